"""A stock count racing a cart line: no rejection while the bucket could serve it.

Each test pauses a count, a strategy switch or a receipt before COMMIT on a raw
connection, lets the service's cart reach the point where it waits for that
bucket (pg_stat_activity tells when), then commits the stock change. The
assertions state the promise: a line the bucket can serve at the instant the
take decides is held, and a stored rejection never shows more available than
was requested.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pgreserve import Database, ReservationService, Tenant
from pgreserve.core.service import digest
from test_concurrency import wait_until_blocked


class Earlier:
    """The database clock an hour behind: a hold made with it is already past its expiry."""

    def __call__(self) -> datetime:
        return datetime.now(UTC) - timedelta(hours=1)


COUNT_SQL = ("SELECT stock_set_v3(%s, %s, 'w', %s, %s, false, NULL, NULL, NULL, NULL, NULL,"
             " NULL)")


async def expired_hold(db: Database, tenant: int, sku: str, qty: int) -> None:
    """Hold qty units of sku that are past their expiry, with no sweeper to give them up."""
    earlier = ReservationService(db, clock=Earlier(), batching=False)
    out = await earlier.reserve(tenant, f"old-{sku}", [(sku, "w", qty)], ttl=60)
    assert out.held


# (a pool line of 15 is short at once: its bucket then has 5 units, all in the expired hold)
@pytest.mark.parametrize(("before", "after", "qty"), [
    ("row", "pool", 1), ("row", "pool", 15), ("row", "row", 1), ("row", "row", 15),
    ("pool", "row", 1)])
async def test_cart_line_waiting_to_give_up_expired_holds_survives_a_count(
        dsn: str, db: Database, tenant: Tenant, before: str, after: str, qty: int) -> None:
    """A cart line whose bucket's only units are an expired hold, waiting for a count (a switch from `before` to `after`) to commit, is held from the counted stock (from the pool, or beyond it: 15 of a pool of 10), not stored as short."""
    service = ReservationService(db, batching=False)
    await service.set_stock(tenant.id, "cart-0", "w", 5, strategy=before, pool_cap=10)
    await service.set_stock(tenant.id, "cart-3", "w", 10, strategy="row")
    await expired_hold(db, tenant.id, "cart-0", 5)  # free 0, every unit in an expired hold
    with psycopg.connect(dsn, application_name="count") as count:
        # the count (20 units, switching the strategy) has locked the bucket and its
        # lines and is paused before COMMIT; the cart read the old strategy
        count.execute(COUNT_SQL, (tenant.id, "cart-0", 20, after))
        cart = asyncio.create_task(service.reserve(
            tenant.id, "cart", [("cart-0", "w", qty), ("cart-3", "w", 2)]))
        await wait_until_blocked(dsn)
        assert not cart.done()
        count.commit()
    out = await cart
    view = await service.get_stock(tenant.id, "cart-0", "w")
    # from the count's commit on, 20 units were there and none was held
    assert out.held, (f"cart rejected with {out.short_lines}; cart-0 now shows"
                      f" {view.available} available")
    assert (view.strategy.value, view.on_hand, view.reserved, view.available) == (
        after, 20, qty, 20 - qty)
    assert await service.invariant_violations() == []


async def test_short_line_served_from_free_after_a_receipt_is_held_under_a_lowered_limit(
        dsn: str, db: Database, tenant: Tenant) -> None:
    """A line found short, whose backorder step finds a receipt's units free, is held from them even when the allowance is used up (backorder limit lowered below the backordered units)."""
    service = ReservationService(db, batching=False)
    await service.set_stock(tenant.id, "tee", "w", 2, strategy="row", backorder_limit=3)
    await service.set_stock(tenant.id, "cap", "w", 10, strategy="row")
    first = await service.reserve(tenant.id, "first", [("tee", "w", 5)])
    assert first.reservation is not None
    assert [line.backordered for line in first.reservation.lines] == [3]
    # the limit lowered under the 3 backordered units: no allowance is left
    view = await service.set_stock(tenant.id, "tee", "w", 2, backorder_limit=1)
    assert (view.available, view.backorder_held) == (0, 3)
    fp = digest("adjust", {"receipt": 10})
    with psycopg.connect(dsn, application_name="receipt") as receipt:
        # a receipt of 10 has written the bucket row and is paused before COMMIT
        receipt.execute("SELECT stock_adjust_v2(%s, 'rcpt', %s, 'tee', 'w', 10, 'receipt',"
                        " false, NULL, NULL)", (tenant.id, fp))
        cart = asyncio.create_task(service.reserve(
            tenant.id, "cart", [("cap", "w", 1), ("tee", "w", 1)]))
        await wait_until_blocked(dsn)
        assert not cart.done()
        receipt.commit()
    out = await cart
    # decided under the bucket's lock, after the receipt: 10 units were free
    assert out.held, f"cart rejected with {out.short_lines}"
    assert out.reservation is not None
    assert [(line.sku, line.backordered) for line in out.reservation.lines] == [
        ("cap", 0), ("tee", 0)]
    after = await service.get_stock(tenant.id, "tee", "w")
    assert (after.on_hand, after.available, after.backorder_held) == (12, 9, 3)
    assert await service.invariant_violations() == []
