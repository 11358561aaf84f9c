"""Reference, metadata and the reservation listing through the typed clients, the
rollout layer beside Redis, and a database upgraded from the signatures without them."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from conftest import table_counts
from pgreserve import Database, ReservationService, Tenant, errors
from pgreserve.client import AsyncClient, Client
from pgreserve.db import migrate as migrations
from pgreserve.rollout import Mode, RedisHoldStore, Rollout, set_mode
from test_client import server  # noqa: F401 - the fixture
from test_migrations import empty_dsn  # noqa: F401 - the fixture
from test_rollout import redis_server, rollout, seed, store  # noqa: F401 - the fixtures


def test_sync_client_reserves_with_reference_and_lists(
        server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """Client.reserve sends reference and metadata and gets them back; list_reservations
    pages newest first by cart and status, and iter_reservations walks every page."""
    base, key = server
    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 10)
        a = shop.reserve([("tee", "berlin", 1)], reference="cart-1", metadata={"o": "1"})
        b = shop.reserve([("tee", "berlin", 1)], reference="cart-1")
        c = shop.reserve([("tee", "berlin", 1)])
        assert a.reservation is not None and b.reservation is not None
        assert c.reservation is not None
        assert (a.reservation.reference, a.reservation.metadata) == ("cart-1", {"o": "1"})
        assert (c.reservation.reference, c.reservation.metadata) == (None, {})
        shop.claim(b.reservation.id)
        page = shop.list_reservations(cart="cart-1", limit=1)
        assert [r.id for r in page.reservations] == [b.reservation.id]
        assert page.next_cursor is not None
        rest = shop.list_reservations(cart="cart-1", cursor=page.next_cursor)
        assert [r.id for r in rest.reservations] == [a.reservation.id]
        assert rest.next_cursor is None and rest.reservations[0].metadata == {"o": "1"}
        assert [r.id for r in shop.iter_reservations(limit=1)] == [
            c.reservation.id, b.reservation.id, a.reservation.id]
        claimed = shop.list_reservations(status=["claimed"])
        assert [r.id for r in claimed.reservations] == [b.reservation.id]
        with pytest.raises(errors.InvalidCursor):
            shop.list_reservations(cursor="r1.nope")
        with pytest.raises(errors.InvalidRequest):
            shop.reserve([("tee", "berlin", 1)], metadata={"k" * 41: "v"})


async def test_async_client_reserves_with_reference_and_lists(
        server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """AsyncClient does the same: reference and metadata on reserve, a replay with other
    metadata is IdempotencyKeyReused, and the listing pages by cart and status."""
    base, key = server
    async with AsyncClient(base, key) as shop:
        await shop.set_stock("cap", "paris", 10)
        out = await shop.reserve([("cap", "paris", 2)], reference="order-9",
                                 metadata={"channel": "app"}, idempotency_key="k1")
        assert out.reservation is not None
        assert out.reservation.metadata == {"channel": "app"}
        with pytest.raises(errors.IdempotencyKeyReused):
            await shop.reserve([("cap", "paris", 2)], reference="order-9",
                               metadata={"channel": "web"}, idempotency_key="k1")
        page = await shop.list_reservations(cart="order-9", status="active")
        assert [r.id for r in page.reservations] == [out.reservation.id]
        assert page.reservations[0].reference == "order-9"
        assert [r.id async for r in shop.iter_reservations(cart="order-9")] == [
            out.reservation.id]
        assert (await shop.list_reservations(status=["released"])).reservations == ()


async def test_redis_modes_refuse_reference_metadata_and_listing(
        rollout: Rollout, service: ReservationService,  # noqa: F811 - the fixture
        store: RedisHoldStore, tenant: Tenant, db: Database,  # noqa: F811 - the fixture
        dsn: str) -> None:
    """While Redis answers (legacy, shadow), a reserve with a reference or metadata and the
    listing raise UnsupportedInRolloutMode and write nothing in either store; a plain
    reserve still holds. In primary and pgreserve modes both are kept and listed."""
    await seed(service, store, tenant.id, "tee", 10)
    for mode in (Mode.LEGACY, Mode.SHADOW):
        await set_mode(db, tenant.id, mode, "test")
        before, held_before = table_counts(dsn), await store.held(tenant.id, "tee", "berlin")
        for kw in ({"reference": "cart-1"}, {"metadata": {"a": "b"}}):
            with pytest.raises(errors.UnsupportedInRolloutMode):
                await rollout.reserve(tenant.id, f"k-{mode.value}", [("tee", "berlin", 1)],
                                      ttl=60, **kw)
        with pytest.raises(errors.UnsupportedInRolloutMode):
            await rollout.list_reservations(tenant.id)
        assert table_counts(dsn) == before
        assert await store.held(tenant.id, "tee", "berlin") == held_before
        assert (await rollout.reserve(tenant.id, f"plain-{mode.value}",
                                      [("tee", "berlin", 1)], ttl=60)).held
    for mode in (Mode.PRIMARY, Mode.PGRESERVE):
        await set_mode(db, tenant.id, mode, "test")
        out = await rollout.reserve(tenant.id, f"k-{mode.value}", [("tee", "berlin", 1)],
                                    ttl=60, reference=f"cart-{mode.value}",
                                    metadata={"m": mode.value})
        assert out.reservation is not None
        assert out.reservation.reference == f"cart-{mode.value}"
        again = await rollout.reserve(tenant.id, f"k-{mode.value}", [("tee", "berlin", 1)],
                                      ttl=60, reference=f"cart-{mode.value}",
                                      metadata={"m": mode.value})
        assert again.replayed
        listed = await rollout.list_reservations(tenant.id, reference=f"cart-{mode.value}")
        assert [r.id for r in listed.reservations] == [out.reservation.id]
        assert listed.reservations[0].metadata == {"m": mode.value}
    assert await service.invariant_violations() == []


def test_an_upgraded_database_keeps_one_reserve_and_batch_function(empty_dsn: str) -> None:  # noqa: F811
    """A database migrated to 0006 with reserve_v1 and bucket_batch_v1 in their earlier
    signatures has, after the upgrade, only the ones with reference and metadata, and a
    call in the earlier form (as a previous release sends it) resolves to them."""
    migrations.migrate(empty_dsn, target=6)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        # the earlier signatures, as the previous release's function files made them
        conn.execute("CREATE FUNCTION reserve_v1(bigint, text, text, text[], text[], integer[],"
                     " interval, timestamptz DEFAULT NULL) RETURNS jsonb LANGUAGE sql"
                     " AS $$ SELECT '{}'::jsonb $$")
        conn.execute("CREATE FUNCTION bucket_batch_v1(bigint, bigint, text[], text[], text[],"
                     " integer[], interval[], uuid[], timestamptz DEFAULT NULL) RETURNS jsonb"
                     " LANGUAGE sql AS $$ SELECT '[]'::jsonb $$")
    migrations.migrate(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT proname, pronargs FROM pg_proc WHERE proname IN"
                            " ('reserve_v1', 'bucket_batch_v1') ORDER BY 1").fetchall()
        assert rows == [("bucket_batch_v1", 11), ("reserve_v1", 10)]
        tenant = conn.execute("SELECT tenant_create_v1('t', %s)", (b"k" * 32,)).fetchone()
        assert tenant is not None
        conn.execute("SELECT stock_set_v1(%s, 'tee', 'w', 5)", (tenant[0],))
        held = conn.execute("SELECT reserve_v1(%s, 'k', 'd', '{tee}', '{w}', '{1}', %s)",
                            (tenant[0], timedelta(minutes=15))).fetchone()
    assert held is not None and held[0]["status"] == "held"
    assert held[0]["reservation"]["reference"] is None
    assert held[0]["reservation"]["metadata"] == {}
