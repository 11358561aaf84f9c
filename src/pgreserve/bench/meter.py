"""What a run cost: CPU of the PostgreSQL server and of the client, and WAL written.

Server CPU is read from /proc: utime + stime of the postmaster and of every
process under it, plus cutime + cstime (the CPU of children that already
exited, which the postmaster reaps: the buyers' backends close before the
last reading). That needs the server on this machine, in this PID namespace.
When /proc does not show it, the fallback is pg_stat_statements'
total_exec_time (milliseconds spent executing statements: not CPU, but the
best the server says about itself), and the `cpu_source` field says which.

WAL is read twice: `pg_current_wal_lsn()` moves at once, so samples taken
during a run can be interpolated at the moment of the last hold;
`pg_stat_wal.wal_bytes` is flushed by each session at most once a second and
when it exits, so it is exact only once the buyers are gone.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from ..db.connect import connect_async
from ..db.queries import queries

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")
SAMPLE_EVERY_S = 0.25


@dataclass(frozen=True)
class Reading:
    """One moment: `at` is perf_counter (the buyers' clock), CPU in seconds, WAL in bytes."""

    at: float
    server_cpu_s: float | None
    wal_lsn: int
    wal_bytes: int
    client_cpu_s: float


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime + stime + cutime + cstime in clock ticks) of a process, None if gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    return int(fields[1]), sum(int(v) for v in fields[11:15])


def _comm(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _processes() -> tuple[dict[int, list[int]], dict[int, int]]:
    """(children of each pid, CPU ticks of each pid) of every process visible in /proc."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
                ticks[int(entry)] = stat[1]
    return children, ticks


def _tree(children: dict[int, list[int]], ticks: dict[int, int], root: int,
          exclude: int | None = None) -> float | None:
    if root not in ticks:
        return None
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid != exclude:
            total += ticks.get(pid, 0)
            todo.extend(children.get(pid, ()))
    return total / CLOCK_TICKS


def tree_cpu_s(root: int, exclude: int | None = None) -> float | None:
    """CPU seconds of a process and all its descendants (but `exclude`'s subtree), those
    that exited included (a reaped child's time is in its parent's cutime/cstime);
    None if root is gone."""
    return _tree(*_processes(), root, exclude)


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have exited (and been waited for)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cpu_split(server: int | None) -> tuple[float | None, float]:
    """(server tree, this process's tree without the server) CPU seconds, from one scan.

    This process's children that are still running (buyer processes) count from
    /proc; once they have been waited for, through this process's cutime/cstime."""
    children, ticks = _processes()
    me = _tree(children, ticks, os.getpid(), exclude=server)
    return (None if server is None else _tree(children, ticks, server),
            own_cpu_s() if me is None else me)


class ServerMeter:
    """Reads the server's CPU and WAL over one connection of its own."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], postmaster: int | None,
                 statements: bool) -> None:
        self.conn = conn
        self.postmaster = postmaster
        self.source: str | None = "proc" if postmaster is not None else \
            "pg_stat_statements" if statements else None

    @classmethod
    async def open(cls, dsn: str) -> ServerMeter:
        conn = await connect_async(dsn)
        cur = await conn.execute(queries["server_usage_read"])
        row = await cur.fetchone()
        if row is None:
            raise RuntimeError("server_usage_read returned no row")
        postmaster = _postmaster_of(int(row[0]))
        statements = False
        if postmaster is None:
            cur = await conn.execute(queries["pg_stat_statements_exists"])
            statements = await cur.fetchone() is not None
        return cls(conn, postmaster, statements)

    async def close(self) -> None:
        await self.conn.close()

    async def read(self) -> Reading:
        cur = await self.conn.execute(queries["server_usage_read"])
        row = await cur.fetchone()
        if row is None:
            raise RuntimeError("server_usage_read returned no row")
        cpu, client = await asyncio.to_thread(cpu_split, self.postmaster)
        if self.source == "pg_stat_statements":
            cur = await self.conn.execute(queries["statement_time_read"])
            ms = await cur.fetchone()
            cpu = float(ms[0]) / 1000.0 if ms else None
        return Reading(time.perf_counter(), cpu, int(row[1]), int(row[2] or 0), client)

    async def sample_until(self, stop: asyncio.Event, into: list[Reading]) -> None:
        """Append a reading every SAMPLE_EVERY_S until `stop` is set."""
        while not stop.is_set():
            into.append(await self.read())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)


def _postmaster_of(backend: int) -> int | None:
    """The postmaster's pid, if this session's backend is a process visible here."""
    stat = _stat(backend)
    if stat is None or _comm(backend) != "postgres" or _comm(stat[0]) != "postgres":
        return None
    return stat[0]


def at(readings: list[Reading], moment: float, field: str) -> float | None:
    """A reading's field linearly interpolated at `moment` (clamped to the first/last)."""
    points = [(r.at, getattr(r, field)) for r in readings if getattr(r, field) is not None]
    if not points:
        return None
    times = [t for t, _ in points]
    i = bisect.bisect_left(times, moment)
    if i == 0:
        return float(points[0][1])
    if i == len(points):
        return float(points[-1][1])
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return float(v0 + (v1 - v0) * (moment - t0) / (t1 - t0)) if t1 > t0 else float(v1)


@dataclass
class Usage:
    """What one run cost, whole (first to last reading) and over its selling window
    (from the buyers' start until the last hold, interpolated between readings)."""

    cpu_source: str | None
    span_s: float
    server_cpu_s: float | None
    client_cpu_s: float
    wal_bytes: int
    selling_window_s: float | None = None
    selling_server_cpu_s: float | None = None
    selling_client_cpu_s: float | None = None
    selling_wal_bytes: float | None = None

    @classmethod
    def measure(cls, source: str | None, readings: list[Reading], start: float,
                sellout: float | None) -> Usage:
        """`readings` in time order; `start` and `sellout` are perf_counter moments."""
        first, last = readings[0], readings[-1]
        cpu = None if first.server_cpu_s is None or last.server_cpu_s is None \
            else last.server_cpu_s - first.server_cpu_s
        usage = cls(source, last.at - first.at, cpu, last.client_cpu_s - first.client_cpu_s,
                    last.wal_bytes - first.wal_bytes)
        if sellout is not None:
            usage.selling_window_s = sellout - start
            usage.selling_server_cpu_s = _delta(readings, start, sellout, "server_cpu_s")
            usage.selling_client_cpu_s = _delta(readings, start, sellout, "client_cpu_s")
            usage.selling_wal_bytes = _delta(readings, start, sellout, "wal_lsn")
        return usage

    def to_dict(self, holds: int) -> dict[str, Any]:
        def per(value: float | None, scale: float = 1.0) -> float | None:
            return None if value is None or not holds else value * scale / holds

        def cores(cpu: float | None, span: float | None) -> float | None:
            return None if cpu is None or not span or span <= 0 else cpu / span

        window = self.selling_window_s
        return {
            "cpu_source": self.cpu_source,
            "span_s": self.span_s,
            "server_cpu_s": self.server_cpu_s,
            "client_cpu_s": self.client_cpu_s,
            "wal_bytes": self.wal_bytes,
            "server_cpu_ms_per_hold": per(self.server_cpu_s, 1000.0),
            "client_cpu_ms_per_hold": per(self.client_cpu_s, 1000.0),
            "wal_bytes_per_hold": per(float(self.wal_bytes)),
            "selling_window": {
                "s": window,
                "server_cpu_s": self.selling_server_cpu_s,
                "client_cpu_s": self.selling_client_cpu_s,
                "wal_bytes": self.selling_wal_bytes,
                "server_cores": cores(self.selling_server_cpu_s, window),
                "client_cores": cores(self.selling_client_cpu_s, window),
                "server_cpu_ms_per_hold": per(self.selling_server_cpu_s, 1000.0),
                "client_cpu_ms_per_hold": per(self.selling_client_cpu_s, 1000.0),
                "wal_bytes_per_hold": per(self.selling_wal_bytes),
            },
        }


def _delta(readings: list[Reading], start: float, end: float, field: str) -> float | None:
    a, b = at(readings, start, field), at(readings, end, field)
    return None if a is None or b is None else b - a
