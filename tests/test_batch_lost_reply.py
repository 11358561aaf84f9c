"""Batches that lose their reply, then fail or find their API key revoked; queued requests waiting for a connection."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from pgreserve import Database, ReservationService, Tenant, apikeys
from pgreserve.db.database import TxSettings
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import ApiKeyRefused, OutcomeUnknown
from test_batch_answered import _lookup
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked
from test_lost_reply import reply_lost_after_commit


def revoking(key_hash: bytes) -> str:
    """The statement that revokes the API key with this hash."""
    return ("UPDATE pgreserve.api_key SET revoked_at = now()"  # noqa: S608 - a hex digest
            f" WHERE key_hash = decode('{key_hash.hex()}', 'hex');")


async def connection_taken(db: Database) -> tuple[asyncio.Future[None], asyncio.Event]:
    """One of the pool's connections, taken (once this returns) by a task that gives it
    back when the event is set."""
    taken, give_back = asyncio.Event(), asyncio.Event()

    async def occupy() -> None:
        async with db.pool.connection():
            taken.set()
            await give_back.wait()

    holder = asyncio.ensure_future(occupy())
    await taken.wait()
    return holder, give_back


async def test_keyed_batch_whose_reply_was_lost_answers_what_it_committed(
        db: Database, service: ReservationService, tenant: Tenant,
        pg_server: EmbeddedServer, dsn: str) -> None:
    """A batched reserve carrying its API key (api_key_hash=, as the HTTP fast path sends
    it) commits a hold; its reply is lost, and the key is revoked right after that
    commit. Database.call retries the batch (a lost connection retries it whole): the
    retry's bucket_batch_keyed_v1 checks the key again, before any replay, and answers
    PR403. The caller is told ApiKeyRefused (HTTP 401: nothing done) while its hold is
    committed under its request key. Unbatched, the same reserve checks the key once and
    its retry replays the hold."""
    key = await service.create_api_key(tenant.id)
    good = apikeys.hash_key(key)
    await service.set_stock(tenant.id, "s", "w", 10)
    assert (await service.reserve(tenant.id, "warm", [("s", "w", 1)],
                                  api_key_hash=good)).held  # bucket id cached: batched
    revoke = revoking(good)
    answer: Any
    with reply_lost_after_commit(pg_server, dsn, "request_ledger", also=revoke):
        try:
            answer = await service.reserve(tenant.id, "k1", [("s", "w", 1)],
                                           api_key_hash=good)
        except (ApiKeyRefused, OutcomeUnknown) as exc:
            answer = exc
    other = ReservationService(db, batching=False)
    stored = await _lookup(other, tenant.id, "k1")
    assert stored == "stored:succeeded"
    # what the caller was told must be what committed (or "unknown", which its key resolves)
    assert not isinstance(answer, ApiKeyRefused), (
        f"told {type(answer).__name__} while its hold committed ({stored})")


async def test_http_fast_path_lost_reply_with_key_revoked_is_503_not_401(
        dsn: str, service: ReservationService, tenant: Tenant,
        pg_server: EmbeddedServer) -> None:
    """A fast-path reserve (hinted key, checked in its batch) commits its hold; the reply
    is lost and the key is revoked right after that commit. With max_attempts=1 the
    batch is not retried: Database.call answers OutcomeUnknown (it may have committed).
    The fast path then asks whether the key is refused now and answers 401 unauthorized
    instead of 503 outcome_unknown: a client told "unauthorized, nothing done" holds
    stock. (FastAPI's route checks the key before the operation: its OutcomeUnknown is
    503 whatever happens to the key afterwards.)"""
    import httpx

    from pgreserve.db.database import TxSettings
    from pgreserve.http import create_app

    api_key = await service.create_api_key(tenant.id)
    good = apikeys.hash_key(api_key)
    revoke = revoking(good)
    async with Database(dsn, max_size=4, settings=TxSettings(max_attempts=1)) as db:
        app = create_app(database=db)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     headers={"Authorization": f"Bearer {api_key}"}) as client:
            resp = await client.put("/v1/stock/w/s", json={"on_hand": 10})
            assert resp.status_code in (200, 201), resp.text
            body = {"lines": [{"sku": "s", "location": "w", "quantity": 1}]}
            warm = await client.post("/v1/reservations", headers={"Idempotency-Key": "warm"},
                                     json=body)
            assert warm.status_code == 201, warm.text
            with reply_lost_after_commit(pg_server, dsn, "request_ledger", also=revoke):
                rx = await client.post("/v1/reservations", headers={"Idempotency-Key": "x"},
                                       json=body)
    other = ReservationService(service.db, batching=False)
    stored = await _lookup(other, tenant.id, "x")
    assert stored == "stored:succeeded"
    assert rx.status_code == 503 and rx.json()["code"] == "outcome_unknown", (
        rx.status_code, rx.text)
    assert "Retry-After" in rx.headers


async def test_a_request_queued_late_in_a_pool_wait_waits_its_own_pool_wait(
        dsn: str, tenant: Tenant, service: ReservationService) -> None:
    """Combiner._connect: "Each queued request waits for [the drain's connection] as long
    as an unbatched call would: pool_wait_s, never past its own deadline." The pool's one
    connection is busy. a (no deadline) starts the bucket's drain at t=0, whose wait is
    bounded by t=pool_wait_s (1 s); b queues at t=0.8. At t=1 the wait ends and every
    queued request is answered Busy, b too after 0.2 s of waiting. The connection is free
    at t=1.2: b, which as an unbatched call would wait until t=1.8, is refused although it
    would have been served."""
    from pgreserve.db.database import TxSettings
    from pgreserve.errors import Busy

    await service.set_stock(tenant.id, "s", "w", 10)
    async with Database(dsn, min_size=1, max_size=1,
                        settings=TxSettings(pool_wait_s=1.0)) as db:
        svc = ReservationService(db)
        assert (await svc.reserve(tenant.id, "warm", [("s", "w", 1)])).held  # bucket cached
        holder, give_back = await connection_taken(db)
        a = asyncio.ensure_future(svc.reserve(tenant.id, "a", [("s", "w", 1)]))
        await asyncio.sleep(0.8)
        b = asyncio.ensure_future(svc.reserve(tenant.id, "b", [("s", "w", 1)]))
        await asyncio.sleep(0.4)  # t = 1.2: the drain's wait (to t = 1.0) is over
        give_back.set()
        await holder
        ra, rb = await asyncio.gather(a, b, return_exceptions=True)
    assert isinstance(ra, Busy), ra  # a waited its whole pool_wait_s: Busy is right
    assert not isinstance(rb, BaseException), f"b was answered {rb!r} within its pool wait"
    assert rb.held


async def test_a_batch_whose_reply_was_lost_and_whose_retry_fails_otherwise_is_unknown(
        db: Database, service: ReservationService, tenant: Tenant,
        pg_server: EmbeddedServer, dsn: str) -> None:
    """A batch commits a hold and its reply is lost; the retry, on a new connection,
    fails for a reason Database.call does not classify (here: the database became
    read-only meanwhile, as after a failover to a node that is not yet writable). The
    first attempt may have committed (it did), so the request's answer must be
    OutcomeUnknown (503 outcome_unknown, resolved by its key) or what committed. It is
    the retry's raw psycopg error (HTTP 500 internal_error), which says neither."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    await service.set_stock(tenant.id, "s", "w", 10)
    assert (await service.reserve(tenant.id, "warm", [("s", "w", 1)])).held
    read_only = (f"EXECUTE 'ALTER DATABASE \"{dbname}\" SET default_transaction_read_only"
                 " = on';")
    answer: Any
    with reply_lost_after_commit(pg_server, dsn, "request_ledger", also=read_only):
        try:
            answer = await service.reserve(tenant.id, "k1", [("s", "w", 1)])
        except Exception as exc:  # noqa: BLE001
            answer = exc
        finally:
            with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
    async with Database(dsn, max_size=1) as fresh:
        stored = await _lookup(ReservationService(fresh, batching=False), tenant.id, "k1")
    assert stored == "stored:succeeded"
    assert isinstance(answer, OutcomeUnknown) or getattr(answer, "held", False), repr(answer)


async def test_http_lost_reply_then_failed_retry_is_503_outcome_unknown(
        db: Database, service: ReservationService, tenant: Tenant,
        pg_server: EmbeddedServer, dsn: str) -> None:
    """The HTTP side of the test above: a fast-path reserve whose batch committed and lost
    its reply, and whose retry failed otherwise (the database read-only meanwhile), is
    answered 500 internal_error; its hold is committed. It must be 503 outcome_unknown
    with Retry-After (the client then resolves it with its Idempotency-Key)."""
    import httpx

    from pgreserve.http import create_app

    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    api_key = await service.create_api_key(tenant.id)
    app = create_app(database=db)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    body = {"lines": [{"sku": "s", "location": "w", "quantity": 1}]}
    read_only = (f"EXECUTE 'ALTER DATABASE \"{dbname}\" SET default_transaction_read_only"
                 " = on';")
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 headers={"Authorization": f"Bearer {api_key}"}) as client:
        resp = await client.put("/v1/stock/w/s", json={"on_hand": 10})
        assert resp.status_code in (200, 201), resp.text
        warm = await client.post("/v1/reservations", headers={"Idempotency-Key": "warm"},
                                 json=body)
        assert warm.status_code == 201, warm.text
        with reply_lost_after_commit(pg_server, dsn, "request_ledger", also=read_only):
            try:
                rx = await client.post("/v1/reservations", headers={"Idempotency-Key": "x"},
                                       json=body)
            finally:
                with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
                    conn.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
    async with Database(dsn, max_size=1) as fresh:
        stored = await _lookup(ReservationService(fresh, batching=False), tenant.id, "x")
    assert stored == "stored:succeeded"
    assert rx.status_code == 503 and rx.json()["code"] == "outcome_unknown", (
        rx.status_code, rx.text)
    assert "Retry-After" in rx.headers


async def test_a_request_queued_behind_a_long_batch_still_gets_its_pool_wait(
        dsn: str, tenant: Tenant, service: ReservationService) -> None:
    """b queues behind a batch in flight that waits 0.9 s on the bucket row (longer than
    pool_wait_s=0.5): b has not waited for a connection at all (the drain held one). When
    that batch ends, others wait for the pool, so the drain hands its connection back and
    takes one again: b gets its whole pool_wait_s then (an unbatched call would have had
    a connection at once and waited on the row lock), and a connection is free 0.2 s
    later. (Counted from b's queueing, its wait was over: Busy at once.)"""
    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(service.db, tenant.id, "s")
    async with Database(dsn, min_size=2, max_size=2,
                        settings=TxSettings(pool_wait_s=0.5)) as db:
        svc = ReservationService(db)
        assert (await svc.reserve(tenant.id, "warm", [("s", "w", 1)])).held  # bucket cached
        async def other_caller() -> None:  # someone else waiting for the pool
            async with db.pool.connection(timeout=5):
                await asyncio.sleep(0.2)

        with bucket_locked(db.conninfo, bucket) as blocker:
            a = asyncio.ensure_future(svc.reserve(tenant.id, "a", [("s", "w", 1)]))
            await wait_until_blocked(db.conninfo)
            b = asyncio.ensure_future(svc.reserve(tenant.id, "b", [("s", "w", 1)]))
            await asyncio.sleep(0.8)  # b waits behind a's batch, longer than pool_wait_s
            holder, give_back = await connection_taken(db)
            waiter = asyncio.ensure_future(other_caller())
            await asyncio.sleep(0.05)  # the other caller waits for the pool now
            blocker.rollback()
        ra = await a
        assert ra.held
        await asyncio.sleep(0.15)
        give_back.set()
        await holder
        await waiter
        rb = await asyncio.gather(b, return_exceptions=True)
    assert not isinstance(rb[0], BaseException), (
        f"b was answered {rb[0]!r} without any wait for a connection")
    assert rb[0].held
