"""Lookup by request key: the stored answer under an Idempotency-Key and, for a hold,
the reservation as it is now."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from conftest import ApiTenant
from pgreserve import ReservationService, Tenant
from pgreserve.errors import RequestInProgress, RequestNotFound
from test_http_api import assert_problem, put_stock, reserve


async def test_library_lookup_of_held_rejected_and_unknown_keys(
        service: ReservationService, tenant: Tenant, strategy: str) -> None:
    """A held key returns its stored outcome and the reservation's current state (claimed
    after a claim), a rejected key its stored rejection with no reservation, a keyed claim
    its own outcome; an unknown key, and another tenant's key, raise RequestNotFound."""
    await service.set_stock(tenant.id, "tee", "eu", 2, strategy=strategy)
    held = await service.reserve(tenant.id, "buy-1", [("tee", "eu", 2)])
    assert held.held and held.reservation
    short = await service.reserve(tenant.id, "buy-2", [("tee", "eu", 1)])
    assert not short.held

    found = await service.lookup_request(tenant.id, "buy-1")
    assert found.operation == "reserve" and found.status == "succeeded"
    assert found.outcome["status"] == "held"
    assert found.outcome["reservation"]["id"] == held.reservation.id
    assert found.reservation is not None and found.reservation.status.value == "active"

    await service.claim(tenant.id, held.reservation.id, request_key="pay-1")
    after = await service.lookup_request(tenant.id, "buy-1")
    assert after.outcome == found.outcome  # the stored answer never changes
    assert after.reservation is not None and after.reservation.status.value == "claimed"
    claim = await service.lookup_request(tenant.id, "pay-1")
    assert claim.operation == "claim" and claim.outcome["status"] == "applied"

    rejected = await service.lookup_request(tenant.id, "buy-2")
    assert rejected.status == "rejected" and rejected.reservation is None
    assert rejected.outcome["reason"] == "insufficient_stock"
    assert rejected.outcome["short_lines"][0]["available"] == 0

    other = await service.create_tenant("globex")
    for who, key in ((tenant.id, "never-sent"), (other.id, "buy-1")):
        with pytest.raises(RequestNotFound):
            await service.lookup_request(who, key)


async def test_http_lookup_returns_the_first_answer_and_the_state_now(
        api: ApiTenant, other: ApiTenant) -> None:
    """GET /v1/requests/{key} returns the status and body the request was first answered
    with, and the reservation as it is now; an unknown key (or another tenant's) is 404
    request_not_found, and without an API key it is 401."""
    await put_stock(api, "tee", 1)
    first = await reserve(api, "buy 1/a", [("tee", "wh", 1)])
    assert first.status_code == 201
    rid = first.json()["id"]
    short = await reserve(api, "buy-2", [("tee", "wh", 1)])
    assert short.status_code == 409
    assert (await api.client.post(f"/v1/reservations/{rid}/release")).status_code == 200

    got = await api.client.get("/v1/requests/buy%201%2Fa")
    assert got.status_code == 200, got.text
    doc = got.json()
    assert doc["key"] == "buy 1/a" and doc["operation"] == "reserve"
    assert doc["outcome"] == "held" and doc["status"] == 201
    assert doc["answer"] == first.json()
    assert doc["reservation"]["id"] == rid and doc["reservation"]["status"] == "released"

    lost = (await api.client.get("/v1/requests/buy-2")).json()
    assert lost["outcome"] == "rejected" and lost["status"] == 409
    assert lost["answer"] == short.json() and lost["reservation"] is None

    assert_problem(await api.client.get("/v1/requests/nope"), 404, "request_not_found")
    assert_problem(await other.client.get("/v1/requests/buy-2"), 404, "request_not_found")
    anonymous = await api.client.get("/v1/requests/buy-2", headers={"Authorization": ""})
    assert_problem(anonymous, 401, "unauthorized")


async def test_http_lookup_finds_a_key_sent_as_utf8_in_the_header(
        api: ApiTenant, other: ApiTenant) -> None:
    """A non-ASCII Idempotency-Key sent as UTF-8 is found by GET /v1/requests/{key} with
    that key percent-encoded as UTF-8; another tenant still gets 404 request_not_found."""
    await put_stock(api, "tee", 2)
    key = "commande-é-№1"
    first = await api.client.post(
        "/v1/reservations", headers={b"Idempotency-Key": key.encode("utf-8")},
        json={"lines": [{"sku": "tee", "location": "wh", "quantity": 1}]})
    assert first.status_code == 201, first.text
    got = await api.client.get("/v1/requests/" + quote(key, safe=""))
    assert got.status_code == 200, got.text
    assert got.json()["answer"] == first.json()
    theirs = await other.client.get("/v1/requests/" + quote(key, safe=""))
    assert_problem(theirs, 404, "request_not_found")
    assert key in theirs.json()["detail"]
    assert_problem(await api.client.get("/v1/requests/" + quote("commande-é-№2", safe="")),
                   404, "request_not_found")


async def test_a_key_whose_request_is_still_running_is_in_progress_not_unknown(
        service: ReservationService, api: ApiTenant, other: ApiTenant, plain_dsn: str,
        strategy: str) -> None:
    """A reserve (and a keyed claim) running in a transaction that has not committed
    holds its key: the lookup, through the library and over HTTP, is RequestInProgress
    / 409 request_in_progress with Retry-After, never "never used" (404) -- that request
    may still commit its hold, and a client told 404 would hold again under a new key.
    Once it commits the lookup returns its answer; once one rolls back, 404. Before, the
    lookup read the ledger alone and answered 404 while the hold could still commit."""
    import psycopg

    tenant = api.tenant
    for t in (tenant.id, other.tenant.id):
        await service.set_stock(t, "tee", "wh", 5, strategy=strategy)
    async with await psycopg.AsyncConnection.connect(plain_dsn, autocommit=True) as shop:
        async with shop.transaction():
            held = await service.reserve(tenant.id, "buy-1", [("tee", "wh", 2)], conn=shop)
            assert held.reservation is not None
            with pytest.raises(RequestInProgress):
                await service.lookup_request(tenant.id, "buy-1")
            busy = await api.client.get("/v1/requests/buy-1")
            assert_problem(busy, 409, "request_in_progress")
            assert busy.headers["Retry-After"] == "1"
            with pytest.raises(RequestNotFound):  # another key
                await service.lookup_request(tenant.id, "buy-2")
            assert_problem(await other.client.get("/v1/requests/buy-1"), 404,
                           "request_not_found")  # another tenant's key
        found = await service.lookup_request(tenant.id, "buy-1")
        assert found.outcome["reservation"]["id"] == held.reservation.id
        assert (await api.client.get("/v1/requests/buy-1")).json()["outcome"] == "held"

        async with shop.transaction():
            await service.claim(tenant.id, held.reservation.id, request_key="pay-1",
                                conn=shop)
            with pytest.raises(RequestInProgress):
                await service.lookup_request(tenant.id, "pay-1")
            savepoint = shop.transaction()
            await savepoint.__aenter__()
            await service.reserve(tenant.id, "buy-3", [("tee", "wh", 1)], conn=shop)
            with pytest.raises(RequestInProgress):
                await service.lookup_request(tenant.id, "buy-3")
            await savepoint.__aexit__(RuntimeError, RuntimeError("roll it back"), None)
        assert (await service.lookup_request(tenant.id, "pay-1")).operation == "claim"
        with pytest.raises(RequestNotFound):
            await service.lookup_request(tenant.id, "buy-3")
