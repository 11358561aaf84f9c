"""The hot routes' fast path (http/fastpath.py) against FastAPI.

Two apps over the same database, one with the fast path and one without, each for its
own tenant with the same stock and its own API key. The same requests (raw ASGI, so
headers, bytes and paths are exactly as written) go to both; the answers are compared
after the reservation ids are named r1, r2, ... in order of appearance, and so are the
tenant's own rows afterwards (reservations, ledger, movements, events, stock).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

import psycopg
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from pgreserve import Database, ReservationService
from pgreserve.http import create_app
from pgreserve.http.requestlog import RequestLog
from test_http_fast_path import http_metrics

VERBOSE = bool(__import__("os").environ.get("DIFF_VERBOSE"))
NOW = datetime(2030, 1, 1, tzinfo=UTC)
UUID = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                  rb"[0-9a-fA-F]{12}")
TS = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?\+00:00")
KEY = "{key}"  # in a header value: this side's API key
# A request: method, raw path (percent-encoded; "{r1}" names an earlier id), query,
# headers (None: Bearer key + application/json), body (bytes, or a list of chunks).
Hdrs = list[tuple[bytes, bytes]]
DEFAULT: Hdrs = [(b"authorization", b"Bearer {key}"), (b"content-type", b"application/json")]


@dataclass
class Req:
    method: str
    path: str
    headers: Hdrs | None = None
    body: bytes | list[bytes] = b""
    query: bytes = b""
    note: str = ""
    root_path: str = ""


@dataclass
class Side:
    app: FastAPI
    key: str
    tenant: int
    log: io.StringIO = field(default_factory=io.StringIO)
    norm_ts: bool = False
    ids: list[bytes] = field(default_factory=list)
    answers: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = field(default_factory=list)

    def name_ids(self, raw: bytes) -> bytes:
        for found in UUID.findall(raw):
            low = found.lower()
            if low not in self.ids:
                self.ids.append(low)
        for n, rid in enumerate(self.ids, 1):
            raw = raw.replace(rid, f"r{n}".encode())
            raw = raw.replace(rid.upper(), f"R{n}".encode())
        if self.norm_ts:  # the legacy store's own clock: the wall clock
            raw = TS.sub(b"<ts>", raw)
        return raw.replace(self.key.encode(), b"<key>")

    def fill(self, text: str) -> str:
        for n, rid in enumerate(self.ids, 1):
            text = text.replace(f"{{r{n}}}", rid.decode())
            text = text.replace(f"{{R{n}}}", rid.decode().upper())
        return text


async def call(side: Side, req: Req) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    raw_path = side.fill(req.path).encode("latin-1")
    path = unquote(raw_path.decode("latin-1"))  # as uvicorn: bad UTF-8 -> U+FFFD
    headers = [(k, v.replace(KEY.encode(), side.key.encode()))
               for k, v in (DEFAULT if req.headers is None else req.headers)]
    chunks = req.body if isinstance(req.body, list) else [req.body]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": req.method, "scheme": "http", "path": path, "raw_path": raw_path,
             "query_string": req.query, "root_path": req.root_path, "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return {"type": "http.disconnect"}

    status = 0
    out_headers: list[tuple[bytes, bytes]] = []
    body = b""

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal status, out_headers, body
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            body += message.get("body", b"")

    try:
        await side.app(scope, receive, send)
    except Exception as exc:  # noqa: BLE001 - a crash is an answer too
        if status == 0:
            status = -1
            body = repr(exc).encode()
    if side.norm_ts:  # a wall-clock time prints without its fraction when it is whole
        out_headers = [(k, b"<n>" if k == b"content-length" else v) for k, v in out_headers]
    return (status, [(k, side.name_ids(v)) for k, v in out_headers], side.name_ids(body))


def log_lines(side: Side) -> list[dict[str, Any]]:
    side.app.state.request_log.flush()
    lines = [json.loads(line) for line in side.log.getvalue().splitlines()]
    for line in lines:
        line["tenant_id"] = line["tenant_id"] is not None
        del line["ts"], line["duration_seconds"]
        for k, v in list(line.items()):
            if isinstance(v, str):
                line[k] = side.name_ids(v.encode()).decode()
    return lines


def side_effects_diff(fast: Side, plain: Side) -> list[str]:
    """Log lines and HTTP metrics that differ (not part of the answer, reported apart)."""
    out = []
    for n, (a, b) in enumerate(zip(log_lines(fast), log_lines(plain), strict=True)):
        if a != b:
            out.append(f"log line {n}: fast {a} / plain {b}")
    fm, pm = http_metrics(fast.app), http_metrics(plain.app)
    for k in sorted(set(fm) | set(pm), key=str):
        if fm.get(k) != pm.get(k):
            out.append(f"metric {k}: fast {fm.get(k)} / plain {pm.get(k)}")
    return out


def tenant_rows(dsn: str, tenant: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with psycopg.connect(dsn) as conn:
        for table in ("reservation", "reservation_line", "request_ledger", "stock_movement",
                      "outbox_event"):
            row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE tenant_id = %s").format(
                sql.Identifier(table)), (tenant,)).fetchone()
            assert row is not None
            out[table] = row[0]
        out["ledger_keys"] = sorted(UUID.sub(b"<id>", r[0].encode()) for r in conn.execute(
            "SELECT request_key FROM request_ledger WHERE tenant_id = %s", (tenant,)))
    return out


async def seeded(service: ReservationService, name: str) -> tuple[int, str]:
    created, key = await service.create_tenant_with_key(name)
    await service.set_stock(created.id, "s", "wh", 1000)
    await service.set_stock(created.id, "t", "wh", 1000, strategy="pool")
    await service.set_stock(created.id, "u", "wh", 3)
    return created.id, key


_names = iter(range(10**6))


async def pair(db: Database, service: ReservationService, **options: Any) -> tuple[Side, Side]:
    sides = []
    n = next(_names)
    for fast in (True, False):
        tenant, key = await seeded(service, f"{'fast' if fast else 'plain'}-{n}")
        log = io.StringIO()
        app = create_app(database=db, clock=lambda: NOW, fast_path=fast,
                         request_log=RequestLog("json", log), **options)
        sides.append(Side(app, key, tenant, log))
    return sides[0], sides[1]


async def run(fast: Side, plain: Side, reqs: list[Req]) -> list[str]:
    """Send each request to both sides in turn; the differences found (as text)."""
    diffs = []
    for n, req in enumerate(reqs):
        a = await call(fast, req)
        b = await call(plain, req)
        fast.answers.append(a)
        plain.answers.append(b)
        if a != b:
            diffs.append(f"#{n} {req.note or ''} {req.method} {req.path} {req.query!r} "
                         f"hdrs={req.headers!r} body={req.body!r}\n"
                         f"   fast : {a!r}\n   plain: {b!r}")
    return diffs


def H(*pairs: tuple[str, str | bytes], auth: bool = True, ctype: bool = True) -> Hdrs:
    out: Hdrs = []
    if auth:
        out.append((b"authorization", b"Bearer {key}"))
    if ctype:
        out.append((b"content-type", b"application/json"))
    for k, v in pairs:
        out.append((k.lower().encode(), v if isinstance(v, bytes) else v.encode("latin-1")))
    return out


def cart(*lines: tuple[Any, Any, Any], **extra: Any) -> bytes:
    return json.dumps({"lines": [{"sku": s, "location": loc, "quantity": q}
                                 for s, loc, q in lines], **extra}).encode()


def R(key: str | bytes | None, body: bytes | list[bytes], *extra: tuple[str, str | bytes],
      auth: bool = True, ctype: bool = True, note: str = "", path: str = "/v1/reservations",
      query: bytes = b"") -> Req:
    pairs = list(extra)
    if key is not None:
        pairs.append(("idempotency-key", key))
    return Req("POST", path, H(*pairs, auth=auth, ctype=ctype), body, query, note)


def T(op: str, rid: str, key: str | bytes | None = None, *extra: tuple[str, str | bytes],
      body: bytes | list[bytes] = b"", auth: bool = True, note: str = "",
      query: bytes = b"") -> Req:
    pairs = list(extra)
    if key is not None:
        pairs.append(("idempotency-key", key))
    return Req("POST", f"/v1/reservations/{rid}/{op}", H(*pairs, auth=auth, ctype=False),
               body, query, note)


def hostile_sequence() -> list[Req]:
    s1 = ("s", "wh", 1)
    big = [("s", "wh", 1)] + [(f"x{i}", "wh", 1) for i in range(99)]
    return [
        R("k1", cart(s1), note="201 r1"),
        R("k1", cart(s1), note="replay"),
        R("k1", cart(("s", "wh", 2)), note="reused"),
        R("k2", cart(("u", "wh", 3)), note="201 r2"),
        R("k3", cart(("u", "wh", 1)), note="insufficient"),
        R("k4", cart(("s", "wh", 1), ("t", "wh", 2), ttl_seconds=60), note="201 r3 multi"),
        # duplicate JSON keys
        R("dk1", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],'
                 b'"lines":[{"sku":"t","location":"wh","quantity":1}]}', note="dup lines key"),
        R("dk2", b'{"lines":[{"sku":"s","location":"wh","quantity":1,"quantity":2}]}',
          note="dup quantity"),
        R("dk3", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],"ttl_seconds":5,'
                 b'"ttl_seconds":0}', note="dup ttl"),
        R("dk4", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],"ttl_seconds":0,'
                 b'"ttl_seconds":5}', note="dup ttl 2"),
        R("dk5", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],"ttl_seconds":5,'
                 b'"ttl_seconds":null}', note="dup ttl null"),
        # numbers
        R("n1", cart(("s", "wh", True))), R("n2", cart(("s", "wh", False))),
        R("n3", cart(("s", "wh", 1.0))), R("n4", cart(("s", "wh", 1.5))),
        R("n5", cart(("s", "wh", -1))), R("n6", cart(("s", "wh", 0))),
        R("n7", cart(("s", "wh", 10**6))), R("n8", cart(("s", "wh", 10**6 + 1))),
        R("n9", cart(("s", "wh", 10**30))), R("n10", cart(("s", "wh", "1"))),
        R("n11", b'{"lines":[{"sku":"s","location":"wh","quantity":1e0}]}'),
        R("n12", b'{"lines":[{"sku":"s","location":"wh","quantity":-0}]}'),
        R("n13", b'{"lines":[{"sku":"s","location":"wh","quantity":NaN}]}'),
        R("n14", b'{"lines":[{"sku":"s","location":"wh","quantity":Infinity}]}'),
        R("n15", b'{"lines":[{"sku":"s","location":"wh","quantity":' + b"9" * 5000 + b"}]}"),
        R("n16", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],"ttl_seconds":'
                 + b"9" * 5000 + b"}"),
        # ttl
        *[R(f"ttl{n}", cart(s1, ttl_seconds=v)) for n, v in enumerate(
            [0, 1, 86400, 86401, None, True, 1.0, -1, "60", 2**63, 900])],
        # names
        R("nm1", cart(("s\x00", "wh", 1))), R("nm2", cart(("s", "w\x00h", 1))),
        R("nm3", cart(("sé", "wh", 1))), R("nm4", cart(("s", "", 1))),
        R("nm5", cart(("a" * 200, "wh", 1))), R("nm6", cart(("a" * 201, "wh", 1))),
        R("nm7", cart(("s\n", "wh", 1))), R("nm8", cart((" s", "wh", 1))),
        R("nm9", cart(("s\t", "wh", 1))), R("nm10", cart(("\ud800", "wh", 1))),
        R("nm11", cart((1, "wh", 1))), R("nm12", cart((None, "wh", 1))),
        R("nm13", cart(("s", None, 1))), R("nm14", cart((["s"], "wh", 1))),
        R("nm15", cart(("\x7f", "wh", 1))), R("nm16", cart(("é" * 200, "wh", 1))),
        R("nm17", cart(("s\u2028", "wh", 1))),
        R("nm18", cart(("\x01", "wh", 1))),
        # shapes
        R("sh1", b'{"lines":[]}'), R("sh2", b'{"lines":{}}'), R("sh3", b'{}'),
        R("sh4", b'[]'), R("sh5", b'null'), R("sh6", b''), R("sh7", b'{"lines":[[]]}'),
        R("sh8", b'{"lines":[{}]}'), R("sh9", b'{"lines":[null]}'),
        R("sh10", cart(s1, extra=1)), R("sh11", cart(s1, reference="o1")),
        R("sh12", cart(s1, reference=None)), R("sh13", cart(s1, metadata=None)),
        R("sh14", b'{"lines":[{"sku":"s","location":"wh","quantity":1,"split":false}]}'),
        R("sh15", b'{"lines":[{"sku":"s","location":"wh"}]}'),
        R("sh16", cart(*big), note="100 lines"),
        R("sh17", cart(*big, ("y", "wh", 1)), note="101 lines"),
        R("sh18", cart(s1, s1), note="same line twice"),
        R("sh19", cart(s1, ("S", "wh", 1)), note="case"),
        R("sh20", b'{"lines":[{"sku":"s","location":"wh","quantity":1}]} '),
        R("sh21", b'\xef\xbb\xbf{"lines":[{"sku":"s","location":"wh","quantity":1}]}',
          note="BOM"),
        R("sh22", '{"lines":[{"sku":"s","location":"wh","quantity":1}]}'.encode("utf-16"),
          note="utf-16"),
        R("sh23", '{"lines":[{"sku":"s","location":"wh","quantity":1}]}'.encode("utf-16-le"),
          note="utf-16-le"),
        R("sh24", '{"lines":[{"sku":"s","location":"wh","quantity":1}]}'.encode("utf-32"),
          note="utf-32"),
        R("sh25", b'{"lines":[{"sku":"s","location":"wh","quantity":1}]}\xff'),
        R("sh26", b'{"l\\u0069nes":[{"sku":"\\u0073","location":"wh","quantity":1}]}'),
        R("sh27", b'{"lines":' + b"[" * 3000 + b"]" * 3000 + b"}"),
        R("sh28", [b'{"lines":[{"sku":"s",', b'"location":"wh","quantity":1}]}'],
          note="chunked"),
        R("sh29", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],"ttl_seconds":60}'),
        R("sh29", b'{"lines":[{"sku":"s","location":"wh","quantity":1}],"ttl_seconds":60}',
          note="replay ttl"),
        R("sh29", b'{"lines":[{"sku":"s","location":"wh","quantity":1}]}',
          note="same key other ttl"),
        R("sh30", cart(s1), note="r: default ttl"),
        R("sh30", cart(s1, ttl_seconds=900), note="same key explicit 900"),
        R("sh31", cart(s1, ttl_seconds=900.0), note="fresh key 900.0"),
        R("sh31", cart(s1), note="replay after FastAPI path"),
        R("sh32", cart(("nope", "wh", 1)), note="unknown stock"),
        R("sh33", cart(("nope", "wh", 1), ("s", "nowh", 1)), note="unknown stock x2"),
        # idempotency keys
        R(None, cart(s1), note="no key"),
        R("", cart(s1)), R('""', cart(s1)), R('"', cart(s1)), R('"a\\"b"', cart(s1)),
        R('"a\\\\b"', cart(s1)), R('"a\\nb"', cart(s1)), R('"ab";p=1', cart(s1)),
        R('"ab"  ', cart(s1)), R('  ab', cart(s1)), R('ab  ', cart(s1)),
        R("k" * 200, cart(s1)), R("k" * 201, cart(s1)), R('"' + "k" * 200 + '"', cart(s1)),
        R('"' + "k" * 201 + '"', cart(s1)), R(b"k\xe9", cart(s1)), R(b"k\xe9", cart(s1)),
        R(b"k\x00", cart(s1)), R(b"\xff\xfe", cart(s1)), R(b"k\tk", cart(s1)),
        R('"k\tk"', cart(s1)), R("k1", cart(s1), ("idempotency-key", "k1"), note="2 keys"),
        R("dup", cart(s1), ("idempotency-key", "other"), note="2 different keys"),
        R('"ab"', cart(s1), note="sf key"), R("ab", cart(s1), note="bare same"),
        R("KEY-1", cart(s1)), R("key-1", cart(s1), note="case of key"),
        # content types
        R("ct1", cart(s1), ("content-type", "application/json; charset=utf-8"), ctype=False),
        R("ct2", cart(s1), ("content-type", "Application/JSON"), ctype=False),
        R("ct3", cart(s1), ctype=False),
        R("ct4", cart(s1), ("content-type", "text/plain"), ctype=False),
        R("ct5", cart(s1), ("content-type", "application/json"), note="2 ctypes"),
        R("ct6", cart(s1), ("content-type", "application/merge-patch+json"), ctype=False),
        R("ct7", cart(s1), ("content-type", "application/json "), ctype=False),
        R("ct8", cart(s1), ("content-type", ""), ctype=False),
        # authorization
        R("au1", cart(s1), auth=False),
        R("au2", cart(s1), ("authorization", "Bearer {key}"), note="2 auth same"),
        R("au3", cart(s1), ("authorization", "Bearer nope"), note="2 auth"),
        R("au4", cart(s1), ("authorization", "Bearer nope"), auth=False),
        R("au5", cart(s1), ("authorization", "bearer {key}"), auth=False),
        R("au6", cart(s1), ("authorization", "BEARER   {key}  "), auth=False),
        R("au7", cart(s1), ("authorization", "Bearer"), auth=False),
        R("au8", cart(s1), ("authorization", b"Bearer \xe9\xff"), auth=False),
        R("au9", cart(s1), ("authorization", "Basic {key}"), auth=False),
        R("au10", cart(s1), ("authorization", "Bearer\t{key}"), auth=False),
        R(None, b"{bad", ("authorization", "Bearer nope"), auth=False, note="bad auth+json"),
        R(None, cart(s1), ("authorization", "Bearer nope"), auth=False,
          note="bad auth no key"),
        R('"bad', cart(s1), ("authorization", "Bearer nope"), auth=False,
          note="bad auth bad key"),
        # paths and queries
        R("p1", cart(s1), query=b"x=1"), R("p2", cart(s1), path="/v1/reservations/"),
        R("p3", cart(s1), path="/v1/Reservations"), R("p4", cart(s1), path="/v1//reservations"),
        R("p5", cart(s1), path="/v1/reservations%2F"), R("p6", cart(s1), query=b"%ff"),
        # claim / release
        T("claim", "{r1}"), T("claim", "{r1}", note="again"), T("release", "{r1}"),
        T("release", "{r2}", "rel-1"), T("release", "{r2}", "rel-1", note="replay"),
        T("claim", "{r2}", "rel-1", note="key of release on claim"),
        T("claim", "{R3}", note="upper"), T("release", "{R3}", note="upper released?"),
        T("claim", "00000000-0000-0000-0000-000000000000"),
        T("claim", "not-a-uuid"), T("release", "%7B{r3}%7D", note="braces"),
        T("release", "urn:uuid:{r3}"), T("claim", "urn%3Auuid%3A{r3}"),
        T("claim", "{r3}", body=b"{}"), T("claim", "{r3}", body=b" "),
        T("claim", "{r3}", body=[b"", b""], note="empty chunks"),
        T("claim", "{r3}", query=b"a=1"), T("claim", "{r3}", ""), T("claim", "{r3}", '"x'),
        T("claim", "{r3}", "a", ("idempotency-key", "b")),
        T("claim", "{r3}", "a" * 201), T("claim", "{r3}", b"\xe9"),
        T("claim", "{r3}", auth=False), T("claim", "{r3}", None, ("authorization", "Bearer x"),
                                          auth=False),
        T("claim", "{r3}", None, ("authorization", "Bearer {key}"), note="2 auth"),
        T("claim", "%ff"), T("claim", "%C3%A9"), T("claim", "%EF%BF%BD"), T("claim", "%00"),
        T("claim", "a%2Fb"), T("claim", ""), T("claim", "x/y"),
        T("claim", "{r3}/"), T("claim/", "{r3}"),
        Req("POST", "/v1/reservations/claim", H(), b"", note="no id"),
        Req("POST", "/v1/reservations/claim/claim", H(), b"", note="id claim"),
        Req("POST", "/v1/reservations/release/release", H(), b"", note="id release"),
        Req("POST", "/v1/reservations//claim", H(), b""),
        Req("GET", "/v1/reservations/{r3}/claim", H(), b""),
        T("release", "{r3}", "rel-3"), T("claim", "{r3}", "rel-3", note="key reuse"),
        T("release", "{r3}", "rel-4", ("content-type", "application/json"),
          body=b"", note="ctype empty"),
    ]


async def test_hostile_sequence_matches(db: Database, service: ReservationService,
                                        dsn: str) -> None:
    fast, plain = await pair(db, service)
    reqs = hostile_sequence()
    diffs = await run(fast, plain, reqs)
    if VERBOSE:
        for req, (st_, _, body) in zip(reqs, fast.answers, strict=True):
            print(st_, req.note, req.path, req.headers and req.headers[2:], req.body[:70]
                  if isinstance(req.body, bytes) else req.body, body[:110])
    assert tenant_rows(dsn, fast.tenant) == tenant_rows(dsn, plain.tenant)
    assert not diffs, "\n".join(diffs)
    assert fast.app.state.fast_path_served > 20


# -- a key the database accepted before, revoked since ----------------------------

async def revoke(service: ReservationService, side: Side) -> None:
    keys = await service.api_keys(side.tenant)
    await service.revoke_api_key(side.tenant, keys[0].prefix)


def revoked_sequence() -> list[Req]:
    s1 = ("s", "wh", 1)
    return [
        R(None, cart(s1), note="revoked key, no Idempotency-Key"),
        R('"bad', cart(s1), note="revoked key, malformed Idempotency-Key"),
        R("", cart(s1), note="revoked key, empty Idempotency-Key"),
        R("rv1", cart(s1, s1), note="revoked key, a line twice"),
        R("rv2", cart(s1), note="revoked key, fine request"),
        R("k0", cart(s1), note="revoked key, replay of an earlier key"),
        T("claim", "not-a-uuid", note="revoked key, malformed id"),
        T("release", "{r1}", note="revoked key, known id"),
        T("claim", "00000000-0000-0000-0000-000000000000", note="revoked key, unknown id"),
        T("claim", "{r1}", '"bad', note="revoked key, malformed key on claim"),
    ]


async def test_revoked_key_matches(db: Database, service: ReservationService,
                                   dsn: str) -> None:
    """Each request with a key of its own that the app accepted once (so the fast path
    has it as a hint, ApiKeyCache.hint) and that was revoked since."""
    fast, plain = await pair(db, service)
    warm = [R("k0", cart(("s", "wh", 1)), note="201 r1")]
    assert not await run(fast, plain, warm)
    diffs = []
    for n, req in enumerate(revoked_sequence()):
        for side in (fast, plain):
            side.key = await service.create_api_key(side.tenant)
        assert not await run(fast, plain, [R(f"w{n}", cart(("s", "wh", 1)), note="warm")])
        for side in (fast, plain):
            keys = [k for k in await service.api_keys(side.tenant) if k.revoked_at is None]
            for k in keys:
                if k.prefix == __import__("pgreserve").apikeys.shown_prefix(side.key):
                    await service.revoke_api_key(side.tenant, k.prefix)
        diffs += await run(fast, plain, [req])
    assert tenant_rows(dsn, fast.tenant) == tenant_rows(dsn, plain.tenant)
    assert not diffs, "\n".join(diffs + side_effects_diff(fast, plain))


# -- generated carts ---------------------------------------------------------------

_names_st = st.one_of(st.sampled_from(["s", "t", "u", "wh", "nope", "", "S", "s\x00", "é"]),
                      st.text(min_size=0, max_size=3))
_ints = st.one_of(st.integers(-2, 5), st.sampled_from([10**6, 10**6 + 1, 86400, 86401,
                                                       2**31, 2**63]),
                  st.booleans(), st.floats(allow_nan=False, allow_infinity=False,
                                           min_value=-2, max_value=5), st.none(), st.just("1"))
_line = st.dictionaries(
    st.sampled_from(["sku", "location", "quantity", "split", "x"]),
    st.one_of(_names_st, _ints), min_size=0, max_size=5)
_good_line = st.fixed_dictionaries({"sku": st.sampled_from(["s", "t", "u", "nope"]),
                                    "location": st.sampled_from(["wh", "nowh"]),
                                    "quantity": _ints})
_doc = st.fixed_dictionaries(
    {"lines": st.lists(st.one_of(_good_line, _line), min_size=0, max_size=3)},
    optional={"ttl_seconds": _ints, "reference": _names_st, "x": st.none()})


@pytest.fixture
async def gen_pair(db: Database, service: ReservationService) -> tuple[Side, Side]:
    return await pair(db, service)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=_doc, key=st.one_of(st.none(), st.sampled_from(["g1", "g2", '"g1"', "", '"x'])),
       fresh=st.booleans())
async def test_generated_carts_match(gen_pair: tuple[Side, Side], doc: dict[str, Any],
                                     key: str | None, fresh: bool) -> None:
    fast, plain = gen_pair
    if fresh and key == "g1":
        key = f"g-{next(_names)}"
    body = json.dumps(doc).encode()
    diffs = await run(fast, plain, [R(key, body)])
    assert not diffs, "\n".join(diffs)


async def test_hostile_sequence_log_and_metrics_match(db: Database,
                                                      service: ReservationService) -> None:
    """Beyond the answers: the request log lines and the HTTP metrics."""
    fast, plain = await pair(db, service)
    await run(fast, plain, hostile_sequence())
    diffs = side_effects_diff(fast, plain)
    assert not diffs, "\n".join(diffs)


# -- with the rollout layer (legacy Redis store) ----------------------------------------

@pytest.fixture(scope="module")
def redis_url() -> Any:
    import toolcheck
    from redisserver import RedisServer

    toolcheck.require("redis-server")
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.mark.parametrize("mode", ["legacy", "shadow", "primary"])
async def test_hostile_sequence_matches_through_the_rollout_layer(
        db: Database, service: ReservationService, dsn: str, redis_url: str,
        mode: str) -> None:
    from pgreserve.rollout import Rollout
    from pgreserve.rollout.modes import set_mode
    from pgreserve.rollout.redis_store import RedisHoldStore

    store = RedisHoldStore(redis_url, namespace=f"diff{next(_names)}")
    rollout = Rollout(service, store, mode_ttl_s=0, flush_every_s=0.05)
    try:
        fast, plain = await pair(db, service, rollout=rollout)
        fast.norm_ts = plain.norm_ts = True
        for side in (fast, plain):
            for sku, on_hand in (("s", 1000), ("t", 1000), ("u", 3)):
                await store.set_stock(side.tenant, sku, "wh", on_hand)
            await set_mode(db, side.tenant, mode, "test")
        diffs = await run(fast, plain, hostile_sequence())
        assert tenant_rows(dsn, fast.tenant) == tenant_rows(dsn, plain.tenant)
        assert not diffs, "\n".join(diffs)
        assert not side_effects_diff(fast, plain)
    finally:
        await rollout.aclose()


def mounted(req: Req, root: str, prefix: str | None = None) -> Req:
    """`req` as a host app mounted at `root` hands it on (path with the root in it)."""
    return Req(req.method, (root if prefix is None else prefix) + req.path, req.headers,
               req.body, req.query, f"{req.note} root={root!r}", root)


async def test_under_a_root_path_matches(db: Database, service: ReservationService,
                                         dsn: str) -> None:
    s1 = ("s", "wh", 1)
    base = [R("m1", cart(s1), note="201 r1"), T("claim", "{r1}"), R("m2", cart(s1)),
            T("release", "{r2}", "rk"), T("claim", "not-a-uuid")]
    reqs = []
    for root, prefix in (("/api", None), ("/api/", None), ("/api", ""), ("/a%20b", None),
                         ("/api", "/apix"), ("/v1", None), ("/v1", ""),
                         ("/v1/reservations", "")):
        reqs += [mounted(r, root, prefix) for r in base]
    fast, plain = await pair(db, service)
    diffs = await run(fast, plain, reqs)
    assert tenant_rows(dsn, fast.tenant) == tenant_rows(dsn, plain.tenant)
    assert not diffs, "\n".join(diffs)
    assert not side_effects_diff(fast, plain)


_VALID = b'{"lines":[{"sku":"s","location":"wh","quantity":1}]}'


@st.composite
def _mutated(draw: Any) -> bytes:
    """The valid cart with a few bytes replaced, inserted or cut."""
    body = bytearray(_VALID)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(body)))
        what = draw(st.sampled_from(["set", "insert", "cut"]))
        byte = draw(st.one_of(st.sampled_from(list(b' "{}[],:0123456789-+.eE\\ntuflasx')),
                              st.integers(0, 255)))
        if what == "insert" or at == len(body):
            body.insert(at, byte)
        elif what == "set":
            body[at] = byte
        else:
            del body[at]
    return bytes(body)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_mutated(),
       key=st.one_of(st.none(), st.binary(min_size=0, max_size=6).filter(
           lambda b: b"\r" not in b and b"\n" not in b), st.sampled_from(
           [b'"g"', b'"g\\"', b'"\\g"', b"g", b'"g" ;x', b'"g"\t', b"\xc3\xa9"])),
       auth=st.sampled_from([b"Bearer {key}", b"bearer {key}", b"Bearer  {key}",
                             b"Bearer {key} ", b"Bearer x", b"", b"{key}"]))
async def test_mutated_requests_match(gen_pair: tuple[Side, Side], body: bytes,
                                      key: bytes | None, auth: bytes) -> None:
    fast, plain = gen_pair
    headers = [(b"authorization", auth), (b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"idempotency-key", key))
    diffs = await run(fast, plain, [Req("POST", "/v1/reservations", headers, body)])
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("limit", [0, 1])
async def test_revoked_key_beside_a_request_in_flight_matches(
        db: Database, service: ReservationService, dsn: str, limit: int) -> None:
    """A held request of the tenant (its bucket locked) and, beside it, one with a key
    accepted once and revoked since, with the same Idempotency-Key."""
    import asyncio

    from test_concurrency import wait_until_blocked
    from test_http_fast_path import buckets_locked

    fast, plain = await pair(db, service, request_deadline_s=2.0,
                             tenant_max_in_flight=limit)
    diffs = []
    for side in (fast, plain):
        good = side.key
        side.key = await service.create_api_key(side.tenant)
        assert (await call(side, R("warm", cart(("s", "wh", 1)))))[0] == 201
        from pgreserve import apikeys
        await service.revoke_api_key(side.tenant, apikeys.shown_prefix(side.key))
        revoked, side.key = side.key, good
        with buckets_locked(dsn):
            held = asyncio.create_task(call(side, R("a", cart(("s", "wh", 1)))))
            await wait_until_blocked(dsn)
            side.key = revoked
            side.answers.append(await call(side, R("a", cart(("s", "wh", 1)))))
            side.key = good
            side.answers.append(await held)
    for a, b in zip(fast.answers, plain.answers, strict=True):
        if a != b:
            diffs.append(f"fast : {a!r}\n   plain: {b!r}")
    assert not diffs, "\n".join(diffs)
