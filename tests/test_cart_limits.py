"""Per-cart limits: at most N units of a SKU in one reservation, over all its lines and
locations, refused with a stored answer; the hot path reads the limit with the bucket."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conftest import ApiTenant, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.client import Client
from pgreserve.domain import LimitedLine, SkuSettings
from pgreserve.errors import InvalidRequest, UnknownTenant
from test_client import server  # noqa: F401 - the fixture
from test_concurrency import wait_until_blocked
from test_http_api import assert_problem, put_stock, reserve


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_cart_over_the_limit_is_refused_stored_and_takes_nothing(
        db: Database, tenant: Tenant, strategy: str, batching: bool, dsn: str) -> None:
    """With a limit of 2 on a SKU: 3 units at one location, or 1 + 2 at two locations, are
    refused (cart_limit_exceeded with the SKU, its limit and the units asked), stored under
    the key (the replay is the same refusal, also after the limit is raised) and take
    nothing; 2 units are held; other SKUs are not limited."""
    svc = ReservationService(db, batching=batching)
    for location in ("berlin", "paris"):
        await svc.set_stock(tenant.id, "tee", location, 10, strategy=strategy)
    await svc.set_stock(tenant.id, "cap", "berlin", 10, strategy=strategy)
    assert await svc.set_cart_limit(tenant.id, "tee", 2) == SkuSettings("tee", 2)
    before = table_counts(dsn)

    one = await svc.reserve(tenant.id, "k1", [("tee", "berlin", 3)])
    assert not one.held and one.reason == "cart_limit_exceeded" and not one.frozen
    assert one.by_rule and one.limited_lines == (LimitedLine("tee", 2, 3),)
    split = await svc.reserve(tenant.id, "k2", [("tee", "berlin", 1), ("tee", "paris", 2),
                                                ("cap", "berlin", 5)])
    assert split.reason == "cart_limit_exceeded"
    assert split.limited_lines == (LimitedLine("tee", 2, 3),)
    after = table_counts(dsn)
    assert after["request_ledger"] == before["request_ledger"] + 2
    assert {k: v for k, v in after.items() if k != "request_ledger"} == {
        k: v for k, v in before.items() if k != "request_ledger"}

    await svc.set_cart_limit(tenant.id, "tee", 10)
    replay = await svc.reserve(tenant.id, "k1", [("tee", "berlin", 3)])
    assert replay.replayed and replay.reason == "cart_limit_exceeded"
    await svc.set_cart_limit(tenant.id, "tee", 2)
    held = await svc.reserve(tenant.id, "k3", [("tee", "berlin", 1), ("tee", "paris", 1),
                                               ("cap", "berlin", 9)])
    assert held.held
    assert (await svc.reserve(tenant.id, "k4", [("cap", "berlin", 1)])).held
    assert (await svc.get_stock(tenant.id, "tee", "berlin")).available == 9
    assert await svc.invariant_violations(tenant.id) == []


async def test_the_limit_follows_the_sku_to_new_locations_and_can_be_removed(
        service: ReservationService, tenant: Tenant) -> None:
    """A bucket created after the limit was set carries it; None removes it everywhere;
    sku_settings answers what is set (none for a SKU never set)."""
    await service.set_stock(tenant.id, "tee", "berlin", 10)
    await service.set_cart_limit(tenant.id, "tee", 1)
    await service.set_stock(tenant.id, "tee", "rome", 10)
    out = await service.reserve(tenant.id, "k1", [("tee", "rome", 2)])
    assert out.reason == "cart_limit_exceeded"
    assert await service.sku_settings(tenant.id, "tee") == SkuSettings("tee", 1)
    assert await service.set_cart_limit(tenant.id, "tee", None) == SkuSettings("tee", None)
    assert (await service.reserve(tenant.id, "k2", [("tee", "rome", 2)])).held
    assert (await service.reserve(tenant.id, "k3", [("tee", "berlin", 5)])).held
    assert await service.sku_settings(tenant.id, "never") == SkuSettings("never", None)


async def test_limits_are_per_tenant(service: ReservationService, tenant: Tenant) -> None:
    """Another tenant's limit on the same SKU name does not limit this tenant; an unknown
    tenant is UnknownTenant."""
    other = await service.create_tenant("other")
    await service.set_stock(tenant.id, "tee", "w", 10)
    await service.set_stock(other.id, "tee", "w", 10)
    await service.set_cart_limit(other.id, "tee", 1)
    assert (await service.reserve(tenant.id, "k", [("tee", "w", 5)])).held
    assert (await service.reserve(other.id, "k", [("tee", "w", 5)])).reason == (
        "cart_limit_exceeded")
    with pytest.raises(UnknownTenant):
        await service.set_cart_limit(10**12, "tee", 1)
    with pytest.raises(UnknownTenant):
        await service.sku_settings(10**12, "tee")


@pytest.mark.parametrize("limit", [0, -1, 1_000_001, True, 2.0, "2"])
async def test_a_bad_limit_is_a_typed_error_and_writes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str, limit: object) -> None:
    """A limit that is not an integer from 1 to 1,000,000 (or None) is InvalidRequest
    naming cart_limit, and nothing is written."""
    await service.set_stock(tenant.id, "tee", "w", 10)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest) as caught:
        await service.set_cart_limit(tenant.id, "tee", limit)  # type: ignore[arg-type]  # bad on purpose
    assert caught.value.details["field"] == "cart_limit"
    assert table_counts(dsn) == before


async def test_a_limit_set_while_a_location_is_being_created_reaches_it(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """A limit set while a new bucket of the SKU is being created (its transaction paused
    before commit) waits for that transaction and then reaches the new bucket too: a cart
    there over the limit is refused."""
    await service.set_stock(tenant.id, "tee", "berlin", 5)
    with psycopg.connect(dsn) as creator:
        creator.execute("SELECT stock_set_v1(%s, 'tee', 'rome', 5)", (tenant.id,))
        setting = asyncio.create_task(service.set_cart_limit(tenant.id, "tee", 1))
        await wait_until_blocked(dsn)
        creator.commit()
    assert await setting == SkuSettings("tee", 1)
    out = await service.reserve(tenant.id, "k", [("tee", "rome", 2)])
    assert out.reason == "cart_limit_exceeded", out


async def test_http_sku_limit_and_the_refusal(api: ApiTenant) -> None:
    """PUT /v1/skus/{sku} sets the limit and GET reads it; a cart over it is 409
    cart_limit_exceeded with limited_lines, replayed for its key; bad limits are 422."""
    await put_stock(api, "tee", 10)
    resp = await api.client.put("/v1/skus/tee", json={"cart_limit": 2})
    assert resp.status_code == 200 and resp.json() == {"sku": "tee", "cart_limit": 2,
                                                       "location_priority": None}
    assert (await api.client.get("/v1/skus/tee")).json() == {"sku": "tee", "cart_limit": 2,
                                                             "location_priority": None}
    first = await reserve(api, "k1", [("tee", "wh", 3)])
    doc = assert_problem(first, 409, "cart_limit_exceeded")
    assert doc["limited_lines"] == [{"sku": "tee", "limit": 2, "requested": 3}]
    again = await reserve(api, "k1", [("tee", "wh", 3)])
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert (await reserve(api, "k2", [("tee", "wh", 2)])).status_code == 201
    for bad in ({"cart_limit": 0}, {"cart_limit": "2"}, {"cart_limit": 1_000_001}, {},
                {"cart_limit": 2, "extra": 1}):
        assert_problem(await api.client.put("/v1/skus/tee", json=bad), 422, "invalid_request")
    cleared = await api.client.put("/v1/skus/tee", json={"cart_limit": None})
    assert cleared.json() == {"sku": "tee", "cart_limit": None, "location_priority": None}
    assert (await reserve(api, "k3", [("tee", "wh", 3)])).status_code == 201


def test_client_reserve_over_the_limit_is_an_outcome(server: tuple[str, str]) -> None:  # noqa: F811 - the fixture
    """The typed client sets a limit and gets a refused outcome (reason and limited lines),
    not an exception."""
    base, key = server
    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 5)
        assert shop.set_cart_limit("tee", 1) == SkuSettings("tee", 1)
        out = shop.reserve([("tee", "berlin", 2)])
        assert not out.held and out.reason == "cart_limit_exceeded"
        assert out.limited_lines == (LimitedLine("tee", 1, 2),)
        assert shop.reserve([("tee", "berlin", 1)]).held
