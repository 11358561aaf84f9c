"""Group commit: a bucket's concurrent requests share one transaction, each with its own answer."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any

import psycopg
import pytest

from conftest import table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.core.batching import BatchConfig, BatchRequest, Combiner
from pgreserve.core.service import digest
from pgreserve.errors import Busy, IdempotencyKeyReused, ReservationClaimed
from test_concurrency import wait_until_blocked


@contextlib.contextmanager
def bucket_locked(dsn: str, bucket: int) -> Iterator[psycopg.Connection[Any]]:
    """A transaction holding the bucket row (batches queue behind it) until rollback."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM stock_bucket WHERE bucket_id = %s FOR UPDATE", (bucket,))
        yield blocker


async def bucket_id(db: Database, tenant: int, sku: str) -> int:
    rows = await db.fetch("SELECT bucket_id FROM stock_bucket WHERE tenant_id = %s AND sku = %s",
                          (tenant, sku))
    return int(rows[0][0])


async def test_concurrent_buyers_share_batches_and_each_gets_its_answer(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """100 concurrent one-unit buyers of 40 units: exactly 40 held, 60 rejected with
    available 0, in fewer transactions than requests, and the books balance."""
    await service.set_stock(tenant.id, "hot", "w", 41, strategy=strategy)
    # one hold first: the bucket's id is then cached and the 100 queue at once
    assert (await service.reserve(tenant.id, "warm", [("hot", "w", 1)])).held
    outs = await asyncio.gather(*(service.reserve(tenant.id, f"k{i}", [("hot", "w", 1)])
                                  for i in range(100)))
    held = [o for o in outs if o.held]
    assert len(held) == 40
    assert len({o.reservation.id for o in held if o.reservation}) == 40
    assert all(o.short_lines[0].available == 0 for o in outs if not o.held)
    assert service.combiner is not None
    assert service.combiner.stats.requests == 101
    assert service.combiner.stats.batches < 100
    view = await service.get_stock(tenant.id, "hot", "w")
    assert (view.on_hand, view.reserved, view.available) == (41, 41, 0)
    assert await service.invariant_violations() == []


async def test_a_batch_decides_in_arrival_order(db: Database, tenant: Tenant,
                                               service: ReservationService) -> None:
    """Within one batch the earlier request wins the last units: with 3 units left,
    requests of 2, 2 and 1 queued behind a busy bucket go as one batch and hold the first
    and the third."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 4)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    ttl = timedelta(minutes=5)
    with bucket_locked(db.conninfo, bucket) as blocker:
        first = asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest(
            "reserve", key="first", digest="d", quantity=1, ttl=ttl)))
        await wait_until_blocked(db.conninfo)
        later = [asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest(
            "reserve", key=f"r{i}", digest="d", quantity=q, ttl=ttl)))
            for i, q in enumerate((2, 2, 1))]
        await asyncio.sleep(0.05)
        blocker.rollback()
    assert (await first)["ok"]["status"] == "held"
    answers = await asyncio.gather(*later)
    assert [a["ok"]["status"] for a in answers] == ["held", "rejected", "held"]
    assert answers[1]["ok"]["short_lines"][0]["available"] == 1
    assert combiner.stats.sizes[3] == 3  # the three waited together and went as one batch


async def test_duplicate_keys_in_one_batch_act_once(db: Database, tenant: Tenant,
                                                   service: ReservationService,
                                                   dsn: str) -> None:
    """The same key twice in one batch holds once and replays; the same key with other
    parameters is IdempotencyKeyReused and changes nothing."""
    await service.set_stock(tenant.id, "s", "w", 10)
    same = await asyncio.gather(*(service.reserve(tenant.id, "twice", [("s", "w", 2)])
                                  for _ in range(2)))
    assert all(o.held for o in same)
    assert same[0].reservation is not None and same[1].reservation is not None
    assert same[0].reservation.id == same[1].reservation.id
    assert sorted(o.replayed for o in same) == [False, True]
    results = await asyncio.gather(
        service.reserve(tenant.id, "other", [("s", "w", 1)]),
        service.reserve(tenant.id, "other", [("s", "w", 5)]), return_exceptions=True)
    assert sum(isinstance(r, IdempotencyKeyReused) for r in results) == 1
    assert table_counts(dsn)["reservation"] == 2
    view = await service.get_stock(tenant.id, "s", "w")
    assert view.reserved == 3
    assert await service.invariant_violations() == []


async def test_claims_and_releases_batch_with_holds(service: ReservationService,
                                                    tenant: Tenant, strategy: str) -> None:
    """Concurrent claims, releases and new holds of one bucket: each transition happens once,
    a claim after a release in the same burst is refused, and the books balance."""
    await service.set_stock(tenant.id, "s", "w", 30, strategy=strategy)
    holds = [await service.reserve(tenant.id, f"h{i}", [("s", "w", 1)]) for i in range(20)]
    ids = [h.reservation.id for h in holds if h.reservation]
    work: list[Coroutine[Any, Any, object]] = [service.claim(tenant.id, rid) for rid in ids[:10]]
    work += [service.release(tenant.id, rid, request_key=f"rel-{rid}") for rid in ids[10:]]
    work += [service.reserve(tenant.id, f"n{i}", [("s", "w", 1)]) for i in range(15)]
    results = await asyncio.gather(*work)
    assert len(results) == 35
    again = await asyncio.gather(*(service.release(tenant.id, rid) for rid in ids[:3]),
                                 return_exceptions=True)
    assert all(isinstance(r, ReservationClaimed) for r in again)
    replay = await service.release(tenant.id, ids[10], request_key=f"rel-{ids[10]}")
    assert replay.replayed
    new_holds = sum(1 for r in results[20:] if getattr(r, "held", False))
    assert 10 <= new_holds <= 15  # 10 free before the releases, 20 after
    view = await service.get_stock(tenant.id, "s", "w")
    assert view.on_hand == 20  # 10 sold
    assert (view.reserved, view.available) == (new_holds, 20 - new_holds)
    assert await service.invariant_violations() == []


async def test_a_poison_request_fails_alone(db: Database, tenant: Tenant,
                                           service: ReservationService) -> None:
    """A request that makes the batch's transaction fail is isolated by splitting: it gets
    its error, every other request of the batch its own answer."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    ttl = timedelta(minutes=5)
    requests = [BatchRequest("reserve", key=f"g{i}", digest="d", quantity=1, ttl=ttl)
                for i in range(6)]
    # a zero quantity passes the batch's arithmetic and breaks a CHECK at insert
    requests.insert(3, BatchRequest("reserve", key="poison", digest="d", quantity=0, ttl=ttl))
    answers = await asyncio.gather(*(combiner.submit(tenant.id, bucket, r) for r in requests),
                                   return_exceptions=True)
    assert isinstance(answers[3], psycopg.errors.CheckViolation)
    assert [a["ok"]["status"] for i, a in enumerate(answers)
            if i != 3 and isinstance(a, dict)] == ["held"] * 6
    assert combiner.stats.splits >= 1
    view = await service.get_stock(tenant.id, "s", "w")
    assert view.reserved == 6
    assert await service.invariant_violations() == []


async def test_a_full_queue_answers_busy_at_once(db: Database, tenant: Tenant,
                                                service: ReservationService) -> None:
    """With the bucket's queue full, a request is answered Busy at once, not queued; the
    queued ones are answered when the bucket is free again."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db, BatchConfig(max_batch=1, max_queue=2))
    req = [BatchRequest("reserve", key=f"q{i}", digest="d", quantity=1,
                        ttl=timedelta(minutes=5)) for i in range(4)]
    with bucket_locked(db.conninfo, bucket) as blocker:
        in_flight = asyncio.create_task(combiner.submit(tenant.id, bucket, req[0]))
        await wait_until_blocked(db.conninfo)
        queued = [asyncio.create_task(combiner.submit(tenant.id, bucket, r)) for r in req[1:3]]
        await asyncio.sleep(0)
        with pytest.raises(Busy):
            await combiner.submit(tenant.id, bucket, req[3])
        blocker.rollback()
    answers = [await in_flight, *(await asyncio.gather(*queued))]
    assert [a["ok"]["status"] for a in answers] == ["held"] * 3
    assert combiner.stats.busy == 1


async def test_a_cancelled_caller_keeps_its_answer_for_the_retry(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """A caller that gives up while its batch waits does not cancel the request: the batch
    commits, and the retry with the same key replays the hold."""
    await service.set_stock(tenant.id, "s", "w", 5)
    bucket = await bucket_id(db, tenant.id, "s")
    with bucket_locked(db.conninfo, bucket) as blocker:
        caller = asyncio.create_task(service.reserve(tenant.id, "gave-up", [("s", "w", 2)]))
        await wait_until_blocked(db.conninfo)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        blocker.rollback()
    for _ in range(100):
        if service.combiner is not None and service.combiner.stats.requests:
            break
        await asyncio.sleep(0.02)
    retry = await service.reserve(tenant.id, "gave-up", [("s", "w", 2)])
    assert retry.held and retry.replayed


async def test_batched_and_unbatched_processes_on_one_bucket_stay_exact(
        dsn: str, tenant: Tenant, strategy: str) -> None:
    """Two services on separate pools, one batching and one not, racing for one bucket with
    holds, claims and releases: never more held than stock, every unit accounted for."""
    async with Database(dsn, max_size=8) as a, Database(dsn, max_size=8) as b:
        batched, plain = ReservationService(a), ReservationService(b, batching=False)
        await plain.set_stock(tenant.id, "s", "w", 50, strategy=strategy)

        async def buyer(svc: ReservationService, name: str) -> int:
            held = 0
            for i in range(20):
                out = await svc.reserve(tenant.id, f"{name}-{i}", [("s", "w", 1 + i % 3)])
                if out.held and out.reservation is not None:
                    held += 1
                    if i % 2:
                        await svc.claim(tenant.id, out.reservation.id)
                    elif i % 4 == 0:
                        await svc.release(tenant.id, out.reservation.id)
            return held

        await asyncio.gather(*(buyer(batched, f"a{n}") for n in range(6)),
                             *(buyer(plain, f"b{n}") for n in range(6)))
        view = await plain.get_stock(tenant.id, "s", "w")
        assert view.available >= 0 and view.reserved >= 0
        assert await plain.invariant_violations() == []


async def test_the_same_request_batched_or_not_gets_the_same_answer(
        dsn: str, tenant: Tenant) -> None:
    """A hold, a replay, a rejection, a claim and a keyed release answer the same documents
    through the combiner as through one transaction each."""
    answers: dict[bool, list[object]] = {}
    async with Database(dsn, max_size=4) as db:
        for batching in (True, False):
            svc = ReservationService(db, batching=batching)
            sku = f"s-{batching}"
            await svc.set_stock(tenant.id, sku, "w", 3)
            held = await svc.reserve(tenant.id, f"{sku}-a", [(sku, "w", 2)])
            replay = await svc.reserve(tenant.id, f"{sku}-a", [(sku, "w", 2)])
            short = await svc.reserve(tenant.id, f"{sku}-b", [(sku, "w", 2)])
            assert held.reservation is not None
            claimed = await svc.claim(tenant.id, held.reservation.id)
            other = await svc.reserve(tenant.id, f"{sku}-c", [(sku, "w", 1)])
            assert other.reservation is not None
            released = await svc.release(tenant.id, other.reservation.id, request_key=f"{sku}-r")
            again = await svc.release(tenant.id, other.reservation.id, request_key=f"{sku}-r")
            twice = await svc.claim(tenant.id, held.reservation.id)
            unkeyed_again = await svc.release(tenant.id, other.reservation.id)
            refusals = await asyncio.gather(
                svc.claim(tenant.id, other.reservation.id),
                svc.release(tenant.id, held.reservation.id),
                svc.claim(tenant.id, held.reservation.id, request_key=f"{sku}-r"),
                return_exceptions=True)
            answers[batching] = [
                (held.held, held.replayed), (replay.held, replay.replayed),
                short.short_lines[0].available, claimed.status, claimed.lines[0].quantity,
                released.status, again.replayed, twice.status,
                unkeyed_again.status, [type(r).__name__ for r in refusals]]
            assert twice.claimed_at == claimed.claimed_at
            assert digest("release", {"id": str(uuid.UUID(other.reservation.id))})
    assert answers[True] == answers[False]


async def test_a_late_claim_takes_its_units_again_in_a_batch(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A claim of a hold whose expiry was given up (inline, by another buyer) takes its units
    again when they are there, and fails with ReservationExpired when they are not."""
    from datetime import timedelta

    from pgreserve.errors import ReservationExpired

    await service.set_stock(tenant.id, "s", "w", 3, strategy=strategy)
    late = await service.reserve(tenant.id, "late", [("s", "w", 2)], ttl=timedelta(seconds=1))
    gone = await service.reserve(tenant.id, "gone", [("s", "w", 2)], ttl=timedelta(seconds=1))
    assert late.reservation is not None and not gone.held
    await asyncio.sleep(1.1)
    # a buyer of 2 gives up the expired hold inline and takes 2 of the 3 units
    taker = await service.reserve(tenant.id, "taker", [("s", "w", 2)])
    assert taker.held
    with pytest.raises(ReservationExpired):
        await service.claim(tenant.id, late.reservation.id)  # 1 unit left, 2 needed
    assert taker.reservation is not None
    await service.release(tenant.id, taker.reservation.id)
    claimed = await service.claim(tenant.id, late.reservation.id)
    assert claimed.status.value == "claimed"
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.available) == (1, 0, 1)
    assert await service.invariant_violations() == []


async def test_a_batch_session_killed_mid_batch_is_replaced(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """The combiner keeps one session for back-to-back batches. Its backend killed while a
    batch waits: that batch is retried whole on another connection, the batches queued
    behind it go out on a new session, and every request holds exactly once."""
    await service.set_stock(tenant.id, "s", "w", 10)
    assert (await service.reserve(tenant.id, "warm", [("s", "w", 1)])).held
    bucket = await bucket_id(db, tenant.id, "s")
    with psycopg.connect(db.conninfo, autocommit=True) as killer, \
            bucket_locked(db.conninfo, bucket) as blocker:
        first = asyncio.create_task(service.reserve(tenant.id, "first", [("s", "w", 1)]))
        await wait_until_blocked(db.conninfo)
        queued = [asyncio.create_task(service.reserve(tenant.id, f"q{i}", [("s", "w", 1)]))
                  for i in range(4)]
        await asyncio.sleep(0.05)
        killed = killer.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND query LIKE '%%bucket_batch_v1%%'").fetchall()
        assert killed == [(True,)]
        blocker.rollback()
    outs = [await first, *(await asyncio.gather(*queued))]
    assert all(o.held for o in outs)
    assert db.stats.connection_retried >= 1
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.reserved, view.available) == (6, 4)
    assert await service.invariant_violations() == []


async def test_a_release_of_a_given_up_hold_in_a_batch_restores_nothing_twice(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A hold whose expiry another buyer gave up inline is released through a batch: the
    reservation ends released, its units are not given back a second time, and the books
    balance (batched and unbatched answer the same)."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 3, strategy=strategy)
    late = await service.reserve(tenant.id, "late", [("s", "w", 2)], ttl=timedelta(seconds=1))
    assert late.reservation is not None
    await asyncio.sleep(1.1)
    taker = await service.reserve(tenant.id, "taker", [("s", "w", 3)])
    assert taker.held  # gave the expired hold up inline
    released = await service.release(tenant.id, late.reservation.id)
    assert released.status.value == "released"
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.available) == (3, 3, 0)
    assert await service.invariant_violations() == []


def _expiry_books(dsn: str, tenant: int) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT (SELECT count(*) FROM reservation WHERE tenant_id = %(t)s"
            "        AND status = 'expired' AND expired_at IS NOT NULL),"
            " (SELECT count(*) FROM stock_movement WHERE tenant_id = %(t)s"
            "        AND kind = 'restore' AND reason = 'expired'),"
            " (SELECT count(*) FROM outbox_event WHERE tenant_id = %(t)s"
            "        AND type = 'reservation.expired'),"
            " (SELECT count(*) FROM reservation_line WHERE tenant_id = %(t)s AND held)",
            {"t": tenant}).fetchone()  # type: ignore[return-value]  # one row


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_the_sweeper_expires_through_the_combiner(
        dsn: str, tenant: Tenant, strategy: str, batching: bool) -> None:
    """Due one-line holds expire through their bucket's combiner (one batch per bucket), a
    due cart of two lines through expire_due_v1; each ends expired with one restore
    movement and one event, batched or not, and the units are for sale again."""
    from datetime import timedelta

    async with Database(dsn, max_size=8) as db:
        service = ReservationService(db, batching=batching)
        for sku in ("a", "b"):
            await service.set_stock(tenant.id, sku, "w", 10, strategy=strategy)
        short = timedelta(seconds=1)
        holds = await asyncio.gather(*(
            service.reserve(tenant.id, f"h{i}", [("a" if i % 2 else "b", "w", 1)], ttl=short)
            for i in range(8)))
        cart = await service.reserve(tenant.id, "cart", [("a", "w", 2), ("b", "w", 2)],
                                     ttl=short)
        kept = await service.reserve(tenant.id, "kept", [("a", "w", 1)])
        assert all(h.held for h in holds) and cart.held and kept.held
        await asyncio.sleep(1.1)
        before = service.combiner.stats.batches if service.combiner else 0
        assert await service.expire_due() == 9
        if service.combiner is not None:
            # eight holds on two buckets: a batch or two per bucket, not one per hold
            assert 1 <= service.combiner.stats.batches - before <= 4
        assert await service.expire_due() == 0
        assert _expiry_books(dsn, tenant.id) == (9, 10, 9, 1)
        for sku in ("a", "b"):
            view = await service.get_stock(tenant.id, sku, "w")
            assert (view.reserved, view.available) == ((1, 9) if sku == "a" else (0, 10))
        assert await service.invariant_violations() == []


async def test_an_expiry_and_a_claim_in_one_batch_are_decided_in_arrival_order(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """A claim queued before the sweeper's expiry wins (the expiry is skipped); a claim
    queued after it is sent alone (one transition per reservation and batch) and takes
    the units back, as a late claim does. What is stored matches every answer."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 4)
    first = await service.reserve(tenant.id, "first", [("s", "w", 2)], ttl=timedelta(seconds=1))
    second = await service.reserve(tenant.id, "second", [("s", "w", 2)],
                                   ttl=timedelta(seconds=1))
    assert first.reservation is not None and second.reservation is not None
    await asyncio.sleep(1.1)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    ids = [uuid.UUID(first.reservation.id), uuid.UUID(second.reservation.id)]
    with bucket_locked(db.conninfo, bucket) as blocker:
        gate = asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest("refill")))
        await wait_until_blocked(db.conninfo)
        order = [BatchRequest("claim", reservation_id=ids[0]),
                 BatchRequest("expire", reservation_id=ids[0]),
                 BatchRequest("expire", reservation_id=ids[1]),
                 BatchRequest("claim", reservation_id=ids[1])]
        tasks = [asyncio.create_task(combiner.submit(tenant.id, bucket, r)) for r in order]
        await asyncio.sleep(0.05)
        blocker.rollback()
    await gate
    claim_first, expire_first, expire_second, claim_second = await asyncio.gather(*tasks)
    assert combiner.stats.batches == 2  # the gate, then the four together
    assert claim_first["ok"]["status"] == "claimed"
    assert expire_first == {"skipped": True}
    assert expire_second["ok"]["status"] == "expired"
    assert claim_second == {"retry": True}
    late = await service.claim(tenant.id, second.reservation.id)  # what the service does
    assert late.status.value == "claimed"
    with psycopg.connect(db.conninfo) as conn:
        stored = conn.execute(
            "SELECT reservation_id, status, claimed_at IS NOT NULL, expired_at IS NOT NULL"
            " FROM reservation WHERE tenant_id = %s ORDER BY created_at", (tenant.id,)
        ).fetchall()
        moves = conn.execute(
            "SELECT reservation_id, kind, reason FROM stock_movement"
            " WHERE tenant_id = %s AND reservation_id IS NOT NULL ORDER BY movement_id",
            (tenant.id,)).fetchall()
    assert stored == [(ids[0], "claimed", True, False), (ids[1], "claimed", True, True)]
    assert moves == [(ids[0], "sale", None), (ids[1], "restore", "expired"),
                     (ids[1], "sale", None)]
    assert (await service.get_reservation(tenant.id, second.reservation.id)).status.value \
        == "claimed"
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.available) == (0, 0, 0)
    assert await service.invariant_violations() == []


async def test_a_refill_of_a_busy_bucket_joins_its_next_batch(
        db: Database, tenant: Tenant) -> None:
    """While this process batches a pool bucket, the replenisher's refill goes into the
    next batch (after its holds) instead of a transaction that would find the bucket
    locked; on an idle bucket it runs on its own. Either way the pool is topped up."""
    from datetime import timedelta

    service = ReservationService(db)
    await service.set_stock(tenant.id, "s", "w", 100, strategy="pool", pool_cap=10)
    bucket = await bucket_id(db, tenant.id, "s")
    plain = ReservationService(db, batching=False)
    assert (await plain.reserve(tenant.id, "drain", [("s", "w", 10)])).held  # pool now empty
    assert service.combiner is not None
    with bucket_locked(db.conninfo, bucket) as blocker:
        hold = asyncio.create_task(service.reserve(tenant.id, "h", [("s", "w", 5)],
                                                   ttl=timedelta(minutes=5)))
        await wait_until_blocked(db.conninfo)
        assert service.combiner.busy(tenant.id, bucket)
        refill = asyncio.create_task(service.refill(tenant.id, bucket))
        await asyncio.sleep(0.05)
        blocker.rollback()
    assert (await hold).held
    assert await refill == 10
    assert service.combiner.stats.requests == 2 and service.combiner.stats.batches == 2
    assert not service.combiner.busy(tenant.id, bucket)
    view = await service.get_stock(tenant.id, "s", "w")
    assert (view.pool, view.reserved) == (10, 15)
    assert await service.refill(tenant.id, bucket) == 0  # idle: its own transaction
    assert service.combiner.stats.requests == 2
    assert await service.invariant_violations() == []


async def test_a_drain_cancelled_in_flight_answers_every_waiting_request(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """The combiner's drain cancelled (service shutdown) while a batch waits on the bucket:
    the request in flight gets OutcomeUnknown (its batch may commit), the queued one Busy
    (never sent); none is left waiting."""
    from datetime import timedelta

    from pgreserve.errors import OutcomeUnknown

    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db, BatchConfig(max_batch=1))
    reqs = [BatchRequest("reserve", key=f"c{i}", digest="d", quantity=1,
                         ttl=timedelta(minutes=5)) for i in range(2)]
    with bucket_locked(db.conninfo, bucket) as blocker:
        in_flight = asyncio.create_task(combiner.submit(tenant.id, bucket, reqs[0]))
        await wait_until_blocked(db.conninfo)
        queued = asyncio.create_task(combiner.submit(tenant.id, bucket, reqs[1]))
        await asyncio.sleep(0)
        drain = combiner._tasks[(tenant.id, bucket)]
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
        blocker.rollback()
    with pytest.raises(OutcomeUnknown):
        await in_flight
    with pytest.raises(Busy):
        await queued
    assert not combiner.busy(tenant.id, bucket)


async def test_a_look_mid_batch_sees_what_the_batch_wrote_off(db: Database,
                                                              tenant: Tenant) -> None:
    """A forced recount leaves a shortfall of 2 under two expired holds of 2. In one batch,
    expire, a reserve short enough to look at the bucket, expire: the shortfall is written
    off once (not again by the look's give-up), the reserve holds, the books balance."""
    from datetime import UTC, datetime, timedelta

    now = [datetime(2030, 1, 1, tzinfo=UTC)]
    plain = ReservationService(db, clock=lambda: now[0], batching=False)
    await plain.set_stock(tenant.id, "s", "w", 4)
    r1 = (await plain.reserve(tenant.id, "a", [("s", "w", 2)], ttl=60)).reservation
    r2 = (await plain.reserve(tenant.id, "b", [("s", "w", 2)], ttl=60)).reservation
    assert r1 is not None and r2 is not None
    await plain.set_stock(tenant.id, "s", "w", 2, force=True)  # 4 held, 2 counted
    now[0] += timedelta(seconds=120)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db, clock=lambda: now[0])
    with bucket_locked(db.conninfo, bucket) as blocker:
        gate = asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest("refill")))
        await wait_until_blocked(db.conninfo)
        tasks = [asyncio.create_task(combiner.submit(tenant.id, bucket, r)) for r in (
            BatchRequest("expire", reservation_id=uuid.UUID(r1.id)),
            BatchRequest("reserve", key="x", digest="d", quantity=1, ttl=timedelta(minutes=1)),
            BatchRequest("expire", reservation_id=uuid.UUID(r2.id)))]
        await asyncio.sleep(0.05)
        blocker.rollback()
    await gate
    first, held, second = await asyncio.gather(*tasks)
    # the refill; the first expiry and the reserve; the second expiry, after the
    # reserve's turn (it came after it: not decided before it)
    assert combiner.stats.splits == 0 and combiner.stats.batches == 3
    assert first["ok"]["status"] == second["ok"]["status"] == "expired"
    # short of free while the batch's own expired holds are still held: not decided
    # in the batch, the service sends it alone
    assert held == {"retry": True}
    view = await plain.get_stock(tenant.id, "s", "w")
    assert (view.on_hand, view.reserved, view.available) == (2, 0, 2)
    assert (await plain.reserve(tenant.id, "x", [("s", "w", 1)], ttl=60)).held
    assert await plain.invariant_violations() == []


async def test_an_expiry_of_a_reservation_locked_elsewhere_is_skipped_not_waited_for(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """The sweeper's expiry in a batch takes its reservation with SKIP LOCKED, as
    expire_due_v1 does: while another transaction holds the reservation, the expiry is
    skipped (due again next sweep) and the buyers sharing the batch are not held up."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 5)
    due = await service.reserve(tenant.id, "due", [("s", "w", 2)], ttl=timedelta(seconds=1))
    assert due.reservation is not None
    await asyncio.sleep(1.1)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    with psycopg.connect(db.conninfo) as locker:
        locker.execute("SELECT 1 FROM reservation WHERE reservation_id = %s FOR UPDATE",
                       (due.reservation.id,))
        expiry, buyer = await asyncio.gather(
            combiner.submit(tenant.id, bucket, BatchRequest(
                "expire", reservation_id=uuid.UUID(due.reservation.id))),
            combiner.submit(tenant.id, bucket, BatchRequest(
                "reserve", key="buyer", digest="d", quantity=1, ttl=timedelta(minutes=5))))
        locker.rollback()
    assert expiry == {"skipped": True}
    assert buyer["ok"]["status"] == "held"
    assert await service.expire_due() == 1  # unlocked now: the next sweep takes it
    assert await service.invariant_violations() == []


async def test_a_lost_batch_session_is_replaced_even_with_a_pool_of_one(dsn: str,
                                                                        tenant: Tenant) -> None:
    """With every connection of the pool kept by a drain (here the only one), a batch whose
    connection is killed hands the dead one back and retries on a new one at once, instead
    of waiting for the pool while holding it."""
    async with Database(dsn, min_size=1, max_size=1) as db:
        db.pool.timeout = 5.0  # a retry that waited for the pool would fail, not hang
        service = ReservationService(db)
        await service.set_stock(tenant.id, "s", "w", 10)
        assert (await service.reserve(tenant.id, "warm", [("s", "w", 1)])).held
        bucket = await bucket_id(db, tenant.id, "s")
        with psycopg.connect(dsn, autocommit=True) as killer, \
                bucket_locked(dsn, bucket) as blocker:
            task = asyncio.create_task(service.reserve(tenant.id, "k1", [("s", "w", 1)]))
            await wait_until_blocked(dsn)
            killer.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                " AND query LIKE '%%bucket_batch_v1%%'")
            blocker.rollback()
        out = await task
        assert out.held and not out.replayed
        assert db.stats.connection_retried == 1
        assert await service.invariant_violations() == []


async def test_a_hot_bucket_hands_its_session_back_when_others_wait(dsn: str,
                                                                     tenant: Tenant) -> None:
    """A drain keeps its connection only while no one else waits for one: with a pool of
    one, a busy bucket that still has requests queued lets a request for another bucket
    (waiting for the pool) go first, instead of keeping the pool for as long as its own
    queue refills."""
    from datetime import timedelta

    async with Database(dsn, min_size=1, max_size=1) as db:
        service = ReservationService(db)
        for sku in ("hot", "cold"):
            await service.set_stock(tenant.id, sku, "w", 10)
            assert (await service.reserve(tenant.id, f"warm-{sku}", [(sku, "w", 1)])).held
        bucket = await bucket_id(db, tenant.id, "hot")
        ttl = timedelta(minutes=5)
        with bucket_locked(dsn, bucket) as blocker:
            first = asyncio.create_task(service.reserve(tenant.id, "h1", [("hot", "w", 1)],
                                                        ttl=ttl))
            await wait_until_blocked(dsn)  # the hot drain holds the only connection
            second = asyncio.create_task(service.reserve(tenant.id, "h2", [("hot", "w", 1)],
                                                         ttl=ttl))
            cold = asyncio.create_task(service.reserve(tenant.id, "c1", [("cold", "w", 1)],
                                                       ttl=ttl))
            for _ in range(200):
                if db.pool.get_stats().get("requests_waiting", 0):
                    break
                await asyncio.sleep(0.01)
            assert db.pool.get_stats().get("requests_waiting", 0) == 1
            blocker.rollback()
        outs = [await first, await second, await cold]
        assert all(o.held for o in outs)
        with psycopg.connect(dsn) as conn:
            order = [r[0] for r in conn.execute(
                "SELECT request_key FROM reservation WHERE tenant_id = %s"
                " AND request_key IN ('h1', 'h2', 'c1') ORDER BY created_at", (tenant.id,))]
        assert order == ["h1", "c1", "h2"]
        assert db.stats.busy == 0
        assert await service.invariant_violations() == []


async def test_a_sold_out_batch_answers_without_waiting_for_the_bucket_row(
        db: Database, tenant: Tenant, service: ReservationService, strategy: str) -> None:
    """At a plainly sold-out bucket (nothing free, no pool unit, no hold past its expiry) a
    batch of reserves is refused while another transaction holds the bucket row, and the
    refusals are stored; with a unit free the same batch waits for the row instead."""
    from datetime import timedelta

    await service.set_stock(tenant.id, "s", "w", 1, strategy=strategy)
    assert (await service.reserve(tenant.id, "last", [("s", "w", 1)])).held
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    ttl = timedelta(minutes=5)
    with bucket_locked(db.conninfo, bucket) as blocker:
        answers = await asyncio.wait_for(asyncio.gather(*(
            combiner.submit(tenant.id, bucket, BatchRequest(
                "reserve", key=f"late{i}", digest=f"d{i}", quantity=1, ttl=ttl))
            for i in range(5))), timeout=60)
        blocker.rollback()
    assert [a["ok"]["status"] for a in answers] == ["rejected"] * 5
    assert all(a["ok"]["short_lines"][0]["available"] == 0 for a in answers)
    stored = await db.fetch("SELECT count(*) FROM request_ledger WHERE tenant_id = %s"
                            " AND request_key LIKE 'late%%' AND status = 'rejected'",
                            (tenant.id,))
    assert stored[0][0] == 5

    await service.set_stock(tenant.id, "s", "w", 2, strategy=strategy)  # one unit free again
    with bucket_locked(db.conninfo, bucket) as blocker:
        waiting = asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest(
            "reserve", key="after", digest="d", quantity=1, ttl=ttl)))
        await wait_until_blocked(db.conninfo)
        assert not waiting.done()
        blocker.rollback()
    assert (await waiting)["ok"]["status"] == "held"
    assert await service.invariant_violations() == []
