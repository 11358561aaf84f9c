"""Bad input is a 4xx problem+json, never a 500, and writes nothing."""

from __future__ import annotations

from typing import Any

from conftest import ApiTenant, table_counts
from test_http_api import assert_problem, put_stock

LINE = {"sku": "s", "location": "wh", "quantity": 1}

BAD_RESERVE_BODIES: list[Any] = [
    {},
    {"lines": []},
    {"lines": "s"},
    {"lines": [LINE], "extra": 1},
    {"lines": [{**LINE, "colour": "red"}]},
    {"lines": [{**LINE, "quantity": True}]},
    {"lines": [{**LINE, "quantity": "1"}]},
    {"lines": [{**LINE, "quantity": 1.5}]},
    {"lines": [{**LINE, "quantity": 0}]},
    {"lines": [{**LINE, "quantity": -1}]},
    {"lines": [{**LINE, "quantity": 10**30}]},
    {"lines": [{**LINE, "sku": "x" * 201}]},
    {"lines": [{**LINE, "sku": ""}]},
    {"lines": [{**LINE, "sku": "a\u0000b"}]},
    {"lines": [{**LINE, "sku": None}]},
    {"lines": [LINE, LINE]},
    {"lines": [LINE] * 101},
    {"lines": [LINE], "ttl_seconds": 0},
    {"lines": [LINE], "ttl_seconds": 86401},
    {"lines": [LINE], "ttl_seconds": False},
    [LINE],
    "lines",
    None,
]


async def test_bad_reserve_bodies_are_422(api: ApiTenant, dsn: str) -> None:
    """Wrong types, unknown fields, bools, out-of-range numbers, long strings: 422, no write."""
    # One database for all bodies: a fresh one per case would dominate the run time.
    await put_stock(api, "s", 5)
    before = table_counts(dsn)
    for body in BAD_RESERVE_BODIES:
        resp = await api.client.post("/v1/reservations", json=body,
                                     headers={"Idempotency-Key": "k"})
        assert_problem(resp, 422, "invalid_request")
    assert table_counts(dsn) == before


async def test_invalid_json_is_422(api: ApiTenant) -> None:
    """Unparseable JSON, non-UTF-8 bodies and lone surrogates are 422 invalid_request."""
    for raw in [b"{", b"not json", b"", b'{"lines": [}', b"\x18~\xff\xfe\x17",
                b'{"lines":[{"sku":"\\ud800","location":"wh","quantity":1}]}']:
        resp = await api.client.post("/v1/reservations", content=raw,
                                     headers={"Idempotency-Key": "k",
                                              "Content-Type": "application/json"})
        assert_problem(resp, 422, "invalid_request")


async def test_oversized_body_is_413(api: ApiTenant) -> None:
    """Bodies over 64 KiB are 413 payload_too_large, with or without Content-Length."""
    raw = b'{"lines": [' + b" " * 70_000 + b"]}"
    resp = await api.client.post("/v1/reservations", content=raw,
                                 headers={"Idempotency-Key": "k",
                                          "Content-Type": "application/json"})
    assert_problem(resp, 413, "payload_too_large")

    async def chunks() -> Any:
        for _ in range(20):
            yield b" " * 4096

    resp = await api.client.post("/v1/reservations", content=chunks(),
                                 headers={"Idempotency-Key": "k",
                                          "Content-Type": "application/json"})
    assert_problem(resp, 413, "payload_too_large")


async def test_bad_stock_bodies_are_422(api: ApiTenant) -> None:
    """PUT stock rejects negative, boolean, fractional, huge and unknown inputs."""
    for body in [{"on_hand": -1}, {"on_hand": True}, {"on_hand": 2**60}, {"on_hand": 1.5},
                 {"on_hand": "1"}, {"on_hand": 1, "strategy": "magic"}, {"onhand": 1},
                 {"on_hand": 1, "pool_cap": 3}]:
        assert_problem(await api.client.put("/v1/stock/wh/s", json=body),
                       422, "invalid_request")


async def test_bad_adjustments_are_422(api: ApiTenant) -> None:
    """Adjustments reject booleans, long or non-string reasons and huge deltas."""
    await put_stock(api, "s", 5)
    for body in [{"delta": True}, {"delta": 1, "reason": "r" * 201}, {"delta": 1, "reason": 5},
                 {"delta": 1, "reason": "a\u0000b"}, {"delta": 2**60}, {}]:
        resp = await api.client.post("/v1/stock/wh/s/adjustments", json=body,
                                     headers={"Idempotency-Key": "k"})
        assert_problem(resp, 422, "invalid_request")


async def test_bad_path_names_are_422(api: ApiTenant) -> None:
    """SKU or location names over 200 characters are 422."""
    assert_problem(await api.client.get(f"/v1/stock/wh/{'x' * 201}"), 422, "invalid_request")
    assert_problem(await api.client.put(f"/v1/stock/{'x' * 201}/s", json={"on_hand": 1}),
                   422, "invalid_request")


async def test_bad_event_queries_are_422(api: ApiTenant) -> None:
    """Malformed cursors and limits are 422."""
    for query in ["after=abc", "after=1-", "limit=0", "limit=1001", "limit=x",
                  "after=99999999999999999999-1",
                  # past every bigint, though 19 digits: no cursor the endpoint returns
                  "after=9999999999999999999-1", "after=1-9223372036854775808",
                  # digits of another script (the published pattern means ASCII)
                  "after=\uff11-1", "after=1-\u0661"]:
        assert_problem(await api.client.get(f"/v1/events?{query}"), 422, "invalid_request")


async def test_bad_extend_bodies_are_422(api: ApiTenant) -> None:
    """Extend needs a strict integer ttl_seconds within 1 s .. 24 h."""
    await put_stock(api, "s", 5)
    resp = await api.client.post("/v1/reservations", json={"lines": [LINE]},
                                 headers={"Idempotency-Key": "k"})
    rid = resp.json()["id"]
    for body in [{}, {"ttl_seconds": True}, {"ttl_seconds": 0}, {"ttl_seconds": 10**9},
                 {"ttl_seconds": 5, "x": 1}]:
        assert_problem(await api.client.post(f"/v1/reservations/{rid}/extend", json=body),
                       422, "invalid_request")


async def test_unknown_query_parameter_is_refused(api: ApiTenant) -> None:
    """A misspelt query parameter is a 422, not silently ignored."""
    resp = await api.client.get("/v1/events?afetr=1-1")
    assert resp.status_code == 422 and resp.json()["code"] == "invalid_request"
    assert "afetr" in resp.json()["detail"]
    ok = await api.client.get("/v1/events?limit=5")
    assert ok.status_code == 200


async def test_names_that_are_not_utf8_are_422_and_write_nothing(api: ApiTenant) -> None:
    """A path or query whose percent-decoded bytes are not UTF-8 is refused: the server
    hands such bytes on as U+FFFD, so `%E9` and `%E8` were one line and a count of one
    overwrote the other. A name that is U+FFFD itself, sent as UTF-8, is a name."""
    for method, url in [("PUT", "/v1/stock/w/%E9"), ("PUT", "/v1/stock/w/caf%E9"),
                        ("PUT", "/v1/skus/%FF"), ("GET", "/v1/stock/w/%E9"),
                        ("GET", "/v1/stock?sku=%E9"), ("GET", "/v1/requests/%FF"),
                        ("POST", "/v1/reservations/%FF/claim"),
                        ("POST", "/v1/reservations/%FF/release")]:
        body = {"on_hand": 5} if url.startswith("/v1/stock/") else (
            {"cart_limit": 3} if url.startswith("/v1/skus/") else None)
        resp = await api.client.request(method, url, json=body,
                                        headers={"Idempotency-Key": "k"})
        assert_problem(resp, 422, "invalid_request")
    assert (await api.client.get("/v1/stock")).json()["stock"] == []
    created = await api.client.put("/v1/stock/w/%EF%BF%BD", json={"on_hand": 5})
    assert created.status_code == 201 and created.json()["sku"] == "\ufffd"
