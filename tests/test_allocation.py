"""Allocation across locations: a cart line that names a SKU and no location takes its
units from the SKU's locations in the tenant's (or the SKU's own) priority order, whole
from one location or split over several; the answer says where each unit is held."""

from __future__ import annotations

import psycopg
import pytest

from conftest import Clock, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.domain import AllocatedLine, Line, ShortLine, SkuSettings
from pgreserve.errors import IdempotencyKeyReused, InvalidRequest, UnknownStock, UnknownTenant


async def stock(svc: ReservationService, tenant: Tenant, sku: str, strategy: str = "row",
                **at: int) -> None:
    for location, on_hand in at.items():
        await svc.set_stock(tenant.id, sku, location, on_hand, strategy=strategy)


async def available(svc: ReservationService, tenant: Tenant, sku: str) -> dict[str, int]:
    [found] = await svc.availability(tenant.id, [sku])
    return {v.location: v.available for v in found.locations}


async def test_an_unsplit_line_takes_the_first_location_in_priority_order_that_can_serve_it(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """With priority [paris, berlin]: 3 units come from paris while it has them, then
    from berlin (the next that can serve all 3), never half from each."""
    await stock(service, tenant, "tee", strategy, berlin=10, paris=4, rome=10)
    assert await service.set_location_priority(tenant.id, ["paris", "berlin"]) == (
        "paris", "berlin")
    one = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 3)])
    assert one.held and one.reservation is not None
    assert one.reservation.lines == (Line("tee", "paris", 3),)
    two = await service.reserve(tenant.id, "k2", [("tee", None, 3)])
    assert two.reservation is not None and two.reservation.lines == (Line("tee", "berlin", 3),)
    assert await available(service, tenant, "tee") == {"berlin": 7, "paris": 1, "rome": 10}
    # a one-line allocated hold is claimed (through its bucket's group commit) there
    await service.claim(tenant.id, one.reservation.id)
    assert (await service.get_stock(tenant.id, "tee", "paris")).on_hand == 1
    assert await service.invariant_violations(tenant.id) == []


async def test_an_allocated_cart_in_the_callers_transaction_rolls_back_with_it(
        service: ReservationService, tenant: Tenant, plain_dsn: str) -> None:
    """With conn=, an allocated hold is made inside the caller's open transaction: a
    rollback leaves no hold and the key free; a commit keeps the allocation."""
    await stock(service, tenant, "tee", berlin=3, paris=3)
    async with await psycopg.AsyncConnection.connect(plain_dsn, autocommit=True) as shop:
        async with shop.transaction(force_rollback=True):
            out = await service.reserve(tenant.id, "order-1",
                                        [AllocatedLine("tee", 4, split=True)], conn=shop)
            assert out.held
        assert await available(service, tenant, "tee") == {"berlin": 3, "paris": 3}
        async with shop.transaction():
            out = await service.reserve(tenant.id, "order-1",
                                        [AllocatedLine("tee", 4, split=True)], conn=shop)
    assert out.reservation is not None and not out.replayed
    assert out.reservation.lines == (Line("tee", "berlin", 3), Line("tee", "paris", 1))
    assert await available(service, tenant, "tee") == {"berlin": 0, "paris": 2}


async def test_a_split_over_more_than_100_locations_is_refused_and_holds_nothing(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """A reservation holds at most 100 lines: a split line that would need 101 locations
    is InvalidRequest and takes nothing; 100 locations are held."""
    for n in range(101):
        await service.set_stock(tenant.id, "pin", f"loc{n:03}", 1)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match="at most 100 lines"):
        await service.reserve(tenant.id, "k1", [AllocatedLine("pin", 101, split=True)])
    assert table_counts(dsn) == before
    out = await service.reserve(tenant.id, "k1", [AllocatedLine("pin", 100, split=True)])
    assert out.reservation is not None and len(out.reservation.lines) == 100


async def test_unlisted_locations_follow_the_listed_ones_in_name_order(
        service: ReservationService, tenant: Tenant) -> None:
    """Locations the priority does not name come after those it names, in name order;
    with no priority at all, every location is in name order; a named location the SKU
    has no stock at is ignored."""
    await stock(service, tenant, "tee", zurich=2, athens=2, madrid=2)
    first = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 2)])
    assert first.reservation is not None
    assert first.reservation.lines == (Line("tee", "athens", 2),)
    await service.set_location_priority(tenant.id, ["nowhere", "zurich"])
    second = await service.reserve(tenant.id, "k2", [AllocatedLine("tee", 2)])
    third = await service.reserve(tenant.id, "k3", [AllocatedLine("tee", 2)])
    assert second.reservation is not None and third.reservation is not None
    assert second.reservation.lines == (Line("tee", "zurich", 2),)
    assert third.reservation.lines == (Line("tee", "madrid", 2),)


async def test_a_skus_own_priority_replaces_the_tenants_and_can_be_removed(
        service: ReservationService, tenant: Tenant) -> None:
    """A SKU's location_priority decides for that SKU only; None removes it and the
    tenant's order applies again; the SKU's settings show it beside the cart limit."""
    await stock(service, tenant, "tee", berlin=10, paris=10)
    await stock(service, tenant, "cap", berlin=10, paris=10)
    await service.set_location_priority(tenant.id, ["berlin"])
    settings = await service.update_sku(tenant.id, "tee", location_priority=["paris"])
    assert settings == SkuSettings("tee", None, ("paris",))
    out = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 1),
                                                  AllocatedLine("cap", 1)])
    assert out.reservation is not None
    assert out.reservation.lines == (Line("cap", "berlin", 1), Line("tee", "paris", 1))
    assert await service.update_sku(tenant.id, "tee", cart_limit=5) == SkuSettings(
        "tee", 5, ("paris",))
    assert await service.sku_settings(tenant.id, "tee") == SkuSettings("tee", 5, ("paris",))
    assert await service.update_sku(tenant.id, "tee", location_priority=None) == SkuSettings(
        "tee", 5, None)
    again = await service.reserve(tenant.id, "k2", [AllocatedLine("tee", 1)])
    assert again.reservation is not None
    assert again.reservation.lines == (Line("tee", "berlin", 1),)
    assert await service.location_priority(tenant.id) == ("berlin",)


async def test_a_split_line_takes_what_each_location_has_in_priority_order(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """split: 9 units over paris (4), berlin (3) and rome (the remaining 2) become three
    lines; claiming sells exactly those units, releasing another split hold gives each
    location back exactly what it gave."""
    await stock(service, tenant, "tee", strategy, berlin=3, paris=4, rome=10)
    await service.set_location_priority(tenant.id, ["paris", "berlin", "rome"])
    out = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 9, split=True)])
    assert out.reservation is not None
    assert out.reservation.lines == (Line("tee", "berlin", 3), Line("tee", "paris", 4),
                                     Line("tee", "rome", 2))
    await service.claim(tenant.id, out.reservation.id)
    views = {v.location: v for v in (await service.availability(tenant.id, ["tee"]))[0].locations}
    assert {k: (v.on_hand, v.available) for k, v in views.items()} == {
        "berlin": (0, 0), "paris": (0, 0), "rome": (8, 8)}
    await service.set_stock(tenant.id, "tee", "paris", 1, strategy=strategy)
    other = await service.reserve(tenant.id, "k2", [AllocatedLine("tee", 5, split=True)])
    assert other.reservation is not None
    assert other.reservation.lines == (Line("tee", "paris", 1), Line("tee", "rome", 4))
    await service.release(tenant.id, other.reservation.id)
    assert await available(service, tenant, "tee") == {"berlin": 0, "paris": 1, "rome": 8}
    assert await service.invariant_violations(tenant.id) == []


async def test_a_split_line_beside_an_explicit_line_takes_what_is_left_at_its_location(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """paris 10 and rome 5 (priority paris, rome; no backorder allowance): a cart of 2 at
    paris and 9 split is held as 10 at paris (the 2 and 8 of the split) and 1 at rome.
    Before, the split skipped paris whenever the cart named it, so this cart was retried
    until its deadline (Busy: the one-snapshot check saw enough), and with rome 20 it was
    held as 2 at paris and 9 at rome. Unsplit, the 9 go whole where they fit: rome."""
    await stock(service, tenant, "tee", strategy, paris=10, rome=5)
    await service.set_location_priority(tenant.id, ["paris", "rome"])
    cart = [("tee", "paris", 2), AllocatedLine("tee", 9, split=True)]
    out = await service.reserve(tenant.id, "k1", cart)
    assert out.reservation is not None, out
    assert out.reservation.lines == (Line("tee", "paris", 10), Line("tee", "rome", 1))
    await service.release(tenant.id, out.reservation.id)
    await service.set_stock(tenant.id, "tee", "rome", 20, strategy=strategy)
    again = await service.reserve(tenant.id, "k2", cart)
    assert again.reservation is not None, again
    assert again.reservation.lines == (Line("tee", "paris", 10), Line("tee", "rome", 1))
    await service.release(tenant.id, again.reservation.id)
    whole = await service.reserve(tenant.id, "k3", [("tee", "paris", 2),
                                                    AllocatedLine("tee", 9)])
    assert whole.reservation is not None, whole
    assert whole.reservation.lines == (Line("tee", "paris", 2), Line("tee", "rome", 9))
    assert await available(service, tenant, "tee") == {"paris": 8, "rome": 11}
    assert await service.invariant_violations(tenant.id) == []


async def test_a_rejection_names_the_line_without_location_and_what_was_available(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """Unsplit, 5 units where no location has 5 is refused with available = the most one
    location had (4); split, 12 where all have 9 is refused with available 9; the
    refusals take nothing and the whole cart (its other lines too) holds nothing."""
    await stock(service, tenant, "tee", strategy, berlin=4, paris=3, rome=2)
    await stock(service, tenant, "cap", strategy, berlin=10)
    before = table_counts(dsn)
    whole = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 5),
                                                    ("cap", "berlin", 1)])
    assert not whole.held and whole.reason == "insufficient_stock"
    assert whole.short_lines == (ShortLine("tee", None, 5, 4),)
    split = await service.reserve(tenant.id, "k2", [AllocatedLine("tee", 12, split=True)])
    assert split.short_lines == (ShortLine("tee", None, 12, 9),)
    after = table_counts(dsn)
    assert after["request_ledger"] == before["request_ledger"] + 2
    assert {k: v for k, v in after.items() if k != "request_ledger"} == {
        k: v for k, v in before.items() if k != "request_ledger"}
    assert await available(service, tenant, "tee") == {"berlin": 4, "paris": 3, "rome": 2}
    assert await service.invariant_violations(tenant.id) == []


async def test_a_mixed_cart_is_all_or_nothing_and_merges_lines_on_one_bucket(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A cart of an explicit line and an allocated line of the same SKU whose allocation
    lands on the explicit line's location holds one line there with both quantities; a
    short explicit line refuses the cart and gives back what the allocation took."""
    await stock(service, tenant, "tee", strategy, berlin=10, paris=10)
    await stock(service, tenant, "cap", strategy, rome=1)
    await service.set_location_priority(tenant.id, ["berlin", "paris"])
    out = await service.reserve(tenant.id, "k1", [("tee", "berlin", 2), AllocatedLine("tee", 3),
                                                  ("cap", "rome", 1)])
    assert out.reservation is not None
    assert out.reservation.lines == (Line("cap", "rome", 1), Line("tee", "berlin", 5))
    # berlin has 5 left: 4 explicit + 3 allocated cannot share it, paris serves the 3
    moved = await service.reserve(tenant.id, "k2", [("tee", "berlin", 4), AllocatedLine("tee", 3)])
    assert moved.reservation is not None
    assert moved.reservation.lines == (Line("tee", "berlin", 4), Line("tee", "paris", 3))
    short = await service.reserve(tenant.id, "k3", [("cap", "rome", 1), AllocatedLine("tee", 2)])
    assert not short.held and short.short_lines == (ShortLine("cap", "rome", 1, 0),)
    assert await available(service, tenant, "tee") == {"berlin": 1, "paris": 7}
    assert await service.invariant_violations(tenant.id) == []


async def test_replaying_the_key_returns_the_same_allocation(
        service: ReservationService, tenant: Tenant) -> None:
    """The same key and cart answer the stored allocation even after the priority changed;
    the same key with another cart (or split instead of unsplit) is IdempotencyKeyReused."""
    await stock(service, tenant, "tee", berlin=10, paris=10)
    await service.set_location_priority(tenant.id, ["paris"])
    first = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 2)])
    await service.set_location_priority(tenant.id, ["berlin"])
    again = await service.reserve(tenant.id, "k1", [{"sku": "tee", "quantity": 2}])
    assert again.replayed and again.reservation is not None and first.reservation is not None
    assert again.reservation.lines == first.reservation.lines == (Line("tee", "paris", 2),)
    assert again.reservation.id == first.reservation.id
    with pytest.raises(IdempotencyKeyReused):
        await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 2, split=True)])
    with pytest.raises(IdempotencyKeyReused):
        await service.reserve(tenant.id, "k1", [("tee", "paris", 2)])
    assert await available(service, tenant, "tee") == {"berlin": 10, "paris": 8}


async def test_bad_allocated_lines_are_typed_errors_that_write_nothing(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """Two allocated lines of one SKU, split on a line with a location, a bad priority,
    an unknown SKU (UnknownStock naming it with no location) and an unknown tenant are
    refused and write nothing."""
    await stock(service, tenant, "tee", berlin=10)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match="merge them"):
        await service.reserve(tenant.id, "k", [AllocatedLine("tee", 1), ("tee", None, 2)])
    with pytest.raises(InvalidRequest, match="split applies only"):
        await service.reserve(tenant.id, "k", [{"sku": "tee", "location": "berlin",
                                                "quantity": 1, "split": True},
                                               AllocatedLine("cap", 1)])
    with pytest.raises(InvalidRequest, match="split"):
        await service.reserve(tenant.id, "k", [{"sku": "tee", "quantity": 1, "split": 1}])
    with pytest.raises(InvalidRequest, match="quantity"):
        await service.reserve(tenant.id, "k", [AllocatedLine("tee", 0)])
    with pytest.raises(InvalidRequest, match="twice"):
        await service.set_location_priority(tenant.id, ["a", "a"])
    with pytest.raises(InvalidRequest):
        await service.update_sku(tenant.id, "tee", location_priority="berlin")
    with pytest.raises(UnknownStock) as unknown:
        await service.reserve(tenant.id, "k", [AllocatedLine("nope", 1)])
    assert "nope" in str(unknown.value.details)
    with pytest.raises(UnknownTenant):
        await service.reserve(987654, "k", [AllocatedLine("tee", 1)])
    with pytest.raises(UnknownTenant):
        await service.set_location_priority(987654, ["berlin"])
    assert table_counts(dsn) == before
    assert await service.sku_settings(tenant.id, "tee") == SkuSettings("tee", None, None)


async def test_cart_limits_count_allocated_units_and_freezes_apply(
        service: ReservationService, tenant: Tenant) -> None:
    """A SKU's per-cart limit counts explicit and allocated units together; a frozen
    location is passed over by the allocation, a SKU whose every location is frozen is
    refused bucket_frozen, a frozen tenant tenant_frozen."""
    await stock(service, tenant, "tee", berlin=10, paris=10)
    await service.set_location_priority(tenant.id, ["berlin", "paris"])
    await service.set_cart_limit(tenant.id, "tee", 3)
    over = await service.reserve(tenant.id, "k1", [("tee", "paris", 2), AllocatedLine("tee", 2)])
    assert over.reason == "cart_limit_exceeded"
    await service.set_cart_limit(tenant.id, "tee", None)
    await service.freeze(tenant.id, "count", "ops", sku="tee", location="berlin")
    passed = await service.reserve(tenant.id, "k2", [AllocatedLine("tee", 2)])
    assert passed.reservation is not None
    assert passed.reservation.lines == (Line("tee", "paris", 2),)
    await service.freeze(tenant.id, "count", "ops", sku="tee", location="paris")
    frozen = await service.reserve(tenant.id, "k3", [AllocatedLine("tee", 2)])
    assert frozen.reason == "bucket_frozen" and len(frozen.frozen_lines) == 2
    await service.freeze(tenant.id, "audit", "ops")
    assert (await service.reserve(tenant.id, "k4", [AllocatedLine("tee", 1)])).reason == (
        "tenant_frozen")


async def test_expiry_gives_back_exactly_the_allocated_buckets(
        timed: ReservationService, tenant: Tenant, clock: Clock, db: Database) -> None:
    """A split hold that expires gives each location back what it gave, once, and those
    units serve the next allocation."""
    await stock(timed, tenant, "tee", berlin=2, paris=2)
    out = await timed.reserve(tenant.id, "k1", [AllocatedLine("tee", 3, split=True)], ttl=60)
    assert out.reservation is not None
    assert out.reservation.lines == (Line("tee", "berlin", 2), Line("tee", "paris", 1))
    clock.advance(61)
    assert await timed.expire_due() == 1
    assert await available(timed, tenant, "tee") == {"berlin": 2, "paris": 2}
    again = await timed.reserve(tenant.id, "k2", [AllocatedLine("tee", 4, split=True)])
    assert again.held
    assert await timed.invariant_violations(tenant.id) == []


async def test_allocation_keeps_safety_stock_and_promises_only_units_on_hand(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A location's safety stock is never allocated (3 of berlin's 5 kept: an unsplit 3
    goes to paris, a split 4 takes berlin's 2 then paris's 2); a backorder allowance
    serves a line that names its location in an allocated cart, never a line without
    one (refused with available 0 where only the allowance is left)."""
    await service.set_stock(tenant.id, "tee", "berlin", 5, strategy=strategy, safety_stock=3)
    await service.set_stock(tenant.id, "tee", "paris", 6, strategy=strategy)
    await service.set_location_priority(tenant.id, ["berlin", "paris"])
    whole = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 3)])
    assert whole.reservation is not None
    assert whole.reservation.lines == (Line("tee", "paris", 3),)
    split = await service.reserve(tenant.id, "k2", [AllocatedLine("tee", 4, split=True)])
    assert split.reservation is not None
    assert split.reservation.lines == (Line("tee", "berlin", 2), Line("tee", "paris", 2))
    await service.set_stock(tenant.id, "cap", "rome", 0, strategy=strategy, backorder_limit=5)
    mixed = await service.reserve(tenant.id, "k3", [("cap", "rome", 2),
                                                    AllocatedLine("tee", 1, split=True)])
    assert mixed.reservation is not None, mixed
    assert mixed.reservation.lines == (Line("cap", "rome", 2, 2), Line("tee", "paris", 1))
    refused = await service.reserve(tenant.id, "k4", [AllocatedLine("cap", 1)])
    assert refused.short_lines == (ShortLine("cap", None, 1, 0),)
    assert (await service.get_stock(tenant.id, "cap", "rome")).backorder_held == 2
    assert await service.invariant_violations(tenant.id) == []


async def test_an_allocated_cart_keeps_its_reference_and_metadata(
        service: ReservationService, tenant: Tenant) -> None:
    """An allocated hold keeps the shop's reference and metadata, in the answer and when
    read back; the same key with other metadata is IdempotencyKeyReused."""
    await stock(service, tenant, "tee", berlin=3)
    out = await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 1)],
                                reference="cart-9", metadata={"channel": "web"})
    assert out.reservation is not None
    assert (out.reservation.reference, out.reservation.metadata) == ("cart-9",
                                                                    {"channel": "web"})
    again = await service.get_reservation(tenant.id, out.reservation.id)
    assert (again.reference, again.metadata, again.lines) == (
        "cart-9", {"channel": "web"}, (Line("tee", "berlin", 1),))
    with pytest.raises(IdempotencyKeyReused):
        await service.reserve(tenant.id, "k1", [AllocatedLine("tee", 1)],
                              reference="cart-9", metadata={"channel": "app"})
