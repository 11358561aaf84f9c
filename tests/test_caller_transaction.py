"""reserve, claim and release with conn=: on the caller's connection, inside the caller's
open transaction, committed or rolled back with the caller's own writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest
import pytest_asyncio

from pgreserve import Database, Line, ReservationService, Status, Tenant
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import InvalidRequest, ReservationClaimed, ReservationNotFound
from test_migrations import _new_database


@pytest_asyncio.fixture
async def shop(plain_dsn: str) -> AsyncIterator[psycopg.AsyncConnection[tuple[object, ...]]]:
    """The shop's own connection (its session search_path as the server gives it) and its
    own order table in public."""
    async with await psycopg.AsyncConnection.connect(plain_dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE public.shop_order (id text PRIMARY KEY, hold uuid)")
        yield conn


async def _orders(conn: psycopg.AsyncConnection[tuple[object, ...]]) -> list[tuple[object, ...]]:
    cur = await conn.execute("SELECT id FROM public.shop_order ORDER BY id")
    return await cur.fetchall()


async def test_a_commit_makes_the_order_and_the_claim_visible_together(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
    """Reserve and claim inside the shop's transaction: nobody else sees the hold or the
    sale before the shop commits; after it, the order row and the sale are both there."""
    await service.set_stock(tenant.id, "sku-1", "wh", 5)
    async with shop.transaction():
        held = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 2)], conn=shop)
        assert held.reservation is not None
        rid = held.reservation.id
        await shop.execute("INSERT INTO public.shop_order VALUES ('order-1', %s)", (rid,))
        sold = await service.claim(tenant.id, rid, conn=shop)
        assert sold.status is Status.CLAIMED
        assert (await service.get_stock(tenant.id, "sku-1", "wh")).on_hand == 5
        with pytest.raises(ReservationNotFound):
            await service.get_reservation(tenant.id, rid)
    assert await _orders(shop) == [("order-1",)]
    stock = await service.get_stock(tenant.id, "sku-1", "wh")
    assert (stock.on_hand, stock.available) == (3, 3)
    assert (await service.get_reservation(tenant.id, rid)).status is Status.CLAIMED


async def test_a_rollback_undoes_the_order_and_the_hold_together(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
    """When the shop's transaction rolls back, neither its order row nor the hold and
    sale remain: the stock is as before and the request key is free for a new hold."""
    await service.set_stock(tenant.id, "sku-1", "wh", 5)
    holds: list[str] = []

    async def checkout() -> None:
        async with shop.transaction():
            held = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 5)],
                                         conn=shop)
            assert held.reservation is not None
            holds.append(held.reservation.id)
            await shop.execute("INSERT INTO public.shop_order VALUES ('order-1', %s)",
                               (held.reservation.id,))
            await service.claim(tenant.id, held.reservation.id, conn=shop)
            raise RuntimeError("payment provider down")

    with pytest.raises(RuntimeError, match="payment provider down"):
        await checkout()
    assert await _orders(shop) == []
    stock = await service.get_stock(tenant.id, "sku-1", "wh")
    assert (stock.on_hand, stock.available) == (5, 5)
    with pytest.raises(ReservationNotFound):
        await service.get_reservation(tenant.id, holds[0])
    again = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 1)])
    assert again.held and not again.replayed and again.reservation is not None
    assert again.reservation.id != holds[0]


async def test_the_callers_search_path_is_left_as_it_was(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
    """The caller's session and transaction-local search_path are the same after
    reserve, claim and release as before, inside the transaction and after it."""
    await service.set_stock(tenant.id, "sku-1", "wh", 5)
    await shop.execute("SET search_path TO public")

    async def path() -> object:
        cur = await shop.execute("SHOW search_path")
        row = await cur.fetchone()
        return None if row is None else row[0]

    async with shop.transaction():
        await shop.execute("SET LOCAL search_path TO pg_catalog, public")
        held = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 1)], conn=shop)
        assert held.reservation is not None
        assert await path() == "pg_catalog, public"
        await service.claim(tenant.id, held.reservation.id, conn=shop)
        other = await service.reserve(tenant.id, "order-2", [Line("sku-1", "wh", 1)],
                                      conn=shop)
        assert other.reservation is not None
        await service.release(tenant.id, other.reservation.id, request_key="r-2", conn=shop)
        assert await path() == "pg_catalog, public"
    assert await path() == "public"


async def test_a_refusal_is_typed_and_keeps_the_callers_transaction_usable(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
    """A refused operation raises its usual typed error and undoes only itself: the
    shop's transaction goes on and commits its own writes and the earlier claim."""
    await service.set_stock(tenant.id, "sku-1", "wh", 5)
    async with shop.transaction():
        await shop.execute("INSERT INTO public.shop_order VALUES ('order-1', NULL)")
        with pytest.raises(ReservationNotFound):
            await service.claim(tenant.id, "0b9a7c52-3c1e-4a4e-9a57-9a0d2f7a1c00", conn=shop)
        held = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 2)], conn=shop)
        assert held.reservation is not None
        await service.claim(tenant.id, held.reservation.id, conn=shop)
        with pytest.raises(ReservationClaimed):
            await service.release(tenant.id, held.reservation.id, conn=shop)
    assert await _orders(shop) == [("order-1",)]
    assert (await service.get_stock(tenant.id, "sku-1", "wh")).on_hand == 3


async def test_a_cart_change_commits_or_rolls_back_with_the_callers_transaction(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
    """change with conn= is part of the shop's transaction: rolled back, the hold keeps
    its old cart, the stock is as before and the key is free; committed, the new cart
    and the shop's row are both there; a refusal inside leaves the transaction usable."""
    await service.set_stock(tenant.id, "sku-1", "wh", 10)
    await service.set_stock(tenant.id, "sku-2", "wh", 4)
    held = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 2)])
    assert held.reservation is not None
    rid = held.reservation.id

    async def change_then_fail() -> None:
        async with shop.transaction():
            out = await service.change(tenant.id, rid, [Line("sku-1", "wh", 5),
                                                        Line("sku-2", "wh", 1)],
                                       request_key="change-1", conn=shop)
            assert out.held
            assert (await service.get_stock(tenant.id, "sku-1", "wh")).available == 8
            raise RuntimeError("payment provider down")

    with pytest.raises(RuntimeError, match="payment provider down"):
        await change_then_fail()
    before = await service.get_reservation(tenant.id, rid)
    assert [(x.sku, x.quantity) for x in before.lines] == [("sku-1", 2)]
    assert (await service.get_stock(tenant.id, "sku-1", "wh")).available == 8
    assert (await service.get_stock(tenant.id, "sku-2", "wh")).available == 4

    async with shop.transaction():
        with pytest.raises(ReservationNotFound):
            await service.change(tenant.id, "0b9a7c52-3c1e-4a4e-9a57-9a0d2f7a1c00",
                                 [Line("sku-1", "wh", 1)], request_key="change-x", conn=shop)
        out = await service.change(tenant.id, rid, [Line("sku-1", "wh", 5),
                                                    Line("sku-2", "wh", 1)],
                                   request_key="change-1", conn=shop)
        assert out.held and not out.replayed
        await shop.execute("INSERT INTO public.shop_order VALUES ('order-1', %s)", (rid,))
    assert await _orders(shop) == [("order-1",)]
    after = await service.get_reservation(tenant.id, rid)
    assert [(x.sku, x.quantity) for x in after.lines] == [("sku-1", 5), ("sku-2", 1)]
    assert (await service.get_stock(tenant.id, "sku-1", "wh")).available == 5
    assert (await service.get_stock(tenant.id, "sku-2", "wh")).available == 3
    replay = await service.change(tenant.id, rid, [Line("sku-1", "wh", 5),
                                                   Line("sku-2", "wh", 1)],
                                  request_key="change-1")
    assert replay.held and replay.replayed


async def test_a_connection_outside_a_transaction_is_refused(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
    """conn= on a connection with no open transaction is InvalidRequest and writes
    nothing (pgreserve never commits on the caller's connection)."""
    await service.set_stock(tenant.id, "sku-1", "wh", 5)
    with pytest.raises(InvalidRequest, match="open transaction"):
        await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 1)], conn=shop)
    assert (await service.get_stock(tenant.id, "sku-1", "wh")).available == 5
    again = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 1)])
    assert again.held and not again.replayed


async def test_the_callers_transaction_works_with_another_schema(
        pg_server: EmbeddedServer) -> None:
    """With the installation in schema `other`, reserve and claim on the shop's
    connection commit with the shop's order row."""
    dsn = _new_database(pg_server, "caller_other_schema")
    migrations.migrate(dsn, schema="other")
    async with Database(dsn, schema="other") as db, \
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as shop:
        service = ReservationService(db)
        tenant = await service.create_tenant("acme")
        await service.set_stock(tenant.id, "sku-1", "wh", 4)
        await shop.execute("CREATE TABLE public.shop_order (id text PRIMARY KEY)")
        async with shop.transaction():
            await shop.execute("INSERT INTO public.shop_order VALUES ('order-1')")
            held = await service.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 3)],
                                         conn=shop)
            assert held.reservation is not None
            await service.claim(tenant.id, held.reservation.id, request_key="c-1", conn=shop)
        cur = await shop.execute("SELECT on_hand FROM other.stock_bucket")
        assert await cur.fetchall() == [(1,)]
        assert await _orders(shop) == [("order-1",)]


@pytest.mark.parametrize("level", [psycopg.IsolationLevel.REPEATABLE_READ,
                                   psycopg.IsolationLevel.SERIALIZABLE],
                         ids=["repeatable-read", "serializable"])
async def test_a_snapshot_transaction_is_refused_so_a_freeze_holds(
        service: ReservationService, tenant: Tenant,
        shop: psycopg.AsyncConnection[tuple[object, ...]],
        level: psycopg.IsolationLevel) -> None:
    """A caller's REPEATABLE READ (or SERIALIZABLE) transaction that took its snapshot
    before a freeze committed would not see the freeze, and its hold would pass it:
    conn= needs READ COMMITTED, and such a transaction is InvalidRequest with nothing
    done (its own transaction still usable). Under READ COMMITTED the freeze holds."""
    await service.set_stock(tenant.id, "sku-1", "wh", 5)
    await shop.set_autocommit(False)
    await shop.set_isolation_level(level)
    async with shop.transaction():
        await shop.execute("SELECT count(*) FROM public.shop_order")  # the snapshot
        await service.freeze(tenant.id, "incident", "op", sku="sku-1", location="wh")
        with pytest.raises(InvalidRequest, match=r"READ COMMITTED transaction \(this one is "):
            await service.reserve(tenant.id, "late", [Line("sku-1", "wh", 2)], conn=shop)
        await shop.execute("INSERT INTO public.shop_order VALUES ('still-usable', NULL)")
    await shop.set_isolation_level(None)  # the server's default: READ COMMITTED
    await shop.set_autocommit(True)
    assert await _orders(shop) == [("still-usable",)]
    async with shop.transaction():
        await shop.execute("SELECT count(*) FROM public.shop_order")
        out = await service.reserve(tenant.id, "late", [Line("sku-1", "wh", 2)], conn=shop)
    assert not out.held and out.reason == "bucket_frozen"
    assert (await service.get_stock(tenant.id, "sku-1", "wh")).available == 5


Conns = tuple[psycopg.AsyncConnection[tuple[object, ...]], ...]


@pytest_asyncio.fixture
async def pool_of_ten(service: ReservationService, tenant: Tenant,
                      plain_dsn: str) -> AsyncIterator[Conns]:
    """SKU s at w: a pool of 10 units whose takes start at the lowest unit (no random
    start: who locks what is known), and three connections: admin, first, second."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy="pool", pool_cap=10)
    connect = psycopg.AsyncConnection.connect
    async with await connect(plain_dsn, autocommit=True) as admin, \
            await connect(plain_dsn, autocommit=True) as first, \
            await connect(plain_dsn, autocommit=True) as second:
        await admin.execute("UPDATE pgreserve.stock_bucket SET pool_hi = pool_lo"
                            " WHERE tenant_id = %s", (tenant.id,))
        await first.execute("BEGIN")
        await second.execute("BEGIN")
        yield admin, first, second


async def test_a_pool_take_hinted_to_wait_then_waits_for_a_slow_callers_units(
        service: ReservationService, tenant: Tenant, pool_of_ten: Conns) -> None:
    """A caller's transaction holds the 7 lowest of 10 pool units. Another caller wants
    6: its take locks the 3 highest and may not wait below them, so it fails with
    the hint `pgreserve: wait for units`, its transaction still open. With
    `pgreserve.wait_for_units` on, the same call waits for the first caller and then
    holds the units that caller gave back."""
    admin, first, second = pool_of_ten
    assert (await service.reserve(tenant.id, "first", [Line("s", "w", 7)], conn=first)).held
    with pytest.raises(psycopg.errors.SerializationFailure) as failed:
        await service.reserve(tenant.id, "second", [Line("s", "w", 6)], conn=second)
    assert failed.value.diag.message_hint == "pgreserve: wait for units"
    cur = await admin.execute("SELECT bucket_id FROM pgreserve.stock_bucket"
                              " WHERE tenant_id = %s", (tenant.id,))
    bucket = (await cur.fetchone() or (None,))[0]
    assert failed.value.diag.message_detail == str(bucket)  # which bucket to wait for
    await second.execute("SET LOCAL pgreserve.wait_for_units = 'on'")
    retry = asyncio.create_task(
        service.reserve(tenant.id, "second", [Line("s", "w", 6)], conn=second))
    for _ in range(500):
        cur = await admin.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'")
        if (await cur.fetchone() or (0,))[0]:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the retry never waited for the first caller's units")
    assert not retry.done()
    await first.execute("ROLLBACK")
    assert (await retry).held
    await second.execute("COMMIT")
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (6, 4)
    assert await service.invariant_violations() == []


@pytest.mark.parametrize(("on_hand", "first_qty"), [(10, 1), (100, 9)])
async def test_a_take_told_to_wait_for_units_does_not_wait_when_it_can_be_served(
        service: ReservationService, tenant: Tenant, pool_of_ten: Conns,
        on_hand: int, first_qty: int) -> None:
    """With `pgreserve.wait_for_units` on, a take first tries what nobody holds: a
    paused caller is not waited for when the pool's other units serve the take (10
    on hand, the caller holding the lowest unit) or when free stock does through a
    refill (100 on hand, the caller holding 9 of the pool's 10). A wait would end in
    lock_timeout, not in a hold."""
    admin, first, second = pool_of_ten
    if on_hand != 10:
        await service.set_stock(tenant.id, "s", "w", on_hand, strategy="pool", pool_cap=10)
        await admin.execute("UPDATE pgreserve.stock_bucket SET pool_hi = pool_lo"
                            " WHERE tenant_id = %s", (tenant.id,))
    assert (await service.reserve(tenant.id, "first", [Line("s", "w", first_qty)],
                                  conn=first)).held
    await second.execute("SET LOCAL pgreserve.wait_for_units = 'on'")
    await second.execute("SET LOCAL lock_timeout = '2s'")
    assert (await service.reserve(tenant.id, "second", [Line("s", "w", 3)],
                                  conn=second)).held
    await second.execute("COMMIT")
    await first.execute("COMMIT")
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (first_qty + 3, on_hand - first_qty - 3)
    assert await service.invariant_violations() == []
