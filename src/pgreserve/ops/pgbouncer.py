"""PgBouncer's pool figures (`SHOW POOLS`, `SHOW STATS` on its admin console).

Connection exhaustion shows first in the pooler: `cl_waiting` clients queued for
a server connection, and `maxwait`, how long the oldest of them has waited.
`read_pgbouncer` (sync, for doctor) and `PgBouncerMonitor` (async, Prometheus
gauges on a given registry) read the same figures.

The admin console speaks the simple query protocol only and has no
transactions: the connection is autocommit with prepared statements off, its
cursors bind on the client (psycopg's ClientCursor, which sends a query without
parameters as a simple query), and the commands carry no parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, Gauge

from ..db.queries import queries

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5


@dataclass(frozen=True)
class PoolFigures:
    """One row of SHOW POOLS: a (database, user) pool."""

    database: str
    user: str
    clients_active: int
    clients_waiting: int
    servers_active: int
    servers_idle: int
    max_wait_s: float
    pool_mode: str


@dataclass(frozen=True)
class DatabaseStats:
    """One row of SHOW STATS (averages over PgBouncer's last stats_period)."""

    database: str
    avg_wait_s: float
    avg_xact_s: float
    avg_xact_count: int


@dataclass(frozen=True)
class PgBouncerReport:
    pools: tuple[PoolFigures, ...] = ()
    stats: tuple[DatabaseStats, ...] = field(default=())

    @property
    def waiting(self) -> tuple[PoolFigures, ...]:
        """The pools with clients waiting for a server connection."""
        return tuple(p for p in self.pools if p.clients_waiting > 0)

    def as_json(self) -> dict[str, Any]:
        return {"pools": [p.__dict__ for p in self.pools],
                "stats": [s.__dict__ for s in self.stats]}


def _rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any],
          rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    names = [c.name for c in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in rows]


def _int(doc: dict[str, Any], name: str) -> int:
    value = doc.get(name)
    return int(value) if value is not None else 0


def parse(pools: list[dict[str, Any]], stats: list[dict[str, Any]]) -> PgBouncerReport:
    """The report from SHOW POOLS and SHOW STATS rows (columns by name: they vary by version)."""
    return PgBouncerReport(
        tuple(PoolFigures(
            str(p.get("database")), str(p.get("user")), _int(p, "cl_active"),
            _int(p, "cl_waiting"), _int(p, "sv_active"), _int(p, "sv_idle"),
            _int(p, "maxwait") + _int(p, "maxwait_us") / 1e6, str(p.get("pool_mode") or ""))
            for p in pools),
        tuple(DatabaseStats(str(s.get("database")), _int(s, "avg_wait_time") / 1e6,
                            _int(s, "avg_xact_time") / 1e6, _int(s, "avg_xact_count"))
              for s in stats))


def _connect_kwargs() -> dict[str, Any]:
    return {"autocommit": True, "prepare_threshold": None,
            "connect_timeout": CONNECT_TIMEOUT_S, "application_name": "pgreserve:pgbouncer"}


def read_pgbouncer(admin_url: str) -> PgBouncerReport:
    """SHOW POOLS and SHOW STATS, read once (for doctor)."""
    with psycopg.connect(admin_url, cursor_factory=psycopg.ClientCursor,
                         **_connect_kwargs()) as conn:
        cur = conn.execute(queries["pgbouncer_pool_list"])
        pools = _rows(cur, cur.fetchall())
        cur = conn.execute(queries["pgbouncer_stat_list"])
        stats = _rows(cur, cur.fetchall())
    return parse(pools, stats)


class PgBouncerMonitor:
    """Reads PgBouncer's pools on `refresh()` and keeps them as gauges on `registry`.

    One admin-console connection, kept between reads and opened again after a
    failure; `pgreserve_pgbouncer_up` is 0 while the console cannot be read.
    """

    def __init__(self, admin_url: str, registry: CollectorRegistry) -> None:
        self.admin_url = admin_url
        self.report = PgBouncerReport()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        g: dict[str, Any] = {"registry": registry, "multiprocess_mode": "mostrecent"}
        pool = ["database", "user"]
        self.up = Gauge("pgreserve_pgbouncer_up",
                        "1 when PgBouncer's admin console answered the last read", **g)
        self.clients_waiting = Gauge(
            "pgreserve_pgbouncer_clients_waiting",
            "Clients waiting for a server connection (SHOW POOLS cl_waiting)", pool, **g)
        self.clients_active = Gauge(
            "pgreserve_pgbouncer_clients_active",
            "Clients linked to a server connection or idle (SHOW POOLS cl_active)", pool, **g)
        self.servers_active = Gauge(
            "pgreserve_pgbouncer_servers_active",
            "Server connections linked to a client (SHOW POOLS sv_active)", pool, **g)
        self.servers_idle = Gauge(
            "pgreserve_pgbouncer_servers_idle",
            "Server connections idle and ready (SHOW POOLS sv_idle)", pool, **g)
        self.max_wait = Gauge(
            "pgreserve_pgbouncer_max_wait_seconds",
            "How long the oldest waiting client has waited (SHOW POOLS maxwait)", pool, **g)
        self.avg_wait = Gauge(
            "pgreserve_pgbouncer_avg_wait_seconds",
            "Average time clients waited for a server (SHOW STATS avg_wait_time)",
            ["database"], **g)
        self.avg_xact = Gauge(
            "pgreserve_pgbouncer_avg_transaction_seconds",
            "Average transaction duration (SHOW STATS avg_xact_time)", ["database"], **g)

    async def refresh(self) -> PgBouncerReport:
        """Read the console once and set the gauges; on failure `up` is 0 and the
        previous figures are cleared (a stale queue length would mislead)."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(
                    self.admin_url, cursor_factory=psycopg.AsyncClientCursor,
                    **_connect_kwargs())
            cur = await self._conn.execute(queries["pgbouncer_pool_list"])
            pools = _rows(cur, await cur.fetchall())
            cur = await self._conn.execute(queries["pgbouncer_stat_list"])
            stats = _rows(cur, await cur.fetchall())
        except psycopg.Error as exc:
            log.warning("PgBouncer admin console unreadable: %s", exc)
            await self.close()
            self.up.set(0)
            self.report = PgBouncerReport()
            self._set(self.report)
            return self.report
        self.up.set(1)
        self.report = parse(pools, stats)
        self._set(self.report)
        return self.report

    def _set(self, report: PgBouncerReport) -> None:
        for gauge in (self.clients_waiting, self.clients_active, self.servers_active,
                      self.servers_idle, self.max_wait, self.avg_wait, self.avg_xact):
            gauge.clear()
        for p in report.pools:
            self.clients_waiting.labels(p.database, p.user).set(p.clients_waiting)
            self.clients_active.labels(p.database, p.user).set(p.clients_active)
            self.servers_active.labels(p.database, p.user).set(p.servers_active)
            self.servers_idle.labels(p.database, p.user).set(p.servers_idle)
            self.max_wait.labels(p.database, p.user).set(p.max_wait_s)
        for s in report.stats:
            self.avg_wait.labels(s.database).set(s.avg_wait_s)
            self.avg_xact.labels(s.database).set(s.avg_xact_s)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
