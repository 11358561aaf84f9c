"""Changing a held cart (ReservationService.change, change_v1): the whole new cart in one
step, keeping what is unchanged held, all or nothing, under a request key."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from conftest import Clock, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.domain import LimitedLine, ShortLine, StockRef
from pgreserve.errors import (
    IdempotencyKeyReused,
    InvalidRequest,
    ReservationClaimed,
    ReservationNotActive,
    ReservationNotFound,
    ReservationReleased,
    UnknownStock,
)


def lines_of(dsn: str, rid: str) -> list[tuple[int, str, int, bool]]:
    """(line_no, sku@location, quantity, held) of a reservation's lines, by line_no."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT l.line_no, b.sku || '@' || b.location, l.quantity, l.held"
            " FROM reservation_line l JOIN stock_bucket b USING (tenant_id, bucket_id)"
            " WHERE l.reservation_id = %s ORDER BY l.line_no", (rid,)).fetchall()
    return [(int(r[0]), str(r[1]), int(r[2]), bool(r[3])) for r in rows]


def movements_of(dsn: str, rid: str) -> list[tuple[str, int, int, str | None]]:
    """(kind, line_no, quantity, reason) of a reservation's stock movements, in order."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT kind, line_no, quantity, reason FROM stock_movement"
            " WHERE reservation_id = %s ORDER BY movement_id", (rid,)).fetchall()
    return [(str(r[0]), int(r[1]), int(r[2]), r[3]) for r in rows]


def events_of(dsn: str, rid: str) -> list[tuple[str, Any]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT type, payload FROM outbox_event WHERE payload ->> 'id' = %s"
            " ORDER BY event_id", (rid,)).fetchall()
    return [(str(r[0]), r[1]) for r in rows]


async def available(svc: ReservationService, tenant: int, sku: str, loc: str = "w") -> int:
    return (await svc.get_stock(tenant, sku, loc)).available


async def stocked(svc: ReservationService, tenant: int, strategy: str,
                  **skus: int) -> None:
    for sku, on_hand in skus.items():
        await svc.set_stock(tenant, sku, "w", on_hand, strategy=strategy)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_each_kind_of_line_change_moves_only_the_difference(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """One change keeps an unchanged line as it was (same row, no movement), takes only the
    difference of a raised line, gives back only the difference of a lowered one (one
    restore record on its old number, the kept units on a new number), gives back a
    removed line whole and takes a new line; the answer, the reservation read back and
    the reservation.changed event are the new cart; the books balance."""
    svc = ReservationService(db, batching=batching)
    await stocked(svc, tenant.id, strategy, a=10, b=10, c=10, d=10, e=10)
    held = await svc.reserve(tenant.id, "r1", [("a", "w", 2), ("b", "w", 3), ("c", "w", 4),
                                               ("d", "w", 5)])
    assert held.held and held.reservation is not None
    rid = held.reservation.id
    assert lines_of(dsn, rid) == [(1, "a@w", 2, True), (2, "b@w", 3, True),
                                  (3, "c@w", 4, True), (4, "d@w", 5, True)]

    out = await svc.change(tenant.id, rid, [("a", "w", 2), ("b", "w", 7), ("c", "w", 1),
                                            ("e", "w", 6)], request_key="c1")
    assert out.held and not out.replayed and out.reservation is not None
    assert [(x.sku, x.quantity) for x in out.reservation.lines] == [
        ("a", 2), ("b", 7), ("c", 1), ("e", 6)]
    assert out.reservation.expires_at == held.reservation.expires_at
    assert lines_of(dsn, rid) == [(1, "a@w", 2, True), (2, "b@w", 7, True),
                                  (5, "c@w", 1, True), (6, "e@w", 6, True)]
    assert movements_of(dsn, rid) == [("restore", 3, 3, "changed"),
                                      ("restore", 4, 5, "changed")]
    assert [await available(svc, tenant.id, s) for s in "abcde"] == [8, 3, 9, 10, 4]
    now = await svc.get_reservation(tenant.id, rid)
    assert now.lines == out.reservation.lines and now.status == "active"
    types = [t for t, _ in events_of(dsn, rid)]
    assert types == ["reservation.created", "reservation.changed"]
    assert events_of(dsn, rid)[1][1]["lines"] == [
        {"sku": s, "location": "w", "quantity": q} for s, q in
        (("a", 2), ("b", 7), ("c", 1), ("e", 6))]
    assert await svc.invariant_violations(tenant.id) == []

    # claim sells exactly what is held now; the books still balance
    claimed = await svc.claim(tenant.id, rid)
    assert claimed.status == "claimed"
    for sku, on_hand in (("a", 8), ("b", 3), ("c", 9), ("d", 10), ("e", 4)):
        assert (await svc.get_stock(tenant.id, sku, "w")).on_hand == on_hand
    assert await svc.invariant_violations(tenant.id) == []


async def test_release_and_expiry_give_back_exactly_the_lines_held_now(
        db: Database, tenant: Tenant, strategy: str, clock: Clock, dsn: str) -> None:
    """After a change, a release gives back the changed cart (each line once), and the
    sweeper expires another changed cart giving back what it holds now, not what it held
    before; no line is restored twice."""
    svc = ReservationService(db, clock=clock)
    await stocked(svc, tenant.id, strategy, a=10, b=10)
    one = (await svc.reserve(tenant.id, "r1", [("a", "w", 4)], ttl=60)).reservation
    two = (await svc.reserve(tenant.id, "r2", [("a", "w", 3), ("b", "w", 1)],
                             ttl=30)).reservation
    assert one is not None and two is not None
    assert (await svc.change(tenant.id, one.id, [("a", "w", 1), ("b", "w", 2)],
                             request_key="c1")).held
    assert (await svc.change(tenant.id, two.id, [("b", "w", 5)], request_key="c2")).held
    assert [await available(svc, tenant.id, s) for s in "ab"] == [9, 3]
    assert (await svc.release(tenant.id, one.id)).status == "released"
    assert [await available(svc, tenant.id, s) for s in "ab"] == [10, 5]
    clock.advance(31)
    assert await svc.expire_due() == 1
    assert (await svc.get_reservation(tenant.id, two.id)).status == "expired"
    assert [await available(svc, tenant.id, s) for s in "ab"] == [10, 10]
    assert [m for m in movements_of(dsn, two.id) if m[3] == "expired"] == [
        ("restore", 2, 5, "expired")]
    assert await svc.invariant_violations(tenant.id) == []


async def test_a_short_line_changes_nothing_and_the_rejection_is_stored(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """When a raised or new line cannot be served, no line changes (not even those that
    would give back), the rejection names each short line with the quantity asked and
    what the line could have (its held units plus what is available), and it is stored:
    the same key replays it even once the stock is there."""
    await stocked(service, tenant.id, strategy, a=10, b=5, c=2)
    held = (await service.reserve(tenant.id, "r1", [("a", "w", 4), ("b", "w", 3)])).reservation
    assert held is not None
    other = await service.reserve(tenant.id, "r2", [("b", "w", 1)])
    assert other.held
    before = table_counts(dsn)
    out = await service.change(tenant.id, held.id, [("a", "w", 1), ("b", "w", 6),
                                                    ("c", "w", 3)], request_key="c1")
    assert not out.held and out.reason == "insufficient_stock"
    assert out.short_lines == (ShortLine("b", "w", 6, 4), ShortLine("c", "w", 3, 2))
    after = table_counts(dsn)
    assert after["request_ledger"] == before["request_ledger"] + 1
    assert {k: v for k, v in after.items() if k != "request_ledger"} == {
        k: v for k, v in before.items() if k != "request_ledger"}
    assert lines_of(dsn, held.id) == [(1, "a@w", 4, True), (2, "b@w", 3, True)]
    assert [await available(service, tenant.id, s) for s in "abc"] == [6, 1, 2]

    await service.adjust_stock(tenant.id, "more", "c", "w", 10)
    await service.adjust_stock(tenant.id, "more-b", "b", "w", 10)
    replay = await service.change(tenant.id, held.id, [("a", "w", 1), ("b", "w", 6),
                                                       ("c", "w", 3)], request_key="c1")
    assert replay.replayed and not replay.held and replay.short_lines == out.short_lines
    assert lines_of(dsn, held.id) == [(1, "a@w", 4, True), (2, "b@w", 3, True)]
    assert await service.invariant_violations(tenant.id) == []


async def test_a_replay_changes_nothing_and_another_cart_under_the_key_is_refused(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """The same key and cart replay the stored answer without moving stock again (even
    after a later change); the same key with another cart, another reservation or as
    another operation raises IdempotencyKeyReused and changes nothing."""
    await stocked(service, tenant.id, strategy, a=10)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 2)])).reservation
    rid2 = (await service.reserve(tenant.id, "r2", [("a", "w", 1)])).reservation
    assert rid is not None and rid2 is not None
    first = await service.change(tenant.id, rid.id, [("a", "w", 5)], request_key="c1")
    assert first.held and await available(service, tenant.id, "a") == 4
    again = await service.change(tenant.id, rid.id, [("a", "w", 5)], request_key="c1")
    assert again.replayed and again.held and again.reservation is not None
    assert first.reservation is not None
    assert again.reservation.lines == first.reservation.lines
    assert await available(service, tenant.id, "a") == 4
    assert (await service.change(tenant.id, rid.id, [("a", "w", 3)], request_key="c2")).held
    replay = await service.change(tenant.id, rid.id, [("a", "w", 5)], request_key="c1")
    assert replay.replayed and await available(service, tenant.id, "a") == 6
    before = table_counts(dsn)
    with pytest.raises(IdempotencyKeyReused):
        await service.change(tenant.id, rid.id, [("a", "w", 6)], request_key="c1")
    with pytest.raises(IdempotencyKeyReused):
        await service.change(tenant.id, rid2.id, [("a", "w", 5)], request_key="c1")
    with pytest.raises(IdempotencyKeyReused):
        await service.change(tenant.id, rid.id, [("a", "w", 2)], request_key="r1")
    with pytest.raises(IdempotencyKeyReused):
        await service.reserve(tenant.id, "c1", [("a", "w", 5)])
    assert table_counts(dsn) == before
    record = await service.lookup_request(tenant.id, "c1")
    assert record.operation == "change" and record.reservation is not None
    assert record.reservation.lines[0].quantity == 3


async def test_only_an_active_reservation_before_its_expiry_changes(
        db: Database, tenant: Tenant, clock: Clock, dsn: str) -> None:
    """A claimed reservation raises ReservationClaimed, a released one ReservationReleased,
    one past its expiry (swept or not) ReservationNotActive, an unknown one
    ReservationNotFound; none of them stores anything under the key."""
    svc = ReservationService(db, clock=clock)
    await stocked(svc, tenant.id, "row", a=10)
    ids = []
    for key in ("r1", "r2", "r3", "r4"):
        got = (await svc.reserve(tenant.id, key, [("a", "w", 1)], ttl=60)).reservation
        assert got is not None
        ids.append(got.id)
    await svc.claim(tenant.id, ids[0])
    await svc.release(tenant.id, ids[1])
    clock.advance(61)
    before = table_counts(dsn)
    cart = [("a", "w", 2)]
    with pytest.raises(ReservationClaimed):
        await svc.change(tenant.id, ids[0], cart, request_key="c1")
    with pytest.raises(ReservationReleased):
        await svc.change(tenant.id, ids[1], cart, request_key="c1")
    with pytest.raises(ReservationNotActive):
        await svc.change(tenant.id, ids[2], cart, request_key="c1")
    with pytest.raises(ReservationNotFound):
        await svc.change(tenant.id, "00000000-0000-0000-0000-000000000000", cart,
                         request_key="c1")
    with pytest.raises(ReservationNotFound):
        await svc.change(tenant.id, "not-an-id", cart, request_key="c1")
    assert table_counts(dsn) == before
    assert await svc.expire_due() >= 1
    with pytest.raises(ReservationNotActive):
        await svc.change(tenant.id, ids[3], cart, request_key="c1")


async def test_bad_input_is_refused_before_anything_is_written(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """An empty cart, a repeated (sku, location), a bad quantity or key are InvalidRequest
    and an unknown bucket UnknownStock (naming it); nothing is written for any of them."""
    await stocked(service, tenant.id, "row", a=10)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 2)])).reservation
    assert rid is not None
    before = table_counts(dsn)
    for cart in ([], [("a", "w", 1), ("a", "w", 2)], [("a", "w", 0)], "a"):
        with pytest.raises(InvalidRequest):
            await service.change(tenant.id, rid.id, cart, request_key="c1")
    with pytest.raises(InvalidRequest):
        await service.change(tenant.id, rid.id, [("a", "w", 1)], request_key="")
    with pytest.raises(UnknownStock) as unknown:
        await service.change(tenant.id, rid.id, [("a", "w", 1), ("zz", "w", 1)],
                             request_key="c1")
    assert unknown.value.details["detail"] == [{"sku": "zz", "location": "w"}]
    assert table_counts(dsn) == before


async def test_the_new_cart_obeys_cart_limits(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A new cart over a SKU's per-cart limit (summed over its locations) is refused with
    cart_limit_exceeded, stored, and changes nothing; one within it is held."""
    for loc in ("w", "x"):
        await service.set_stock(tenant.id, "a", loc, 10, strategy=strategy)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 2)])).reservation
    assert rid is not None
    await service.set_cart_limit(tenant.id, "a", 3)
    out = await service.change(tenant.id, rid.id, [("a", "w", 2), ("a", "x", 2)],
                               request_key="c1")
    assert out.reason == "cart_limit_exceeded"
    assert out.limited_lines == (LimitedLine("a", 3, 4),)
    assert lines_of(dsn, rid.id) == [(1, "a@w", 2, True)]
    assert (await service.change(tenant.id, rid.id, [("a", "w", 2), ("a", "x", 2)],
                                 request_key="c1")).replayed
    assert (await service.change(tenant.id, rid.id, [("a", "w", 1), ("a", "x", 2)],
                                 request_key="c2")).held
    assert await available(service, tenant.id, "a", "x") == 8


async def test_a_limit_lowered_after_the_hold_refuses_only_a_change_that_adds_to_it(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A cart held under a per-cart limit that was lowered since: the cart sent as it is
    answers held and changes nothing, a change lowering the SKU goes on (while still over
    the new limit), and only a change adding to the SKU is refused (cart_limit_exceeded,
    stored, nothing changed). Another SKU is held to its limit as usual."""
    for loc in ("w", "x"):
        await service.set_stock(tenant.id, "a", loc, 10, strategy=strategy)
    await service.set_stock(tenant.id, "b", "w", 10, strategy=strategy)
    await service.set_cart_limit(tenant.id, "a", 5)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 3), ("a", "x", 2)])).reservation
    assert rid is not None
    await service.set_cart_limit(tenant.id, "a", 2)
    await service.set_cart_limit(tenant.id, "b", 1)
    same = await service.change(tenant.id, rid.id, [("a", "w", 3), ("a", "x", 2)],
                                request_key="c1")
    assert same.held, same
    assert lines_of(dsn, rid.id) == [(1, "a@w", 3, True), (2, "a@x", 2, True)]
    lower = await service.change(tenant.id, rid.id, [("a", "w", 1), ("a", "x", 3)],
                                 request_key="c2")
    assert lower.held, lower
    more = await service.change(tenant.id, rid.id, [("a", "w", 2), ("a", "x", 3)],
                                request_key="c3")
    assert more.reason == "cart_limit_exceeded"
    assert more.limited_lines == (LimitedLine("a", 2, 5),)
    other = await service.change(tenant.id, rid.id, [("a", "w", 1), ("a", "x", 3),
                                                     ("b", "w", 2)], request_key="c4")
    assert other.reason == "cart_limit_exceeded"
    assert other.limited_lines == (LimitedLine("b", 1, 2),)
    assert sorted((sku, q) for _, sku, q, held in lines_of(dsn, rid.id) if held) == [
        ("a@w", 1), ("a@x", 3)]
    assert await service.invariant_violations() == []


async def test_a_freeze_stops_what_a_change_takes_but_not_what_it_gives_back(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """A frozen bucket refuses a change that would take from it (bucket_frozen, stored,
    nothing changed); a change that only gives back from it, or takes elsewhere, goes on;
    a frozen tenant refuses every change that takes."""
    await stocked(service, tenant.id, strategy, a=10, b=10)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 3), ("b", "w", 3)])).reservation
    assert rid is not None
    await service.freeze(tenant.id, "count", "ops", sku="a", location="w")
    out = await service.change(tenant.id, rid.id, [("a", "w", 4), ("b", "w", 3)],
                               request_key="c1")
    assert out.reason == "bucket_frozen" and out.frozen_lines == (StockRef("a", "w"),)
    assert lines_of(dsn, rid.id) == [(1, "a@w", 3, True), (2, "b@w", 3, True)]
    assert (await service.change(tenant.id, rid.id, [("a", "w", 1), ("b", "w", 4)],
                                 request_key="c2")).held
    assert [await available(service, tenant.id, s) for s in "ab"] == [9, 6]
    await service.freeze(tenant.id, "drift", "ops")
    out = await service.change(tenant.id, rid.id, [("a", "w", 1), ("b", "w", 5)],
                               request_key="c3")
    assert out.reason == "tenant_frozen"
    assert (await service.change(tenant.id, rid.id, [("b", "w", 4)], request_key="c4")).held
    assert [await available(service, tenant.id, s) for s in "ab"] == [10, 6]
    assert await service.invariant_violations(tenant.id) == []


async def test_an_unchanged_cart_is_answered_and_writes_no_event(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """Sending the cart as it is answers it held, stores the answer and writes no
    reservation.changed event and no movement."""
    await stocked(service, tenant.id, "row", a=10)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 2)])).reservation
    assert rid is not None
    out = await service.change(tenant.id, rid.id, [("a", "w", 2)], request_key="c1")
    assert out.held and out.reservation is not None
    assert out.reservation.lines == rid.lines
    assert [t for t, _ in events_of(dsn, rid.id)] == ["reservation.created"]
    assert movements_of(dsn, rid.id) == []


async def test_repeated_changes_keep_each_line_restored_at_most_once(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """Many changes up and down of one cart: every line number has at most one restore
    record, the reservation holds exactly its last cart, and after a release the bucket
    is whole again with the invariants true."""
    await stocked(service, tenant.id, strategy, a=50, b=50)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 5)])).reservation
    assert rid is not None
    carts = [[("a", "w", 3)], [("a", "w", 8), ("b", "w", 2)], [("b", "w", 1)],
             [("a", "w", 1), ("b", "w", 1)], [("a", "w", 9), ("b", "w", 9)],
             [("a", "w", 2), ("b", "w", 4)]]
    for n, cart in enumerate(carts):
        assert (await service.change(tenant.id, rid.id, cart, request_key=f"c{n}")).held
        assert await service.invariant_violations(tenant.id) == []
    now = await service.get_reservation(tenant.id, rid.id)
    assert [(x.sku, x.quantity) for x in now.lines] == [("a", 2), ("b", 4)]
    assert [await available(service, tenant.id, s) for s in "ab"] == [48, 46]
    restores = [m[1] for m in movements_of(dsn, rid.id) if m[0] == "restore"]
    assert len(restores) == len(set(restores))
    await service.release(tenant.id, rid.id)
    assert [await available(service, tenant.id, s) for s in "ab"] == [50, 50]
    assert await service.invariant_violations(tenant.id) == []


async def test_a_reservation_out_of_line_numbers_is_refused_and_unchanged(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """When the next line numbers could pass smallint's range (a cart changed some 300
    times), the change is InvalidRequest and nothing changes or is stored."""
    await stocked(service, tenant.id, "row", a=10, b=10)
    rid = (await service.reserve(tenant.id, "r1", [("a", "w", 2)])).reservation
    assert rid is not None
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE reservation_line SET line_no = 32767 WHERE reservation_id = %s",
                     (rid.id,))
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match="changed too often"):
        await service.change(tenant.id, rid.id, [("a", "w", 2), ("b", "w", 1)],
                             request_key="c1")
    assert table_counts(dsn) == before
    assert lines_of(dsn, rid.id) == [(32767, "a@w", 2, True)]
    assert await available(service, tenant.id, "b") == 10
