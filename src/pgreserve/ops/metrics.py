"""Prometheus metrics of the service, the workers, the sampler and the bloat monitor.

Multi-process safe: with PROMETHEUS_MULTIPROC_DIR set (before prometheus_client
is imported; `pgreserve serve --workers N` sets it), every process writes its
values to files there and /metrics aggregates them (prometheus_client
multiprocess mode). Gauges then report the most recent value of any process.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# psycopg_pool's get_stats() keys that are levels now: (stat, metric suffix, help).
POOL_GAUGES = (
    ("pool_size", "connections", "Connections the pool has open or is opening"),
    ("pool_available", "idle_connections", "Connections idle in the pool"),
    ("pool_min", "min_connections", "The pool's configured minimum size"),
    ("pool_max", "max_connections", "The pool's configured maximum size"),
    ("requests_waiting", "waiting_requests", "Requests waiting for a connection now"),
)
# Running totals since the pool opened: (stat, metric name, help, scale to base units).
POOL_COUNTERS = (
    ("requests_num", "requests", "Connection requests", 1.0),
    ("requests_queued", "queued_requests", "Connection requests that had to wait", 1.0),
    ("requests_wait_ms", "request_wait_seconds", "Time spent waiting for a connection", 1e-3),
    ("requests_errors", "request_errors", "Connection requests that failed (timeout, ...)",
     1.0),
    ("usage_ms", "usage_seconds", "Time connections were lent out", 1e-3),
    ("returns_bad", "bad_returns", "Connections returned in a bad state", 1.0),
    ("connections_num", "connects", "Connection attempts to the server", 1.0),
    ("connections_ms", "connect_seconds", "Time spent connecting to the server", 1e-3),
    ("connections_errors", "connect_errors", "Failed connection attempts", 1.0),
    ("connections_lost", "connections_lost", "Connections found broken", 1.0),
)

# No `_created` series beside every counter and histogram: nothing here reads
# them, and they double the families a scrape carries.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Database events that are also reserve outcomes (see Database._emit).
_RESERVE_EVENTS = {"deadlock_retried", "busy", "unknown_outcome_resolved", "unknown_outcome"}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class DatabaseRefills:
    """Pool refills by mode, database-wide: a running total PostgreSQL keeps
    (pg_stat_user_functions), exposed as the counter it is, as last read."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "pgreserve_db_pool_refills", "Pool refills by mode, database-wide since the "
            "statistics reset (pg_stat_user_functions; needs track_functions)", labels=["mode"])
        for mode, n in self.counts.items():
            family.add_metric([mode], n)
        yield family


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
        self.recent_errors: deque[dict[str, str]] = deque(maxlen=50)
        self.extra_collectors: list[Collector] = []
        self.db_refills = DatabaseRefills()
        self.register(self.db_refills)
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
        # psycopg_pool's figures, one metric per quantity (connections, requests,
        # seconds): its running totals become counters, increased by what they grew.
        live: dict[str, Any] = {"registry": r, "multiprocess_mode": "livesum"}
        self.pool_gauges = {
            stat: Gauge(f"pgreserve_client_pool_{name}", text, ["pool"], **live)
            for stat, name, text in POOL_GAUGES}
        self.pool_counters = {
            stat: (Counter(f"pgreserve_client_pool_{name}", text, ["pool"], registry=r), scale)
            for stat, name, text, scale in POOL_COUNTERS}
        self._pool_seen: dict[tuple[str, str], float] = {}
        self.dead_tuples = Gauge("pgreserve_partition_dead_tuples", "Dead tuples per pool "
                                 "partition", ["partition"], **g)
        self.live_tuples = Gauge("pgreserve_partition_live_tuples", "Live tuples per pool "
                                 "partition", ["partition"], **g)
        self.dead_ratio = Gauge("pgreserve_partition_dead_tuple_ratio", "Dead tuples over "
                                "live plus dead tuples per pool partition (0 to 1)",
                                ["partition"], **g)
        self.bloat_warning = Gauge("pgreserve_partition_bloat_warning", "1 when % dead stayed "
                                   "above the threshold for the whole window", ["partition"], **g)
        self.last_autovacuum = Gauge("pgreserve_partition_last_autovacuum_timestamp_seconds",
                                     "Unix time of the last autovacuum per pool partition",
                                     ["partition"], **g)
        self.freezes = Gauge("pgreserve_freezes", "Live freezes of new reservations by "
                             "tenant and scope (bucket: frozen buckets, tenant: 1 when the "
                             "whole tenant is frozen)", ["tenant", "scope"], **g)
        self.xid_age = Gauge("pgreserve_database_xid_age", "age(datfrozenxid) of the database",
                             **g)
        self._seen_idle: set[str] = set()
        # children of the two labelled series every operation updates (a handful of
        # actions and outcomes)
        self._latency: dict[str, Any] = {}
        self._reserved: dict[str, Any] = {}

    # -- hooks -------------------------------------------------------------------

    def operation(self, action: str, outcome: str, seconds: float) -> None:
        """ServiceObserver: one service operation finished."""
        latency = self._latency.get(action)
        if latency is None:  # labels() costs more than the observation: one per action
            latency = self._latency[action] = self.latency.labels(action)
        latency.observe(seconds)
        if action == "reserve":
            counter = self._reserved.get(outcome)
            if counter is None:
                counter = self._reserved[outcome] = self.reservations.labels(outcome)
            counter.inc()
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
            self.dead_ratio.labels(p.name).set(p.dead_pct / 100)
            self.bloat_warning.labels(p.name).set(1 if p.state == "warning" else 0)
            if p.last_autovacuum is not None:
                self.last_autovacuum.labels(p.name).set(p.last_autovacuum.timestamp())
        self.xid_age.set(report.xid_age)

    def pool_stats(self, stats: Mapping[str, Mapping[str, int]]) -> None:
        """psycopg_pool's get_stats() of each pool: levels set, running totals added to."""
        for pool, values in stats.items():
            for stat, gauge in self.pool_gauges.items():
                if stat in values:
                    gauge.labels(pool).set(values[stat])
            for stat, (counter, scale) in self.pool_counters.items():
                if stat not in values:
                    continue
                total = values[stat] * scale
                grown = total - self._pool_seen.get((pool, stat), 0.0)
                self._pool_seen[(pool, stat)] = total
                if grown > 0:
                    counter.labels(pool).inc(grown)

    def register(self, collector: Collector) -> None:
        """Add a collector (PgBouncer's figures, say) to what /metrics exposes."""
        self.registry.register(collector)
        self.extra_collectors.append(collector)

    def figures(self, fig: Any) -> None:
        self.db_refills.counts = {"inline": fig.refills_inline,
                                  "background": fig.refills_background}
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
            registry.register(_WithOwnGauges(multiprocess.MultiProcessCollector(None, path=path),
                                             self.registry, self.extra_collectors))
            for collector in self.extra_collectors:
                registry.register(collector)
            return generate_latest(registry)
        return generate_latest(self.registry)


class _WithOwnGauges:
    """The workers' figures from the multiprocess files, with this process's own gauges
    where the files have no sample of them. Under `serve --workers N` the parent runs the
    monitors (hold time, bloat, the ops figures, PgBouncer): their gauges live in its
    memory, not in a file, and the files only hold the workers' empty copies of them."""

    def __init__(self, files: Any, own: CollectorRegistry, extra: list[Collector]) -> None:
        self.files = files
        self.own = own
        self.extra = extra

    def collect(self) -> Any:
        # (the extra collectors are exposed on their own: not twice)
        theirs = {family.name for collector in self.extra for family in collector.collect()}
        own = {family.name: family for family in self.own.collect()
               if family.type == "gauge" and family.samples and family.name not in theirs}
        for family in self.files.collect():
            mine = own.pop(family.name, None)
            if mine is not None and not family.samples:
                family.samples = mine.samples
            yield family
        yield from own.values()
