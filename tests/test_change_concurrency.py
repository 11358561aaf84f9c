"""Changing held carts under real concurrency: the lock order against carts and
batches, the batched claim and release of a changed cart, and the books afterwards."""

from __future__ import annotations

import asyncio
import random
import uuid

import psycopg
import pytest

from pgreserve import Database, ReservationService, Tenant, errors
from pgreserve.core.service import digest
from test_concurrency import deadlocks, reserve_sql, wait_until_blocked


def change_sql(tenant: int, key: str, rid: str,
               cart: list[tuple[str, str, int]]) -> tuple[str, tuple[object, ...]]:
    """The exact call ReservationService.change makes, for a hand-driven transaction."""
    cart = sorted(cart)
    fp = digest("change", {"id": rid, "lines": [list(x) for x in cart]})
    return ("SELECT change_v1(%s, %s, %s, %s, %s, %s, %s)",
            (tenant, key, fp, rid, [x[0] for x in cart], [x[1] for x in cart],
             [x[2] for x in cart]))


def held_by_bucket(dsn: str, tenant: int) -> dict[str, int]:
    """sku -> units the reservation lines hold (active reservations only)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT b.sku, coalesce(sum(l.quantity) FILTER (WHERE l.held), 0)"
            " FROM stock_bucket b LEFT JOIN reservation_line l USING (tenant_id, bucket_id)"
            " WHERE b.tenant_id = %s GROUP BY b.sku", (tenant,)).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


async def test_a_change_takes_buckets_in_sku_location_order(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """A change that gives back to bucket a and takes from bucket c waits for a's lock
    (held by a paused reserve) without having touched c: a reserve of c meanwhile goes
    through at once; once the pause ends the change completes, with no deadlock."""
    for sku in ("a", "c"):
        await service.set_stock(tenant.id, sku, "w", 10)
    held = (await service.reserve(tenant.id, "r1", [("a", "w", 4)])).reservation
    assert held is not None
    before = deadlocks(dsn)
    sql, params = reserve_sql(tenant.id, "paused", "a", "w", 1)
    with psycopg.connect(dsn) as first:
        assert first.execute(sql, params).fetchone()[0]["status"] == "held"  # type: ignore[index]
        change = asyncio.create_task(service.change(
            tenant.id, held.id, [("a", "w", 1), ("c", "w", 5)], request_key="c1"))
        await wait_until_blocked(dsn)
        assert not change.done()
        # c is free: the waiting change has not locked it
        other = await asyncio.wait_for(service.reserve(tenant.id, "r2", [("c", "w", 2)]), 30)
        assert other.held and not change.done()
        first.commit()
    out = await change
    assert out.held and out.reservation is not None
    assert [(x.sku, x.quantity) for x in out.reservation.lines] == [("a", 1), ("c", 5)]
    assert (await service.get_stock(tenant.id, "a", "w")).available == 8
    assert (await service.get_stock(tenant.id, "c", "w")).available == 3
    assert deadlocks(dsn) == before
    assert await service.invariant_violations() == []


async def test_a_paused_change_makes_a_batch_of_its_bucket_wait_and_both_finish(
        dsn: str, service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A change left open after taking from bucket b makes a batch of b (one-line
    reserves through the combiner) wait; when the change commits the batch serves
    exactly what is left, with no deadlock and the books balanced."""
    for sku in ("a", "b"):
        await service.set_stock(tenant.id, sku, "w", 10, strategy=strategy)
    held = (await service.reserve(tenant.id, "r1", [("a", "w", 2), ("b", "w", 2)])).reservation
    assert held is not None
    before = deadlocks(dsn)
    sql, params = change_sql(tenant.id, "c1", held.id, [("a", "w", 1), ("b", "w", 7)])
    with psycopg.connect(dsn) as first:
        assert first.execute(sql, params).fetchone()[0]["status"] == "held"  # type: ignore[index]
        buyers = [asyncio.create_task(service.reserve(tenant.id, f"b{n}", [("b", "w", 1)]))
                  for n in range(4)]
        await asyncio.sleep(0.3)
        if strategy == "row":
            await wait_until_blocked(dsn)
            assert not any(b.done() for b in buyers)
        first.commit()
    outs = await asyncio.gather(*buyers)
    assert sum(o.held for o in outs) == 3
    assert (await service.get_stock(tenant.id, "b", "w")).available == 0
    assert deadlocks(dsn) == before
    assert await service.invariant_violations() == []


async def test_batched_claim_and_release_of_a_changed_cart_take_every_line(
        db: Database, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A one-line reservation remembered for its bucket's batch, then changed to two
    buckets, is claimed whole (both lines sold); one moved to another bucket is
    released whole from there; and a service whose memory is stale (it made the
    reservation, another changed it) still claims every line."""
    svc = ReservationService(db)  # batching on
    for sku in ("a", "b", "c"):
        await svc.set_stock(tenant.id, sku, "w", 20, strategy=strategy)
    one = (await svc.reserve(tenant.id, "r1", [("a", "w", 2)])).reservation
    two = (await svc.reserve(tenant.id, "r2", [("a", "w", 3)])).reservation
    three = (await svc.reserve(tenant.id, "r3", [("a", "w", 4)])).reservation
    assert one is not None and two is not None and three is not None
    assert (await svc.change(tenant.id, one.id, [("a", "w", 2), ("b", "w", 5)],
                             request_key="c1")).held
    assert (await svc.claim(tenant.id, one.id)).status == "claimed"
    assert (await svc.change(tenant.id, two.id, [("c", "w", 6)], request_key="c2")).held
    assert (await svc.release(tenant.id, two.id, request_key="rel2")).status == "released"

    # svc remembers three's bucket a; another service (process) changes the cart
    a = await svc._bucket_id(tenant.id, "a", "w")
    assert svc._reservation_buckets.get((tenant.id, uuid.UUID(three.id))) == a
    other = ReservationService(db)
    assert (await other.change(tenant.id, three.id, [("b", "w", 1), ("c", "w", 1)],
                               request_key="c3")).held
    assert (await svc.claim(tenant.id, three.id)).status == "claimed"

    on_hand = {s: (await svc.get_stock(tenant.id, s, "w")).on_hand for s in "abc"}
    assert on_hand == {"a": 18, "b": 14, "c": 19}
    for s in "abc":
        view = await svc.get_stock(tenant.id, s, "w")
        assert (view.reserved, view.available) == (0, view.on_hand)
    assert await svc.invariant_violations() == []
    with psycopg.connect(dsn) as conn:
        sold = conn.execute(
            "SELECT count(*) FROM stock_movement WHERE kind = 'sale' AND reservation_id = %s",
            (three.id,)).fetchone()
    assert sold == (2,)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_many_buyers_change_carts_while_others_reserve_and_the_books_balance(
        dsn: str, strategy: str, batching: bool) -> None:
    """Buyers change their carts over four scarce buckets at random (up, down, in, out)
    while others reserve one-line and two-line carts, claim and release: no call raises,
    changes are both held and refused, each changed reservation holds exactly its last
    accepted cart, every bucket's books balance (available = on_hand - held,
    invariant_violations empty), also once every changed cart is claimed, and with the
    row strategy the server saw no deadlock."""
    async with Database(dsn, min_size=16, max_size=16) as db:
        service = ReservationService(db, batching=batching)
        tenant = await service.create_tenant("changes")
        skus = ["a", "b", "c", "d"]
        for sku in skus:
            await service.set_stock(tenant.id, sku, "w", 40, strategy=strategy)
        answers: dict[bool, int] = {True: 0, False: 0}
        before = deadlocks(dsn)

        async def changer(n: int) -> tuple[str, list[tuple[str, int]]]:
            rng = random.Random(n)
            out = await service.reserve(tenant.id, f"h{n}", [(rng.choice(skus), "w", 2)])
            assert out.held and out.reservation is not None
            rid = out.reservation.id
            cart = [(x.sku, x.quantity) for x in out.reservation.lines]
            for r in range(12):
                picked = rng.sample(skus, rng.randint(1, 3))
                want = [(s, "w", rng.randint(1, 6)) for s in picked]
                got = await service.change(tenant.id, rid, want, request_key=f"h{n}-{r}")
                answers[got.held] += 1
                if got.held:
                    assert got.reservation is not None
                    cart = sorted((s, q) for s, _, q in want)
                    assert [(x.sku, x.quantity) for x in got.reservation.lines] == cart
            return rid, cart

        async def buyer(n: int) -> None:
            rng = random.Random(1000 + n)
            for r in range(12):
                if r % 2:
                    lines = [(s, "w", rng.randint(1, 4)) for s in rng.sample(skus, 2)]
                else:
                    lines = [(rng.choice(skus), "w", rng.randint(1, 3))]
                out = await service.reserve(tenant.id, f"b{n}-{r}", lines)
                if out.held and out.reservation is not None and r % 3 == 0:
                    await service.release(tenant.id, out.reservation.id)
                elif out.held and out.reservation is not None and r % 3 == 1:
                    await service.claim(tenant.id, out.reservation.id)

        results = await asyncio.gather(*(changer(n) for n in range(8)),
                                       *(buyer(n) for n in range(8)))
        # both answers happened: carts changed, and some were short (nothing changed)
        assert answers[True] > 0 and answers[False] > 0
        for result in results[:8]:
            assert result is not None
            rid, cart = result
            now = await service.get_reservation(tenant.id, rid)
            assert now.status == "active"
            assert [(x.sku, x.quantity) for x in now.lines] == cart
        held = held_by_bucket(dsn, tenant.id)
        for sku in skus:
            view = await service.get_stock(tenant.id, sku, "w")
            assert view.available == view.on_hand - held[sku]
            assert view.reserved == held[sku]
        assert await service.invariant_violations() == []
        if strategy == "row":
            # changes, carts and batches take buckets in one order: no deadlock at all
            # (pool: see test_opposite_order_carts_never_partial_never_deadlock)
            assert deadlocks(dsn) == before
        # then every changed cart is claimed through the same paths: all of it sold
        for result in results[:8]:
            assert result is not None
            assert (await service.claim(tenant.id, result[0])).status == "claimed"
        assert await service.invariant_violations() == []
        for sku in skus:
            view = await service.get_stock(tenant.id, sku, "w")
            assert view.reserved == held_by_bucket(dsn, tenant.id)[sku]


@pytest.mark.parametrize("case", ["row", "pool", "backorder"])
async def test_a_change_whose_take_waits_across_the_expiry_is_refused(
        dsn: str, service: ReservationService, tenant: Tenant, case: str) -> None:
    """A change that raises a line waits for the bucket (a paused reserve holds it) while
    its reservation's expiry passes. When the take decides, the reservation has expired:
    the change is refused (reservation_not_active) and writes nothing. Before, the take
    gave the change's own expired line up to cover itself, the change answered "held"
    for a line that held nothing, and the units were lost for good."""
    if case == "backorder":
        await service.set_stock(tenant.id, "a", "w", 3, backorder_limit=5)
        new = 6
    else:
        await service.set_stock(tenant.id, "a", "w", 4, strategy=case)
        new = 4
    held = (await service.reserve(tenant.id, "r1", [("a", "w", 2)], ttl=1)).reservation
    assert held is not None
    sql, params = reserve_sql(tenant.id, "paused", "a", "w", 1)
    with psycopg.connect(dsn) as first:
        assert first.execute(sql, params).fetchone()[0]["status"] == "held"  # type: ignore[index]
        change = asyncio.create_task(service.change(tenant.id, held.id, [("a", "w", new)],
                                                    request_key="c1"))
        await wait_until_blocked(dsn)
        await asyncio.sleep(1.3)  # the reservation expires while the change waits
        first.commit()
    with pytest.raises(errors.ReservationNotActive):
        await change
    assert await service.invariant_violations() == []
    # nothing was stored under the key: it is refused again the same way
    with pytest.raises(errors.ReservationNotActive):
        await service.change(tenant.id, held.id, [("a", "w", new)], request_key="c1")
    assert await service.expire_due() == 1
    assert await service.invariant_violations() == []
    stock = await service.get_stock(tenant.id, "a", "w")
    assert stock.reserved == 1  # the paused reserve's unit only


async def test_an_extend_that_waits_for_the_lines_across_the_expiry_is_refused(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """An extend waits for its reservation's lines (another transaction holds them) while
    the expiry passes: it is judged when it decides, and refused."""
    await service.set_stock(tenant.id, "a", "w", 4)
    held = (await service.reserve(tenant.id, "r1", [("a", "w", 2)], ttl=1)).reservation
    assert held is not None
    with psycopg.connect(dsn) as first:
        first.execute("SELECT 1 FROM reservation_line WHERE tenant_id = %s"
                      " AND reservation_id = %s FOR UPDATE", (tenant.id, held.id))
        extend = asyncio.create_task(service.extend(tenant.id, held.id, 600))
        await wait_until_blocked(dsn)
        await asyncio.sleep(1.3)
        first.commit()
    with pytest.raises(errors.ReservationNotActive):
        await extend
    assert (await service.get_reservation(tenant.id, held.id)).status.value == "expired"
