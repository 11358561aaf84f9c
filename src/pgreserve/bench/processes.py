"""Buyers spread over several processes, each an asyncio loop with one connection per buyer.

One Python process drives a few thousand calls a second at most. With every
buyer in one event loop, that loop becomes the bottleneck long before the
database does (a sold-out answer costs the client about as much as the server),
and the run measures the load generator. Each process here runs its share of
the buyers through the library API, exactly as the single-process run does;
the parent seeds, sweeps, shows progress and checks the books.

All processes start at one moment (an event set after every process has
opened its connections) and time their calls from one time zero: Linux's
perf_counter is the system-wide monotonic clock, so their samples merge.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import time
import traceback
from collections import Counter
from dataclasses import asdict
from typing import Any

from ..core.batching import BatchStats
from ..core.service import ReservationService
from ..db.database import Database
from .buyers import drive, sweep_until
from .results import RunResult
from .scenario import PlannedRequest, Scenario

READY_TIMEOUT_S = 120.0


def split(requests: list[PlannedRequest], buyers: int,
          processes: int) -> list[tuple[int, list[PlannedRequest]]]:
    """(buyers, requests) of each process: requests dealt round robin, buyers spread evenly."""
    n = max(1, min(processes, buyers))
    return [(buyers // n + (1 if k < buyers % n else 0), requests[k::n]) for k in range(n)]


def _child(number: int, dsn: str, scenario: Scenario, strategy: str, batching: bool,
           tenant: int, buyers: int, requests: list[PlannedRequest], application_name: str,
           go: Any, zero: Any, done: Any, out: Any) -> None:
    try:
        asyncio.run(_child_run(number, dsn, scenario, strategy, batching, tenant, buyers,
                               requests, application_name, go, zero, done, out))
    except BaseException as exc:  # noqa: BLE001 - report it: the parent must not wait for this process
        out.put(("error", number, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


async def _child_run(number: int, dsn: str, scenario: Scenario, strategy: str,
                     batching: bool, tenant: int, buyers: int,
                     requests: list[PlannedRequest], application_name: str,
                     go: Any, zero: Any, done: Any, out: Any) -> None:
    loop = asyncio.get_running_loop()

    async def gate() -> float:
        await loop.run_in_executor(None, go.wait)
        return float(zero.value)

    def progress(_strategy: str, n: int) -> None:
        with done.get_lock():
            done.value += n

    db = Database(dsn, min_size=buyers, max_size=buyers, application_name=application_name)
    await db.open()
    service = ReservationService(db, batching=batching)
    try:
        out.put(("ready", number, None))
        result = await drive(service, None, tenant, scenario, strategy,
                              requests, progress, buyers=buyers, gate=gate)
    finally:
        await db.close()
    result.client_stats = asdict(db.stats)
    result.batch = service.combiner.stats if service.combiner is not None else None
    out.put(("result", number, result))


async def drive_processes(dsn: str, admin: ReservationService, tenant: int, scenario: Scenario,
                          strategy: str, requests: list[PlannedRequest],
                          progress: Any, application_name: str,
                          batching: bool = True) -> RunResult:
    """Run the plan with the scenario's buyers spread over `scenario.processes` processes,
    each with its own ReservationService (batched or not: `batching`)."""
    ctx = mp.get_context("spawn")
    parts = split(requests, scenario.buyers, scenario.processes)
    go, zero, done, out = ctx.Event(), ctx.Value("d", 0.0), ctx.Value("q", 0), ctx.Queue()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(k, dsn, scenario, strategy, batching, tenant, buyers, reqs,
                               application_name, go, zero, done, out))
             for k, (buyers, reqs) in enumerate(parts)]
    for proc in procs:
        proc.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    helpers: list[asyncio.Task[None]] = []
    finished: dict[int, RunResult] = {}
    try:
        ready = 0
        deadline = time.monotonic() + READY_TIMEOUT_S
        while ready < len(procs):
            kind, number, body = await _next(loop, out, procs, deadline)
            if kind == "error":
                raise RuntimeError(f"buyer process {number} failed: {body}")
            ready += kind == "ready"
        if scenario.expire > 0:
            helpers.append(asyncio.create_task(sweep_until(admin, stop)))
        if progress is not None:
            helpers.append(asyncio.create_task(_report(progress, strategy, done, stop)))
        zero.value = time.perf_counter()
        go.set()
        while len(finished) < len(procs):
            kind, number, body = await _next(loop, out, procs, None)
            if kind == "error":
                raise RuntimeError(f"buyer process {number} failed: {body}")
            if kind == "result":
                finished[number] = body
    finally:
        stop.set()
        for task in helpers:
            await task
        for proc in procs:
            if proc.is_alive() and len(finished) < len(procs):
                proc.terminate()
            await loop.run_in_executor(None, proc.join, 30)
    result = _merge(strategy, scenario, list(finished.values()))
    result.batching = batching
    result.t0 = float(zero.value)
    return result


async def _next(loop: asyncio.AbstractEventLoop, out: Any, procs: list[Any],
                deadline: float | None) -> tuple[str, int, Any]:
    """The next message from a buyer process; fails if one died without a word or time is up."""
    while True:
        try:
            msg: tuple[str, int, Any] = await loop.run_in_executor(None, out.get, True, 0.5)
            return msg
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a buyer process exited with code {dead[0].exitcode}") from None
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError("buyer processes did not get ready in time") from None


async def _report(progress: Any, strategy: str, done: Any, stop: asyncio.Event) -> None:
    shown = 0
    while True:
        now = int(done.value)
        if now > shown:
            progress(strategy, now - shown)
            shown = now
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def _merge(strategy: str, scenario: Scenario, parts: list[RunResult]) -> RunResult:
    """One run from the processes' runs: samples in start order, counts and stats summed."""
    samples = sorted((x for part in parts for x in part.samples), key=lambda x: x.start)
    result = RunResult(strategy, scenario, samples, max(part.elapsed_s for part in parts))
    stats: Counter[str] = Counter()
    for part in parts:
        result.claimed += part.claimed
        result.claimed_units += part.claimed_units
        result.released += part.released
        result.followup_errors += part.followup_errors
        result.error_kinds.update(part.error_kinds)
        stats.update(part.client_stats)
    result.client_stats = {f"client_{k}": v for k, v in stats.items()}
    result.batch = merge_batch_stats([p.batch for p in parts if p.batch is not None])
    return result


def merge_batch_stats(parts: list[BatchStats]) -> BatchStats | None:
    """The processes' combiner stats as one: counts and the size histogram summed."""
    if not parts:
        return None
    out = BatchStats()
    for part in parts:
        out.batches += part.batches
        out.requests += part.requests
        out.splits += part.splits
        out.busy += part.busy
        out.sizes.update(part.sizes)
    return out
