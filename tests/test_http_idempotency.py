"""Idempotency-Key over HTTP: required where documented, replays byte-for-byte, rejects reuse."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
import psycopg
from fastapi import FastAPI

from conftest import ApiTenant
from pgreserve import Database, ReservationService
from pgreserve.http import create_app
from test_http_api import assert_problem, put_stock, reserve

CART = [("s", "wh", 2)]


async def test_missing_key_is_400(api: ApiTenant) -> None:
    """POST /v1/reservations and adjustments without Idempotency-Key are 400."""
    await put_stock(api, "s", 5)
    resp = await api.client.post("/v1/reservations",
                                 json={"lines": [{"sku": "s", "location": "wh", "quantity": 1}]})
    assert_problem(resp, 400, "idempotency_key_missing")
    resp = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 1})
    assert_problem(resp, 400, "idempotency_key_missing")
    assert (await api.client.get("/v1/stock/wh/s")).json()["reserved"] == 0


def _written(dsn: str, tenant: int) -> tuple[int, ...]:
    """The tenant's rows in the tables a keyed operation writes."""
    counts = []
    with psycopg.connect(dsn) as conn:
        for table in ("reservation", "request_ledger", "outbox_event", "stock_movement"):
            row = conn.execute(f"SELECT count(*) FROM {table} WHERE tenant_id = %s",  # noqa: S608
                               (tenant,)).fetchone()
            assert row is not None
            counts.append(int(row[0]))
    return tuple(counts)


async def test_an_empty_key_is_refused_everywhere_and_writes_nothing(
        api: ApiTenant, dsn: str) -> None:
    """An Idempotency-Key header sent empty is 400 idempotency_key_invalid (docs/api.md)
    where a key is required and where it is optional: a claim, release or extend with an
    empty key is refused, not run without a key. Nothing is written."""
    await put_stock(api, "s", 5)
    held = await reserve(api, "held-1", CART)
    rid = held.json()["id"]
    empty = {"Idempotency-Key": ""}
    before = _written(dsn, api.tenant.id)
    line = {"lines": [{"sku": "s", "location": "wh", "quantity": 1}]}
    answers = [
        await api.client.post("/v1/reservations", json=line, headers=empty),
        await api.client.post(f"/v1/reservations/{rid}/claim", headers=empty),
        await api.client.post(f"/v1/reservations/{rid}/release", headers=empty),
        await api.client.post(f"/v1/reservations/{rid}/extend", json={"ttl_seconds": 60},
                              headers=empty),
        await api.client.put(f"/v1/reservations/{rid}/lines", json=line, headers=empty),
        await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 1}, headers=empty),
    ]
    for resp in answers:
        doc = assert_problem(resp, 400, "idempotency_key_invalid")
        assert "empty" in doc["detail"]
    assert _written(dsn, api.tenant.id) == before
    stock = (await api.client.get("/v1/stock/wh/s")).json()
    assert (stock["on_hand"], stock["reserved"]) == (5, 2)
    assert (await api.client.get(f"/v1/reservations/{rid}")).content == held.content


async def test_a_repeated_key_or_authorization_header_is_refused(
        app: FastAPI, api: ApiTenant, other: ApiTenant, dsn: str) -> None:
    """Two Idempotency-Key headers are 400 idempotency_key_invalid and two Authorization
    headers 401, whichever comes first and even when both name the same value: the
    request is ambiguous, nothing is written, and no later request finds either key."""
    await put_stock(api, "s", 5)
    held = await reserve(api, "held-1", CART)
    rid = held.json()["id"]
    before = _written(dsn, api.tenant.id)
    line = {"lines": [{"sku": "s", "location": "wh", "quantity": 1}]}
    bearer = api.client.headers["Authorization"]
    for keys in (["first", "second"], ["same", "same"]):
        headers = [("Idempotency-Key", k) for k in keys]
        for resp in (await api.client.post("/v1/reservations", json=line, headers=headers),
                     await api.client.post(f"/v1/reservations/{rid}/claim", headers=headers),
                     await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 1},
                                           headers=headers)):
            assert "2" in assert_problem(resp, 400, "idempotency_key_invalid")["detail"]
    for second in (bearer, "Bearer nope", other.client.headers["Authorization"]):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as bare:
            headers = [("Authorization", bearer), ("Authorization", second),
                       ("Idempotency-Key", "auth-twice")]
            for resp in (await bare.post("/v1/reservations", json=line, headers=headers),
                         await bare.post(f"/v1/reservations/{rid}/release", headers=headers),
                         await bare.get("/v1/stock/wh/s", headers=headers[:2])):
                assert_problem(resp, 401, "unauthorized")
    assert _written(dsn, api.tenant.id) == before
    for key in ("first", "second", "same", "auth-twice"):
        assert (await api.client.get(f"/v1/requests/{key}")).status_code == 404
    stock = (await api.client.get("/v1/stock/wh/s")).json()
    assert (stock["on_hand"], stock["reserved"]) == (5, 2)


async def test_overlong_key_is_400(api: ApiTenant) -> None:
    """A key over 200 characters, bare or as a structured-field string, is 400
    idempotency_key_invalid (the draft's answer to a malformed key) and holds nothing."""
    await put_stock(api, "s", 5)
    assert_problem(await reserve(api, "k" * 201, CART), 400, "idempotency_key_invalid")
    assert_problem(await reserve(api, '"' + "k" * 201 + '"', CART), 400,
                   "idempotency_key_invalid")
    assert (await reserve(api, '"' + "k" * 200 + '"', CART)).status_code == 201
    assert (await api.client.get("/v1/stock/wh/s")).json()["reserved"] == 2


async def test_quoted_key_is_the_same_key_as_the_bare_one(api: ApiTenant) -> None:
    """`"abc"` (the draft's sf-string form) and `abc` name one key: the second replays the
    first and one reservation holds; escapes decode (`"a\\"b"` is `a"b`)."""
    await put_stock(api, "s", 5)
    first = await reserve(api, '"abc"', CART)
    again = await reserve(api, "abc", CART)
    assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    escaped = await reserve(api, '"a\\"b\\\\c"', [("s", "wh", 1)])
    plain = await reserve(api, 'a"b\\c', [("s", "wh", 1)])
    assert escaped.status_code == 201 and plain.headers["idempotent-replayed"] == "true"
    claim = await api.client.post(f"/v1/reservations/{first.json()['id']}/claim",
                                  headers={"Idempotency-Key": '"pay-1"'})
    replay = await api.client.post(f"/v1/reservations/{first.json()['id']}/claim",
                                   headers={"Idempotency-Key": "pay-1"})
    assert claim.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
    assert (await api.client.get("/v1/stock/wh/s")).json()["reserved"] == 1


async def test_malformed_quoted_keys_are_400_and_write_nothing(api: ApiTenant) -> None:
    """A structured-field string that is unterminated, empty, escapes another character,
    holds non-ASCII or carries parameters is 400 idempotency_key_invalid, on reserve and
    on claim, and nothing is held."""
    await put_stock(api, "s", 5)
    held = await reserve(api, "ok-1", CART)
    body = {"lines": [{"sku": "s", "location": "wh", "quantity": 2}]}
    bad_keys = [b'"abc', b'""', b'"a\\nb"', b'"a\tb"', b'"abc";p=1', b'"abc" x',
                '"caf\u00e9"'.encode()]
    for bad in bad_keys:
        headers = {b"Idempotency-Key": bad}
        resp = await api.client.post("/v1/reservations", json=body, headers=headers)
        assert_problem(resp, 400, "idempotency_key_invalid")
        resp = await api.client.post(f"/v1/reservations/{held.json()['id']}/claim",
                                     headers=headers)
        assert_problem(resp, 400, "idempotency_key_invalid")
    stock = (await api.client.get("/v1/stock/wh/s")).json()
    assert (stock["on_hand"], stock["reserved"]) == (5, 2)


async def test_same_key_same_body_replays_bytes(api: ApiTenant) -> None:
    """The same key and body replays the first 201 byte-for-byte, marked, without taking stock."""
    await put_stock(api, "s", 5)
    first = await reserve(api, "k1", CART)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    await api.client.post(f"/v1/reservations/{first.json()['id']}/claim")
    again = await reserve(api, "k1", CART)
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    stock = (await api.client.get("/v1/stock/wh/s")).json()
    assert (stock["on_hand"], stock["reserved"]) == (3, 0)


async def test_rejected_reserve_replays_its_409(api: ApiTenant) -> None:
    """A stored insufficient_stock answer replays as the same 409 even after stock arrives."""
    await put_stock(api, "s", 1)
    first = await reserve(api, "k1", CART)
    assert_problem(first, 409, "insufficient_stock")
    await put_stock(api, "s", 100)
    again = await reserve(api, "k1", CART)
    assert again.status_code == 409 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"


async def test_same_key_other_body_is_422(api: ApiTenant) -> None:
    """The same key with another body is 422 idempotency_key_reused; the first is untouched."""
    await put_stock(api, "s", 5)
    first = await reserve(api, "k1", CART)
    assert_problem(await reserve(api, "k1", [("s", "wh", 3)]), 422, "idempotency_key_reused")
    assert_problem(await reserve(api, "k1", CART, ttl=60), 422, "idempotency_key_reused")
    resp = await api.client.post("/v1/stock/wh/s/adjustments", json={"delta": 1},
                                 headers={"Idempotency-Key": "k1"})
    assert_problem(resp, 422, "idempotency_key_reused")
    got = await api.client.get(f"/v1/reservations/{first.json()['id']}")
    assert got.json() == first.json()


async def test_adjustment_replay(api: ApiTenant) -> None:
    """A repeated adjustment applies once and replays its first answer byte-for-byte."""
    await put_stock(api, "s", 5)
    args = {"json": {"delta": 2, "reason": "receipt"}, "headers": {"Idempotency-Key": "a"}}
    first = await api.client.post("/v1/stock/wh/s/adjustments", **args)  # type: ignore[arg-type]  # httpx's keyword types; args is built above
    again = await api.client.post("/v1/stock/wh/s/adjustments", **args)  # type: ignore[arg-type]  # httpx's keyword types; args is built above
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert (await api.client.get("/v1/stock/wh/s")).json()["on_hand"] == 7


async def test_keyed_extend_replays(api: ApiTenant) -> None:
    """A retried extend with the same key does not push the expiry again; another id is 422."""
    await put_stock(api, "s", 5)
    rid = (await reserve(api, "k1", CART)).json()["id"]
    other = (await reserve(api, "k2", CART)).json()["id"]
    h = {"Idempotency-Key": "e1"}
    first = await api.client.post(f"/v1/reservations/{rid}/extend", json={"ttl_seconds": 1800},
                                  headers=h)
    again = await api.client.post(f"/v1/reservations/{rid}/extend", json={"ttl_seconds": 1800},
                                  headers=h)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    resp = await api.client.post(f"/v1/reservations/{other}/extend", json={"ttl_seconds": 1800},
                                 headers=h)
    assert_problem(resp, 422, "idempotency_key_reused")


async def test_keys_are_per_tenant(api: ApiTenant, other: ApiTenant) -> None:
    """Two tenants may use the same key independently."""
    await put_stock(api, "s", 5)
    await put_stock(other, "s", 5)
    a = await reserve(api, "same", CART)
    b = await reserve(other, "same", CART)
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]


async def test_concurrent_same_key_in_one_process(api: ApiTenant, dsn: str) -> None:
    """Concurrent duplicates get 409 request_in_progress or the replay; one hold is made."""
    await put_stock(api, "s", 50)
    results = await asyncio.gather(*(reserve(api, "dup", CART) for _ in range(8)))
    ok = [r for r in results if r.status_code == 201]
    busy = [r for r in results if r.status_code == 409]
    assert len(ok) + len(busy) == len(results) and ok
    assert all(r.content == ok[0].content for r in ok)
    for r in busy:
        assert_problem(r, 409, "request_in_progress")
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM reservation").fetchone() == (1,)
    final = await reserve(api, "dup", CART)
    assert final.content == ok[0].content


async def test_concurrent_same_key_across_processes(api: ApiTenant, dsn: str,
                                                    api_dsn: tuple[str, int | None]) -> None:
    """Two app instances (like two server processes) racing one key both answer the stored 201."""
    await put_stock(api, "s", 50)
    clients = []
    for _ in range(4):
        database = await Database(api_dsn[0], max_size=2, prepare_threshold=api_dsn[1]).open()
        app = create_app(database=database)
        clients.append((database, httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t",
            headers={"Authorization": f"Bearer {api.key}"})))
    try:
        body = {"lines": [{"sku": "s", "location": "wh", "quantity": 2}]}
        results = await asyncio.gather(*(
            c.post("/v1/reservations", json=body, headers={"Idempotency-Key": "race"})
            for _, c in clients))
    finally:
        for database, c in clients:
            await c.aclose()
            await database.close()
    assert {r.status_code for r in results} == {201}
    assert len({r.content for r in results}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in results) == 3
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM reservation").fetchone() == (1,)


async def test_old_keys_are_purged(api: ApiTenant, db: Database) -> None:
    """Keys older than the retention are forgotten by the janitor; newer ones are kept."""
    from conftest import Clock
    from pgreserve.workers.janitor import Janitor, JanitorConfig

    await put_stock(api, "s", 5)
    await reserve(api, "old", CART)
    clock = Clock()
    clock.now = clock.now.replace(year=2100)  # far past every key's created_at
    janitor = Janitor(ReservationService(db, clock=clock), JanitorConfig(keep=timedelta(hours=24)))
    assert await janitor.run_once() == 1
    assert await janitor.run_once() == 0
    fresh = Janitor(ReservationService(db), JanitorConfig(keep=timedelta(hours=24)))
    await reserve(api, "new", CART)
    assert await fresh.run_once() == 0
