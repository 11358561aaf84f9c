"""A reservation's reference (cart or order id) and metadata, kept from reserve on and shown
in every reservation document, and the tenant's reservation listing with keyset cursors."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from typing import Any

import psycopg
import pytest

from conftest import ApiTenant, Clock, table_counts
from pgreserve import Database, ReservationService, Tenant
from pgreserve.core.service import reservation_cursor
from pgreserve.db.queries import queries
from pgreserve.domain import Reservation, Status
from pgreserve.errors import IdempotencyKeyReused, InvalidCursor, InvalidRequest, UnknownTenant
from test_batching import bucket_id, bucket_locked
from test_concurrency import wait_until_blocked
from test_http_api import assert_problem, put_stock

META = {"order": "1001", "channel": "web", "note": ""}

BAD_REFERENCES: list[tuple[Any, str]] = [
    (7, "reference must be a string"),
    ("", "reference must not be empty"),
    ("r" * 201, "reference must be at most 200 characters"),
    ("a\x00b", "reference must not contain NUL characters"),
    ("\ud800", "reference must be valid Unicode text"),
]

BAD_METADATA: list[tuple[Any, str]] = [
    (["a", "b"], "metadata must be an object of string keys and string values"),
    ("k=v", "metadata must be an object of string keys and string values"),
    ({f"k{i}": "v" for i in range(51)}, "metadata has at most 50 keys"),
    ({"": "v"}, "metadata keys must be strings of 1 to 40 characters"),
    ({"k" * 41: "v"}, "metadata keys must be strings of 1 to 40 characters"),
    ({1: "v"}, "metadata keys must be strings of 1 to 40 characters"),
    ({"a\x00": "v"}, "metadata keys must not contain NUL characters"),
    ({"k": 5}, "metadata value of 'k' must be a string of at most 500 characters"),
    ({"k": None}, "metadata value of 'k' must be a string of at most 500 characters"),
    ({"k": "v" * 501}, "metadata value of 'k' must be a string of at most 500 characters"),
    ({"k": "v\x00"}, "metadata must not contain NUL characters"),
    ({"k": "\udfff"}, "metadata must be valid Unicode text"),
]


def stored(dsn: str, reservation_id: str) -> tuple[str | None, dict[str, str]]:
    """The reference and metadata columns of a reservation as stored."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT reference, metadata FROM reservation"
                           " WHERE reservation_id = %s", (reservation_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


# -- validation ------------------------------------------------------------------------

@pytest.mark.parametrize(("reference", "message"), BAD_REFERENCES)
async def test_a_bad_reference_is_refused_and_writes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str, reference: Any,
        message: str) -> None:
    """A reference that is not a string of 1 to 200 characters of storable text is
    InvalidRequest naming the rule, and nothing is written (not even under the key)."""
    await service.set_stock(tenant.id, "tee", "w", 5)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match=message):
        await service.reserve(tenant.id, "k", [("tee", "w", 1)], reference=reference)
    assert table_counts(dsn) == before


@pytest.mark.parametrize(("metadata", "message"), BAD_METADATA)
async def test_bad_metadata_is_refused_and_writes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str, metadata: Any,
        message: str) -> None:
    """Metadata that is not an object of at most 50 keys of 1-40 characters with string
    values of at most 500 characters is InvalidRequest naming the rule; nothing is
    written."""
    await service.set_stock(tenant.id, "tee", "w", 5)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match=message) as caught:
        await service.reserve(tenant.id, "k", [("tee", "w", 1)], metadata=metadata)
    assert caught.value.details["field"] == "metadata"
    assert table_counts(dsn) == before


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_metadata_at_its_limits_is_kept_exactly(
        db: Database, tenant: Tenant, dsn: str, batching: bool) -> None:
    """50 keys of 40 characters, values of 500 characters (or empty, or beyond ASCII) and a
    reference of 200 characters are the largest accepted, and come back as given."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 5)
    meta = {f"{i:02d}".ljust(40, "k"): ("v" * 500 if i else "") for i in range(50)}
    meta["00".ljust(40, "k")] = "grüße \"quoted\" \\ {braces} 😀"
    out = await svc.reserve(tenant.id, "k", [("tee", "w", 1)], reference="r" * 200,
                            metadata=meta)
    assert out.reservation is not None
    assert out.reservation.reference == "r" * 200 and out.reservation.metadata == meta
    assert stored(dsn, out.reservation.id) == ("r" * 200, meta)


# -- kept and shown --------------------------------------------------------------------

@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("lines", [1, 2], ids=["one-line", "two-lines"])
async def test_reference_and_metadata_show_in_every_reservation_document(
        db: Database, tenant: Tenant, strategy: str, batching: bool, lines: int,
        dsn: str) -> None:
    """Given at reserve, the reference and metadata are stored on the reservation and shown
    in the answer, its replay, GET, the request lookup, the claim's answer and the
    created and claimed events (which webhooks deliver)."""
    svc = ReservationService(db, batching=batching)
    for sku in ("tee", "cap"):
        await svc.set_stock(tenant.id, sku, "w", 5, strategy=strategy)
    cart = [("tee", "w", 1), ("cap", "w", 2)][:lines]
    out = await svc.reserve(tenant.id, "k", cart, reference="cart-7", metadata=META)
    assert out.held and out.reservation is not None
    rid = out.reservation.id
    replay = await svc.reserve(tenant.id, "k", cart, reference="cart-7", metadata=dict(META))
    claimed = await svc.claim(tenant.id, rid, request_key="c1")
    looked_up = await svc.lookup_request(tenant.id, "k")
    docs: list[Reservation] = [out.reservation, await svc.get_reservation(tenant.id, rid),
                               claimed, await svc.claim(tenant.id, rid, request_key="c1")]
    assert replay.replayed and replay.reservation is not None
    docs.append(replay.reservation)
    assert looked_up.reservation is not None
    docs += [looked_up.reservation, Reservation.from_json(looked_up.outcome["reservation"])]
    events = [e for e in (await svc.events(tenant.id)).events
              if e.payload.get("id") == rid]
    assert [e.type for e in events] == ["reservation.created", "reservation.claimed"]
    docs += [Reservation.from_json(e.payload) for e in events]
    assert all(e.payload["reference"] == "cart-7" and e.payload["metadata"] == META
               for e in events)
    for doc in docs:
        assert (doc.reference, doc.metadata) == ("cart-7", META), doc
    assert stored(dsn, rid) == ("cart-7", META)
    assert await svc.invariant_violations(tenant.id) == []


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_without_them_the_reference_is_null_and_metadata_empty(
        db: Database, tenant: Tenant, batching: bool, dsn: str) -> None:
    """A reservation made without a reference or metadata shows reference None and
    metadata {} everywhere (stored as NULL and '{}'); an empty metadata object is the same
    as none, also for the request key."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 5)
    out = await svc.reserve(tenant.id, "k", [("tee", "w", 1)])
    assert out.reservation is not None
    assert (out.reservation.reference, out.reservation.metadata) == (None, {})
    got = await svc.get_reservation(tenant.id, out.reservation.id)
    assert (got.reference, got.metadata) == (None, {})
    assert (await svc.reserve(tenant.id, "k", [("tee", "w", 1)], metadata={})).replayed
    released = await svc.release(tenant.id, out.reservation.id)
    assert (released.reference, released.metadata) == (None, {})
    assert stored(dsn, out.reservation.id) == (None, {})


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_the_same_key_with_another_reference_or_metadata_is_a_reused_key(
        db: Database, tenant: Tenant, batching: bool, dsn: str) -> None:
    """Reference and metadata are part of the request's fingerprint: the same key with
    another reference, another metadata value, or with them added or dropped raises
    IdempotencyKeyReused and writes nothing; the same ones (keys in any order) replay."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 5)
    cart = [("tee", "w", 1)]
    first = await svc.reserve(tenant.id, "k", cart, reference="cart-1", metadata=META)
    plain = await svc.reserve(tenant.id, "plain", cart)
    before = table_counts(dsn)
    for reference, metadata in [("cart-2", META), (None, META), ("cart-1", None),
                                ("cart-1", {**META, "channel": "app"}),
                                ("cart-1", {**META, "extra": "x"})]:
        with pytest.raises(IdempotencyKeyReused):
            await svc.reserve(tenant.id, "k", cart, reference=reference, metadata=metadata)
    for reference, metadata in [("cart-1", None), (None, {"a": "b"})]:
        with pytest.raises(IdempotencyKeyReused):
            await svc.reserve(tenant.id, "plain", cart, reference=reference,
                              metadata=metadata)
    assert table_counts(dsn) == before
    again = await svc.reserve(tenant.id, "k", cart, reference="cart-1",
                              metadata=dict(reversed(list(META.items()))))
    assert again.replayed and again.reservation is not None and first.reservation is not None
    assert again.reservation.id == first.reservation.id
    assert (again.reservation.reference, again.reservation.metadata) == ("cart-1", META)
    replain = await svc.reserve(tenant.id, "plain", cart)
    assert replain.replayed and replain.reservation is not None
    assert plain.reservation is not None and replain.reservation.id == plain.reservation.id


async def test_batched_reserves_each_keep_their_own_reference_and_metadata(
        db: Database, service: ReservationService, tenant: Tenant, dsn: str,
        strategy: str) -> None:
    """Reserves of one bucket queued behind a locked bucket go as one batch (the
    combiner on), each keeping its own reference and metadata (some without any), in its
    answer and in its stored row; a repeat of one key in the batch replays it."""
    await service.set_stock(tenant.id, "hot", "w", 20, strategy=strategy)
    assert (await service.reserve(tenant.id, "warm", [("hot", "w", 1)])).held  # caches the id
    bucket = await bucket_id(db, tenant.id, "hot")
    combiner = service.combiner
    assert combiner is not None

    def meta(i: int) -> dict[str, str] | None:
        return None if i % 3 == 0 else {"buyer": str(i), "slot": "x" * i}

    def ref(i: int) -> str | None:
        return None if i % 4 == 0 else f"cart-{i}"

    with bucket_locked(dsn, bucket) as blocker:
        first = asyncio.create_task(service.reserve(tenant.id, "k0", [("hot", "w", 1)],
                                                    reference=ref(0), metadata=meta(0)))
        await wait_until_blocked(dsn)
        rest = [asyncio.create_task(service.reserve(tenant.id, f"k{i}", [("hot", "w", 1)],
                                                    reference=ref(i), metadata=meta(i)))
                for i in range(1, 9)]
        await asyncio.sleep(0.2)
        blocker.rollback()
        outs = [await first, *[await t for t in rest]]
    assert max(combiner.stats.sizes) >= 8  # the eight queued together
    for i, out in enumerate(outs):
        assert out.held and out.reservation is not None
        assert (out.reservation.reference, out.reservation.metadata) == (ref(i), meta(i) or {})
        assert stored(dsn, out.reservation.id) == (ref(i), meta(i) or {})
    released = await service.release(tenant.id, outs[1].reservation.id)  # type: ignore[union-attr]
    assert (released.reference, released.metadata) == (ref(1), meta(1))
    assert await service.invariant_violations(tenant.id) == []


# -- the listing -----------------------------------------------------------------------

async def _hold(svc: ReservationService, tenant: int, key: str, reference: str | None,
                sku: str = "tee") -> Reservation:
    out = await svc.reserve(tenant, key, [(sku, "w", 1)], reference=reference)
    assert out.reservation is not None
    return out.reservation


async def _all_pages(svc: ReservationService, tenant: int, **kw: Any) -> list[Reservation]:
    found: list[Reservation] = []
    cursor = None
    while True:
        page = await svc.list_reservations(tenant, after=cursor, **kw)
        found += page.reservations
        if page.next_cursor is None:
            return found
        cursor = page.next_cursor


async def test_the_listing_pages_newest_first_by_cart_and_status(
        timed: ReservationService, tenant: Tenant, clock: Clock) -> None:
    """Reservations list newest first, a page of `limit` at a time; `reference` keeps one
    cart's; `status` keeps those statuses as the documents show them (an active hold past
    its expiry is expired), given once or several times."""
    svc = timed
    await svc.set_stock(tenant.id, "tee", "w", 100)
    made = []
    for i in range(7):
        made.append(await _hold(svc, tenant.id, f"k{i}", "cart-a" if i % 2 else "cart-b"))
        clock.advance(1)
    await svc.claim(tenant.id, made[1].id)
    await svc.release(tenant.id, made[2].id)
    short = await svc.reserve(tenant.id, "short", [("tee", "w", 1)], ttl=1,
                              reference="cart-a")
    assert short.reservation is not None
    clock.advance(2)  # `short` is past its expiry, not yet swept
    newest_first = [short.reservation.id] + [r.id for r in reversed(made)]

    page = await svc.list_reservations(tenant.id, limit=3)
    assert [r.id for r in page.reservations] == newest_first[:3]
    assert page.next_cursor is not None
    assert [r.id for r in await _all_pages(svc, tenant.id, limit=3)] == newest_first
    assert [r.id for r in await _all_pages(svc, tenant.id, limit=200)] == newest_first
    cart_a = await _all_pages(svc, tenant.id, reference="cart-a", limit=2)
    assert [r.id for r in cart_a] == [short.reservation.id, made[5].id, made[3].id,
                                      made[1].id]
    assert all(r.reference == "cart-a" for r in cart_a)
    expired = await svc.list_reservations(tenant.id, status="expired")
    assert [(r.id, r.status) for r in expired.reservations] == [
        (short.reservation.id, Status.EXPIRED)]
    active = await _all_pages(svc, tenant.id, status=["active"], limit=1)
    assert [r.id for r in active] == [made[i].id for i in (6, 5, 4, 3, 0)]
    done = await svc.list_reservations(tenant.id, status=["released", "claimed", "claimed"],
                                       reference="cart-a")
    assert [r.id for r in done.reservations] == [made[1].id]
    assert (await svc.list_reservations(tenant.id, reference="none")).reservations == ()
    last = await svc.list_reservations(tenant.id, limit=8)
    assert len(last.reservations) == 8 and last.next_cursor is None


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"limit": 0}, InvalidRequest, "limit must be between 1 and 200"),
    ({"limit": 201}, InvalidRequest, "limit must be between 1 and 200"),
    ({"limit": "5"}, InvalidRequest, "limit must be an integer"),
    ({"status": ["active", "gone"]}, InvalidRequest, "status must be one of active"),
    ({"status": []}, InvalidRequest, "name at least one status"),
    ({"reference": ""}, InvalidRequest, "reference must not be empty"),
    ({"after": "nonsense"}, InvalidCursor, "cursor must be a next_cursor"),
    ({"after": "r1.bm90IGpzb24"}, InvalidCursor, "cursor must be a next_cursor"),
    ({"after": "r1.WyJ4IiwieSJd"}, InvalidCursor, "cursor must be a next_cursor"),
    ({"after": "s1.WyJhIiwiYiJd"}, InvalidCursor, "cursor must be a next_cursor"),
])
async def test_a_bad_listing_request_is_a_typed_error(
        service: ReservationService, tenant: Tenant, kwargs: dict[str, Any],
        error: type[Exception], message: str) -> None:
    """A limit outside 1-200, an unknown status, an empty reference or a cursor the
    listing did not hand out (not base64 JSON, not a position, another listing's) is a
    typed error naming the rule."""
    with pytest.raises(error, match=message):
        await service.list_reservations(tenant.id, **kwargs)


async def test_the_listing_is_tenant_scoped(service: ReservationService,
                                            tenant: Tenant) -> None:
    """Another tenant's reservations, even under the same cart reference, never show; an
    unknown tenant is UnknownTenant."""
    other = await service.create_tenant("other")
    for t in (tenant.id, other.id):
        await service.set_stock(t, "tee", "w", 10)
    mine = await _hold(service, tenant.id, "k1", "cart-1")
    theirs = await _hold(service, other.id, "k1", "cart-1")
    assert [r.id for r in (await service.list_reservations(tenant.id)).reservations] == [
        mine.id]
    assert [r.id for r in (await service.list_reservations(
        other.id, reference="cart-1")).reservations] == [theirs.id]
    with pytest.raises(UnknownTenant):
        await service.list_reservations(999_999)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_paging_while_buyers_insert_has_no_repeats_or_gaps(
        db: Database, tenant: Tenant, batching: bool) -> None:
    """Paging three at a time (all reservations, and one cart's) while eight buyers keep
    making reservations of that cart and others: every reservation committed before the
    first page appears exactly once, nothing appears twice, and the order is newest
    first throughout."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "tee", "w", 10_000)
    await svc.set_stock(tenant.id, "cap", "w", 10_000)
    for i in range(30):
        await _hold(svc, tenant.id, f"pre{i}", "cart-x" if i % 2 else None)
    made: list[Reservation] = []
    started = asyncio.Event()

    async def buyer(n: int) -> None:
        for i in range(40):
            made.append(await _hold(svc, tenant.id, f"b{n}-{i}", "cart-x" if i % 2 else None,
                                    sku="tee" if n % 2 else "cap"))
            if i == 2:
                started.set()
            await asyncio.sleep(0)

    buyers = [asyncio.create_task(buyer(n)) for n in range(8)]
    try:
        await started.wait()
        existing = await _all_ids(svc, tenant.id)  # committed before the paging below
        during = len(made)
        seen, seen_cart = await asyncio.gather(_paged(svc, tenant.id),
                                               _paged(svc, tenant.id, "cart-x"))
        during = len(made) - during
    finally:
        await asyncio.gather(*buyers)
    assert during > 0  # buyers did insert while the pages were read
    ids = [r.id for r in seen]
    assert len(ids) == len(set(ids))
    assert set(existing) <= set(ids)
    cart_ids = [r.id for r in seen_cart]
    assert len(cart_ids) == len(set(cart_ids))
    assert all(r.reference == "cart-x" for r in seen_cart)
    final = {r.id: r for r in await _all_pages(svc, tenant.id, limit=200)}
    assert {i for i in existing if final[i].reference == "cart-x"} <= set(cart_ids)
    assert set(ids) <= set(final)
    for listed in (seen, seen_cart):
        keys = [(r.created_at, r.id) for r in listed]
        assert keys == sorted(keys, reverse=True)


async def _paged(svc: ReservationService, tenant: int,
                 reference: str | None = None) -> list[Reservation]:
    """Every page of three, the buyers committing between pages."""
    seen: list[Reservation] = []
    cursor: str | None = None
    while True:
        page = await svc.list_reservations(tenant, limit=3, after=cursor, reference=reference)
        seen += page.reservations
        if page.next_cursor is None:
            return seen
        cursor = page.next_cursor
        await asyncio.sleep(0.005)


async def _all_ids(svc: ReservationService, tenant: int) -> list[str]:
    with_ids = await _all_pages(svc, tenant, limit=200)
    return [r.id for r in with_ids]


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


@pytest.mark.parametrize(("query", "index"), [
    ("reservation_list", "reservation_list_idx"),
    ("reservation_list_by_reference", "reservation_reference_idx"),
])
async def test_the_listing_reads_only_the_tenants_range_of_its_index(
        service: ReservationService, tenant: Tenant, dsn: str, query: str,
        index: str) -> None:
    """With another tenant holding 2,000 reservations (the same cart reference) and
    statistics gathered, a page of this tenant's is an index range scan pinned to the
    tenant: no sequential scan, no sort, and no row of the other tenant read."""
    other = await service.create_tenant("big")
    for t in (tenant.id, other.id):
        await service.set_stock(t, "tee", "w", 10_000)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT reserve_v1(%s, 'o' || i, 'd', '{tee}', '{w}', '{1}',"
                     " '15 minutes', NULL, 'cart-1') FROM generate_series(1, 2000) i",
                     (other.id,))
    for i in range(20):
        await _hold(service, tenant.id, f"k{i}", "cart-1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE reservation")
        row = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queries[query],
            {"now": None, "tenant": tenant.id, "reference": "cart-1",
             "before_created": "infinity", "before_id": "ffffffff-ffff-ffff-ffff-ffffffffffff",
             "statuses": None, "limit": 11}).fetchone()
    assert row is not None
    nodes = _plan_nodes(row[0][0]["Plan"])
    kinds = [n["Node Type"] for n in nodes]
    assert "Seq Scan" not in kinds and "Sort" not in kinds, kinds
    scans = [n for n in nodes if n.get("Index Name") == index]
    assert len(scans) == 1, json.dumps(row[0])
    assert "tenant_id" in scans[0]["Index Cond"]
    assert scans[0]["Actual Rows"] == 11 and scans[0].get("Rows Removed by Filter", 0) == 0


async def test_a_cursor_is_only_a_position(service: ReservationService, tenant: Tenant) -> None:
    """A cursor continues after a (created_at, id) position whatever filters come with it,
    and one made for a position past every reservation gives an empty last page."""
    await service.set_stock(tenant.id, "tee", "w", 10)
    a = await _hold(service, tenant.id, "k1", "c")
    b = await _hold(service, tenant.id, "k2", "c")
    page = await service.list_reservations(tenant.id, limit=1)
    assert [r.id for r in page.reservations] == [b.id] and page.next_cursor is not None
    rest = await service.list_reservations(tenant.id, reference="c", after=page.next_cursor)
    assert [r.id for r in rest.reservations] == [a.id] and rest.next_cursor is None
    oldest = reservation_cursor(a.created_at, a.id)
    assert (await service.list_reservations(tenant.id, after=oldest)).reservations == ()


# -- HTTP ------------------------------------------------------------------------------

async def test_http_reserve_with_reference_and_metadata_and_list_them(
        api: ApiTenant, other: ApiTenant) -> None:
    """POST /v1/reservations takes reference and metadata and answers them (null and {}
    when absent, also on GET); GET /v1/reservations?cart=&status=&limit=&cursor= pages the
    tenant's own, newest first; a reused key with other metadata is 422."""
    await put_stock(api, "tee", 10)
    await put_stock(other, "tee", 10)
    body = {"lines": [{"sku": "tee", "location": "wh", "quantity": 1}],
            "reference": "cart-9", "metadata": META}
    first = await api.client.post("/v1/reservations", json=body,
                                  headers={"Idempotency-Key": "a"})
    assert first.status_code == 201, first.text
    assert first.json()["reference"] == "cart-9" and first.json()["metadata"] == META
    again = await api.client.post("/v1/reservations", json=body,
                                  headers={"Idempotency-Key": "a"})
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    reused = await api.client.post("/v1/reservations",
                                   json={**body, "metadata": {"order": "1002"}},
                                   headers={"Idempotency-Key": "a"})
    assert_problem(reused, 422, "idempotency_key_reused")
    plain = await api.client.post("/v1/reservations", json={"lines": body["lines"]},
                                  headers={"Idempotency-Key": "b"})
    assert plain.json()["reference"] is None and plain.json()["metadata"] == {}
    got = await api.client.get(f"/v1/reservations/{plain.json()['id']}")
    assert got.json()["reference"] is None and got.json()["metadata"] == {}
    theirs = await other.client.post("/v1/reservations", json=body,
                                     headers={"Idempotency-Key": "a"})
    assert theirs.status_code == 201

    page = await api.client.get("/v1/reservations", params={"limit": 1})
    assert page.status_code == 200, page.text
    assert [r["id"] for r in page.json()["reservations"]] == [plain.json()["id"]]
    rest = await api.client.get("/v1/reservations",
                                params={"limit": 1, "cursor": page.json()["next_cursor"]})
    assert rest.json() == {"reservations": [first.json()], "next_cursor": None}
    by_cart = await api.client.get("/v1/reservations", params=[
        ("cart", "cart-9"), ("status", "active"), ("status", "claimed")])
    assert [r["id"] for r in by_cart.json()["reservations"]] == [first.json()["id"]]
    none = await api.client.get("/v1/reservations", params={"status": "expired"})
    assert none.json() == {"reservations": [], "next_cursor": None}


def _cursor(doc: list[str]) -> str:
    """A reservation cursor of this shape, as a client could forge it."""
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return "r1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(("params", "status", "code"), [
    ({"limit": "0"}, 422, "invalid_request"),
    ({"limit": "201"}, 422, "invalid_request"),
    ({"limit": "many"}, 422, "invalid_request"),
    ({"status": "gone"}, 422, "invalid_request"),
    ([("limit", "1"), ("limit", "2")], 422, "invalid_request"),
    ([("cart", "a"), ("cart", "b")], 422, "invalid_request"),
    ({"cart": ""}, 422, "invalid_request"),
    ({"cursor": "r1.garbage"}, 400, "invalid_cursor"),
    # well-formed but not handed out: an offset PostgreSQL refuses (was a 500), a
    # nesting deeper than the JSON parser goes (was a 500), another spelling of an id
    ({"cursor": _cursor(["2020-01-01T00:00:00+16:00", str(uuid.UUID(int=0))])}, 400,
     "invalid_cursor"),
    ({"cursor": "r1." + base64.urlsafe_b64encode(b"[" * 3000).decode()}, 400,
     "invalid_cursor"),
    ({"cursor": _cursor(["2020-01-01T00:00:00+00:00", uuid.UUID(int=0).hex])}, 400,
     "invalid_cursor"),
])
async def test_http_bad_listing_parameters_are_typed_problems(
        api: ApiTenant, params: Any, status: int, code: str) -> None:
    """A bad limit, status or cart (or one given twice) is 422 invalid_request; a cursor
    the listing did not hand out is 400 invalid_cursor, as for GET /v1/stock."""
    assert_problem(await api.client.get("/v1/reservations", params=params), status, code)


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("reference", "", "reference"),
    ("reference", "r" * 201, "reference"),
    ("reference", 5, "reference"),
    ("metadata", {f"k{i}": "v" for i in range(51)}, "at most 50 keys"),
    ("metadata", {"k" * 41: "v"}, "1 to 40 characters"),
    ("metadata", {"k": "v" * 501}, "at most 500 characters"),
    ("metadata", {"k": 1}, "at most 500 characters"),
    ("metadata", ["k"], "metadata"),
])
async def test_http_bad_reference_or_metadata_is_422_and_writes_nothing(
        api: ApiTenant, dsn: str, field: str, value: Any, fragment: str) -> None:
    """A body whose reference or metadata breaks a rule is 422 invalid_request saying the
    rule, and nothing is written."""
    await put_stock(api, "tee", 10)
    before = table_counts(dsn)
    resp = await api.client.post(
        "/v1/reservations", headers={"Idempotency-Key": "k"},
        json={"lines": [{"sku": "tee", "location": "wh", "quantity": 1}], field: value})
    doc = assert_problem(resp, 422, "invalid_request")
    assert fragment in doc["detail"], doc
    assert table_counts(dsn) == before


async def test_openapi_shows_reference_metadata_and_the_listing(api: ApiTenant) -> None:
    """The OpenAPI document has reference and metadata (with their rules) on the reserve
    body and the reservation, and GET /v1/reservations (listReservations) with its
    parameters and page."""
    doc = (await api.client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    reserve = schemas["ReserveIn"]["properties"]
    assert reserve["reference"]["anyOf"][0]["maxLength"] == 200
    meta = reserve["metadata"]["anyOf"][0]
    assert meta["maxProperties"] == 50 and meta["propertyNames"]["maxLength"] == 40
    assert meta["additionalProperties"]["maxLength"] == 500
    assert {"reference", "metadata"} <= set(schemas["ReservationOut"]["required"])
    listing = doc["paths"]["/v1/reservations"]["get"]
    assert listing["operationId"] == "listReservations"
    assert {p["name"] for p in listing["parameters"]} == {"cart", "status", "limit", "cursor"}
    ok = listing["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("/ReservationPageOut")
    assert {"400", "422"} <= set(listing["responses"])


async def test_a_changed_cart_keeps_its_reference_and_metadata(
        service: ReservationService, tenant: Tenant) -> None:
    """Changing a held cart keeps the reservation's reference and metadata in the change's
    answer, in GET and in the listing by cart."""
    for sku in ("tee", "cap"):
        await service.set_stock(tenant.id, sku, "w", 10)
    out = await service.reserve(tenant.id, "k", [("tee", "w", 1)], reference="cart-3",
                                metadata=META)
    assert out.reservation is not None
    changed = await service.change(tenant.id, out.reservation.id,
                                   [("tee", "w", 2), ("cap", "w", 1)], request_key="c")
    assert changed.held and changed.reservation is not None
    assert (changed.reservation.reference, changed.reservation.metadata) == ("cart-3", META)
    got = await service.get_reservation(tenant.id, out.reservation.id)
    assert (got.reference, got.metadata) == ("cart-3", META)
    listed = await service.list_reservations(tenant.id, reference="cart-3")
    assert [r.id for r in listed.reservations] == [out.reservation.id]
    assert len(listed.reservations[0].lines) == 2
