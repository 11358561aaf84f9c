"""Allocation across locations under real concurrency: many buyers over several locations,
split and unsplit, beside carts that name their location (batched and not), then the
books of every bucket, no unit promised twice or stranded, no false rejection, and no
deadlock between carts that take the same buckets in different priority orders."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import psycopg
import pytest

from conftest import table_counts
from pgreserve import AllocatedLine, Database, ReservationService, Tenant
from pgreserve.domain import ReserveOutcome
from pgreserve.errors import Busy
from test_concurrency import deadlocks, reserve_sql, wait_until_blocked

LOCATIONS = {"athens": 7, "berlin": 5, "cairo": 9}


async def books(svc: ReservationService, tenant: Tenant, sku: str) -> dict[str, tuple[int, int]]:
    """(on_hand, available) per location of a SKU, read at one instant."""
    [found] = await svc.availability(tenant.id, [sku])
    return {v.location: (v.on_hand, v.available) for v in found.locations}


def held_per_bucket(dsn: str) -> Counter[tuple[str, str]]:
    """Units of held lines per (sku, location), as the database keeps them."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT b.sku, b.location, sum(l.quantity) FROM reservation_line l"
            " JOIN stock_bucket b USING (tenant_id, bucket_id) WHERE l.held"
            " GROUP BY b.sku, b.location").fetchall()
    return Counter({(r[0], r[1]): int(r[2]) for r in rows})


def cart(rng: random.Random) -> list[Any]:
    """A random cart: one line without a location (split or not), sometimes beside a line
    that names one, or only a line that names one."""
    kind = rng.randrange(4)
    if kind == 0:
        return [AllocatedLine("tee", rng.randint(1, 4))]
    if kind == 1:
        return [AllocatedLine("tee", rng.randint(2, 6), split=True)]
    if kind == 2:
        return [AllocatedLine("tee", rng.randint(1, 3), split=rng.random() < 0.5),
                ("tee", rng.choice(sorted(LOCATIONS)), 1)]
    return [("tee", rng.choice(sorted(LOCATIONS)), rng.randint(1, 2))]


@pytest.mark.parametrize("seed", [1, 2])
async def test_many_buyers_allocating_across_locations_keep_exact_books(
        db: Database, tenant: Tenant, strategy: str, dsn: str, seed: int) -> None:
    """40 buyers at once over three locations (split, unsplit, mixed and explicit carts,
    the explicit one-line carts through group commit): each bucket's held units equal
    the held answers' lines there and never exceed its stock, invariants hold, no
    rejected allocated line could have been served by what is left (stock only goes
    down here, so what is left is at most what was there when it was refused), every
    replay answers the same, and releasing every hold gives every unit back."""
    batched = ReservationService(db, batching=True)
    plain = ReservationService(db, batching=False)
    for location, on_hand in LOCATIONS.items():
        await plain.set_stock(tenant.id, "tee", location, on_hand, strategy=strategy)
    await plain.set_location_priority(tenant.id, ["berlin", "cairo"])
    rng = random.Random(seed)
    carts = {f"k{n}": cart(rng) for n in range(40)}

    async def buy(key: str, lines: list[Any]) -> ReserveOutcome | None:
        svc = batched if len(lines) == 1 and isinstance(lines[0], tuple) else plain
        try:
            return await svc.reserve(tenant.id, key, lines)
        except Busy:
            return None  # nothing committed; not an answer

    answers = dict(zip(carts, await asyncio.gather(*(buy(k, c) for k, c in carts.items())),
                       strict=True))
    assert await plain.invariant_violations(tenant.id) == []
    promised: Counter[tuple[str, str]] = Counter()
    for out in answers.values():
        if out is not None and out.held:
            assert out.reservation is not None
            for line in out.reservation.lines:
                promised[(line.sku, line.location)] += line.quantity
    assert held_per_bucket(dsn) == promised
    left = await books(plain, tenant, "tee")
    for location, on_hand in LOCATIONS.items():
        assert left[location] == (on_hand, on_hand - promised[("tee", location)])
    held = [o for o in answers.values() if o is not None and o.held]
    assert held, "some carts were held"
    for key, out in answers.items():
        if out is None or out.held:
            continue
        for short in out.short_lines:
            if short.location is None:
                split = next(x.split for x in carts[key] if isinstance(x, AllocatedLine))
                could = (sum(a for _, a in left.values()) if split
                         else max(a for _, a in left.values()))
                assert could < short.requested, (key, carts[key], short, left)
    for key, out in answers.items():
        if out is None:
            continue
        again = await plain.reserve(tenant.id, key, carts[key])
        assert again.replayed and again.held == out.held
        assert again.short_lines == out.short_lines
        if out.reservation is not None:
            assert again.reservation is not None
            assert (again.reservation.id, again.reservation.lines) == (
                out.reservation.id, out.reservation.lines)
    for out in held:
        assert out.reservation is not None
        await plain.release(tenant.id, out.reservation.id)
    assert await books(plain, tenant, "tee") == {k: (v, v) for k, v in LOCATIONS.items()}
    assert held_per_bucket(dsn) == Counter()
    assert await plain.invariant_violations(tenant.id) == []


async def test_carts_allocated_in_opposite_orders_never_deadlock(
        db: Database, tenant: Tenant, dsn: str) -> None:
    """Two SKUs whose priorities run opposite ways (tee: b then a, cap: a then b), bought
    together by many carts without locations beside carts that name both locations: every
    cart is answered, no deadlock is ever detected, and the books are exact."""
    svc = ReservationService(db, batching=False)
    for sku in ("tee", "cap"):
        for location in ("a", "b"):
            await svc.set_stock(tenant.id, sku, location, 60)
    await svc.update_sku(tenant.id, "tee", location_priority=["b", "a"])
    await svc.update_sku(tenant.id, "cap", location_priority=["a", "b"])
    before = deadlocks(dsn)
    carts: list[list[Any]] = []
    for n in range(30):
        if n % 3 == 0:
            carts.append([("cap", "a", 1), ("tee", "b", 1)])
        else:
            carts.append([AllocatedLine("tee", 2, split=n % 2 == 0),
                          AllocatedLine("cap", 2, split=n % 2 == 1)])
    outs = await asyncio.gather(*(svc.reserve(tenant.id, f"k{n}", c)
                                  for n, c in enumerate(carts)))
    assert deadlocks(dsn) == before
    assert await svc.invariant_violations(tenant.id) == []
    held = Counter[tuple[str, str]]()
    for out in outs:
        assert out.reservation is not None, out
        for line in out.reservation.lines:
            held[(line.sku, line.location)] += line.quantity
    assert held_per_bucket(dsn) == held
    assert sum(held.values()) == 10 * 2 + 20 * 4


async def test_an_allocation_locks_its_buckets_in_name_order_before_taking(
        db: Database, tenant: Tenant, dsn: str) -> None:
    """A cart naming tee@a and tee@b has taken tee@a and pauses; a split allocation of 8
    (priority b first, 5 at each) waits for tee@a before it touches tee@b, so the paused
    cart then takes tee@b at once: no deadlock, and the allocation then holds b's 5 and
    a's 3. (Taking in priority order without the locks first, b then a, deadlocks.)"""
    svc = ReservationService(db, batching=False)
    for location in ("a", "b"):
        await svc.set_stock(tenant.id, "tee", location, 5)
    await svc.set_location_priority(tenant.id, ["b", "a"])
    take = ("UPDATE stock_bucket SET free = free - 1 WHERE tenant_id = %s AND sku = 'tee'"
            " AND location = %s AND free >= 1")
    with psycopg.connect(dsn) as paused:
        paused.execute(take, (tenant.id, "a"))
        task = asyncio.create_task(svc.reserve(tenant.id, "k1",
                                               [AllocatedLine("tee", 8, split=True)]))
        await wait_until_blocked(dsn)
        await asyncio.to_thread(paused.execute, take, (tenant.id, "b"))
        paused.rollback()
        out = await task
    assert out.reservation is not None
    assert [(x.location, x.quantity) for x in out.reservation.lines] == [("a", 3), ("b", 5)]
    assert db.stats.deadlocks_retried == 0
    assert await svc.invariant_violations(tenant.id) == []


@pytest.mark.parametrize("ends", ["rollback", "commit"])
async def test_an_allocation_waits_for_a_buyer_in_flight_instead_of_refusing(
        db: Database, tenant: Tenant, strategy: str, dsn: str, ends: str) -> None:
    """Berlin is empty and a buyer's open transaction has taken paris's 2 units: an
    unsplit allocation of 2 waits for it. If that buyer rolls back, the allocation holds
    paris's 2 units (refusing then would be a false rejection); if it commits, the
    allocation is refused with available 0, and nothing is promised twice."""
    svc = ReservationService(db)
    await svc.set_stock(tenant.id, "tee", "berlin", 0, strategy=strategy)
    await svc.set_stock(tenant.id, "tee", "paris", 2, strategy=strategy)
    await svc.set_location_priority(tenant.id, ["berlin", "paris"])
    with psycopg.connect(dsn) as other:
        other.execute(*reserve_sql(tenant.id, "theirs", "tee", "paris", 2))
        task = asyncio.create_task(svc.reserve(tenant.id, "mine", [AllocatedLine("tee", 2)]))
        await wait_until_blocked(dsn)
        assert not task.done()
        if ends == "rollback":
            other.rollback()
        else:
            other.commit()
        out = await task
    if ends == "rollback":
        assert out.reservation is not None
        assert [(x.location, x.quantity) for x in out.reservation.lines] == [("paris", 2)]
    else:
        assert not out.held and out.short_lines[0].location is None
        assert out.short_lines[0].available == 0
    assert held_per_bucket(dsn) == Counter({("tee", "paris"): 2})
    assert await svc.invariant_violations(tenant.id) == []
    assert table_counts(dsn)["reservation"] == 1
