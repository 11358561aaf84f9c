"""A request the combiner answered before its batch was sent again (OutcomeUnknown at
its deadline, while the batch was in flight) is not in the batch's later attempts: a
split's halves and a retry after a lost connection send only the requests not answered
yet, so a lookup of its key that found no answer stays true."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from pgreserve import Database, ReservationService, Tenant, deadline
from pgreserve.core.batching import BatchRequest, Combiner
from pgreserve.errors import OutcomeUnknown, RequestInProgress, RequestNotFound
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked

TTL = timedelta(minutes=5)
# an interval PostgreSQL cannot hold: the batch's statement fails on its parameters,
# before any lock (a poison request that only the split isolates)
POISON_TTL = timedelta(days=999_999_999)


async def _lookup(svc: ReservationService, tenant: int, key: str) -> str:
    try:
        rec = await svc.lookup_request(tenant, key)
    except RequestNotFound:
        return "never used"
    except RequestInProgress:
        return "in progress"
    return f"stored:{rec.status}"


async def test_a_request_answered_unknown_is_not_sent_again_by_a_split(
        db: Database, tenant: Tenant, service: ReservationService) -> None:
    """A batch [a, poison, x, y] fails as a whole and is split. While its first half
    ([a]) waits on the bucket row, x's deadline passes: x is answered OutcomeUnknown,
    which its key resolves. No transaction holds x's key between the halves, so a
    lookup then says it has no answer; x is not sent again with the second half, so it
    never gets one. Before, the second half held x after that lookup."""
    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    other = ReservationService(db, batching=False)

    async def send(key: str, ttl: timedelta = TTL, within: float | None = None) -> Any:
        with deadline(within):
            return await combiner.submit(tenant.id, bucket, BatchRequest(
                "reserve", key=key, digest="d", quantity=1, ttl=ttl))

    with bucket_locked(db.conninfo, bucket) as blocker:
        a = asyncio.ensure_future(send("a"))
        p = asyncio.ensure_future(send("p", POISON_TTL))
        x = asyncio.ensure_future(send("x", within=0.8))
        y = asyncio.ensure_future(send("y"))
        await wait_until_blocked(db.conninfo)  # the split's first half waits on the row
        with pytest.raises(OutcomeUnknown):
            await x
        seen = await _lookup(other, tenant.id, "x")
        blocker.rollback()
    results = await asyncio.gather(a, p, y, return_exceptions=True)
    assert combiner.stats.splits >= 1, results
    final = await _lookup(other, tenant.id, "x")
    assert (seen, final) == ("never used", "never used")


async def test_a_request_answered_unknown_is_not_sent_again_by_a_retry(
        dsn: str, pg_server: Any, tenant: Tenant) -> None:
    """Two reserves through the service leave as one batch, which waits on the bucket
    row; its backend is killed and no new connection can be made for a moment. x (1 s
    deadline) is answered OutcomeUnknown at its deadline while the batch waits to retry
    (holding no lock): a lookup of x's key then says it has no answer, and the retry
    sends y alone, so x never gets one (before, the retry held x after that lookup;
    unbatched, a call ends at its deadline and commits nothing after it)."""
    import psycopg

    from pgreserve.db.database import TxSettings

    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    settings = TxSettings(pool_wait_s=8.0)
    async with Database(dsn, min_size=1, max_size=1, settings=settings) as db, \
            Database(dsn, min_size=1, max_size=1) as other_db:
        svc = ReservationService(db)
        other = ReservationService(other_db, batching=False)
        await svc.set_stock(tenant.id, "s", "w", 10)
        assert (await svc.reserve(tenant.id, "warm", [("s", "w", 1)])).held
        await other.get_stock(tenant.id, "s", "w")  # its one connection is open
        bucket = await bucket_id(db, tenant.id, "s")

        async def hurried() -> Any:
            with deadline(1.0):
                return await svc.reserve(tenant.id, "x", [("s", "w", 1)])

        admin = pg_server.dsn("postgres")
        with bucket_locked(dsn, bucket) as blocker, \
                psycopg.connect(admin, autocommit=True) as killer:
            x = asyncio.ensure_future(hurried())
            y = asyncio.ensure_future(svc.reserve(tenant.id, "y", [("s", "w", 1)]))
            await wait_until_blocked(dsn)
            try:
                killer.execute(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS false')
                killed = killer.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = %s AND wait_event_type = 'Lock'"
                    " AND query LIKE '%%bucket_batch_v1%%'", (dbname,)).fetchall()
                assert killed == [(True,)]
                with pytest.raises(OutcomeUnknown):
                    await x
                seen = await _lookup(other, tenant.id, "x")
            finally:
                killer.execute(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS true')
            blocker.rollback()
        held = await y
        final = await _lookup(other, tenant.id, "x")
    assert held.held
    assert (seen, final) == ("never used", "never used")
