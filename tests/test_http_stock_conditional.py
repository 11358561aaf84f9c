"""HTTP conventions of stock and created resources: ETag / If-Match / If-None-Match on
stock lines, the GET /v1/stock listing, and Location on every 201."""

from __future__ import annotations

import base64

import httpx
import pytest
from fastapi import FastAPI

from conftest import ApiTenant, table_counts
from test_http_api import assert_problem, reserve


async def put(api: ApiTenant, sku: str, on_hand: int, location: str = "wh",
              **headers: str) -> httpx.Response:
    return await api.client.put(f"/v1/stock/{location}/{sku}", json={"on_hand": on_hand},
                                headers={k.replace("_", "-"): v for k, v in headers.items()})


async def test_etag_moves_with_counts_not_with_sales(api: ApiTenant) -> None:
    """GET, PUT and adjustments answer the ETag W/"<version>"; a hold, a claim and a
    release leave it as it was, a count and an adjustment move it."""
    created = await put(api, "s", 10)
    assert created.status_code == 201 and created.headers["etag"] == 'W/"1"'
    rid = (await reserve(api, "k1", [("s", "wh", 2)])).json()["id"]
    assert (await api.client.post(f"/v1/reservations/{rid}/claim")).status_code == 200
    rid2 = (await reserve(api, "k2", [("s", "wh", 1)])).json()["id"]
    assert (await api.client.post(f"/v1/reservations/{rid2}/release")).status_code == 200
    await reserve(api, "k3", [("s", "wh", 1)])
    got = await api.client.get("/v1/stock/wh/s")
    assert got.headers["etag"] == 'W/"1"' and got.json()["reserved"] == 1
    assert got.json()["version"] == 1
    counted = await put(api, "s", 20, if_match='W/"1"')
    assert counted.status_code == 200 and counted.headers["etag"] == 'W/"2"'
    adjusted = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 1},
                                     headers={"Idempotency-Key": "a1", "If-Match": 'W/"2"'})
    assert adjusted.status_code == 200 and adjusted.headers["etag"] == 'W/"3"'


async def test_stale_if_match_is_412_and_writes_nothing(api: ApiTenant, dsn: str) -> None:
    """A PUT or adjustment whose If-Match is not the current ETag is 412
    precondition_failed, and no table changes; the refused adjustment's key stays unused."""
    await put(api, "s", 10)
    await put(api, "s", 11)
    before = table_counts(dsn)
    assert_problem(await put(api, "s", 50, if_match='W/"1"'), 412, "precondition_failed")
    refused = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": -4},
                                    headers={"Idempotency-Key": "a", "If-Match": 'W/"1"'})
    assert_problem(refused, 412, "precondition_failed")
    assert table_counts(dsn) == before
    got = await api.client.get("/v1/stock/wh/s")
    assert got.json()["on_hand"] == 11 and got.headers["etag"] == 'W/"2"'
    # a list with the current tag, strong or weak, matches (weak comparison)
    assert (await put(api, "s", 12, if_match='"7", "2"')).status_code == 200
    ok = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": -4},
                               headers={"Idempotency-Key": "a", "If-Match": 'W/"3"'})
    assert ok.status_code == 200 and ok.json()["on_hand"] == 8
    replay = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": -4},
                                   headers={"Idempotency-Key": "a", "If-Match": 'W/"3"'})
    assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == ok.content and replay.headers["etag"] == 'W/"4"'


async def test_if_match_star_and_if_none_match_star(api: ApiTenant, dsn: str) -> None:
    """If-Match: * never creates a line (412), If-None-Match: * creates one (201) and
    refuses an existing one (412); a foreign tag never matches."""
    before = table_counts(dsn)
    assert_problem(await put(api, "s", 5, if_match="*"), 412, "precondition_failed")
    assert_problem(await put(api, "s", 5, if_match='W/"1"'), 412, "precondition_failed")
    assert table_counts(dsn) == before
    made = await put(api, "s", 5, if_none_match="*")
    assert made.status_code == 201 and made.headers["location"] == "/v1/stock/wh/s"
    assert_problem(await put(api, "s", 9, if_none_match="*"), 412, "precondition_failed")
    assert_problem(await put(api, "s", 9, if_match='"abc"'), 412, "precondition_failed")
    assert_problem(await put(api, "s", 9, if_match="*", if_none_match="*"), 412,
                   "precondition_failed")
    assert (await api.client.get("/v1/stock/wh/s")).json()["on_hand"] == 5
    assert (await put(api, "s", 9, if_match="*")).status_code == 200


@pytest.mark.parametrize(("header", "value"), [
    ("If-Match", "3"), ("If-Match", 'W/"1'), ("If-Match", '"1" x'), ("If-None-Match", 'W/"1"'),
])
async def test_malformed_preconditions_are_400(api: ApiTenant, dsn: str, header: str,
                                               value: str) -> None:
    """An If-Match that is not a list of entity tags, or an If-None-Match other than * on
    a write, is 400 precondition_invalid and writes nothing."""
    before = table_counts(dsn)
    resp = await api.client.put("/v1/stock/wh/s", json={"on_hand": 1}, headers={header: value})
    assert_problem(resp, 400, "precondition_invalid")
    assert table_counts(dsn) == before


async def test_location_on_every_201(app: FastAPI, api: ApiTenant) -> None:
    """A created reservation, stock line and webhook answer 201 with Location: their URL
    under the app's root path; a replayed 201 carries the same Location."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path="/shop"),
                                 base_url="http://test",
                                 headers={"Authorization": f"Bearer {api.key}"}) as client:
        stock = await client.put("/v1/stock/wh/tee%20red", json={"on_hand": 5})
        assert stock.status_code == 201
        assert stock.headers["location"] == "/shop/v1/stock/wh/tee%20red"
        again = await client.put("/v1/stock/wh/tee%20red", json={"on_hand": 5})
        assert again.status_code == 200 and "location" not in again.headers
    await put(api, "s", 5)
    held = await reserve(api, "k1", [("s", "wh", 1)])
    rid = held.json()["id"]
    assert held.status_code == 201 and held.headers["location"] == f"/v1/reservations/{rid}"
    replay = await reserve(api, "k1", [("s", "wh", 1)])
    assert replay.headers["location"] == held.headers["location"]
    assert (await api.client.get(held.headers["location"])).json()["id"] == rid
    hook = await api.client.post("/v1/webhooks", json={"url": "https://93.184.215.14/hook"})
    assert hook.status_code == 201
    assert hook.headers["location"] == f"/v1/webhooks/{hook.json()['id']}"
    assert (await api.client.delete(hook.headers["location"])).status_code == 204


@pytest.mark.parametrize(("path", "location", "sku", "header"), [
    ("/v1/stock/%2E%2E/x", "..", "x", "/v1/stock/%2E%2E/x"),
    ("/v1/stock/wh/%2E", "wh", ".", "/v1/stock/wh/%2E"),
    ("/v1/stock/%2E/%2E%2E", ".", "..", "/v1/stock/%2E/%2E%2E"),
    ("/v1/stock/wh/...", "wh", "...", "/v1/stock/wh/..."),
])
async def test_location_of_a_dot_named_line_is_that_line(
        api: ApiTenant, path: str, location: str, sku: str, header: str) -> None:
    """A name "." or ".." in Location is percent-encoded: bare, it is a dot-segment, and
    the URL a client resolves from it (RFC 3986 5.2.4) names another resource."""
    created = await api.client.put(path, json={"on_hand": 3})
    assert created.status_code == 201, created.text
    assert (created.json()["location"], created.json()["sku"]) == (location, sku)
    assert created.headers["location"] == header
    followed = httpx.URL("http://test/").join(created.headers["location"])
    got = await api.client.get(str(followed))
    assert got.status_code == 200, (followed, got.text)
    assert (got.json()["location"], got.json()["sku"]) == (location, sku)


async def test_stock_listing_over_http(api: ApiTenant, other: ApiTenant) -> None:
    """GET /v1/stock pages with limit and next_cursor through every line of this tenant
    only, with filters; a bad cursor is 400 invalid_cursor, a bad limit or a filter given
    twice 422."""
    for sku in ["tee-red", "tee-blue", "cap"]:
        for loc in ["berlin", "paris"]:
            await put(api, sku, 3, location=loc)
    await put(other, "tee-red", 1, location="rome")
    seen: list[tuple[str, str]] = []
    params: dict[str, str | int] = {"limit": 4}
    while True:
        page = await api.client.get("/v1/stock", params=params)
        assert page.status_code == 200, page.text
        seen.extend((x["sku"], x["location"]) for x in page.json()["stock"])
        if page.json()["next_cursor"] is None:
            break
        params["cursor"] = page.json()["next_cursor"]
    assert seen == sorted((s, loc) for s in ["tee-red", "tee-blue", "cap"]
                          for loc in ["berlin", "paris"])
    narrowed = await api.client.get("/v1/stock", params=[
        ("sku", "cap"), ("sku", "tee-red"), ("location", "paris")])
    assert [(x["sku"], x["version"]) for x in narrowed.json()["stock"]] == [
        ("cap", 1), ("tee-red", 1)]
    prefixed = await api.client.get("/v1/stock", params={"sku_prefix": "tee-"})
    assert len(prefixed.json()["stock"]) == 4 and prefixed.json()["next_cursor"] is None
    assert_problem(await api.client.get("/v1/stock", params={"cursor": "garbage"}), 400,
                   "invalid_cursor")
    # a nesting deeper than the JSON parser goes (was a 500); a cursor handed out, then
    # padded or with a line break (only what the listing hands out is taken)
    deep = "s1." + base64.urlsafe_b64encode(b"[" * 3000).decode()
    assert_problem(await api.client.get("/v1/stock", params={"cursor": deep}), 400,
                   "invalid_cursor")
    handed = (await api.client.get("/v1/stock", params={"limit": 1})).json()["next_cursor"]
    for forged in (handed + "==", handed + "\n"):
        assert_problem(await api.client.get("/v1/stock", params={"cursor": forged}), 400,
                       "invalid_cursor")
    twice = await api.client.get("/v1/stock", params=[("sku_prefix", "a"), ("sku_prefix", "b")])
    assert_problem(twice, 422, "invalid_request")
    for limit in ("0", "1001", "x"):
        assert_problem(await api.client.get("/v1/stock", params={"limit": limit}), 422,
                       "invalid_request")


async def test_openapi_documents_the_conventions(api: ApiTenant) -> None:
    """The OpenAPI document names listStock, the If-Match / If-None-Match headers, 412,
    the ETag header and the Location header of each 201."""
    doc = (await api.client.get("/openapi.json")).json()
    paths = doc["paths"]
    assert paths["/v1/stock"]["get"]["operationId"] == "listStock"
    put_op = paths["/v1/stock/{location}/{sku}"]["put"]
    assert {p["name"] for p in put_op["parameters"]} >= {"If-Match", "If-None-Match"}
    assert "412" in put_op["responses"] and "Location" in put_op["responses"]["201"]["headers"]
    assert "ETag" in paths["/v1/stock/{location}/{sku}"]["get"]["responses"]["200"]["headers"]
    assert "Location" in paths["/v1/reservations"]["post"]["responses"]["201"]["headers"]
    assert "Location" in paths["/v1/webhooks"]["post"]["responses"]["201"]["headers"]


async def test_if_none_match_on_an_adjustment_is_refused_and_writes_nothing(
        api: ApiTenant) -> None:
    """If-None-Match on an adjustment (`*`, which can never hold for a line that exists,
    or anything else) is 400 precondition_invalid with nothing written and nothing stored
    under the key; before, it was ignored and the stock moved."""
    await put(api, "s", 10)
    for value in ("*", 'W/"1"', "garbage"):
        resp = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 5},
                                     headers={"Idempotency-Key": "adj",
                                              "If-None-Match": value})
        assert_problem(resp, 400, "precondition_invalid")
    assert (await api.client.get("/v1/stock/wh/s")).json()["on_hand"] == 10
    done = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 5},
                                 headers={"Idempotency-Key": "adj"})
    assert done.status_code == 200 and done.json()["on_hand"] == 15
