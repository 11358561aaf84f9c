"""pgreserve.client against the real app on uvicorn over a real socket: typed answers, typed
errors, and retries that reuse the Idempotency-Key so a lost reply never holds twice."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from pgreserve import apikeys, errors
from pgreserve.client import AsyncClient, Client, Stock
from pgreserve.domain import Line, Status, Strategy
from pgreserve.http import problems
from test_cli_up import free_port
from test_http_schema import Served


class DroppingProxy:
    """A TCP proxy to the API that, for the first `drop` requests, lets the server answer
    and then closes the client's connection without passing the answer on (a reply lost
    after the server acted)."""

    def __init__(self, upstream_port: int, drop: int) -> None:
        self.upstream_port = upstream_port
        self.drop = drop
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.closed = False
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            for src, dst, replies in ((client, upstream, False), (upstream, client, True)):
                t = threading.Thread(target=self._pump, args=(src, dst, replies, client,
                                                              upstream), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool,
              client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if replies:
                    with self.lock:
                        lose = self.dropped < self.drop
                        if lose:
                            self.dropped += 1
                    if lose:  # the server answered; the caller never hears it
                        break
                dst.sendall(data)
        for s in (client, upstream):  # shutdown wakes the other direction's recv
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@pytest.fixture
def server(dsn: str) -> Iterator[tuple[str, str]]:
    """The API on a free loopback port over a fresh database with tenant 'acme'; yields
    (base URL, API key)."""
    key = apikeys.new_key()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT tenant_create_v1('acme', %s)", (apikeys.hash_key(key),))
    with Served(dsn) as srv:
        yield f"http://127.0.0.1:{srv.port}", key


def held_units(dsn: str) -> tuple[int, int]:
    """(reservations, held units) in the database."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM reservation), "
                           "(SELECT coalesce(sum(quantity), 0) FROM reservation_line "
                           "WHERE held)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_sync_client_reserve_claim_release_extend_and_stock(server: tuple[str, str]) -> None:
    """The sync client sets and reads stock, holds, extends, claims and releases, each
    answer typed; a sold-out reserve is an outcome with its short lines, and the holds,
    claims and releases leave the line's version where the count put it."""
    base, key = server
    with Client(base, key) as shop:
        assert shop.set_stock("tee", "berlin", 5, strategy="pool") == Stock(
            "tee", "berlin", 5, 0, 5, Strategy.POOL, version=1)
        out = shop.reserve([("tee", "berlin", 2)], ttl_seconds=60)
        assert out.held and out.reservation is not None and not out.replayed
        rid = out.reservation.id
        assert out.reservation.lines == (Line("tee", "berlin", 2),)
        assert shop.get_stock("tee", "berlin").reserved == 2
        extended = shop.extend(rid, 600)
        assert extended.expires_at > out.reservation.expires_at
        assert shop.claim(rid).status is Status.CLAIMED
        assert shop.get_reservation(rid).status is Status.CLAIMED
        other = shop.reserve([Line("tee", "berlin", 1)])
        assert other.reservation is not None
        assert shop.release(other.reservation.id).status is Status.RELEASED
        short = shop.reserve([("tee", "berlin", 9)], idempotency_key="big")
        assert not short.held and short.short_lines[0].requested == 9
        assert short.short_lines[0].available == 3
        assert shop.reserve([("tee", "berlin", 9)], idempotency_key="big").replayed
        assert shop.get_stock("tee", "berlin") == Stock("tee", "berlin", 3, 0, 3, Strategy.POOL,
                                                        version=1)


def test_typed_errors_from_the_problem_codes(server: tuple[str, str]) -> None:
    """Problem responses raise the pgreserve.errors class of their code, with the status
    and the problem document in details."""
    base, key = server
    with Client(base, key, retries=0) as shop:
        shop.set_stock("tee", "berlin", 5)
        with pytest.raises(errors.UnknownStock) as unknown:
            shop.get_stock("nope", "berlin")
        assert unknown.value.details["status"] == 404
        assert unknown.value.details["problem"]["code"] == "unknown_stock"
        with pytest.raises(errors.ReservationNotFound):
            shop.claim("00000000-0000-0000-0000-000000000000")
        shop.reserve([("tee", "berlin", 1)], idempotency_key="k1")
        with pytest.raises(errors.IdempotencyKeyReused):
            shop.reserve([("tee", "berlin", 2)], idempotency_key="k1")
        with pytest.raises(errors.InvalidRequest):
            shop.reserve([("tee", "berlin", 0)])
        rid = shop.reserve([("tee", "berlin", 1)]).reservation
        assert rid is not None
        shop.release(rid.id)
        with pytest.raises(errors.ReservationReleased):
            shop.claim(rid.id)
    with Client(base, "pgr_" + "x" * 43, retries=0) as stranger, \
            pytest.raises(problems.Unauthorized):
        stranger.get_stock("tee", "berlin")


def test_a_lost_reply_is_retried_with_the_same_key_and_holds_once(
        server: tuple[str, str], dsn: str) -> None:
    """When the server holds but its reply is lost, the client retries with the key it
    generated and returns the stored outcome: one reservation, not two."""
    base, key = server
    with Client(base, key) as setup:
        setup.set_stock("tee", "berlin", 10)
    proxy = DroppingProxy(int(base.rsplit(":", 1)[1]), drop=1)
    sent: list[str | None] = []

    def seen(request: httpx.Request) -> None:
        sent.append(request.headers.get("Idempotency-Key"))

    try:
        http = httpx.Client(timeout=30, event_hooks={"request": [seen]})
        with Client(f"http://127.0.0.1:{proxy.port}", key, http=http, backoff=0.01) as shop:
            out = shop.reserve([("tee", "berlin", 3)])
    finally:
        proxy.close()
    assert proxy.dropped == 1
    assert out.held and out.replayed, "the answer is the stored one"
    assert len(sent) == 2 and sent[0] == sent[1] and sent[0] is not None
    assert held_units(dsn) == (1, 3)


async def test_async_client_retries_a_lost_claim_reply_with_the_same_key(
        server: tuple[str, str], dsn: str) -> None:
    """The async client holds, then loses a claim's reply; its retry with the same key
    replays the claim, and the reservation is claimed once."""
    base, key = server
    async with AsyncClient(base, key) as shop:
        await shop.set_stock("tee", "berlin", 4)
        out = await shop.reserve([("tee", "berlin", 4)], idempotency_key="order-7")
        assert out.reservation is not None
        again = await shop.reserve([("tee", "berlin", 4)], idempotency_key="order-7")
        assert again.replayed and again.reservation == out.reservation.__class__(
            **{**out.reservation.__dict__, "replayed": True})
    proxy = DroppingProxy(int(base.rsplit(":", 1)[1]), drop=1)
    try:
        async with AsyncClient(f"http://127.0.0.1:{proxy.port}", key, backoff=0.01) as shop:
            claimed = await shop.claim(out.reservation.id, idempotency_key="pay-7")
            stock = await shop.get_stock("tee", "berlin")
    finally:
        proxy.close()
    assert proxy.dropped == 1 and claimed.status is Status.CLAIMED and claimed.replayed
    assert (stock.on_hand, stock.reserved) == (0, 0)
    with psycopg.connect(dsn) as conn:
        sales = conn.execute("SELECT count(*) FROM stock_movement WHERE kind = 'sale'"
                             ).fetchone()
    assert sales == (1,)


def test_busy_is_retried_after_retry_after_and_then_succeeds(
        server: tuple[str, str], dsn: str) -> None:
    """A reserve that meets a locked bucket gets 503 busy with Retry-After; the client
    waits, retries with the same key once the lock is gone, and holds once."""
    base, key = server
    with Client(base, key) as setup:
        setup.set_stock("tee", "berlin", 10)
    locker = psycopg.connect(dsn)
    locker.execute("SELECT 1 FROM stock_bucket WHERE sku = 'tee' FOR UPDATE")
    answers: list[tuple[int, str | None, str | None]] = []

    def seen(response: httpx.Response) -> None:
        answers.append((response.status_code, response.headers.get("Retry-After"),
                        response.request.headers.get("Idempotency-Key")))
        if response.status_code == 503:
            locker.rollback()  # the lock goes; the retry can take the bucket

    try:
        http = httpx.Client(timeout=60, event_hooks={"response": [seen]})
        with Client(base, key, http=http) as shop:
            out = shop.reserve([("tee", "berlin", 2)])
    finally:
        locker.close()
    assert out.held
    assert [a[:2] for a in answers] == [(503, "1"), (201, None)]
    assert answers[0][2] == answers[1][2]
    assert held_units(dsn) == (1, 2)


def test_retries_are_bounded_and_then_raise(dsn: str) -> None:
    """With nothing listening, the client tries 1 + retries times and raises the
    connection error."""
    attempts: list[int] = []

    def seen(request: httpx.Request) -> None:
        attempts.append(1)

    http = httpx.Client(timeout=5, event_hooks={"request": [seen]})
    with Client(f"http://127.0.0.1:{free_port()}", "pgr_x", http=http, retries=2,
                backoff=0.01) as shop, pytest.raises(httpx.ConnectError):
        shop.get_stock("tee", "berlin")
    assert len(attempts) == 3



def test_a_key_with_quotes_and_backslashes_reaches_the_server_as_itself(
        server: tuple[str, str]) -> None:
    """The client sends its key as a structured-field string, so a key with backslashes is
    the key a bare header names, and one that starts with a quote is what its hand-written
    sf-string names."""
    base, key = server
    cart = {"lines": [{"sku": "tee", "location": "berlin", "quantity": 1}], "ttl_seconds": 900}

    def by_hand(header: str) -> httpx.Response:
        return httpx.post(f"{base}/v1/reservations", json=cart, timeout=30,
                          headers={"Authorization": f"Bearer {key}", "Idempotency-Key": header})

    with Client(base, key) as shop:
        shop.set_stock("tee", "berlin", 5)
        slashed = shop.reserve([("tee", "berlin", 1)], idempotency_key="a\\b")
        quoted = shop.reserve([("tee", "berlin", 1)], idempotency_key='"order" 7')
    assert slashed.reservation is not None and quoted.reservation is not None
    bare = by_hand("a\\b")
    assert bare.headers["idempotent-replayed"] == "true"
    assert bare.json()["id"] == slashed.reservation.id
    escaped = by_hand('"\\"order\\" 7"')
    assert escaped.headers["idempotent-replayed"] == "true"
    assert escaped.json()["id"] == quoted.reservation.id


@pytest.mark.parametrize(("status", "body", "retry"), [
    (503, {"code": "busy"}, True),
    (503, {"code": "outcome_unknown"}, True),
    (503, {"code": "database_unavailable"}, True),
    (429, {"code": "too_many_requests"}, True),
    (409, {"code": "request_in_progress"}, True),
    (409, {"code": "insufficient_stock"}, False),
    (422, {"code": "idempotency_key_reused"}, False),
    (502, None, True),
    (500, {"code": "internal_error"}, False),
])
def test_which_answers_are_retried(status: int, body: dict[str, str] | None,
                                   retry: bool) -> None:
    """An answer is retried when its problem code is a retryable pgreserve error, or when a
    proxy's 502/503/504 carries none."""
    from pgreserve.client import _retryable

    response = httpx.Response(status, json=body) if body else httpx.Response(status)
    assert _retryable(response) is retry


def test_sync_client_conditional_counts_and_listing(server: tuple[str, str]) -> None:
    """The sync client's set_stock sends if_match (an ETag or a version) and create_only,
    a stale one raises PreconditionFailed and changes nothing; list_stock pages and
    iter_stock walks every page."""
    base, key = server
    with Client(base, key) as shop:
        made = shop.set_stock("a", "w", 5, create_only=True)
        assert made.version == 1 and made.etag == 'W/"1"'
        with pytest.raises(errors.PreconditionFailed) as failed:
            shop.set_stock("a", "w", 9, create_only=True)
        assert failed.value.details["status"] == 412
        assert shop.set_stock("a", "w", 6, if_match=made.etag).version == 2
        with pytest.raises(errors.PreconditionFailed):
            shop.set_stock("a", "w", 7, if_match=1)
        assert shop.set_stock("a", "w", 7, if_match=2).on_hand == 7
        assert shop.get_stock("a", "w").on_hand == 7
        for sku in ["b", "c", "d"]:
            shop.set_stock(sku, "w", 1)
        page = shop.list_stock(limit=3)
        assert [s.sku for s in page.stock] == ["a", "b", "c"] and page.next_cursor
        assert [s.sku for s in shop.list_stock(cursor=page.next_cursor).stock] == ["d"]
        assert [s.sku for s in shop.iter_stock(limit=1)] == ["a", "b", "c", "d"]
        assert [s.sku for s in shop.iter_stock(skus=["d", "b"])] == ["b", "d"]
        with pytest.raises(errors.InvalidCursor):
            shop.list_stock(cursor="nope")


async def test_async_client_conditional_counts_and_listing(server: tuple[str, str]) -> None:
    """The async client's set_stock honours if_match and create_only like the sync one,
    and iter_stock walks every page of a prefix."""
    base, key = server
    async with AsyncClient(base, key) as shop:
        made = await shop.set_stock("tee-1", "w", 5)
        with pytest.raises(errors.PreconditionFailed):
            await shop.set_stock("tee-1", "w", 9, if_match='W/"9"')
        assert (await shop.set_stock("tee-1", "w", 9, if_match=made.etag)).on_hand == 9
        with pytest.raises(errors.PreconditionFailed):
            await shop.set_stock("tee-2", "w", 1, if_match="*")
        await shop.set_stock("tee-2", "w", 1, create_only=True)
        await shop.set_stock("cap", "w", 1)
        seen = [s.sku async for s in shop.iter_stock(sku_prefix="tee-", limit=1)]
        assert seen == ["tee-1", "tee-2"]
