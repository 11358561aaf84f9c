"""Exact answers on the hot path (issue 12): one regression test per finding.

Each test drives the dangerous interleaving by hand: a raw connection runs the
SQL the service runs (reserve_v1, bucket_take_v1) and stops before COMMIT
while the service's own call blocks on it; pg_stat_activity tells when the
other side waits. The assertions state the promise, not the mechanism, so
they hold for any correct fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import Busy, InvalidRequest, OutcomeUnknown, PgReserveError
from pgreserve.workers.sweeper import Sweeper
from test_concurrency import deadlocks, reserve_sql, wait_until_blocked


class Later:
    """The database clock an hour ahead: every hold made now is past its expiry."""

    def __call__(self) -> datetime:
        return datetime.now(UTC) + timedelta(hours=1)


def figures(dsn: str, tenant: int, sku: str) -> dict[str, int]:
    """A bucket's books read in one snapshot: on_hand, free, pool, held, shortfall, sold."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT b.on_hand, b.free,"
            " (SELECT count(*) FROM stock_unit u WHERE u.tenant_id = b.tenant_id"
            "   AND u.bucket_id = b.bucket_id),"
            " (SELECT coalesce(sum(quantity), 0) FROM reservation_line l"
            "   WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held),"
            " b.shortfall,"
            " (SELECT coalesce(-sum(quantity), 0) FROM stock_movement m"
            "   WHERE m.tenant_id = b.tenant_id AND m.bucket_id = b.bucket_id"
            "   AND m.kind = 'sale')"
            " FROM stock_bucket b WHERE b.tenant_id = %s AND b.sku = %s",
            (tenant, sku)).fetchone()
    assert row is not None
    names = ("on_hand", "free", "pool", "held", "shortfall", "sold")
    return {k: int(v) for k, v in zip(names, row, strict=True)}


def bucket_id(dsn: str, tenant: int, sku: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT bucket_id FROM stock_bucket WHERE tenant_id = %s"
                           " AND sku = %s", (tenant, sku)).fetchone()
    assert row is not None
    return int(row[0])


async def reserve_and_claim(service: ReservationService, tenant: int, key: str, sku: str,
                            qty: int) -> bool:
    """A buyer who pays at once: reserve, and claim if held. Any exception fails the test."""
    try:
        out = await service.reserve(tenant, key, [(sku, "w", qty)])
        if out.held:
            assert out.reservation is not None
            await service.claim(tenant, out.reservation.id)
    except Exception as exc:  # noqa: BLE001 - the promise is an answer, never any error
        pytest.fail(f"reserve/claim of {qty} raised {type(exc).__name__}: {exc}")
    return out.held


# -- D1, D2: a short pool buyer racing a one-unit buyer or a recount ----------------

async def test_one_unit_buyer_waiting_on_a_short_pool_take_is_held(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """D1: a one-unit buyer waiting on a short pool buyer's units is held once they come back, never stored as sold out."""
    await service.set_stock(tenant.id, "s", "w", 3, strategy="pool")
    sql, params = reserve_sql(tenant.id, "short", "s", "w", 5)
    with psycopg.connect(dsn, application_name="short-buyer") as short:
        # the buyer of 5 takes all 3 pool units, comes up short, gives them back,
        # and pauses before COMMIT
        short.execute(sql, params)
        one = asyncio.create_task(service.reserve(tenant.id, "one", [("s", "w", 1)]))
        await wait_until_blocked(dsn)
        assert not one.done()
        short.commit()
    out = await one
    view = await service.get_stock(tenant.id, "s", "w")
    # 3 units were there at every instant: the rejection, stored for good, is false
    assert out.held, (f"one-unit buyer rejected with {out.short_lines} while the bucket"
                      f" had {view.available} available")
    assert (view.on_hand, view.reserved, view.available) == (3, 1, 2)
    assert await service.invariant_violations() == []


@pytest.mark.parametrize("change", ["recount", "negative_adjustment"])
async def test_stock_change_racing_a_short_pool_take_leaves_no_phantom_units(
        dsn: str, service: ReservationService, tenant: Tenant, change: str) -> None:
    """D2: a recount or a negative adjustment racing a short pool take leaves no phantom units."""
    await service.set_stock(tenant.id, "s", "w", 3, strategy="pool")
    sql, params = reserve_sql(tenant.id, "short", "s", "w", 5)
    with psycopg.connect(dsn, application_name="short-buyer") as short:
        short.execute(sql, params)
        if change == "recount":
            expected = 3
            task: asyncio.Task[Any] = asyncio.create_task(
                service.set_stock(tenant.id, "s", "w", 3))
        else:
            expected = 2
            task = asyncio.create_task(
                service.adjust_stock(tenant.id, "damaged", "s", "w", -1, reason="damaged"))
        # the stock change waits in the pool drain for the short buyer's units
        await wait_until_blocked(dsn)
        assert not task.done()
        short.commit()
    await task
    books = figures(dsn, tenant.id, "s")
    assert books["on_hand"] == expected
    assert books["on_hand"] == books["free"] + books["pool"] + books["held"], (
        f"phantom units: {books}")
    beyond = await service.reserve(tenant.id, "beyond", [("s", "w", expected + 1)])
    assert not beyond.held, f"a buyer of {expected + 1} was held on {expected} units"
    assert await service.invariant_violations() == []


# -- D4: a live strategy switch ----------------------------------------------------

async def test_strategy_switch_during_a_cart_stores_no_false_rejection(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """D4: a cart whose pool bucket is switched to row while the cart waits is held, not rejected with stock on hand."""
    await service.set_stock(tenant.id, "A", "w", 10, strategy="row")
    await service.set_stock(tenant.id, "B", "w", 10, strategy="pool")
    with psycopg.connect(dsn, application_name="blocker") as blocker:
        # hold bucket A so the cart, which has read both strategies, waits on its
        # first line
        blocker.execute("SELECT 1 FROM stock_bucket WHERE tenant_id = %s AND sku = 'A'"
                        " FOR NO KEY UPDATE", (tenant.id,))
        cart = asyncio.create_task(service.reserve(tenant.id, "cart",
                                                   [("A", "w", 1), ("B", "w", 1)]))
        await wait_until_blocked(dsn)
        switched = await service.set_stock(tenant.id, "B", "w", 10, strategy="row")
        assert (switched.strategy.value, switched.available) == ("row", 10)
        assert not cart.done()
        blocker.rollback()
    out = await cart
    # both buckets had 10 units at every instant
    assert out.held, f"cart rejected with {out.short_lines} while both buckets had 10"
    assert (await service.get_stock(tenant.id, "B", "w")).available == 9
    assert await service.invariant_violations() == []


# -- D3: a forced correction's shortfall ---------------------------------------------

async def test_expired_hold_given_up_inline_writes_off_the_forced_shortfall(
        db: Database, service: ReservationService, tenant: Tenant, dsn: str,
        strategy: str) -> None:
    """D3: after a forced count of 4 under a 10-unit hold that then expires unswept, buyers are answered (no error) and at most 4 units are sold."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    assert (await service.reserve(tenant.id, "first", [("s", "w", 10)], ttl=60)).held
    await service.set_stock(tenant.id, "s", "w", 4, force=True)  # 6 held units are gone
    later = ReservationService(db, clock=Later())  # the hold is past expiry, no sweeper ran
    big = await reserve_and_claim(later, tenant.id, "big", "s", 10)
    rest = await reserve_and_claim(later, tenant.id, "rest", "s", 4)
    books = figures(dsn, tenant.id, "s")
    assert books["sold"] <= 4, f"sold {books['sold']} units against 4 physical: {books}"
    assert not big and rest, "the 4 physical units are sold to the buyer of 4, not of 10"
    assert await later.invariant_violations() == []


async def test_claims_keep_the_forced_shortfall_until_receipts_pay_it(
        service: ReservationService, tenant: Tenant, dsn: str, strategy: str) -> None:
    """D3: claiming holds forced short does not erase the shortfall; the next receipt pays it back instead of being sold again."""
    await service.set_stock(tenant.id, "s", "w", 10, strategy=strategy)
    holds = [await service.reserve(tenant.id, f"h{i}", [("s", "w", 5)]) for i in range(2)]
    await service.set_stock(tenant.id, "s", "w", 4, force=True)  # 6 held units are gone
    for out in holds:
        assert out.reservation is not None
        await service.claim(tenant.id, out.reservation.id)
    await service.adjust_stock(tenant.id, "receipt", "s", "w", 6, reason="receipt")
    await reserve_and_claim(service, tenant.id, "again", "s", 6)
    books = figures(dsn, tenant.id, "s")
    # 10 units existed, 6 went missing, 6 came in: 10 physical units in all
    assert books["sold"] <= 10, f"sold {books['sold']} units against 10 physical: {books}"
    assert await service.invariant_violations() == []


async def test_invariant_violations_report_units_sold_beyond_the_ledger(
        service: ReservationService, tenant: Tenant, dsn: str, strategy: str) -> None:
    """D3: units made available outside the movement ledger and then sold are reported by invariant_violations_v1."""
    await service.set_stock(tenant.id, "s", "w", 4, strategy=strategy)
    # what the inline give-up did: 6 units back into free with no movement that
    # brought them in (on_hand = free + pool + held still holds)
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand + 6, free = free + 6"
                     " WHERE tenant_id = %s AND sku = 's'", (tenant.id,))
    assert await reserve_and_claim(service, tenant.id, "big", "s", 10)
    books = figures(dsn, tenant.id, "s")
    assert books["sold"] == 10
    found = await service.invariant_violations(tenant.id)
    assert found, f"10 units sold against 4 received, and no violation reported: {books}"


# -- D5: a rejection survives a crash -------------------------------------------------

@pytest.fixture
def durable_server() -> Iterator[EmbeddedServer]:
    """A server of its own with synchronous_commit on, and a WAL writer that flushes only
    every 10 s, so a commit that does not flush itself stays in memory until the crash."""
    root = Path(tempfile.mkdtemp(prefix="pgreserve-durable-"))
    server = EmbeddedServer(root / "data", extra_settings={
        "fsync": "off", "full_page_writes": "off", "synchronous_commit": "on",
        "wal_writer_delay": "10s", "autovacuum": "off"})
    try:
        server.start()
        yield server
    finally:
        with contextlib.suppress(Exception):  # already stopped if the test failed midway
            server.stop_now("immediate")
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_stored_rejection_survives_an_immediate_stop(
        durable_server: EmbeddedServer) -> None:
    """D5: a rejection the client has seen (twice) is still the key's answer after a crash and a receipt."""
    dsn = durable_server.dsn()
    migrations.migrate(dsn)
    async with Database(dsn, max_size=2) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("durable")
        await service.set_stock(tenant.id, "s", "w", 1)
        first = await service.reserve(tenant.id, "twice", [("s", "w", 2)])
        again = await service.reserve(tenant.id, "twice", [("s", "w", 2)])
        assert not first.held and not again.held and again.replayed
        # last, so that no later commit flushes its record along with its own
        once = await service.reserve(tenant.id, "once", [("s", "w", 2)])
        assert not once.held
    durable_server.stop_now("immediate")  # right after the client saw the answers
    durable_server.start()
    async with Database(dsn, max_size=2) as db:
        service = ReservationService(db)
        await service.adjust_stock(tenant.id, "receipt", "s", "w", 5, reason="receipt")
        after = {key: await service.reserve(tenant.id, key, [("s", "w", 2)])
                 for key in ("twice", "once")}
    changed = {key: "held" if out.held else "rejected afresh"
               for key, out in after.items() if out.held or not out.replayed}
    assert not changed, f"rejected before the crash, after it: {changed}"


# -- D6: the sweeper and two-line carts ----------------------------------------------

async def wait_blocked_or_done(dsn: str, task: asyncio.Task[Any]) -> None:
    """Wait until a pgreserve backend waits on a lock, or the task has finished."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(500):
            if task.done():
                return
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'pgreserve:core' AND wait_event_type = 'Lock'"
            ).fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the sweeper neither waited on a lock nor finished")


async def test_sweeper_never_deadlocks_with_a_two_line_cart(dsn: str) -> None:
    """D6: a sweeper round expiring holds of buckets B then A and a cart taking A then B never deadlock, and the round is not Busy."""
    async with Database(dsn, max_size=4) as db:
        service = ReservationService(db)
        later = ReservationService(db, clock=Later())
        tenant = await service.create_tenant("sweep")
        for sku in ("A", "B"):
            await service.set_stock(tenant.id, sku, "w", 10)
        # expiry order B, then A: across buckets, against the (sku, location) order
        assert (await service.reserve(tenant.id, "hold-b", [("B", "w", 1)], ttl=60)).held
        assert (await service.reserve(tenant.id, "hold-a", [("A", "w", 1)], ttl=120)).held
        a, b = bucket_id(dsn, tenant.id, "A"), bucket_id(dsn, tenant.id, "B")
        take = "SELECT bucket_take_v1(%s::bigint, %s::bigint, 1, clock_timestamp(), 'row')"
        before = deadlocks(dsn)
        cart_deadlocked = False
        async with await psycopg.AsyncConnection.connect(dsn, application_name="cart") as cart:
            # a two-line cart takes its lines in sorted order, as reserve_v1 does:
            # A now, then B once the sweeper is under way
            await cart.execute(take, (tenant.id, a))
            sweep = asyncio.create_task(Sweeper(later).run_once())
            await wait_blocked_or_done(dsn, sweep)
            try:
                await cart.execute(take, (tenant.id, b))
            except psycopg.errors.DeadlockDetected:
                cart_deadlocked = True
            await cart.rollback()  # the cart is abandoned: its takes are undone
        busy: PgReserveError | None = None
        try:
            expired = await sweep
        except (Busy, OutcomeUnknown) as exc:
            busy, expired = exc, 0
        # a sweeper that skips what is locked may leave a hold for its next round
        expired += await Sweeper(later).run_once()
        retried = db.stats.deadlocks_retried
        # (pg_stat_database may count a deadlock late: a backend flushes its
        # statistics when idle, at most once a second; the two above are direct)
        counted = deadlocks(dsn) - before
        assert (cart_deadlocked, retried, counted) == (False, 0, 0), (
            f"deadlock: cart victim {cart_deadlocked}, sweeper retried {retried},"
            f" pg_stat_database +{counted}")
        assert busy is None, f"the sweeper round gave up: {busy!r}"
        assert expired == 2
        assert await later.invariant_violations() == []


# -- L1: untyped library errors --------------------------------------------------------

@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), 1e20, -float("inf")])
async def test_non_finite_or_huge_ttl_is_invalid_request(
        dsn: str, service: ReservationService, tenant: Tenant, ttl: float) -> None:
    """L1: a ttl of inf, nan or 1e20 seconds is InvalidRequest, for reserve and extend, and writes nothing."""
    await service.set_stock(tenant.id, "s", "w", 5)
    out = await service.reserve(tenant.id, "ok", [("s", "w", 1)])
    assert out.reservation is not None
    rid = out.reservation.id
    before = table_counts(dsn)
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: service.reserve(tenant.id, "k", [("s", "w", 1)], ttl=ttl),
        lambda: service.extend(tenant.id, rid, ttl),
        lambda: service.extend(tenant.id, rid, ttl, request_key="x"),
    ]
    for call in calls:
        await refused(call)
    assert table_counts(dsn) == before
    assert (await service.get_reservation(tenant.id, rid)).expires_at == \
        out.reservation.expires_at


async def refused(call: Callable[[], Awaitable[Any]]) -> None:
    """The call raises InvalidRequest (a typed error), not a library exception."""
    try:
        await call()
    except InvalidRequest:
        return
    except Exception as exc:  # noqa: BLE001 - any other exception is the finding
        pytest.fail(f"raised {type(exc).__name__}: {exc}, not InvalidRequest")
    pytest.fail("accepted")


LONE = "\ud800"


@pytest.mark.parametrize("field", ["sku", "location", "request_key", "reason", "tenant_name"])
async def test_lone_surrogate_is_invalid_request_and_writes_nothing(
        dsn: str, service: ReservationService, tenant: Tenant, field: str) -> None:
    """L1: a lone surrogate in a sku, location, request key, reason or tenant name is InvalidRequest and writes nothing."""
    await service.set_stock(tenant.id, "s", "w", 5)
    bad = f"x{LONE}y"
    sku, loc, key, reason = (bad if field == f else ok for f, ok in
                             (("sku", "s"), ("location", "w"), ("request_key", "k"),
                              ("reason", "r")))
    calls: list[Callable[[], Awaitable[Any]]]
    if field == "tenant_name":
        calls = [lambda: service.create_tenant(bad),
                 lambda: service.create_tenant_with_key(bad)]
    elif field == "reason":
        calls = [lambda: service.adjust_stock(tenant.id, key, sku, loc, 1, reason=reason)]
    else:
        calls = [lambda: service.reserve(tenant.id, key, [(sku, loc, 1)]),
                 lambda: service.adjust_stock(tenant.id, key, sku, loc, 1, reason=reason)]
        if field != "request_key":
            calls += [lambda: service.set_stock(tenant.id, sku, loc, 5),
                      lambda: service.get_stock(tenant.id, sku, loc)]
    before = table_counts(dsn)
    for call in calls:
        await refused(call)
    assert table_counts(dsn) == before


# -- L2: the on_hand bound ---------------------------------------------------------------

MAX_DELTA = 2**53  # the documented maximum of on_hand and of a receipt's delta


def typed_refusal(exc: BaseException) -> bool:
    """A specific PgReserveError that says what is wrong (not retry-later, not the base)."""
    return (isinstance(exc, PgReserveError) and type(exc) is not PgReserveError
            and not isinstance(exc, (Busy, OutcomeUnknown)))


async def test_receipts_at_the_on_hand_bound_get_a_typed_error(
        db: Database, service: ReservationService, dsn: str) -> None:
    """L2: receipts of the maximum delta stop at the on_hand bound with a typed error (HTTP 4xx), never `bigint out of range`."""
    import httpx

    from pgreserve.http import create_app

    tenant, key = await service.create_tenant_with_key("bound")
    await service.set_stock(tenant.id, "s", "w", MAX_DELTA)
    failure: BaseException | None = None
    accepted = 0
    # 2**63 / 2**53 = 1024: the receipt that would pass bigint is the 1023rd at the latest
    for i in range(1024):
        try:
            await service.adjust_stock(tenant.id, f"r{i}", "s", "w", MAX_DELTA, reason="in")
        except Exception as exc:  # noqa: BLE001 - which exception is what the test checks
            failure = exc
            break
        accepted += 1
    assert failure is not None, "1024 receipts of 2**53 accepted past bigint"
    assert typed_refusal(failure), (
        f"receipt {accepted + 1} raised {type(failure).__name__}: {failure}")
    books = figures(dsn, tenant.id, "s")
    assert books["on_hand"] == MAX_DELTA * (accepted + 1)  # the refused one wrote nothing
    # the same receipt through the API is a client error, not a 500
    transport = httpx.ASGITransport(app=create_app(database=db), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        response = await client.post("/v1/stock/w/s/adjustments", json={"delta": MAX_DELTA},
                                     headers={"Idempotency-Key": "over"})
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert figures(dsn, tenant.id, "s")["on_hand"] == books["on_hand"]


# -- A cart's later line judges expiry by the instant the request started ---------------

async def wait_until_past_expiry(dsn: str, tenant: int, reservation_id: str) -> None:
    """Wait until the database's clock is past a hold's expires_at (polled, no fixed sleep)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(1000):
            row = conn.execute(
                "SELECT clock_timestamp() > expires_at FROM reservation"
                " WHERE tenant_id = %s AND reservation_id = %s",
                (tenant, reservation_id)).fetchone()
            if row is not None and row[0]:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the hold never passed its expiry")


async def test_cart_waiting_on_its_first_line_counts_a_hold_that_expired_meanwhile(
        dsn: str, service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A cart that waits on its first bucket while a hold of its second runs out is held, not stored as sold out: at every instant of its request the second bucket could serve it."""
    await service.set_stock(tenant.id, "A", "w", 10, strategy="row")
    await service.set_stock(tenant.id, "B", "w", 4, strategy=strategy)
    first = await service.reserve(tenant.id, "short-lived", [("B", "w", 2)], ttl=1.0)
    assert first.held and first.reservation is not None
    with psycopg.connect(dsn, application_name="blocker") as blocker:
        # hold bucket A so the cart waits on its first line
        blocker.execute("SELECT 1 FROM stock_bucket WHERE tenant_id = %s AND sku = 'A'"
                        " FOR NO KEY UPDATE", (tenant.id,))
        cart = asyncio.create_task(service.reserve(tenant.id, "cart",
                                                   [("A", "w", 1), ("B", "w", 2)]))
        await wait_until_blocked(dsn)
        # the short-lived hold passes its expiry while the cart waits (no
        # sweeper runs); only then does another buyer, arriving now, take the
        # 2 units of B that were never held
        await wait_until_past_expiry(dsn, tenant.id, first.reservation.id)
        other = await service.reserve(tenant.id, "other", [("B", "w", 2)])
        assert other.held
        assert not cart.done()
        blocker.rollback()
    out = await cart
    # B had 2 units for the cart at every instant: 2 never held until the
    # other buyer took them, and from then on (the hold already past expiry)
    # the expired hold's 2. The rejection, stored for the cart's key for
    # good, was true at no instant; a buyer arriving right after is held.
    fresh = await service.reserve(tenant.id, "fresh", [("B", "w", 2)])
    assert out.held, (f"cart stored as rejected with {out.short_lines} although B's expired "
                      f"hold was there to give up (a buyer right after was "
                      f"{'held' if fresh.held else 'rejected'})")
    assert not fresh.held
    assert await service.invariant_violations() == []


async def test_a_stock_change_does_not_count_holds_past_their_expiry(
        timed: ReservationService, tenant: Tenant, clock: Any, strategy: str,
        dsn: str) -> None:
    """A hold past its expiry no longer counts against stock, before the sweeper too
    (docs/state-machine.md): a correction or count below the units such holds kept is
    applied, giving them up first, as a short reserve would, and a forced one records
    only the live holds' missing units as shortfall. Below the live holds it is still
    refused (would_oversell naming them), and then nothing changes."""
    from pgreserve.errors import WouldOversell

    t = tenant.id
    await timed.set_stock(t, "s", "wh", 5, strategy=strategy)
    late = (await timed.reserve(t, "late", [("s", "wh", 3)], ttl=60)).reservation
    assert late is not None
    clock.advance(120)  # `late` is past its expiry; the sweeper has not run
    live = (await timed.reserve(t, "live", [("s", "wh", 2)], ttl=600)).reservation
    assert live is not None
    stock = await timed.get_stock(t, "s", "wh")
    assert (stock.on_hand, stock.reserved, stock.available) == (5, 2, 3)

    before = table_counts(dsn)
    with pytest.raises(WouldOversell) as refused:
        await timed.adjust_stock(t, "too-far", "s", "wh", -4)
    assert "2 units held" in str(refused.value)
    assert table_counts(dsn) == before  # nothing given up, nothing written

    after = await timed.adjust_stock(t, "damaged", "s", "wh", -1)
    assert (after.on_hand, after.reserved, after.available) == (4, 2, 2)
    counted = await timed.set_stock(t, "s", "wh", 3)
    assert (counted.on_hand, counted.reserved, counted.available) == (3, 2, 1)
    forced = await timed.set_stock(t, "s", "wh", 1, force=True)
    assert (forced.on_hand, forced.reserved, forced.shortfall) == (2, 2, 1)
    assert (await timed.get_reservation(t, late.id)).status.value == "expired"
    with psycopg.connect(dsn) as conn:
        restores = conn.execute(
            "SELECT count(*), sum(quantity) FROM stock_movement WHERE reservation_id = %s"
            " AND kind = 'restore'", (late.id,)).fetchone()
    assert restores == (1, 3)  # given up once, its 3 units back once
    await Sweeper(timed).run_once()  # the sweeper finds nothing more to give back
    assert (await timed.get_stock(t, "s", "wh")).reserved == 2
    assert await timed.invariant_violations() == []


async def test_a_backorder_take_waits_for_an_expired_hold_being_given_up(
        db: Database, tenant: Tenant, dsn: str) -> None:
    """Row bucket s: 3 on hand, a backorder allowance of 3, all 3 held by E (1 s).

    C takes 2 of the allowance and stays open on s's row. B's cart (a:1, s:3) finds s
    short and waits for the row to take from the allowance (3 committed: enough). E
    expires; its release locks E's line and queues behind B. C commits: 1 of the
    allowance left, and E's 3 expired units. B's units were there at every instant, so
    B must not be refused: its give-up of expired holds skips E's line (locked by the
    release), and B retries once that release is through instead of storing a
    rejection of 1 for good."""
    service = ReservationService(db)
    await service.set_stock(tenant.id, "s", "w", 3, strategy="row", backorder_limit=3)
    await service.set_stock(tenant.id, "a", "w", 10, strategy="row")
    started = asyncio.get_running_loop().time()
    held = await service.reserve(tenant.id, "E", [("s", "w", 3)], ttl=1)
    assert held.held and held.reservation is not None
    sql, params = reserve_sql(tenant.id, "C", "s", "w", 2)
    with psycopg.connect(dsn) as c:
        doc = c.execute(sql, params).fetchone()[0]  # type: ignore[index]
        assert doc["status"] == "held", doc  # from the allowance, not committed yet
        buyer = asyncio.create_task(
            service.reserve(tenant.id, "B", [("a", "w", 1), ("s", "w", 3)]))
        await wait_until_blocked(dsn)  # B, on s's row
        assert (await service.get_stock(tenant.id, "s", "w")).available >= 3
        # past E's expiry, within B's 2 s lock_timeout
        await asyncio.sleep(max(0.0, started + 1.1 - asyncio.get_running_loop().time()))
        release = asyncio.create_task(service.release(tenant.id, held.reservation.id))
        await wait_until_blocked(dsn, 2)  # the release holds E's line, waits for s's row
        assert (await service.get_stock(tenant.id, "s", "w")).available >= 3
        c.commit()
    out = await buyer
    await release
    assert out.held, out.short_lines
    after = await service.get_stock(tenant.id, "s", "w")
    assert (after.on_hand, after.reserved) == (3, 5)  # C's 2 and B's 3
    assert await service.invariant_violations() == []
