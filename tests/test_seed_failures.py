"""The six failure tests of seed 001_c95ed70301805c58, where the other test files leave gaps.

Already covered elsewhere, for both strategies (the `strategy` fixture):
  1. competing shortage, paused first, commit/rollback, both orders:
     test_concurrency.py::test_competing_shortage_with_paused_first
  2. same key from 8 connections + parameter conflict:
     test_concurrency.py::test_same_key_from_8_connections_has_one_effect
  3. lost reply after commit / rollback before commit:
     test_concurrency.py::test_lost_reply_after_commit_is_recovered_by_key,
     test_concurrency.py::test_rollback_before_commit_lets_the_retry_run
  4. release vs release, release vs sweeper, claim vs release (unpaused, many at once):
     test_concurrency.py::test_release_races_release_sweeper_and_claim,
     test_lifecycle.py::test_release_gives_back_exactly_once
  5. partial insufficiency 2 of S1 (5) + 4 of S2 (3):
     test_lifecycle.py::test_two_line_cart_with_short_second_line_holds_nothing
  6. invalid values: test_bad_input.py; opposite-order carts:
     test_concurrency.py::test_opposite_order_carts_never_partial_never_deadlock
This file adds: same-key collisions at each stage of the first transaction,
an exception injected mid-transaction then retried with the same key, the
paused release/claim/expiry competitions, a successful two-bucket order and
a deadlock that is classified and retried.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from conftest import table_counts
from pgreserve import Database, ReservationService, Status, Tenant
from pgreserve.errors import IdempotencyKeyReused, ReservationClaimed, ReservationReleased
from test_concurrency import reserve_sql, wait_until_blocked


def key_lock_sql(tenant: int, key: str) -> tuple[str, tuple[object, ...]]:
    """The same-key lock reserve_v1 takes first, before it reads or inserts anything."""
    return "SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))", (key, tenant)


async def counts(dsn: str) -> tuple[int, int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM reservation), (SELECT count(*) FROM request_ledger),"
            " (SELECT coalesce(sum(quantity), 0) FROM reservation_line WHERE held)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize(("stage", "ends"), [("before_insert", "commit"),
                                             ("before_commit", "commit"),
                                             ("before_commit", "rollback")])
async def test_same_key_collision_at_each_stage(
        dsn: str, db: Database, tenant: Tenant, strategy: str,
        stage: str, ends: str, batching: bool) -> None:
    """Two same-key requests arriving while the first transaction is before its insert, or after its update and before commit: one reservation, one decrement, one id (batched, both wait in one batch's transaction)."""
    service = ReservationService(db, batching=batching)
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    with psycopg.connect(dsn) as first:
        if stage == "before_insert":
            sql, params = key_lock_sql(tenant.id, "order-A-reserve-1")
        else:
            sql, params = reserve_sql(tenant.id, "order-A-reserve-1", "s", "w", 7)
        first.execute(sql, params)
        racers = [asyncio.create_task(service.reserve(
            tenant.id, "order-A-reserve-1", [("s", "w", 7)], ttl=timedelta(minutes=15)))
            for _ in range(2)]
        await wait_until_blocked(dsn, 1 if batching else 2)
        assert not any(t.done() for t in racers)
        first.commit() if ends == "commit" else first.rollback()
    outs = await asyncio.gather(*racers)
    ids = {o.reservation.id for o in outs if o.reservation}
    assert all(o.held for o in outs) and len(ids) == 1
    # the first transaction's own effect counts once, whoever made it
    assert await counts(dsn) == (1, 1, 7)
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (7, 3)
    assert await service.invariant_violations() == []


async def test_parameter_conflict_while_first_is_uncommitted(
        dsn: str, service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """The same key with 8 units while the 7-unit original is uncommitted: key reused, original untouched."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    sql, params = reserve_sql(tenant.id, "order-A-reserve-1", "s", "w", 7)
    with psycopg.connect(dsn) as first:
        first.execute(sql, params)
        conflict = asyncio.create_task(service.reserve(
            tenant.id, "order-A-reserve-1", [("s", "w", 8)], ttl=timedelta(minutes=15)))
        await wait_until_blocked(dsn)
        first.commit()
    with pytest.raises(IdempotencyKeyReused):
        await conflict
    assert await counts(dsn) == (1, 1, 7)
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (7, 3)


@pytest.mark.parametrize("fault", ["exception", "terminated"])
async def test_failure_mid_transaction_then_same_key_retry(
        dsn: str, service: ReservationService, tenant: Tenant, strategy: str,
        fault: str) -> None:
    """An exception (or a killed backend) after reserve_v1's writes rolls everything back; the same key then reserves once."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    before = table_counts(dsn)
    sql, params = reserve_sql(tenant.id, "A", "s", "w", 7)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql, params)
        if fault == "exception":
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1 / 0")
            conn.rollback()
        else:
            pid = conn.info.backend_pid
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            with pytest.raises(psycopg.OperationalError):
                conn.execute("SELECT 1")
    assert table_counts(dsn) == before
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (0, 10)
    retry = await service.reserve(tenant.id, "A", [("s", "w", 7)], ttl=timedelta(minutes=15))
    assert retry.held and not retry.replayed
    again = await service.reserve(tenant.id, "A", [("s", "w", 7)], ttl=timedelta(minutes=15))
    assert again.replayed and again.reservation and retry.reservation
    assert again.reservation.id == retry.reservation.id
    assert await counts(dsn) == (1, 1, 7)
    assert await service.invariant_violations() == []


async def test_release_with_exception_mid_transaction_restores_once(
        dsn: str, service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A release that fails after its writes leaves the hold intact; the next release restores once, a repeat none."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    out = await service.reserve(tenant.id, "A", [("s", "w", 7)])
    assert out.reservation is not None
    rid = uuid.UUID(out.reservation.id)
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT release_v1(%s, %s)", (tenant.id, rid))
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        conn.rollback()
    assert (await service.get_reservation(tenant.id, rid)).status is Status.ACTIVE
    assert (await service.get_stock(tenant.id, "s", "w")).available == 3
    first = await service.release(tenant.id, rid)
    second = await service.release(tenant.id, rid)
    assert first.status is second.status is Status.RELEASED
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.available) == (10, 0, 10)
    assert await service.invariant_violations() == []


@pytest.mark.parametrize("first_op", ["release", "claim"])
@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
async def test_paused_claim_or_release_against_the_other(
        dsn: str, service: ReservationService, tenant: Tenant, strategy: str,
        first_op: str, first_ends: str) -> None:
    """Claim vs release with the first paused before commit: the second waits, then obeys the first's outcome; units move once."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    out = await service.reserve(tenant.id, "A", [("s", "w", 7)])
    assert out.reservation is not None
    rid = uuid.UUID(out.reservation.id)
    second_op = service.claim if first_op == "release" else service.release
    with psycopg.connect(dsn) as first:
        first.execute(f"SELECT {first_op}_v1(%s, %s)", (tenant.id, rid))
        second = asyncio.create_task(second_op(tenant.id, rid))
        await wait_until_blocked(dsn)
        first.commit() if first_ends == "commit" else first.rollback()
    view_status: Status
    if first_ends == "commit":
        expected = ReservationReleased if first_op == "release" else ReservationClaimed
        with pytest.raises(expected):
            await second
        view_status = Status.RELEASED if first_op == "release" else Status.CLAIMED
    else:
        view_status = (await second).status
        assert view_status is (Status.CLAIMED if first_op == "release" else Status.RELEASED)
    assert (await service.get_reservation(tenant.id, rid)).status is view_status
    view = await service.get_stock(tenant.id, "s", "w")
    if view_status is Status.CLAIMED:
        assert (view.on_hand, view.reserved, view.available) == (3, 0, 3)
    else:
        assert (view.on_hand, view.reserved, view.available) == (10, 0, 10)
    with psycopg.connect(dsn) as conn:
        moves = conn.execute("SELECT kind, count(*) FROM stock_movement WHERE reservation_id = %s"
                             " GROUP BY kind ORDER BY kind", (rid,)).fetchall()
    assert moves == ([("sale", 1)] if view_status is Status.CLAIMED else [("restore", 1)])
    assert await service.invariant_violations() == []


class Later:
    """The database clock an hour ahead: every hold made now is due."""

    def __call__(self) -> datetime:
        return datetime.now(UTC) + timedelta(hours=1)


async def test_paused_sweeper_against_release(
        dsn: str, db: Database, service: ReservationService, tenant: Tenant,
        strategy: str) -> None:
    """The sweeper expires a hold and pauses; a release waits, then answers 'expired' and restores nothing more."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    out = await service.reserve(tenant.id, "A", [("s", "w", 7)], ttl=60)
    assert out.reservation is not None
    rid = out.reservation.id
    with psycopg.connect(dsn) as sweeper:
        assert sweeper.execute("SELECT expire_due_v1(10, %s)", (Later()(),)).fetchone() == (1,)
        release = asyncio.create_task(service.release(tenant.id, rid))
        await wait_until_blocked(dsn)
        sweeper.commit()
    assert (await release).status is Status.EXPIRED
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.available) == (10, 0, 10)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM stock_movement WHERE kind = 'restore'"
                            ).fetchone() == (1,)
    assert await ReservationService(db, clock=Later()).invariant_violations() == []


async def test_two_bucket_order_succeeds_whole(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """2 of S1 (stock 5) and 3 of S2 (stock 3): held whole, both buckets decremented together."""
    await service.set_stock(tenant.id, "S1", "w", 5, strategy=strategy)
    await service.set_stock(tenant.id, "S2", "w", 3, strategy=strategy)
    out = await service.reserve(tenant.id, "cart", [("S2", "w", 3), ("S1", "w", 2)])
    assert out.held and out.reservation is not None
    assert sorted((x.sku, x.quantity) for x in out.reservation.lines) == [("S1", 2), ("S2", 3)]
    assert (await service.get_stock(tenant.id, "S1", "w")).available == 3
    assert (await service.get_stock(tenant.id, "S2", "w")).available == 0
    assert await service.invariant_violations() == []


async def test_deadlock_is_classified_and_retried_with_same_key(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """A cart deadlocked by a writer that breaks the lock order is retried whole with its key: one reservation, no partial lines."""
    # Row strategy only: a pool take locks units with SKIP LOCKED, never the
    # bucket row, so a pool cart cannot wait on (or deadlock with) that writer.
    strategy = "row"
    await service.set_stock(tenant.id, "A", "w", 10, strategy=strategy)
    await service.set_stock(tenant.id, "B", "w", 10, strategy=strategy)
    with psycopg.connect(dsn) as other:
        # A writer that breaks the lock order: B's bucket row first, then A's.
        other.execute("SELECT 1 FROM stock_bucket WHERE sku = 'B' FOR UPDATE")
        task = asyncio.create_task(service.reserve(
            tenant.id, "cart", [("A", "w", 1), ("B", "w", 1)]))
        await wait_until_blocked(dsn)
        try:
            other.execute("SELECT 1 FROM stock_bucket WHERE sku = 'A' FOR UPDATE")
            rogue_was_victim = False
        except psycopg.errors.DeadlockDetected:
            rogue_was_victim = True
        other.rollback()
    out = await task
    assert out.held
    # Whichever side PostgreSQL picked: if it was the reserve, Database
    # classified the 40P01 and re-ran the whole transaction with the same key.
    assert service.db.stats.deadlocks_retried == (0 if rogue_was_victim else 1)
    assert await counts(dsn) == (1, 1, 2)
    assert await service.invariant_violations() == []
