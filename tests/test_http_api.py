"""The HTTP API through the real app and a real database: statuses, codes, bodies."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from conftest import ApiTenant, Clock
from pgreserve import Database
from pgreserve.http import create_app

PROBLEM = "application/problem+json"


def assert_problem(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    doc: dict[str, Any] = resp.json()
    assert doc["status"] == status and doc["code"] == code
    assert doc["type"] == f"urn:pgreserve:problem:{code}"
    assert isinstance(doc["title"], str) and isinstance(doc["detail"], str)
    return doc


async def put_stock(api: ApiTenant, sku: str, on_hand: int, location: str = "wh",
                    **extra: Any) -> httpx.Response:
    resp = await api.client.put(f"/v1/stock/{location}/{sku}", json={"on_hand": on_hand, **extra})
    assert resp.status_code in (200, 201), resp.text  # 201: the PUT created the line
    return resp


async def reserve(api: ApiTenant, key: str, lines: list[tuple[str, str, int]],
                  ttl: int = 900) -> httpx.Response:
    return await api.client.post(
        "/v1/reservations", headers={"Idempotency-Key": key},
        json={"lines": [{"sku": s, "location": loc, "quantity": q} for s, loc, q in lines],
              "ttl_seconds": ttl})


async def test_put_and_get_stock(api: ApiTenant) -> None:
    """PUT stock answers the stock view and GET returns exactly the eleven documented fields."""
    resp = await put_stock(api, "sku-1", 10, strategy="pool")
    assert resp.json() == {"sku": "sku-1", "location": "wh", "on_hand": 10, "reserved": 0,
                           "available": 10, "strategy": "pool", "version": 1,
                           "safety_stock": 0, "backorder_limit": 0, "backorder_held": 0,
                           "backorder_owed": 0}
    got = await api.client.get("/v1/stock/wh/sku-1")
    assert got.status_code == 200 and got.json() == resp.json()


async def test_get_unknown_stock_is_404(api: ApiTenant) -> None:
    """An unknown (location, sku) is 404 unknown_stock."""
    assert_problem(await api.client.get("/v1/stock/wh/nope"), 404, "unknown_stock")


async def test_adjustments(api: ApiTenant) -> None:
    """A receipt adds units; a correction below the held units is 409 would_oversell."""
    await put_stock(api, "s", 5)
    resp = await api.client.post("/v1/stock/wh/s/adjustments", headers={"Idempotency-Key": "a1"},
                                 json={"delta": 3, "reason": "receipt"})
    assert resp.status_code == 200 and resp.json()["on_hand"] == 8
    assert (await reserve(api, "r1", [("s", "wh", 6)])).status_code == 201
    resp = await api.client.post("/v1/stock/wh/s/adjustments", headers={"Idempotency-Key": "a2"},
                                 json={"delta": -4, "reason": "damaged"})
    assert_problem(resp, 409, "would_oversell")
    resp = await api.client.post("/v1/stock/wh/nope/adjustments",
                                 headers={"Idempotency-Key": "a3"}, json={"delta": 1})
    assert_problem(resp, 404, "unknown_stock")


async def test_reservation_lifecycle_claim(api: ApiTenant) -> None:
    """Reserve is 201 active; claim is 200 claimed and repeating it answers the same."""
    await put_stock(api, "s", 10)
    created = await reserve(api, "k1", [("s", "wh", 3)])
    assert created.status_code == 201
    doc = created.json()
    assert doc["status"] == "active" and doc["lines"] == [
        {"sku": "s", "location": "wh", "quantity": 3}]
    assert set(doc) == {"id", "status", "created_at", "expires_at", "claimed_at",
                        "released_at", "expired_at", "lines", "reference", "metadata"}
    got = await api.client.get(f"/v1/reservations/{doc['id']}")
    assert got.status_code == 200 and got.json() == doc
    stock = (await api.client.get("/v1/stock/wh/s")).json()
    assert (stock["on_hand"], stock["reserved"], stock["available"]) == (10, 3, 7)
    first = await api.client.post(f"/v1/reservations/{doc['id']}/claim")
    assert first.status_code == 200 and first.json()["status"] == "claimed"
    again = await api.client.post(f"/v1/reservations/{doc['id']}/claim")
    assert again.status_code == 200 and again.json() == first.json()
    assert_problem(await api.client.post(f"/v1/reservations/{doc['id']}/release"),
                   409, "reservation_claimed")
    assert_problem(await api.client.post(f"/v1/reservations/{doc['id']}/extend",
                                         json={"ttl_seconds": 60}),
                   409, "reservation_not_active")
    stock = (await api.client.get("/v1/stock/wh/s")).json()
    assert (stock["on_hand"], stock["reserved"], stock["available"]) == (7, 0, 7)


async def test_release_then_claim_is_409(api: ApiTenant) -> None:
    """Release is 200 released (repeatable); a later claim is 409 reservation_released."""
    await put_stock(api, "s", 10)
    rid = (await reserve(api, "k1", [("s", "wh", 4)])).json()["id"]
    first = await api.client.post(f"/v1/reservations/{rid}/release")
    assert first.status_code == 200 and first.json()["status"] == "released"
    again = await api.client.post(f"/v1/reservations/{rid}/release")
    assert again.status_code == 200 and again.json() == first.json()
    assert_problem(await api.client.post(f"/v1/reservations/{rid}/claim"),
                   409, "reservation_released")


async def test_extend_active_reservation(api: ApiTenant) -> None:
    """Extend answers 200 with a new expiry counted from now."""
    await put_stock(api, "s", 10)
    doc = (await reserve(api, "k1", [("s", "wh", 1)], ttl=5)).json()
    resp = await api.client.post(f"/v1/reservations/{doc['id']}/extend",
                                 json={"ttl_seconds": 3600})
    assert resp.status_code == 200
    assert resp.json()["status"] == "active" and resp.json()["expires_at"] > doc["expires_at"]


async def test_claim_of_expired_reservation_whose_stock_is_gone(
        api: ApiTenant, api_db: Database) -> None:
    """An expired hold whose units were sold to someone else is 409 reservation_expired."""
    clock = Clock()
    timed = create_app(database=api_db, clock=clock)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=timed), base_url="http://t",
                                 headers={"Authorization": f"Bearer {api.key}"}) as client:
        timed_api = ApiTenant(api.tenant, api.key, client)
        await put_stock(timed_api, "s", 1)
        rid = (await reserve(timed_api, "k1", [("s", "wh", 1)], ttl=60)).json()["id"]
        clock.advance(61)
        got = await client.get(f"/v1/reservations/{rid}")
        assert got.json()["status"] == "expired"
        assert (await reserve(timed_api, "k2", [("s", "wh", 1)])).status_code == 201
        assert_problem(await client.post(f"/v1/reservations/{rid}/claim"),
                       409, "reservation_expired")
        assert_problem(await client.post(f"/v1/reservations/{rid}/extend",
                                         json={"ttl_seconds": 60}),
                       409, "reservation_not_active")


async def test_insufficient_stock_lists_short_lines(api: ApiTenant) -> None:
    """A cart that does not fit is 409 insufficient_stock with requested and available per line."""
    await put_stock(api, "a", 5)
    await put_stock(api, "b", 1)
    resp = await reserve(api, "k1", [("a", "wh", 2), ("b", "wh", 3)])
    doc = assert_problem(resp, 409, "insufficient_stock")
    assert doc["short_lines"] == [{"sku": "b", "location": "wh", "requested": 3, "available": 1}]
    stock = (await api.client.get("/v1/stock/wh/a")).json()
    assert stock["available"] == 5


async def test_reserve_unknown_stock_is_404(api: ApiTenant) -> None:
    """A cart naming stock the tenant does not have is 404 unknown_stock, naming it."""
    await put_stock(api, "a", 5)
    doc = assert_problem(await reserve(api, "k1", [("a", "wh", 1), ("zz", "wh", 1)]),
                         404, "unknown_stock")
    assert doc["unknown_stock"] == [{"sku": "zz", "location": "wh"}]


async def test_unknown_reservation_is_404(api: ApiTenant) -> None:
    """A well-formed but unknown id and a malformed id are both 404 reservation_not_found."""
    for rid in ("00000000-0000-0000-0000-000000000000", "not-a-uuid"):
        assert_problem(await api.client.get(f"/v1/reservations/{rid}"),
                       404, "reservation_not_found")
        assert_problem(await api.client.post(f"/v1/reservations/{rid}/claim"),
                       404, "reservation_not_found")


@pytest.mark.parametrize("auth", [None, "Bearer pgr_wrong", "Bearer ", "Basic abc", "pgr_x"])
async def test_missing_or_wrong_key_is_401(api: ApiTenant, auth: str | None) -> None:
    """No API key, an unknown key or another scheme is 401 unauthorized."""
    headers = {"Authorization": auth} if auth is not None else {}
    transport = api.client._transport
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 headers=headers) as anon:
        resp = await anon.get("/v1/stock/wh/s")
    assert_problem(resp, 401, "unauthorized")
    assert resp.headers["www-authenticate"] == "Bearer"


async def test_other_tenants_reservation_is_404_everywhere(
        api: ApiTenant, other: ApiTenant) -> None:
    """Another tenant's reservation id is answered exactly like a nonexistent one."""
    await put_stock(api, "s", 5)
    rid = (await reserve(api, "k1", [("s", "wh", 1)])).json()["id"]
    missing = "00000000-0000-0000-0000-000000000000"
    calls = [("GET", "", None), ("POST", "/claim", None), ("POST", "/release", None),
             ("POST", "/extend", {"ttl_seconds": 60})]
    for method, suffix, body in calls:
        theirs = await other.client.request(method, f"/v1/reservations/{rid}{suffix}", json=body)
        nothing = await other.client.request(method, f"/v1/reservations/{missing}{suffix}",
                                             json=body)
        assert_problem(theirs, 404, "reservation_not_found")
        assert_problem(nothing, 404, "reservation_not_found")
        strip = theirs.json()["detail"].replace(rid, "ID")
        assert strip == nothing.json()["detail"].replace(missing, "ID")
    assert_problem(await other.client.get("/v1/stock/wh/s"), 404, "unknown_stock")
    assert (await api.client.get(f"/v1/reservations/{rid}")).json()["status"] == "active"


async def test_healthz_and_metrics(api: ApiTenant, app: Any) -> None:
    """healthz answers ok; the ops app's metrics count the API's requests by route and
    status, and reserve outcomes."""
    from pgreserve.http.ops_app import create_ops_app

    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    await put_stock(api, "s", 1)
    await reserve(api, "k1", [("s", "wh", 1)])
    await reserve(api, "k2", [("s", "wh", 1)])
    ops = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_ops_app(state=app.state)),
                            base_url="http://ops")
    async with ops:
        text = (await ops.get("/metrics")).text
    assert ('pgreserve_http_requests_total{method="PUT",route="/v1/stock/{location}/{sku}",'
            'status="201"} 1.0') in text
    assert 'route="/v1/reservations",status="201"} 1.0' in text
    assert 'route="/v1/reservations",status="409"} 1.0' in text
    assert 'pgreserve_reservation_outcomes_total{outcome="held",replayed="false"} 1.0' in text
    assert 'pgreserve_reservation_outcomes_total{outcome="rejected",replayed="false"} 1.0' in text


async def test_unknown_route_is_problem_404(api: ApiTenant) -> None:
    """Unknown paths and methods are problem+json too."""
    assert_problem(await api.client.get("/v1/nothing"), 404, "not_found")
    assert_problem(await api.client.delete("/v1/reservations"), 405, "method_not_allowed")


async def test_an_accepted_api_key_is_trusted_for_the_cache_time_only(db: Database) -> None:
    """A key the database accepted is trusted for api_key_cache_s: revoked in the
    database, it still works on a process that cached it, and is refused once that time
    has passed; with the cache off it is refused at once. A new key works at once."""
    import asyncio

    import psycopg

    from pgreserve import ReservationService
    from pgreserve.errors import InvalidRequest

    service = ReservationService(db)
    _, key = await service.create_tenant_with_key("cached")
    apps = {ttl: create_app(database=db, api_key_cache_s=ttl) for ttl in (0.0, 0.3, 600.0)}
    clients = {ttl: httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                      base_url="http://test",
                                      headers={"Authorization": f"Bearer {key}"})
               for ttl, app in apps.items()}
    try:
        for client in clients.values():
            assert (await client.get("/v1/events")).status_code == 200
        with psycopg.connect(db.conninfo, autocommit=True) as conn:
            conn.execute("UPDATE api_key SET revoked_at = now()")
        assert (await clients[0.0].get("/v1/events")).status_code == 401
        assert (await clients[600.0].get("/v1/events")).status_code == 200
        await asyncio.sleep(0.4)
        assert (await clients[0.3].get("/v1/events")).status_code == 401
        _, fresh = await service.create_tenant_with_key("fresh")
        answer = await clients[600.0].get("/v1/events",
                                          headers={"Authorization": f"Bearer {fresh}"})
        assert answer.status_code == 200
    finally:
        for client in clients.values():
            await client.aclose()
    with pytest.raises(InvalidRequest):
        create_app(database=db, api_key_cache_s=float("nan"))
