"""Allocation across locations over HTTP, in the typed clients, in the OpenAPI document and
under the rollout layer (refused where the legacy Redis store takes part)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import ApiTenant, table_counts
from pgreserve import AllocatedLine, Database, Line, ReservationService, Tenant
from pgreserve.client import AsyncClient, Client
from pgreserve.domain import ShortLine, SkuSettings
from pgreserve.errors import AllocationUnavailable
from pgreserve.http import create_app
from pgreserve.rollout import Mode, Rollout, set_mode
from test_client import server  # noqa: F401 - the fixture
from test_http_api import assert_problem, put_stock
from test_rollout import redis_server, rollout, store  # noqa: F401 - the fixtures


async def post_cart(api: ApiTenant, key: str, lines: list[dict[str, Any]]) -> Any:
    return await api.client.post("/v1/reservations", headers={"Idempotency-Key": key},
                                 json={"lines": lines})


async def test_http_priority_and_allocated_reserves(api: ApiTenant) -> None:
    """PUT/GET /v1/locations/priority and a SKU's location_priority set the order; a line
    without a location is held at the first location that has it all (201, the lines say
    where), split over several with split: true, and a replay answers the same bytes."""
    for location, on_hand in (("berlin", 2), ("paris", 3), ("rome", 10)):
        await put_stock(api, "tee", on_hand, location)
    put = await api.client.put("/v1/locations/priority", json={"locations": ["paris", "berlin"]})
    assert put.status_code == 200 and put.json() == {"locations": ["paris", "berlin"]}
    assert (await api.client.get("/v1/locations/priority")).json() == {
        "locations": ["paris", "berlin"]}
    whole = await post_cart(api, "k1", [{"sku": "tee", "quantity": 3}])
    assert whole.status_code == 201, whole.text
    assert whole.json()["lines"] == [{"sku": "tee", "location": "paris", "quantity": 3}]
    again = await post_cart(api, "k1", [{"sku": "tee", "quantity": 3}])
    assert again.content == whole.content and again.headers["idempotent-replayed"] == "true"
    split = await post_cart(api, "k2", [{"sku": "tee", "location": None, "quantity": 5,
                                         "split": True}])
    assert split.status_code == 201, split.text
    assert split.json()["lines"] == [{"sku": "tee", "location": "berlin", "quantity": 2},
                                     {"sku": "tee", "location": "rome", "quantity": 3}]
    sku = await api.client.put("/v1/skus/tee", json={"location_priority": ["rome"]})
    assert sku.json() == {"sku": "tee", "cart_limit": None, "location_priority": ["rome"]}
    limit = await api.client.put("/v1/skus/tee", json={"cart_limit": 50})
    assert limit.json() == {"sku": "tee", "cart_limit": 50, "location_priority": ["rome"]}
    third = await post_cart(api, "k3", [{"sku": "tee", "quantity": 1}])
    assert third.json()["lines"] == [{"sku": "tee", "location": "rome", "quantity": 1}]
    cleared = await api.client.put("/v1/skus/tee", json={"location_priority": None})
    assert cleared.json()["location_priority"] is None


async def test_http_allocated_rejections_and_bad_input(api: ApiTenant, dsn: str) -> None:
    """A line no allocation can serve is 409 insufficient_stock naming it with location
    null and what was available; split with a location, a bad priority and two lines
    without a location for one SKU are 422 and write nothing; an unknown SKU is 404."""
    await put_stock(api, "tee", 2, "berlin")
    await put_stock(api, "tee", 2, "paris")
    short = await post_cart(api, "k1", [{"sku": "tee", "quantity": 3}])
    doc = assert_problem(short, 409, "insufficient_stock")
    assert doc["short_lines"] == [{"sku": "tee", "location": None, "requested": 3,
                                   "available": 2}]
    before = table_counts(dsn)
    for bad in ([{"sku": "tee", "location": "berlin", "quantity": 1, "split": True}],
                [{"sku": "tee", "quantity": 1}, {"sku": "tee", "quantity": 2}],
                [{"sku": "tee", "quantity": 1, "split": "yes"}]):
        assert_problem(await post_cart(api, "k2", bad), 422, "invalid_request")
    bodies: list[dict[str, Any]] = [{"locations": ["a", "a"]}, {"locations": "a"}, {},
                                    {"locations": [""]}]
    for body in bodies:
        assert_problem(await api.client.put("/v1/locations/priority", json=body), 422,
                       "invalid_request")
    bodies = [{}, {"location_priority": [1]}, {"location_priority": ["x", "x"]}]
    for body in bodies:
        assert_problem(await api.client.put("/v1/skus/tee", json=body), 422, "invalid_request")
    unknown = assert_problem(await post_cart(api, "k3", [{"sku": "nope", "quantity": 1}]),
                             404, "unknown_stock")
    assert unknown["unknown_stock"] == [{"sku": "nope", "location": None}]
    assert table_counts(dsn) == before


def test_openapi_documents_allocation() -> None:
    """The OpenAPI document has the priority endpoints, an optional nullable location and
    split on cart lines, location_priority on SKU settings and a nullable location in
    short lines."""
    doc = create_app("postgresql:///unused").openapi()
    assert {"put", "get"} <= set(doc["paths"]["/v1/locations/priority"])
    schemas = doc["components"]["schemas"]
    line = schemas["ReserveLineIn"]
    assert set(schemas["LineIn"]["required"]) == {"sku", "location", "quantity"}  # a change
    assert set(line["required"]) == {"sku", "quantity"}
    assert {"type": "null"} in line["properties"]["location"]["anyOf"]
    assert line["properties"]["split"]["type"] == "boolean"
    assert "location_priority" in schemas["SkuSettingsIn"]["properties"]
    assert "location_priority" in schemas["SkuSettingsOut"]["properties"]
    assert {"type": "null"} in schemas["ShortLine"]["properties"]["location"]["anyOf"]


def test_sync_client_allocates(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The sync client sets the priorities, holds an allocated cart and reads where it
    went; a refusal is an outcome with a short line without location."""
    base, key = server
    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 5)
        shop.set_stock("tee", "paris", 5)
        assert shop.set_location_priority(["paris"]) == ("paris",)
        assert shop.location_priority() == ("paris",)
        out = shop.reserve([AllocatedLine("tee", 7, split=True), ("tee", "berlin", 1)])
        assert out.held and out.reservation is not None
        assert out.reservation.lines == (Line("tee", "berlin", 3), Line("tee", "paris", 5))
        assert shop.set_sku_location_priority("tee", ["berlin"]) == SkuSettings(
            "tee", None, ("berlin",))
        short = shop.reserve([("tee", None, 3)])
        assert not short.held and short.short_lines == (ShortLine("tee", None, 3, 2),)


async def test_async_client_allocates(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The async client does the same calls, awaited."""
    base, key = server
    async with AsyncClient(base, key) as shop:
        await shop.set_stock("tee", "berlin", 5)
        await shop.set_stock("tee", "paris", 5)
        assert await shop.set_location_priority(["paris", "berlin"]) == ("paris", "berlin")
        out = await shop.reserve([AllocatedLine("tee", 2)])
        assert out.reservation is not None
        assert out.reservation.lines == (Line("tee", "paris", 2),)
        assert await shop.location_priority() == ("paris", "berlin")
        settings = await shop.set_sku_location_priority("tee", None)
        assert settings == SkuSettings("tee", None, None)


@pytest.mark.parametrize("mode", [Mode.LEGACY, Mode.SHADOW, Mode.PRIMARY])
async def test_rollout_refuses_allocation_where_redis_takes_part(
        rollout: Rollout, service: ReservationService, tenant: Tenant, db: Database,  # noqa: F811 - the fixture
        mode: Mode, dsn: str) -> None:
    """In modes legacy, shadow and primary a line without a location is
    AllocationUnavailable and writes nothing; in mode pgreserve it is allocated."""
    await service.set_stock(tenant.id, "tee", "berlin", 5)
    await set_mode(db, tenant.id, mode, "test")
    before = table_counts(dsn)
    with pytest.raises(AllocationUnavailable, match="mode pgreserve"):
        await rollout.reserve(tenant.id, "k1", [AllocatedLine("tee", 1)])
    assert table_counts(dsn) == before
    await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
    out = await rollout.reserve(tenant.id, "k2", [AllocatedLine("tee", 1)])
    assert out.reservation is not None
    assert out.reservation.lines == (Line("tee", "berlin", 1),)
