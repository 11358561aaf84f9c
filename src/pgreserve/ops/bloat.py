"""Bloat and vacuum health of the unit pool (stock_unit_p0..p15).

Every take of a pool unit is a DELETE and every refill an INSERT: the pool
partitions churn dead tuples all day, and a short load test never shows what
happens when autovacuum falls behind. This monitor reads live and dead tuples,
the last (auto)vacuum of each partition and age(datfrozenxid), and raises a
warning when a partition's share of dead tuples stays above a threshold for a
whole window (a spike between two autovacuum runs is normal).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg

from ..db import schema as schemas
from ..db.database import Op, tagged
from ..db.queries import queries
from ..workers.base import LoopConfig

log = logging.getLogger(__name__)

PARTITIONS = Op("bloat", "partitions", "worker/bloat")
XID_AGE = Op("bloat", "xid_age", "worker/bloat")


@dataclass(frozen=True)
class BloatConfig:
    dead_pct_warn: float = 20.0  # warn when % dead stays above this ...
    window_s: float = 300.0  # ... for this long
    min_dead_tuples: int = 0  # ignore partitions with fewer dead tuples than this
    use_pgstattuple: bool = True
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(interval_s=10.0))

    def __post_init__(self) -> None:
        if not 0 < self.dead_pct_warn < 100:
            raise ValueError("dead_pct_warn must be between 0 and 100")
        if self.window_s < 0:
            raise ValueError("window_s must not be negative")


@dataclass
class PartitionHealth:
    name: str
    live: int
    dead: int
    dead_pct: float
    last_autovacuum: datetime | None
    last_vacuum: datetime | None
    autovacuum_count: int
    vacuum_count: int
    state: str  # ok | high (above the threshold, not yet for the window) | warning
    high_for_s: float = 0.0
    approx_dead_pct: float | None = None  # pgstattuple_approx, when installed
    free_pct: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "partition": self.name, "live": self.live, "dead": self.dead,
            "dead_pct": round(self.dead_pct, 2), "state": self.state,
            "high_for_s": round(self.high_for_s, 1),
            "last_autovacuum": self.last_autovacuum.isoformat() if self.last_autovacuum else None,
            "last_vacuum": self.last_vacuum.isoformat() if self.last_vacuum else None,
            "autovacuum_count": self.autovacuum_count, "vacuum_count": self.vacuum_count,
            "pgstattuple_dead_pct": self.approx_dead_pct, "pgstattuple_free_pct": self.free_pct,
        }


@dataclass
class BloatReport:
    partitions: list[PartitionHealth] = field(default_factory=list)
    xid_age: int = 0
    pgstattuple: bool = False

    @property
    def warnings(self) -> list[PartitionHealth]:
        return [p for p in self.partitions if p.state == "warning"]

    def as_json(self) -> dict[str, Any]:
        return {"xid_age": self.xid_age, "pgstattuple": self.pgstattuple,
                "warnings": [p.name for p in self.warnings],
                "partitions": [p.as_json() for p in self.partitions]}


class BloatMonitor:
    """A worker (run_forever) watching the pool partitions on its own connection."""

    name = "bloat"

    def __init__(self, dsn: str, config: BloatConfig | None = None,
                 metrics: Any | None = None, schema: str | None = None) -> None:
        self.dsn = dsn
        self.schema = schemas.resolve(schema)
        self.config = config or BloatConfig()
        self.loop_config = self.config.loop
        self.metrics = metrics
        self.report = BloatReport()
        self._high_since: dict[str, float] = {}
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._pgstattuple: bool | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, application_name="pgreserve:bloat",
                prepare_threshold=None)
        return self._conn

    async def _has_pgstattuple(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        if self._pgstattuple is None:
            self._pgstattuple = False
            if self.config.use_pgstattuple:
                try:
                    await conn.execute(queries["pgstattuple_create"])
                    self._pgstattuple = True
                except psycopg.Error as exc:  # not installed, or no privilege
                    log.info("pgstattuple unavailable: %s", exc)
        return self._pgstattuple

    async def check(self, *, once: bool = False) -> BloatReport:
        """Read every pool partition once and update the warning states.

        `once` (`pgreserve ops bloat`, one look): how long a partition has been high
        cannot be seen, so a high one is `warning` when no vacuum (auto or manual) has
        finished on it within `window_s` (autovacuum is not keeping up), `high`
        otherwise; `high_for_s` is then the time since that last vacuum (`window_s`
        when none is on record)."""
        conn = await self._connection()
        rows = await (await conn.execute(
            tagged(queries["pool_partition_stat_list"], PARTITIONS), (self.schema,))).fetchall()
        xid_row = await (await conn.execute(
            tagged(queries["database_xid_age"], XID_AGE))).fetchone()
        stattuple = await self._has_pgstattuple(conn) if rows else False
        now = time.monotonic()
        cfg = self.config
        parts: list[PartitionHealth] = []
        for name, live, dead, last_av, last_v, av_count, v_count, oid in rows:
            total = live + dead
            pct = 100.0 * dead / total if total else 0.0
            high = pct > cfg.dead_pct_warn and dead >= cfg.min_dead_tuples
            if high and once:
                vacuumed = max((t for t in (last_av, last_v) if t is not None), default=None)
                high_for = (cfg.window_s if vacuumed is None
                            else (datetime.now(UTC) - vacuumed).total_seconds())
                state = "warning" if high_for >= cfg.window_s else "high"
            elif high:
                since = self._high_since.setdefault(name, now)
                high_for = now - since
                state = "warning" if high_for >= cfg.window_s else "high"
            else:
                self._high_since.pop(name, None)
                high_for, state = 0.0, "ok"
            part = PartitionHealth(name, int(live), int(dead), pct, last_av, last_v,
                                   int(av_count), int(v_count), state, high_for)
            if stattuple:
                try:
                    cur = await conn.execute(queries["pool_partition_tuple_approx"], (oid,))
                    got = await cur.fetchone()
                    if got is not None:
                        part.approx_dead_pct, part.free_pct = float(got[0]), float(got[1])
                except psycopg.Error as exc:
                    log.info("pgstattuple_approx(%s) failed: %s", name, exc)
            parts.append(part)
        self.report = BloatReport(parts, int(xid_row[0]) if xid_row else 0, stattuple)
        if self.metrics is not None:
            self.metrics.bloat(self.report)
        return self.report

    async def run_once(self) -> int:
        await self.check()
        return 0

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
