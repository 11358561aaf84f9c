"""What the buyers do: reserve through the library or the HTTP API, then claim or release.

`drive` runs a plan with concurrent buyers in this process; processes.py runs
it in several processes, runner.py seeds, sweeps and checks the books around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from typing import Any, Protocol

import psycopg

from ..core.service import ReservationService
from ..errors import PgReserveError
from .results import ERROR, HELD, REJECTED, REPLAYED, RunResult, Sample
from .scenario import PlannedRequest, Scenario

SWEEP_EVERY_S = 0.25


class Buyer(Protocol):
    """What a buyer calls: the library (ReservationService) or the HTTP API (HttpBuyer)."""

    async def reserve(self, tenant: int, request_key: str, lines: Iterable[Any], *,
                      ttl: timedelta) -> Any: ...

    async def claim(self, tenant: int, reservation_id: str) -> Any: ...

    async def release(self, tenant: int, reservation_id: str) -> Any: ...


Progress = Callable[[str, int], None]


async def sweep_until(admin: ReservationService, stop: asyncio.Event) -> None:
    """Expire due holds every SWEEP_EVERY_S, as the sweeper worker would, until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(PgReserveError):
            await admin.expire_due()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SWEEP_EVERY_S)


async def drive(buyer: Buyer, admin: ReservationService | None, tenant: int,
                scenario: Scenario, strategy: str, requests: list[PlannedRequest],
                progress: Progress | None, *, buyers: int | None = None,
                gate: Callable[[], Awaitable[float]] | None = None) -> RunResult:
    """Run `requests` with `buyers` concurrent buyers (default: the scenario's).

    `gate` waits for the go signal and returns the run's time zero (a
    perf_counter value shared by all buyer processes); without it the run
    starts at once. The sweeper runs here when holds expire and `admin` is given.
    """
    samples: list[Sample] = []
    result = RunResult(strategy, scenario, samples, 0.0)
    queue = iter(requests)
    hold_ttl = timedelta(seconds=scenario.hold_ttl_s)
    expire_ttl = timedelta(seconds=scenario.expire_ttl_s)
    start = asyncio.Event()
    done = asyncio.Event()
    t0 = 0.0

    async def one_buyer(number: int) -> None:
        previous: tuple[str, list[tuple[str, str, int]], timedelta] | None = None
        await start.wait()
        for req in queue:  # one shared iterator: each request is taken by one buyer
            if req.retry and previous is not None:
                key, lines, ttl = previous
            else:
                key = f"r{req.seq}"
                lines = [(scenario.sku(req.sku), scenario.location, req.quantity)]
                ttl = expire_ttl if req.fate == "expire" else hold_ttl
                previous = (key, lines, ttl)
            began = time.perf_counter()
            try:
                out = await buyer.reserve(tenant, key, lines, ttl=ttl)
            except (PgReserveError, psycopg.Error) as exc:
                samples.append(Sample(req.seq, began - t0, time.perf_counter() - t0, ERROR, 0))
                result.error_kinds[type(exc).__name__] += 1
            else:
                ended = time.perf_counter()
                outcome = REPLAYED if out.replayed else HELD if out.held else REJECTED
                units = sum(q for _, _, q in lines) if outcome == HELD else 0
                samples.append(Sample(req.seq, began - t0, ended - t0, outcome, units))
                if outcome == HELD and out.reservation is not None:
                    await _follow_up(buyer, tenant, out.reservation.id, req, units, result)
            if progress is not None:
                progress(strategy, 1)

    tasks = [asyncio.create_task(one_buyer(i)) for i in range(buyers or scenario.buyers)]
    sweep = asyncio.create_task(sweep_until(admin, done)) \
        if scenario.expire > 0 and admin else None
    t0 = await gate() if gate is not None else time.perf_counter()
    result.t0 = t0
    start.set()
    try:
        await asyncio.gather(*tasks)
    finally:
        done.set()
        if sweep is not None:
            await sweep
    result.elapsed_s = time.perf_counter() - t0
    return result


async def _follow_up(buyer: Buyer, tenant: int, reservation_id: str,
                     req: PlannedRequest, units: int, result: RunResult) -> None:
    """What happens to a granted hold: payment succeeds (claim) or fails (release)."""
    try:
        if req.fate == "claim":
            await buyer.claim(tenant, reservation_id)
            result.claimed += 1
            result.claimed_units += units
        elif req.fate == "release":
            await buyer.release(tenant, reservation_id)
            result.released += 1
    except (PgReserveError, psycopg.Error) as exc:
        result.followup_errors += 1
        result.error_kinds[f"{req.fate}:{type(exc).__name__}"] += 1
