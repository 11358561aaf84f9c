"""Reserve, claim, release, extend and expire, for both strategies."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conftest import Clock
from pgreserve import Database, ReservationService, Status, Tenant
from pgreserve.errors import (
    ReservationClaimed,
    ReservationExpired,
    ReservationNotActive,
    ReservationReleased,
    UnknownStock,
    WouldOversell,
)


async def assert_invariants(service: ReservationService) -> None:
    assert await service.invariant_violations() == []


async def test_reserve_then_claim_deducts_on_hand(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A claim turns the hold into a sale: on_hand drops, reserved drops, available stays."""
    await service.set_stock(tenant.id, "sku-1", "wh", 10, strategy=strategy)
    out = await service.reserve(tenant.id, "k1", [("sku-1", "wh", 3)])
    assert out.held and out.reservation is not None
    view = await service.get_stock(tenant.id, "sku-1", "wh")
    assert (view.on_hand, view.reserved, view.available) == (10, 3, 7)
    claimed = await service.claim(tenant.id, out.reservation.id)
    assert claimed.status is Status.CLAIMED and claimed.claimed_at is not None
    view = await service.get_stock(tenant.id, "sku-1", "wh")
    assert (view.on_hand, view.reserved, view.available) == (7, 0, 7)
    again = await service.claim(tenant.id, out.reservation.id)
    assert again.claimed_at == claimed.claimed_at
    assert (await service.get_stock(tenant.id, "sku-1", "wh")).on_hand == 7
    with pytest.raises(ReservationClaimed):
        await service.release(tenant.id, out.reservation.id)
    await assert_invariants(service)


async def test_release_gives_back_exactly_once(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """Releasing twice restores the units once and returns the same state."""
    await service.set_stock(tenant.id, "s", "l", 10, strategy=strategy)
    out = await service.reserve(tenant.id, "k", [("s", "l", 7)])
    assert out.reservation is not None
    first = await service.release(tenant.id, out.reservation.id)
    second = await service.release(tenant.id, out.reservation.id)
    assert first == second and first.status is Status.RELEASED
    view = await service.get_stock(tenant.id, "s", "l")
    assert (view.on_hand, view.reserved, view.available) == (10, 0, 10)
    with pytest.raises(ReservationReleased):
        await service.claim(tenant.id, out.reservation.id)
    await assert_invariants(service)


async def test_expired_hold_stops_counting_without_the_sweeper(
        timed: ReservationService, tenant: Tenant, clock: Clock, strategy: str) -> None:
    """Past expires_at a hold no longer counts, for reads and for new reservations."""
    await timed.set_stock(tenant.id, "s", "l", 5, strategy=strategy)
    first = await timed.reserve(tenant.id, "a", [("s", "l", 5)], ttl=60)
    assert first.held
    assert not (await timed.reserve(tenant.id, "b", [("s", "l", 1)])).held
    clock.advance(61)
    view = await timed.get_stock(tenant.id, "s", "l")
    assert (view.reserved, view.available) == (0, 5)
    assert first.reservation is not None
    assert (await timed.get_reservation(tenant.id, first.reservation.id)).status is Status.EXPIRED
    second = await timed.reserve(tenant.id, "c", [("s", "l", 5)])
    assert second.held
    await assert_invariants(timed)
    # the sweeper then finds the first one and restores nothing twice
    assert await timed.expire_due() == 1
    view = await timed.get_stock(tenant.id, "s", "l")
    assert (view.on_hand, view.reserved, view.available) == (5, 5, 0)
    await assert_invariants(timed)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("lines", [1, 2])
async def test_a_release_past_expiry_before_the_sweeper_is_final(
        db: Database, tenant: Tenant, clock: Clock, strategy: str, batching: bool,
        lines: int) -> None:
    """A hold past its expiry reads as expired; a release before the sweeper records
    it ends it released (the shop's word that its units must not be sold): units back
    once, and a later claim (a late payment callback) is refused, where an expired
    reservation could have been claimed late. The sweeper finds nothing to do."""
    svc = ReservationService(db, clock=clock, batching=batching)
    cart = [("s", "l", 2), ("t", "l", 1)][:lines]
    for sku, loc, _ in cart:
        await svc.set_stock(tenant.id, sku, loc, 5, strategy=strategy)
    held = await svc.reserve(tenant.id, "a", cart, ttl=60)
    assert held.reservation is not None
    rid = held.reservation.id
    clock.advance(61)
    assert (await svc.get_reservation(tenant.id, rid)).status is Status.EXPIRED
    assert (await svc.release(tenant.id, rid)).status is Status.RELEASED
    with pytest.raises(ReservationReleased):
        await svc.claim(tenant.id, rid)
    assert (await svc.release(tenant.id, rid)).status is Status.RELEASED
    assert await svc.expire_due() == 0
    for sku, loc, _ in cart:
        view = await svc.get_stock(tenant.id, sku, loc)
        assert (view.on_hand, view.reserved, view.available) == (5, 0, 5)
    await assert_invariants(svc)


async def test_sweeper_expires_and_restores(
        timed: ReservationService, tenant: Tenant, clock: Clock, strategy: str) -> None:
    """The sweeper moves due reservations to expired and gives their units back."""
    await timed.set_stock(tenant.id, "s", "l", 10, strategy=strategy)
    ids = []
    for i in range(5):
        out = await timed.reserve(tenant.id, f"k{i}", [("s", "l", 2)], ttl=30 + i)
        assert out.reservation is not None
        ids.append(out.reservation.id)
    clock.advance(32)
    assert await timed.expire_due(batch=500) == 3
    assert await timed.expire_due(batch=500) == 0
    statuses = [(await timed.get_reservation(tenant.id, i)).status for i in ids]
    assert statuses == [Status.EXPIRED] * 3 + [Status.ACTIVE] * 2
    view = await timed.get_stock(tenant.id, "s", "l")
    assert (view.on_hand, view.reserved, view.available) == (10, 4, 6)
    await assert_invariants(timed)


async def test_claim_after_expiry_retakes_when_stock_allows(
        timed: ReservationService, tenant: Tenant, clock: Clock, strategy: str) -> None:
    """An expired reservation is claimed only if its units can all be taken again."""
    await timed.set_stock(tenant.id, "s", "l", 4, strategy=strategy)
    late = await timed.reserve(tenant.id, "late", [("s", "l", 3)], ttl=10)
    gone = await timed.reserve(tenant.id, "gone", [("s", "l", 1)], ttl=10)
    assert late.reservation is not None and gone.reservation is not None
    clock.advance(11)
    await timed.expire_due()
    claimed = await timed.claim(tenant.id, late.reservation.id)
    assert claimed.status is Status.CLAIMED
    # now the other one's unit was taken by a new buyer: its claim must fail
    assert (await timed.reserve(tenant.id, "new", [("s", "l", 1)])).held
    with pytest.raises(ReservationExpired):
        await timed.claim(tenant.id, gone.reservation.id)
    view = await timed.get_stock(tenant.id, "s", "l")
    assert (view.on_hand, view.reserved, view.available) == (1, 1, 0)
    assert (await timed.get_reservation(tenant.id, gone.reservation.id)).status is Status.EXPIRED
    await assert_invariants(timed)


async def test_extend_moves_expiry_of_active_only(
        timed: ReservationService, tenant: Tenant, clock: Clock, strategy: str) -> None:
    """Extend gives an active hold a new TTL; an expired one cannot be extended."""
    await timed.set_stock(tenant.id, "s", "l", 2, strategy=strategy)
    out = await timed.reserve(tenant.id, "k", [("s", "l", 2)], ttl=10)
    assert out.reservation is not None
    clock.advance(9)
    extended = await timed.extend(tenant.id, out.reservation.id, 60)
    assert extended.expires_at == clock.now + timedelta(seconds=60)
    clock.advance(30)
    assert (await timed.get_stock(tenant.id, "s", "l")).reserved == 2
    assert await timed.expire_due() == 0
    clock.advance(31)
    with pytest.raises(ReservationNotActive):
        await timed.extend(tenant.id, out.reservation.id, 60)
    await assert_invariants(timed)


async def test_two_line_cart_with_short_second_line_holds_nothing(
        service: ReservationService, tenant: Tenant, strategy: str, dsn: str) -> None:
    """2 of S1 (stock 5) and 4 of S2 (stock 3): rejected whole, both buckets unchanged."""
    await service.set_stock(tenant.id, "S1", "w", 5, strategy=strategy)
    await service.set_stock(tenant.id, "S2", "w", 3, strategy=strategy)
    out = await service.reserve(tenant.id, "cart", [("S1", "w", 2), ("S2", "w", 4)])
    assert not out.held
    assert [(s.sku, s.requested, s.available) for s in out.short_lines] == [("S2", 4, 3)]
    for sku, n in (("S1", 5), ("S2", 3)):
        view = await service.get_stock(tenant.id, sku, "w")
        assert (view.on_hand, view.reserved, view.available) == (n, 0, n)
    from conftest import table_counts

    assert table_counts(dsn)["reservation"] == 0
    await assert_invariants(service)


async def test_rejection_is_stored_and_survives_restock(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A rejected key stays rejected after a restock; a new key then succeeds."""
    await service.set_stock(tenant.id, "s", "l", 1, strategy=strategy)
    assert not (await service.reserve(tenant.id, "k", [("s", "l", 2)])).held
    await service.adjust_stock(tenant.id, "receipt-1", "s", "l", 5)
    replay = await service.reserve(tenant.id, "k", [("s", "l", 2)])
    assert not replay.held and replay.replayed
    assert (await service.reserve(tenant.id, "k2", [("s", "l", 2)])).held


async def test_correction_below_held_is_refused_unless_forced(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A correction cutting into held units raises WouldOversell; forced, it records a shortfall."""
    await service.set_stock(tenant.id, "s", "l", 10, strategy=strategy)
    out = await service.reserve(tenant.id, "k", [("s", "l", 8)])
    assert out.reservation is not None
    with pytest.raises(WouldOversell):
        await service.adjust_stock(tenant.id, "c1", "s", "l", -5)
    view = await service.get_stock(tenant.id, "s", "l")
    assert (view.on_hand, view.available) == (10, 2)
    ok = await service.adjust_stock(tenant.id, "c2", "s", "l", -2)
    assert (ok.on_hand, ok.available, ok.shortfall) == (8, 0, 0)
    forced = await service.adjust_stock(tenant.id, "c3", "s", "l", -3, force=True)
    assert (forced.on_hand, forced.available, forced.shortfall) == (8, 0, 3)
    # the released hold's missing units are written off, not made available
    await service.release(tenant.id, out.reservation.id)
    view = await service.get_stock(tenant.id, "s", "l")
    assert (view.on_hand, view.available, view.shortfall) == (5, 5, 0)
    await assert_invariants(service)


async def test_adjust_is_idempotent_by_key(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """The same receipt sent twice adds its units once."""
    await service.set_stock(tenant.id, "s", "l", 1, strategy=strategy)
    a = await service.adjust_stock(tenant.id, "r1", "s", "l", 4, reason="PO-1")
    b = await service.adjust_stock(tenant.id, "r1", "s", "l", 4, reason="PO-1")
    assert a.on_hand == b.on_hand == 5 and b.replayed
    assert (await service.get_stock(tenant.id, "s", "l")).on_hand == 5


async def test_unknown_stock_is_not_insufficient_stock(
        service: ReservationService, tenant: Tenant) -> None:
    """A bucket the tenant lacks raises UnknownStock, naming the line."""
    await service.set_stock(tenant.id, "s", "l", 1)
    with pytest.raises(UnknownStock) as info:
        await service.reserve(tenant.id, "k", [("s", "l", 1), ("nope", "l", 1)])
    assert info.value.details["detail"] == [{"sku": "nope", "location": "l"}]
    assert (await service.get_stock(tenant.id, "s", "l")).available == 1


async def test_strategy_switch_keeps_every_unit(
        service: ReservationService, tenant: Tenant) -> None:
    """Switching row -> pool -> row with holds outstanding keeps the accounting exact."""
    await service.set_stock(tenant.id, "s", "l", 20)
    a = await service.reserve(tenant.id, "a", [("s", "l", 5)])
    pool = await service.set_stock(tenant.id, "s", "l", 20, strategy="pool", pool_cap=8)
    assert (pool.strategy.value, pool.reserved, pool.available, pool.pool) == ("pool", 5, 15, 8)
    b = await service.reserve(tenant.id, "b", [("s", "l", 10)])
    assert b.held and a.reservation is not None
    await service.release(tenant.id, a.reservation.id)
    row = await service.set_stock(tenant.id, "s", "l", 20, strategy="row")
    assert (row.strategy.value, row.reserved, row.available, row.pool) == ("row", 10, 10, 0)
    await assert_invariants(service)


async def test_invariant_check_finds_planted_drift(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """The invariant check reports an accounting drift, a stray pool unit and a finished-but-held line."""
    import psycopg

    await service.set_stock(tenant.id, "s", "l", 10)
    out = await service.reserve(tenant.id, "k", [("s", "l", 2)])
    assert out.reservation is not None
    assert await service.invariant_violations() == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE stock_bucket SET free = free + 1")
        conn.execute("INSERT INTO stock_unit (tenant_id, bucket_id)"
                     " SELECT tenant_id, bucket_id FROM stock_bucket")
        conn.execute("ALTER TABLE reservation DISABLE TRIGGER reservation_transition_guard")
        conn.execute("UPDATE reservation SET status = 'released', released_at = now()")
    rules = {v.rule for v in await service.invariant_violations()}
    assert rules == {"accounting", "pool_on_row_bucket", "finished_but_held"}
