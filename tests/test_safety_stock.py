"""Safety stock per bucket: units never promised to buyers, kept back by the database's own
conditional writes on every path that takes stock (both strategies, batched and unbatched,
carts), never put in the pool, and shown as what can be promised."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conftest import ApiTenant, Clock, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.client import Client
from pgreserve.errors import InvalidRequest, StockPolicyUnsupported
from pgreserve.rollout import Mode, RedisHoldStore, Rollout, set_mode
from test_client import server  # noqa: F401 - the fixture
from test_concurrency import wait_until_blocked
from test_http_api import assert_problem, put_stock, reserve
from test_rollout import redis_server, store  # noqa: F401 - the fixtures

BATCHING = pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])


def bucket_row(dsn: str, tenant: int, sku: str, location: str = "w") -> dict[str, int]:
    """free, on_hand, safety_stock and the pool size of one bucket, read straight from the tables."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT b.free, b.on_hand, b.safety_stock,"
            " (SELECT count(*) FROM stock_unit u"
            "   WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id)"
            " FROM stock_bucket b WHERE b.tenant_id = %s AND b.sku = %s AND b.location = %s",
            (tenant, sku, location)).fetchone()
    assert row is not None
    return {"free": int(row[0]), "on_hand": int(row[1]), "safety": int(row[2]),
            "pool": int(row[3])}


@BATCHING
async def test_safety_stock_is_never_promised(db: Database, tenant: Tenant, strategy: str,
                                              batching: bool, dsn: str) -> None:
    """With 10 on hand and a safety stock of 3, availability is 7; 8 units are refused as
    insufficient_stock showing 7, 7 are held, then 1 more is refused showing 0; the 3 stay
    in free, never in the pool."""
    svc = ReservationService(db, batching=batching)
    view = await svc.set_stock(tenant.id, "tee", "w", 10, strategy=strategy, safety_stock=3)
    assert (view.safety_stock, view.available, view.on_hand) == (3, 7, 10)
    assert view.pool <= 7

    over = await svc.reserve(tenant.id, "k1", [("tee", "w", 8)])
    assert not over.held and over.reason == "insufficient_stock"
    assert [(s.requested, s.available) for s in over.short_lines] == [(8, 7)]
    assert (await svc.reserve(tenant.id, "k2", [("tee", "w", 7)])).held
    last = await svc.reserve(tenant.id, "k3", [("tee", "w", 1)])
    assert not last.held and [s.available for s in last.short_lines] == [0]

    now = await svc.get_stock(tenant.id, "tee", "w")
    assert (now.on_hand, now.reserved, now.available) == (10, 7, 0)
    row = bucket_row(dsn, tenant.id, "tee")
    assert row["free"] == 3 and row["pool"] == 0
    assert await svc.invariant_violations(tenant.id) == []


async def test_a_cart_keeps_each_lines_safety_stock(service: ReservationService, tenant: Tenant,
                                                    strategy: str, dsn: str) -> None:
    """A cart of two lines fails whole when one line would dip into its bucket's safety stock
    (the short line shows what was promisable) and takes nothing from the other; within it,
    the cart is held."""
    await service.set_stock(tenant.id, "tee", "w", 5, strategy=strategy, safety_stock=2)
    await service.set_stock(tenant.id, "cap", "w", 5, strategy=strategy)
    before = table_counts(dsn)
    out = await service.reserve(tenant.id, "k1", [("cap", "w", 5), ("tee", "w", 4)])
    assert not out.held and out.reason == "insufficient_stock"
    assert [(s.sku, s.requested, s.available) for s in out.short_lines] == [("tee", 4, 3)]
    after = table_counts(dsn)
    assert after["request_ledger"] == before["request_ledger"] + 1
    assert after["reservation"] == before["reservation"]
    assert (await service.get_stock(tenant.id, "cap", "w")).available == 5
    assert (await service.reserve(tenant.id, "k2", [("cap", "w", 5), ("tee", "w", 3)])).held
    assert bucket_row(dsn, tenant.id, "tee")["free"] == 2
    assert await service.invariant_violations(tenant.id) == []


async def test_a_raise_of_safety_stock_takes_its_units_out_of_the_pool(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """A pool bucket whose safety stock is raised gives the units back from the pool to free
    (the pool keeps only what can be promised), the line's version moves although on_hand
    did not, and a lowered safety stock refills the pool."""
    first = await service.set_stock(tenant.id, "tee", "w", 10, strategy="pool")
    assert first.pool == 10
    raised = await service.set_stock(tenant.id, "tee", "w", 10, safety_stock=6)
    assert raised.version is not None and first.version is not None
    assert raised.version > first.version
    assert (raised.pool, raised.available, raised.safety_stock) == (4, 4, 6)
    assert bucket_row(dsn, tenant.id, "tee") == {"free": 6, "on_hand": 10, "safety": 6,
                                                 "pool": 4}
    assert (await service.reserve(tenant.id, "k1", [("tee", "w", 4)])).held
    assert not (await service.reserve(tenant.id, "k2", [("tee", "w", 1)])).held
    lowered = await service.set_stock(tenant.id, "tee", "w", 10, safety_stock=1)
    assert (lowered.available, lowered.pool) == (5, 5)
    # a count or a strategy switch without safety_stock keeps it
    kept = await service.set_stock(tenant.id, "tee", "w", 10, strategy="row")
    assert (kept.safety_stock, kept.available) == (1, 5)
    assert await service.invariant_violations(tenant.id) == []


@BATCHING
async def test_units_given_back_refill_safety_stock_before_the_pool(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """Safety stock raised above what is free (8 of 10 held) makes nothing available; the
    release of the hold first tops free back up to the safety stock, and only the rest can
    be promised (or enters the pool)."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 10, strategy=strategy)
    held = await svc.reserve(tenant.id, "k1", [("tee", "w", 8)])
    assert held.reservation is not None
    view = await svc.set_stock(tenant.id, "tee", "w", 10, safety_stock=5)
    assert (view.available, view.reserved) == (0, 8)
    assert not (await svc.reserve(tenant.id, "k2", [("tee", "w", 1)])).held
    await svc.release(tenant.id, held.reservation.id)
    row = bucket_row(dsn, tenant.id, "tee")
    assert row["free"] >= 5 and row["free"] + row["pool"] == 10
    assert (await svc.get_stock(tenant.id, "tee", "w")).available == 5
    assert (await svc.reserve(tenant.id, "k3", [("tee", "w", 5)])).held
    assert not (await svc.reserve(tenant.id, "k4", [("tee", "w", 1)])).held
    assert await svc.invariant_violations(tenant.id) == []


@BATCHING
async def test_expired_holds_come_back_behind_the_safety_stock(
        db: Database, clock: Clock, tenant: Tenant, strategy: str, batching: bool) -> None:
    """A hold past its expiry is reclaimed by the next reserve, but only what lies beyond the
    safety stock is promised: 8 again of 10 with 2 kept back, then nothing."""
    svc = ReservationService(db, clock=clock, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 10, strategy=strategy, safety_stock=2)
    assert (await svc.reserve(tenant.id, "k1", [("tee", "w", 8)], ttl=60)).held
    clock.advance(61)
    assert (await svc.get_stock(tenant.id, "tee", "w")).available == 8
    assert (await svc.reserve(tenant.id, "k2", [("tee", "w", 8)], ttl=60)).held
    out = await svc.reserve(tenant.id, "k3", [("tee", "w", 1)], ttl=60)
    assert not out.held and [s.available for s in out.short_lines] == [0]
    assert await svc.invariant_violations(tenant.id) == []


@BATCHING
async def test_many_buyers_never_get_the_safety_stock(db: Database, tenant: Tenant,
                                                      strategy: str, batching: bool,
                                                      dsn: str) -> None:
    """40 concurrent buyers of 1 unit against 20 on hand with a safety stock of 5: exactly 15
    are held, every other is refused with nothing promisable, 5 units stay free and the
    books balance."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 20, strategy=strategy, safety_stock=5,
                        pool_cap=4)
    outs = await asyncio.gather(*(svc.reserve(tenant.id, f"k{i}", [("tee", "w", 1)])
                                  for i in range(40)))
    assert sum(o.held for o in outs) == 15
    assert all(s.available == 0 for o in outs if not o.held for s in o.short_lines)
    row = bucket_row(dsn, tenant.id, "tee")
    assert row["free"] == 5 and row["pool"] == 0
    assert await svc.invariant_violations(tenant.id) == []


async def test_a_raise_committed_while_a_buyer_waits_is_enforced_by_the_write(
        service: ReservationService, tenant: Tenant, dsn: str, strategy: str) -> None:
    """A buyer whose reserve waits behind an uncommitted raise of the safety stock (10 on
    hand, 0 -> 8) is decided by the raised figure once it commits: 5 units are refused,
    showing 2, although the buyer started while 10 were promisable."""
    await service.set_stock(tenant.id, "tee", "w", 10, strategy=strategy)
    with psycopg.connect(dsn) as setter:
        setter.execute("SELECT stock_set_v3(%s, 'tee', 'w', 10, NULL, false, NULL, NULL, NULL,"
                       " 8, NULL)", (tenant.id,))
        buying = asyncio.create_task(service.reserve(tenant.id, "k1", [("tee", "w", 5)]))
        await wait_until_blocked(dsn)
        setter.commit()
    out = await buying
    assert not out.held and [s.available for s in out.short_lines] == [2]
    assert await service.invariant_violations(tenant.id) == []


@pytest.mark.parametrize("value", [-1, 2**53 + 1, True, 2.5, "3"])
async def test_a_bad_safety_stock_is_a_typed_error_and_writes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str, value: object) -> None:
    """A safety stock or backorder limit that is not an integer from 0 to 2^53 is
    InvalidRequest naming the field, and nothing is written."""
    await service.set_stock(tenant.id, "tee", "w", 10)
    before = table_counts(dsn)
    for field in ("safety_stock", "backorder_limit"):
        with pytest.raises(InvalidRequest) as caught:
            await service.set_stock(tenant.id, "tee", "w", 5, **{field: value})  # type: ignore[arg-type]  # bad on purpose
        assert caught.value.details["field"] == field
    assert table_counts(dsn) == before
    assert (await service.get_stock(tenant.id, "tee", "w")).on_hand == 10


async def test_http_safety_stock_is_set_shown_and_enforced(api: ApiTenant) -> None:
    """PUT /v1/stock sets safety_stock (a settings-only change moves the ETag), the stock
    document and GET /v1/availability show it and what can be promised, a reserve into it
    is 409 insufficient_stock with the promisable figure, and bad values are 422."""
    first = await put_stock(api, "tee", 10)
    assert first.json()["safety_stock"] == 0
    second = await put_stock(api, "tee", 10, safety_stock=4)
    assert second.headers["etag"] != first.headers["etag"]
    doc = second.json()
    assert (doc["safety_stock"], doc["available"], doc["on_hand"]) == (4, 6, 10)
    got = (await api.client.get("/v1/stock/wh/tee")).json()
    assert got["safety_stock"] == 4 and got["available"] == 6
    avail = (await api.client.get("/v1/availability?sku=tee")).json()
    assert avail["items"][0]["available"] == 6, avail
    refused = assert_problem(await reserve(api, "k1", [("tee", "wh", 7)]), 409,
                             "insufficient_stock")
    assert refused["short_lines"] == [{"sku": "tee", "location": "wh", "requested": 7,
                                       "available": 6}]
    assert (await reserve(api, "k2", [("tee", "wh", 6)])).status_code == 201
    for bad in ({"on_hand": 10, "safety_stock": -1}, {"on_hand": 10, "safety_stock": "1"},
                {"on_hand": 10, "backorder_limit": 1.5}):
        assert_problem(await api.client.put("/v1/stock/wh/tee", json=bad), 422,
                       "invalid_request")


def test_client_sets_and_shows_safety_stock(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The typed client sets a safety stock and reads it back with what can be promised."""
    base, key = server
    with Client(base, key) as shop:
        made = shop.set_stock("tee", "berlin", 10, safety_stock=3)
        assert (made.safety_stock, made.available) == (3, 7)
        assert shop.get_stock("tee", "berlin").safety_stock == 3
        assert not shop.reserve([("tee", "berlin", 8)]).held


@pytest.mark.parametrize("mode", [Mode.LEGACY, Mode.SHADOW])
async def test_rollout_refuses_a_policy_while_redis_decides(
        service: ReservationService, db: Database, tenant: Tenant, mode: Mode, dsn: str,
        store: RedisHoldStore) -> None:  # noqa: F811 - the fixture
    """In rollout modes where Redis decides holds, a safety stock or backorder limit is
    refused with StockPolicyUnsupported and nothing is written; a plain count still works."""
    rollout = Rollout(service, RedisHoldStore(store.url, namespace=store.namespace),
                      mode_ttl_s=0, flush_every_s=0.05)
    try:
        await set_mode(db, tenant.id, mode, "test")
        before = table_counts(dsn)
        for policy in ({"safety_stock": 2}, {"backorder_limit": 2}):
            with pytest.raises(StockPolicyUnsupported):
                await rollout.set_stock(tenant.id, "tee", "w", 10, **policy)  # type: ignore[arg-type]  # keyword arguments
        assert table_counts(dsn) == before
        assert (await rollout.set_stock(tenant.id, "tee", "w", 10)).safety_stock == 0
    finally:
        await rollout.aclose()


@BATCHING
async def test_a_raise_during_a_rush_keeps_the_new_safety_stock_out_of_the_pool(
        db: Database, tenant: Tenant, batching: bool, dsn: str) -> None:
    """A raise of the safety stock (0 -> 10) committed while 40 buyers race for a pool
    bucket of 30: no unit of the new safety stock is in the pool afterwards, nothing is
    promised twice, and what stays promisable is exactly 30 - held - 10."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 30, strategy="pool", pool_cap=8)

    async def raise_it() -> None:
        await asyncio.sleep(0.05)
        await svc.set_stock(tenant.id, "tee", "w", 30, safety_stock=10)

    outs, _ = await asyncio.gather(
        asyncio.gather(*(svc.reserve(tenant.id, f"k{i}", [("tee", "w", 1)])
                         for i in range(40))),
        raise_it())
    held = sum(o.held for o in outs)
    assert 20 <= held <= 30
    view = await svc.get_stock(tenant.id, "tee", "w")
    assert (view.reserved, view.available) == (held, max(0, 30 - held - 10))
    row = bucket_row(dsn, tenant.id, "tee")
    assert row["pool"] == 0 or row["free"] >= 10
    assert await svc.invariant_violations(tenant.id) == []
