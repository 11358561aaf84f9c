"""The hold-time sampler: who holds database connections, for how long, in which state.

Every interval (1 s) it reads pg_stat_activity once and adds, per
(application_name, state), the number of backends times the time since the
previous sample: connection-seconds. With every business process on its own
application_name (see db/database.py, Op) this shows where connection hold
time goes, and which caller leaves sessions `idle in transaction`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..db.database import Op, tagged
from ..db.queries import queries
from ..workers.base import LoopConfig

SAMPLE = Op("sampler", "sample", "worker/sampler")


@dataclass(frozen=True)
class Session:
    pid: int
    application_name: str
    state: str
    xact_seconds: float | None
    state_seconds: float | None
    wait_event_type: str | None


@dataclass
class HoldTimeReport:
    """What the sampler has seen so far, and in its last sample."""

    samples: int = 0
    connection_seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    backends: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_xact_seconds: float = 0.0
    oldest_xact_application: str | None = None
    oldest_xact_pid: int | None = None
    idle_in_transaction: list[Session] = field(default_factory=list)

    def by_caller(self) -> dict[str, float]:
        """Connection-seconds per application_name, all states summed."""
        out: dict[str, float] = defaultdict(float)
        for (app, _state), secs in self.connection_seconds.items():
            out[app] += secs
        return dict(out)

    def as_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "connection_seconds": [
                {"application_name": a, "state": s, "seconds": round(v, 3),
                 "backends_now": self.backends.get((a, s), 0)}
                for (a, s), v in sorted(self.connection_seconds.items(), key=lambda kv: -kv[1])],
            "oldest_xact": {"seconds": round(self.oldest_xact_seconds, 3),
                            "application_name": self.oldest_xact_application,
                            "pid": self.oldest_xact_pid},
            "idle_in_transaction": [
                {"pid": s.pid, "application_name": s.application_name,
                 "idle_seconds": s.state_seconds, "xact_seconds": s.xact_seconds}
                for s in self.idle_in_transaction],
        }


@dataclass(frozen=True)
class SamplerConfig:
    all_databases: bool = False  # default: only the database of the DSN
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(interval_s=1.0))


class HoldTimeSampler:
    """A worker (run_forever) that samples pg_stat_activity on its own connection."""

    name = "sampler"

    def __init__(self, dsn: str, config: SamplerConfig | None = None,
                 metrics: Any | None = None) -> None:
        self.dsn = dsn
        self.config = config or SamplerConfig()
        self.loop_config = self.config.loop
        self.metrics = metrics
        self.report = HoldTimeReport()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._last: float | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, application_name="pgreserve:sampler",
                prepare_threshold=None)
        return self._conn

    async def sample(self) -> list[Session]:
        """Read pg_stat_activity once and fold it into the report."""
        conn = await self._connection()
        cur = await conn.execute(tagged(queries["activity_sample"], SAMPLE),
                                 {"all": self.config.all_databases})
        rows = await cur.fetchall()
        now = time.monotonic()
        # The first sample counts one interval: a backend seen once was there
        # for about that long.
        elapsed = self.loop_config.interval_s if self._last is None else now - self._last
        self._last = now
        sessions = [Session(int(r[0]), str(r[1]), str(r[2]), r[3], r[4], r[5]) for r in rows]
        rep = self.report
        rep.samples += 1
        backends: dict[tuple[str, str], int] = defaultdict(int)
        for s in sessions:
            backends[(s.application_name, s.state)] += 1
        for key, n in backends.items():
            rep.connection_seconds[key] = rep.connection_seconds.get(key, 0.0) + n * elapsed
        rep.backends = dict(backends)
        in_xact = [s for s in sessions if s.xact_seconds is not None]
        oldest = max(in_xact, key=lambda s: s.xact_seconds or 0.0, default=None)
        rep.oldest_xact_seconds = (oldest.xact_seconds or 0.0) if oldest else 0.0
        rep.oldest_xact_application = oldest.application_name if oldest else None
        rep.oldest_xact_pid = oldest.pid if oldest else None
        rep.idle_in_transaction = [s for s in sessions if s.state.startswith("idle in transaction")]
        if self.metrics is not None:
            self.metrics.hold_time(rep, backends, elapsed)
        return sessions

    async def run_once(self) -> int:
        await self.sample()
        return 0  # always sleep one interval between samples

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
