"""What one strategy's run measured, and the figures derived from it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hdrh.histogram import HdrHistogram

from ..core.batching import BatchStats
from .meter import Usage
from .scenario import Scenario

HELD, REJECTED, REPLAYED, ERROR = "held", "rejected", "replayed", "error"
# Latencies are recorded in microseconds, from 1 us to 10 minutes, 3 significant digits.
_LOWEST_US, _HIGHEST_US, _DIGITS = 1, 600_000_000, 3
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


@dataclass(frozen=True)
class Sample:
    """One reserve call: when it started and ended (seconds since the run began) and its outcome."""

    seq: int
    start: float
    end: float
    outcome: str
    units: int

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1000.0


@dataclass(frozen=True)
class DbSnapshot:
    """The database's own counters at one moment."""

    pool_dead_tuples: int
    pool_live_tuples: int
    pool_deleted: int
    pool_vacuums: int
    deadlocks: int
    xact_commit: int
    xact_rollback: int


@dataclass(frozen=True)
class Ledger:
    """The tenant's books after the run, read from the database."""

    on_hand: int
    free: int
    pool: int
    held: int
    restored: int
    reservations: int
    shortfall: int


# A run whose errors exceed this share of its requests does not measure holds.
FAILED_SHARE = 0.01


@dataclass
class RunResult:
    """Everything one strategy's run recorded; figures are derived on demand."""

    strategy: str
    scenario: Scenario
    samples: list[Sample]
    elapsed_s: float
    claimed: int = 0
    claimed_units: int = 0
    released: int = 0
    followup_errors: int = 0
    error_kinds: Counter[str] = field(default_factory=Counter)
    ledger: Ledger | None = None
    violations: list[str] = field(default_factory=list)
    db_before: DbSnapshot | None = None
    db_after: DbSnapshot | None = None
    client_stats: dict[str, int] = field(default_factory=dict)
    peak_pool_dead_tuples: int | None = None
    target: str = "library"  # how the buyers reached the service: "library" or "http"
    background_refills: int | None = None  # pool runs: refills by the background replenisher
    background_refilled_units: int | None = None
    batching: bool | None = True
    """The buyers' ReservationService batched (group commit) or not; None: a running
    service's own setting (--url)."""
    t0: float = 0.0  # perf_counter at the buyers' start
    batch: BatchStats | None = None  # the buyers' combiner(s), batched runs
    usage: Usage | None = None  # server and client CPU, WAL

    @property
    def mode(self) -> str:
        """"batched", "unbatched", or "service" (a running service's own setting)."""
        return "service" if self.batching is None else \
            "batched" if self.batching else "unbatched"

    @property
    def label(self) -> str:
        return f"{self.strategy} {self.mode}"

    def batch_sizes(self) -> dict[str, int] | None:
        """Batch size at p50/p90/p99 over requests sent through the combiner (reserves,
        claims, releases); None when nothing was batched."""
        stats = self.batch
        if stats is None or not stats.requests:
            return None
        return {k: stats.percentile(p) for k, p in (("p50", 50.0), ("p90", 90.0),
                                                     ("p99", 99.0))} | {"max": max(stats.sizes)}

    # -- counts ----------------------------------------------------------------

    def count(self, outcome: str) -> int:
        return sum(1 for s in self.samples if s.outcome == outcome)

    @property
    def requests(self) -> int:
        return len(self.samples)

    @property
    def held(self) -> int:
        return self.count(HELD)

    @property
    def rejected(self) -> int:
        return self.count(REJECTED)

    @property
    def retries(self) -> int:
        return self.count(REPLAYED)

    @property
    def errors(self) -> int:
        return self.count(ERROR) + self.followup_errors

    @property
    def granted_units(self) -> int:
        return sum(s.units for s in self.samples if s.outcome == HELD)

    # -- throughput --------------------------------------------------------------

    @property
    def sellout_s(self) -> float | None:
        """When the last hold completed: the end of the selling window."""
        ends = [s.end for s in self.samples if s.outcome == HELD]
        return max(ends) if ends else None

    @property
    def end_s(self) -> float:
        return max((s.end for s in self.samples), default=0.0)

    @property
    def reservations_per_s(self) -> float | None:
        """Holds granted / time from the start until the last hold."""
        sellout = self.sellout_s
        return self.held / sellout if sellout else None

    @property
    def rejections_after_sellout(self) -> int:
        sellout = self.sellout_s or 0.0
        return sum(1 for s in self.samples if s.outcome == REJECTED and s.end > sellout)

    @property
    def rejection_window_s(self) -> float:
        return self.end_s - (self.sellout_s or 0.0)

    @property
    def rejections_per_s(self) -> float | None:
        """Rejections completed after the last hold / the time from the last hold to the end."""
        window = self.rejection_window_s
        count = self.rejections_after_sellout
        return count / window if count and window > 0 else None

    # -- latency ---------------------------------------------------------------

    def histogram(self, outcomes: tuple[str, ...] = (HELD, REJECTED, REPLAYED)) -> HdrHistogram:
        hist = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
        for s in self.samples:
            if s.outcome in outcomes:
                hist.record_value(_us(s))
        return hist

    def latency_ms(
            self, outcomes: tuple[str, ...] = (HELD, REJECTED, REPLAYED)) -> dict[str, float]:
        hist = self.histogram(outcomes)
        if hist.get_total_count() == 0:
            return {**dict.fromkeys(PERCENTILES, 0.0), "max": 0.0}
        doc = {k: hist.get_value_at_percentile(p) / 1000.0 for k, p in PERCENTILES.items()}
        doc["max"] = hist.get_max_value() / 1000.0
        return doc

    def take_windows(self) -> dict[str, Any]:
        """p99 latency of the first and the last `window` holds, in the order they started."""
        holds = sorted((s for s in self.samples if s.outcome == HELD), key=lambda s: s.start)
        size = min(self.scenario.window, len(holds) // 2)
        if size == 0:
            return {"window": 0, "first_p99_ms": None, "last_p99_ms": None, "ratio": None}
        first, last = _p99_ms(holds[:size]), _p99_ms(holds[-size:])
        return {"window": size, "takes": len(holds), "first_p99_ms": first,
                "last_p99_ms": last, "ratio": last / first if first else None}

    # -- invariants --------------------------------------------------------------

    @property
    def oversold(self) -> int:
        """Units granted beyond what was ever there to sell (seeded plus units given back)."""
        restored = self.ledger.restored if self.ledger else 0
        return max(0, self.granted_units - restored - self.scenario.seeded_units)

    def invariants(self) -> dict[str, bool]:
        """Each accounting rule the run must keep."""
        book = self.ledger
        seeded = self.scenario.seeded_units
        if book is None:
            return {"checked": False}
        available = book.free + book.pool
        return {
            # units sold + held + available = units seeded
            "conservation": self.claimed_units + book.held + available == seeded,
            "on_hand": book.on_hand == seeded - self.claimed_units,
            "no_oversell": self.oversold == 0,
            # every hold the buyers were told about exists, and no other
            "holds_match": book.reservations == self.held,
            "no_shortfall": book.shortfall == 0,
            "service_invariants": not self.violations,
        }

    @property
    def invariants_ok(self) -> bool:
        return all(self.invariants().values())

    @property
    def measures(self) -> bool:
        """Whether its rates measure holds: its invariants held and at most 1% of its
        requests (claims and releases included) ended in an error, as `bench http`
        asks of a run (a run that mostly failed looked fast)."""
        return self.invariants_ok and self.errors <= FAILED_SHARE * max(1, self.requests)

    # -- the database's view ---------------------------------------------------

    def db_view(self) -> dict[str, Any]:
        doc: dict[str, Any] = dict(self.client_stats)
        before, after = self.db_before, self.db_after
        if before is not None:
            doc["pool_dead_tuples_before"] = before.pool_dead_tuples
        if after is not None:
            doc["pool_dead_tuples_after"] = after.pool_dead_tuples
            doc["pool_live_tuples_after"] = after.pool_live_tuples
        if before is not None and after is not None:
            doc["deadlocks"] = after.deadlocks - before.deadlocks
            doc["xact_commit"] = after.xact_commit - before.xact_commit
            doc["xact_rollback"] = after.xact_rollback - before.xact_rollback
            doc["pool_rows_deleted"] = after.pool_deleted - before.pool_deleted
            doc["pool_vacuums"] = after.pool_vacuums - before.pool_vacuums
        if self.peak_pool_dead_tuples is not None:
            doc["pool_dead_tuples_peak"] = self.peak_pool_dead_tuples
        if self.background_refills is not None:
            doc["background_refills"] = self.background_refills
            doc["background_refilled_units"] = self.background_refilled_units
        return doc

    def to_dict(self) -> dict[str, Any]:
        book = self.ledger
        return {
            "strategy": self.strategy,
            "batching": self.batching,
            "target": self.target,
            "requests": self.requests,
            "held": self.held,
            "rejected": self.rejected,
            "errors": self.errors,
            "retries": self.retries,
            "granted_units": self.granted_units,
            "claimed": self.claimed,
            "released": self.released,
            "reservations_per_s": self.reservations_per_s,
            "rejections_per_s": self.rejections_per_s,
            "throughput": {
                "holds": self.held,
                "hold_window_s": self.sellout_s,
                "rejections_after_sellout": self.rejections_after_sellout,
                "rejection_window_s": self.rejection_window_s,
                "elapsed_s": self.elapsed_s,
            },
            "oversold": self.oversold,
            "invariants_ok": self.invariants_ok,
            "invariants": self.invariants(),
            "violations": list(self.violations),
            "books": None if book is None else {
                "seeded": self.scenario.seeded_units, "sold": self.claimed_units,
                "held": book.held, "available": book.free + book.pool, "pool": book.pool,
                "on_hand": book.on_hand, "restored": book.restored,
            },
            "latency_ms": self.latency_ms(),
            "latency_ms_by_outcome": {
                HELD: self.latency_ms((HELD,)), REJECTED: self.latency_ms((REJECTED,)),
            },
            "take_latency_climb": self.take_windows(),
            "error_kinds": dict(self.error_kinds),
            "db": self.db_view(),
            "batch_sizes": self.batch_sizes(),
            "batches": None if self.batch is None else {
                "batches": self.batch.batches, "requests": self.batch.requests,
                "splits": self.batch.splits, "busy": self.batch.busy,
                "requests_per_batch": self.batch.requests / self.batch.batches
                if self.batch.batches else None},
            "resources": None if self.usage is None else self.usage.to_dict(self.held),
        }


class Rated(Protocol):
    """What ratios() reads of a run (a RunResult, or a server bench's ServerRun)."""

    @property
    def strategy(self) -> str: ...

    @property
    def reservations_per_s(self) -> float | None: ...

    @property
    def rejections_per_s(self) -> float | None: ...


def ratios(runs: Sequence[Rated]) -> dict[str, float | None]:
    """pool/row reservations per second, and each strategy's rejections/s over reservations/s.

    Flash-sale runs (they have `batching`) are named by strategy and mode: batched
    over unbatched holds/s and p99 latency per strategy, and the sold-out rate over
    each mode's hold rate; `pool_over_row_reservations_per_s` compares the batched
    runs only (absent without them), the unbatched ones are under
    `pool_over_row_unbatched_reservations_per_s`."""
    out: dict[str, float | None] = {}
    if not all(hasattr(r, "batching") for r in runs):
        by = {r.strategy: r for r in runs}
        row_, pool_ = by.get("row"), by.get("pool")
        if row_ and pool_:
            out["pool_over_row_reservations_per_s"] = _ratio(pool_.reservations_per_s,
                                                            row_.reservations_per_s)
        for run in runs:
            out[f"{run.strategy}_rejections_over_reservations_per_s"] = _ratio(
                run.rejections_per_s, run.reservations_per_s)
        return out
    flash = [r for r in runs if isinstance(r, RunResult)]
    modes = {(r.strategy, r.mode): r for r in flash}

    def measured(a: float | None, b: float | None, *of: RunResult) -> float | None:
        # (a run that does not measure holds gives no ratio: null, its figures stay
        # in its own entry)
        return _ratio(a, b) if all(r.measures for r in of) else None

    mode_order = [m for m in ("batched", "service", "unbatched")
                  if any(r.mode == m for r in flash)]
    for mode in mode_order:
        row, pool = modes.get(("row", mode)), modes.get(("pool", mode))
        if row and pool:
            # the bare name is the batched runs' figure only, never another mode's
            name = "pool_over_row_reservations_per_s" if mode == "batched" \
                else f"pool_over_row_{mode}_reservations_per_s"
            out[name] = measured(pool.reservations_per_s, row.reservations_per_s, pool, row)
    for strategy in dict.fromkeys(r.strategy for r in flash):
        on, off = modes.get((strategy, "batched")), modes.get((strategy, "unbatched"))
        if on and off:
            out[f"{strategy}_batched_over_unbatched_reservations_per_s"] = measured(
                on.reservations_per_s, off.reservations_per_s, on, off)
            out[f"{strategy}_batched_over_unbatched_p99_latency"] = measured(
                on.latency_ms()["p99"], off.latency_ms()["p99"], on, off)
        for mode in mode_order:
            one = modes.get((strategy, mode))
            if one is not None:
                out[f"{strategy}_{mode}_rejections_over_reservations_per_s"] = measured(
                    one.rejections_per_s, one.reservations_per_s, one)
    return out


def comparison(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per strategy, the batched and the unbatched run side by side (what --json calls
    `comparison`): holds/s, sold-out answers/s, p99 latency and their ratios."""
    out = []
    for strategy in dict.fromkeys(r.strategy for r in runs):
        doc: dict[str, Any] = {"strategy": strategy}
        for run in (r for r in runs if r.strategy == strategy):
            doc[run.mode] = {"reservations_per_s": run.reservations_per_s,
                             "rejections_per_s": run.rejections_per_s,
                             "p99_ms": run.latency_ms()["p99"],
                             "held_p99_ms": run.latency_ms((HELD,))["p99"],
                             "batch_sizes": run.batch_sizes()}
        measured = {r.mode for r in runs if r.strategy == strategy and r.measures}
        on, off = doc.get("batched"), doc.get("unbatched")
        # (null from a run that does not measure holds)
        if on and off:
            both = {"batched", "unbatched"} <= measured
            doc["batched_over_unbatched_reservations_per_s"] = _ratio(
                on["reservations_per_s"], off["reservations_per_s"]) if both else None
            doc["batched_over_unbatched_p99"] = _ratio(
                on["p99_ms"], off["p99_ms"]) if both else None
        if on:
            doc["rejections_over_batched_reservations_per_s"] = _ratio(
                on["rejections_per_s"], on["reservations_per_s"]) \
                if "batched" in measured else None
        out.append(doc)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None



def _us(sample: Sample) -> int:
    return max(_LOWEST_US, min(_HIGHEST_US, int((sample.end - sample.start) * 1_000_000)))


def _p99_ms(samples: list[Sample]) -> float:
    hist = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
    for s in samples:
        hist.record_value(_us(s))
    return float(hist.get_value_at_percentile(99.0)) / 1000.0
