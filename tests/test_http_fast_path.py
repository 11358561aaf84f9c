"""The hot routes' fast path answers exactly as the FastAPI routes do, and hands on the rest.

Each test runs one sequence of requests against two apps over the same database, one
with the fast path (create_app's default) and one without (`fast_path=False`), each
for its own tenant with the same stock, and compares what came back: status, headers,
body bytes (reservation ids and tenant ids put in the order they appeared), the
request log lines and the HTTP metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI

from pgreserve import Database, ReservationService, apikeys
from pgreserve.db.database import deadline_at
from pgreserve.errors import Busy
from pgreserve.http import create_app
from pgreserve.http.app import fast_path_enabled
from pgreserve.http.dependencies import KeyLookups
from pgreserve.http.fastpath import cart_of
from pgreserve.http.requestlog import RequestLog
from test_concurrency import wait_until_blocked

NOW = datetime(2030, 1, 1, tzinfo=UTC)
UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# A request: method, path ("{r1}" names the reservation of an earlier answer), headers
# (None: the tenant's key and a JSON content type; AUTH as a value: "Bearer <the key>"),
# body bytes.
Step = tuple[str, str, dict[str, str] | None, bytes]
AUTH = "<the tenant's key>"
AUTHED = {"Authorization": AUTH}
JSON_TYPE = {"Content-Type": "application/json"}


@dataclass
class Side:
    """One app (fast path on or off), its tenant and what it answered."""

    app: FastAPI
    key: str
    tenant: int
    log: io.StringIO
    ids: list[bytes] = field(default_factory=list)
    answers: list[tuple[int, list[tuple[str, str]], bytes]] = field(default_factory=list)

    def name_ids(self, raw: bytes) -> bytes:
        """The bytes with every reservation id replaced by r<N>, N its order of appearance."""
        for found in UUID.findall(raw):
            if found not in self.ids:
                self.ids.append(found)
        for n, rid in enumerate(self.ids, 1):
            raw = raw.replace(rid, f"r{n}".encode())
        return raw

    def path(self, template: str) -> str:
        for n, rid in enumerate(self.ids, 1):
            template = template.replace(f"{{r{n}}}", rid.decode())
        return template


def make_side(db: Database, key: str, tenant: int, fast: bool, **options: Any) -> Side:
    log = io.StringIO()
    app = create_app(database=db, clock=lambda: NOW, fast_path=fast,
                     request_log=RequestLog("json", log), **options)
    return Side(app, key, tenant, log)


@contextlib.asynccontextmanager
async def client_of(side: Side) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=side.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def send(client: httpx.AsyncClient, side: Side, step: Step) -> httpx.Response:
    method, path, headers, body = step
    sent = AUTHED | JSON_TYPE if headers is None else headers
    sent = {k: f"Bearer {side.key}" if v == AUTH else v for k, v in sent.items()}
    return await client.request(method, side.path(path), headers=sent, content=body)


def record(side: Side, resp: httpx.Response) -> None:
    headers = [(k, side.name_ids(v.encode()).decode()) for k, v in resp.headers.multi_items()]
    side.answers.append((resp.status_code, headers, side.name_ids(resp.content)))


def log_lines(side: Side) -> list[dict[str, Any]]:
    assert side.app.state.request_log is not None
    side.app.state.request_log.flush()
    lines = [json.loads(line) for line in side.log.getvalue().splitlines()]
    for line in lines:
        assert line["tenant_id"] in (None, side.tenant)
        line["tenant_id"] = line["tenant_id"] is not None
        del line["ts"], line["duration_seconds"]
    return lines


def http_metrics(app: FastAPI) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The HTTP layer's counters and histogram counts (not the durations' sums)."""
    wanted = ("pgreserve_http_requests_total", "pgreserve_reservation_outcomes_total",
              "pgreserve_reservation_transitions_total",
              "pgreserve_http_request_duration_seconds_count")
    out = {}
    for metric in app.state.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name in wanted:
                out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def assert_same(fast: Side, plain: Side) -> None:
    for n, (a, b) in enumerate(zip(fast.answers, plain.answers, strict=True)):
        assert a == b, f"answer {n} differs: fast {a!r} / plain {b!r}"
    assert log_lines(fast) == log_lines(plain)
    assert http_metrics(fast.app) == http_metrics(plain.app)


def reserve(key: str | None, body: Any, headers: dict[str, str] | None = None) -> Step:
    """POST /v1/reservations with `key` (None: no Idempotency-Key); `headers` default to
    the tenant's key and a JSON content type."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = dict(AUTHED | JSON_TYPE if headers is None else headers)
    if key is not None:
        hdrs["Idempotency-Key"] = key
    return ("POST", "/v1/reservations", hdrs, raw)


def cart(*lines: tuple[Any, str, Any], **extra: Any) -> dict[str, Any]:
    return {"lines": [{"sku": s, "location": loc, "quantity": q} for s, loc, q in lines],
            **extra}


async def run_steps(side: Side, steps: list[Step]) -> None:
    async with client_of(side) as client:
        for step in steps:
            record(side, await send(client, side, step))


def sequence() -> list[Step]:
    """Every answer the hot routes give, and requests of other shapes beside them."""
    auth_only = AUTHED
    json_type = JSON_TYPE
    return [
        reserve("k1", cart(("s", "wh", 2))),                          # 201, r1
        reserve("k1", cart(("s", "wh", 2))),                          # replayed
        reserve("k1", cart(("s", "wh", 3))),                          # key reused
        reserve("k2", cart(("s", "wh", 50))),                         # insufficient
        reserve("k2", cart(("s", "wh", 50))),                         # rejection replayed
        reserve("k3", cart(("nope", "wh", 1))),                       # unknown stock
        reserve("k4", cart(("s", "wh", 1), ("t", "wh", 1), ttl_seconds=60)),  # 201, r2
        reserve("k5", cart(("s", "wh", 1), ("s", "wh", 1))),          # same line twice
        reserve(None, cart(("s", "wh", 1)), auth_only | json_type),   # no key
        reserve('"unterminated', cart(("s", "wh", 1))),               # malformed key
        reserve('"k6"', cart(("s", "wh", 1))),                        # sf-string key, r3
        reserve("k6", cart(("s", "wh", 1))),                          # the same key bare
        reserve("k7", cart(("s", "wh", 1)), json_type | {"Authorization": "Bearer nope"}),
        reserve("k7", cart(("s", "wh", 1)), json_type),               # no Authorization
        reserve("k7", cart(("s", "wh", 1)), json_type | {"Authorization": "Basic abc"}),
        # shapes the fast path hands to FastAPI
        reserve("k8", cart(("s", "wh", 1.0))),                        # a float quantity
        reserve("k9", cart(("s", "wh", 0))),                          # out of range
        reserve("k10", cart(("s", "wh", True))),                      # a bool
        reserve("k11", cart(("s", "wh", 1), reference="order-1")),    # another field
        reserve("k12", {"lines": [{"sku": "s", "quantity": 1}]}),     # a line without location
        reserve("k13", cart(("s\u00e9", "wh", 1))),                    # a non-ASCII name
        reserve("k14", cart(("s", "wh", 1), ttl_seconds=900.0)),
        reserve("k15", cart(("s", "wh", 1), ttl_seconds=0)),
        reserve("k16", {"lines": []}),
        reserve("k17", b"{not json"),
        reserve("k18", b"[]"),
        reserve("k19", json.dumps(cart(("s", "wh", 1))).encode(),
                auth_only | {"Content-Type": "text/plain"}),
        reserve("k20", json.dumps(cart(("s", "wh", 1))).encode(), auth_only),  # no type
        reserve("k21", json.dumps(cart(("s", "wh", 1))).encode(),
                auth_only | {"Content-Type": "application/json; charset=utf-8"}),
        ("POST", "/v1/reservations?x=1", auth_only | json_type | {"Idempotency-Key": "k22"},
         json.dumps(cart(("s", "wh", 1))).encode()),
        ("POST", "/v1/reservations/", auth_only | json_type | {"Idempotency-Key": "k23"},
         json.dumps(cart(("s", "wh", 1))).encode()),
        # claim and release
        ("POST", "/v1/reservations/{r1}/claim", None, b""),                # 200
        ("POST", "/v1/reservations/{r1}/claim", None, b""),                # again: 200
        ("POST", "/v1/reservations/{r1}/release", None, b""),              # claimed: 409
        ("POST", "/v1/reservations/{r2}/release", auth_only | {"Idempotency-Key": "rel-1"},
         b""),
        ("POST", "/v1/reservations/{r2}/release", auth_only | {"Idempotency-Key": "rel-1"},
         b""),                                                             # replayed
        ("POST", "/v1/reservations/{r2}/claim", None, b""),                # released: 409
        ("POST", "/v1/reservations/{r3}/claim", auth_only | {"Idempotency-Key": '"x'}, b""),
        ("POST", "/v1/reservations/{r3}/claim", auth_only | {"Idempotency-Key": ""}, b""),
        ("POST", "/v1/reservations/{r3}/release", auth_only | {"Idempotency-Key": ""}, b""),
        reserve("", cart(("s", "wh", 1))),                              # an empty key
        ("POST", "/v1/reservations/00000000-0000-0000-0000-000000000000/claim", None, b""),
        ("POST", "/v1/reservations/not-a-uuid/release", None, b""),
        ("POST", "/v1/reservations/{r3}/claim", {"Authorization": "Bearer nope"}, b""),
        ("POST", "/v1/reservations/{r3}/claim", {}, b""),
        ("POST", "/v1/reservations/{r3}/claim", None, b'{"x": 1}'),        # with a body
        ("POST", "/v1/reservations/{r3}/claim?x=1", None, b""),
        ("POST", "/v1/reservations/{r3}/extend", None, b'{"ttl_seconds": 60}'),
        ("GET", "/v1/reservations/{r3}", None, b""),
        ("POST", "/v1/reservations/{r3}/release", None, b""),              # 200
        ("POST", "/v1/reservations/a%2Fb/claim", None, b""),
        ("PUT", "/v1/reservations/{r3}/claim", None, b""),
        ("GET", "/v1/stock/wh/s", None, b""),
    ]


async def seeded(service: ReservationService, name: str) -> tuple[int, str]:
    created, key = await service.create_tenant_with_key(name)
    await service.set_stock(created.id, "s", "wh", 5)
    await service.set_stock(created.id, "t", "wh", 5, strategy="pool")
    return created.id, key


async def test_every_answer_of_the_hot_routes_matches_fastapis(
        api_db: Database, service: ReservationService) -> None:
    """The same requests (held, replayed, key reused, rejected, unknown stock, not found,
    wrong state, bad key or auth, other body shapes and routes) give the same statuses,
    headers, bytes, log lines and metrics with the fast path as without, and the fast
    path served the well-formed hot requests itself."""
    sides = []
    for name, fast in (("fast", True), ("plain", False)):
        tenant, key = await seeded(service, name)
        side = make_side(api_db, key, tenant, fast)
        await run_steps(side, sequence())
        sides.append(side)
    fast_side, plain_side = sides
    statuses = [a[0] for a in fast_side.answers]
    assert statuses[:8] == [201, 201, 422, 409, 409, 404, 201, 422]
    assert {200, 400, 401, 404, 405, 409, 422} <= set(statuses)
    assert_same(fast_side, plain_side)
    assert fast_side.app.state.fast_path_served >= 20
    assert plain_side.app.state.fast_path_served == 0
    books = [await service.get_stock(side.tenant, "s", "wh") for side in sides]
    assert (books[0].on_hand, books[0].reserved) == (books[1].on_hand, books[1].reserved)


@contextlib.contextmanager
def buckets_locked(dsn: str) -> Iterator[None]:
    """Every tenant's bucket `s` locked (a batch waits behind it) until the block ends."""
    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM stock_bucket WHERE sku = 's' FOR UPDATE")
        yield
        blocker.rollback()


@pytest.mark.parametrize("limit", [0, 1])
async def test_in_progress_too_many_and_busy_match_fastapis(
        db: Database, service: ReservationService, dsn: str, limit: int) -> None:
    """Behind a locked bucket: a second request with the key in flight (409
    request_in_progress, or 429 over a tenant limit of 1) and the first one past its
    deadline (503 busy, Retry-After) are the same with the fast path as without."""
    sides = []
    for name, fast in (("fast", True), ("plain", False)):
        tenant, key = await seeded(service, f"{name}-{limit}")
        side = make_side(db, key, tenant, fast, request_deadline_s=1.0,
                         tenant_max_in_flight=limit)
        async with client_of(side) as client:
            body = json.dumps(cart(("s", "wh", 1))).encode()
            with buckets_locked(dsn):
                held = asyncio.create_task(send(client, side, reserve("a", body)))
                await wait_until_blocked(dsn)
                record(side, await send(client, side, reserve("a", body)))
                record(side, await held)
        sides.append(side)
    fast_side, plain_side = sides
    assert [a[0] for a in fast_side.answers] == [429 if limit else 409, 503]
    assert_same(fast_side, plain_side)
    assert fast_side.app.state.fast_path_served == 2


def test_only_the_known_body_shape_is_taken() -> None:
    """cart_of takes exactly {"lines": [{sku, location, quantity}], "ttl_seconds"?} with
    values pydantic accepts as they are, and refuses any other shape (FastAPI's then)."""
    ok = cart_of(b'{"lines": [{"sku": "a", "location": "b", "quantity": 2}]}')
    assert ok == ([("a", "b", 2)], 900)
    assert cart_of(json.dumps(cart(("a", "b", 1), ttl_seconds=60)).encode()) == (
        [("a", "b", 1)], 60)
    refused: list[Any] = [cart(("a", "b", 1), reference="x"), cart(("a", "b", 1), split=True),
               {"lines": [{"sku": "a", "quantity": 1}]},
               {"lines": [{"sku": "a", "location": "b", "quantity": 1, "split": False}]},
               cart(("a", "b", 1), metadata={}), cart(("a", "b", 1.0)), cart(("a", "b", 0)),
               cart(("a", "b", 10**7)), cart(("", "b", 1)), cart(("a" * 201, "b", 1)),
               cart(("a\x00", "b", 1)), cart((1, "b", 1)), cart(("a", "b", 1), ttl_seconds=0),
               cart(("a", "b", 1), ttl_seconds=86401), cart(("a", "b", 1), ttl_seconds=None),
               {"lines": []}, {"lines": {}}, {}, [], "x", None,
               {"lines": [{"sku": "a", "location": "b", "quantity": 1}] * 101}]
    for doc in refused:
        assert cart_of(json.dumps(doc).encode()) is None, doc
    assert cart_of(b"{") is None
    assert cart_of(b"[" * 100_000) is None


def test_the_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """fast_path=None follows PGRESERVE_HTTP_FAST_PATH (on unless 0/off/false/no); an
    explicit value wins."""
    monkeypatch.delenv("PGRESERVE_HTTP_FAST_PATH", raising=False)
    assert fast_path_enabled(None) is True
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv("PGRESERVE_HTTP_FAST_PATH", off)
        assert fast_path_enabled(None) is False
        assert fast_path_enabled(True) is True
    monkeypatch.setenv("PGRESERVE_HTTP_FAST_PATH", "1")
    assert fast_path_enabled(None) is True
    assert fast_path_enabled(False) is False



class CountingService(ReservationService):
    """The real service, counting its key reads (the database answers them)."""

    reads = 0

    async def tenants_for_api_key_hashes(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        self.reads += 1
        return await super().tenants_for_api_key_hashes(hashes)


async def test_concurrent_key_lookups_share_reads_and_each_gets_its_answer(
        db: Database) -> None:
    """60 lookups asked at once (a valid key, an unknown one, a revoked one) are answered
    by fewer reads than lookups, each with its own key's tenant or None."""
    svc = CountingService(db)
    good_tenant, good = await svc.create_tenant_with_key("good")
    gone_tenant, gone = await svc.create_tenant_with_key("gone")
    await svc.revoke_api_key(gone_tenant.id, apikeys.shown_prefix(gone))
    unknown = apikeys.new_key()
    lookups = KeyLookups()
    keys = [good, unknown, gone] * 20
    found = await asyncio.gather(*(lookups.tenant(svc, apikeys.hash_key(k)) for k in keys))
    assert found == [good_tenant.id, None, None] * 20
    assert 1 <= svc.reads < 60


async def test_a_lookup_asked_during_a_read_waits_for_the_next_read(
        db: Database, dsn: str) -> None:
    """A lookup asked while a read is in flight is not answered by that read but by one
    started after it asked: a key revoked meanwhile is refused to it."""
    svc = CountingService(db)
    tenant, key = await svc.create_tenant_with_key("acme")
    digest = apikeys.hash_key(key)
    lookups = KeyLookups()
    with psycopg.connect(dsn) as locker:
        locker.execute("LOCK TABLE api_key IN ACCESS EXCLUSIVE MODE")
        first = asyncio.create_task(lookups.tenant(svc, digest))
        await _until_a_backend_waits(dsn)
        second = asyncio.create_task(lookups.tenant(svc, digest))
        await asyncio.sleep(0.05)
        assert not second.done()
        locker.rollback()
    assert await first == tenant.id
    assert await second == tenant.id
    assert svc.reads == 2
    await svc.revoke_api_key(tenant.id, apikeys.shown_prefix(key))
    assert await lookups.tenant(svc, digest) is None


async def test_a_failed_read_is_the_error_of_every_lookup_it_answers(db: Database) -> None:
    """A read that cannot run (every waiter's deadline has passed) raises Busy in each
    lookup it was to answer, and the next lookup reads again."""
    svc = CountingService(db)
    tenant, key = await svc.create_tenant_with_key("acme")
    lookups = KeyLookups()
    with deadline_at(time.monotonic() - 1):
        found = await asyncio.gather(*(lookups.tenant(svc, apikeys.hash_key(key))
                                       for _ in range(5)), return_exceptions=True)
    assert all(isinstance(x, Busy) for x in found), found
    assert await lookups.tenant(svc, apikeys.hash_key(key)) == tenant.id


async def _until_a_backend_waits(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(500):
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname ="
                               " current_database() AND wait_event_type = 'Lock'").fetchone()
            if row is not None and row[0] >= 1:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("no backend ever waited on the lock")
