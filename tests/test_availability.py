"""Availability of many SKUs at once: per location and in total, read at one instant."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from conftest import ApiTenant, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.client import AsyncClient, Client, LocationAvailability, SkuAvailability
from pgreserve.domain import MAX_AVAILABILITY_NAMES
from pgreserve.errors import InvalidRequest, UnknownTenant
from test_client import server  # noqa: F401 - the fixture
from test_http_api import assert_problem, put_stock, reserve


def figures(items: list) -> list[tuple]:  # type: ignore[type-arg]  # Availability items
    return [(a.sku, a.known, a.on_hand, a.reserved, a.available,
             [(v.location, v.on_hand, v.reserved, v.available) for v in a.locations])
            for a in items]


async def test_each_sku_per_location_and_in_total_in_the_order_asked(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """Each SKU asked for comes back once, in the order asked, with every location's
    on-hand, reserved and available figures and their sums; a SKU without stock is
    there too, known False, all zero."""
    await service.set_stock(tenant.id, "tee", "berlin", 5, strategy=strategy)
    await service.set_stock(tenant.id, "tee", "paris", 7, strategy=strategy)
    await service.set_stock(tenant.id, "cap", "paris", 3, strategy=strategy)
    assert (await service.reserve(tenant.id, "k1", [("tee", "berlin", 2),
                                                    ("cap", "paris", 1)])).held
    items = await service.availability(tenant.id, ["tee", "ghost", "cap", "tee"])
    assert figures(items) == [
        ("tee", True, 12, 2, 10, [("berlin", 5, 2, 3), ("paris", 7, 0, 7)]),
        ("ghost", False, 0, 0, 0, []),
        ("cap", True, 3, 1, 2, [("paris", 3, 1, 2)]),
    ]
    only = await service.availability(tenant.id, ["tee", "cap"], locations=["berlin"])
    assert figures(only) == [("tee", True, 5, 2, 3, [("berlin", 5, 2, 3)]),
                             ("cap", False, 0, 0, 0, [])]


async def test_an_expired_hold_counts_as_available_before_the_sweeper_runs(
        db: Database, strategy: str) -> None:
    """A hold past its expiry is available again at once, as in the single-bucket view
    (a reserve would take it back), even before the sweeper has run."""
    now = [datetime(2026, 1, 1, tzinfo=UTC)]
    svc = ReservationService(db, clock=lambda: now[0])
    tenant = await svc.create_tenant("t")
    await svc.set_stock(tenant.id, "tee", "w", 4, strategy=strategy)
    assert (await svc.reserve(tenant.id, "k", [("tee", "w", 3)], ttl=60)).held
    assert figures(await svc.availability(tenant.id, ["tee"])) == [
        ("tee", True, 4, 3, 1, [("w", 4, 3, 1)])]
    now[0] += timedelta(seconds=61)
    assert figures(await svc.availability(tenant.id, ["tee"])) == [
        ("tee", True, 4, 0, 4, [("w", 4, 0, 4)])]
    got = await svc.get_stock(tenant.id, "tee", "w")
    assert (got.reserved, got.available) == (0, 4)


async def test_another_tenants_stock_is_never_shown(
        service: ReservationService, tenant: Tenant) -> None:
    """Two tenants with the same SKU and location see only their own figures; an unknown
    tenant is UnknownTenant, not an empty answer."""
    other = await service.create_tenant("other")
    await service.set_stock(tenant.id, "tee", "w", 5)
    await service.set_stock(other.id, "tee", "w", 50)
    mine = await service.availability(tenant.id, ["tee"])
    theirs = await service.availability(other.id, ["tee"])
    assert (mine[0].available, theirs[0].available) == (5, 50)
    with pytest.raises(UnknownTenant):
        await service.availability(10**12, ["tee"])


@pytest.mark.parametrize(("skus", "locations", "field"), [
    ([], None, "sku"),
    ("tee", None, "sku"),
    ([f"s{i}" for i in range(MAX_AVAILABILITY_NAMES + 1)], None, "sku"),
    (["a\x00b"], None, "sku"),
    (["x" * 201], None, "sku"),
    ([7], None, "sku"),
    (["tee"], [], "location"),
    (["tee"], ["\udc80"], "location"),
], ids=["none", "a-string", "too-many", "nul", "too-long", "not-text", "no-location",
        "lone-surrogate"])
async def test_bad_input_is_a_typed_error_and_writes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str, skus: object,
        locations: object, field: str) -> None:
    """No SKU, a bare string, more than the limit, NUL, an over-long name, a non-string
    or an empty location list: InvalidRequest naming the field, nothing written."""
    await service.set_stock(tenant.id, "tee", "w", 5)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest) as caught:
        await service.availability(tenant.id, skus, locations)  # type: ignore[arg-type]  # bad on purpose
    assert caught.value.details["field"] == field
    assert table_counts(dsn) == before


async def test_the_figures_of_all_buckets_are_from_one_instant(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """Carts that each hold one unit at two locations at once, and release it, while
    availability is read over and over: every read shows as many units held at one
    location as at the other (two reads per bucket would catch a cart half-way)."""
    for location in ("a", "b"):
        await service.set_stock(tenant.id, "tee", location, 10_000, strategy=strategy)
    done = asyncio.Event()
    reads: list[tuple[int, int]] = []

    async def cart(n: int) -> None:
        for i in range(60):
            out = await service.reserve(tenant.id, f"c{n}-{i}", [("tee", "a", 1),
                                                                ("tee", "b", 1)])
            assert out.held and out.reservation is not None
            if i % 2:
                await service.release(tenant.id, out.reservation.id)

    async def reader() -> None:
        while not done.is_set():
            (item,) = await service.availability(tenant.id, ["tee"])
            at = {v.location: v.reserved for v in item.locations}
            reads.append((at["a"], at["b"]))
            await asyncio.sleep(0)

    reading = [asyncio.create_task(reader()) for _ in range(3)]
    try:
        await asyncio.gather(*(cart(n) for n in range(6)))
    finally:
        done.set()
        await asyncio.gather(*reading)
    assert len(reads) > 10
    assert [r for r in reads if r[0] != r[1]] == []
    (final,) = await service.availability(tenant.id, ["tee"])
    assert [(v.location, v.reserved) for v in final.locations] == [("a", 180), ("b", 180)]
    assert await service.invariant_violations(tenant.id) == []


async def test_http_availability_per_location_and_in_total(
        api: ApiTenant, other: ApiTenant) -> None:
    """GET /v1/availability with repeated sku (and location) parameters answers each SKU
    per location and in total, only the caller's own stock."""
    await put_stock(api, "tee", 5, location="berlin")
    await put_stock(api, "tee", 7, location="paris")
    await put_stock(other, "tee", 99, location="berlin")
    assert (await reserve(api, "k1", [("tee", "paris", 3)])).status_code == 201
    resp = await api.client.get("/v1/availability", params=[("sku", "tee"), ("sku", "cap")])
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"items": [
        {"sku": "tee", "known": True, "on_hand": 12, "reserved": 3, "available": 9,
         "locations": [
             {"location": "berlin", "on_hand": 5, "reserved": 0, "available": 5},
             {"location": "paris", "on_hand": 7, "reserved": 3, "available": 4}]},
        {"sku": "cap", "known": False, "on_hand": 0, "reserved": 0, "available": 0,
         "locations": []}]}
    narrowed = await api.client.get("/v1/availability",
                                    params=[("sku", "tee"), ("location", "paris")])
    assert [x["location"] for x in narrowed.json()["items"][0]["locations"]] == ["paris"]


@pytest.mark.parametrize("query", [
    "", "?location=w", "?" + "&".join(f"sku=s{i}" for i in range(MAX_AVAILABILITY_NAMES + 1)),
    "?sku=a%00b", "?sku=" + "x" * 201,
], ids=["no-sku", "location-only", "too-many", "nul", "too-long"])
async def test_http_bad_availability_queries_are_422(api: ApiTenant, query: str) -> None:
    """No sku parameter, too many, NUL or an over-long name: 422 invalid_request."""
    assert_problem(await api.client.get("/v1/availability" + query), 422, "invalid_request")


async def test_http_repeats_are_answered_once_and_count_against_the_limit(
        api: ApiTenant) -> None:
    """A SKU sent 100 times is answered once; 101 values are 422 over HTTP, repeats
    included (docs/api.md says so: the query's limit counts what is sent)."""
    await put_stock(api, "tee", 5, location="w")
    resp = await api.client.get("/v1/availability", params=[("sku", "tee")] * 100)
    assert resp.status_code == 200, resp.text
    assert [(i["sku"], i["available"]) for i in resp.json()["items"]] == [("tee", 5)]
    assert_problem(await api.client.get("/v1/availability", params=[("sku", "tee")] * 101),
                   422, "invalid_request")


async def test_http_availability_needs_an_api_key(api: ApiTenant) -> None:
    """Without an API key: 401."""
    resp = await api.client.get("/v1/availability?sku=tee", headers={"Authorization": ""})
    assert_problem(resp, 401, "unauthorized")


@pytest.fixture
def stocked(server: tuple[str, str]) -> tuple[str, str]:  # noqa: F811 - the fixture
    base, key = server
    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 5)
        shop.set_stock("tee", "paris", 2)
    return base, key


def test_sync_client_availability(stocked: tuple[str, str]) -> None:
    """The sync client's availability() answers typed figures per SKU and location."""
    base, key = stocked
    with Client(base, key) as shop:
        assert shop.reserve([("tee", "berlin", 1)]).held
        assert shop.availability(["tee", "cap"], locations=["berlin", "paris"]) == [
            SkuAvailability("tee", True, 7, 1, 6, (LocationAvailability("berlin", 5, 1, 4),
                                                   LocationAvailability("paris", 2, 0, 2))),
            SkuAvailability("cap", False, 0, 0, 0, ())]


async def test_async_client_availability(stocked: tuple[str, str]) -> None:
    """The async client's availability() answers the same, and a bad query is a typed
    InvalidRequest."""
    base, key = stocked
    async with AsyncClient(base, key) as shop:
        (tee,) = await shop.availability(["tee"], locations=["paris"])
        assert tee == SkuAvailability("tee", True, 2, 0, 2,
                                      (LocationAvailability("paris", 2, 0, 2),))
        with pytest.raises(InvalidRequest):
            await shop.availability([])
