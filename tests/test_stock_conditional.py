"""Stock versions in the library: conditional counts and adjustments decided by the
database's write, raced by real concurrent writers; the keyset stock listing."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conftest import table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.core.service import stock_cursor
from pgreserve.errors import InvalidCursor, InvalidRequest, PreconditionFailed, UnknownStock


async def wait_for_lock_waiters(dsn: str, count: int) -> None:
    """Wait until `count` pgreserve backends of this database wait on a lock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(1000):
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE 'pgreserve:%%' AND wait_event_type = 'Lock'"
            ).fetchone()
            assert row is not None
            if row[0] >= count:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{count} writers never all waited on the lock")


def version_of(dsn: str, tenant: int, sku: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT version FROM stock_bucket WHERE tenant_id = %s AND sku = %s",
                           (tenant, sku)).fetchone()
        assert row is not None
        return int(row[0])


async def test_a_count_moves_the_version_and_holds_claims_releases_do_not(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A new line is at version 1; every count or adjustment moves it by one; holds, claims,
    releases and expiry leave it where it was."""
    first = await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    assert first.version == 1 and first.created
    held = await service.reserve(tenant.id, "k1", [("s", "w", 3)], ttl=1)
    other = await service.reserve(tenant.id, "k2", [("s", "w", 2)])
    assert held.reservation is not None and other.reservation is not None
    await service.claim(tenant.id, other.reservation.id)
    third = await service.reserve(tenant.id, "k3", [("s", "w", 1)])
    assert third.reservation is not None
    await service.release(tenant.id, third.reservation.id)
    await asyncio.sleep(1.1)
    await service.expire_due()
    seen = await service.get_stock(tenant.id, "s", "w")
    assert seen.version == 1 and seen.on_hand == 8
    counted = await service.set_stock(tenant.id, "s", "w", 8, if_match=1)
    assert counted.version == 2 and not counted.created
    adjusted = await service.adjust_stock(tenant.id, "a1", "s", "w", 4, if_match=2)
    assert adjusted.version == 3 and adjusted.on_hand == 12


async def test_a_stale_version_writes_nothing(service: ReservationService, tenant: Tenant,
                                              dsn: str, strategy: str) -> None:
    """A count or adjustment whose if_match is not the line's version raises
    PreconditionFailed with the current version, and no table changes."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    await service.set_stock(tenant.id, "s", "w", 9)
    await service.reserve(tenant.id, "k1", [("s", "w", 2)])
    before = table_counts(dsn)
    with pytest.raises(PreconditionFailed) as failed:
        await service.set_stock(tenant.id, "s", "w", 50, if_match=1)
    assert failed.value.details["version"] == 2
    for delta in (5, -3):
        with pytest.raises(PreconditionFailed):
            await service.adjust_stock(tenant.id, f"adj{delta}", "s", "w", delta, if_match=[1, 7])
    assert table_counts(dsn) == before
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.version) == (9, 2, 2)
    if strategy == "pool":
        assert view.pool == 7  # the drained pool was put back: nothing of the write is left
    # the key of a refused adjustment was not used: it runs now
    done = await service.adjust_stock(tenant.id, "adj-3", "s", "w", -3, if_match=2)
    assert done.on_hand == 6 and not done.replayed


async def test_exists_and_create_only(service: ReservationService, tenant: Tenant,
                                      dsn: str) -> None:
    """if_match="*" never creates a line, create_only never changes one; each refusal
    writes nothing."""
    before = table_counts(dsn)
    with pytest.raises(PreconditionFailed) as failed:
        await service.set_stock(tenant.id, "s", "w", 5, if_match="*")
    assert failed.value.details["version"] is None
    with pytest.raises(PreconditionFailed):
        await service.set_stock(tenant.id, "s", "w", 5, if_match=1)
    assert table_counts(dsn) == before
    made = await service.set_stock(tenant.id, "s", "w", 5, create_only=True)
    assert made.created and made.version == 1
    after_create = table_counts(dsn)
    with pytest.raises(PreconditionFailed):
        await service.set_stock(tenant.id, "s", "w", 99, create_only=True)
    assert table_counts(dsn) == after_create
    assert (await service.set_stock(tenant.id, "s", "w", 6, if_match="*")).version == 2
    with pytest.raises(InvalidRequest):
        await service.set_stock(tenant.id, "s", "w", 6, if_match="*", create_only=True)
    with pytest.raises(InvalidRequest):
        await service.set_stock(tenant.id, "s", "w", 6, if_match=0)


async def test_an_adjustment_replay_ignores_the_version(service: ReservationService,
                                                        tenant: Tenant) -> None:
    """A replayed adjustment key returns its stored answer, even when its if_match no longer
    holds; an unknown line is still 404, not a precondition failure."""
    await service.set_stock(tenant.id, "s", "w", 5)
    first = await service.adjust_stock(tenant.id, "a", "s", "w", 2, if_match=1)
    again = await service.adjust_stock(tenant.id, "a", "s", "w", 2, if_match=1)
    assert again.replayed and (again.on_hand, again.version) == (first.on_hand, first.version)
    with pytest.raises(UnknownStock):
        await service.adjust_stock(tenant.id, "b", "nope", "w", 2, if_match=1)


@pytest.mark.parametrize("write", ["set", "receipt", "correction"])
async def test_writers_with_one_version_exactly_one_wins(dsn: str, strategy: str,
                                                         write: str) -> None:
    """Eight writers holding the same version, queued behind a lock on the bucket row and
    let go at once: exactly one writes, seven get PreconditionFailed, and the books show
    only the winner's write."""
    async with Database(dsn, min_size=10, max_size=10) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("race")
        await service.set_stock(tenant.id, "s", "w", 100, strategy=strategy)
        await service.reserve(tenant.id, "held", [("s", "w", 5)])
        version = (await service.get_stock(tenant.id, "s", "w")).version
        assert version == 1

        async def writer(i: int) -> int | None:
            try:
                if write == "set":
                    view = await service.set_stock(tenant.id, "s", "w", 200 + i,
                                                   if_match=version)
                else:
                    delta = i + 1 if write == "receipt" else -(i + 1)
                    view = await service.adjust_stock(tenant.id, f"w{i}", "s", "w", delta,
                                                      if_match=version)
            except PreconditionFailed:
                return None
            return view.on_hand

        with psycopg.connect(dsn) as blocker:
            blocker.execute("SELECT 1 FROM stock_bucket WHERE tenant_id = %s FOR UPDATE",
                            (tenant.id,))
            tasks = [asyncio.create_task(writer(i)) for i in range(8)]
            await wait_for_lock_waiters(dsn, 8)
            blocker.commit()
            results = await asyncio.gather(*tasks)
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        final = await service.get_stock(tenant.id, "s", "w")
        assert final.on_hand == winners[0] and final.version == version + 1
        assert final.reserved == 5
        with psycopg.connect(dsn) as conn:
            movements = conn.execute(
                "SELECT count(*) FROM stock_movement WHERE tenant_id = %s AND kind <> 'restore'",
                (tenant.id,)).fetchone()
            keys = conn.execute("SELECT count(*) FROM request_ledger WHERE tenant_id = %s"
                                " AND operation = 'adjust'", (tenant.id,)).fetchone()
            broken = conn.execute("SELECT count(*) FROM invariant_violations_v1(%s)",
                                  (tenant.id,)).fetchone()
        assert movements == (2,)  # the first count and the winner's write
        assert keys == ((0,) if write == "set" else (1,))
        assert broken == (0,)


async def test_create_only_racers_create_one_line(dsn: str) -> None:
    """Eight create-only writers of one new line at once: one creates it, seven get
    PreconditionFailed, and the line has the creator's count."""
    async with Database(dsn, min_size=10, max_size=10) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("race")

        async def creator(i: int) -> int | None:
            try:
                return (await service.set_stock(tenant.id, "new", "w", 10 + i,
                                                create_only=True)).on_hand
            except PreconditionFailed:
                return None

        results = await asyncio.gather(*(creator(i) for i in range(8)))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        final = await service.get_stock(tenant.id, "new", "w")
        assert final.on_hand == winners[0] and final.version == 1


async def test_listing_pages_through_every_line_once_in_byte_order(
        service: ReservationService, tenant: Tenant) -> None:
    """Pages of 3 return every line of the tenant once, ordered by (sku, location) in
    code-point order, and the last page has no cursor; another tenant's lines never show."""
    names = ["b", "a", "B", "a-1", "ä", "z", "a"]
    for i, sku in enumerate(names):
        await service.set_stock(tenant.id, sku, f"loc{i % 2}", i)
    stranger = await service.create_tenant("stranger")
    await service.set_stock(stranger.id, "a", "loc9", 1)
    expected = sorted({(sku, f"loc{i % 2}") for i, sku in enumerate(names)})
    seen: list[tuple[str, str]] = []
    cursor = None
    pages = 0
    while True:
        page = await service.list_stock(tenant.id, limit=3, after=cursor)
        pages += 1
        seen.extend((v.sku, v.location) for v in page.stock)
        if page.next_cursor is None:
            break
        assert len(page.stock) == 3
        cursor = page.next_cursor
    assert seen == expected and pages == 3


async def test_listing_filters(service: ReservationService, tenant: Tenant) -> None:
    """An SKU prefix, a list of SKUs and a location narrow the listing, alone and together,
    across pages."""
    for sku in ["tee-red", "tee-blue", "teeth", "cap", "te"]:
        for loc in ["berlin", "paris"]:
            await service.set_stock(tenant.id, sku, loc, 1)

    async def every(**filters: object) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        cursor = None
        while True:
            page = await service.list_stock(tenant.id, limit=2, after=cursor,
                                            **filters)  # type: ignore[arg-type]  # filters are the keyword arguments of list_stock
            out.extend((v.sku, v.location) for v in page.stock)
            if page.next_cursor is None:
                return out
            cursor = page.next_cursor

    assert await every(sku_prefix="tee-") == [("tee-blue", "berlin"), ("tee-blue", "paris"),
                                              ("tee-red", "berlin"), ("tee-red", "paris")]
    assert await every(skus=["cap", "te", "nope"], location="paris") == [
        ("cap", "paris"), ("te", "paris")]
    assert await every(sku_prefix="tee", location="berlin") == [
        ("tee-blue", "berlin"), ("tee-red", "berlin"), ("teeth", "berlin")]
    assert await every(sku_prefix="zzz") == []


async def test_listing_is_stable_under_concurrent_inserts(service: ReservationService,
                                                          tenant: Tenant) -> None:
    """Lines created between pages, before and after the cursor, never make an existing
    line repeat or go missing; those after the cursor are listed, those before are not."""
    for i in range(0, 40, 2):
        await service.set_stock(tenant.id, f"s{i:03d}", "w", 1)
    page = await service.list_stock(tenant.id, limit=10)
    seen = [v.sku for v in page.stock]
    assert seen[-1] == "s018"
    for i in range(1, 40, 2):  # every odd SKU: half sort before the cursor, half after
        await service.set_stock(tenant.id, f"s{i:03d}", "w", 1)
    cursor = page.next_cursor
    while cursor is not None:
        page = await service.list_stock(tenant.id, limit=10, after=cursor)
        seen.extend(v.sku for v in page.stock)
        cursor = page.next_cursor
    assert len(seen) == len(set(seen))
    assert {f"s{i:03d}" for i in range(0, 40, 2)} <= set(seen)
    assert {s for s in seen if int(s[1:]) % 2} == {f"s{i:03d}" for i in range(19, 40, 2)}


async def test_listing_refuses_bad_cursors_and_limits(service: ReservationService,
                                                      tenant: Tenant) -> None:
    """A cursor the listing did not make is InvalidCursor; a limit outside 1..1000, an empty
    or oversized SKU list is InvalidRequest."""
    for bad in ["nope", "s1.", "s1.!!!", "s1." + "e30", stock_cursor("a", "b")[:-2] + "__"]:
        with pytest.raises(InvalidCursor):
            await service.list_stock(tenant.id, after=bad)
    for limit in (0, 1001):
        with pytest.raises(InvalidRequest):
            await service.list_stock(tenant.id, limit=limit)
    for skus in ([], [f"s{i}" for i in range(101)]):
        with pytest.raises(InvalidRequest):
            await service.list_stock(tenant.id, skus=skus)
    assert (await service.list_stock(tenant.id, after=stock_cursor("a", "b"))).stock == ()
