"""Admission: deadlines, Busy (not run) against OutcomeUnknown (may have run), the tenant limit."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from datetime import timedelta

import httpx
import psycopg
import pytest
import pytest_asyncio

from pgreserve import Database, ReservationService, TxSettings
from pgreserve.core.batching import BatchRequest, Combiner
from pgreserve.db.database import deadline
from pgreserve.errors import Busy, DatabaseUnavailable, OutcomeUnknown
from pgreserve.http import create_app
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked

LINE = {"location": "w", "quantity": 1}
# the only effect a statement can have: terminate its own backend (a lost connection
# after the statement was sent)
SELF_TERMINATE = "SELECT pg_terminate_backend(pg_backend_pid())"


def stock_of(dsn: str, sku: str) -> tuple[int, int]:
    """(reserved, available) of a bucket, read on a connection of its own."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT bucket_view_v1(tenant_id, bucket_id, clock_timestamp())"
                           " FROM stock_bucket WHERE sku = %s", (sku,)).fetchone()
    assert row is not None
    return int(row[0]["reserved"]), int(row[0]["available"])


def ledger_rows(dsn: str, key: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM request_ledger WHERE request_key = %s",
                           (key,)).fetchone()
    assert row is not None
    return int(row[0])


class Api:
    """An app over its own small pool, and clients for two tenants."""

    def __init__(self, db: Database, service: ReservationService, a: httpx.AsyncClient,
                 b: httpx.AsyncClient, tenants: tuple[int, int]) -> None:
        self.db, self.service, self.a, self.b, self.tenants = db, service, a, b, tenants


async def make_api(dsn: str, settings: TxSettings, pool: int,
                   **options: object) -> AsyncIterator[Api]:
    async with Database(dsn, min_size=pool, max_size=pool, settings=settings) as db:
        service = ReservationService(db)
        ta, key_a = await service.create_tenant_with_key("shop-a")
        tb, key_b = await service.create_tenant_with_key("shop-b")
        # keys trusted for the whole test: authentication needs no connection later
        app = create_app(database=db, api_key_cache_s=3600, **options)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     headers={"Authorization": f"Bearer {key_a}"}) as a, \
                httpx.AsyncClient(transport=transport, base_url="http://test",
                                  headers={"Authorization": f"Bearer {key_b}"}) as b:
            for client, sku in ((a, "a"), (a, "b"), (a, "c"), (b, "other")):
                resp = await client.put(f"/v1/stock/w/{sku}", json={"on_hand": 5})
                assert resp.status_code == 201  # the PUT created the line
                # one hold each: every bucket id is then cached (no lookup needs a connection)
                resp = await reserve(client, f"warm-{sku}", sku)
                assert resp.status_code == 201, resp.text
            yield Api(db, service, a, b, (ta.id, tb.id))


async def reserve(client: httpx.AsyncClient, key: str, sku: str) -> httpx.Response:
    return await client.post("/v1/reservations", headers={"Idempotency-Key": key},
                             json={"lines": [{**LINE, "sku": sku}]})


@pytest_asyncio.fixture
async def saturable(dsn: str) -> AsyncIterator[Api]:
    """Two connections, a short pool wait, long lock waits: blocked requests keep both."""
    settings = TxSettings(lock_timeout_ms=30_000, pool_wait_s=0.2)
    async for api in make_api(dsn, settings, 2, request_deadline_s=30):
        yield api


async def test_busy_with_retry_after_when_every_connection_is_taken(saturable: Api,
                                                                    dsn: str) -> None:
    """Both pool connections held by requests waiting on locked buckets: a third request
    is answered 503 busy with Retry-After, nothing of it is in the database, and the same
    key later holds normally (not a replay)."""
    api = saturable
    tenant = api.tenants[0]
    buckets = [await bucket_id(api.db, tenant, sku) for sku in ("a", "b")]
    with ExitStack() as stack:
        for b in buckets:
            stack.enter_context(bucket_locked(dsn, b))
        blocked = [asyncio.create_task(reserve(api.a, f"blocked-{sku}", sku))
                   for sku in ("a", "b")]
        await wait_until_blocked(dsn, 2)  # both connections are waiting on the locks
        busy = await reserve(api.a, "late", "c")
        assert busy.status_code == 503, busy.text
        assert busy.json()["code"] == "busy"
        assert busy.headers["Retry-After"] == "1"
        assert ledger_rows(dsn, "late") == 0
        assert stock_of(dsn, "c") == (1, 4)  # the warm-up hold only
        assert not any(t.done() for t in blocked)
    assert [(await t).status_code for t in blocked] == [201, 201]
    again = await reserve(api.a, "late", "c")
    assert again.status_code == 201, again.text
    assert "Idempotent-Replayed" not in again.headers
    view = await api.service.get_stock(tenant, "c", "w")
    assert (view.reserved, view.available) == (2, 3)
    assert await api.service.invariant_violations() == []


async def test_a_lost_connection_mid_statement_is_outcome_unknown(dsn: str) -> None:
    """A reserve whose backend is terminated while its statement waits on a lock (no retry
    allowed) is 503 outcome_unknown, not busy; the same key then finds it never committed
    and holds once."""
    settings = TxSettings(max_attempts=1, lock_timeout_ms=30_000)
    async for api in make_api(dsn, settings, 2, request_deadline_s=30):
        tenant = api.tenants[0]
        with bucket_locked(dsn, await bucket_id(api.db, tenant, "a")), \
                psycopg.connect(dsn, autocommit=True) as killer:
            task = asyncio.create_task(reserve(api.a, "cut", "a"))
            await wait_until_blocked(dsn)
            killed = killer.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                " AND application_name = 'pgreserve:core'").fetchall()
            assert killed == [(True,)]
            resp = await task
        assert resp.status_code == 503, resp.text
        assert resp.json()["code"] == "outcome_unknown"
        assert resp.headers["Retry-After"] == "1"
        assert ledger_rows(dsn, "cut") == 0  # it was rolled back with its backend
        again = await reserve(api.a, "cut", "a")
        assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
        view = await api.service.get_stock(tenant, "a", "w")
        assert (view.reserved, view.available) == (2, 3)


async def test_retries_stop_at_the_deadline(dsn: str) -> None:
    """A statement that always fails with a serialization failure is retried only until
    the deadline (far fewer attempts than allowed) and then is Busy: it never ran."""
    settings = TxSettings(max_attempts=1_000_000, backoff_base_s=0.01, backoff_cap_s=0.05)
    async with Database(dsn, max_size=2, settings=settings) as db:
        await db.call("CREATE FUNCTION always_conflicts() RETURNS int LANGUAGE plpgsql AS"
                      " $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
        with deadline(0.5), pytest.raises(Busy, match="deadline passed"):
            await db.call("SELECT always_conflicts()")
        assert 1 <= db.stats.serialization_retried < 1000


async def test_busy_says_what_the_server_said_without_its_function_context(dsn: str) -> None:
    """A call given up after its retries is Busy with the server's own message, in one
    line: not the CONTEXT lines psycopg appends, which name pgreserve's functions and
    their lines and reached API answers (503 busy's detail) before."""
    quick = TxSettings(max_attempts=2, backoff_base_s=0.001, backoff_cap_s=0.002,
                       contention_retry_s=0)
    async with Database(dsn, max_size=2, settings=quick) as db:
        await db.call("CREATE FUNCTION conflicted() RETURNS int LANGUAGE plpgsql AS"
                      " $$ BEGIN RAISE EXCEPTION 'the stock moved' USING ERRCODE = '40001',"
                      " HINT = 'inner hint'; END $$")
        with pytest.raises(Busy) as busy:
            await db.call("SELECT conflicted()")
    assert busy.value.message == ("gave up after 2 attempts: the stock moved; nothing was "
                                  "done, retry later")


async def test_contention_is_retried_for_its_window_past_max_attempts(dsn: str) -> None:
    """A statement refused by contention (serialization failure, deadlock) more often than
    max_attempts is still retried while contention_retry_s lasts and then succeeds; with
    no window, max_attempts alone bounds it and the call is Busy, never run."""
    async with Database(dsn, max_size=2) as db:
        await db.call("CREATE SEQUENCE tries")
        await db.call(
            "CREATE FUNCTION contended(fails int, state text) RETURNS bigint"
            " LANGUAGE plpgsql AS $$ DECLARE n bigint := nextval('tries'); BEGIN"
            " IF n <= fails THEN RAISE EXCEPTION 'contended' USING ERRCODE = state; END IF;"
            " RETURN n; END $$")
    quick = TxSettings(max_attempts=2, backoff_base_s=0.001, backoff_cap_s=0.002)
    async with Database(dsn, max_size=2, settings=quick) as db:
        assert await db.call("SELECT contended(8, '40001')") == 9
        assert db.stats.serialization_retried == 8
        await db.call("SELECT setval('tries', 1, false)")
        assert await db.call("SELECT contended(5, '40P01')") == 6
        assert db.stats.deadlocks_retried == 5
        # a window's retries may run to thousands: the backoff stays under its cap
        assert 0 <= db._backoff(5000) <= quick.backoff_cap_s
    short_window = dataclasses.replace(quick, contention_retry_s=0.3)
    async with Database(dsn, max_size=2, settings=short_window) as db:
        started = time.monotonic()
        with pytest.raises(Busy, match="gave up after") as refused:
            await db.call("SELECT contended(1000000, '40001')")  # without a deadline
        # (it gives up when the next backoff would end past the window)
        assert 0.3 - quick.backoff_cap_s <= time.monotonic() - started < 5
        attempts = int(str(refused.value).split("gave up after ")[1].split()[0])
        assert attempts > 2 and db.stats.serialization_retried == attempts
    async with Database(dsn, max_size=2, settings=quick) as db:
        # a group-commit batch's session keeps max_attempts alone (its queue waits)
        await db.call("SELECT setval('tries', 1, false)")
        async with db.session() as session:
            with pytest.raises(Busy, match="gave up after 2 attempts"):
                await db.call("SELECT contended(8, '40001')", session=session)
    no_window = dataclasses.replace(quick, contention_retry_s=0)
    async with Database(dsn, max_size=2, settings=no_window) as db:
        await db.call("SELECT setval('tries', 1, false)")
        with pytest.raises(Busy, match="gave up after 2 attempts"):
            await db.call("SELECT contended(8, '40001')")
        assert await db.call("SELECT nextval('tries')") == 3  # two attempts ran, no more


async def test_a_lost_connection_after_sending_stays_unknown_until_the_deadline(
        dsn: str) -> None:
    """A statement whose connection is lost every time it is sent is retried until the
    deadline and then reported as OutcomeUnknown (it may have run), never Busy."""
    settings = TxSettings(max_attempts=1_000_000, backoff_base_s=0.01, backoff_cap_s=0.05)
    async with Database(dsn, max_size=2, settings=settings) as db:
        with deadline(0.5), pytest.raises(OutcomeUnknown):
            await db.call(SELF_TERMINATE)
        assert db.stats.connection_retried >= 1


async def test_the_pool_wait_is_bounded_and_busy_was_never_sent(dsn: str) -> None:
    """With the only connection held by a real transaction, a call and a read wait at most
    pool_wait_s and are Busy; the call's statement never reached the database."""
    async with Database(dsn, min_size=1, max_size=1,
                        settings=TxSettings(pool_wait_s=0.2)) as db:
        await db.call("CREATE TABLE touched (x int)")
        async with db.pool.connection() as held:
            await held.execute("BEGIN")
            await held.execute("SELECT pg_sleep(0.01)")
            with pytest.raises(Busy, match="no database connection"):
                await db.call("INSERT INTO touched VALUES (1)")
            with pytest.raises(Busy, match="no database connection"):
                await db.fetch("SELECT 1")
            await held.execute("ROLLBACK")
        assert await db.call("SELECT count(*) FROM touched") == 0
        assert db.stats.connection_retried == 0


async def test_the_deadline_cuts_the_statement_timeout(dsn: str) -> None:
    """A statement waiting on a lock longer than its deadline is stopped by the
    transaction's statement_timeout cut to the time left: Busy, and rolled back."""
    async with Database(dsn, max_size=2, settings=TxSettings(lock_timeout_ms=30_000)) as db:
        await db.call("CREATE TABLE t (x int PRIMARY KEY)")
        await db.call("INSERT INTO t VALUES (1)")
        with psycopg.connect(dsn) as blocker:
            blocker.execute("SELECT 1 FROM t FOR UPDATE")
            with deadline(0.3), pytest.raises(Busy, match="statement timeout"):
                await db.call("UPDATE t SET x = 2 WHERE x = 1")
        assert await db.call("SELECT x FROM t") == 1


async def test_a_read_that_loses_its_connection_is_a_typed_error(dsn: str) -> None:
    """Database.fetch whose connection is lost on every attempt raises DatabaseUnavailable
    (retried first), not psycopg's OperationalError."""
    async with Database(dsn, max_size=2, settings=TxSettings(max_attempts=2)) as db:
        with pytest.raises(DatabaseUnavailable, match="nothing was changed"):
            await db.fetch(SELF_TERMINATE)
        assert db.stats.connection_retried == 2
        assert await db.fetch("SELECT 1") == [(1,)]


async def test_a_queued_batch_request_past_its_deadline_is_busy_and_never_sent(
        db: Database, service: ReservationService, dsn: str) -> None:
    """Behind a batch waiting on the locked bucket, a request whose deadline passes while
    queued is answered Busy at its deadline, while that batch still waits, and is never
    sent (no ledger row); the batch in flight holds."""
    tenant = await service.create_tenant("acme")
    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    ttl = timedelta(minutes=5)
    with bucket_locked(dsn, bucket) as blocker:
        first = asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest(
            "reserve", key="first", digest="d", quantity=1, ttl=ttl)))
        await wait_until_blocked(dsn)
        with deadline(0.2):
            late = asyncio.create_task(combiner.submit(tenant.id, bucket, BatchRequest(
                "reserve", key="late", digest="d", quantity=1, ttl=ttl)))
        with pytest.raises(Busy, match="deadline passed while it waited"):
            await asyncio.wait_for(late, 60)  # (a guard against a hang, not a limit)
        assert not first.done()
        blocker.rollback()
    assert (await first)["ok"]["status"] == "held"
    assert ledger_rows(dsn, "late") == 0
    assert ledger_rows(dsn, "first") == 1


async def test_a_batch_is_stopped_at_its_latest_deadline(
        db: Database, service: ReservationService, dsn: str) -> None:
    """A batch whose (latest) request has a short deadline, waiting on the locked bucket,
    is stopped at that deadline by statement_timeout: Busy, nothing of it committed. (An
    earlier deadline of its batch mates does not cut it: test_batch_isolation.py.)"""
    tenant = await service.create_tenant("acme")
    await service.set_stock(tenant.id, "s", "w", 10)
    bucket = await bucket_id(db, tenant.id, "s")
    combiner = Combiner(db)
    with bucket_locked(dsn, bucket), deadline(0.3), \
            pytest.raises(Busy, match="statement timeout"):
        await combiner.submit(tenant.id, bucket, BatchRequest(
            "reserve", key="short", digest="d", quantity=1, ttl=timedelta(minutes=5)))
    assert ledger_rows(dsn, "short") == 0
    view = await service.get_stock(tenant.id, "s", "w")
    assert view.reserved == 0


async def test_the_tenant_limit_refuses_the_hot_tenant_and_serves_the_others(dsn: str) -> None:
    """With at most one request per tenant in flight, a tenant whose request waits on a
    lock gets 429 too_many_requests (Retry-After, nothing stored) for its next one, while
    another tenant is served; once the first ends, the tenant is served again."""
    settings = TxSettings(lock_timeout_ms=30_000)
    async for api in make_api(dsn, settings, 4, request_deadline_s=30, tenant_max_in_flight=1):
        tenant = api.tenants[0]
        with bucket_locked(dsn, await bucket_id(api.db, tenant, "a")) as blocker:
            first = asyncio.create_task(reserve(api.a, "first", "a"))
            await wait_until_blocked(dsn)
            refused = await reserve(api.a, "second", "b")
            assert refused.status_code == 429, refused.text
            assert refused.json()["code"] == "too_many_requests"
            assert refused.headers["Retry-After"] == "1"
            assert ledger_rows(dsn, "second") == 0
            served = await reserve(api.b, "other-1", "other")
            assert served.status_code == 201, served.text
            blocker.rollback()
        assert (await first).status_code == 201
        again = await reserve(api.a, "second", "b")
        assert again.status_code == 201, again.text


async def test_a_cancelled_request_gives_its_tenant_slot_back(dsn: str) -> None:
    """With at most one request per tenant in flight, a request cancelled while it waits
    on a lock (the client went away) frees the tenant's slot: the next one is served."""
    settings = TxSettings(lock_timeout_ms=30_000)
    async for api in make_api(dsn, settings, 4, request_deadline_s=30, tenant_max_in_flight=1):
        tenant = api.tenants[0]
        with bucket_locked(dsn, await bucket_id(api.db, tenant, "a")) as blocker:
            first = asyncio.create_task(reserve(api.a, "first", "a"))
            await wait_until_blocked(dsn)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            served = await reserve(api.a, "second", "b")
            assert served.status_code == 201, served.text
            blocker.rollback()


def test_create_app_refuses_a_deadline_out_of_range(dsn: str) -> None:
    """A request deadline outside 0.1..600 s is refused when the app is built."""
    from pgreserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="request_deadline_s"):
        create_app(dsn, request_deadline_s=0)
    with pytest.raises(InvalidRequest, match="tenant_max_in_flight"):
        create_app(dsn, tenant_max_in_flight=-1)


def test_the_admission_options_come_from_the_environment(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --workers N` builds each process's app from the environment: the deadline,
    the tenant limit and the PgBouncer console are read from PGRESERVE_* variables."""
    from pgreserve.http.admission import Admission
    from pgreserve.http.app import app_from_env

    monkeypatch.setenv("PGRESERVE_DATABASE_URL", dsn)
    monkeypatch.setenv("PGRESERVE_GC_THRESHOLD", "off")  # this process keeps its collector
    monkeypatch.setenv("PGRESERVE_REQUEST_DEADLINE_SECONDS", "2.5")
    monkeypatch.setenv("PGRESERVE_TENANT_MAX_IN_FLIGHT", "3")
    monkeypatch.setenv("PGRESERVE_PGBOUNCER_ADMIN_URL", "postgresql://u@127.0.0.1:1/pgbouncer")
    app = app_from_env()
    assert app.state.tenant_limit.max_in_flight == 3
    assert app.state.pgbouncer.admin_url == "postgresql://u@127.0.0.1:1/pgbouncer"
    admission = [m for m in app.user_middleware if m.cls is Admission]  # type: ignore[comparison-overlap]  # Starlette types cls as a factory
    assert [m.kwargs["deadline_s"] for m in admission] == [2.5]


def test_the_cli_refuses_a_deadline_out_of_range() -> None:
    """`pgreserve up` / `serve` refuse --request-deadline-seconds outside 0.1..600 and a
    negative --tenant-max-in-flight before starting anything."""
    from click.testing import CliRunner

    from pgreserve.cli import main

    for command in ("up", "serve"):
        result = CliRunner().invoke(main, [command, "--request-deadline-seconds", "0"])
        assert result.exit_code == 2 and "request-deadline-seconds" in result.output
        result = CliRunner().invoke(main, [command, "--tenant-max-in-flight", "-1"])
        assert result.exit_code == 2 and "tenant-max-in-flight" in result.output
