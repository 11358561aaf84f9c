"""A request whose caller gave up while it was queued for its bucket's batch is never
sent: the lookup of its key says it was never used, and it stays so. (It was sent in a
later batch and committed a hold after that lookup: a client trusting the answer held
again under a new key, two holds for one purchase.)"""

from __future__ import annotations

import asyncio

import pytest

from pgreserve import Database, ReservationService, Tenant
from pgreserve.errors import RequestInProgress, RequestNotFound
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked


async def queued(queues: dict, key: tuple[int, int], n: int) -> None:  # type: ignore[type-arg]
    """Until the bucket's queue holds n requests (at most 5 s)."""
    for _ in range(2500):
        if len(queues.get(key, ())) >= n:
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"the queue never held {n} requests")


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
        try:
            await service.lookup_request(tenant.id, "buyer-1")
            seen = "answered"
        except RequestNotFound:
            seen = "never used"
        except RequestInProgress:
            seen = "in progress"
        blocker.rollback()
    await first
    for _ in range(200):  # the queued request goes in the bucket's next batch
        if not queue.get((tenant.id, bucket)):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    try:
        status = (await service.lookup_request(tenant.id, "buyer-1")).status
    except RequestNotFound:
        status = "none"
    # the key was told "never used", and yet it holds now
    assert not (seen == "never used" and status == "succeeded"), (
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
        try:
            await service.lookup_request(tenant.id, "buyer-1")
            seen = "answered"
        except RequestNotFound:
            seen = "never used"
        except RequestInProgress:
            seen = "in progress"
        blocker.rollback()
    await first
    await asyncio.sleep(0.5)
    try:
        record = (await service.lookup_request(tenant.id, "buyer-1")).status
    except RequestNotFound:
        record = "none"
    assert not (seen == "never used" and record == "succeeded")


async def test_a_deferred_request_of_a_caller_that_gave_up_is_not_reported_never_used(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """The same through a deferred request: its batch stopped at a request sent alone
    (whose key another transaction holds); while that one has its turn, the caller of the
    deferred request gives up and looks its key up: never used. It commits after."""
    import psycopg

    await service.set_stock(tenant.id, "s", "w", 5)
    bucket = await bucket_id(db, tenant.id, "s")
    assert service.combiner is not None
    queue = service.combiner._queues
    with psycopg.connect(db.conninfo) as keyholder:
        # another transaction holds request key "r" (the same key in flight elsewhere)
        keyholder.execute("SELECT pg_advisory_xact_lock(hashtextextended('r', %s))",
                          (tenant.id,))
        with bucket_locked(db.conninfo, bucket) as blocker:
            first = asyncio.ensure_future(service.reserve(tenant.id, "first", [("s", "w", 1)]))
            await wait_until_blocked(db.conninfo)
            r = asyncio.ensure_future(service.reserve(tenant.id, "r", [("s", "w", 1)]))
            await queued(queue, (tenant.id, bucket), 1)
            b = asyncio.ensure_future(service.reserve(tenant.id, "buyer-b", [("s", "w", 2)]))
            await queued(queue, (tenant.id, bucket), 2)
            blocker.rollback()
        await first
        # "r" is answered retry and sent alone, where it waits for its key; "buyer-b" is
        # deferred behind it
        await wait_until_blocked(db.conninfo)
        assert not b.done()
        b.cancel()  # the buyer gives up
        with pytest.raises(asyncio.CancelledError):
            await b
        try:
            await service.lookup_request(tenant.id, "buyer-b")
            seen = "answered"
        except RequestNotFound:
            seen = "never used"
        except RequestInProgress:
            seen = "in progress"
        keyholder.rollback()
    await r
    for _ in range(200):
        if not queue.get((tenant.id, bucket)):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    try:
        status = (await service.lookup_request(tenant.id, "buyer-b")).status
    except RequestNotFound:
        status = "none"
    assert not (seen == "never used" and status == "succeeded"), (
        f"lookup said the key was never used, then the request committed: {status}")
