"""API keys checked in the reserve's own batch: no read of their own, no weaker check.

Once the database accepted a key, the API routes the next reserves with it to their
tenant's batch at once and `bucket_batch_keyed_v1` checks the key in the batch's own
transaction, which starts after the request arrived. A key revoked before a request is
refused exactly as before (401, nothing written, nothing replayed); the others of the
same batch are served.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import psycopg
import pytest
import pytest_asyncio

from pgreserve import Database, ReservationService, apikeys
from pgreserve.db import literals as lit
from pgreserve.errors import UNKNOWN_API_KEY, ApiKeyRefused, InvalidRequest
from pgreserve.http import create_app
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked

KEYED = ("SELECT bucket_batch_keyed_v1(%s::bytea[], %s, %s, %s::text[], %s::text[],"
         " %s::text[], %s::integer[], %s::interval[], %s::uuid[])")


def ledger_keys(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {r[0] for r in conn.execute("SELECT request_key FROM request_ledger")}


def reservations(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM reservation").fetchone()
    assert row is not None
    return int(row[0])


async def test_the_batch_refuses_each_bad_key_alone_and_serves_the_rest(
        service: ReservationService, dsn: str) -> None:
    """A batch of five reserves (an active key, a revoked key, no key to check, another
    tenant's key, an unknown key): answers in the requests' places, PR403 for the three
    bad keys, and nothing written or replayed for them."""
    tenant, good = await service.create_tenant_with_key("shop")
    _, gone = await service.create_tenant_with_key("shop-2")
    await service.revoke_api_key((await service.tenant_by_name("shop-2")).id,  # type: ignore[union-attr]  # created above
                                 apikeys.shown_prefix(gone))
    other_tenant, other = await service.create_tenant_with_key("other")
    await service.set_stock(tenant.id, "s", "w", 10)
    revoked_of_shop = await service.create_api_key(tenant.id)
    await service.revoke_api_key(tenant.id, apikeys.shown_prefix(revoked_of_shop))
    bucket = await bucket_id(service.db, tenant.id, "s")
    hashes: list[bytes | None] = [apikeys.hash_key(good), apikeys.hash_key(revoked_of_shop),
                                  None, apikeys.hash_key(other),
                                  apikeys.hash_key(apikeys.new_key())]
    keys = ["ok-1", "revoked", "ok-2", "other-tenant", "unknown"]
    n = len(keys)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(KEYED, (
            lit.nullable_bytea_array(hashes), tenant.id, bucket, ["reserve"] * n, keys,
            ["d"] * n, [1] * n, ["600 s"] * n, [None] * n)).fetchone()
    assert row is not None
    answers: list[dict[str, Any]] = row[0]
    assert [("ok" in a, a.get("error")) for a in answers] == [
        (True, None), (False, "PR403"), (True, None), (False, "PR403"), (False, "PR403")]
    # the batch says what every other refusal of a key says
    assert {a["message"] for a in answers if "error" in a} == {UNKNOWN_API_KEY}
    assert all(a["ok"]["status"] == "held" for a in (answers[0], answers[2]))
    assert ledger_keys(dsn) == {"ok-1", "ok-2"}
    assert reservations(dsn) == 2
    assert other_tenant.id != tenant.id
    # every key refused: nothing runs, every answer a refusal
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(KEYED, (
            lit.nullable_bytea_array([apikeys.hash_key(other)] * 2), tenant.id, bucket,
            ["reserve"] * 2, ["x", "y"], ["d"] * 2, [1] * 2, ["600 s"] * 2,
            [None] * 2)).fetchone()
        assert row is not None and [a.get("error") for a in row[0]] == ["PR403", "PR403"]
        # a refused request between two kept ones: the kept keep their own reference
        # and metadata (the arrays are compacted together)
        row = conn.execute(KEYED[:-1] + ", NULL, %s::text[], %s::jsonb[])", (
            lit.nullable_bytea_array([apikeys.hash_key(good), apikeys.hash_key(other),
                                      None]),
            tenant.id, bucket, ["reserve"] * 3, ["m1", "m2", "m3"], ["d"] * 3, [1] * 3,
            ["600 s"] * 3, [None] * 3, ["cart-1", "cart-2", None],
            ['{"a": "1"}', '{"b": "2"}', None])).fetchone()
        assert row is not None
        kept = [a.get("ok", {}).get("reservation") for a in row[0]]
        assert [a.get("error") for a in row[0]] == [None, "PR403", None]
        assert [(r["reference"], r["metadata"]) for r in (kept[0], kept[2])] == [
            ("cart-1", {"a": "1"}), (None, {})]
        with pytest.raises(psycopg.Error, match="one API key"):
            conn.execute(KEYED, (lit.nullable_bytea_array([None]), tenant.id, bucket,
                                 ["reserve"] * 2, ["x", "y"], ["d"] * 2, [1] * 2,
                                 ["600 s"] * 2, [None] * 2))
    assert ledger_keys(dsn) == {"ok-1", "ok-2", "m1", "m3"}


@pytest.mark.parametrize("batching", [True, False])
async def test_the_service_checks_the_key_where_the_reserve_runs(
        db: Database, dsn: str, batching: bool) -> None:
    """reserve, claim and release (api_key_hash=): an active key of the tenant is served;
    a revoked key, or one of another tenant, is ApiKeyRefused with nothing stored under
    the request key and the reservation as it was, batched or not, and for a two-line
    cart (never batched); a malformed hash is InvalidRequest."""
    svc = ReservationService(db, batching=batching)
    tenant, key = await svc.create_tenant_with_key("shop")
    _, other = await svc.create_tenant_with_key("other")
    await svc.set_stock(tenant.id, "s", "w", 10)
    await svc.set_stock(tenant.id, "t", "w", 10)
    good = apikeys.hash_key(key)
    held = await svc.reserve(tenant.id, "k1", [("s", "w", 1)], api_key_hash=good)
    assert held.held
    for bad, cart in ((apikeys.hash_key(other), [("s", "w", 1)]),
                      (apikeys.hash_key(other), [("s", "w", 1), ("t", "w", 1)])):
        with pytest.raises(ApiKeyRefused):
            await svc.reserve(tenant.id, f"bad-{len(cart)}", cart, api_key_hash=bad)
    assert held.reservation is not None
    rid = held.reservation.id
    for operation in (svc.claim, svc.release):
        with pytest.raises(ApiKeyRefused):
            await operation(tenant.id, rid, request_key="t-bad",
                            api_key_hash=apikeys.hash_key(other))
    assert (await svc.get_reservation(tenant.id, rid)).status.value == "active"
    await svc.revoke_api_key(tenant.id, apikeys.shown_prefix(key))
    with pytest.raises(ApiKeyRefused):
        await svc.reserve(tenant.id, "k1", [("s", "w", 1)], api_key_hash=good)  # no replay
    with pytest.raises(ApiKeyRefused):
        await svc.claim(tenant.id, rid, api_key_hash=good)
    with pytest.raises(InvalidRequest, match="api_key_hash"):
        await svc.reserve(tenant.id, "k2", [("s", "w", 1)], api_key_hash=b"short")
    assert ledger_keys(dsn) == {"k1"}
    view = await svc.get_stock(tenant.id, "s", "w")
    assert view.reserved == 1


class CountingService(ReservationService):
    """Counts the API key reads (ReservationService.tenants_for_api_key_hashes)."""

    reads = 0

    async def tenants_for_api_key_hashes(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        self.reads += 1
        return await super().tenants_for_api_key_hashes(hashes)


@pytest_asyncio.fixture
async def counted(db: Database) -> AsyncIterator[tuple[httpx.AsyncClient, CountingService]]:
    app = create_app(database=db)
    async with app.router.lifespan_context(app):
        svc = CountingService(db)
        app.state.service = svc
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            yield client, svc


def reserve(client: httpx.AsyncClient, key: str, request_key: str,
            sku: str = "s") -> Any:
    return client.post("/v1/reservations", headers={
        "Authorization": f"Bearer {key}", "Idempotency-Key": request_key,
        "Content-Type": "application/json"},
        content=json.dumps({"lines": [{"sku": sku, "location": "w", "quantity": 1}]}))


async def test_an_accepted_key_is_not_read_again_and_a_revoked_one_is_refused(
        counted: tuple[httpx.AsyncClient, CountingService], dsn: str) -> None:
    """Over HTTP (the fast path): the first reserve with a key reads it, the next ones do
    not (their batches check it); once the key is revoked the next reserve is 401 with
    the body an unknown key gets, nothing is stored, and the one after reads again."""
    client, svc = counted
    tenant, key = await svc.create_tenant_with_key("shop")
    await svc.set_stock(tenant.id, "s", "w", 100)
    first = await reserve(client, key, "k0")
    assert first.status_code == 201 and svc.reads == 1
    ids = [first.json()["id"]]
    for i in range(1, 6):
        held = await reserve(client, key, f"k{i}")
        assert held.status_code == 201
        ids.append(held.json()["id"])
    auth = {"Authorization": f"Bearer {key}"}
    assert (await client.post(f"/v1/reservations/{ids[0]}/claim", headers=auth)
            ).status_code == 200
    assert (await client.post(f"/v1/reservations/{ids[1]}/release",
                              headers={**auth, "Idempotency-Key": "rel-1"})).status_code == 200
    assert svc.reads == 1  # the five reserves, the claim and the release: in their batches
    await svc.revoke_api_key(tenant.id, apikeys.shown_prefix(key))
    claim = await client.post(f"/v1/reservations/{ids[2]}/claim",
                              headers={**auth, "Idempotency-Key": "claim-2"})
    assert claim.status_code == 401 and claim.json()["code"] == "unauthorized"
    assert "claim-2" not in ledger_keys(dsn)
    assert (await svc.get_reservation(tenant.id, ids[2])).status.value == "active"
    refused = await reserve(client, key, "after-revoke")
    unknown = await reserve(client, apikeys.new_key(), "unknown-key")
    assert refused.status_code == unknown.status_code == 401
    assert refused.content == unknown.content
    assert refused.json()["code"] == "unauthorized"
    assert "after-revoke" not in ledger_keys(dsn)
    reads = svc.reads
    again = await reserve(client, key, "after-revoke")  # refused by a read now
    assert again.status_code == 401 and svc.reads == reads + 1
    replay = await reserve(client, key, "k1")  # a stored answer is not given to it
    assert replay.status_code == 401
    assert (await svc.get_stock(tenant.id, "s", "w")).reserved == 4  # one sold, one back


async def test_a_revoked_key_in_a_batch_is_refused_and_the_others_are_held(
        counted: tuple[httpx.AsyncClient, CountingService], dsn: str) -> None:
    """Requests of two keys queued behind a locked bucket go as one batch after one of
    the keys was revoked: its requests are 401 with nothing stored, the other key's are
    held."""
    client, svc = counted
    tenant, keep = await svc.create_tenant_with_key("shop")
    drop = await svc.create_api_key(tenant.id)
    await svc.set_stock(tenant.id, "s", "w", 100)
    for key, name in ((keep, "warm-keep"), (drop, "warm-drop")):  # both keys accepted once
        assert (await reserve(client, key, name)).status_code == 201
    await svc.revoke_api_key(tenant.id, apikeys.shown_prefix(drop))
    with bucket_locked(dsn, await bucket_id(svc.db, tenant.id, "s")) as blocker:
        first = asyncio.create_task(reserve(client, keep, "first"))
        await wait_until_blocked(dsn)
        queued = [asyncio.create_task(reserve(client, key, f"{name}-{i}"))
                  for i in range(4) for key, name in ((keep, "keep"), (drop, "drop"))]
        await asyncio.sleep(0.2)
        blocker.rollback()
    assert (await first).status_code == 201
    answers = {f"{name}-{i}": (await task).status_code
               for task, (i, name) in zip(queued, [(i, n) for i in range(4)
                                                   for n in ("keep", "drop")], strict=True)}
    assert answers == {**{f"keep-{i}": 201 for i in range(4)},
                       **{f"drop-{i}": 401 for i in range(4)}}
    assert not any(k.startswith("drop-") for k in ledger_keys(dsn))
    assert svc.combiner is not None and svc.combiner.stats.batches < 10


@pytest.mark.parametrize("batching", [True, False])
async def test_a_refused_key_wins_over_a_bad_id_or_request_key_batched_or_not(
        db: Database, batching: bool) -> None:
    """claim and release with an API key to check and an id or request key that is also
    wrong: the key's refusal comes first, as it does unbatched (the key is checked before
    anything else is looked at); with a good key, the id or key's own error."""
    from pgreserve.errors import ReservationNotFound

    svc = ReservationService(db, batching=batching)
    tenant, key = await svc.create_tenant_with_key("shop")
    _, other = await svc.create_tenant_with_key("other")
    await svc.set_stock(tenant.id, "s", "w", 10)
    good, bad = apikeys.hash_key(key), apikeys.hash_key(other)
    held = await svc.reserve(tenant.id, "k1", [("s", "w", 1)], api_key_hash=good)
    assert held.reservation is not None
    for operation in (svc.claim, svc.release):
        with pytest.raises(ApiKeyRefused):
            await operation(tenant.id, "not-an-id", api_key_hash=bad)
        with pytest.raises(ApiKeyRefused):
            await operation(tenant.id, held.reservation.id, request_key="",
                            api_key_hash=bad)
        with pytest.raises(ReservationNotFound):
            await operation(tenant.id, "not-an-id", api_key_hash=good)
        with pytest.raises(InvalidRequest):
            await operation(tenant.id, held.reservation.id, request_key="",
                            api_key_hash=good)
    assert (await svc.get_reservation(tenant.id, held.reservation.id)).status.value == "active"
