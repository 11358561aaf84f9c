"""Races with many real connections at once, then the invariants asserted."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pgreserve import Database, ReservationService, Status, Tenant
from pgreserve.core.service import digest
from pgreserve.errors import IdempotencyKeyReused, ReservationClaimed, ReservationReleased


async def wait_until_blocked(dsn: str, count: int = 1) -> None:
    """Wait until `count` pgreserve backends are waiting on a lock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(500):
            n = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'pgreserve:core' AND wait_event_type = 'Lock'"
            ).fetchone()[0]  # type: ignore[index]  # the query always returns one row
            if n >= count:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("no backend ever waited on the lock")


def deadlocks(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0])  # type: ignore[index]  # the query always returns one row


def reserve_sql(tenant: int, key: str, sku: str, loc: str, qty: int) -> tuple[str, tuple[object, ...]]:
    """The exact call ReservationService.reserve makes, for a hand-driven transaction."""
    fp = digest("reserve", {"lines": [[sku, loc, qty]], "ttl_ms": 900_000})
    return ("SELECT reserve_v1(%s, %s, %s, %s, %s, %s, %s)",
            (tenant, key, fp, [sku], [loc], [qty], timedelta(minutes=15)))


async def test_64_clients_race_for_50_units(dsn: str, strategy: str) -> None:
    """64 clients x 20 one-unit requests with distinct keys against 50 units: exactly 50 holds."""
    async with Database(dsn, min_size=64, max_size=64) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("race")
        await service.set_stock(tenant.id, "hot", "w", 50, strategy=strategy)

        async def client(c: int) -> int:
            held = 0
            for r in range(20):
                out = await service.reserve(tenant.id, f"c{c}-r{r}", [("hot", "w", 1)])
                held += out.held
            return held

        results = await asyncio.gather(*(client(c) for c in range(64)))
        assert sum(results) == 50
        view = await service.get_stock(tenant.id, "hot", "w")
        assert (view.on_hand, view.reserved, view.available) == (50, 50, 0)
        assert await service.invariant_violations() == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*), sum(quantity) FROM reservation_line").fetchone() == (
            50, 50)


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
@pytest.mark.parametrize(("first_qty", "second_qty"), [(7, 6), (6, 7)])
async def test_competing_shortage_with_paused_first(
        dsn: str, service: ReservationService, tenant: Tenant, first_ends: str,
        strategy: str, first_qty: int, second_qty: int) -> None:
    """Stock 10, requests of 7 and 6 (both orders): the second waits for the paused first, then fails or succeeds."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    sql, params = reserve_sql(tenant.id, "A", "s", "w", first_qty)
    with psycopg.connect(dsn) as first:
        outcome = first.execute(sql, params).fetchone()[0]  # type: ignore[index]  # the query always returns one row
        assert outcome["status"] == "held"
        second = asyncio.create_task(service.reserve(tenant.id, "B", [("s", "w", second_qty)]))
        await wait_until_blocked(dsn)
        assert not second.done()
        if first_ends == "commit":
            first.commit()
        else:
            first.rollback()
    result = await second
    view = await service.get_stock(tenant.id, "s", "w")
    if first_ends == "commit":
        assert not result.held
        assert (view.reserved, view.available) == (first_qty, 10 - first_qty)
    else:
        assert result.held
        assert (view.reserved, view.available) == (second_qty, 10 - second_qty)
    assert await service.invariant_violations() == []


async def test_opposite_order_carts_never_partial_never_deadlock(dsn: str, strategy: str) -> None:
    """Carts naming two SKUs in opposite orders, many rounds at once: whole carts only, no deadlock."""
    async with Database(dsn, min_size=16, max_size=16) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("carts")
        for sku in ("A", "B"):
            await service.set_stock(tenant.id, sku, "w", 300, strategy=strategy)
        before = deadlocks(dsn)

        async def buyer(n: int) -> list[str]:
            ids = []
            for r in range(25):
                lines = [("A", "w", 2), ("B", "w", 3)]
                if (n + r) % 2:
                    lines.reverse()
                out = await service.reserve(tenant.id, f"{n}-{r}", lines)
                if out.held:
                    assert out.reservation is not None
                    ids.append(out.reservation.id)
                    if r % 3 == 0:
                        await service.release(tenant.id, out.reservation.id)
            return ids

        held = [i for ids in await asyncio.gather(*(buyer(n) for n in range(16))) for i in ids]
        for rid in held:
            res = await service.get_reservation(tenant.id, rid)
            assert sorted((x.sku, x.quantity) for x in res.lines) == [("A", 2), ("B", 3)]
        a = await service.get_stock(tenant.id, "A", "w")
        b = await service.get_stock(tenant.id, "B", "w")
        # every cart took 2 A and 3 B together, or nothing
        assert a.reserved * 3 == b.reserved * 2
        assert a.available == 300 - a.reserved and b.available == 300 - b.reserved
        assert await service.invariant_violations() == []
        # sorted carts take bucket locks in one order, and a pool buyer holding
        # part of what it needs waits only for higher units than its own: the
        # server never even detects a deadlock
        assert deadlocks(dsn) == before


@pytest.mark.parametrize("batching", [False, True])
async def test_pool_buyers_holding_part_at_sell_out_never_deadlock(dsn: str,
                                                                   batching: bool) -> None:
    """At sell-out of a pool bucket, buyers of several units each lock part of what
    they need and wait for units other buyers hold. A buyer waits only for units
    above the highest it holds, so no two of them wait for each other: the server
    detects no deadlock, and every answer is exact (whole holds, books balanced)."""
    async with Database(dsn, min_size=16, max_size=16) as db:
        service = ReservationService(db, batching=batching)
        tenant = await service.create_tenant("sellout")
        # all stock in the pool: only units other buyers hold can serve a short buyer
        await service.set_stock(tenant.id, "s", "w", 12, strategy="pool", pool_cap=12)
        before = deadlocks(dsn)
        loop = asyncio.get_running_loop()
        stop = loop.time() + 3
        held = rejected = 0

        async def buyer(n: int) -> None:
            nonlocal held, rejected
            r = 0
            while loop.time() < stop:
                r += 1
                out = await service.reserve(tenant.id, f"{n}-{r}", [("s", "w", 2 + (n + r) % 3)])
                if not out.held:
                    rejected += 1
                    continue
                held += 1
                assert out.reservation is not None
                # most are given back (new units, new ids), so the sell-out goes on
                if r % 4:
                    await service.release(tenant.id, out.reservation.id)

        await asyncio.gather(*(buyer(n) for n in range(16)))
        assert held > 0 and rejected > 0, (held, rejected)
        assert await service.invariant_violations() == []
        stock = await service.get_stock(tenant.id, "s", "w")
        assert stock.available + stock.reserved == 12
        assert deadlocks(dsn) == before


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
async def test_pool_buyer_holding_higher_units_waits_for_lower_ones_on_its_retry(
        dsn: str, first_ends: str) -> None:
    """Pool of 10, a paused buyer holds the 7 lowest units, a second buyer wants 6:
    it locks the 3 highest and may not wait below them (a wait that could close a
    cycle), so it is retried once, and the retry waits for the paused buyer holding
    none. It then answers from what that buyer did: short when it kept its units,
    held when it rolled back. No spinning, no deadlock."""
    async with Database(dsn, min_size=2, max_size=2) as db:
        service = ReservationService(db, batching=False)
        tenant = await service.create_tenant("below")
        await service.set_stock(tenant.id, "s", "w", 10, strategy="pool", pool_cap=10)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # takes start at the lowest unit (no random start): who locks what is known
            conn.execute("UPDATE stock_bucket SET pool_hi = pool_lo WHERE tenant_id = %s",
                         (tenant.id,))
        before = deadlocks(dsn)
        sql, params = reserve_sql(tenant.id, "first", "s", "w", 7)
        with psycopg.connect(dsn) as first:
            assert first.execute(sql, params).fetchone()[0]["status"] == "held"  # type: ignore[index]
            second = asyncio.create_task(service.reserve(tenant.id, "second", [("s", "w", 6)]))
            await wait_until_blocked(dsn)
            assert not second.done()
            # one retry, hinted to wait: the blocked attempt is the second one
            assert db.stats.serialization_retried == 1
            if first_ends == "commit":
                first.commit()
            else:
                first.rollback()
        result = await second
        assert result.held is (first_ends == "rollback")
        view = await service.get_stock(tenant.id, "s", "w")
        assert view.reserved == (7 if first_ends == "commit" else 6)
        assert db.stats.serialization_retried == 1
        assert deadlocks(dsn) == before
        assert await service.invariant_violations() == []


async def test_same_key_from_8_connections_has_one_effect(
        dsn: str, strategy: str) -> None:
    """8 concurrent requests with one key: one reservation, one decrement, one answer."""
    async with Database(dsn, min_size=8, max_size=8) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("dup")
        await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
        outs = await asyncio.gather(*(
            service.reserve(tenant.id, "order-A-reserve-1", [("s", "w", 7)]) for _ in range(8)))
        ids = {o.reservation.id for o in outs if o.reservation}
        assert all(o.held for o in outs) and len(ids) == 1
        assert sum(not o.replayed for o in outs) == 1
        with pytest.raises(IdempotencyKeyReused):
            await service.reserve(tenant.id, "order-A-reserve-1", [("s", "w", 8)])
        view = await service.get_stock(tenant.id, "s", "w")
        assert (view.reserved, view.available) == (7, 3)
        original = await service.get_reservation(tenant.id, ids.pop())
        assert original.lines[0].quantity == 7
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM reservation").fetchone() == (1,)


async def test_lost_reply_after_commit_is_recovered_by_key(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """Committed but the reply never arrived: the retry with the same key returns the original."""
    await service.set_stock(tenant.id, "s", "w", 10)
    sql, params = reserve_sql(tenant.id, "A", "s", "w", 7)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql, params)
        conn.commit()  # the client never reads the answer
    with psycopg.connect(dsn) as conn:
        stored = conn.execute(
            "SELECT outcome->'reservation'->>'id' FROM request_ledger WHERE request_key = 'A'"
        ).fetchone()[0]  # type: ignore[index]  # the query always returns one row
    retry = await service.reserve(tenant.id, "A", [("s", "w", 7)])
    assert retry.replayed and retry.reservation is not None
    assert retry.reservation.id == stored
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (7, 3)


async def test_rollback_before_commit_lets_the_retry_run(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """Rolled back before commit: the retry with the same key reserves normally."""
    await service.set_stock(tenant.id, "s", "w", 10)
    sql, params = reserve_sql(tenant.id, "A", "s", "w", 7)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql, params)
        conn.rollback()
    retry = await service.reserve(tenant.id, "A", [("s", "w", 7)])
    assert retry.held and not retry.replayed
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (7, 3)


class FarFuture:
    def __call__(self) -> datetime:
        return datetime.now(UTC) + timedelta(hours=1)


async def test_release_races_release_sweeper_and_claim(dsn: str, strategy: str) -> None:
    """Release vs release, release vs sweeper, claim vs release: each hold restored at most once."""
    async with Database(dsn, min_size=24, max_size=24) as db:
        service = ReservationService(db)
        sweeper = ReservationService(db, clock=FarFuture())
        tenant = await service.create_tenant("races")
        await service.set_stock(tenant.id, "s", "w", 600, strategy=strategy)
        ids = []
        for i in range(150):
            out = await service.reserve(tenant.id, f"k{i}", [("s", "w", 2)], ttl=60)
            assert out.reservation is not None
            ids.append(out.reservation.id)

        async def quiet(coro: Awaitable[object]) -> object:
            try:
                return await coro
            except (ReservationClaimed, ReservationReleased) as exc:
                return exc

        jobs: list[Awaitable[object]] = []
        for n, rid in enumerate(ids):
            if n % 3 == 0:
                jobs += [service.release(tenant.id, rid), service.release(tenant.id, rid)]
            elif n % 3 == 1:
                jobs += [service.release(tenant.id, rid)]
            else:
                jobs += [service.claim(tenant.id, rid), service.release(tenant.id, rid)]
        jobs += [sweeper.expire_due(20) for _ in range(8)]
        await asyncio.gather(*(quiet(j) for j in jobs))

        final = [await service.get_reservation(tenant.id, rid) for rid in ids]
        statuses = [r.status for r in final]
        claimed = sum(s is Status.CLAIMED for s in statuses)
        # claimed after the sweeper had expired it: one restore, then the late claim's sale
        late = sum(r.status is Status.CLAIMED and r.expired_at is not None for r in final)
        assert all(s is not Status.ACTIVE or n % 3 == 1 for n, s in enumerate(statuses))
        view = await service.get_stock(tenant.id, "s", "w")
        active = sum(s is Status.ACTIVE for s in statuses)
        assert view.on_hand == 600 - 2 * claimed
        assert view.reserved == 2 * active
        assert await service.invariant_violations() == []
    with psycopg.connect(dsn) as conn:
        restores = conn.execute(
            "SELECT count(*), count(DISTINCT (reservation_id, line_no)) FROM stock_movement"
            " WHERE kind = 'restore'").fetchone()
        assert restores is not None and restores[0] == restores[1]
        assert restores[0] == len(ids) - claimed - active + late


async def test_two_sweepers_expire_each_hold_once(dsn: str, strategy: str) -> None:
    """Several sweepers at once: every due reservation is expired once, restored once."""
    async with Database(dsn, min_size=6, max_size=6) as db:
        service = ReservationService(db)
        sweeper = ReservationService(db, clock=FarFuture())
        tenant = await service.create_tenant("sweep")
        await service.set_stock(tenant.id, "s", "w", 1000, strategy=strategy)
        for i in range(300):
            assert (await service.reserve(tenant.id, f"k{i}", [("s", "w", 3)], ttl=30)).held
        counts = await asyncio.gather(*(sweeper.expire_due(37) for _ in range(12)))
        while (n := await sweeper.expire_due(500)) > 0:
            counts.append(n)
        assert sum(counts) == 300
        view = await service.get_stock(tenant.id, "s", "w")
        assert (view.on_hand, view.reserved, view.available) == (1000, 0, 1000)
        assert await sweeper.invariant_violations() == []


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize(("first", "second"), [("claim", "release"), ("release", "claim")])
async def test_a_key_sent_with_two_operations_at_once_is_reused_not_refused(
        dsn: str, db: Database, tenant: Tenant, first: str, second: str,
        batching: bool) -> None:
    """One request key sent with a claim and a release of one reservation at once (the
    first paused before its commit): the second is answered as it would be once the first
    is stored, idempotency_key_reused, not with the state the first left (before, it
    waited only for the reservation's lock, not the key's, and was answered claimed or
    released)."""
    service = ReservationService(db, batching=batching)
    await service.set_stock(tenant.id, "a", "w", 4)
    held = (await service.reserve(tenant.id, "r1", [("a", "w", 1)])).reservation
    assert held is not None
    fingerprint = digest(first, {"id": held.id})
    with psycopg.connect(dsn) as paused:
        paused.execute("SELECT transition_keyed_v2(%s, 'k', %s, %s, %s, NULL, false)",
                       (tenant.id, first, fingerprint, held.id))
        run = service.claim if second == "claim" else service.release
        racing = asyncio.create_task(run(tenant.id, held.id, request_key="k"))
        await wait_until_blocked(dsn)
        paused.commit()
    with pytest.raises(IdempotencyKeyReused):
        await racing
