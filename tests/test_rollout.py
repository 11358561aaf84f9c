"""Rolling out beside the legacy Redis hold store: the adapter, the modes, the comparison."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import pytest_asyncio

import toolcheck
from pgreserve import errors
from pgreserve.core.service import ReservationService
from pgreserve.db.database import Database, deadline
from pgreserve.domain import Reservation, ReserveOutcome, Status, Tenant
from pgreserve.http import create_app
from pgreserve.rollout import Mode, RedisHoldStore, Rollout, set_mode
from pgreserve.rollout import report as reports
from pgreserve.rollout.comparison import Comparison, Recorder, RolloutMetrics
from redisserver import RedisServer, free_port
from test_http_api import assert_problem

BIN = Path(sys.executable).parent / "pgreserve"
_ns = itertools.count()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the run (each test uses its own key namespace)."""
    toolcheck.require("redis-server")
    server = RedisServer().start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisHoldStore]:
    s = RedisHoldStore(redis_server.url, namespace=f"test{os.getpid()}n{next(_ns)}")
    yield s
    await s.aclose()


@pytest_asyncio.fixture
async def patient_store(redis_server: RedisServer) -> AsyncIterator[RedisHoldStore]:
    """A store whose callers wait up to 30 s for one of its connections (the default gives
    up after 1 s): for tests of many calls at once, where a loaded machine's slow turn is
    not the failure under test."""
    s = RedisHoldStore(redis_server.url, namespace=f"test{os.getpid()}n{next(_ns)}",
                       timeout_s=30)
    yield s
    await s.aclose()


@contextlib.asynccontextmanager
async def rollout_layer(service: ReservationService,
                        store: RedisHoldStore) -> AsyncIterator[Rollout]:
    """A rollout layer over the store's Redis namespace, reading modes on every request
    (no cache delay in tests)."""
    r = Rollout(service, RedisHoldStore(store.url, namespace=store.namespace), mode_ttl_s=0,
                flush_every_s=0.05)
    try:
        yield r
    finally:
        await r.aclose()


@pytest_asyncio.fixture
async def rollout(service: ReservationService,
                  store: RedisHoldStore) -> AsyncIterator[Rollout]:
    """The rollout layer of one process."""
    async with rollout_layer(service, store) as r:
        yield r


async def seed(service: ReservationService, store: RedisHoldStore, tenant: int, sku: str,
               on_hand: int, location: str = "berlin") -> None:
    """Both stores counted alike."""
    await service.set_stock(tenant, sku, location, on_hand)
    await store.set_stock(tenant, sku, location, on_hand)


async def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command in a thread (the event loop keeps serving) and return its result."""
    return await asyncio.to_thread(subprocess.run, list(argv), capture_output=True, text=True,
                                   check=check)


@contextlib.asynccontextmanager
async def redis_down(rollout: Rollout) -> AsyncIterator[None]:
    """Inside, the rollout's Redis does not answer (a store on a port nothing listens
    on, given up after 0.2 s); its own store again after."""
    live = rollout.store
    down = RedisServer()  # never started: nothing listens on its port
    rollout.store = RedisHoldStore(down.url, namespace=live.namespace, timeout_s=0.2)
    try:
        yield
    finally:
        await rollout.store.aclose()
        rollout.store = live


async def pg_sold(db: Database, tenant: int, sku: str) -> int:
    rows = await db.fetch("SELECT coalesce(abs(sum(m.quantity)), 0) FROM stock_movement m "
                          "JOIN stock_bucket b USING (tenant_id, bucket_id) "
                          "WHERE m.tenant_id = %s AND b.sku = %s AND m.kind = 'sale'",
                          (tenant, sku))
    return int(rows[0][0])


# -- the adapter ------------------------------------------------------------------

async def test_legacy_cart_is_held_whole_or_not_at_all(store: RedisHoldStore,
                                                       tenant: Tenant) -> None:
    """A cart with one short line takes nothing in Redis; a cart that fits takes every line."""
    from datetime import timedelta

    from pgreserve import validation as check

    await store.set_stock(tenant.id, "a", "x", 5)
    await store.set_stock(tenant.id, "b", "x", 1)
    cart = check.cart([("a", "x", 2), ("b", "x", 2)])
    out = await store.reserve(tenant.id, "k1", "fp1", cart, timedelta(seconds=60))
    assert not out.held and [(s.sku, s.requested, s.available) for s in out.short_lines] == \
        [("b", 2, 1)]
    assert (await store.available(tenant.id, "a", "x"), await store.available(tenant.id, "b", "x")) == (5, 1)
    cart = check.cart([("a", "x", 2), ("b", "x", 1)])
    out = await store.reserve(tenant.id, "k2", "fp2", cart, timedelta(seconds=60))
    assert out.held
    assert (await store.available(tenant.id, "a", "x"), await store.available(tenant.id, "b", "x")) == (3, 0)
    again = await store.reserve(tenant.id, "k2", "fp2", cart, timedelta(seconds=60))
    assert again.replayed and again.reservation is not None and out.reservation is not None
    assert again.reservation.id == out.reservation.id
    assert await store.available(tenant.id, "a", "x") == 3
    with pytest.raises(errors.IdempotencyKeyReused):
        await store.reserve(tenant.id, "k2", "other", cart, timedelta(seconds=60))


async def test_legacy_release_gives_back_once_and_claim_removes_the_hold(
        store: RedisHoldStore, tenant: Tenant) -> None:
    """A release gives the units back once, a claim keeps them sold, and neither repeats."""
    from datetime import timedelta

    from pgreserve import validation as check

    await store.set_stock(tenant.id, "a", "x", 4)
    cart = check.cart([("a", "x", 2)])
    first = await store.reserve(tenant.id, "r1", "f", cart, timedelta(seconds=60))
    second = await store.reserve(tenant.id, "r2", "f", cart, timedelta(seconds=60))
    assert first.reservation and second.reservation
    assert (await store.release(tenant.id, first.reservation.id)).status is Status.RELEASED
    assert (await store.release(tenant.id, first.reservation.id)).status is Status.RELEASED
    assert await store.available(tenant.id, "a", "x") == 2
    assert (await store.claim(tenant.id, second.reservation.id)).status is Status.CLAIMED
    assert (await store.claim(tenant.id, second.reservation.id)).replayed
    with pytest.raises(errors.ReservationClaimed):
        await store.release(tenant.id, second.reservation.id)
    with pytest.raises(errors.ReservationReleased):
        await store.claim(tenant.id, first.reservation.id)
    assert await store.available(tenant.id, "a", "x") == 2
    assert await store.held(tenant.id, "a", "x") == 0
    assert await store.redis.exists(store.key(tenant.id, "hold", second.reservation.id)) == 0


async def test_legacy_hold_expires_by_ttl_and_gives_units_back_once(
        store: RedisHoldStore, tenant: Tenant) -> None:
    """A hold whose key Redis expired gives its units back once (sweep), and cannot be claimed."""
    from datetime import timedelta

    from pgreserve import validation as check

    await store.set_stock(tenant.id, "a", "x", 3)
    out = await store.reserve(tenant.id, "e1", "f", check.cart([("a", "x", 3)]),
                              timedelta(seconds=1))
    assert out.reservation is not None
    assert await store.available(tenant.id, "a", "x") == 0
    await asyncio.sleep(1.2)
    assert await store.expire_due(tenant.id) == 1
    assert await store.expire_due(tenant.id) == 0
    assert await store.available(tenant.id, "a", "x") == 3
    with pytest.raises(errors.ReservationExpired):
        await store.claim(tenant.id, out.reservation.id)
    assert await store.available(tenant.id, "a", "x") == 3


async def test_legacy_keys_are_namespaced_per_tenant(store: RedisHoldStore,
                                                     service: ReservationService) -> None:
    """Two tenants' counters of the same sku and location are separate keys."""
    one = await service.create_tenant("one")
    two = await service.create_tenant("two")
    await store.set_stock(one.id, "a:b", "x", 5)
    await store.set_stock(two.id, "a", "b:x", 7)
    assert store.counter_key(one.id, "a:b", "x") != store.counter_key(two.id, "a", "b:x")
    assert store.counter_key(one.id, "a:b", "x").startswith(f"{store.namespace}:t{one.id}:")
    assert (await store.available(one.id, "a:b", "x"), await store.available(two.id, "a", "b:x")) \
        == (5, 7)
    assert await store.available(two.id, "a:b", "x") == 0


# -- shadow mode ------------------------------------------------------------------

async def test_shadow_mode_64_buyers_one_hot_sku_agree_fully(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Shadow mode under 64 concurrent buyers of one hot SKU seeded alike: agreement 1.0,
    and both stores end with the same units sold and available."""
    await seed(service, store, tenant.id, "hot", 40)
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    claimed = 0

    async def buyer(i: int) -> None:
        nonlocal claimed
        out = await rollout.reserve(tenant.id, f"buy-{i}", [("hot", "berlin", 1)], ttl=60)
        if out.held:
            assert out.reservation is not None
            await asyncio.sleep(random.random() / 100)
            if i % 3:
                await rollout.claim(tenant.id, out.reservation.id)
                claimed += 1
            else:
                await rollout.release(tenant.id, out.reservation.id)

    await asyncio.gather(*(buyer(i) for i in range(64)))
    await rollout.recorder.flush()
    summary, latest = await reports.report(db, tenant.id)
    assert latest == []
    assert summary[0].compared > 64 and summary[0].agreement == 1.0
    view = await service.get_stock(tenant.id, "hot", "berlin")
    assert view.on_hand == 40 - claimed and view.available == 40 - claimed
    assert await store.available(tenant.id, "hot", "berlin") == 40 - claimed
    assert await store.held(tenant.id, "hot", "berlin") == 0
    sales = await db.fetch("SELECT count(*) FROM rollout_legacy_sale WHERE tenant_id = %s",
                           (tenant.id,))
    assert int(sales[0][0]) == claimed == await pg_sold(db, tenant.id, "hot")
    assert await service.invariant_violations() == []


async def test_planted_disagreement_shows_up_with_its_request_key(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """A manual DECR on the Redis counter makes the last buyer's answers differ; the report
    lists that request key with both outcomes, and the caller gets Redis's answer."""
    await seed(service, store, tenant.id, "tee", 5)
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    await store.redis.decr(store.counter_key(tenant.id, "tee", "berlin"))
    answers = [await rollout.reserve(tenant.id, f"order-{i}", [("tee", "berlin", 1)], ttl=60)
               for i in range(5)]
    assert [a.held for a in answers] == [True] * 4 + [False]
    await rollout.recorder.flush()
    summary, latest = await reports.report(db, tenant.id)
    assert summary[0].compared == 5 and summary[0].agreed == 4
    assert [d.request_key for d in latest] == ["order-4"]
    assert latest[0].legacy["held"] is False and latest[0].pgreserve == {"held": True}
    # the hold the caller was not told about is given back in pgreserve
    assert (await service.get_stock(tenant.id, "tee", "berlin")).available == 1
    out = await run(str(BIN), "rollout", "report", "--tenant", "acme", "--json",
                    "--database-url", db.conninfo)
    doc = json.loads(out.stdout)
    assert doc["tenants"][0]["agreement"] == 0.8
    assert doc["disagreements"][0]["request_key"] == "order-4"


# -- switching ----------------------------------------------------------------------

async def test_flip_primary_to_legacy_mid_sale_keeps_every_unit_accounted(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Flipping primary -> legacy in the middle of a 64-buyer sale: in Redis, available +
    held + every claim = the stock; in pgreserve too: the claims of primary holds are its
    sales, those of legacy holds leave its count (docs/operations.md)."""
    await seed(service, store, tenant.id, "hot", 50)
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    claims = {"primary": 0, "legacy": 0}
    started = asyncio.Event()

    async def buyer(i: int) -> None:
        if i >= 32:
            await started.wait()
        out = await rollout.reserve(tenant.id, f"b{i}", [("hot", "berlin", 1)], ttl=60)
        if i == 31:
            await set_mode(db, tenant.id, Mode.LEGACY, "test")
            started.set()
        if out.held:
            assert out.reservation is not None
            record = await store.record(tenant.id, out.reservation.id)
            assert record is not None
            mode: str = record.mode
            await asyncio.sleep(random.random() / 50)
            if i % 4:
                done = await rollout.claim(tenant.id, out.reservation.id)
                assert done.status is Status.CLAIMED
                claims[mode] += 1
            else:
                await rollout.release(tenant.id, out.reservation.id)

    await asyncio.gather(*(buyer(i) for i in range(64)))
    assert claims["primary"] > 0 and claims["legacy"] > 0
    total = claims["primary"] + claims["legacy"]
    assert total <= 50  # no unit sold twice across the two stores
    assert await store.available(tenant.id, "hot", "berlin") + \
        await store.held(tenant.id, "hot", "berlin") + total == 50
    assert await store.held(tenant.id, "hot", "berlin") == 0
    assert await pg_sold(db, tenant.id, "hot") == claims["primary"]
    view = await service.get_stock(tenant.id, "hot", "berlin")
    assert view.on_hand == 50 - total and view.available == view.on_hand
    assert await service.invariant_violations() == []


async def test_switch_with_holds_in_flight_loses_and_duplicates_nothing(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Holds taken in each mode, then finished after the tenant moved on, finish under the
    mode they were taken in: each store counts each of its claims once and every release
    back; the sale of a legacy hold (no pgreserve twin) leaves pgreserve's count once."""
    await seed(service, store, tenant.id, "sku", 100)
    holds: list[tuple[str, str]] = []
    # (back from pgreserve to legacy or shadow is forced: Redis does not know the
    # holds pgreserve took meanwhile, which the counts below leave out)
    for n, mode in enumerate([Mode.LEGACY, Mode.SHADOW, Mode.PRIMARY, Mode.PGRESERVE] * 2):
        await set_mode(db, tenant.id, mode, "test", force=True)
        for i in range(3):
            out = await rollout.reserve(tenant.id, f"{n}-{i}", [("sku", "berlin", 2)], ttl=60)
            assert out.held and out.reservation is not None
            holds.append((mode.value, out.reservation.id))
    await set_mode(db, tenant.id, Mode.SHADOW, "test", force=True)
    redis_claims = pg_claims = legacy_sold = 0
    for i, (taken, rid) in enumerate(holds):
        if i % 2:
            first = await rollout.claim(tenant.id, rid)
            again = await rollout.claim(tenant.id, rid)
            assert first.status is again.status is Status.CLAIMED
            redis_claims += 2 * (taken != "pgreserve")
            pg_claims += 2 * (taken != "legacy")
            legacy_sold += 2 * (taken == "legacy")
        else:
            await rollout.release(tenant.id, rid)
            await rollout.release(tenant.id, rid)
    assert await store.held(tenant.id, "sku", "berlin") == 0
    assert await store.available(tenant.id, "sku", "berlin") == 100 - redis_claims
    view = await service.get_stock(tenant.id, "sku", "berlin")
    assert view.on_hand == view.available == 100 - pg_claims - legacy_sold
    assert await pg_sold(db, tenant.id, "sku") == pg_claims
    await rollout.recorder.flush()
    summary, latest = await reports.report(db, tenant.id)
    assert latest == [] and summary[0].agreement == 1.0
    assert await service.invariant_violations() == []


async def test_extend_moves_the_expiry_in_the_stores_of_the_holds_mode(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """An extend of a shadow hold moves its expiry in Redis (hold key TTL) and in pgreserve;
    an extend of a released hold is refused by both alike."""
    await seed(service, store, tenant.id, "a", 2)
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    out = await rollout.reserve(tenant.id, "k", [("a", "berlin", 1)], ttl=5)
    assert out.reservation is not None
    rid = out.reservation.id
    longer = await rollout.extend(tenant.id, rid, 600)
    assert (longer.expires_at - out.reservation.expires_at).total_seconds() > 500
    assert await store.redis.pttl(store.key(tenant.id, "hold", rid)) > 500_000
    record = await store.record(tenant.id, rid)
    assert record is not None and record.pg_id is not None
    twin = await service.get_reservation(tenant.id, record.pg_id)
    assert (twin.expires_at - out.reservation.expires_at).total_seconds() > 500
    await rollout.release(tenant.id, rid)
    with pytest.raises(errors.ReservationNotActive):
        await rollout.extend(tenant.id, rid, 600)
    await rollout.recorder.flush()
    summary, latest = await reports.report(db, tenant.id)
    assert latest == [] and summary[0].compared == 4


@pytest.mark.parametrize("mode", [Mode.LEGACY, Mode.SHADOW])
async def test_an_extend_that_would_shorten_a_redis_hold_is_refused_unless_asked(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, mode: Mode) -> None:
    """In legacy and shadow mode, where Redis answers, an extend ending the hold sooner is
    ExtendWouldShorten with the Redis hold's expiry unchanged (and pgreserve's twin too in
    shadow); with allow_shorten both stores end it sooner."""
    await seed(service, store, tenant.id, "a", 2)
    await set_mode(db, tenant.id, mode, "test")
    out = await rollout.reserve(tenant.id, "k", [("a", "berlin", 1)], ttl=900)
    assert out.reservation is not None
    rid = out.reservation.id
    before = await store.record(tenant.id, rid)
    assert before is not None
    with pytest.raises(errors.ExtendWouldShorten):
        await rollout.extend(tenant.id, rid, 60)
    after = await store.record(tenant.id, rid)
    assert after is not None and after.expires_at == before.expires_at
    assert await store.redis.pttl(store.key(tenant.id, "hold", rid)) > 800_000
    if mode is Mode.SHADOW:
        assert before.pg_id is not None
        twin = await service.get_reservation(tenant.id, before.pg_id)
        assert (twin.expires_at - datetime.now(UTC)).total_seconds() > 800
    shorter = await rollout.extend(tenant.id, rid, 60, allow_shorten=True)
    assert (shorter.expires_at - datetime.now(UTC)).total_seconds() < 100
    assert await store.redis.pttl(store.key(tenant.id, "hold", rid)) <= 60_000
    if mode is Mode.SHADOW:
        assert before.pg_id is not None
        twin = await service.get_reservation(tenant.id, before.pg_id)
        assert (twin.expires_at - datetime.now(UTC)).total_seconds() < 100


async def test_a_redis_hold_is_not_extended_past_the_time_claims_look_in_redis(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """After a move to pgreserve, extending a hold taken in primary keeps it within the
    24 hours its claims still look for it in Redis, in both stores."""
    await seed(service, store, tenant.id, "a", 1)
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    out = await rollout.reserve(tenant.id, "k", [("a", "berlin", 1)], ttl=60)
    assert out.reservation is not None
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    until = (await rollout.modes.get(tenant.id)).redis_until
    assert until is not None
    await asyncio.sleep(1.1)
    longer = await rollout.extend(tenant.id, out.reservation.id, 24 * 3600)
    assert longer.expires_at <= until
    record = await store.record(tenant.id, out.reservation.id)
    assert record is not None and record.expires_at <= until
    assert (await rollout.claim(tenant.id, out.reservation.id)).status is Status.CLAIMED
    assert await store.held(tenant.id, "a", "berlin") == 0


@pytest.mark.parametrize("ended", ["released", "claimed"])
async def test_an_extend_pgreserve_refuses_in_primary_leaves_the_redis_hold_as_it_was(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, ended: str) -> None:
    """In primary, pgreserve answers an extend: when it refuses one (its hold ended,
    Redis's did not yet), Redis's hold keeps the end it had. Extended there, it would
    outlive pgreserve's and keep its units from Redis's buyers long after pgreserve gave
    them back. The comparison records Redis's hold as it still is: a disagreement."""
    await seed(service, store, tenant.id, "a", 2)
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    out = await rollout.reserve(tenant.id, "k", [("a", "berlin", 1)], ttl=30)
    assert out.reservation is not None
    rid = out.reservation.id
    before = await store.record(tenant.id, rid)
    assert before is not None and before.status == "held"
    if ended == "released":
        await service.release(tenant.id, rid)  # pgreserve's hold alone
    else:
        await service.claim(tenant.id, rid)
    with pytest.raises(errors.ReservationNotActive):
        await rollout.extend(tenant.id, rid, 600)
    after = await store.record(tenant.id, rid)
    assert after is not None and after.expires_at == before.expires_at
    assert await store.redis.pttl(store.key(tenant.id, "hold", rid)) <= 30_000
    await rollout.recorder.flush()
    _summary, latest = await reports.report(db, tenant.id)
    extends = [d for d in latest if d.operation == "extend"]
    assert len(extends) == 1
    assert extends[0].legacy == {"status": "active"}
    assert extends[0].pgreserve["error"] == "reservation_not_active"


async def test_a_failing_secondary_store_never_fails_the_caller(
        service: ReservationService, tenant: Tenant, db: Database) -> None:
    """Primary mode with Redis stopped still answers from pgreserve; the failures are counted
    and recorded as disagreements."""
    server = RedisServer().start()
    r = Rollout(service, RedisHoldStore(server.url), mode_ttl_s=0)
    try:
        await service.set_stock(tenant.id, "a", "x", 3)
        await r.store.set_stock(tenant.id, "a", "x", 3)
        await set_mode(db, tenant.id, Mode.PRIMARY, "test")
        server.stop()
        out = await r.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
        assert out.held and out.reservation is not None
        assert (await r.claim(tenant.id, out.reservation.id)).status is Status.CLAIMED
        assert r.metrics.secondary_failures.labels("legacy", "reserve")._value.get() == 1
        await r.recorder.flush()
        _, latest = await reports.report(db, tenant.id)
        assert sorted((d.operation, d.legacy["error"]) for d in latest) == \
            [("claim", "outcome_unknown"), ("reserve", "outcome_unknown")]
        assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 2
    finally:
        server.stop()
        await r.aclose()


async def test_pgreserve_tenants_never_call_redis_and_read_their_mode_once_per_ttl(
        service: ReservationService, tenant: Tenant, db: Database) -> None:
    """A tenant in mode pgreserve is served with Redis down, and a process reads its mode
    from the database at most once per TTL (a switch is seen when the TTL is over)."""
    server = RedisServer().start()
    r = Rollout(service, RedisHoldStore(server.url), mode_ttl_s=3600)
    server.stop()
    try:
        await service.set_stock(tenant.id, "a", "x", 5)
        out = await r.reserve(tenant.id, "k1", [("a", "x", 1)], ttl=60)
        assert out.reservation is not None
        assert (await r.claim(tenant.id, out.reservation.id)).status is Status.CLAIMED
        await set_mode(db, tenant.id, Mode.LEGACY, "test")
        cached = await r.reserve(tenant.id, "k2", [("a", "x", 1)], ttl=60)
        assert cached.held  # still pgreserve: the mode is cached
        r.modes.forget(tenant.id)
        with pytest.raises(errors.OutcomeUnknown):  # legacy now: Redis answers, and is down
            await r.reserve(tenant.id, "k3", [("a", "x", 1)], ttl=60)
        assert (await service.get_stock(tenant.id, "a", "x")).available == 3
    finally:
        await r.aclose()


async def test_a_freeze_stops_new_holds_in_shadow_and_primary_modes(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """A bucket frozen in pgreserve takes no new hold in either store while the tenant is in
    shadow or primary mode; the refusal is replayed for its key, also after the lift."""
    for mode in (Mode.SHADOW, Mode.PRIMARY):
        sku = f"tee-{mode.value}"
        await seed(service, store, tenant.id, sku, 5)
        await set_mode(db, tenant.id, mode, "test")
        await service.freeze(tenant.id, "stock count is wrong", "test@ops", sku=sku,
                             location="berlin")
        cart = [(sku, "berlin", 1)]
        out = await rollout.reserve(tenant.id, f"k-{mode.value}", cart, ttl=60)
        assert not out.held and out.reason == "bucket_frozen", mode
        assert await store.available(tenant.id, sku, "berlin") == 5
        assert await store.held(tenant.id, sku, "berlin") == 0
        again = await rollout.reserve(tenant.id, f"k-{mode.value}", cart, ttl=60)
        assert again.replayed and again.reason == "bucket_frozen", mode
        await service.unfreeze(tenant.id, "recounted", "test@ops", sku=sku, location="berlin")
        after = await rollout.reserve(tenant.id, f"k-{mode.value}", cart, ttl=60)
        assert not after.held and after.reason == "bucket_frozen", mode
        fresh = await rollout.reserve(tenant.id, f"k2-{mode.value}", cart, ttl=60)
        assert fresh.held, mode
        assert await store.available(tenant.id, sku, "berlin") == 4
        assert (await service.get_stock(tenant.id, sku, "berlin")).available == 4
    assert await service.invariant_violations() == []


async def test_a_cart_limit_refuses_in_shadow_and_primary_modes(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """A cart over pgreserve's per-cart limit takes no hold in either store in shadow or
    primary mode (Redis knows no limits: its hold in shadow is given back), and the refusal
    is replayed for its key."""
    for mode in (Mode.SHADOW, Mode.PRIMARY):
        sku = f"cap-{mode.value}"
        await seed(service, store, tenant.id, sku, 5)
        await service.set_cart_limit(tenant.id, sku, 1)
        await set_mode(db, tenant.id, mode, "test")
        cart = [(sku, "berlin", 2)]
        out = await rollout.reserve(tenant.id, f"k-{mode.value}", cart, ttl=60)
        assert not out.held and out.reason == "cart_limit_exceeded", mode
        assert await store.available(tenant.id, sku, "berlin") == 5
        assert await store.held(tenant.id, sku, "berlin") == 0
        again = await rollout.reserve(tenant.id, f"k-{mode.value}", cart, ttl=60)
        assert again.replayed and again.reason == "cart_limit_exceeded", mode
        assert (await rollout.reserve(tenant.id, f"k2-{mode.value}", [(sku, "berlin", 1)],
                                      ttl=60)).held, mode
        assert await store.available(tenant.id, sku, "berlin") == 4
    assert await service.invariant_violations() == []


async def test_shadow_mode_pgreserve_failure_is_recorded_not_returned(
        rollout: Rollout, store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """In shadow mode an error of pgreserve (a bucket it does not know) leaves Redis's answer
    to the caller and is recorded as a disagreement."""
    await store.set_stock(tenant.id, "only-redis", "x", 2)
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    out = await rollout.reserve(tenant.id, "k1", [("only-redis", "x", 1)], ttl=60)
    assert out.held
    await rollout.recorder.flush()
    _, latest = await reports.report(db, tenant.id)
    assert latest[0].request_key == "k1" and latest[0].pgreserve["error"] == "unknown_stock"


async def test_the_comparison_writer_is_not_bound_by_the_deadline_of_a_request(
        db: Database, tenant: Tenant) -> None:
    """A comparison recorded inside a request with a short deadline is still written after
    that deadline has passed (the background writer runs under no request's deadline)."""
    recorder = Recorder(db, RolloutMetrics(), flush_every_s=0.1)
    try:
        with deadline(0.05):  # as the HTTP layer sets one per request
            recorder.add(Comparison(tenant.id, "shadow", "reserve", "k1", {"held": True},
                                    {"held": True}, 1.0, 1.0))
        written = 0
        for _ in range(100):  # the writer flushes every 0.1 s; wait up to 5 s for it
            await asyncio.sleep(0.05)
            rows = await db.fetch("SELECT count(*) FROM rollout_comparison "
                                  "WHERE tenant_id = %s", (tenant.id,))
            written = int(rows[0][0])
            if written:
                break
        assert written == 1
    finally:
        await recorder.aclose()


async def test_comparisons_not_written_at_shutdown_are_said_and_counted(
        dsn: str, tenant: Tenant, caplog: pytest.LogCaptureFixture) -> None:
    """The recorder's last flush at shutdown fails (the database is gone): the
    comparisons it held are counted as dropped (metric and `dropped`), and an error
    names how many were writes Redis missed, which `rollout set ... legacy` will not
    see. Before, that failure was suppressed without a word."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    db = Database(dsn, max_size=2)
    await db.open()
    recorder = Recorder(db, RolloutMetrics(registry), flush_every_s=60)
    recorder.add(Comparison(tenant.id, "primary", "reserve", "k1",
                            {"error": "outcome_unknown"}, {"held": True}, 1.0, 1.0))
    recorder.add(Comparison(tenant.id, "primary", "reserve", "k2", {"held": True},
                            {"held": True}, 1.0, 1.0))
    await db.close()
    with caplog.at_level(logging.ERROR, logger="pgreserve.rollout.comparison"):
        await recorder.aclose()
    assert recorder.dropped == 2
    assert registry.get_sample_value("pgreserve_rollout_comparisons_dropped_total") == 2
    [said] = [r.getMessage() for r in caplog.records if "not written at shutdown" in
              r.getMessage()]
    assert "2 comparisons" in said and "1 of them writes Redis missed" in said, said


# -- the command line and the API -----------------------------------------------------

async def test_rollout_cli_sets_modes_with_who_and_plans_smallest_first(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """`rollout set` records who switched; `status` shows it; `plan` lists tenants from the
    smallest traffic to the largest with mode and agreement."""
    big = await service.create_tenant("big")
    small = await service.create_tenant("small")

    def cli(*args: str) -> str:
        return subprocess.run([str(BIN), "rollout", *args, "--database-url", db.conninfo],
                              capture_output=True, text=True, check=True).stdout

    assert "pgreserve -> shadow (by alice)" in cli("set", "big", "shadow", "--by", "alice")
    cli("set", "small", "shadow", "--by", "bob")
    for t, n in ((big, 6), (small, 2)):
        await seed(service, store, t.id, "s", 10, location="x")
        for i in range(n):
            await rollout.reserve(t.id, f"k{i}", [("s", "x", 1)], ttl=60)
    await rollout.recorder.flush()
    status = {r["tenant"]: r for r in json.loads(cli("status", "--json"))}
    assert status["big"]["mode"] == "shadow" and status["big"]["changed_by"] == "alice"
    assert status["small"]["changed_by"] == "bob"
    plan = [r for r in json.loads(cli("plan", "--json")) if r["tenant"] in ("big", "small")]
    assert [(r["tenant"], r["traffic"], r["agreement"]) for r in plan] == \
        [("small", 2, 1.0), ("big", 6, 1.0)]
    changes = await db.fetch("SELECT to_mode, changed_by FROM rollout_mode_change "
                             "WHERE tenant_id = %s", (big.id,))
    assert changes == [("shadow", "alice")]
    bad = await run(str(BIN), "rollout", "set", "big", "sideways", "--database-url",
                    db.conninfo, check=False)
    assert bad.returncode != 0 and "sideways" in bad.stderr
    with pytest.raises(errors.UnknownTenant):
        await set_mode(db, 10_000, Mode.SHADOW, "test")
    with pytest.raises(errors.InvalidRequest):
        await set_mode(db, big.id, "sideways", "test")


async def test_rollout_cli_reads_the_database_of_the_settings_file(
        service: ReservationService, db: Database, tmp_path: Path) -> None:
    """`rollout` commands take `--config FILE` and PGRESERVE_CONFIG like the other
    commands of the service's database: its `database_url` is the database they use."""
    await service.create_tenant("configured")
    config = tmp_path / "pgreserve.toml"
    config.write_text(f"database_url = {json.dumps(db.conninfo)}\nport = 8001\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGRESERVE_")}
    flag = await asyncio.to_thread(
        subprocess.run, [str(BIN), "rollout", "status", "--json", "--config", str(config)],
        capture_output=True, text=True, env=env)
    assert flag.returncode == 0, flag.stderr
    assert "configured" in {r["tenant"] for r in json.loads(flag.stdout)}
    by_env = await asyncio.to_thread(
        subprocess.run, [str(BIN), "rollout", "set", "configured", "shadow", "--by", "ops"],
        capture_output=True, text=True, env={**env, "PGRESERVE_CONFIG": str(config)})
    assert by_env.returncode == 0, by_env.stderr
    modes = await db.fetch("SELECT to_mode, changed_by FROM rollout_mode_change "
                           "JOIN tenant USING (tenant_id) WHERE tenant.name = 'configured'")
    assert modes == [("shadow", "ops")]


async def test_rehearsal_runs_a_shadow_sale_on_a_scratch_tenant(
        service: ReservationService, redis_server: RedisServer, db: Database) -> None:
    """`rollout rehearse` sells out a scratch tenant in shadow mode; both stores agree on
    every request and the report has its latencies."""
    from pgreserve.rollout.rehearsal import rehearse

    done = await rehearse(service, redis_server.url, buyers=24, stock=16, seed=3)
    assert done.held == 16 and done.tenant.name.startswith("rehearsal-")
    summary, latest = await reports.report(db, done.tenant.id)
    assert latest == [] and summary[0].agreement == 1.0
    assert summary[0].compared == 24 + 16
    assert summary[0].legacy_p99_ms is not None and summary[0].pgreserve_p99_ms is not None


async def test_http_api_serves_legacy_mode_behind_the_same_endpoints(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """With the rollout layer, PUT /v1/stock counts both stores, and POST /v1/reservations
    and /claim of a tenant in legacy mode are answered by Redis and write no reservation
    to pgreserve."""

    created, key = await service.create_tenant_with_key("shop")
    await set_mode(db, created.id, Mode.LEGACY, "test")
    app = create_app(database=db, rollout=rollout)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        counted = await client.put("/v1/stock/berlin/tee", json={"on_hand": 2})
        assert counted.status_code == 201  # the count created the line
        received = await client.post("/v1/stock/berlin/tee/adjustments", json={"delta": 1},
                                     headers={"Idempotency-Key": "receipt-1"})
        again = await client.post("/v1/stock/berlin/tee/adjustments", json={"delta": 1},
                                  headers={"Idempotency-Key": "receipt-1"})
        assert received.status_code == again.status_code == 200
        assert await store.available(created.id, "tee", "berlin") == 3
        made = await client.post("/v1/reservations", headers={"Idempotency-Key": "c-1"},
                                 json={"lines": [{"sku": "tee", "location": "berlin",
                                                  "quantity": 3}], "ttl_seconds": 60})
        assert made.status_code == 201
        short = await client.post("/v1/reservations", headers={"Idempotency-Key": "c-2"},
                                  json={"lines": [{"sku": "tee", "location": "berlin",
                                                   "quantity": 1}]})
        assert short.status_code == 409
        done = await client.post(f"/v1/reservations/{made.json()['id']}/claim")
        assert done.status_code == 200 and done.json()["status"] == "claimed"
        seen = await client.get(f"/v1/reservations/{made.json()['id']}")
        assert seen.status_code == 200 and seen.json()["status"] == "claimed"
    rows = await db.fetch("SELECT count(*) FROM reservation WHERE tenant_id = %s", (created.id,))
    assert rows[0][0] == 0
    assert await store.available(created.id, "tee", "berlin") == 0


# -- the crash gap ---------------------------------------------------------------------

CRASH = """
import asyncio, os, sys
from pgreserve.core.service import ReservationService
from pgreserve.db.database import Database
from pgreserve.rollout import RedisHoldStore, Rollout

async def main(dsn, url, ns, tenant, hold, ledger_first):
    async with Database(dsn, max_size=2) as db:
        r = Rollout(ReservationService(db), RedisHoldStore(url, namespace=ns))
        record = await r.store.record(tenant, hold)
        async def crash():
            os._exit(17)
        await r.legacy_finish("claim", tenant, record, ledger_first=ledger_first, between=crash)

dsn, url, ns, tenant, hold, first = sys.argv[1:]
asyncio.run(main(dsn, url, ns, int(tenant), hold, first == "ledger_first"))
"""


@pytest.mark.parametrize("order", ["redis_first", "ledger_first"])
async def test_legacy_claim_crash_gap_undersells_or_oversells(
        order: str, rollout: Rollout, store: RedisHoldStore, tenant: Tenant,
        db: Database) -> None:
    """A process crash between the Redis claim and the ledger write loses units (Redis
    first) or sells them twice (ledger first): the legacy design's crash gap."""
    await store.set_stock(tenant.id, "tee", "berlin", 1)
    await set_mode(db, tenant.id, Mode.LEGACY, "test")
    held = await rollout.reserve(tenant.id, "first", [("tee", "berlin", 1)], ttl=4)
    assert held.reservation is not None
    proc = await run(sys.executable, "-c", CRASH, db.conninfo, store.url, store.namespace,
                     str(tenant.id), held.reservation.id, order, check=False)
    assert proc.returncode == 17, proc.stderr
    await asyncio.sleep(max(0.0, (held.reservation.expires_at - datetime.now(UTC)).total_seconds()) + 0.2)
    await store.expire_due(tenant.id)
    sold = int((await db.fetch("SELECT count(*) FROM rollout_legacy_sale WHERE tenant_id = %s",
                               (tenant.id,)))[0][0])
    available = await store.available(tenant.id, "tee", "berlin")
    if order == "redis_first":
        assert (sold, available) == (0, 0)  # one unit neither sold nor for sale: undersold
        return
    assert (sold, available) == (1, 1)  # sold, and for sale again
    again = await rollout.reserve(tenant.id, "second", [("tee", "berlin", 1)], ttl=60)
    assert again.reservation is not None
    await rollout.claim(tenant.id, again.reservation.id)
    sold = int((await db.fetch("SELECT count(*) FROM rollout_legacy_sale WHERE tenant_id = %s",
                               (tenant.id,)))[0][0])
    assert sold == 2  # two sales of the one unit there was: oversold


PG_CLAIM = """
import asyncio, sys
from pgreserve.core.service import ReservationService
from pgreserve.db.database import Database

async def main(dsn, tenant, rid):
    async with Database(dsn, max_size=1, application_name="pgreserve:crashing") as db:
        await ReservationService(db, batching=False).claim(tenant, rid)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


def kill_claim_in_its_transaction(dsn: str, tenant: int, rid: str) -> None:
    """Start a claim in another process, wait until it waits on the bucket lock inside its
    transaction, then kill the process and its backend."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM stock_bucket WHERE tenant_id = %s FOR UPDATE",
                        (tenant,))
        proc = subprocess.Popen([sys.executable, "-c", PG_CLAIM, dsn, str(tenant),
                                 rid])
        with psycopg.connect(dsn, autocommit=True) as watcher:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                waiting = watcher.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = "
                    "'pgreserve:crashing' AND wait_event_type = 'Lock'").fetchall()
                if waiting:
                    break
                time.sleep(0.05)
            assert waiting, "the claim never reached the bucket lock"
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            watcher.execute("SELECT pg_terminate_backend(%s)", (waiting[0][0],))
        blocker.rollback()


async def test_pgreserve_claim_is_one_transaction_with_no_crash_gap(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """A claimer killed inside its transaction leaves the hold untouched and no sale; the
    retried claim sells the unit once: no unit is lost or sold twice."""
    await service.set_stock(tenant.id, "tee", "berlin", 1)
    out = await service.reserve(tenant.id, "k", [("tee", "berlin", 1)], ttl=60)
    assert out.reservation is not None
    await asyncio.to_thread(kill_claim_in_its_transaction, dsn, tenant.id, out.reservation.id)
    found = await service.get_reservation(tenant.id, out.reservation.id)
    assert found.status is Status.ACTIVE
    view = await service.get_stock(tenant.id, "tee", "berlin")
    assert (view.on_hand, view.reserved) == (1, 1)
    assert (await service.claim(tenant.id, out.reservation.id)).status is Status.CLAIMED
    view = await service.get_stock(tenant.id, "tee", "berlin")
    assert (view.on_hand, view.available) == (0, 0)
    assert await service.invariant_violations() == []


def test_up_with_a_legacy_store_serves_a_legacy_tenant_from_redis(
        redis_server: RedisServer) -> None:
    """`pgreserve up` with PGRESERVE_LEGACY_REDIS_URL serves a tenant switched to legacy
    from Redis (the switch seen without a restart) and gives expired Redis holds back."""
    import shutil
    import tempfile

    from test_cli import clean_env, running_up
    from test_cli_up import free_port

    root = Path(tempfile.mkdtemp(prefix="pgr-"))
    data = str(root / "data")
    port = free_port()
    env = clean_env(PGRESERVE_LEGACY_REDIS_URL=redis_server.url)

    def cli(*args: str) -> str:
        return subprocess.run([str(BIN), *args, "--data-dir", data], capture_output=True,
                              text=True, env=env, timeout=120, check=True).stdout

    try:
        with running_up("--data-dir", data, "--port", str(port), env=env):
            key = json.loads(cli("tenant", "create", "shop", "--json"))["api_key"]
            cli("rollout", "set", "shop", "legacy", "--by", "ops")
            tenant_id = next(r["tenant_id"] for r in json.loads(cli("rollout", "status", "--json"))
                             if r["tenant"] == "shop")
            counter = RedisHoldStore(redis_server.url).counter_key(tenant_id, "tee", "wh")
            redis = redis_server.client()
            time.sleep(1.5)  # the API process reads a tenant's mode at most once a second
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                              headers={"Authorization": f"Bearer {key}"}) as client:
                assert client.put("/v1/stock/wh/tee", json={"on_hand": 4}).status_code == 201
                assert int(redis.get(counter) or 0) == 4
                made = client.post("/v1/reservations", headers={"Idempotency-Key": "o-1"},
                                   json={"lines": [{"sku": "tee", "location": "wh", "quantity": 3}],
                                         "ttl_seconds": 1})
                assert made.status_code == 201
                assert int(redis.get(counter) or 0) == 1
                deadline = time.monotonic() + 30
                while int(redis.get(counter) or 0) != 4 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert int(redis.get(counter) or 0) == 4  # the expired hold was given back
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_primary_replay_keeps_the_hold_the_caller_was_told_when_redis_was_down(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In primary mode a reserve first answered by pgreserve alone (Redis down) replays as
    the same hold once Redis is back, even if Redis would now refuse it: the stored answer
    never changes and the caller's hold is not given back behind its back."""
    await seed(service, store, tenant.id, "a", 1, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    async with redis_down(rollout):
        first = await rollout.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
    assert first.held and first.reservation is not None
    await store.adjust_stock(tenant.id, "a", "x", -1)  # Redis now has no unit for it
    # every retry, not only the first one Redis sees (which Redis stores as refused)
    for _ in range(3):
        again = await rollout.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
        assert again.replayed and again.held and again.reservation is not None
        assert again.reservation.id == first.reservation.id
    assert (await service.get_reservation(tenant.id, first.reservation.id)).status is \
        Status.ACTIVE
    done = await rollout.claim(tenant.id, first.reservation.id)
    assert done.status is Status.CLAIMED
    assert await pg_sold(db, tenant.id, "a") == 1
    assert await service.invariant_violations() == []


async def test_a_cancelled_waiter_does_not_free_a_bucket_another_request_holds() -> None:
    """A request cancelled while waiting for a bucket's turn (its deadline, a dropped
    client) leaves the bucket held by the request inside it: the next one still waits."""
    from pgreserve.domain import Line
    from pgreserve.rollout.router import BucketLocks

    locks = BucketLocks()
    cart = [Line("a", "x", 1)]
    inside = asyncio.Event()
    leave = asyncio.Event()
    order: list[str] = []

    async def first() -> None:
        async with locks.hold(1, cart):
            order.append("first in")
            inside.set()
            await leave.wait()
            order.append("first out")

    async def later(name: str) -> None:
        async with locks.hold(1, cart):
            order.append(f"{name} in")

    a = asyncio.create_task(first())
    await inside.wait()
    b = asyncio.create_task(later("cancelled"))
    await asyncio.sleep(0.01)
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    c = asyncio.create_task(later("third"))
    await asyncio.sleep(0.01)
    leave.set()
    await asyncio.gather(a, c)
    assert order == ["first in", "first out", "third in"]
    assert locks._locks == {}


async def test_rollout_cli_bad_input_gives_a_message_not_a_traceback(db: Database) -> None:
    """`rollout rehearse` with a URL that is not a redis:// URL, and `rollout set` with an
    empty --by, exit non-zero with a message naming the problem and no traceback."""
    for args, said in ((("rehearse", "--legacy-redis-url", "not-a-url", "--buyers", "2"),
                        "redis"),
                       (("set", "nobody-here", "shadow"), "nobody-here"),
                       (("report", "--tenant", "nobody-here"), "nobody-here")):
        bad = await run(str(BIN), "rollout", *args, "--database-url", db.conninfo,
                        check=False)
        assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
        assert said in bad.stderr.lower()


async def test_rehearse_with_a_redis_that_does_not_answer_makes_no_tenant(
        db: Database) -> None:
    """`rollout rehearse` whose Redis does not answer (nothing listens on its port) exits 1
    with a message, and leaves no scratch tenant (nor its stock) behind."""
    async def tenants() -> int:
        rows = await db.fetch("SELECT count(*) FROM tenant", ())
        return int(rows[0][0])

    before = await tenants()
    port = free_port()  # nothing listens there
    bad = await run(str(BIN), "rollout", "rehearse", "--legacy-redis-url",
                    f"redis://127.0.0.1:{port}/0", "--buyers", "2",
                    "--database-url", db.conninfo, check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "did not answer" in bad.stderr and "no tenant was made" in bad.stderr
    assert await tenants() == before


async def test_shadow_claim_of_a_hold_redis_expired_sells_nothing_in_pgreserve(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In shadow mode a claim that Redis answers 'expired' (its TTL ran out first) gives
    the units back in both stores: pgreserve does not sell what the caller was told expired."""
    await seed(service, store, tenant.id, "a", 3, "x")
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    out = await rollout.reserve(tenant.id, "k", [("a", "x", 2)], ttl=60)
    assert out.held and out.reservation is not None
    rid = out.reservation.id
    await store.redis.pexpire(store.key(tenant.id, "hold", rid), 1)  # Redis's TTL runs out
    await asyncio.sleep(0.05)
    with pytest.raises(errors.ReservationExpired):
        await rollout.claim(tenant.id, rid)
    assert await store.available(tenant.id, "a", "x") == 3
    record = await store.record(tenant.id, rid)
    assert record is not None and record.pg_id is not None
    assert (await service.get_reservation(tenant.id, record.pg_id)).status is not \
        Status.CLAIMED
    assert await pg_sold(db, tenant.id, "a") == 0
    view = await service.get_stock(tenant.id, "a", "x")
    assert view.on_hand == view.available == 3
    assert await service.invariant_violations() == []


async def test_primary_claim_of_a_hold_redis_expired_first_stays_sold_in_redis(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In primary mode a claim pgreserve made stands in Redis even if Redis's TTL ran out
    first (expired by the sweep or not yet), so its counter does not offer sold units again."""
    await seed(service, store, tenant.id, "a", 5, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    rids = []
    for key in ("k1", "k2"):
        out = await rollout.reserve(tenant.id, key, [("a", "x", 2)], ttl=60)
        assert out.held and out.reservation is not None
        rids.append(out.reservation.id)
        await store.redis.pexpire(store.key(tenant.id, "hold", out.reservation.id), 1)
    await asyncio.sleep(0.05)
    await store.redis.zadd(store.key(tenant.id, "deadlines"), {rids[0]: 0})  # due now
    assert await store.expire_due(tenant.id) == 1  # the first given back by the sweep
    assert await store.available(tenant.id, "a", "x") == 3
    for rid in rids:
        assert (await rollout.claim(tenant.id, rid)).status is Status.CLAIMED
    assert await pg_sold(db, tenant.id, "a") == 4
    assert await store.available(tenant.id, "a", "x") == 1
    assert await store.held(tenant.id, "a", "x") == 0
    for rid in rids:
        record = await store.record(tenant.id, rid)
        assert record is not None and record.status == "claimed"


async def test_legacy_expiry_racing_claims_and_releases_counts_every_unit_once(
        patient_store: RedisHoldStore, tenant: Tenant) -> None:
    """Holds whose TTL runs out while claims, releases and the expiry sweep arrive at the
    same moment (120 calls at once, more than the store's connections) each end once:
    counter + held units + claimed units is the stock."""
    store = patient_store
    from datetime import timedelta

    from pgreserve import validation as check

    await store.set_stock(tenant.id, "a", "x", 200)
    cart = check.cart([("a", "x", 2)])
    rids = []
    for i in range(60):
        out = await store.reserve(tenant.id, f"k{i}", f"fp{i}", cart,
                                  timedelta(milliseconds=150 + (i % 20) * 10))
        assert out.reservation is not None
        rids.append(out.reservation.id)
    claimed: set[str] = set()
    stop = asyncio.Event()

    async def sweep() -> None:
        while not stop.is_set():
            await store.expire_due(tenant.id)
            await asyncio.sleep(0)

    async def finish(i: int, rid: str) -> None:
        await asyncio.sleep((i % 25) * 0.015)
        try:
            if i % 2:
                await store.claim(tenant.id, rid)
                claimed.add(rid)
            else:
                await store.release(tenant.id, rid)
        except errors.ReservationExpired:
            pass

    sweeper = asyncio.create_task(sweep())
    await asyncio.gather(*(finish(i, rid) for i, rid in enumerate(rids)),
                         *(finish(i, rid) for i, rid in enumerate(rids)))
    await asyncio.sleep(0.1)
    stop.set()
    await sweeper
    await store.expire_due(tenant.id)
    statuses = [(await store.record(tenant.id, rid)) for rid in rids]
    assert all(r is not None and r.status != "held" for r in statuses)
    sold = sum(2 for r in statuses if r is not None and r.status == "claimed")
    assert sold == 2 * len(claimed) and len(claimed) <= 30
    assert await store.held(tenant.id, "a", "x") == 0
    assert await store.available(tenant.id, "a", "x") == 200 - sold


async def test_an_adjustment_retried_after_redis_did_not_answer_moves_redis_once(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In legacy mode an adjustment whose Redis write did not answer is OutcomeUnknown
    (pgreserve has applied it); its retry with the same key replays pgreserve's answer
    and moves the Redis counter then, once: further retries leave both stores alone."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.LEGACY, "test")
    async with redis_down(rollout):
        with pytest.raises(errors.OutcomeUnknown):
            await rollout.adjust_stock(tenant.id, "adj-1", "a", "x", 5, reason="receipt")
    assert await store.available(tenant.id, "a", "x") == 10  # Redis never saw it
    for _ in range(2):
        again = await rollout.adjust_stock(tenant.id, "adj-1", "a", "x", 5, reason="receipt")
        assert again.replayed and again.on_hand == 15
        assert await store.available(tenant.id, "a", "x") == 15
    other = await rollout.adjust_stock(tenant.id, "adj-2", "a", "x", -2, reason="damaged")
    assert other.on_hand == 13 and await store.available(tenant.id, "a", "x") == 13


@pytest.mark.parametrize("mode", [Mode.SHADOW, Mode.PRIMARY])
async def test_a_claim_both_stores_refuse_as_released_or_expired_is_an_agreement(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, mode: Mode) -> None:
    """A claim of a reservation released in both stores is refused by both: the store that
    answers raises, the other gets a release in its stead, which finds it released; that
    is recorded as agreeing, not as a disagreement. A hold the other store still had
    active (its release did something) stays a disagreement."""
    await seed(service, store, tenant.id, "a", 5, "x")
    await set_mode(db, tenant.id, mode, "test")
    out = await rollout.reserve(tenant.id, "k1", [("a", "x", 1)], ttl=60)
    assert out.held and out.reservation is not None
    rid = out.reservation.id
    await rollout.release(tenant.id, rid)
    with pytest.raises(errors.ReservationReleased):
        await rollout.claim(tenant.id, rid, request_key="pay-1")
    await rollout.recorder.flush()
    summary, latest = await reports.report(db, tenant.id)
    assert summary[0].compared == summary[0].agreed == 3 and latest == []
    # the other store still holding it: a real disagreement
    held = await rollout.reserve(tenant.id, "k2", [("a", "x", 1)], ttl=60)
    assert held.reservation is not None
    if mode is Mode.SHADOW:  # Redis answers: release it in Redis only
        record = await store.record(tenant.id, held.reservation.id)
        assert record is not None
        await store.release(tenant.id, record.id)
    else:  # pgreserve answers: release it in pgreserve only
        await service.release(tenant.id, held.reservation.id)
    with pytest.raises(errors.ReservationReleased):
        await rollout.claim(tenant.id, held.reservation.id, request_key="pay-2")
    await rollout.recorder.flush()
    summary, latest = await reports.report(db, tenant.id)
    assert [d.request_key for d in latest] == ["pay-2"]
    assert (await service.get_stock(tenant.id, "a", "x")).available == 5
    assert await store.available(tenant.id, "a", "x") == 5


@pytest.mark.parametrize("claimed_in", [Mode.LEGACY, Mode.SHADOW])
async def test_a_legacy_holds_sale_leaves_pgreserve_s_count_so_the_ramp_cannot_oversell(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, claimed_in: Mode) -> None:
    """A hold taken in `legacy` (pgreserve never held it) and claimed in `legacy`, or
    after the switch to `shadow`: its sale takes its units out of pgreserve's count too,
    once, so that after `primary` and `pgreserve` no more than the count is sold. A
    shadow hold's claim, which pgreserve's twin sells itself, is not counted twice."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.LEGACY, "test")
    legacy = await rollout.reserve(tenant.id, "buyer-1", [("a", "x", 3)], ttl=60)
    assert legacy.reservation is not None
    await set_mode(db, tenant.id, claimed_in, "test")
    for _ in range(2):  # a repeated claim sells once
        assert (await rollout.claim(tenant.id, legacy.reservation.id)).status is Status.CLAIMED
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand, view.available) == (7, 7)
    assert await store.available(tenant.id, "a", "x") == 7
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    shadow = await rollout.reserve(tenant.id, "buyer-2", [("a", "x", 2)], ttl=60)
    assert shadow.reservation is not None
    assert (await rollout.claim(tenant.id, shadow.reservation.id)).status is Status.CLAIMED
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 5
    assert await store.available(tenant.id, "a", "x") == 5
    for mode in (Mode.PRIMARY, Mode.PGRESERVE):
        await set_mode(db, tenant.id, mode, "test")
    everything = await rollout.reserve(tenant.id, "buyer-3", [("a", "x", 6)], ttl=60)
    assert not everything.held  # 5 are left of the 10 counted
    rest = await rollout.reserve(tenant.id, "buyer-4", [("a", "x", 5)], ttl=60)
    assert rest.held and rest.reservation is not None
    await rollout.claim(tenant.id, rest.reservation.id)
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand, view.reserved, view.available) == (0, 0, 0)
    assert await service.invariant_violations() == []


async def test_going_back_from_primary_is_refused_while_redis_missed_writes(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In primary, a reserve and a count Redis did not answer are served by pgreserve and
    recorded as disagreements; going back to legacy (or shadow) is then refused, by the
    library and by `rollout set`, with what Redis missed, because Redis would sell the
    units pgreserve holds. `--force` switches (after a recount). Without a miss since the
    tenant entered primary, going back is one command, as before."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    assert await set_mode(db, tenant.id, Mode.LEGACY, "test") is Mode.PRIMARY  # no miss
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    async with redis_down(rollout):
        held = await rollout.reserve(tenant.id, "missed", [("a", "x", 4)], ttl=60)
        counted = await rollout.adjust_stock(tenant.id, "count-1", "a", "x", 1)
    assert held.held and counted.on_hand == 11
    await rollout.recorder.flush()
    _, latest = await reports.report(db, tenant.id)
    assert {d.request_key for d in latest} == {"missed", "count-1"}
    for mode in (Mode.LEGACY, Mode.SHADOW):
        with pytest.raises(errors.RedisMissedWrites, match="missed 2 write"):
            await set_mode(db, tenant.id, mode, "test")
    out = await run(str(BIN), "rollout", "set", "acme", "legacy", "--database-url",
                    db.conninfo, check=False)
    assert out.returncode == 1 and "Redis missed 2 write(s)" in out.stderr
    assert "Traceback" not in out.stderr
    forced = await run(str(BIN), "rollout", "set", "acme", "shadow", "--force",
                       "--database-url", db.conninfo)
    assert "primary -> shadow" in forced.stdout
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")  # misses before this are past
    assert await set_mode(db, tenant.id, Mode.LEGACY, "test") is Mode.PRIMARY


async def test_a_shadow_sale_whose_twin_pgreserve_let_go_leaves_pgreserve_s_count(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In shadow mode a reserve Redis did not answer (503) leaves no hold in pgreserve; its
    retry with the same key holds in Redis beside pgreserve's stored, released answer
    (no twin linked). And a linked twin may be gone from pgreserve when Redis sells the
    hold. Either way the sale leaves pgreserve's count, once, so both stores keep the
    same stock."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    async with redis_down(rollout):
        with pytest.raises(errors.OutcomeUnknown):
            await rollout.reserve(tenant.id, "k1", [("a", "x", 4)], ttl=60)
    again = await rollout.reserve(tenant.id, "k1", [("a", "x", 4)], ttl=60)
    assert again.held and again.reservation is not None
    for _ in range(2):
        assert (await rollout.claim(tenant.id, again.reservation.id)).status is Status.CLAIMED
    assert await store.available(tenant.id, "a", "x") == 6
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand, view.reserved, view.available) == (6, 0, 6)
    # a linked twin pgreserve no longer holds (here released behind the rollout's back)
    linked = await rollout.reserve(tenant.id, "k2", [("a", "x", 2)], ttl=60)
    assert linked.reservation is not None
    record = await store.record(tenant.id, linked.reservation.id)
    assert record is not None and record.pg_id is not None
    await service.release(tenant.id, record.pg_id)
    for _ in range(2):
        assert (await rollout.claim(tenant.id, linked.reservation.id)).status is \
            Status.CLAIMED
    assert await store.available(tenant.id, "a", "x") == 4
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand, view.reserved, view.available) == (4, 0, 4)
    assert await service.invariant_violations() == []


async def test_a_shadow_sale_leaves_pgreserve_s_count_once_whatever_its_twin_answered(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sold shadow hold's units leave pgreserve's count once: by its twin's claim,
    also when that claim's answer was lost after its commit (OutcomeUnknown) or was a
    Busy the caller's retry then sold; or, when the twin was released, by the legacy
    sale, once, also after the request keys are forgotten and the claim comes again."""
    from datetime import timedelta

    await seed(service, store, tenant.id, "a", 20, "x")
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    claim = service.claim

    async def lost_answer(*args: Any, **kwargs: Any) -> Any:
        await claim(*args, **kwargs)  # committed, then the answer is lost
        raise errors.OutcomeUnknown("the connection was lost after the commit")

    async def busy(*args: Any, **kwargs: Any) -> Any:
        raise errors.Busy("no connection was free")

    for failure in (lost_answer, busy):
        held = await rollout.reserve(tenant.id, f"k-{failure.__name__}", [("a", "x", 2)],
                                     ttl=60)
        assert held.reservation is not None
        monkeypatch.setattr(service, "claim", failure)
        assert (await rollout.claim(tenant.id, held.reservation.id)).status is \
            Status.CLAIMED
        monkeypatch.setattr(service, "claim", claim)
        assert (await rollout.claim(tenant.id, held.reservation.id)).status is \
            Status.CLAIMED  # the caller's retry
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 16
    released = await rollout.reserve(tenant.id, "k-released", [("a", "x", 2)], ttl=60)
    assert released.reservation is not None
    record = await store.record(tenant.id, released.reservation.id)
    assert record is not None and record.pg_id is not None
    await service.release(tenant.id, record.pg_id)
    await rollout.claim(tenant.id, released.reservation.id)
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 14
    assert await service.purge_request_keys(timedelta(0)) > 0
    await rollout.claim(tenant.id, released.reservation.id)
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 14
    assert await store.available(tenant.id, "a", "x") == 14
    assert await service.invariant_violations() == []


async def test_legacy_sale_lines_with_at_signs_each_leave_their_own_count(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """The correction of each line of a legacy sale has a key of its own, whatever the
    names: ("a@b", "c") and ("a", "b@c") in one hold both leave pgreserve's count."""
    await seed(service, store, tenant.id, "a@b", 10, "c")
    await seed(service, store, tenant.id, "a", 10, "b@c")
    await set_mode(db, tenant.id, Mode.LEGACY, "test")
    out = await rollout.reserve(tenant.id, "k", [("a@b", "c", 1), ("a", "b@c", 2)], ttl=60)
    assert out.held and out.reservation is not None
    await rollout.claim(tenant.id, out.reservation.id)
    one = await service.get_stock(tenant.id, "a@b", "c")
    two = await service.get_stock(tenant.id, "a", "b@c")
    assert (one.on_hand, two.on_hand) == (9, 8)


# -- what Redis mirrors while pgreserve answers (primary) and after ---------------------
# A hold named by any spelling of its id, a Redis that does not answer or refuses
# writes, a key retried across a mode switch, a shadow twin whose claim failed: Redis
# must not be left able to sell units pgreserve sold or holds, and going back to
# `legacy` must be refused while it missed a write.


def spellings(rid: str) -> list[str]:
    """Other spellings of a UUID that uuid.UUID (and so pgreserve) reads as the same."""
    return [rid.upper(), "{" + rid + "}", rid.replace("-", ""), "urn:uuid:" + rid]


@contextlib.contextmanager
def refusing_writes(redis_server: RedisServer) -> Iterator[None]:
    """Redis answers but refuses every write (maxmemory reached under noeviction)."""
    client = redis_server.client()
    old = (str(client.config_get("maxmemory")["maxmemory"]),
           str(client.config_get("maxmemory-policy")["maxmemory-policy"]))
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        yield
    finally:
        client.config_set("maxmemory", old[0])
        client.config_set("maxmemory-policy", old[1])


@pytest.mark.parametrize("action", ["claim", "release"])
async def test_a_primary_hold_named_by_another_spelling_of_its_id_finishes_in_both_stores(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, action: str) -> None:
    """In primary, a claim or release naming the hold by another spelling of its id
    (upper case, braces, no dashes, urn:uuid:) reaches Redis's record too: Redis's hold
    never outlives the sale and gives the sold units back."""
    await seed(service, store, tenant.id, "a", 20, "x")
    await set_mode(rollout.service.db, tenant.id, Mode.PRIMARY, "test")
    for n in range(4):
        out = await rollout.reserve(tenant.id, f"k{n}", [("a", "x", 2)], ttl=60)
        assert out.held and out.reservation is not None
        rid = out.reservation.id
        spelled = spellings(rid)[n]
        done = await getattr(rollout, action)(tenant.id, spelled)
        assert done.id == rid
        record = await store.record(tenant.id, rid)
        assert record is not None
        assert record.status == ("claimed" if action == "claim" else "released"), spelled
    assert await store.available(tenant.id, "a", "x") == \
        (await service.get_stock(tenant.id, "a", "x")).available


async def test_a_primary_sale_by_another_spelling_is_not_sold_again_after_going_back(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """5 units; 2 sold in primary by an upper-case id; Redis's hold reaches its expiry;
    after going back to legacy, Redis sells the 3 left, not 5."""
    await seed(service, store, tenant.id, "a", 5, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    out = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=1)
    assert out.held and out.reservation is not None
    await rollout.claim(tenant.id, out.reservation.id.upper())
    await asyncio.sleep(1.2)
    await rollout.expire_due()
    await rollout.recorder.flush()
    await set_mode(db, tenant.id, Mode.LEGACY, "test")
    assert not (await rollout.reserve(tenant.id, "k2", [("a", "x", 4)], ttl=60)).held
    assert (await rollout.reserve(tenant.id, "k3", [("a", "x", 3)], ttl=60)).held
    assert await pg_sold(db, tenant.id, "a") == 2


async def test_a_change_by_another_spelling_of_a_redis_hold_is_refused(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """A hold Redis keeps (taken in primary) cannot change, by any spelling of its id:
    ChangeNotMirrored, and neither store changes."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    out = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=60)
    assert out.held and out.reservation is not None
    rid = out.reservation.id
    for n, spelled in enumerate([rid, *spellings(rid)]):
        with pytest.raises(errors.ChangeNotMirrored):
            await rollout.change(tenant.id, spelled, [("a", "x", 7)], request_key=f"c{n}")
    pg = await service.get_reservation(tenant.id, rid)
    assert [x.quantity for x in pg.lines] == [2]
    record = await store.record(tenant.id, rid)
    assert record is not None and [x.quantity for x in record.lines] == [2]


async def test_a_primary_claim_while_redis_is_down_is_a_recorded_miss(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In primary, a claim served while Redis does not answer is pgreserve's, and the
    write Redis missed is recorded: going back to legacy is refused (RedisMissedWrites)
    until the tenant is in primary again with nothing missed."""
    await seed(service, store, tenant.id, "a", 5, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    out = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=60)
    assert out.held and out.reservation is not None
    async with redis_down(rollout):
        done = await rollout.claim(tenant.id, out.reservation.id, request_key="pay-1")
    assert done.status is Status.CLAIMED
    await rollout.recorder.flush()
    rows = await db.fetch("SELECT operation, request_key, agree, legacy_outcome ->> 'error'"
                          " FROM rollout_comparison WHERE tenant_id = %s"
                          " AND operation = 'claim'", (tenant.id,))
    assert rows == [("claim", "pay-1", False, "outcome_unknown")]
    with pytest.raises(errors.RedisMissedWrites):
        await set_mode(db, tenant.id, Mode.LEGACY, "test")


@pytest.mark.parametrize("mode", [Mode.PRIMARY, Mode.PGRESERVE])
async def test_finishing_a_hold_only_redis_has_while_redis_is_silent_is_busy(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, mode: Mode) -> None:
    """While Redis may keep older holds and does not answer, a claim of a hold only
    Redis has (taken in legacy) is Busy, not 404, and writes nothing; once Redis answers
    the same key claims it. A claim of pgreserve's own hold is served; in mode
    pgreserve, which writes nothing to Redis, it records no missed write."""
    old, own = await legacy_and_own_holds(rollout, service, store, tenant.id, db, mode)
    async with redis_down(rollout):
        with pytest.raises(errors.Busy, match="legacy store"):
            await rollout.claim(tenant.id, old.id, request_key="pay-0")
        done = await rollout.claim(tenant.id, own.id, request_key="pay-1")
    assert done.status is Status.CLAIMED
    await rollout.recorder.flush()
    rows = await db.fetch("SELECT request_key FROM rollout_comparison WHERE tenant_id = %s"
                          " AND operation = 'claim' ORDER BY request_key", (tenant.id,))
    assert rows == ([("pay-1",)] if mode is Mode.PRIMARY else [])
    record = await store.record(tenant.id, old.id)
    assert record is not None and record.status == "held"
    claimed = await rollout.claim(tenant.id, old.id, request_key="pay-0")
    assert claimed.status is Status.CLAIMED


async def test_a_redis_refusing_writes_is_a_miss_in_primary_and_503_in_legacy(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, redis_server: RedisServer) -> None:
    """A Redis that answers but refuses writes (out of memory under noeviction, a
    read-only replica after a failover) is a store that did not take the write: in
    primary a recorded miss that refuses going back; in legacy a typed, retryable 503
    (outcome_unknown), not a 500."""
    await seed(service, store, tenant.id, "a", 5, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    with refusing_writes(redis_server):
        held = await rollout.reserve(tenant.id, "k1", [("a", "x", 5)], ttl=60)
    assert held.held
    await rollout.recorder.flush()
    with pytest.raises(errors.RedisMissedWrites):
        await set_mode(db, tenant.id, Mode.LEGACY, "test")

    shop, key = await service.create_tenant_with_key("refused")
    await set_mode(db, shop.id, Mode.LEGACY, "test")
    app = create_app(database=db, rollout=rollout)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        assert (await client.put("/v1/stock/x/a", json={"on_hand": 5})).status_code == 201
        with refusing_writes(redis_server):
            made = await client.post(
                "/v1/reservations", headers={"Idempotency-Key": "c-1"},
                json={"lines": [{"sku": "a", "location": "x", "quantity": 2}]})
        assert made.status_code == 503, made.text
        assert made.json()["code"] == "outcome_unknown" and "Retry-After" in made.headers
        again = await client.post(
            "/v1/reservations", headers={"Idempotency-Key": "c-1"},
            json={"lines": [{"sku": "a", "location": "x", "quantity": 2}]})
        assert again.status_code == 201, again.text
    assert await store.available(shop.id, "a", "x") == 3


async def legacy_and_own_holds(rollout: Rollout, service: ReservationService,
                               store: RedisHoldStore, tenant: int, db: Database,
                               mode: Mode) -> tuple[Reservation, Reservation]:
    """A hold only Redis has (taken in legacy) and one taken in `mode`, reached from
    legacy through shadow and primary."""
    await seed(service, store, tenant, "a", 5, "x")
    await set_mode(db, tenant, Mode.LEGACY, "test")
    old = await rollout.reserve(tenant, "k0", [("a", "x", 1)], ttl=60)
    assert old.reservation is not None
    await set_mode(db, tenant, Mode.SHADOW, "test")
    await set_mode(db, tenant, Mode.PRIMARY, "test")
    await set_mode(db, tenant, mode, "test")
    own = await rollout.reserve(tenant, "k1", [("a", "x", 2)], ttl=60)
    assert own.held and own.reservation is not None
    return old.reservation, own.reservation


@pytest.mark.parametrize("mode", [Mode.PRIMARY, Mode.PGRESERVE])
async def test_reading_a_pgreserve_hold_needs_no_redis_once_pgreserve_answers(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, mode: Mode) -> None:
    """In primary, and in pgreserve while Redis may still hold older holds, a hold
    pgreserve has is read while Redis does not answer; one only Redis has (taken in
    legacy) is Busy then, not 404."""
    old, own = await legacy_and_own_holds(rollout, service, store, tenant.id, db, mode)
    async with redis_down(rollout):
        got = await rollout.get_reservation(tenant.id, own.id.upper())
        assert got.id == own.id and got.status is Status.ACTIVE
        with pytest.raises(errors.Busy):
            await rollout.get_reservation(tenant.id, old.id)


async def test_a_change_while_redis_may_hold_the_cart_and_does_not_answer_is_busy(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In the day after leaving primary, whether Redis keeps a hold is Redis's to say: a
    change while it does not answer is Busy (retryable) and changes nothing; once it
    answers, a hold taken in pgreserve mode changes."""
    await seed(service, store, tenant.id, "a", 5, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    out = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=60)
    assert out.held and out.reservation is not None
    async with redis_down(rollout):
        with pytest.raises(errors.Busy):
            await rollout.change(tenant.id, out.reservation.id, [("a", "x", 3)],
                                 request_key="c1")
    assert (await service.get_stock(tenant.id, "a", "x")).reserved == 2
    changed = await rollout.change(tenant.id, out.reservation.id, [("a", "x", 3)],
                                   request_key="c1")
    assert changed.held and (await service.get_stock(tenant.id, "a", "x")).reserved == 3


@pytest.mark.parametrize("failure", [errors.Busy, errors.OutcomeUnknown])
async def test_a_shadow_sale_whose_twin_claim_failed_leaves_pgreserve_s_count(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch,
        failure: type[errors.PgReserveError]) -> None:
    """Shadow: Redis sells a hold (the caller is answered claimed) while its pgreserve
    twin's claim fails without selling (Busy; or OutcomeUnknown, which did not commit):
    the twin is released and the sale leaves pgreserve's count, so both stores offer
    the same units after the twin's expiry would have passed."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    held = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=1)
    assert held.held and held.reservation is not None

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise failure("the twin's claim did not get through")

    with monkeypatch.context() as patch:
        patch.setattr(service, "claim", failing)
        assert (await rollout.claim(tenant.id, held.reservation.id)).status is Status.CLAIMED
    await asyncio.sleep(1.3)
    await service.expire_due()
    await rollout.expire_due()
    assert await store.available(tenant.id, "a", "x") == 8
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand, view.available, view.reserved) == (8, 8, 0)
    assert await service.invariant_violations() == []


async def test_a_shadow_twin_whose_failed_claim_did_sell_is_not_counted_twice(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin's claim committed but its answer was lost (OutcomeUnknown): the twin is
    claimed in pgreserve, so nothing more leaves pgreserve's count."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    held = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=60)
    assert held.held and held.reservation is not None
    claim = service.claim

    async def lost_answer(*args: Any, **kwargs: Any) -> Any:
        await claim(*args, **kwargs)
        raise errors.OutcomeUnknown("the connection was lost after the commit")

    with monkeypatch.context() as patch:
        patch.setattr(service, "claim", lost_answer)
        assert (await rollout.claim(tenant.id, held.reservation.id)).status is Status.CLAIMED
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand, view.available) == (8, 8)
    assert await store.available(tenant.id, "a", "x") == 8


@pytest.mark.parametrize(("first", "then"), [(Mode.LEGACY, Mode.SHADOW),
                                             (Mode.LEGACY, Mode.PRIMARY),
                                             (Mode.SHADOW, Mode.PRIMARY)])
async def test_a_key_retried_after_a_mode_switch_replays_its_first_hold(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, first: Mode, then: Mode) -> None:
    """A reserve held while Redis answered (legacy, shadow), retried with its key after
    the tenant moved on: the retry replays the first hold, pgreserve keeps no second
    one, and a claim of it sells once in each store."""
    await seed(service, store, tenant.id, "a", 10, "x")
    await set_mode(db, tenant.id, first, "test")
    one = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=60)
    assert one.held and one.reservation is not None
    if first is Mode.LEGACY and then is Mode.PRIMARY:
        await set_mode(db, tenant.id, Mode.SHADOW, "test")
    await set_mode(db, tenant.id, then, "test")
    again = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=60)
    assert again.held and again.reservation is not None
    assert again.reservation.id == one.reservation.id and again.replayed
    expect_pg_held = 2 if first is Mode.SHADOW else 0  # a shadow hold's twin
    assert (await service.get_stock(tenant.id, "a", "x")).reserved == expect_pg_held
    done = await rollout.claim(tenant.id, one.reservation.id)
    assert done.status is Status.CLAIMED
    assert await store.available(tenant.id, "a", "x") == 8
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand - view.reserved, view.available) == (8, 8)
    assert await service.invariant_violations() == []


async def test_http_claim_by_an_upper_case_id_reaches_redis_in_primary(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """Through the HTTP API: a 200 claim by an upper-case id is Redis's sale too."""
    created, key = await service.create_tenant_with_key("shop")
    await set_mode(db, created.id, Mode.PRIMARY, "test")
    app = create_app(database=db, rollout=rollout)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        assert (await client.put("/v1/stock/berlin/tee", json={"on_hand": 5})).status_code == 201
        made = await client.post("/v1/reservations", headers={"Idempotency-Key": "c-1"},
                                 json={"lines": [{"sku": "tee", "location": "berlin",
                                                  "quantity": 2}], "ttl_seconds": 60})
        assert made.status_code == 201
        rid = made.json()["id"]
        claimed = await client.post(f"/v1/reservations/{rid.upper()}/claim")
        assert claimed.status_code == 200 and claimed.json()["status"] == "claimed"
        assert claimed.json()["id"] == rid
    record = await store.record(created.id, rid)
    assert record is not None and record.status == "claimed"


@pytest.mark.parametrize("first", [Mode.LEGACY, Mode.SHADOW])
async def test_a_key_redis_answered_first_keeps_its_answer_through_the_move_to_pgreserve(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, first: Mode) -> None:
    """A key held (or refused) while Redis answered, retried in every later mode, up to
    pgreserve while Redis may still hold the tenant's holds: every retry replays the
    first answer, and pgreserve keeps no answer (no hold) of its own under that key."""
    await seed(service, store, tenant.id, "a", 3, "x")
    await set_mode(db, tenant.id, first, "test")
    one = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=600)
    short = await rollout.reserve(tenant.id, "k2", [("a", "x", 2)], ttl=600)
    assert one.held and one.reservation is not None and not short.held
    for then in [Mode.SHADOW, Mode.PRIMARY, Mode.PGRESERVE]:
        await set_mode(db, tenant.id, then, "test")
        again = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=600)
        assert again.reservation is not None and again.replayed, then
        assert again.reservation.id == one.reservation.id, then
        refused = await rollout.reserve(tenant.id, "k2", [("a", "x", 2)], ttl=600)
        assert not refused.held and refused.replayed, then
    ledger = await db.fetch("SELECT request_key FROM request_ledger WHERE tenant_id = %s"
                            " AND request_key IN ('k1', 'k2')", (tenant.id,))
    twins = 1 if first is Mode.SHADOW else 0  # a shadow hold's twin, and its refusal
    assert len(ledger) == 2 * twins
    done = await rollout.claim(tenant.id, one.reservation.id)
    assert done.status is Status.CLAIMED
    assert await store.available(tenant.id, "a", "x") == 1
    view = await service.get_stock(tenant.id, "a", "x")
    assert (view.on_hand - view.reserved, view.available) == (1, 1)
    assert await service.invariant_violations() == []


async def test_setting_primary_again_keeps_the_writes_redis_missed(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """`rollout set T primary` run again while T is in primary (a ramp script run twice,
    a second operator) changes nothing: the writes Redis missed still count from when T
    entered primary, and going back is still refused."""
    await seed(service, store, tenant.id, "a", 4, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "first")
    async with redis_down(rollout):
        held = await rollout.reserve(tenant.id, "k1", [("a", "x", 4)], ttl=600)
    assert held.held
    await rollout.recorder.flush()
    with pytest.raises(errors.RedisMissedWrites):
        await set_mode(db, tenant.id, Mode.LEGACY, "ops")
    assert await set_mode(db, tenant.id, Mode.PRIMARY, "again") is Mode.PRIMARY
    with pytest.raises(errors.RedisMissedWrites, match="missed 1 write"):
        await set_mode(db, tenant.id, Mode.LEGACY, "ops")
    rows = await db.fetch("SELECT changed_by FROM rollout_mode WHERE tenant_id = %s",
                          (tenant.id,))
    assert rows == [("first",)]  # the switch into primary, not the run that changed nothing


async def test_going_back_after_pgreserve_mode_is_refused_until_forced(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In pgreserve mode Redis is not written: going back to legacy or shadow from there,
    or from primary after a stay in pgreserve, is refused (Redis would sell what pgreserve
    sold or holds) until --force. A tenant that was never in pgreserve mode since Redis
    last answered for it goes back as before."""
    await seed(service, store, tenant.id, "a", 3, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "ops")
    await set_mode(db, tenant.id, Mode.PGRESERVE, "ops")
    out = await rollout.reserve(tenant.id, "k1", [("a", "x", 3)], ttl=600)
    assert out.held and out.reservation is not None
    await rollout.claim(tenant.id, out.reservation.id)
    for mode in (Mode.LEGACY, Mode.SHADOW):
        with pytest.raises(errors.RedisMissedWrites, match="pgreserve mode"):
            await set_mode(db, tenant.id, mode, "ops")
    assert await set_mode(db, tenant.id, Mode.PRIMARY, "ops") is Mode.PGRESERVE
    with pytest.raises(errors.RedisMissedWrites, match="pgreserve mode"):
        await set_mode(db, tenant.id, Mode.LEGACY, "ops")
    refused = await run(str(BIN), "rollout", "set", "acme", "legacy", "--database-url",
                        db.conninfo, check=False)
    assert refused.returncode == 1 and "pgreserve mode" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert await set_mode(db, tenant.id, Mode.LEGACY, "ops", force=True) is Mode.PRIMARY
    # forced back: the stay in pgreserve is behind the tenant now
    await set_mode(db, tenant.id, Mode.PRIMARY, "ops")
    assert await set_mode(db, tenant.id, Mode.SHADOW, "ops") is Mode.PRIMARY


async def test_a_primary_hold_finished_after_going_back_waits_for_redis(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, redis_server: RedisServer) -> None:
    """A hold taken in primary and claimed after the tenant went back to legacy, while
    Redis refuses writes: Redis answers the caller now, so the claim is
    `outcome_unknown` and pgreserve does not sell the hold either. Once the hold has
    expired in both stores, its units sell once."""
    await seed(service, store, tenant.id, "a", 2, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "ops")
    held = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=1)
    assert held.held and held.reservation is not None
    await set_mode(db, tenant.id, Mode.LEGACY, "ops")
    with refusing_writes(redis_server), pytest.raises(errors.OutcomeUnknown):
        await rollout.claim(tenant.id, held.reservation.id, request_key="pay")
    assert (await service.get_reservation(tenant.id, held.reservation.id)).status \
        is Status.ACTIVE
    await asyncio.sleep(1.5)
    await rollout.expire_due()
    await service.expire_due()
    with pytest.raises(errors.ReservationExpired):  # the retry the 503 asked for
        await rollout.claim(tenant.id, held.reservation.id, request_key="pay")
    again = await rollout.reserve(tenant.id, "k2", [("a", "x", 2)], ttl=60)
    assert again.held and again.reservation is not None
    await rollout.claim(tenant.id, again.reservation.id)
    assert await pg_sold(db, tenant.id, "a") == 0  # the first hold sold nowhere
    rows = await db.fetch("SELECT coalesce(sum(quantity), 0) FROM rollout_legacy_sale"
                          " WHERE tenant_id = %s", (tenant.id,))
    assert rows == [(2,)]
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 0


async def test_a_shadow_claim_redis_did_not_decide_leaves_the_twin_alone(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, redis_server: RedisServer) -> None:
    """In shadow a claim Redis refuses to write is `outcome_unknown`: pgreserve's twin
    stays active (it was claimed before, and kept that sale when the retry found the
    hold expired in Redis). The retry settles both: expired in Redis, expired in
    pgreserve, sold in neither."""
    await seed(service, store, tenant.id, "a", 2, "x")
    await set_mode(db, tenant.id, Mode.SHADOW, "ops")
    held = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=1)
    assert held.held and held.reservation is not None
    twin = await db.fetch("SELECT reservation_id FROM reservation WHERE tenant_id = %s",
                          (tenant.id,))
    assert len(twin) == 1
    with refusing_writes(redis_server), pytest.raises(errors.OutcomeUnknown):
        await rollout.claim(tenant.id, held.reservation.id, request_key="pay")
    assert (await service.get_reservation(tenant.id, twin[0][0])).status is Status.ACTIVE
    await asyncio.sleep(1.5)
    await rollout.expire_due()
    await service.expire_due()
    with pytest.raises(errors.ReservationExpired):
        await rollout.claim(tenant.id, held.reservation.id, request_key="pay")
    assert (await service.get_reservation(tenant.id, twin[0][0])).status is Status.EXPIRED
    assert await pg_sold(db, tenant.id, "a") == 0
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 2


async def test_a_write_redis_missed_is_kept_when_the_comparison_buffer_is_full(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """The comparison buffer drops rows when the database does not keep up, but never a
    write Redis missed: dropped, it would let the tenant go back to legacy."""
    await seed(service, store, tenant.id, "a", 4, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "ops")
    rollout.recorder.max_buffer = 0  # full
    ok = await rollout.reserve(tenant.id, "k0", [("a", "x", 1)], ttl=600)
    assert ok.held and rollout.recorder.dropped == 1  # a plain comparison is dropped
    async with redis_down(rollout):
        held = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=600)
    assert held.held and rollout.recorder.dropped == 1
    await rollout.recorder.flush()
    with pytest.raises(errors.RedisMissedWrites, match="missed 1 write"):
        await set_mode(db, tenant.id, Mode.LEGACY, "ops")


async def test_a_primary_hold_redis_lost_is_a_write_redis_missed(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, redis_server: RedisServer) -> None:
    """Redis restarted without its data while a tenant is in primary: a claim of a hold
    Redis no longer has is pgreserve's, recorded as a write Redis missed, and going back
    to legacy is refused (even after a recount: Redis would not know the claim)."""
    await seed(service, store, tenant.id, "a", 4, "x")
    await set_mode(db, tenant.id, Mode.PRIMARY, "ops")
    held = await rollout.reserve(tenant.id, "k1", [("a", "x", 2)], ttl=600)
    assert held.held and held.reservation is not None
    client = redis_server.client()
    lost = list(client.scan_iter(match=f"{store.namespace}:*", count=1000))
    assert lost
    client.delete(*lost)
    await rollout.set_stock(tenant.id, "a", "x", 4)  # the operator counts again
    done = await rollout.claim(tenant.id, held.reservation.id, request_key="pay")
    assert done.status is Status.CLAIMED
    await rollout.recorder.flush()
    with pytest.raises(errors.RedisMissedWrites, match=r"missed 1 write.*request key pay"):
        await set_mode(db, tenant.id, Mode.LEGACY, "ops")
    _, latest = await reports.report(db, tenant.id)
    assert [(d.operation, d.legacy["error"]) for d in latest] == [
        ("claim", "missing_in_redis")]


async def test_a_primary_refusal_over_a_pgreserve_hold_replays_refused_in_every_later_mode(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """In primary mode a cart Redis refuses is refused even where pgreserve held it. That
    refusal is the key's answer from then on: after the move to pgreserve, and after the
    24 hours Redis is still asked, a replay gives the same refusal, never the hold the
    caller was not told about; the lookup by key shows it, and the unit is free."""
    await service.set_stock(tenant.id, "a", "x", 1)
    await store.set_stock(tenant.id, "a", "x", 0)  # Redis's unit is held elsewhere
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    first = await rollout.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
    assert not first.held and first.short_lines[0].available == 0
    again = await rollout.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
    assert again.replayed and not again.held
    assert again.short_lines == first.short_lines

    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    moved = await rollout.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
    assert moved.replayed and not moved.held and moved.short_lines == first.short_lines
    await db.fetch("UPDATE rollout_mode SET redis_until = now() - interval '1 second' "
                   "WHERE tenant_id = %s RETURNING 1", (tenant.id,))
    later = await rollout.reserve(tenant.id, "k", [("a", "x", 1)], ttl=60)
    assert later.replayed and not later.held and later.short_lines == first.short_lines
    record = await service.lookup_request(tenant.id, "k")
    assert record.status == "rejected" and record.reservation is None
    assert record.outcome["status"] == "rejected"
    view = await service.get_stock(tenant.id, "a", "x")
    assert view.available == 1
    assert await service.invariant_violations() == []


# -- primary: a refusal over a pgreserve hold, across retries and processes ----------

CART = [("a", "x", 1)]


@pytest_asyncio.fixture
async def rollout_b(service: ReservationService,
                    store: RedisHoldStore) -> AsyncIterator[Rollout]:
    """A second process: same database and Redis namespace, its own bucket locks."""
    async with rollout_layer(service, store) as r:
        yield r


async def redis_refuses(service: ReservationService, store: RedisHoldStore,
                        tenant: int, db: Database) -> None:
    """pgreserve has the unit; Redis's unit is held elsewhere (a legacy process)."""
    await service.set_stock(tenant, "a", "x", 1)
    await store.set_stock(tenant, "a", "x", 0)
    await set_mode(db, tenant, Mode.PRIMARY, "test")


def gate(owner: Any, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """owner's async method `name` waits until `go` is set before it runs; `reached` is
    set when a call gets there."""
    reached, go = asyncio.Event(), asyncio.Event()
    real = getattr(owner, name)

    async def gated(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        await go.wait()
        return await real(*args, **kwargs)

    setattr(owner, name, gated)
    return reached, go


def gate_record(r: Rollout) -> tuple[asyncio.Event, asyncio.Event]:
    """r's pgreserve-side step after Redis refused (recording the refusal) waits."""
    return gate(r, "_record_refusal")


def gate_redis_reserve(r: Rollout) -> tuple[asyncio.Event, asyncio.Event]:
    """r's reserves in Redis wait."""
    return gate(r.store, "reserve_answer")


async def assert_same_active_hold(service: ReservationService, tenant: int,
                                  first: ReserveOutcome, *outs: ReserveOutcome) -> None:
    """Every outcome in `outs` is the hold `first` was told, and that hold is active."""
    assert first.held and first.reservation is not None
    for out in outs:
        assert out.held and out.reservation is not None
        assert out.reservation.id == first.reservation.id
    assert (await service.get_reservation(tenant, first.reservation.id)).status is \
        Status.ACTIVE


async def refusal_not_recorded(rollout: Rollout, service: ReservationService,
                               tenant: int) -> None:
    """A reserve of key k in primary whose refusal (Redis's, over pgreserve's hold) could
    not be recorded in pgreserve (the database did not answer): OutcomeUnknown."""
    real_fetch = service.db.fetch

    async def failing_fetch(sql: Any, params: Any = (), *, op: Any = None,
                            **options: Any) -> Any:
        if op is not None and op.action == "rollout_refusal_record":
            raise errors.DatabaseUnavailable("no connection free")
        return await real_fetch(sql, params, op=op, **options)

    service.db.fetch = failing_fetch  # type: ignore[method-assign]
    try:
        with pytest.raises(errors.OutcomeUnknown):
            await rollout.reserve(tenant, "k", CART, ttl=60)
    finally:
        service.db.fetch = real_fetch  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def primary_shop(service: ReservationService, rollout: Rollout, db: Database,
                       **app_options: Any) -> AsyncIterator[tuple[int, httpx.AsyncClient]]:
    """A tenant in primary mode with 1 unit of a at x in pgreserve (none in Redis yet),
    and an HTTP client of the app over `rollout` with the tenant's API key."""
    created, key = await service.create_tenant_with_key("shop")
    await set_mode(db, created.id, Mode.PRIMARY, "test")
    app = create_app(database=db, rollout=rollout, **app_options)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        assert (await client.put("/v1/stock/x/a", json={"on_hand": 1})).status_code == 201
        yield created.id, client


BODY = {"lines": [{"sku": "a", "location": "x", "quantity": 1}], "ttl_seconds": 60,
        "reference": "order-1", "metadata": {"m": "1"}}
KEYED = {"Idempotency-Key": "c-1"}


async def test_a_primary_refusal_whose_record_failed_is_still_replayed_as_the_refusal(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Primary: pgreserve held, Redis refused, and recording the refusal in pgreserve
    failed (the database did not answer). The refusal is not told before it is the
    key's answer: the caller gets OutcomeUnknown, and the retry the refusal, recorded
    then, in primary and after the move to pgreserve."""
    await redis_refuses(service, store, tenant.id, db)
    await refusal_not_recorded(rollout, service, tenant.id)
    again = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not again.held, f"replayed {again.held=}"
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    moved = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not moved.held and moved.short_lines == again.short_lines
    assert (await service.lookup_request(tenant.id, "k")).status == "rejected"
    assert (await service.get_stock(tenant.id, "a", "x")).available == 1


async def test_http_a_primary_refusal_told_after_the_deadline_replays_409(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """Through HTTP: Redis's refusal comes after the request's deadline (0.5 s), so
    the refusal cannot be recorded in pgreserve in that request, and it is not told:
    503 outcome_unknown. The retry, and the lookup by key, say 409."""
    slow = {"on": False}
    real_reserve = rollout.store.reserve_answer

    async def slow_reserve(*args: Any, **kwargs: Any) -> Any:
        out = await real_reserve(*args, **kwargs)
        if slow["on"]:
            await asyncio.sleep(0.6)
        return out

    rollout.store.reserve_answer = slow_reserve  # type: ignore[method-assign]
    async with primary_shop(service, rollout, db, request_deadline_s=0.5) as (tenant, client):
        await store.set_stock(tenant, "a", "x", 0)  # Redis's unit is held elsewhere
        slow["on"] = True
        first = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        slow["on"] = False
        assert first.status_code == 503, first.text
        assert first.json()["code"] == "outcome_unknown"
        again = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        looked = await client.get("/v1/requests/c-1")
        assert (again.status_code, looked.json()["status"]) == (409, 409), \
            f"retry {again.status_code} {again.text}; lookup {looked.text}"


async def test_two_processes_with_one_key_tell_the_same_refusal_in_primary(
        rollout: Rollout, rollout_b: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """Two processes (two Rollout objects, each its own bucket locks), one key: A's
    pgreserve holds H and Redis refuses; B's request of the key comes before A records
    the refusal in pgreserve. Both callers, and a later replay, get the refusal."""
    await redis_refuses(service, store, tenant.id, db)
    reached, go = gate_record(rollout)
    a = asyncio.create_task(rollout.reserve(tenant.id, "k", CART, ttl=60))
    await asyncio.wait_for(reached.wait(), 5)
    b = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    go.set()
    first = await a
    later = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    told_b = ("held", b.reservation.id) if b.held and b.reservation else ("refused", None)
    assert first.held == b.held == later.held, (
        f"A's caller: held={first.held}; B's caller: {told_b}; replay now: held={later.held}")


async def test_a_refusal_being_recorded_is_never_a_hold_another_process_can_claim(
        rollout: Rollout, rollout_b: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """As above: B's caller is refused too, so no caller holds H; once A has recorded
    the refusal, H is released (a claim of it by id is refused), nothing is sold in
    pgreserve that Redis refused, and the key keeps replaying the refusal."""
    await redis_refuses(service, store, tenant.id, db)
    reached, go = gate_record(rollout)
    a = asyncio.create_task(rollout.reserve(tenant.id, "k", CART, ttl=60))
    await asyncio.wait_for(reached.wait(), 5)
    b = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    assert not b.held and b.reservation is None
    go.set()
    first = await a
    assert not first.held
    rows = await db.fetch("SELECT reservation_id::text FROM reservation WHERE tenant_id = %s",
                          (tenant.id,))
    assert len(rows) == 1
    with pytest.raises(errors.ReservationReleased):
        await rollout_b.claim(tenant.id, rows[0][0])
    replay = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not replay.held and replay.short_lines == first.short_lines
    assert await pg_sold(db, tenant.id, "a") == 0
    assert (await service.get_stock(tenant.id, "a", "x")).available == 1
    assert await service.invariant_violations() == []


async def test_two_processes_with_one_key_tell_the_same_hold_when_a_retry_reaches_redis_first(
        rollout: Rollout, rollout_b: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """The other order: B's request of the key (a replay in pgreserve) reaches Redis
    before A's, and Redis refuses it; B's caller keeps pgreserve's hold (Redis first saw
    the key on a retry). A's Redis call then replays that refusal: A's caller gets the
    same hold, which stays active."""
    await redis_refuses(service, store, tenant.id, db)
    reached, go = gate_redis_reserve(rollout)
    a = asyncio.create_task(rollout.reserve(tenant.id, "k", CART, ttl=60))
    await asyncio.wait_for(reached.wait(), 5)
    b = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    go.set()
    first = await a
    assert b.held and first.held, f"A told held={first.held}, B told held={b.held}"
    await assert_same_active_hold(service, tenant.id, first, b)


async def test_http_a_primary_refusal_replays_the_same_409_in_primary_and_pgreserve(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """Through HTTP, with a reference and metadata: the refusal Redis gave over
    pgreserve's hold replays as the same 409 (marked replayed) in primary and after the
    move to pgreserve; the lookup by key shows it with no reservation; the unit is free."""
    async with primary_shop(service, rollout, db) as (tenant, client):
        await store.set_stock(tenant, "a", "x", 0)
        first = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        assert first.status_code == 409
        again = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        await set_mode(db, tenant, Mode.PGRESERVE, "test")
        moved = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        looked = (await client.get("/v1/requests/c-1")).json()
    for r in (again, moved):
        assert r.status_code == 409 and r.json() == first.json()
        assert r.headers.get("idempotent-replayed") == "true"
    assert looked["status"] == 409 and looked["answer"] == first.json()
    assert looked["reservation"] is None
    assert (await service.get_stock(tenant, "a", "x")).available == 1
    assert await service.invariant_violations() == []


async def test_http_a_hold_answered_while_redis_was_down_replays_the_same_201(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """Through HTTP: a hold pgreserve answered while Redis was down replays as the same
    201 (body and Location) on three retries Redis refuses, and after the move to
    pgreserve; the lookup by key shows it."""
    async with primary_shop(service, rollout, db) as (tenant, client):
        async with redis_down(rollout):
            first = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        assert first.status_code == 201
        await store.set_stock(tenant, "a", "x", 0)
        replies = [await client.post("/v1/reservations", headers=KEYED, json=BODY)
                   for _ in range(3)]
        await set_mode(db, tenant, Mode.PGRESERVE, "test")
        replies.append(await client.post("/v1/reservations", headers=KEYED, json=BODY))
        looked = (await client.get("/v1/requests/c-1")).json()
    for r in replies:
        assert r.status_code == 201 and r.json() == first.json()
        assert r.headers["location"] == first.headers["location"]
    assert looked["status"] == 201 and looked["answer"] == first.json()


async def test_redis_keeps_with_a_refusal_the_hold_it_was_given_over(
        store: RedisHoldStore, tenant: Tenant) -> None:
    """A refusal Redis keeps says the mode it was given in and the pgreserve hold it was
    given over ('' for none; None when stored before refusals kept it), and its replay
    says the same; a hold has no mark."""
    from datetime import timedelta

    from pgreserve.domain import Line
    from pgreserve.rollout.redis_store import RefusalMark

    await store.set_stock(tenant.id, "a", "x", 1)
    cart, life = [Line("a", "x", 2)], timedelta(seconds=60)
    hold = "11111111-1111-1111-1111-111111111111"
    for replay in (False, True):
        out, mark = await store.reserve_answer(tenant.id, "over", "fp", cart, life,
                                               mode="primary", over=hold)
        assert not out.held and out.replayed is replay
        assert mark == RefusalMark("primary", hold)
    _, mark = await store.reserve_answer(tenant.id, "none", "fp", cart, life, mode="shadow")
    assert mark == RefusalMark("shadow", "")
    out, mark = await store.reserve_answer(tenant.id, "held", "fp", [Line("a", "x", 1)], life)
    assert out.held and mark is None
    await store.redis.set(store.key(tenant.id, "req", "old"), json.dumps(
        {"held": False, "short": [[1, 2, 0]], "fp": "fp", "mode": "primary"}))
    out, mark = await store.reserve_answer(tenant.id, "old", "fp", cart, life, mode="primary")
    assert out.replayed and not out.held and mark == RefusalMark("primary", None)


async def busy_redis(store: RedisHoldStore, seconds: float) -> None:
    """Keep the real redis-server busy for `seconds` (a Lua loop on its own connection):
    a call from another client waits, its caller gives up after 1 s, and Redis runs the
    call afterwards (a slow Redis, not a down one)."""
    import redis.asyncio as aioredis

    c = aioredis.Redis.from_url(store.url, socket_timeout=seconds + 5)
    try:
        await c.eval("local t0 = redis.call('TIME'); local s0 = tonumber(t0[1]) * 1000000 + "
                     "tonumber(t0[2]); while true do local t = redis.call('TIME'); "
                     "if tonumber(t[1]) * 1000000 + tonumber(t[2]) - s0 > tonumber(ARGV[1]) "
                     "then break end end return 1", 0, int(seconds * 1_000_000))
    finally:
        await c.aclose()


def slow_redis_once(rollout: Rollout, store: RedisHoldStore) -> list[asyncio.Task[None]]:
    """The rollout's next reserve in Redis finds Redis busy for 1.6 s: its caller stops
    waiting after 1 s, and Redis runs it after that. The returned list gets the task
    that keeps Redis busy."""
    from pgreserve.rollout import redis_store

    real = rollout.store.reserve_answer
    busy: list[asyncio.Task[None]] = []

    async def reserve_answer(*args: Any, **kwargs: Any) -> Any:
        if not busy:
            # a running service has the script loaded: Redis runs the call late, as sent
            await store.redis.script_load(redis_store._RESERVE)
            busy.append(asyncio.create_task(busy_redis(store, 1.6)))
            await asyncio.sleep(0.1)
        return await real(*args, **kwargs)

    rollout.store.reserve_answer = reserve_answer  # type: ignore[method-assign]
    return busy


async def test_a_hold_told_while_redis_was_slow_stays_the_answer_when_redis_refused_late(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Primary: Redis is busy when the reserve reaches it, so the caller is told
    pgreserve's hold H; Redis runs the reserve afterwards and keeps a refusal over H.
    The hold stays the key's answer: retries in primary and after the move to pgreserve
    replay it, and it stays active."""
    await redis_refuses(service, store, tenant.id, db)
    busy = slow_redis_once(rollout, store)
    first = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    await busy[0]
    assert first.held and first.reservation is not None
    raw = await store.redis.get(store.key(tenant.id, "req", "k"))
    assert raw is not None and not json.loads(raw)["held"]  # Redis ran it late: refused
    again = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    moved = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    await assert_same_active_hold(service, tenant.id, first, again, moved)


async def test_http_a_201_told_while_redis_was_slow_replays_201(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """Through HTTP: Redis is busy when the reserve reaches it; the caller gets 201
    (pgreserve's hold). Redis then runs the reserve and keeps a refusal over that hold.
    The retry and the lookup by key say 201."""
    async with primary_shop(service, rollout, db) as (tenant, client):
        await store.set_stock(tenant, "a", "x", 0)
        busy = slow_redis_once(rollout, store)
        first = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        await busy[0]
        assert first.status_code == 201, first.text
        again = await client.post("/v1/reservations", headers=KEYED, json=BODY)
        looked = (await client.get("/v1/requests/c-1")).json()
    assert again.status_code == 201 and again.json() == first.json()
    assert looked["status"] == 201 and looked["answer"] == first.json()


async def test_a_refusal_whose_record_failed_is_the_answer_after_a_move_to_pgreserve(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Primary: Redis refused over pgreserve's hold and the record of the refusal failed
    (OutcomeUnknown). The tenant moves to pgreserve before any retry: the retry (Redis is
    still asked) gets the refusal, which pgreserve now keeps, and nothing is sold."""
    await redis_refuses(service, store, tenant.id, db)
    await refusal_not_recorded(rollout, service, tenant.id)
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    moved = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not moved.held and moved.short_lines[0].available == 0
    assert (await service.lookup_request(tenant.id, "k")).status == "rejected"
    assert (await service.get_stock(tenant.id, "a", "x")).available == 1


@pytest.mark.parametrize("later_mode", [Mode.PRIMARY, Mode.PGRESERVE])
async def test_a_purged_key_redis_still_refuses_is_refused_not_held_anew(
        later_mode: Mode, rollout: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """Primary: Redis refused over pgreserve's hold, recorded. pgreserve then forgets the
    key (its retention can be shorter than Redis's 24 h): the retry, in primary or after
    the move to pgreserve (Redis still asked), makes a new hold in pgreserve, Redis
    replays its refusal over the old one, and the caller is refused again; the new hold
    goes back and nothing is sold."""
    await redis_refuses(service, store, tenant.id, db)
    first = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not first.held
    await db.fetch("SELECT request_keys_purge_v1(interval '0 seconds', 1000)")
    await set_mode(db, tenant.id, later_mode, "test")
    again = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not again.held and again.short_lines == first.short_lines
    assert (await service.get_stock(tenant.id, "a", "x")).available == 1
    assert await pg_sold(db, tenant.id, "a") == 0


@pytest.mark.parametrize("first_mode", [Mode.LEGACY, Mode.SHADOW])
async def test_a_refusal_redis_gave_while_it_answered_stays_the_answer_in_primary(
        first_mode: Mode, rollout: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """Redis answered (legacy or shadow) and refused the cart. The tenant moves to
    primary, and the retry's first read of Redis's answer fails once, so pgreserve is
    asked; Redis's replayed refusal (given while it answered) is still the answer, and
    no pgreserve hold of the unit is left."""
    await service.set_stock(tenant.id, "a", "x", 1)
    await store.set_stock(tenant.id, "a", "x", 0)
    await set_mode(db, tenant.id, first_mode, "test")
    first = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not first.held
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    real = rollout.store.answered
    calls = itertools.count()

    async def answered(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 0:
            raise errors.OutcomeUnknown("the legacy Redis store did not answer (TimeoutError)")
        return await real(*args, **kwargs)

    rollout.store.answered = answered  # type: ignore[method-assign]
    again = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not again.held and again.short_lines == first.short_lines
    assert (await service.get_stock(tenant.id, "a", "x")).available == 1
    assert await service.invariant_violations() == []


async def test_http_a_refusal_of_several_lines_replays_the_same_409(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """Three lines, the middle one short in Redis only: the 409 replays the same in
    primary and after the move to pgreserve, and every line's stock is back."""
    body = {"lines": [{"sku": s, "location": "x", "quantity": 2} for s in ("c", "a", "b")],
            "ttl_seconds": 60}
    async with primary_shop(service, rollout, db) as (tenant, client):
        for s in ("a", "b", "c"):
            assert (await client.put(f"/v1/stock/x/{s}", json={"on_hand": 5})).status_code \
                in (200, 201)
            await store.set_stock(tenant, s, "x", 5)
        await store.set_stock(tenant, "b", "x", 1)
        first = await client.post("/v1/reservations", headers=KEYED, json=body)
        assert first.status_code == 409, first.text
        again = await client.post("/v1/reservations", headers=KEYED, json=body)
        await set_mode(db, tenant, Mode.PGRESERVE, "test")
        moved = await client.post("/v1/reservations", headers=KEYED, json=body)
    assert again.json() == first.json() == moved.json()
    assert (again.status_code, moved.status_code) == (409, 409)
    for s in ("a", "b", "c"):
        assert (await service.get_stock(tenant, s, "x")).available == 5


@pytest.mark.parametrize("paused", ["before Redis", "recording the refusal"])
async def test_a_request_in_pgreserve_mode_agrees_with_one_still_in_primary(
        paused: str, rollout: Rollout, rollout_b: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """A (primary) has pgreserve's hold H and is paused before it reaches Redis, or once
    Redis refused over H, before it records the refusal; the tenant moves to pgreserve
    and B, another process in the new mode, gets a request of the key. Before Redis: B
    finds no answer in Redis and is told H, marked as told first, so Redis's refusal
    does not replace it and both callers hold H. Recording: B finds Redis's refusal over
    H and both callers are refused."""
    await redis_refuses(service, store, tenant.id, db)
    reached, go = (gate_redis_reserve(rollout) if paused == "before Redis"
                   else gate_record(rollout))
    a = asyncio.create_task(rollout.reserve(tenant.id, "k", CART, ttl=60))
    await asyncio.wait_for(reached.wait(), 5)
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    b = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    go.set()
    first = await a
    later = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    held = paused == "before Redis"
    assert first.held == b.held == later.held == held
    if held:
        assert b.reservation is not None
        assert (await rollout_b.claim(tenant.id, b.reservation.id)).status is Status.CLAIMED
    else:
        assert b.short_lines == first.short_lines
        assert (await service.get_stock(tenant.id, "a", "x")).available == 1


async def test_a_hold_told_in_pgreserve_mode_while_redis_is_down_stays_the_answer(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Primary: Redis refused over pgreserve's hold H and the record failed
    (OutcomeUnknown, no answer). After the move to pgreserve a retry while Redis is down
    is told H, the key's first answer; once Redis is back, with its refusal over H,
    retries still replay H, and H stays active."""
    await redis_refuses(service, store, tenant.id, db)
    await refusal_not_recorded(rollout, service, tenant.id)
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    async with redis_down(rollout):
        told = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    await assert_same_active_hold(service, tenant.id, told, *[
        await rollout.reserve(tenant.id, "k", CART, ttl=60) for _ in range(2)])


@pytest.mark.parametrize("told_first", [False, True])
async def test_a_hold_told_and_a_refusal_recorded_at_once_agree(
        told_first: bool, rollout: Rollout, rollout_b: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """A: Redis runs the reserve (a refusal over H) but its reply is lost, so A marks H
    told; B (primary) replays H and Redis's refusal over H and records the refusal. In
    either order both callers, and a later replay, agree."""
    await redis_refuses(service, store, tenant.id, db)
    real = rollout.store.reserve_answer

    async def lost_reply(*args: Any, **kwargs: Any) -> Any:
        await real(*args, **kwargs)
        raise errors.OutcomeUnknown("the legacy Redis store did not answer (reply lost)")

    rollout.store.reserve_answer = lost_reply  # type: ignore[method-assign]
    reached, go = gate(rollout, "_hold_told")
    a = asyncio.create_task(rollout.reserve(tenant.id, "k", CART, ttl=60))
    await asyncio.wait_for(reached.wait(), 5)
    if told_first:
        go.set()
        first = await a
        b = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    else:
        b = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
        go.set()
        first = await a
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    later = await rollout_b.reserve(tenant.id, "k", CART, ttl=60)
    assert first.held == b.held == later.held == told_first
    assert await service.invariant_violations() == []


async def test_a_refusal_stored_before_marks_is_the_answer_in_pgreserve_mode_too(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """The state earlier code left: Redis refused over pgreserve's hold H in primary (a
    refusal kept without its mark), the caller was told the refusal and H was released,
    pgreserve's ledger still says held. After the move to pgreserve the retry replays the
    refusal, as it does in primary."""
    await redis_refuses(service, store, tenant.id, db)
    await refusal_not_recorded(rollout, service, tenant.id)
    rkey = store.key(tenant.id, "req", "k")
    raw = await store.redis.get(rkey)
    assert raw is not None
    doc = json.loads(raw)
    del doc["over"]  # as stored before refusals kept it
    await store.redis.set(rkey, json.dumps(doc))
    rows = await db.fetch("SELECT reservation_id::text FROM reservation WHERE tenant_id = %s",
                          (tenant.id,))
    await service.release(tenant.id, rows[0][0])  # what the earlier code did
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    moved = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not moved.held and moved.short_lines[0].available == 0
    assert (await service.lookup_request(tenant.id, "k")).status == "rejected"


@pytest.mark.parametrize("later_mode", [Mode.PRIMARY, Mode.PGRESERVE])
async def test_an_unmarked_refusal_of_a_retry_does_not_take_back_a_told_hold(
        later_mode: Mode, rollout: Rollout, service: ReservationService,
        store: RedisHoldStore, tenant: Tenant, db: Database) -> None:
    """The other state earlier code left: Redis was down on the first request and the
    caller was told pgreserve's hold H; a retry reached Redis first, which refused and
    kept its refusal without a mark, and the caller was told H again. H is active and
    not marked told. Later retries, in primary or pgreserve, still replay H."""
    await redis_refuses(service, store, tenant.id, db)
    async with redis_down(rollout):
        first = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert first.held and first.reservation is not None
    await db.fetch("UPDATE request_ledger SET rollout_told = false WHERE tenant_id = %s "
                   "AND request_key = 'k' RETURNING 1", (tenant.id,))  # as then
    again = await rollout.reserve(tenant.id, "k", CART, ttl=60)  # the retry Redis refuses
    assert again.held and again.reservation is not None
    assert again.reservation.id == first.reservation.id
    rkey = store.key(tenant.id, "req", "k")
    raw = await store.redis.get(rkey)
    assert raw is not None
    doc = json.loads(raw)
    assert doc["held"] is False and doc["over"] == ""
    del doc["over"]  # as stored before refusals were marked
    await store.redis.set(rkey, json.dumps(doc))
    await set_mode(db, tenant.id, later_mode, "test")
    later = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    await assert_same_active_hold(service, tenant.id, first, later)


async def test_a_shadow_refusal_stays_the_answer_once_redis_is_no_longer_asked(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """Shadow: Redis refuses a cart pgreserve could hold; the caller gets Redis's refusal
    and pgreserve's hold goes back. The refusal is the key's answer in pgreserve too, so
    after the move to pgreserve, once Redis is no longer asked, a retry is refused, and
    the lookup by key says so."""
    await service.set_stock(tenant.id, "a", "x", 1)
    await store.set_stock(tenant.id, "a", "x", 0)
    await set_mode(db, tenant.id, Mode.SHADOW, "test")
    first = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not first.held
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    await db.fetch("UPDATE rollout_mode SET redis_until = now() - interval '1 second' "
                   "WHERE tenant_id = %s RETURNING 1", (tenant.id,))
    later = await rollout.reserve(tenant.id, "k", CART, ttl=60)
    assert not later.held and later.short_lines == first.short_lines
    assert (await service.lookup_request(tenant.id, "k")).status == "rejected"
    assert (await service.get_stock(tenant.id, "a", "x")).available == 1


async def test_lookup_by_key_never_answers_for_the_legacy_store(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        db: Database) -> None:
    """GET /v1/requests/{key} reads pgreserve's stored answers. In legacy pgreserve keeps
    none (a 404 said "never used" of a key Redis held under: a client resolving a lost
    reply held again), and in shadow it keeps its twin's, whose id the caller was never
    given (claiming it sold in pgreserve beside Redis's hold). Both are 409
    unsupported_in_rollout_mode, and so is a key Redis answered in shadow once the
    tenant is in primary; a key answered in primary is looked up as always."""
    created, key = await service.create_tenant_with_key("shop")
    await seed(service, store, created.id, "tee", 3)
    app = create_app(database=db, rollout=rollout)
    line = {"lines": [{"sku": "tee", "location": "berlin", "quantity": 1}], "ttl_seconds": 60}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        async def hold(request_key: str) -> str:
            made = await client.post("/v1/reservations", json=line,
                                     headers={"Idempotency-Key": request_key})
            assert made.status_code == 201, made.text
            return str(made.json()["id"])

        await set_mode(db, created.id, Mode.LEGACY, "test")
        await hold("in-legacy")
        assert_problem(await client.get("/v1/requests/in-legacy"), 409,
                       "unsupported_in_rollout_mode")
        await set_mode(db, created.id, Mode.SHADOW, "test")
        await hold("in-shadow")
        assert_problem(await client.get("/v1/requests/in-shadow"), 409,
                       "unsupported_in_rollout_mode")
        await set_mode(db, created.id, Mode.PRIMARY, "test")
        for answered_by_redis in ("in-legacy", "in-shadow"):
            assert_problem(await client.get(f"/v1/requests/{answered_by_redis}"), 409,
                           "unsupported_in_rollout_mode")
        mine = await hold("in-primary")
        looked = await client.get("/v1/requests/in-primary")
        assert looked.status_code == 200 and looked.json()["answer"]["id"] == mine
        assert_problem(await client.get("/v1/requests/never"), 404, "request_not_found")


async def test_rollout_cli_refuses_an_empty_by_and_an_empty_tenant(
        service: ReservationService, db: Database) -> None:
    """`rollout set T MODE --by ""` was taken as no --by (user@host recorded), and
    `rollout report --tenant ""` reported every tenant: both exit non-zero with a
    message now, and nothing is switched."""
    await service.create_tenant("t1")
    by = await run(str(BIN), "rollout", "set", "t1", "shadow", "--by", "",
                   "--database-url", db.conninfo, check=False)
    assert by.returncode != 0 and "changed_by" in by.stderr, (by.stdout, by.stderr)
    assert await db.fetch("SELECT 1 FROM rollout_mode_change", ()) == []
    report = await run(str(BIN), "rollout", "report", "--tenant", "", "--json",
                       "--database-url", db.conninfo, check=False)
    assert report.returncode != 0 and report.stdout == "", (report.stdout, report.stderr)


async def assert_refused_by_the_freeze(rollout: Rollout, tenant: int) -> None:
    """Key k's cart (1 of a@x) is answered bucket_frozen."""
    answer = await rollout.reserve(tenant, "k", [("a", "x", 1)], ttl=60)
    assert (answer.held, answer.reason) == (False, "bucket_frozen"), (
        answer.held, answer.reservation and answer.reservation.status)


async def refused_by_a_freeze(rollout: Rollout, service: ReservationService,
                              store: RedisHoldStore, db: Database, tenant: int,
                              mode: Mode) -> None:
    """Both stores count 5 of a@x, the tenant is in `mode`, the bucket is frozen, and key
    k's first reserve is refused bucket_frozen."""
    await seed(service, store, tenant, "a", 5, location="x")
    await set_mode(db, tenant, mode, "test")
    await service.freeze(tenant, "recount", "test@ops", sku="a", location="x")
    await assert_refused_by_the_freeze(rollout, tenant)


@pytest.mark.parametrize("later", [Mode.LEGACY, Mode.PRIMARY, Mode.PGRESERVE])
async def test_a_shadow_refusal_by_rule_replays_refused_in_every_later_mode(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, later: Mode) -> None:
    """Shadow: a frozen bucket refuses (bucket_frozen), and Redis's hold is marked and
    given back. That refusal is the key's answer in every later mode; before, legacy,
    primary and pgreserve replayed Redis's released hold, which the caller never saw."""
    await refused_by_a_freeze(rollout, service, store, db, tenant.id, Mode.SHADOW)
    await assert_refused_by_the_freeze(rollout, tenant.id)
    await set_mode(db, tenant.id, later, "test")
    await assert_refused_by_the_freeze(rollout, tenant.id)


@pytest.mark.parametrize("later", [Mode.LEGACY, Mode.SHADOW])
async def test_a_primary_refusal_replays_refused_after_going_back(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database, later: Mode) -> None:
    """Primary: pgreserve refuses a frozen bucket (the caller's answer); Redis held the
    cart, and its hold is marked and given back. Going back to legacy or shadow (allowed:
    Redis missed nothing), the key replays the refusal, not Redis's released hold."""
    await refused_by_a_freeze(rollout, service, store, db, tenant.id, Mode.PRIMARY)
    await rollout.recorder.flush()
    await set_mode(db, tenant.id, later, "test")
    await assert_refused_by_the_freeze(rollout, tenant.id)


async def test_a_replayed_adjustment_first_made_in_pgreserve_mode_leaves_redis(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """An adjustment made in mode pgreserve (Redis not written), then the way back:
    primary, and every bucket counted again (both stores at 8). A retry of the old
    adjustment's key replays in pgreserve and moves nothing in Redis either; before, it
    moved Redis's recounted counter by 3, units Redis would sell after going back. One
    first made in primary while Redis did not answer still reaches Redis on its replay
    (test_an_adjustment_retried_after_redis_did_not_answer_moves_redis_once)."""
    await seed(service, store, tenant.id, "a", 5, location="x")
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    await rollout.adjust_stock(tenant.id, "adj-1", "a", "x", 3)
    assert (await service.get_stock(tenant.id, "a", "x")).on_hand == 8
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    await rollout.set_stock(tenant.id, "a", "x", 8)
    assert await store.available(tenant.id, "a", "x") == 8
    replay = await rollout.adjust_stock(tenant.id, "adj-1", "a", "x", 3)
    assert replay.replayed and replay.on_hand == 8
    assert await store.available(tenant.id, "a", "x") == 8


async def test_a_primary_refusal_of_a_key_redis_first_sees_on_a_retry_replays_refused(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """A key refused by pgreserve (a freeze) before Redis saw it (mode pgreserve), retried
    in primary: Redis holds it for the first time and gives it back, as pgreserve's
    refusal is the caller's answer. Back in legacy, the key replays that refusal, not
    Redis's released hold (its hold is marked given back for pgreserve's refusal)."""
    await refused_by_a_freeze(rollout, service, store, db, tenant.id, Mode.PGRESERVE)
    await set_mode(db, tenant.id, Mode.PRIMARY, "test")
    await assert_refused_by_the_freeze(rollout, tenant.id)
    await rollout.recorder.flush()
    await set_mode(db, tenant.id, Mode.LEGACY, "test", force=True)
    await assert_refused_by_the_freeze(rollout, tenant.id)


async def test_lookup_by_key_answers_an_adjustment_in_every_mode(
        rollout: Rollout, service: ReservationService, store: RedisHoldStore,
        tenant: Tenant, db: Database) -> None:
    """pgreserve answers adjustments in every mode, so the lookup of an adjustment's key
    answers in legacy and shadow too, while a reserve's key there is refused."""
    await seed(service, store, tenant.id, "a", 5, location="x")
    for mode in (Mode.LEGACY, Mode.SHADOW):
        await set_mode(db, tenant.id, mode, "test", force=True)
        view = await rollout.adjust_stock(tenant.id, f"adj-{mode.value}", "a", "x", 1)
        record = await rollout.lookup_request(tenant.id, f"adj-{mode.value}")
        assert record.operation == "adjust"
        assert record.outcome["stock"]["on_hand"] == view.on_hand
        assert (await rollout.reserve(tenant.id, f"r-{mode.value}", [("a", "x", 1)])).held
        with pytest.raises(errors.UnsupportedInRolloutMode):
            await rollout.lookup_request(tenant.id, f"r-{mode.value}")
