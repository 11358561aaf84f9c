"""PUT /v1/reservations/{id}/lines over HTTP, its OpenAPI entry, both clients, and the
rollout layer's refusal for holds kept in the legacy store."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from conftest import ApiTenant, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.client import AsyncClient, Client
from pgreserve.domain import Line, ShortLine
from pgreserve.errors import ChangeNotMirrored, IdempotencyKeyReused, ReservationClaimed
from pgreserve.http.openapi import openapi_schema
from pgreserve.rollout import Mode, RedisHoldStore, Rollout, set_mode
from test_client import server  # noqa: F401 - the fixture
from test_http_api import assert_problem, put_stock, reserve
from test_rollout import redis_server, seed, store  # noqa: F401 - the fixtures


def cart(*lines: tuple[str, int]) -> dict[str, object]:
    return {"lines": [{"sku": s, "location": "wh", "quantity": q} for s, q in lines]}


async def held_id(api: ApiTenant, key: str, lines: list[tuple[str, str, int]]) -> str:
    resp = await reserve(api, key, lines)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


async def test_put_lines_changes_the_cart_and_a_replay_answers_the_same_bytes(
        api: ApiTenant) -> None:
    """PUT lines answers 200 with the reservation holding the new cart (same expiry); the
    same key and body replay the same bytes with Idempotent-Replayed; the request lookup
    shows the change; the same key with another cart is 422 idempotency_key_reused."""
    for sku in ("a", "b"):
        await put_stock(api, sku, 10)
    rid = await held_id(api, "r1", [("a", "wh", 2)])
    before = (await api.client.get(f"/v1/reservations/{rid}")).json()
    url = f"/v1/reservations/{rid}/lines"
    resp = await api.client.put(url, headers={"Idempotency-Key": "c1"},
                                json=cart(("b", 3), ("a", 5)))
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert doc["lines"] == [{"sku": "a", "location": "wh", "quantity": 5},
                            {"sku": "b", "location": "wh", "quantity": 3}]
    assert doc["expires_at"] == before["expires_at"] and doc["status"] == "active"
    again = await api.client.put(url, headers={"Idempotency-Key": "c1"},
                                 json=cart(("b", 3), ("a", 5)))
    assert again.status_code == 200 and again.content == resp.content
    assert again.headers["Idempotent-Replayed"] == "true"
    assert (await api.client.get("/v1/stock/wh/a")).json()["available"] == 5
    looked = (await api.client.get("/v1/requests/c1")).json()
    assert looked["operation"] == "change" and looked["outcome"] == "held"
    assert looked["status"] == 200 and looked["answer"] == doc
    reused = await api.client.put(url, headers={"Idempotency-Key": "c1"}, json=cart(("a", 1)))
    assert_problem(reused, 422, "idempotency_key_reused")


async def test_put_lines_rejections_are_problems_stored_under_the_key(
        api: ApiTenant, service: ReservationService) -> None:
    """A short line is 409 insufficient_stock with its short lines (replayed as such, and
    shown by the request lookup), a frozen bucket 423 bucket_frozen; nothing changes."""
    await put_stock(api, "a", 4)
    await put_stock(api, "b", 4)
    rid = await held_id(api, "r1", [("a", "wh", 2)])
    url = f"/v1/reservations/{rid}/lines"
    short = await api.client.put(url, headers={"Idempotency-Key": "c1"}, json=cart(("a", 9)))
    doc = assert_problem(short, 409, "insufficient_stock")
    assert doc["short_lines"] == [{"sku": "a", "location": "wh", "requested": 9,
                                   "available": 4}]
    replay = await api.client.put(url, headers={"Idempotency-Key": "c1"}, json=cart(("a", 9)))
    assert replay.content == short.content and replay.headers["Idempotent-Replayed"] == "true"
    looked = (await api.client.get("/v1/requests/c1")).json()
    assert looked["outcome"] == "rejected" and looked["status"] == 409
    assert looked["answer"] == doc
    await service.freeze(api.tenant.id, "count", "ops", sku="b", location="wh")
    frozen = await api.client.put(url, headers={"Idempotency-Key": "c2"},
                                  json=cart(("a", 2), ("b", 1)))
    doc = assert_problem(frozen, 423, "bucket_frozen")
    assert doc["frozen_lines"] == [{"sku": "b", "location": "wh"}]
    got = (await api.client.get(f"/v1/reservations/{rid}")).json()
    assert got["lines"] == [{"sku": "a", "location": "wh", "quantity": 2}]


async def test_put_lines_errors_are_typed_and_write_nothing(
        api: ApiTenant, other: ApiTenant, dsn: str) -> None:
    """No Idempotency-Key is 400, an empty cart or a repeated line 422 invalid_request, an
    unknown SKU 404 unknown_stock, another tenant's reservation 404, a claimed one 409
    reservation_claimed, a released one 409 reservation_released; nothing is written."""
    await put_stock(api, "a", 10)
    rid = await held_id(api, "r1", [("a", "wh", 2)])
    claimed = await held_id(api, "r2", [("a", "wh", 1)])
    released = await held_id(api, "r3", [("a", "wh", 1)])
    assert (await api.client.post(f"/v1/reservations/{claimed}/claim")).status_code == 200
    assert (await api.client.post(f"/v1/reservations/{released}/release")).status_code == 200
    url = f"/v1/reservations/{rid}/lines"
    before = table_counts(dsn)
    assert_problem(await api.client.put(url, json=cart(("a", 1))), 400,
                   "idempotency_key_missing")
    assert_problem(await api.client.put(url, headers={"Idempotency-Key": "k"},
                                        json={"lines": []}), 422, "invalid_request")
    assert_problem(await api.client.put(url, headers={"Idempotency-Key": "k"},
                                        json=cart(("a", 1), ("a", 2))), 422, "invalid_request")
    missing = assert_problem(await api.client.put(url, headers={"Idempotency-Key": "k"},
                                                  json=cart(("zz", 1))), 404, "unknown_stock")
    assert missing["unknown_stock"] == [{"sku": "zz", "location": "wh"}]
    assert_problem(await other.client.put(url, headers={"Idempotency-Key": "k"},
                                          json=cart(("a", 1))), 404, "reservation_not_found")
    assert_problem(await api.client.put(f"/v1/reservations/{claimed}/lines",
                                        headers={"Idempotency-Key": "k"},
                                        json=cart(("a", 1))), 409, "reservation_claimed")
    assert_problem(await api.client.put(f"/v1/reservations/{released}/lines",
                                        headers={"Idempotency-Key": "k"},
                                        json=cart(("a", 1))), 409, "reservation_released")
    assert table_counts(dsn) == before


def test_openapi_documents_the_change(app: FastAPI) -> None:
    """The OpenAPI document has PUT /v1/reservations/{reservation_id}/lines as
    changeReservation, with a required Idempotency-Key, the cart body, the reservation as
    200 and the rejections' problems; a created reservation links to it."""
    schema = openapi_schema(app)
    op = schema["paths"]["/v1/reservations/{reservation_id}/lines"]["put"]
    assert op["operationId"] == "changeReservation"
    key = next(p for p in op["parameters"] if p["name"] == "Idempotency-Key")
    assert key["required"] is True
    body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body == "#/components/schemas/ChangeIn"
    lines = schema["components"]["schemas"]["ChangeIn"]["properties"]["lines"]
    assert (lines["minItems"], lines["maxItems"]) == (1, 100)
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"] == \
        "#/components/schemas/ReservationOut"
    for status in ("400", "404", "409", "422", "423"):
        assert status in op["responses"]
    links = schema["paths"]["/v1/reservations"]["post"]["responses"]["201"]["links"]
    assert links["ChangeReservation"]["operationId"] == "changeReservation"


def test_sync_client_changes_a_cart(server: tuple[str, str]) -> None:  # noqa: F811
    """The sync client's change returns the held outcome with the new lines, a short one
    as an outcome with its short lines, replays under its key, and raises the typed errors
    (reservation_claimed, idempotency_key_reused)."""
    base, key = server
    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 5)
        shop.set_stock("cap", "berlin", 5)
        out = shop.reserve([("tee", "berlin", 2)])
        assert out.reservation is not None
        rid = out.reservation.id
        changed = shop.change(rid, [("tee", "berlin", 1), ("cap", "berlin", 4)],
                              idempotency_key="c1")
        assert changed.held and changed.reservation is not None
        assert changed.reservation.lines == (Line("cap", "berlin", 4), Line("tee", "berlin", 1))
        assert shop.change(rid, [("tee", "berlin", 1), ("cap", "berlin", 4)],
                           idempotency_key="c1").replayed
        short = shop.change(rid, [("tee", "berlin", 9)])
        assert not short.held and short.short_lines == (ShortLine("tee", "berlin", 9, 5),)
        with pytest.raises(IdempotencyKeyReused):
            shop.change(rid, [("tee", "berlin", 2)], idempotency_key="c1")
        shop.claim(rid)
        with pytest.raises(ReservationClaimed):
            shop.change(rid, [("tee", "berlin", 2)])
        assert shop.get_stock("cap", "berlin").on_hand == 1


async def test_async_client_changes_a_cart(server: tuple[str, str]) -> None:  # noqa: F811
    """The async client's change holds the new cart and reads back the same lines."""
    base, key = server
    async with AsyncClient(base, key) as shop:
        await shop.set_stock("tee", "berlin", 5, strategy="pool")
        out = await shop.reserve([("tee", "berlin", 2)])
        assert out.reservation is not None
        changed = await shop.change(out.reservation.id, [("tee", "berlin", 4)])
        assert changed.held and changed.reservation is not None
        assert changed.reservation.lines == (Line("tee", "berlin", 4),)
        assert (await shop.get_reservation(out.reservation.id)).lines == \
            changed.reservation.lines
        assert (await shop.get_stock("tee", "berlin")).available == 1


@pytest.mark.parametrize("mode", [Mode.LEGACY, Mode.SHADOW, Mode.PRIMARY])
async def test_rollout_refuses_to_change_a_hold_kept_in_redis(
        db: Database, service: ReservationService, tenant: Tenant,
        store: RedisHoldStore, mode: Mode) -> None:  # noqa: F811
    """In legacy, shadow and primary modes a hold is kept in Redis too, which cannot
    change a cart: change raises ChangeNotMirrored and neither store changes; a hold taken
    in mode pgreserve is changed as the service changes it."""
    rollout = Rollout(service, RedisHoldStore(store.url, namespace=store.namespace),
                      mode_ttl_s=0, flush_every_s=0.05)
    try:
        await seed(service, store, tenant.id, "tee", 10)
        await set_mode(db, tenant.id, mode, "test")
        out = await rollout.reserve(tenant.id, "r1", [("tee", "berlin", 2)])
        assert out.held and out.reservation is not None
        pg_before = (await service.get_stock(tenant.id, "tee", "berlin")).available
        redis_before = await store.available(tenant.id, "tee", "berlin")
        with pytest.raises(ChangeNotMirrored):
            await rollout.change(tenant.id, out.reservation.id, [("tee", "berlin", 5)],
                                 request_key="c1")
        assert (await service.get_stock(tenant.id, "tee", "berlin")).available == pg_before
        assert await store.available(tenant.id, "tee", "berlin") == redis_before

        await set_mode(db, tenant.id, Mode.PGRESERVE, "test")
        fresh = await rollout.reserve(tenant.id, "r2", [("tee", "berlin", 1)])
        assert fresh.reservation is not None
        changed = await rollout.change(tenant.id, fresh.reservation.id,
                                       [("tee", "berlin", 3)], request_key="c2")
        assert changed.held and changed.reservation is not None
        assert changed.reservation.lines == (Line("tee", "berlin", 3),)
    finally:
        await rollout.aclose()
