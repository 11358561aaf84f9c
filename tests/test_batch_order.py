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
from pgreserve.core import batching
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


async def together_or_apart(db: Database, svc: ReservationService,
                            plain: ReservationService, tenant: int, stock: tuple[str, str],
                            calls: list[Callable[[], Awaitable[Any]]], batched: bool,
                            catch: type[Exception] = PgReserveError) -> list[Any]:
    """The calls' answers (or the errors of type `catch` they raised), after a first
    reserve of one unit of `stock`: `batched`, as one batch of `svc` in their order
    (each queued behind the bucket's row, held until all are); else one by one through
    `plain`, unbatched."""
    sku, location = stock
    if batched:
        assert svc.combiner is not None
        bucket = await bucket_id(db, tenant, sku)
        queue = svc.combiner._queues
        with bucket_locked(db.conninfo, bucket) as blocker:
            first = asyncio.ensure_future(svc.reserve(tenant, "first", [(sku, location, 1)]))
            await wait_until_blocked(db.conninfo)
            tasks = await queued_in_order(lambda: len(queue.get((tenant, bucket), ())), calls)
            blocker.rollback()
        await first
        return list(await asyncio.gather(*tasks, return_exceptions=True))
    await plain.reserve(tenant, "first", [(sku, location, 1)])
    results: list[Any] = []
    for call in calls:
        try:
            results.append(await call())
        except catch as exc:
            results.append(exc)
    return results


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
    results = await together_or_apart(db, svc, plain, tenant, (SKU, LOCATION), calls,
                                      batched)
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


async def test_a_deferred_request_keeps_its_own_deadline_during_anothers_turn(
        db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request deferred behind one sent alone (a short reserve on a backorder line)
    whose deadline passes while that one's unbatched call runs is answered Busy then,
    not when the turn ends: its deadline is its own. The retried one is held."""
    from pgreserve import deadline
    from pgreserve.errors import Busy

    svc = ReservationService(db)
    tenant = (await svc.create_tenant("deferred-deadline")).id
    await svc.set_stock(tenant, SKU, LOCATION, 5, backorder_limit=5)
    bucket = await bucket_id(db, tenant, SKU)
    turn_ended = asyncio.Event()
    check_key = svc._check_api_key

    async def slow_alone(*args: Any) -> None:  # the retried reserve's own call, held up
        await turn_ended.wait()
        await check_key(*args)

    monkeypatch.setattr(svc, "_check_api_key", slow_alone)
    # the turn would otherwise end by itself after TURN_WAIT_S (A has no deadline)
    monkeypatch.setattr(batching, "TURN_WAIT_S", 3600.0)
    assert svc.combiner is not None
    queue = svc.combiner._queues

    async def late() -> Any:
        with deadline(0.3):
            return await svc.reserve(tenant, "b", [(SKU, LOCATION, 1)])

    with bucket_locked(db.conninfo, bucket) as blocker:
        first = asyncio.ensure_future(svc.reserve(tenant, "first", [(SKU, LOCATION, 1)]))
        await wait_until_blocked(db.conninfo)
        short, deferred = await queued_in_order(
            lambda: len(queue.get((tenant, bucket), ())),
            [lambda: svc.reserve(tenant, "a", [(SKU, LOCATION, 8)]), late])
        blocker.rollback()
    await first
    with pytest.raises(Busy):  # answered while the retried request still holds its turn
        await asyncio.wait_for(deferred, 120)  # (not a speed limit: the turn lasts 3600 s)
    assert not short.done()
    turn_ended.set()
    held = await short
    assert held.held and held.reservation is not None
    assert held.reservation.lines[0].backordered == 4


async def test_a_short_deadline_does_not_answer_its_bucket_mates_busy(dsn: str) -> None:
    """While no pool connection is free, a queued request waits for one as an unbatched
    call would (pool_wait_s, never past its own deadline): one with a short deadline is
    answered Busy when it passes; one without waits on and is held once the connection
    comes back, as it would be unbatched."""
    from pgreserve import deadline
    from pgreserve.errors import Busy

    async with Database(dsn, max_size=1) as small:
        svc = ReservationService(small)
        plain = ReservationService(small, batching=False)
        tenant = (await svc.create_tenant("short-deadline")).id
        await svc.set_stock(tenant, SKU, LOCATION, 5)
        await svc.set_stock(tenant, "other", LOCATION, 5)
        await svc.reserve(tenant, "warm", [(SKU, LOCATION, 1)])  # the bucket id is known
        other = await bucket_id(small, tenant, "other")

        async def short() -> Any:
            with deadline(0.2):
                return await svc.reserve(tenant, "short", [(SKU, LOCATION, 1)])

        with bucket_locked(dsn, other) as blocker:  # the pool's one connection waits
            hog = asyncio.ensure_future(plain.reserve(tenant, "hog", [("other", LOCATION, 1)]))
            await wait_until_blocked(dsn)
            hurried = asyncio.ensure_future(short())
            patient = asyncio.ensure_future(svc.reserve(tenant, "patient",
                                                        [(SKU, LOCATION, 1)]))
            with pytest.raises(Busy):
                await hurried
            assert not patient.done()
            blocker.rollback()
        assert (await hog).held
        assert (await patient).held
        assert (await plain.get_stock(tenant, SKU, LOCATION)).reserved == 2
