"""The pool strategy: refills, switches and partial takes under real concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import random

import psycopg
import pytest

from pgreserve import Database, ReservationService
from pgreserve.errors import WouldOversell
from pgreserve.workers.replenisher import Replenisher, ReplenisherConfig


def pool_size(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute("SELECT count(*) FROM stock_unit").fetchone()[0])  # type: ignore[index]  # the query always returns one row


async def test_short_pool_never_grants_a_partial_line(dsn: str) -> None:
    """Buyers of 3 units against 10 units: only whole lines, exactly 3 holds, 1 unit left."""
    async with Database(dsn, min_size=16, max_size=16) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("partial")
        await service.set_stock(tenant.id, "s", "w", 10, strategy="pool", pool_cap=4)
        outs = await asyncio.gather(*(
            service.reserve(tenant.id, f"k{i}", [("s", "w", 3)]) for i in range(16)))
        held = [o for o in outs if o.held]
        assert len(held) == 3
        assert all(o.reservation and o.reservation.lines[0].quantity == 3 for o in held)
        view = await service.get_stock(tenant.id, "s", "w")
        assert (view.reserved, view.available) == (9, 1)
        assert await service.invariant_violations() == []


async def test_sold_out_pool_rejects_with_pool_empty(
        service: ReservationService) -> None:
    """Once everything is held, requests are rejected and nothing is left in the pool or free."""
    tenant = await service.create_tenant("soldout")
    await service.set_stock(tenant.id, "s", "w", 5, strategy="pool")
    assert (await service.reserve(tenant.id, "all", [("s", "w", 5)])).held
    for i in range(5):
        out = await service.reserve(tenant.id, f"no{i}", [("s", "w", 1)])
        assert not out.held and out.short_lines[0].available == 0
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.pool, view.available) == (0, 0)


async def test_refill_races_claims_restocks_and_corrections(dsn: str) -> None:
    """Inline and background refills racing claims, releases, restocks and corrections keep pool + holds <= on_hand."""
    async with Database(dsn, min_size=20, max_size=20) as db:
        service = ReservationService(db)
        # Unbatched takes come out of the pool first; batched ones out of free
        # first (the batch holds the bucket row). Half the buyers do each.
        plain = ReservationService(db, batching=False)
        tenant = await service.create_tenant("refill")
        await service.set_stock(tenant.id, "s", "w", 400, strategy="pool", pool_cap=25)
        replenisher = Replenisher(service, ReplenisherConfig(low_water=0.5))
        rng = random.Random(7)
        stop = asyncio.Event()

        async def refiller() -> None:
            while not stop.is_set():
                await replenisher.run_once()
                await asyncio.sleep(0.005)

        async def buyer(n: int) -> None:
            mine = service if n % 2 else plain
            for r in range(30):
                out = await mine.reserve(tenant.id, f"b{n}-{r}",
                                            [("s", "w", rng.randint(1, 4))])
                if out.held and out.reservation is not None:
                    if rng.random() < 0.5:
                        await mine.claim(tenant.id, out.reservation.id)
                    else:
                        await mine.release(tenant.id, out.reservation.id)

        async def stock_keeper() -> None:
            for i in range(15):
                await service.adjust_stock(tenant.id, f"in{i}", "s", "w", 10, reason="receipt")
                with contextlib.suppress(WouldOversell):
                    await service.adjust_stock(tenant.id, f"out{i}", "s", "w", -7,
                                               reason="damaged")
                await asyncio.sleep(0.01)

        # Hold most of the pool so the replenisher has work before the race
        # starts: its first round must refill (deterministically), and its loop
        # then keeps racing the buyers' inline refills.
        warmup = await plain.reserve(tenant.id, "warmup", [("s", "w", 20)])
        assert warmup.held
        assert await replenisher.run_once() > 0
        background = asyncio.create_task(refiller())
        await asyncio.gather(*(buyer(n) for n in range(12)), stock_keeper())
        stop.set()
        await background
        assert await service.invariant_violations() == []
        view = await service.get_stock(tenant.id, "s", "w")
        assert view.pool + view.reserved <= view.on_hand
        assert replenisher.refills > 0


async def test_strategy_switch_during_reservations_loses_nothing(dsn: str) -> None:
    """Switching row <-> pool repeatedly while 16 buyers reserve: every unit accounted for once."""
    async with Database(dsn, min_size=18, max_size=18) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("switch")
        await service.set_stock(tenant.id, "s", "w", 300, strategy="row")
        done = asyncio.Event()

        async def switcher() -> int:
            n = 0
            while not done.is_set():
                strategy = "pool" if n % 2 == 0 else "row"
                await service.set_stock(tenant.id, "s", "w", 300, strategy=strategy,
                                        pool_cap=40)
                n += 1
                await asyncio.sleep(0.01)
            return n

        async def buyer(b: int) -> int:
            held = 0
            for r in range(40):
                out = await service.reserve(tenant.id, f"{b}-{r}", [("s", "w", 1)])
                held += out.held
            return held

        task = asyncio.create_task(switcher())
        held = await asyncio.gather(*(buyer(b) for b in range(16)))
        done.set()
        switches = await task
        assert switches >= 2
        # 640 one-unit requests for 300 units: all 300 sold, none twice
        assert sum(held) == 300
        view = await service.get_stock(tenant.id, "s", "w")
        assert (view.on_hand, view.reserved, view.available) == (300, 300, 0)
        assert await service.invariant_violations() == []
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT sum(quantity) FROM reservation_line WHERE held"
                                ).fetchone() == (300,)


@pytest.mark.parametrize("batching", [False, True], ids=["unbatched", "batched"])
async def test_released_units_are_sold_again(dsn: str, batching: bool) -> None:
    """Released units are for sale again at once: an unbatched release puts them back
    into the pool; a batched one into free, which batches take from first."""
    async with Database(dsn, max_size=4) as db:
        service = ReservationService(db, batching=batching)
        tenant = await service.create_tenant(f"back-{batching}")
        await service.set_stock(tenant.id, "s", "w", 3, strategy="pool")
        out = await service.reserve(tenant.id, "a", [("s", "w", 3)])
        assert out.reservation is not None and pool_size(dsn) == 0
        await service.release(tenant.id, out.reservation.id)
        view = await service.get_stock(tenant.id, "s", "w")
        assert (pool_size(dsn), view.available) == ((0, 3) if batching else (3, 3))
        assert (await service.reserve(tenant.id, "b", [("s", "w", 3)])).held
        assert await service.invariant_violations() == []


async def test_buyers_waiting_for_a_refill_are_let_through_together(dsn: str) -> None:
    """While one transaction holds a dry pool bucket (refilling it), short buyers wait for
    that transaction itself, all of them, not in a queue for the bucket lock that would let
    them through one commit at a time; when it commits with new units, every one holds.
    (Unbatched buyers, one transaction each: batched ones share one transaction.)"""
    async with Database(dsn, min_size=8, max_size=8) as db:
        service = ReservationService(db, batching=False)
        tenant = await service.create_tenant("together")
        await service.set_stock(tenant.id, "s", "w", 30, strategy="pool", pool_cap=10)
        assert (await service.reserve(tenant.id, "first", [("s", "w", 10)])).held
        with psycopg.connect(dsn, autocommit=True) as probe:
            bucket, pool = probe.execute(
                "SELECT b.bucket_id, (SELECT count(*) FROM stock_unit u WHERE u.tenant_id ="
                " b.tenant_id AND u.bucket_id = b.bucket_id) FROM stock_bucket b"
                " WHERE tenant_id = %s", (tenant.id,)).fetchone()  # type: ignore[misc]  # the query always returns one row
            assert pool == 0
            with psycopg.connect(dsn) as refiller:
                refiller.execute("SELECT 1 FROM stock_bucket WHERE tenant_id = %s AND"
                                 " bucket_id = %s FOR NO KEY UPDATE", (tenant.id, bucket))
                xid = refiller.execute("SELECT pg_current_xact_id()::text").fetchone()[0]  # type: ignore[index]  # the query always returns one row
                buyers = [asyncio.create_task(service.reserve(tenant.id, f"b{i}",
                                                              [("s", "w", 1)]))
                          for i in range(8)]
                waiting = (
                    "SELECT count(*) FILTER (WHERE locktype = 'transactionid'"
                    " AND transactionid::text = %s), count(*) FROM pg_locks WHERE NOT granted")
                for _ in range(200):
                    on_refiller, all_waits = probe.execute(waiting, (xid,)).fetchone()  # type: ignore[misc]  # the query always returns one row
                    if all_waits >= 8:
                        break
                    await asyncio.sleep(0.02)
                assert (on_refiller, all_waits) == (8, 8)
                added = refiller.execute("SELECT pool_refill_v1(%s, %s)",
                                         (tenant.id, bucket)).fetchone()[0]  # type: ignore[index]  # the query always returns one row
                assert added == 10
                refiller.commit()
            outs = await asyncio.gather(*buyers)
        assert all(o.held for o in outs)
        view = await service.get_stock(tenant.id, "s", "w")
        assert (view.reserved, view.pool, view.available) == (18, 2, 12)
        assert db.stats.serialization_retried == 0
        assert await service.invariant_violations() == []


@pytest.mark.parametrize("strategy", ["row", "pool"])
async def test_a_short_take_gives_up_only_the_expired_holds_it_needs(dsn: str,
                                                                      strategy: str) -> None:
    """3,000 expired holds nobody swept: a buyer short of stock gives up expired holds in
    batches until it has what it can use, not all 3,000 under the bucket lock; the rest stay
    available, and the books stay exact."""
    async with Database(dsn, min_size=2, max_size=2) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant(f"backlog-{strategy}")
        await service.set_stock(tenant.id, "s", "w", 3000, strategy=strategy, pool_cap=100)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT reserve_v1(%s, 'old' || i, 'd', '{s}', '{w}', '{1}', '15 minutes')"
                " FROM generate_series(1, 3000) i", (tenant.id,))
            # an hour passes with the sweeper stopped
            conn.execute("UPDATE reservation SET created_at = created_at - interval '2 hours',"
                         " expires_at = expires_at - interval '2 hours' WHERE tenant_id = %s",
                         (tenant.id,))
            conn.execute("UPDATE reservation_line SET expires_at = expires_at - interval"
                         " '2 hours' WHERE tenant_id = %s", (tenant.id,))
            out = await service.reserve(tenant.id, "new", [("s", "w", 1)])
            assert out.held
            still_expired = conn.execute(
                "SELECT count(*) FROM reservation_line WHERE tenant_id = %s AND held"
                " AND expires_at <= clock_timestamp()", (tenant.id,)).fetchone()[0]  # type: ignore[index]  # the query always returns one row
        # one batch of 500 lines covers the row take (1 unit) and the refill (1 + cap 100)
        assert still_expired == 2500
        view = await service.get_stock(tenant.id, "s", "w")
        assert (view.on_hand, view.reserved, view.available) == (3000, 1, 2999)
        assert await service.invariant_violations() == []
