"""Prometheus metrics of the service, the workers, the sampler and the bloat monitor.

Multi-process safe: with PROMETHEUS_MULTIPROC_DIR set (before prometheus_client
is imported; `pgreserve serve --workers N` sets it), every process writes its
values to files there and /metrics aggregates them (prometheus_client
multiprocess mode). Gauges then report the most recent value of any process.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Database events that are also reserve outcomes (see Database._emit).
_RESERVE_EVENTS = {"deadlock_retried", "busy", "unknown_outcome_resolved", "unknown_outcome"}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class OpsMetrics:
    """Every metric of one process, in its own registry (tests build several apps)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        g: dict[str, Any] = {"registry": r, "multiprocess_mode": "mostrecent"}
        self.reservations = Counter(
            "pgreserve_reservations", "Reserve calls by outcome: held, sold_out, frozen, "
            "idempotent_replay, idempotency_key_reused, busy, deadlock_retried, "
            "unknown_outcome_resolved, ...", ["outcome"], registry=r)
        self.operations = Counter(
            "pgreserve_operations", "Claims, releases, extends and sweeps by outcome",
            ["operation", "outcome"], registry=r)
        self.claims = Counter("pgreserve_claims", "Successful claims (sales)", registry=r)
        self.releases = Counter("pgreserve_releases", "Successful releases", registry=r)
        self.expiries = Counter("pgreserve_expiries", "Reservations expired by the sweeper",
                                registry=r)
        self.db_events = Counter("pgreserve_db_events", "Retries, busy answers and lost "
                                 "connections seen by the retry loop", ["action", "event"],
                                 registry=r)
        self.refills = Counter("pgreserve_pool_refills", "Pool refills done by the background "
                               "replenisher of this process", ["mode"], registry=r)
        self.refill_units = Counter("pgreserve_pool_refill_units", "Units added to pools by "
                                    "the background replenisher", registry=r)
        self.db_refills = Gauge("pgreserve_db_pool_refills", "Pool refills by mode, "
                                "database-wide since the statistics reset "
                                "(pg_stat_user_functions; needs track_functions)", ["mode"], **g)
        self.latency = Histogram("pgreserve_operation_seconds", "Latency per operation",
                                 ["operation"], buckets=LATENCY_BUCKETS, registry=r)
        self.pool_units = Gauge("pgreserve_pool_units", "Pool rows of the hot buckets",
                                ["tenant", "sku", "location"], **g)
        self.held_units = Gauge("pgreserve_held_units", "Held units of the hot buckets",
                                ["tenant", "sku", "location"], **g)
        self.holds = Gauge("pgreserve_reservations_by_state", "Reservations by state "
                           "(overdue: active past expiry, not yet swept)", ["state"], **g)
        self.conn_seconds = Counter("pgreserve_connection_seconds", "Connection-seconds by "
                                    "application_name and state (hold-time sampler)",
                                    ["application_name", "state"], registry=r)
        self.backends = Gauge("pgreserve_backends", "Backends by application_name and state "
                              "at the last sample", ["application_name", "state"], **g)
        self.oldest_xact = Gauge("pgreserve_oldest_transaction_seconds", "Age of the oldest "
                                 "open transaction at the last sample", **g)
        self.idle_in_xact = Gauge("pgreserve_idle_in_transaction_sessions", "Sessions idle in "
                                  "transaction, by application_name", ["application_name"], **g)
        self.idle_in_xact_max = Gauge("pgreserve_idle_in_transaction_max_seconds", "Longest "
                                      "idle in transaction, by application_name",
                                      ["application_name"], **g)
        self.pool_stat = Gauge("pgreserve_client_pool", "psycopg_pool statistics (pool_size, "
                               "requests_waiting, requests_wait_ms, usage_ms, connections_lost, "
                               "...) per pool", ["pool", "stat"], **g)
        self.dead_tuples = Gauge("pgreserve_partition_dead_tuples", "Dead tuples per pool "
                                 "partition", ["partition"], **g)
        self.live_tuples = Gauge("pgreserve_partition_live_tuples", "Live tuples per pool "
                                 "partition", ["partition"], **g)
        self.dead_pct = Gauge("pgreserve_partition_dead_percent", "% dead tuples per pool "
                              "partition", ["partition"], **g)
        self.bloat_warning = Gauge("pgreserve_partition_bloat_warning", "1 when % dead stayed "
                                   "above the threshold for the whole window", ["partition"], **g)
        self.last_autovacuum = Gauge("pgreserve_partition_last_autovacuum_timestamp",
                                     "Unix time of the last autovacuum per pool partition",
                                     ["partition"], **g)
        self.freezes = Gauge("pgreserve_freezes", "Live freezes of new reservations by "
                             "tenant and scope (bucket: frozen buckets, tenant: 1 when the "
                             "whole tenant is frozen)", ["tenant", "scope"], **g)
        self.xid_age = Gauge("pgreserve_database_xid_age", "age(datfrozenxid) of the database",
                             **g)
        self.recent_errors: deque[dict[str, str]] = deque(maxlen=50)
        self._seen_idle: set[str] = set()

    # -- hooks -------------------------------------------------------------------

    def operation(self, action: str, outcome: str, seconds: float) -> None:
        """ServiceObserver: one service operation finished."""
        self.latency.labels(action).observe(seconds)
        if action == "reserve":
            self.reservations.labels(outcome).inc()
        elif action == "refill":
            if outcome.isdigit() and int(outcome) > 0:
                self.refilled(int(outcome))
            return
        elif action == "expire_due":
            n = int(outcome) if outcome.isdigit() else 0
            if n:
                self.expiries.inc(n)
            self.operations.labels(action, "ok").inc()
            return
        else:
            self.operations.labels(action, outcome).inc()
            if outcome == "ok" and action == "claim":
                self.claims.inc()
            elif outcome == "ok" and action == "release":
                self.releases.inc()
        if outcome not in ("ok", "held", "sold_out", "frozen", "idempotent_replay"):
            self.error(f"{action}: {outcome}")

    def db_event(self, action: str, event: str) -> None:
        """Database observer: a retry, busy answer or lost connection."""
        self.db_events.labels(action, event).inc()
        if action == "reserve" and event in _RESERVE_EVENTS - {"busy"}:
            self.reservations.labels(event).inc()

    def refilled(self, units: int) -> None:
        self.refills.labels("background").inc()
        self.refill_units.inc(units)

    def error(self, text: str) -> None:
        self.recent_errors.appendleft(
            {"at": datetime.now(UTC).isoformat(timespec="seconds"), "error": text})

    def hold_time(self, report: Any, backends: Mapping[tuple[str, str], int],
                  elapsed: float) -> None:
        for (app, state), n in backends.items():
            self.conn_seconds.labels(app, state).inc(n * elapsed)
        self.backends.clear()
        for (app, state), n in backends.items():
            self.backends.labels(app, state).set(n)
        self.oldest_xact.set(report.oldest_xact_seconds)
        counts: dict[str, int] = {}
        longest: dict[str, float] = {}
        for s in report.idle_in_transaction:
            counts[s.application_name] = counts.get(s.application_name, 0) + 1
            longest[s.application_name] = max(longest.get(s.application_name, 0.0),
                                              s.state_seconds or 0.0)
        for app in self._seen_idle - set(counts):
            self.idle_in_xact.labels(app).set(0)
            self.idle_in_xact_max.labels(app).set(0)
        for app, n in counts.items():
            self.idle_in_xact.labels(app).set(n)
            self.idle_in_xact_max.labels(app).set(longest[app])
        self._seen_idle |= set(counts)

    def bloat(self, report: Any) -> None:
        for p in report.partitions:
            self.dead_tuples.labels(p.name).set(p.dead)
            self.live_tuples.labels(p.name).set(p.live)
            self.dead_pct.labels(p.name).set(p.dead_pct)
            self.bloat_warning.labels(p.name).set(1 if p.state == "warning" else 0)
            if p.last_autovacuum is not None:
                self.last_autovacuum.labels(p.name).set(p.last_autovacuum.timestamp())
        self.xid_age.set(report.xid_age)

    def pool_stats(self, stats: Mapping[str, Mapping[str, int]]) -> None:
        for pool, values in stats.items():
            for stat, value in values.items():
                self.pool_stat.labels(pool, stat).set(value)

    def figures(self, fig: Any) -> None:
        self.db_refills.labels("inline").set(fig.refills_inline)
        self.db_refills.labels("background").set(fig.refills_background)
        self.pool_units.clear()
        self.held_units.clear()
        for b in fig.hot_buckets:
            self.pool_units.labels(b.tenant, b.sku, b.location).set(b.pool)
            self.held_units.labels(b.tenant, b.sku, b.location).set(b.held)
        for state in ("active", "overdue", "claimed", "released", "expired"):
            self.holds.labels(state).set(fig.holds.get(state, 0))
        counts: dict[tuple[str, str], int] = {}
        for f in fig.frozen:
            counts[(f["tenant"], f["scope"])] = counts.get((f["tenant"], f["scope"]), 0) + 1
        self.freezes.clear()
        for (tenant, scope), n in counts.items():
            self.freezes.labels(tenant, scope).set(n)

    def render(self) -> bytes:
        """The Prometheus text: this registry, or every process's files in multiprocess mode."""
        path = multiprocess_dir()
        if path:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=path)
            return generate_latest(registry)
        return generate_latest(self.registry)
