"""The comparison of the two stores' answers: recorded in a table and in metrics.

Each request served by both stores (modes `shadow` and `primary`) becomes one
row of `rollout_comparison`: both outcomes, both latencies, and whether they
agree. Rows are written in batches off the request path (`Recorder.flush`,
every `flush_every_s`); the metrics move at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter as Tally
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .. import errors
from ..db.database import Database, Op, deadline_at
from ..db.queries import queries
from ..domain import Reservation, ReserveOutcome

log = logging.getLogger(__name__)

OP_RECORD = Op("rollout", "rollout_comparison_record", "rollout/compare")
OP_TRAFFIC = Op("rollout", "rollout_traffic_add", "rollout/compare")


def reserve_outcome(outcome: ReserveOutcome) -> dict[str, Any]:
    """What is compared of a reserve: held or not, and which lines were short."""
    if outcome.held:
        return {"held": True}
    return {"held": False,
            "short": sorted([s.sku, s.location, s.requested] for s in outcome.short_lines),
            "available": sorted([s.sku, s.location, s.available] for s in outcome.short_lines)}


def transition_outcome(reservation: Reservation) -> dict[str, Any]:
    """What is compared of a claim or release: the status it left."""
    return {"status": reservation.status.value}


def error_outcome(exc: BaseException) -> dict[str, Any]:
    code = exc.code if isinstance(exc, errors.PgReserveError) else type(exc).__name__
    return {"error": code, "message": str(exc)[:500]}


def agree(legacy: dict[str, Any], pgreserve: dict[str, Any]) -> bool:
    """Same answer: held in both, short on the same lines, the same status or error code.

    The available counts of short lines are recorded, not compared: an expired
    hold not given back yet counts in one store and not in the other."""
    if "error" in legacy or "error" in pgreserve:
        return legacy.get("error") == pgreserve.get("error")
    strip = {"available", "message"}
    return ({k: v for k, v in legacy.items() if k not in strip}
            == {k: v for k, v in pgreserve.items() if k not in strip})


# The legacy outcome of a finish in primary of a hold Redis has no record of.
MISSING_IN_REDIS = "missing_in_redis"
# The legacy outcomes (errors) of writes Redis missed in primary.
REDIS_MISSED = ("outcome_unknown", MISSING_IN_REDIS)


@dataclass(frozen=True)
class Comparison:
    tenant: int
    mode: str
    operation: str
    request_key: str
    legacy: dict[str, Any]
    pgreserve: dict[str, Any]
    legacy_ms: float
    pgreserve_ms: float
    at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def agree(self) -> bool:
        return agree(self.legacy, self.pgreserve)

    @property
    def redis_missed(self) -> bool:
        """A write pgreserve served in primary that Redis did not answer, or of a hold
        Redis had no record of: what refuses going back to legacy (the same rule as
        the query rollout_redis_miss_list)."""
        return self.mode == "primary" and self.legacy.get("error") in REDIS_MISSED


class RolloutMetrics:
    """Agreement and per-side latency; in the app's registry when given one."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.comparisons = Counter(
            "pgreserve_rollout_comparisons", "Requests served by both stores, by result "
            "(agree, disagree)", ["tenant", "operation", "result"], registry=r)
        self.agreement = Gauge(
            "pgreserve_rollout_agreement_ratio", "Agreeing answers / compared answers "
            "since this process started", ["tenant"], registry=r,
            multiprocess_mode="mostrecent")
        self.latency = Histogram(
            "pgreserve_rollout_latency_seconds", "Latency of each store's answer",
            ["side", "operation"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        self.secondary_failures = Counter(
            "pgreserve_rollout_secondary_failures", "Failures of the store that did not "
            "answer the caller (counted, never returned)", ["side", "operation"], registry=r)
        self.dropped = Counter(
            "pgreserve_rollout_comparisons_dropped", "Comparisons not written to "
            "rollout_comparison (the buffer was full, or the last flush at shutdown "
            "failed): counted in the metrics, missing from `rollout report`", registry=r)
        self._seen: Tally[int] = Tally()
        self._agreed: Tally[int] = Tally()

    def observe(self, c: Comparison) -> None:
        ok = c.agree
        self.comparisons.labels(str(c.tenant), c.operation, "agree" if ok else "disagree").inc()
        self._seen[c.tenant] += 1
        self._agreed[c.tenant] += ok
        self.agreement.labels(str(c.tenant)).set(self._agreed[c.tenant] / self._seen[c.tenant])
        self.latency.labels("legacy", c.operation).observe(c.legacy_ms / 1000)
        self.latency.labels("pgreserve", c.operation).observe(c.pgreserve_ms / 1000)


class Recorder:
    """Buffers comparisons and writes them in batches to `rollout_comparison`."""

    def __init__(self, db: Database, metrics: RolloutMetrics, *,
                 flush_every_s: float = 0.5, max_buffer: int = 100_000) -> None:
        self.db = db
        self.metrics = metrics
        self.flush_every_s = flush_every_s
        self.max_buffer = max_buffer
        self.dropped = 0
        self._rows: list[Comparison] = []
        self._traffic: Tally[int] = Tally()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def add(self, c: Comparison) -> None:
        self.metrics.observe(c)
        if len(self._rows) >= self.max_buffer and not c.redis_missed:
            # the database is not keeping up: keep the metrics only. A write Redis
            # missed is kept whatever the buffer holds: dropped, it would let the
            # tenant go back to legacy, where Redis would sell what pgreserve holds
            self.dropped += 1
            self.metrics.dropped.inc()
            return
        self._rows.append(c)
        self._start()

    def request(self, tenant: int) -> None:
        """Count one request of a tenant that went through the rollout layer."""
        self._traffic[tenant] += 1
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        # Started from inside a request, this task copied that request's deadline:
        # its writes are not that request's and run under none.
        with deadline_at(None):
            while self._rows or self._traffic:
                await asyncio.sleep(self.flush_every_s)
                try:
                    await self.flush()
                except Exception:  # logged; the rows are kept for the next try
                    log.exception("rollout comparisons not written; retrying")

    async def flush(self) -> int:
        """Write what is buffered; return the comparisons written."""
        async with self._lock:
            rows, self._rows = self._rows, []
            traffic, self._traffic = self._traffic, Tally()
            try:
                if traffic:
                    tenants = sorted(traffic)
                    await self.db.fetch(queries["rollout_traffic_add"],
                                        (tenants, [traffic[t] for t in tenants]), op=OP_TRAFFIC)
                if not rows:
                    return 0
                await self.db.fetch(queries["rollout_comparison_record"], (
                    [c.tenant for c in rows], [c.at for c in rows], [c.mode for c in rows],
                    [c.operation for c in rows], [c.request_key for c in rows],
                    [c.agree for c in rows], [json.dumps(c.legacy) for c in rows],
                    [json.dumps(c.pgreserve) for c in rows], [c.legacy_ms for c in rows],
                    [c.pgreserve_ms for c in rows]), op=OP_RECORD)
            except BaseException:
                self._rows[:0] = rows
                self._traffic.update(traffic)
                raise
            return len(rows)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - shutting down: said, counted, not raised
            if not self._rows:  # only the traffic counts (rollout plan's ordering)
                log.warning("rollout: request counts not written at shutdown (%s)", exc)
                return
            missed = sum(c.redis_missed for c in self._rows)
            self.dropped += len(self._rows)
            self.metrics.dropped.inc(len(self._rows))
            log.error("rollout: %d comparisons not written at shutdown (%s), %d of them "
                      "writes Redis missed: `rollout set ... legacy` will not see those; "
                      "count every bucket again in primary before going back", len(self._rows),
                      exc, missed)
