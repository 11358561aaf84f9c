"""A batch decides its requests as if each had been sent alone, in arrival order.

Each scenario runs twice on fresh tenants of one database: once with its requests
queued behind a first reserve whose batch waits on the locked bucket row (so they
leave as one batch, in the order they queued), and once one by one through a service
without batching. Both runs must give every request the same answer, leave the same
stock and replay the same answers. The scenarios are those where a request of the
batch cannot be decided there (answered retry, sent alone by the service): a short
reserve on a line with a backorder allowance, a late claim after an expiry in the
same batch, a short reserve while a reservation of the batch holds an expired hold.
The requests after it must not be decided before it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pgreserve import Database, ReservationService
from pgreserve.domain import Reservation, ReserveOutcome
from pgreserve.errors import PgReserveError
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked

Step = Callable[[ReservationService, int, dict[str, str]], Awaitable[Any]]
SKU, LOCATION = "s", "w"


class Scenario:
    """Stock, what happens before the batch, and the batch's requests in order."""

    def __init__(self, on_hand: int, setup: Step | None, steps: list[Step],
                 **stock: Any) -> None:
        self.on_hand = on_hand
        self.setup = setup
        self.steps = steps
        self.stock = stock


def answer(result: Any) -> tuple[Any, ...]:
    """What a caller learns from an answer (ids aside)."""
    if isinstance(result, PgReserveError):
        return ("error", result.code)
    if isinstance(result, BaseException):
        raise result
    if isinstance(result, ReserveOutcome):
        if result.held:
            assert result.reservation is not None
            return ("held", [(x.quantity, x.backordered) for x in result.reservation.lines])
        return ("rejected", result.reason,
                [(s.requested, s.available) for s in result.short_lines])
    if isinstance(result, Reservation):
        return ("reservation", result.status.value)
    if isinstance(result, int):
        return ("expired", result)
    raise AssertionError(f"unexpected answer {result!r}")


async def queued_in_order(combiner_queue: Callable[[], int],
                          calls: list[Callable[[], Awaitable[Any]]]) -> list[asyncio.Future[Any]]:
    """Start each call once the previous one is queued for the bucket's next batch."""
    tasks: list[asyncio.Future[Any]] = []
    for call in calls:
        before = combiner_queue()
        tasks.append(asyncio.ensure_future(call()))
        deadline = time.monotonic() + 10
        while combiner_queue() <= before:
            assert time.monotonic() < deadline, "the request never queued"
            await asyncio.sleep(0.002)
    return tasks


async def run(db: Database, scenario: Scenario, name: str, batched: bool,
              now: list[datetime]) -> tuple[list[tuple[Any, ...]], tuple[int, ...],
                                            list[tuple[Any, ...]]]:
    svc = ReservationService(db, clock=lambda: now[0], batching=batched)
    plain = ReservationService(db, clock=lambda: now[0], batching=False)
    tenant = (await plain.create_tenant(name)).id
    await plain.set_stock(tenant, SKU, LOCATION, scenario.on_hand, **scenario.stock)
    ids: dict[str, str] = {}
    if scenario.setup is not None:
        await scenario.setup(plain, tenant, ids)
    calls: list[Callable[[], Awaitable[Any]]] = [
        functools.partial(step, svc, tenant, ids) for step in scenario.steps]
    if batched:
        assert svc.combiner is not None
        bucket = await bucket_id(db, tenant, SKU)
        queue = svc.combiner._queues
        with bucket_locked(db.conninfo, bucket) as blocker:
            first = asyncio.ensure_future(svc.reserve(tenant, "first", [(SKU, LOCATION, 1)]))
            await wait_until_blocked(db.conninfo)
            tasks = await queued_in_order(lambda: len(queue.get((tenant, bucket), ())), calls)
            blocker.rollback()
        await first
        results = await asyncio.gather(*tasks, return_exceptions=True)
    else:
        await plain.reserve(tenant, "first", [(SKU, LOCATION, 1)])
        results = []
        for call in calls:
            try:
                results.append(await call())
            except PgReserveError as exc:
                results.append(exc)
    view = await plain.get_stock(tenant, SKU, LOCATION)
    assert await plain.invariant_violations() == []
    replays = []
    for call in calls:  # every keyed request again, unbatched: its stored answer
        try:
            replays.append(answer(await call()))
        except PgReserveError as exc:
            replays.append(answer(exc))
    return ([answer(r) for r in results], (view.on_hand, view.reserved, view.available),
            replays)


def reserve(key: str, quantity: int) -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        outcome = await svc.reserve(tenant, key, [(SKU, LOCATION, quantity)], ttl=600)
        if outcome.reservation is not None:
            ids.setdefault(key, outcome.reservation.id)
        return outcome
    return step


def claim(name: str, key: str) -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        return await svc.claim(tenant, ids[name], request_key=key)
    return step


def sweep() -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        return await svc.expire_due()
    return step


def expired_hold(quantity: int, now: list[datetime]) -> Step:
    """`x` holds `quantity`, and its expiry passes (no sweeper has run)."""
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        held = await svc.reserve(tenant, "x", [(SKU, LOCATION, quantity)], ttl=60)
        assert held.reservation is not None
        ids["x"] = held.reservation.id
        now[0] += timedelta(seconds=120)
    return step


NOW = datetime(2030, 1, 1, tzinfo=UTC)


def scenarios(now: list[datetime]) -> dict[str, Scenario]:
    return {
        # A (5) needs the allowance: decided alone; B (2) after it finds nothing
        "backorder_then_small": Scenario(3, None, [reserve("a", 5), reserve("b", 2)],
                                         backorder_limit=3),
        # one key twice: the first (5, alone) owns it, the second is a reuse
        "one_key_twice": Scenario(3, None, [reserve("k", 5), reserve("k", 1)],
                                  backorder_limit=3),
        # the sweeper's expiry, a late claim of it (alone), then a reserve of the rest
        "expiry_claim_reserve": Scenario(4, expired_hold(2, now),
                                         [sweep(), claim("x", "pay-x"), reserve("y", 2)]),
        # short while the expired hold of a reservation claimed later in the batch
        # is still held: the reserve gives it up first, the claim then fails
        "short_before_a_late_claim": Scenario(4, expired_hold(3, now),
                                              [reserve("a", 3), claim("x", "pay-x")]),
    }


@pytest.mark.parametrize("name", ["backorder_then_small", "one_key_twice",
                                  "expiry_claim_reserve", "short_before_a_late_claim"])
async def test_a_batch_answers_as_its_requests_sent_one_by_one(db: Database,
                                                               name: str) -> None:
    batched_now, plain_now = [NOW], [NOW]
    batched = await run(db, scenarios(batched_now)[name], f"{name}-batched", True,
                        batched_now)
    one_by_one = await run(db, scenarios(plain_now)[name], f"{name}-plain", False,
                           plain_now)
    assert batched == one_by_one
