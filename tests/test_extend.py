"""Extend never ends a hold sooner than it ends now, unless asked to."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from conftest import ApiTenant, Clock, table_counts
from pgreserve import ReservationService, Tenant
from pgreserve.client import Client
from pgreserve.errors import ExtendWouldShorten, IdempotencyKeyReused, InvalidRequest
from test_client import server  # noqa: F401 - the fixture
from test_http_api import assert_problem, put_stock, reserve


def expiries(dsn: str, rid: str) -> tuple[object, ...]:
    """The reservation's expires_at and those of its held lines, as stored."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT expires_at FROM reservation WHERE reservation_id = %s UNION ALL "
            "(SELECT expires_at FROM reservation_line WHERE reservation_id = %s"
            " ORDER BY line_no)", (rid, rid)).fetchall()
    return tuple(r[0] for r in rows)


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
async def test_a_shorter_time_to_live_is_refused_and_changes_nothing(
        timed: ReservationService, tenant: Tenant, clock: Clock, dsn: str,
        keyed: bool) -> None:
    """A hold ending in 600 s, extended by 60 s: ExtendWouldShorten, the stored expiry of the
    reservation and of its lines unchanged, no key stored; the same time to live with
    allow_shorten ends it 60 s from now; an equal or later end needs no flag."""
    await timed.set_stock(tenant.id, "s", "l", 5)
    await timed.set_stock(tenant.id, "t", "l", 5)
    out = await timed.reserve(tenant.id, "k", [("s", "l", 1), ("t", "l", 1)], ttl=600)
    assert out.reservation is not None
    rid = out.reservation.id
    key = "e1" if keyed else None
    before, counts = expiries(dsn, rid), table_counts(dsn)
    clock.advance(10)
    with pytest.raises(ExtendWouldShorten) as caught:
        await timed.extend(tenant.id, rid, 60, request_key=key)
    assert "allow_shorten" in str(caught.value)
    assert expiries(dsn, rid) == before and table_counts(dsn) == counts
    same_end = await timed.extend(tenant.id, rid, 590, request_key="e0" if keyed else None)
    assert same_end.expires_at == out.reservation.expires_at
    shorter = await timed.extend(tenant.id, rid, 60, request_key=key, allow_shorten=True)
    assert shorter.expires_at == clock.now + timedelta(seconds=60)
    assert set(expiries(dsn, rid)) == {shorter.expires_at}
    longer = await timed.extend(tenant.id, rid, 3600, request_key="e2" if keyed else None)
    assert longer.expires_at == clock.now + timedelta(seconds=3600)


async def test_a_key_used_with_allow_shorten_is_not_reused_without_it(
        timed: ReservationService, tenant: Tenant, clock: Clock) -> None:
    """A keyed extend that shortened replays for the same request; the same key without
    allow_shorten is another request (IdempotencyKeyReused), and a non-boolean flag is
    InvalidRequest."""
    await timed.set_stock(tenant.id, "s", "l", 5)
    out = await timed.reserve(tenant.id, "k", [("s", "l", 1)], ttl=600)
    assert out.reservation is not None
    rid = out.reservation.id
    first = await timed.extend(tenant.id, rid, 30, request_key="e", allow_shorten=True)
    clock.advance(5)
    again = await timed.extend(tenant.id, rid, 30, request_key="e", allow_shorten=True)
    assert again.replayed and again.expires_at == first.expires_at
    with pytest.raises(IdempotencyKeyReused):
        await timed.extend(tenant.id, rid, 30, request_key="e")
    with pytest.raises(InvalidRequest):
        await timed.extend(tenant.id, rid, 30, allow_shorten=1)  # type: ignore[arg-type]  # bad on purpose


async def test_http_extend_refuses_to_shorten_unless_asked(api: ApiTenant) -> None:
    """POST /extend with a time to live ending sooner: 409 extend_would_shorten and the
    expiry unchanged; with "allow_shorten": true it is shortened; a non-boolean flag is
    422."""
    await put_stock(api, "s", 5)
    created = (await reserve(api, "k1", [("s", "wh", 1)], ttl=900)).json()
    rid = created["id"]
    url = f"/v1/reservations/{rid}/extend"
    assert_problem(await api.client.post(url, json={"ttl_seconds": 60}), 409,
                   "extend_would_shorten")
    assert (await api.client.get(f"/v1/reservations/{rid}")).json()["expires_at"] == (
        created["expires_at"])
    shortened = await api.client.post(url, json={"ttl_seconds": 60, "allow_shorten": True})
    assert shortened.status_code == 200, shortened.text
    assert shortened.json()["expires_at"] < created["expires_at"]
    assert_problem(await api.client.post(url, json={"ttl_seconds": 60, "allow_shorten": "yes"}),
                   422, "invalid_request")


def test_client_extend_raises_the_typed_error(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The typed client raises ExtendWouldShorten for a shorter time to live and shortens
    with allow_shorten=True."""
    base, key = server
    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 5)
        out = shop.reserve([("tee", "berlin", 1)], ttl_seconds=900)
        assert out.reservation is not None
        with pytest.raises(ExtendWouldShorten):
            shop.extend(out.reservation.id, 60)
        shorter = shop.extend(out.reservation.id, 60, allow_shorten=True)
        assert shorter.expires_at < out.reservation.expires_at


@pytest.mark.parametrize("strategy", ["row", "pool"])
async def test_an_extend_that_waited_past_expiry_refuses_a_hold_given_up_meanwhile(
        service: ReservationService, tenant: Tenant, dsn: str, strategy: str) -> None:
    """An extend that waits for the reservation's lock across its expiry, while another
    buyer's reserve gives up its expired line and takes the unit, is refused as not
    active: it does not answer "active for 60 s more" for a hold that holds nothing
    (whose claim would then fail). Judged on the clock read after the lock wait."""
    import asyncio
    from datetime import UTC, datetime

    from pgreserve.errors import ReservationNotActive
    from test_concurrency import wait_until_blocked

    await service.set_stock(tenant.id, "hot", "wh", 1, strategy=strategy)
    first = (await service.reserve(tenant.id, "a", [("hot", "wh", 1)], ttl=1)).reservation
    assert first is not None
    with psycopg.connect(dsn) as blocker:  # the header locked, as any transaction can
        blocker.execute("SELECT 1 FROM reservation WHERE reservation_id = %s FOR UPDATE",
                        (first.id,))
        extend = asyncio.create_task(service.extend(tenant.id, first.id, 60))
        await wait_until_blocked(dsn)
        await asyncio.sleep(max(0.0, (first.expires_at - datetime.now(UTC)).total_seconds())
                            + 0.2)
        second = await service.reserve(tenant.id, "b", [("hot", "wh", 1)], ttl=600)
        assert second.held  # the unit of the expired hold, given up
        blocker.rollback()
    with pytest.raises(ReservationNotActive):
        await extend
    now = await service.get_reservation(tenant.id, first.id)
    assert now.status.value == "expired" and now.expires_at == first.expires_at
    assert expiries(dsn, first.id) == (first.expires_at, first.expires_at)
    stock = await service.get_stock(tenant.id, "hot", "wh")
    assert (stock.on_hand, stock.reserved, stock.available) == (1, 1, 0)
    assert await service.invariant_violations() == []
