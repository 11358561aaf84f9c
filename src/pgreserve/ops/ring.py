"""The last minutes of the service's figures, one point a second, for the live /ops page.

A worker (run_forever) in the process that serves the ops listener. Each round
reads what this process already has: the counters and the HTTP latency
histogram (every process's, in multiprocess mode), the hold-time sampler's and
the bloat monitor's last reports; every `buckets_every` rounds it also reads
the hot buckets' pool levels from the database (one query). Nothing here is on
a request's path.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import multiprocess
from prometheus_client.metrics_core import Metric

from ..db.database import Database, Op
from ..db.queries import queries
from ..workers.base import LoopConfig
from .metrics import OpsMetrics, multiprocess_dir

HOT_BUCKETS = Op("ops", "ring_hot_buckets", "ops/ring")

# The request whose p99 the page charts: the hot one.
RESERVE_ROUTE = ("POST", "/v1/reservations")
DURATION_BUCKET = "pgreserve_http_request_duration_seconds_bucket"


@dataclass(frozen=True)
class RingConfig:
    points: int = 300  # five minutes at one a second
    buckets_every: int = 5  # rounds between two reads of the hot buckets' pool levels
    hot: int = 5  # hot buckets charted
    p99_window: int = 5  # rounds the p99 is computed over
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(interval_s=1.0))

    def __post_init__(self) -> None:
        if not (2 <= self.points <= 100_000 and self.buckets_every >= 1 and self.hot >= 1
                and self.p99_window >= 1):
            raise ValueError("points >= 2, buckets_every >= 1, hot >= 1, p99_window >= 1")


@dataclass(frozen=True)
class Totals:
    """Running totals read in one round."""

    at: float
    held: float
    sold_out: float
    claims: float
    reserve_buckets: dict[float, float]  # le -> cumulative count, POST /v1/reservations
    busy_seconds: dict[str, float]  # application_name -> connection-seconds not idle


def quantile(q: float, before: Mapping[float, float], after: Mapping[float, float]) -> float | None:
    """The q-quantile of the observations between two readings of cumulative buckets
    (linear inside a bucket, as PromQL's histogram_quantile); None without observations."""
    bounds = sorted(after)
    deltas = [after[b] - before.get(b, 0.0) for b in bounds]
    if not deltas or deltas[-1] <= 0:
        return None
    rank = q * deltas[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, deltas, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            span = count - below
            return lower + (bound - lower) * ((rank - below) / span if span > 0 else 1.0)
        lower, below = bound, count
    return lower


def _families(metrics: OpsMetrics) -> Iterable[Metric]:
    path = multiprocess_dir()
    if path:  # every process's files: the API workers count, this process charts
        found: Iterable[Metric] = multiprocess.MultiProcessCollector(None, path=path).collect()
        return found
    own: list[Metric] = [*metrics.reservations.collect(), *metrics.claims.collect()]
    duration = getattr(metrics, "http_duration", None)
    if duration is not None:
        own.extend(duration.collect())
    return own


class RecentFigures:
    """A ring of per-second points; `as_json()` is what /ops/series.json serves."""

    name = "ops-ring"

    def __init__(self, metrics: OpsMetrics, state: Any, db: Database | None = None,
                 config: RingConfig | None = None) -> None:
        self.metrics = metrics
        self.state = state  # where the monitors leave themselves (sampler, bloat)
        self.db = db
        self.config = config or RingConfig()
        self.loop_config = self.config.loop
        self.points: deque[dict[str, Any]] = deque(maxlen=self.config.points)
        self._totals: deque[Totals] = deque(maxlen=self.config.p99_window + 1)
        self._pools: dict[str, int] = {}
        self._rounds = 0

    def read_totals(self) -> Totals:
        held = sold_out = claims = 0.0
        buckets: dict[float, float] = {}
        for family in _families(self.metrics):
            for s in family.samples:
                if s.name == "pgreserve_reservations_total":
                    outcome = s.labels.get("outcome")
                    if outcome == "held":
                        held += s.value
                    elif outcome == "sold_out":
                        sold_out += s.value
                elif s.name == "pgreserve_claims_total":
                    claims += s.value
                elif (s.name == DURATION_BUCKET
                      and (s.labels.get("method"), s.labels.get("route")) == RESERVE_ROUTE):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
        busy: dict[str, float] = {}
        sampler = getattr(self.state, "sampler", None)
        if sampler is not None:
            # every caller seen, with its connection-seconds outside `idle`
            for (app, state), seconds in sampler.report.connection_seconds.items():
                busy[app] = busy.get(app, 0.0) + (seconds if state != "idle" else 0.0)
        return Totals(time.time(), held, sold_out, claims, buckets, busy)

    async def read_pools(self) -> None:
        if self.db is None:
            return
        rows = await self.db.fetch(queries["bucket_hot_list"], (self.config.hot,),
                                   op=HOT_BUCKETS)
        # (tenant, sku, location) -> pool rows, for the pool-strategy buckets
        self._pools = {f"{r[1]}/{r[2]}@{r[3]}": int(r[8]) for r in rows if r[4] == "pool"}

    def dead_ratios(self) -> dict[str, float]:
        bloat = getattr(self.state, "bloat", None)
        if bloat is None:
            return {}
        return {p.name: round(p.dead / (p.live + p.dead), 4) if p.live + p.dead else 0.0
                for p in bloat.report.partitions}

    async def run_once(self) -> int:
        if self._rounds % self.config.buckets_every == 0:
            await self.read_pools()
        self._rounds += 1
        now = self.read_totals()
        last = self._totals[-1] if self._totals else None
        first = self._totals[0] if self._totals else None
        self._totals.append(now)
        if last is None or first is None:
            return 0  # rates need two readings
        dt = max(now.at - last.at, 1e-6)
        self.points.append({
            "t": round(now.at, 3),
            "holds_per_s": round((now.held - last.held) / dt, 3),
            "sold_out_per_s": round((now.sold_out - last.sold_out) / dt, 3),
            "claims_per_s": round((now.claims - last.claims) / dt, 3),
            "reserve_p99_seconds": quantile(0.99, first.reserve_buckets, now.reserve_buckets),
            "pool_units": dict(self._pools),
            "dead_tuple_ratio": self.dead_ratios(),
            "connection_seconds_per_s": {
                app: round((secs - last.busy_seconds.get(app, 0.0)) / dt, 3)
                for app, secs in now.busy_seconds.items()},
        })
        return 0  # one point per interval

    def as_json(self) -> dict[str, Any]:
        return {"interval_seconds": self.loop_config.interval_s, "points": list(self.points)}
