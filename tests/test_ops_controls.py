"""The operator's freeze endpoints (ops/controls.py) and frozen state on /ops, /ops.json
and /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest_asyncio

from pgreserve import Database, ReservationService, Tenant
from pgreserve.http import create_app
from pgreserve.http.ops_app import create_ops_app
from test_http_api import assert_problem
from test_ops_page import Tables


@pytest_asyncio.fixture
async def operator(db: Database) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the ops listener's app (the operator's side: no API key)."""
    ops = create_ops_app(state=create_app(database=db).state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ops),
                                 base_url="http://test") as client:
        yield client


async def test_freeze_list_and_lift_over_http(operator: httpx.AsyncClient,
                                              service: ReservationService,
                                              tenant: Tenant) -> None:
    """POST /ops/freezes freezes (201, then 200 already), GET lists it with who and why,
    a reserve is then refused, and POST /ops/freezes/lift lifts it (a second lift: 404
    freeze_not_found); an unknown tenant is 404 and a body without a reason 422."""
    await service.set_stock(tenant.id, "tee", "eu", 5)
    body = {"tenant": "acme", "sku": "tee", "location": "eu", "reason": "drift", "by": "bob"}
    made = await operator.post("/ops/freezes", json=body)
    assert made.status_code == 201, made.text
    assert made.json()["scope"] == "bucket" and made.json()["frozen_by"] == "bob"
    again = await operator.post("/ops/freezes", json=body)
    assert again.status_code == 200 and again.json()["already"] is True
    listed = (await operator.get("/ops/freezes", params={"tenant": "acme"})).json()["freezes"]
    assert [(f["sku"], f["reason"], f["frozen_by"]) for f in listed] == [("tee", "drift", "bob")]
    assert (await service.reserve(tenant.id, "k", [("tee", "eu", 1)])).reason == "bucket_frozen"

    lifted = await operator.post("/ops/freezes/lift", json={**body, "reason": "checked"})
    assert lifted.status_code == 200 and lifted.json()["lift_reason"] == "checked"
    assert (await operator.get("/ops/freezes")).json() == {"freezes": []}
    assert_problem(await operator.post("/ops/freezes/lift", json=body), 404, "freeze_not_found")
    assert_problem(await operator.post("/ops/freezes", json={**body, "tenant": "nobody"}),
                   404, "not_found")
    no_reason = {k: v for k, v in body.items() if k != "reason"}
    assert_problem(await operator.post("/ops/freezes", json=no_reason), 422, "invalid_request")


async def test_frozen_state_shows_on_ops_pages_and_metrics(operator: httpx.AsyncClient,
                                                           service: ReservationService,
                                                           tenant: Tenant) -> None:
    """A bucket freeze and a tenant freeze appear in /ops.json, in the /ops page's frozen
    table, and as the pgreserve_freezes gauge; lifted, the gauge drops them."""
    await service.set_stock(tenant.id, "tee", "eu", 5)
    other = await service.create_tenant("globex")
    await service.freeze(tenant.id, "recount", "bob", sku="tee", location="eu")
    await service.freeze(other.id, "halt", "carol")
    doc = (await operator.get("/ops.json")).json()
    assert [(f["tenant"], f["scope"], f["sku"]) for f in doc["frozen"]] == [
        ("acme", "bucket", "tee"), ("globex", "tenant", None)]
    page = Tables()
    page.feed((await operator.get("/ops")).text)
    assert [row[:3] for row in page.tables["frozen"]] == [["acme", "tee", "eu"],
                                                          ["globex", "(whole tenant)", ""]]
    metrics = (await operator.get("/metrics")).text
    assert 'pgreserve_freezes{scope="bucket",tenant="acme"} 1.0' in metrics
    assert 'pgreserve_freezes{scope="tenant",tenant="globex"} 1.0' in metrics
    await service.unfreeze(other.id, "over", "carol")
    metrics = (await operator.get("/metrics")).text
    assert 'tenant="globex"' not in metrics.split("# TYPE pgreserve_freezes", 1)[1].split(
        "# HELP", 1)[0]
