"""A request whose caller gave up while it was queued for its bucket's batch is never
sent: the lookup of its key says it was never used, and it stays so. (It was sent in a
later batch and committed a hold after that lookup: a client trusting the answer held
again under a new key, two holds for one purchase.)"""

from __future__ import annotations

import asyncio

import pytest

from pgreserve import Database, ReservationService, Tenant
from test_batch_answered import _lookup
from test_batch_isolation import queued
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked


async def after_the_queue(service: ReservationService, tenant: int, bucket: int,
                          key: str) -> str:
    """What a lookup of `key` says once the bucket's queue has gone out in a batch (not
    in progress: that would be no answer)."""
    assert service.combiner is not None
    for _ in range(200):
        if not service.combiner._queues.get((tenant, bucket)):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    said = await _lookup(service, tenant, key)
    assert said != "in progress"
    return said


async def test_a_queued_request_of_a_caller_that_gave_up_is_not_reported_never_used(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    await service.set_stock(tenant.id, "s", "w", 5)
    bucket = await bucket_id(db, tenant.id, "s")
    assert service.combiner is not None
    queue = service.combiner._queues
    with bucket_locked(db.conninfo, bucket) as blocker:
        # a batch in flight, waiting for the bucket row
        first = asyncio.ensure_future(service.reserve(tenant.id, "first", [("s", "w", 1)]))
        await wait_until_blocked(db.conninfo)
        # the buyer's reserve queues behind it; the buyer gives up (a timeout)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                service.reserve(tenant.id, "buyer-1", [("s", "w", 2)]), timeout=0.3)
        assert len(queue.get((tenant.id, bucket), ())) == 1  # still queued
        # the buyer asks what became of its key
        seen = await _lookup(service, tenant.id, "buyer-1")
        blocker.rollback()
    await first
    status = await after_the_queue(service, tenant.id, bucket, "buyer-1")
    # the key was told "never used", and yet it holds now
    assert not (seen == "never used" and status == "stored:succeeded"), (
        f"lookup said the key was never used, then the request committed: {status}")


async def test_unbatched_the_same_lookup_stays_never_used(db: Database,
                                                          tenant: Tenant) -> None:
    """The same sequence without batching, as the reference: the lookup is never 'never
    used' for a request that commits later."""
    service = ReservationService(db, batching=False)
    await service.set_stock(tenant.id, "s", "w", 5)
    bucket = await bucket_id(db, tenant.id, "s")
    with bucket_locked(db.conninfo, bucket) as blocker:
        first = asyncio.ensure_future(service.reserve(tenant.id, "first", [("s", "w", 1)]))
        await wait_until_blocked(db.conninfo)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                service.reserve(tenant.id, "buyer-1", [("s", "w", 2)]), timeout=0.3)
        seen = await _lookup(service, tenant.id, "buyer-1")
        blocker.rollback()
    await first
    await asyncio.sleep(0.5)
    record = await _lookup(service, tenant.id, "buyer-1")
    assert record != "in progress"
    assert not (seen == "never used" and record == "stored:succeeded")


async def test_a_deferred_request_of_a_caller_that_gave_up_is_not_reported_never_used(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """The same through a deferred request: its batch stopped at a request sent alone
    (whose key another transaction holds); while that one has its turn, the caller of the
    deferred request gives up and looks its key up: never used. It commits after."""
    import psycopg

    await service.set_stock(tenant.id, "s", "w", 5)
    bucket = await bucket_id(db, tenant.id, "s")
    with psycopg.connect(db.conninfo) as keyholder:
        # another transaction holds request key "r" (the same key in flight elsewhere)
        keyholder.execute("SELECT pg_advisory_xact_lock(hashtextextended('r', %s))",
                          (tenant.id,))
        with bucket_locked(db.conninfo, bucket) as blocker:
            first = asyncio.ensure_future(service.reserve(tenant.id, "first", [("s", "w", 1)]))
            await wait_until_blocked(db.conninfo)
            r = asyncio.ensure_future(service.reserve(tenant.id, "r", [("s", "w", 1)]))
            await queued(service, tenant.id, bucket, 1)
            b = asyncio.ensure_future(service.reserve(tenant.id, "buyer-b", [("s", "w", 2)]))
            await queued(service, tenant.id, bucket, 2)
            blocker.rollback()
        await first
        # "r" is answered retry and sent alone, where it waits for its key; "buyer-b" is
        # deferred behind it
        await wait_until_blocked(db.conninfo)
        assert not b.done()
        b.cancel()  # the buyer gives up
        with pytest.raises(asyncio.CancelledError):
            await b
        seen = await _lookup(service, tenant.id, "buyer-b")
        keyholder.rollback()
    await r
    status = await after_the_queue(service, tenant.id, bucket, "buyer-b")
    assert not (seen == "never used" and status == "stored:succeeded"), (
        f"lookup said the key was never used, then the request committed: {status}")
