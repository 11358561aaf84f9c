"""A batch judges a shortage at the instant of its look, not at the instant it took the
bucket row: a hold that passed its expiry in between is given up (or counted) there."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import psycopg

from pgreserve import Database, ReservationService

# H's time to live, and the requests the batch works through before its last one: long
# enough for H to expire and the buyer to commit meanwhile (seconds on a 2-core machine)
TTL, N = 3, 400_000


async def row_taken(dsn: str, bucket: int) -> datetime:
    """Wait until another transaction holds the bucket row; when it was first seen so."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for _ in range(2000):
            try:
                async with conn.transaction():
                    await conn.execute("SELECT 1 FROM stock_bucket WHERE bucket_id = %s"
                                       " FOR UPDATE NOWAIT", (bucket,))
            except psycopg.errors.LockNotAvailable:
                return datetime.now(UTC)
            await asyncio.sleep(0.005)
    raise AssertionError("the batch never took the bucket row")


async def test_batch_judges_expiry_at_its_lock_instant_not_at_its_shortage_look(
        dsn: str) -> None:
    """A pool bucket: free 0, one unit U in its pool, one hold H of 3 s. A batch takes the
    bucket row (its instant v_now) before H expires, and works through requests ahead of
    its last one (releases of a reservation released already: they change nothing).
    Meanwhile H passes its expiry, and then an unbatched buyer takes U and commits. The
    batch's last request, a reserve of 1, is short: its look gives expired holds up and
    asks whether any are left, both judged at v_now, not at the look. H, past its expiry
    and still held, is neither given up nor counted; U is gone; the reserve is stored
    as insufficient_stock. Yet at every instant of its decision one unit could be
    served: U until the buyer committed, and H (past its expiry, which reserve_v1 gives
    up on demand) from before then. It must be held or answered retry, never refused."""
    async with Database(dsn) as db:
        plain = ReservationService(db, batching=False)
        t = await plain.create_tenant("x")
        await plain.set_stock(t.id, "P", "w", 2, strategy="pool", pool_cap=2)
        gone = await plain.reserve(t.id, "gone", [("P", "w", 1)], ttl=60)
        assert gone.held and gone.reservation is not None
        await plain.release(t.id, gone.reservation.id)
        h = await plain.reserve(t.id, "h", [("P", "w", 1)], ttl=TTL)
        assert h.held and h.reservation is not None
        with psycopg.connect(dsn, autocommit=True) as c:
            bucket = c.execute("SELECT bucket_id FROM stock_bucket"
                               " WHERE sku = 'P'").fetchone()[0]  # type: ignore[index]
            figures = c.execute(
                "SELECT b.free, (SELECT count(*) FROM stock_unit u WHERE u.bucket_id ="
                " b.bucket_id), (SELECT expires_at FROM reservation_line l WHERE l.held"
                " AND l.bucket_id = b.bucket_id)"
                " FROM stock_bucket b WHERE b.bucket_id = %s", (bucket,)).fetchone()
        assert figures is not None
        free, pool, h_expires = figures
        assert (free, pool) == (0, 1)  # U is the pool's only unit
        batch = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            call = asyncio.ensure_future(batch.execute(
                "SELECT bucket_batch_v1(%s, %s, %s::text[], %s::text[], %s::text[],"
                " %s::integer[], %s::interval[], %s::uuid[], NULL)",
                (t.id, bucket, ["release"] * N + ["reserve"], [None] * N + ["buyer"],
                 [None] * N + ["d-buyer"], [None] * N + [1], [None] * N + ["15 min"],
                 [str(gone.reservation.id)] * N + [None])))
            locked = await row_taken(dsn, bucket)
            assert locked < h_expires, "setup: the batch took the row after H expired"
            # H past its expiry; then a buyer takes U, unbatched, and commits
            with psycopg.connect(dsn, autocommit=True) as c:
                for _ in range(1000):
                    if c.execute("SELECT clock_timestamp() > %s",
                                 (h_expires,)).fetchone()[0]:  # type: ignore[index]
                        break
                    await asyncio.sleep(0.01)
            took = await plain.reserve(t.id, "taker", [("P", "w", 1)])
            assert took.held
            assert not call.done(), "setup: the batch ended before the buyer: raise N"
            row = await (await call).fetchone()
        finally:
            await batch.close()
        assert row is not None
        last = row[0][-1]
        assert last.get("retry") or last["ok"]["status"] == "held", (
            f"stored as sold out while H, past its expiry, was still held: {last}")
