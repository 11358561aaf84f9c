"""Pool operations that wait (for units a paused buyer locked, for a stock change holding
the bucket) decide at the instant they decide, and in the one lock order: a hold's life
starts when it is held, a count judges expiry when it counts, and a late claim never
holds units while it waits for the bucket row."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from pgreserve import AllocatedLine, Database, ReservationService
from test_concurrency import reserve_sql, wait_until_blocked

LOC = "w"


@pytest.mark.parametrize("path", ["unbatched", "batched", "allocated"])
async def test_a_hold_that_waited_for_pool_units_lives_its_whole_ttl(
        dsn: str, db: Database, path: str) -> None:
    """A one-unit buyer (ttl 1 s) waits 1.5 s for the one unit a short pool buyer keeps
    locked, then is held. Its life counts from then: it is active when read right after,
    and its unit is not sold to the next buyer. Before, created_at and expires_at were
    taken when the call began, so the hold was told `active` already past its expiry."""
    service = ReservationService(db, batching=path == "batched")
    tenant = await service.create_tenant("born")
    await service.set_stock(tenant.id, "s", LOC, 1, strategy="pool")
    sql, params = reserve_sql(tenant.id, "short", "s", LOC, 2)
    with psycopg.connect(dsn, application_name="short-buyer") as short:
        short.execute(sql, params)  # locks the one unit, is short, paused before COMMIT
        line: Any = AllocatedLine("s", 1) if path == "allocated" else ("s", LOC, 1)
        one = asyncio.create_task(service.reserve(tenant.id, "one", [line], ttl=1))
        await wait_until_blocked(dsn)
        await asyncio.sleep(1.5)
        short.commit()
    out = await one
    assert out.held and out.reservation is not None
    now = await service.get_reservation(tenant.id, out.reservation.id)
    assert now.status.value == "active", (out.reservation.created_at,
                                          out.reservation.expires_at)
    assert not (await service.reserve(tenant.id, "next", [("s", LOC, 1)])).held
    assert await service.invariant_violations(tenant.id) == []


@pytest.mark.parametrize("change", ["count", "correction", "forced_count"])
async def test_a_stock_change_that_waited_gives_up_holds_that_expired_meanwhile(
        dsn: str, service: ReservationService, change: str) -> None:
    """5 units in a pool, a hold of 3 (ttl 1 s). A count to 2 (or a correction of -3)
    waits in the pool drain for a paused short buyer while the hold passes its expiry.
    When it decides, that hold no longer counts (a count or correction is not refused by
    holds past their expiry, docs/guarantees.md): on hand 2, nothing reserved, no
    shortfall. Before, it judged expiry at the call's start: WouldOversell, or a forced
    count recorded the expired hold's units as missing."""
    tenant = await service.create_tenant("late-count")
    await service.set_stock(tenant.id, "s", LOC, 5, strategy="pool")
    assert (await service.reserve(tenant.id, "h", [("s", LOC, 3)], ttl=1)).held
    sql, params = reserve_sql(tenant.id, "short", "s", LOC, 3)
    with psycopg.connect(dsn, application_name="short-buyer") as short:
        short.execute(sql, params)  # locks the 2 units left, is short, paused before COMMIT
        task: asyncio.Task[Any]
        if change == "correction":
            task = asyncio.create_task(
                service.adjust_stock(tenant.id, "lost-3", "s", LOC, -3, reason="lost"))
        else:
            task = asyncio.create_task(
                service.set_stock(tenant.id, "s", LOC, 2, force=change == "forced_count"))
        await wait_until_blocked(dsn)
        await asyncio.sleep(1.5)  # the hold's second passes while the change waits
        short.commit()
    view = await task
    assert (view.on_hand, view.reserved, view.shortfall) == (2, 0, 0), view
    assert await service.invariant_violations(tenant.id) == []


async def test_a_late_claim_takes_the_bucket_before_its_units(dsn: str, db: Database) -> None:
    """A hold expired and was swept (its units back in the pool). A count holds the
    bucket row and drains the pool in unit order, waiting for the lowest unit, which a
    paused session keeps. A late claim of the hold then waits for the bucket row before
    it takes a unit, so the count, once the unit is free, drains and commits, and the
    claim goes after it: no deadlock (before, the claim took two higher units, then
    waited for the bucket the count held while the count waited for those units)."""
    service = ReservationService(db, batching=False)
    tenant = (await service.create_tenant("late-claim")).id
    await service.set_stock(tenant, "s", LOC, 6, strategy="pool")
    late = await service.reserve(tenant, "late", [("s", LOC, 2)], ttl=1)
    assert late.reservation is not None
    await asyncio.sleep(1.2)
    assert await service.expire_due() == 1
    with psycopg.connect(dsn, application_name="slow-buyer") as slow:
        slow.execute("SELECT unit_id FROM pgreserve.stock_unit WHERE tenant_id = %s"
                     " ORDER BY unit_id LIMIT 1 FOR UPDATE", (tenant,))
        count = asyncio.create_task(service.set_stock(tenant, "s", LOC, 6))
        await wait_until_blocked(dsn)  # the drain waits for the lowest unit
        claim = asyncio.create_task(service.claim(tenant, late.reservation.id))
        await wait_until_blocked(dsn, 2)  # the claim waits too
        slow.rollback()
    counted, claimed = await asyncio.gather(count, claim)
    assert counted.on_hand == 6 and claimed.status.value == "claimed"
    assert db.stats.deadlocks_retried == 0
    stock = await service.get_stock(tenant, "s", LOC)
    assert (stock.on_hand, stock.reserved) == (4, 0)
    assert await service.invariant_violations(tenant) == []
