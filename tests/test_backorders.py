"""Backorders per bucket: holds beyond on_hand up to a limit, marked per line, owed once
claimed until receipts cover them, and given back exactly once on release or expiry."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conftest import ApiTenant, Clock, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.client import AsyncClient, Client
from pgreserve.errors import WouldOversell
from test_client import server  # noqa: F401 - the fixture
from test_http_api import assert_problem, put_stock, reserve

BATCHING = pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])


def books(dsn: str, tenant: int, sku: str, location: str = "w") -> dict[str, int]:
    """A bucket's counters and its held lines' backordered units, straight from the tables."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT b.on_hand, b.free, b.backorder_held, b.backorder_owed,"
            " (SELECT coalesce(sum(l.backordered), 0) FROM reservation_line l"
            "   WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held)"
            " FROM stock_bucket b WHERE b.tenant_id = %s AND b.sku = %s AND b.location = %s",
            (tenant, sku, location)).fetchone()
    assert row is not None
    return dict(zip(("on_hand", "free", "held", "owed", "lines"), (int(x) for x in row),
                    strict=True))


def created_events(dsn: str, tenant: int,
                   kind: str = "reservation.created") -> list[dict[str, object]]:
    """The payloads of the tenant's events of one type, oldest first."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT payload FROM outbox_event WHERE tenant_id = %s"
                            " AND type = %s ORDER BY event_id", (tenant, kind)).fetchall()
    return [r[0] for r in rows]


@BATCHING
async def test_a_hold_beyond_on_hand_takes_the_rest_from_the_allowance(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """5 on hand with a backorder limit of 3: 7 units are held with 2 backordered (the
    answer and the event say so per line), availability counts the allowance left, 2 more
    are refused showing 1, and 1 more is held backordered."""
    svc = ReservationService(db, batching=batching)
    view = await svc.set_stock(tenant.id, "tee", "w", 5, strategy=strategy, backorder_limit=3)
    assert (view.available, view.backorder_limit) == (8, 3)
    out = await svc.reserve(tenant.id, "k1", [("tee", "w", 7)])
    assert out.held and out.reservation is not None
    assert [(x.quantity, x.backordered) for x in out.reservation.lines] == [(7, 2)]
    assert created_events(dsn, tenant.id)[-1]["lines"] == [
        {"sku": "tee", "location": "w", "quantity": 7, "backordered": 2}]
    got = await svc.get_reservation(tenant.id, out.reservation.id)
    assert got.lines[0].backordered == 2
    now = await svc.get_stock(tenant.id, "tee", "w")
    assert (now.on_hand, now.reserved, now.available, now.backorder_held) == (5, 7, 1, 2)
    over = await svc.reserve(tenant.id, "k2", [("tee", "w", 2)])
    assert not over.held and [s.available for s in over.short_lines] == [1]
    last = await svc.reserve(tenant.id, "k3", [("tee", "w", 1)])
    assert last.held and last.reservation is not None
    assert last.reservation.lines[0].backordered == 1
    assert books(dsn, tenant.id, "tee") == {"on_hand": 5, "free": 0, "held": 3, "owed": 0,
                                            "lines": 3}
    assert await svc.invariant_violations(tenant.id) == []


@BATCHING
async def test_release_and_expiry_give_the_allowance_back_exactly_once(
        db: Database, clock: Clock, tenant: Tenant, strategy: str, batching: bool,
        dsn: str) -> None:
    """A released backordered hold gives its stock and its allowance back once (a second
    release changes nothing); one that expires gives them back once, whether the sweeper
    or the next reserve gives it up."""
    svc = ReservationService(db, clock=clock, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 5, strategy=strategy, backorder_limit=3)
    first = await svc.reserve(tenant.id, "k1", [("tee", "w", 7)], ttl=60)
    assert first.reservation is not None
    await svc.release(tenant.id, first.reservation.id)
    await svc.release(tenant.id, first.reservation.id)
    assert books(dsn, tenant.id, "tee")["held"] == 0
    assert (await svc.get_stock(tenant.id, "tee", "w")).available == 8

    swept = await svc.reserve(tenant.id, "k2", [("tee", "w", 8)], ttl=60)
    assert swept.held
    clock.advance(61)
    assert (await svc.get_stock(tenant.id, "tee", "w")).available == 8
    await svc.expire_due(500)
    await svc.expire_due(500)
    assert books(dsn, tenant.id, "tee")["held"] == 0

    assert (await svc.reserve(tenant.id, "k3", [("tee", "w", 8)], ttl=60)).held
    clock.advance(61)
    # the next reserve gives the expired hold up inline, then backorders again
    again = await svc.reserve(tenant.id, "k4", [("tee", "w", 6)], ttl=60)
    assert again.held and again.reservation is not None
    assert again.reservation.lines[0].backordered == 1
    assert books(dsn, tenant.id, "tee")["held"] == 1
    await svc.expire_due(500)
    assert await svc.invariant_violations(tenant.id) == []


@BATCHING
async def test_a_claim_makes_backorders_owed_and_receipts_pay_them_first(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """Claiming 7 of 5 on hand (2 backordered) sells the 5 and owes 2, which use the
    allowance until a receipt of 3 pays them: then 1 unit is on hand and the whole
    allowance is back; the movement ledger agrees throughout."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 5, strategy=strategy, backorder_limit=3)
    out = await svc.reserve(tenant.id, "k1", [("tee", "w", 7)])
    assert out.reservation is not None
    await svc.claim(tenant.id, out.reservation.id)
    assert books(dsn, tenant.id, "tee") == {"on_hand": 0, "free": 0, "held": 0, "owed": 2,
                                            "lines": 0}
    view = await svc.get_stock(tenant.id, "tee", "w")
    assert (view.on_hand, view.available, view.backorder_owed) == (0, 1, 2)
    assert await svc.invariant_violations(tenant.id) == []
    paid = await svc.adjust_stock(tenant.id, "receipt-1", "tee", "w", 3, reason="receipt")
    assert (paid.on_hand, paid.backorder_owed, paid.available) == (1, 0, 4)
    assert await svc.invariant_violations(tenant.id) == []
    # a count afterwards sets what is on hand
    counted = await svc.set_stock(tenant.id, "tee", "w", 4)
    assert (counted.on_hand, counted.available) == (4, 7)
    assert await svc.invariant_violations(tenant.id) == []


@BATCHING
async def test_a_late_claim_of_a_backordered_hold_owes_nothing_and_says_so(
        db: Database, clock: Clock, tenant: Tenant, strategy: str, batching: bool,
        dsn: str) -> None:
    """2 on hand, allowance 3: a hold of 5 has 3 backordered. The sweeper gives it up at
    its expiry (its allowance back), a receipt of 10 arrives, and the late claim takes
    all 5 from stock: nothing is owed, and the claimed reservation and its
    reservation.claimed event mark none of its units backordered. Before, both still
    said 3, which a consumer would take for 3 units to ship later."""
    svc = ReservationService(db, clock=clock, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 2, strategy=strategy, backorder_limit=3)
    out = await svc.reserve(tenant.id, "k1", [("tee", "w", 5)], ttl=10)
    assert out.reservation is not None and out.reservation.lines[0].backordered == 3
    clock.advance(20)
    assert await svc.expire_due(500) == 1
    await svc.adjust_stock(tenant.id, "receipt-1", "tee", "w", 10, reason="receipt")
    claimed = await svc.claim(tenant.id, out.reservation.id)
    assert claimed.status == "claimed"
    assert [x.backordered for x in claimed.lines] == [0]
    found = books(dsn, tenant.id, "tee")
    assert (found["on_hand"], found["held"], found["owed"], found["lines"]) == (7, 0, 0, 0)
    [event] = created_events(dsn, tenant.id, "reservation.claimed")
    assert event["lines"] == [{"sku": "tee", "location": "w", "quantity": 5}]
    assert (await svc.get_reservation(tenant.id, out.reservation.id)).lines == claimed.lines
    assert await svc.invariant_violations(tenant.id) == []


async def test_a_count_keeps_backordered_holds_out_of_on_hand(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """With 7 held of 5 (2 backordered), a count of 5 is allowed (5 held on hand) and one of
    4 is refused as would_oversell unless forced; the books balance either way."""
    await service.set_stock(tenant.id, "tee", "w", 5, backorder_limit=3)
    assert (await service.reserve(tenant.id, "k1", [("tee", "w", 7)])).held
    view = await service.set_stock(tenant.id, "tee", "w", 5)
    assert (view.on_hand, view.reserved, view.available) == (5, 7, 1)
    with pytest.raises(WouldOversell):
        await service.set_stock(tenant.id, "tee", "w", 4)
    assert await service.invariant_violations(tenant.id) == []


async def test_a_cart_that_fails_gives_the_allowance_back(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A cart whose first line was backordered and whose second line is short fails whole:
    nothing is held, no allowance stays taken, and the short line shows what it could have
    had."""
    await service.set_stock(tenant.id, "cap", "w", 2, strategy=strategy, backorder_limit=4)
    await service.set_stock(tenant.id, "tee", "w", 1, strategy=strategy)
    before = table_counts(dsn)
    out = await service.reserve(tenant.id, "k1", [("cap", "w", 5), ("tee", "w", 2)])
    assert not out.held
    assert [(s.sku, s.available) for s in out.short_lines] == [("tee", 1)]
    cap = books(dsn, tenant.id, "cap")
    assert (cap["on_hand"], cap["held"], cap["owed"], cap["lines"]) == (2, 0, 0, 0)
    assert table_counts(dsn)["reservation"] == before["reservation"]
    assert (await service.get_stock(tenant.id, "cap", "w")).available == 6
    assert await service.invariant_violations(tenant.id) == []


@BATCHING
async def test_many_buyers_never_get_more_than_on_hand_less_safety_plus_the_limit(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """30 concurrent buyers of 1 unit against 10 on hand, a safety stock of 2 and a backorder
    limit of 5: exactly 13 are held, 5 of them backordered, the rest refused with nothing
    left, and the books balance."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 10, strategy=strategy, safety_stock=2,
                        backorder_limit=5, pool_cap=3)
    outs = await asyncio.gather(*(svc.reserve(tenant.id, f"k{i}", [("tee", "w", 1)])
                                  for i in range(30)))
    held = [o for o in outs if o.held]
    assert len(held) == 13
    assert sum(o.reservation.lines[0].backordered for o in held if o.reservation) == 5
    assert all(s.available == 0 for o in outs if not o.held for s in o.short_lines)
    b = books(dsn, tenant.id, "tee")
    assert b["held"] == b["lines"] == 5 and b["free"] == 2
    assert await svc.invariant_violations(tenant.id) == []
    # releasing all of them puts everything back
    await asyncio.gather(*(svc.release(tenant.id, o.reservation.id)
                           for o in held if o.reservation))
    view = await svc.get_stock(tenant.id, "tee", "w")
    assert (view.available, view.backorder_held) == (13, 0)
    assert await svc.invariant_violations(tenant.id) == []


async def test_http_backorders(api: ApiTenant) -> None:
    """PUT /v1/stock sets backorder_limit; a reserve beyond on_hand is 201 with the line's
    backordered units; the stock document shows them held, then owed after the claim, and a
    receipt pays them; beyond the limit is 409 insufficient_stock."""
    await put_stock(api, "tee", 2, backorder_limit=2)
    made = await reserve(api, "k1", [("tee", "wh", 3)])
    assert made.status_code == 201, made.text
    line = made.json()["lines"][0]
    assert (line["quantity"], line["backordered"]) == (3, 1)
    stock = (await api.client.get("/v1/stock/wh/tee")).json()
    assert (stock["backorder_held"], stock["available"]) == (1, 1)
    refused = assert_problem(await reserve(api, "k2", [("tee", "wh", 2)]), 409,
                             "insufficient_stock")
    assert refused["short_lines"][0]["available"] == 1
    rid = made.json()["id"]
    assert (await api.client.post(f"/v1/reservations/{rid}/claim")).status_code == 200
    stock = (await api.client.get("/v1/stock/wh/tee")).json()
    assert (stock["on_hand"], stock["backorder_owed"]) == (0, 1)
    paid = await api.client.post("/v1/stock/wh/tee/adjustments", json={"delta": 2},
                                 headers={"Idempotency-Key": "r1"})
    assert paid.status_code == 200, paid.text
    assert (paid.json()["on_hand"], paid.json()["backorder_owed"]) == (1, 0)


def test_client_backorders(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The typed client sets a backorder limit and sees a hold's backordered units."""
    base, key = server
    with Client(base, key) as shop:
        assert shop.set_stock("tee", "berlin", 1, backorder_limit=2).backorder_limit == 2
        out = shop.reserve([("tee", "berlin", 3)])
        assert out.held and out.reservation is not None
        assert out.reservation.lines[0].backordered == 2
        assert shop.get_stock("tee", "berlin").backorder_held == 2


async def test_async_client_sets_both_policies(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The asyncio client sets a safety stock and a backorder limit together and sees what
    can be promised and a hold's backordered units."""
    base, key = server
    async with AsyncClient(base, key) as shop:
        made = await shop.set_stock("tee", "berlin", 4, safety_stock=1, backorder_limit=2)
        assert (made.safety_stock, made.backorder_limit, made.available) == (1, 2, 5)
        out = await shop.reserve([("tee", "berlin", 5)])
        assert out.held and out.reservation is not None
        assert out.reservation.lines[0].backordered == 2
        assert (await shop.get_stock("tee", "berlin")).available == 0


async def test_a_hold_with_backordered_units_cannot_be_changed(
        db: Database, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A change of a reservation holding backordered units is refused with
    BackorderedHoldUnchangeable and nothing changes (neither the line, its allowance nor
    the ledger); a hold without backordered units of the same bucket changes."""
    from pgreserve.errors import BackorderedHoldUnchangeable

    svc = ReservationService(db, batching=False)
    await svc.set_stock(tenant.id, "tee", "w", 2, strategy=strategy, backorder_limit=3)
    out = await svc.reserve(tenant.id, "k1", [("tee", "w", 4)])
    assert out.held and out.reservation is not None
    before = books(dsn, tenant.id, "tee")
    with pytest.raises(BackorderedHoldUnchangeable):
        await svc.change(tenant.id, out.reservation.id, [("tee", "w", 1)], request_key="c1")
    assert books(dsn, tenant.id, "tee") == before == {
        "on_hand": 2, "free": 0, "held": 2, "owed": 0, "lines": 2}
    got = await svc.get_reservation(tenant.id, out.reservation.id)
    assert [(x.quantity, x.backordered) for x in got.lines] == [(4, 2)]
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM request_ledger WHERE request_key = 'c1'"
                            ).fetchone() == (0,)
    await svc.release(tenant.id, out.reservation.id)
    plain = await svc.reserve(tenant.id, "k2", [("tee", "w", 1)])
    assert plain.reservation is not None
    changed = await svc.change(tenant.id, plain.reservation.id, [("tee", "w", 2)],
                               request_key="c2")
    assert changed.held and changed.reservation is not None
    assert [(x.quantity, x.backordered) for x in changed.reservation.lines] == [(2, 0)]
    assert await svc.invariant_violations() == []


async def test_a_change_takes_what_stock_lacks_from_the_allowance(
        db: Database, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A change raising a line past what is free, and one adding a line, take the rest from
    the backorder allowance as a reserve does (the lines say how much); once the allowance
    is spent a raise is refused with what the line could have had, allowance included."""
    svc = ReservationService(db, batching=False)
    await svc.set_stock(tenant.id, "tee", "w", 2, strategy=strategy, backorder_limit=3)
    await svc.set_stock(tenant.id, "cap", "w", 0, strategy=strategy, backorder_limit=1)
    held = await svc.reserve(tenant.id, "k1", [("tee", "w", 2)])
    assert held.reservation is not None
    rid = held.reservation.id
    out = await svc.change(tenant.id, rid, [("cap", "w", 1), ("tee", "w", 4)],
                           request_key="c1")
    assert out.held and out.reservation is not None
    assert [(x.sku, x.quantity, x.backordered) for x in out.reservation.lines] == [
        ("cap", 1, 1), ("tee", 4, 2)]
    assert books(dsn, tenant.id, "tee") == {
        "on_hand": 2, "free": 0, "held": 2, "owed": 0, "lines": 2}
    assert books(dsn, tenant.id, "cap")["held"] == 1
    other = await svc.reserve(tenant.id, "k2", [("tee", "w", 1)])
    assert other.held and other.reservation is not None  # the allowance's last unit
    await svc.release(tenant.id, rid)  # gives the allowance back, once
    tee = books(dsn, tenant.id, "tee")
    assert (tee["on_hand"], tee["held"], tee["owed"], tee["lines"]) == (2, 1, 0, 1)
    assert (await svc.get_stock(tenant.id, "tee", "w")).available == 4  # 2 + 2 allowance

    plain = await svc.reserve(tenant.id, "k3", [("tee", "w", 2)])
    assert plain.reservation is not None
    refused = await svc.change(tenant.id, plain.reservation.id, [("tee", "w", 5)],
                               request_key="c2")
    assert not refused.held
    assert [(x.requested, x.available) for x in refused.short_lines] == [(5, 4)]
    assert await svc.invariant_violations() == []


@BATCHING
async def test_a_limit_lowered_below_what_is_backordered_keeps_the_holds_and_stops_new_ones(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """With 3 units backordered, lowering the limit to 2 is accepted and keeps the hold as
    it was; a new hold that needs the allowance is refused, one the stock covers is held;
    once the backordered hold is released, the lowered limit serves again."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 2, strategy=strategy, backorder_limit=5)
    first = await svc.reserve(tenant.id, "k1", [("tee", "w", 4)])
    assert first.held and first.reservation is not None
    assert first.reservation.lines[0].backordered == 2
    await svc.reserve(tenant.id, "k2", [("tee", "w", 1)])  # backordered 1: 3 in all
    view = await svc.set_stock(tenant.id, "tee", "w", 4, strategy=strategy, backorder_limit=2)
    assert (view.backorder_limit, view.backorder_held) == (2, 3)
    assert books(dsn, tenant.id, "tee")["lines"] == 3
    refused = await svc.reserve(tenant.id, "k3", [("tee", "w", 3)])
    assert not refused.held
    covered = await svc.reserve(tenant.id, "k4", [("tee", "w", 2)])  # the 2 counted in
    assert covered.held and covered.reservation is not None
    assert covered.reservation.lines[0].backordered == 0
    await svc.release(tenant.id, first.reservation.id)
    again = await svc.reserve(tenant.id, "k5", [("tee", "w", 3)])
    assert again.held and again.reservation is not None
    assert again.reservation.lines[0].backordered == 1
    assert books(dsn, tenant.id, "tee") == {"on_hand": 4, "free": 0, "held": 2, "owed": 0,
                                            "lines": 2}
    assert await svc.invariant_violations(tenant.id) == []


async def test_an_expired_hold_all_backordered_gives_its_allowance_to_the_next_cart(
        db: Database, clock: Clock, tenant: Tenant, strategy: str) -> None:
    """A hold made only of backordered units (nothing on hand) that expired unswept gives
    its allowance back to the next cart that needs it, on either strategy, and a refusal
    reports what really could be held: the allowance is read again after the give-up,
    also when it returned no unit on hand."""
    svc = ReservationService(db, clock=clock, batching=False)
    await svc.set_stock(tenant.id, "yp", "w", 0, strategy=strategy, backorder_limit=2)
    await svc.set_stock(tenant.id, "other", "w", 5)
    held = await svc.reserve(tenant.id, "k1", [("yp", "w", 1)], ttl=60)
    assert held.reservation is not None and held.reservation.lines[0].backordered == 1
    clock.advance(61)
    assert (await svc.get_stock(tenant.id, "yp", "w")).available == 2
    too_many = await svc.reserve(tenant.id, "k2", [("yp", "w", 3), ("other", "w", 1)],
                                 ttl=60)
    assert not too_many.held
    assert [(s.requested, s.available) for s in too_many.short_lines] == [(3, 2)]
    cart = await svc.reserve(tenant.id, "k3", [("yp", "w", 2), ("other", "w", 1)], ttl=60)
    assert cart.held and cart.reservation is not None
    assert [x.backordered for x in cart.reservation.lines] == [0, 2]  # (other, yp)
    assert await svc.invariant_violations(tenant.id) == []


@pytest.mark.parametrize("strategy", ["row", "pool"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
async def test_an_allocated_line_beside_a_backordered_line_of_its_bucket(
        service: ReservationService, tenant: Tenant, strategy: str, split: bool) -> None:
    """4 on hand at A with an allowance of 5. A cart of 3 at A and 2 allocated: the
    allocated 2 are on hand at A, the explicit line takes the other 2 on hand and 1 of
    the allowance (one line of 5 with 1 backordered, as 5 at A alone). With 5 more at A
    the allocated 2 cannot be on hand anywhere: refused, showing 0 on hand for them, and
    nothing is held. Once an allocated line would need the allowance, it is refused."""
    from pgreserve.domain import AllocatedLine

    await service.set_stock(tenant.id, "t", "A", 4, strategy=strategy, backorder_limit=5)
    out = await service.reserve(tenant.id, "k1", [("t", "A", 3),
                                                  AllocatedLine("t", 2, split=split)])
    assert out.held and out.reservation is not None, out
    assert [(x.location, x.quantity, x.backordered) for x in out.reservation.lines] == [
        ("A", 5, 1)]
    view = await service.get_stock(tenant.id, "t", "A")
    assert (view.on_hand, view.available) == (4, 4)  # the allowance left: 4 of 5
    again = await service.reserve(tenant.id, "k1", [("t", "A", 3),
                                                    AllocatedLine("t", 2, split=split)])
    assert again.replayed and again.reservation is not None
    assert again.reservation.id == out.reservation.id
    short = await service.reserve(tenant.id, "k2", [("t", "A", 1),
                                                    AllocatedLine("t", 1, split=split)])
    assert not short.held
    assert [(s.location, s.requested, s.available) for s in short.short_lines] == [
        (None, 1, 0)]
    assert await service.get_stock(tenant.id, "t", "A") == view
    await service.release(tenant.id, out.reservation.id)
    # 4 on hand, allowance 5: 3 allocated and 5 at A need 4 on hand for the 3 and 1 of
    # the 5, and 4 backordered: held; 5 allocated and 1 at A cannot be (4 on hand)
    more = await service.reserve(tenant.id, "k3", [("t", "A", 5), AllocatedLine("t", 3,
                                                                               split=split)])
    assert more.held and more.reservation is not None, more
    assert [(x.quantity, x.backordered) for x in more.reservation.lines] == [(8, 4)]
    await service.release(tenant.id, more.reservation.id)
    over = await service.reserve(tenant.id, "k4", [("t", "A", 1), AllocatedLine("t", 5,
                                                                               split=split)])
    assert not over.held
    assert [(s.location, s.requested, s.available) for s in over.short_lines] == [
        (None, 5, 4)]
    assert await service.invariant_violations(tenant.id) == []
