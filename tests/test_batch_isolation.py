"""One request's failure never fails another of its batch: its deadline, its wait for
a lock (its key, its reservation), a connection that stops answering. Each test runs
the same requests unbatched too, and the batch must answer its other requests as the
unbatched path does."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from pgreserve import Database, ReservationService, deadline
from pgreserve.db.database import TxSettings
from pgreserve.errors import Busy, OutcomeUnknown
from test_batching import bucket_id, bucket_locked

SKU, LOC = "s", "w"


async def waiters(dsn: str, count: int) -> None:
    """Wait until `count` backends of this database wait on a lock."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for _ in range(1000):
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'")
            row = await cur.fetchone()
            assert row is not None
            if row[0] >= count:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{count} backends never waited on a lock")


async def queued(svc: ReservationService, tenant: int, bucket: int, n: int,
                 dsn: str = "", waiting: int = 0) -> None:
    """Until n requests are queued in the bucket's combiner (unbatched: until `waiting`
    backends wait on a lock)."""
    if svc.combiner is None:
        await waiters(dsn, waiting)
        return
    for _ in range(1000):
        if len(svc.combiner._queues.get((tenant, bucket), ())) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the requests never queued")


async def waiter_then_three_buyers(
        svc: ReservationService, dsn: str, tenant: int, bucket: int,
        waiter: Callable[[], Awaitable[Any]], batching: bool) -> tuple[Any, list[Any]]:
    """Behind a first reserve of `bucket` paused on its row, `waiter()` (a request whose
    own lock another transaction holds) and then three buyers of the bucket queue (in one
    batch when batching); the row is let go. The waiter's outcome and the buyers'
    results, exceptions returned."""
    with bucket_locked(dsn, bucket) as blocker:
        first = asyncio.ensure_future(svc.reserve(tenant, "first", [(SKU, LOC, 1)]))
        await waiters(dsn, 1)
        waiting = asyncio.ensure_future(waiter())
        await queued(svc, tenant, bucket, 1, dsn, 2)
        buyers = [asyncio.ensure_future(svc.reserve(tenant, f"b{i}", [(SKU, LOC, 1)]))
                  for i in range(3)]
        if batching:
            await queued(svc, tenant, bucket, 4)
        blocker.rollback()
    assert (await first).held
    results = await asyncio.gather(*buyers, return_exceptions=True)
    outcome = (await asyncio.gather(waiting, return_exceptions=True))[0]
    return outcome, results


def assert_all_held(results: list[Any], waited_for: str) -> None:
    bad = [x for x in results if isinstance(x, BaseException)]
    assert not bad, f"buyers failed by {waited_for}: {bad!r}"
    assert all(not isinstance(x, BaseException) and x.held for x in results)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_short_deadline_does_not_fail_its_batch_mates_statement(
        db: Database, dsn: str, batching: bool) -> None:
    """Two requests queued behind a busy bucket leave as one batch: `hurried` with a
    0.5 s deadline, `patient` with none. The bucket row is then held by another
    transaction for 1 s (less than lock_timeout). Unbatched, `patient` waits the
    second and is held; `hurried` alone is Busy. Batched, the batch runs to its latest
    deadline: `patient` is held, and `hurried` is answered at its own deadline."""
    svc = ReservationService(db, batching=batching)
    for attempt in range(3):
        if await short_deadline_beside_a_patient_one(svc, dsn, batching, attempt):
            return
    pytest.fail("the batch took the bucket row before the second transaction 3 times: "
                "the setup never held")


async def short_deadline_beside_a_patient_one(svc: ReservationService, dsn: str,
                                              batching: bool, attempt: int) -> bool:
    """One try of the test above; False when the setup did not hold (the batch, sent as
    the first one committed, took the bucket row before the second transaction did:
    both follow the row's new version, in no set order)."""
    tenant = (await svc.create_tenant(f"short-deadline-batch-{attempt}")).id
    await svc.set_stock(tenant, SKU, LOC, 10)
    assert (await svc.reserve(tenant, "warm", [(SKU, LOC, 1)])).held  # bucket id cached
    bucket = await bucket_id(svc.db, tenant, SKU)

    async def hurried() -> Any:
        with deadline(0.5):
            return await svc.reserve(tenant, "hurried", [(SKU, LOC, 1)])

    async with await psycopg.AsyncConnection.connect(dsn) as second:
        with bucket_locked(dsn, bucket) as first_blocker:
            first = asyncio.ensure_future(svc.reserve(tenant, "first", [(SKU, LOC, 1)]))
            await waiters(dsn, 1)
            # a second transaction queues on the row behind the first batch
            grab = asyncio.ensure_future(second.execute(
                "SELECT 1 FROM stock_bucket WHERE bucket_id = %s FOR UPDATE", (bucket,)))
            await waiters(dsn, 2)
            h = asyncio.ensure_future(hurried())
            p = asyncio.ensure_future(svc.reserve(tenant, "patient", [(SKU, LOC, 1)]))
            await queued(svc, tenant, bucket, 2, dsn, 4)
            first_blocker.rollback()
        assert (await first).held
        await grab  # the second transaction holds the row; the batch [hurried, patient] waits
        await asyncio.sleep(0.05)
        if p.done():  # the batch had the row first: it committed, nothing was tested
            await second.rollback()
            await asyncio.gather(h, p, return_exceptions=True)
            return False
        await asyncio.sleep(1.0)
        await second.rollback()
    results = await asyncio.gather(h, p, return_exceptions=True)
    # its own deadline: Busy unbatched (the statement cut), OutcomeUnknown batched (its
    # batch went on for the other), which the key resolves
    assert isinstance(results[0], Busy if not batching else OutcomeUnknown), results[0]
    assert not isinstance(results[1], BaseException), (
        f"patient (no deadline) was failed by its batch mate's deadline: {results[1]!r}")
    assert results[1].held
    again = await svc.reserve(tenant, "hurried", [(SKU, LOC, 1)])
    assert again.held and again.replayed == batching
    return True


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_request_behind_a_frozen_connection_is_not_left_hanging(
        dsn: str, batching: bool) -> None:
    """The pool's warm connection freezes (its backend SIGSTOPped: a frozen host, a
    partition) just as a first reserve (no deadline) is sent on it. A second reserve of
    the same bucket, no deadline either: unbatched it takes another connection of the
    pool and is held. Batched it does not wait for good behind the frozen batch, which
    ends at its statement_timeout (and a second): the second is held or Busy."""
    import os
    import signal

    app = "probe-frozen"
    async with Database(dsn, min_size=1, max_size=4, application_name=app) as db:
        svc = ReservationService(db, batching=batching)
        tenant = (await svc.create_tenant("frozen")).id
        await svc.set_stock(tenant, SKU, LOC, 10)
        assert (await svc.reserve(tenant, "warm", [(SKU, LOC, 1)])).held
        with psycopg.connect(dsn, autocommit=True) as conn:
            pids = [int(r[0]) for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,))]
        assert len(pids) == 1, pids  # (test_unanswered.py: the same with deadlines)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(svc.reserve(tenant, "first", [(SKU, LOC, 1)]))
            await asyncio.sleep(0.5)
            assert not first.done()
            second = asyncio.ensure_future(svc.reserve(tenant, "second", [(SKU, LOC, 1)]))
            done, _ = await asyncio.wait([second], timeout=20)
            hung = not done
        finally:
            os.kill(pids[0], signal.SIGCONT)
        await asyncio.gather(first, second, return_exceptions=True)
    assert not hung, "the second request was still waiting after 20 s (a hang, no Busy)"
    assert second.exception() is None or isinstance(second.exception(), Busy)


async def test_http_an_old_queued_request_does_not_fail_its_fresh_batch_mates(
        dsn: str) -> None:
    """Over HTTP every request has the same deadline (3 s here). A request that waited in
    the bucket's queue behind a slow batch leaves with fresh ones, and the bucket row is
    then busy for a moment (1 s, inside the fresh requests' 3 s and lock_timeout): the
    old request is answered 503 at its own deadline, the fresh ones wait and are held,
    as they would be unbatched."""
    import httpx

    from pgreserve.http import create_app

    settings = TxSettings(lock_timeout_ms=10_000)
    async with Database(dsn, min_size=4, max_size=4, settings=settings) as db:
        svc = ReservationService(db)
        ta, key = await svc.create_tenant_with_key("shop-a")
        tenant = ta.id
        app = create_app(database=db, api_key_cache_s=3600, request_deadline_s=3)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     headers={"Authorization": f"Bearer {key}"}) as c:
            async def reserve(k: str) -> httpx.Response:
                return await c.post("/v1/reservations", headers={"Idempotency-Key": k},
                                    json={"lines": [{"sku": "a", "location": "w",
                                                     "quantity": 1}]})
            assert (await c.put("/v1/stock/w/a", json={"on_hand": 10})).status_code == 201
            assert (await reserve("warm")).status_code == 201
            app_svc = app.state.service
            bucket = await bucket_id(db, tenant, "a")
            async with await psycopg.AsyncConnection.connect(dsn) as second:
                with bucket_locked(dsn, bucket) as first_blocker:
                    first = asyncio.ensure_future(reserve("first"))
                    await waiters(dsn, 1)
                    old = asyncio.ensure_future(reserve("old"))
                    await queued(app_svc, tenant, bucket, 1)
                    await asyncio.sleep(2.2)  # `old` has 0.8 s left
                    grab = asyncio.ensure_future(second.execute(
                        "SELECT 1 FROM stock_bucket WHERE bucket_id = %s FOR UPDATE",
                        (bucket,)))
                    await waiters(dsn, 2)
                    fresh = [asyncio.ensure_future(reserve(f"fresh-{i}")) for i in range(3)]
                    await queued(app_svc, tenant, bucket, 4)
                    first_blocker.rollback()
                assert (await first).status_code == 201
                await grab
                await asyncio.sleep(1.0)
                await second.rollback()
            answers = await asyncio.gather(old, *fresh)
    assert answers[0].status_code == 503  # its own deadline: fair
    assert answers[0].json()["code"] == "outcome_unknown"  # in flight, its batch went on
    statuses = [(r.status_code, r.json().get("code"), r.headers.get("Retry-After"))
                for r in answers[1:]]
    assert statuses == [(201, None, None)] * 3, statuses
@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_one_requests_lock_wait_does_not_fail_its_batch_mates(
        db: Database, dsn: str, batching: bool) -> None:
    """A shop's own transaction changes reservation R (one line on bucket s) to add a
    line on another bucket (conn=) and keeps its transaction open. A claim of R (the
    payment callback) queues on s with three buyers of s. Unbatched, the buyers are
    held at once and only the claim waits. Batched, the claim's wait for R is its own
    (it is sent alone): its three batch mates are held."""
    settings = TxSettings(lock_timeout_ms=1000)
    async with Database(dsn, settings=settings) as small:
        svc = ReservationService(small, batching=batching)
        tenant = (await svc.create_tenant("lock-wait-batch")).id
        await svc.set_stock(tenant, SKU, LOC, 10)
        await svc.set_stock(tenant, "o", LOC, 10)
        r = await svc.reserve(tenant, "r", [(SKU, LOC, 1)])
        assert r.held and r.reservation is not None
        rid = r.reservation.id
        bucket = await bucket_id(small, tenant, SKU)

        async with await psycopg.AsyncConnection.connect(dsn) as shop, shop.transaction():
            changed = await svc.change(tenant, rid, [(SKU, LOC, 1), ("o", LOC, 1)],
                                       request_key="chg", conn=shop)
            assert changed.held
            _, results = await waiter_then_three_buyers(
                svc, dsn, tenant, bucket, lambda: svc.claim(tenant, rid), batching)
        assert_all_held(results, "the claim's lock wait")


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_one_requests_key_lock_wait_does_not_fail_its_batch_mates(
        dsn: str, batching: bool) -> None:
    """A shop's own transaction (conn=) holds a reserve under key `dup` on bucket o and
    is still open. A reserve with the same key for bucket s (a client retry with another
    cart) queues on s with three buyers of s. Unbatched the buyers are held at once and
    only `dup` waits for its key. Batched the key's wait is `dup`'s own (it is sent
    alone): the three buyers are held."""
    settings = TxSettings(lock_timeout_ms=1000)
    async with Database(dsn, settings=settings) as small:
        svc = ReservationService(small, batching=batching)
        tenant = (await svc.create_tenant("key-wait-batch")).id
        await svc.set_stock(tenant, SKU, LOC, 10)
        await svc.set_stock(tenant, "o", LOC, 10)
        assert (await svc.reserve(tenant, "warm", [(SKU, LOC, 1)])).held
        bucket = await bucket_id(small, tenant, SKU)
        async with await psycopg.AsyncConnection.connect(dsn) as shop, shop.transaction():
            assert (await svc.reserve(tenant, "dup", [("o", LOC, 1)], conn=shop)).held
            _, results = await waiter_then_three_buyers(
                svc, dsn, tenant, bucket,
                lambda: svc.reserve(tenant, "dup", [(SKU, LOC, 1)]), batching)
        assert_all_held(results, "another request's key wait")



@pytest.mark.parametrize(("strategy", "batching"), [
    ("row", True), ("pool", True), ("row", False)], ids=["row", "pool", "row-unbatched"])
async def test_a_line_lock_of_another_bucket_does_not_fail_its_batch_mates(
        dsn: str, batching: bool, strategy: str) -> None:
    """Reservation x was taken on s by this process, which remembers s as its bucket;
    another process moved its cart to bucket q, and x expired. A shop's open transaction
    (conn=) takes q's one unit: its take gives x's expired line up and keeps that line
    locked, not x itself. A claim of x, routed to s, queues with three buyers of s. The
    claim's wait for the line is its own (sent alone); its batch mates are held, as
    unbatched. (Unbatched, a pool bucket's buyers take units without its row: the
    harness, which holds the row, measures the row strategy there.)"""
    settings = TxSettings(lock_timeout_ms=1000)
    async with Database(dsn, settings=settings) as small, Database(dsn) as other_db:
        svc = ReservationService(small, batching=batching)
        other = ReservationService(other_db, batching=False)
        tenant = (await svc.create_tenant(f"line-wait-{strategy}")).id
        await svc.set_stock(tenant, SKU, LOC, 10, strategy=strategy)
        await svc.set_stock(tenant, "q", LOC, 1, strategy=strategy)
        x = await svc.reserve(tenant, "x", [(SKU, LOC, 1)], ttl=1)
        assert x.held and x.reservation is not None
        rid = x.reservation.id
        assert (await other.change(tenant, rid, [("q", LOC, 1)], request_key="move")).held
        await asyncio.sleep(1.2)  # x expires, on q
        bucket = await bucket_id(small, tenant, SKU)
        async with await psycopg.AsyncConnection.connect(dsn) as shop, shop.transaction():
            assert (await other.reserve(tenant, "shop", [("q", LOC, 1)], conn=shop)).held
            claimed, results = await waiter_then_three_buyers(
                svc, dsn, tenant, bucket, lambda: svc.claim(tenant, rid), batching)
        assert_all_held(results, "another request's line wait")
        # the claim waited for the shop's lock of x's line, alone
        assert isinstance(claimed, Busy), claimed
        assert await svc.invariant_violations() == []
