"""Webhook delivery against real local receivers: order, retries, signatures, isolation."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from aiohttp import web

from pgreserve import Database, ReservationService, Tenant
from pgreserve.workers.base import LoopConfig, run_forever
from pgreserve.workers.webhooks import (
    SIGNATURE_HEADER,
    WebhookConfig,
    WebhookDeliverer,
    sign,
    verify,
)

# The receivers listen on 127.0.0.1: these tests allow private addresses
# explicitly (test_webhook_targets.py proves they are refused otherwise).
FAST = WebhookConfig(timeout_s=2.0, lease_s=5.0, backoff_base_s=0.02, backoff_cap_s=0.1,
                     idle_poll_s=0.02, loop=LoopConfig(interval_s=0.02), allow_private=True)


@pytest_asyncio.fixture
async def service(db: Database) -> ReservationService:
    """The service, registering webhooks on loopback (allowed explicitly)."""
    return ReservationService(db, allow_private_webhooks=True)


@dataclass
class Delivery:
    path: str
    body: bytes
    signature: str
    status: int

    @property
    def doc(self) -> dict:  # type: ignore[type-arg]  # a JSON document of the test's own
        return json.loads(self.body)  # type: ignore[no-any-return]  # a JSON document of the test's own


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that records every request; `fail_first` get a 500.
    Each answer takes `delay_s` (a window for overlapping deliveries to show up)."""

    fail_first: int = 0
    delay_s: float = 0.002
    seen: list[Delivery] = field(default_factory=list)
    url: str = ""
    in_flight: dict[str, int] = field(default_factory=dict)
    most_in_flight: dict[str, int] = field(default_factory=dict)

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        self.in_flight[path] = self.in_flight.get(path, 0) + 1
        self.most_in_flight[path] = max(self.most_in_flight.get(path, 0), self.in_flight[path])
        try:
            body = await request.read()
            await asyncio.sleep(self.delay_s)
            status = 500 if self.fail_first > 0 else 200
            self.fail_first -= 1 if self.fail_first > 0 else 0
            self.seen.append(Delivery(path, body, request.headers.get(SIGNATURE_HEADER, ""),
                                      status))
            return web.Response(status=status)
        finally:
            self.in_flight[path] -= 1

    def ok(self, path: str = "/hook") -> list[Delivery]:
        return [d for d in self.seen if d.status == 200 and d.path == path]


@asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.Response]]
                  ) -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 answering every POST with `handler`; yields its URL."""
    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def receiver(fail_first: int = 0, delay_s: float = 0.002) -> AsyncIterator[Receiver]:
    rec = Receiver(fail_first=fail_first, delay_s=delay_s)
    async with serving(rec.handle) as url:
        rec.url = url
        yield rec


@asynccontextmanager
async def workers(*services: ReservationService,
                  config: WebhookConfig = FAST) -> AsyncIterator[list[WebhookDeliverer]]:
    stop = asyncio.Event()
    running = [WebhookDeliverer(s, config) for s in services]
    tasks = [asyncio.create_task(run_forever(w, stop)) for w in running]
    try:
        yield running
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for w in running:
            await w.aclose()


async def until(check: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Poll `check` until it is truthy or the deadline passes (the caller asserts after)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not check():  # noqa: ASYNC110 - no event to await
        await asyncio.sleep(0.02)


def refused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/dead"  # nothing listens there now


async def make_events(service: ReservationService, tenant: int, n: int) -> None:
    """One stock.changed, then n reservations of one unit (n reservation.created)."""
    await service.set_stock(tenant, "s", "wh", 10_000)
    for i in range(n):
        out = await service.reserve(tenant, f"k{i}", [("s", "wh", 1)])
        assert out.held


async def feed_ids(service: ReservationService, tenant: int) -> list[int]:
    page = await service.events(tenant, limit=1000)
    return [e.event_id for e in page.events]


async def test_events_arrive_in_order_and_signed(service: ReservationService,
                                                 tenant: Tenant) -> None:
    """Every event after registration arrives once, in feed order, with a valid signature."""
    async with receiver() as rec:
        hook = await service.add_webhook(tenant.id, rec.url + "/hook")
        assert hook.secret is not None and hook.secret.startswith("whsec_")
        await make_events(service, tenant.id, 20)
        expected = await feed_ids(service, tenant.id)
        async with workers(service):
            await until(lambda: len(rec.ok()) >= len(expected))
        got = rec.ok()
        assert [d.doc["id"] for d in got] == expected
        assert got[0].doc["type"] == "stock.changed"
        assert {d.doc["type"] for d in got[1:]} == {"reservation.created"}
        for d in got:
            assert verify(hook.secret, d.signature, d.body)
            assert not verify(hook.secret, d.signature, d.body + b" ")
            assert not verify("whsec_wrong-secret-000000", d.signature, d.body)
        state = (await service.webhooks(tenant.id))[0]
        assert state.delivered == len(expected) and state.attempts == 0


async def test_events_before_registration_are_not_sent(service: ReservationService,
                                                       tenant: Tenant) -> None:
    """An endpoint gets the events committed after it was registered, not the history."""
    await make_events(service, tenant.id, 3)
    before = set(await feed_ids(service, tenant.id))
    async with receiver() as rec:
        await service.add_webhook(tenant.id, rec.url + "/hook")
        await service.reserve(tenant.id, "later", [("s", "wh", 1)])
        after = [i for i in await feed_ids(service, tenant.id) if i not in before]
        async with workers(service):
            await until(lambda: len(rec.ok()) >= 1)
            await asyncio.sleep(0.2)  # room for a wrong extra delivery to show up
        assert [d.doc["id"] for d in rec.ok()] == after


def test_signature_rejects_stale_timestamps() -> None:
    """verify() accepts a fresh signature and refuses one older than the tolerance."""
    body = b'{"id":1}'
    fresh = sign("whsec_0123456789abcdef", 1_000_000, body)
    assert verify("whsec_0123456789abcdef", fresh, body, now=1_000_100)
    assert not verify("whsec_0123456789abcdef", fresh, body, now=1_000_400)
    assert not verify("whsec_0123456789abcdef", "garbage", body, now=1_000_000)


async def test_retries_after_failures_lose_nothing(service: ReservationService,
                                                   tenant: Tenant) -> None:
    """After 500s the same event is retried with backoff; every event then arrives in order."""
    async with receiver(fail_first=4) as rec:
        await service.add_webhook(tenant.id, rec.url + "/hook")
        await make_events(service, tenant.id, 10)
        expected = await feed_ids(service, tenant.id)
        async with workers(service):
            await until(lambda: len(rec.ok()) >= len(expected))
        failed = [d for d in rec.seen if d.status == 500]
        assert len(failed) == 4
        assert {d.doc["id"] for d in failed} == {expected[0]}  # N+1 never before N succeeded
        assert [d.doc["id"] for d in rec.ok()] == expected
        state = (await service.webhooks(tenant.id))[0]
        assert state.delivered == len(expected)
        assert state.attempts == 0 and state.last_error == "HTTP 500"


async def test_dead_endpoint_blocks_neither_reservations_nor_other_tenants(
        service: ReservationService, tenant: Tenant) -> None:
    """Connection refused: attempts and the error are recorded with a later next attempt,
    while reservations go on and another tenant's endpoint gets all its events."""
    other = await service.create_tenant("globex")
    async with receiver() as rec:
        dead = await service.add_webhook(tenant.id, refused_url())
        await service.add_webhook(other.id, rec.url + "/hook")
        await service.set_stock(tenant.id, "s", "wh", 100)
        async with workers(service):
            await until(lambda: False, timeout_s=0.3)  # let the dead endpoint fail a while
            for i in range(10):
                assert (await service.reserve(tenant.id, f"k{i}", [("s", "wh", 1)])).held
            await make_events(service, other.id, 10)
            expected = await feed_ids(service, other.id)
            await until(lambda: len(rec.ok()) >= len(expected))
            state = {w.id: w for w in await service.webhooks(tenant.id)}[dead.id]
        assert [d.doc["id"] for d in rec.ok()] == expected
        assert state.delivered == 0 and state.attempts >= 2
        assert state.last_error is not None and "Connect" in state.last_error
        assert state.last_attempt_at is not None and state.next_attempt_at is not None
        assert state.next_attempt_at > state.last_attempt_at
        assert (await service.get_stock(tenant.id, "s", "wh")).available == 90


async def test_two_workers_deliver_each_event_exactly_once(dsn: str,
                                                           service: ReservationService) -> None:
    """Two workers with their own pools share the endpoints; each event arrives exactly once,
    in order, and no endpoint ever has two deliveries in flight.

    Each worker sends to one endpoint at a time and each answer takes 20 ms, so one
    worker alone needs about a second for the 45 events while two endpoints stay due:
    a second worker that never takes one is a fault, not chance."""
    tenants = [await service.create_tenant(f"t{i}") for i in range(3)]
    config = WebhookConfig(timeout_s=2.0, lease_s=5.0, backoff_base_s=0.02,
                           backoff_cap_s=0.1, idle_poll_s=0.01, events_per_claim=3,
                           concurrency=1, loop=LoopConfig(interval_s=0.01),
                           allow_private=True)
    async with receiver(delay_s=0.02) as rec, Database(dsn, max_size=4) as db1, \
            Database(dsn, max_size=4) as db2:
        for t in tenants:
            await service.add_webhook(t.id, f"{rec.url}/hook/{t.id}")
        async with workers(ReservationService(db1), ReservationService(db2),
                           config=config) as running:
            for t in tenants:
                await make_events(service, t.id, 15)
            expected = {t.id: await feed_ids(service, t.id) for t in tenants}
            total = sum(len(v) for v in expected.values())
            await until(lambda: len(rec.seen) >= total)
            await asyncio.sleep(0.3)  # room for a duplicate to show up
        for t in tenants:
            got = [d.doc["id"] for d in rec.ok(f"/hook/{t.id}")]
            assert got == expected[t.id]
        assert len(rec.seen) == total
        assert max(rec.most_in_flight.values()) == 1
        assert all(w.delivered > 0 for w in running)  # both took part


async def test_deleted_endpoint_gets_nothing_more(dsn: str, service: ReservationService,
                                                  tenant: Tenant) -> None:
    """Deleting an endpoint removes its delivery row; other tenants cannot delete it."""
    other = await service.create_tenant("globex")
    hook = await service.add_webhook(tenant.id, "https://example.invalid/hook")
    from pgreserve.errors import WebhookNotFound

    try:
        await service.delete_webhook(other.id, hook.id)
    except WebhookNotFound:
        pass
    else:
        raise AssertionError("another tenant deleted the webhook")
    await service.delete_webhook(tenant.id, hook.id)
    assert await service.webhooks(tenant.id) == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM webhook_delivery").fetchone() == (0,)


async def test_an_endpoint_the_client_cannot_send_to_is_a_failed_attempt(
        dsn: str, service: ReservationService, tenant: Tenant) -> None:
    """An endpoint stored with a host name the HTTP client refuses (an empty label, as
    registration accepted before it refused them) is a failed attempt like any other:
    attempts and last_error recorded, the next attempt after the backoff. Before, the
    delivery task died holding its lease: nothing recorded, retried at each lease end."""
    hook = await service.add_webhook(tenant.id, "https://shop.example.com/hook")
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE webhook_endpoint SET url = 'https://shop..example.com/hook'"
                     " WHERE tenant_id = %s AND endpoint_id = %s", (tenant.id, hook.id))
    await make_events(service, tenant.id, 1)
    async with workers(service):
        await until(lambda: False, timeout_s=0.5)
        state = {w.id: w for w in await service.webhooks(tenant.id)}[hook.id]
    assert state.delivered == 0 and state.attempts >= 2
    assert state.last_error is not None and "idna" in state.last_error.lower()
    assert state.next_attempt_at is not None and state.last_attempt_at is not None


async def test_one_tenants_hanging_endpoints_leave_slots_to_the_others(
        service: ReservationService, tenant: Tenant) -> None:
    """A tenant's endpoints that take the connection and never answer hold at most its
    share of a worker's slots (here 2 of 4): another tenant's endpoint is delivered to
    while they all still hang. Before, six hanging endpoints took every slot until their
    timeout, and the other tenant waited for them."""
    release = asyncio.Event()
    hanging: list[str] = []

    async def hang(request: web.Request) -> web.Response:
        hanging.append(request.path)
        await release.wait()
        return web.Response(status=200)

    other = await service.create_tenant("other")
    config = dataclasses.replace(FAST, timeout_s=60.0, lease_s=121.0, concurrency=4,
                                 per_tenant=2)
    try:
        async with serving(hang) as slow, receiver() as rec:
            for i in range(6):
                await service.add_webhook(tenant.id, f"{slow}/hang{i}")
            await make_events(service, tenant.id, 1)
            await service.add_webhook(other.id, rec.url + "/hook")
            async with workers(service, config=config):
                await until(lambda: len(hanging) >= 2)
                await make_events(service, other.id, 1)
                await until(lambda: len(rec.ok()) >= 2)  # stock.changed, reservation.created
                assert len(rec.ok()) >= 2
                assert len(hanging) == 2  # the share; the other four wait their turn
                release.set()
    finally:
        release.set()  # (the server's cleanup waits for its handlers)


def test_a_tenant_share_is_within_the_slots() -> None:
    assert WebhookConfig().tenant_share == 8
    assert WebhookConfig(concurrency=1).tenant_share == 1
    with pytest.raises(ValueError, match="per_tenant"):
        WebhookConfig(concurrency=4, per_tenant=5)


class StallingService(ReservationService):
    """A worker's service whose first read of the feed stalls past the lease (a worker
    paused: a long GC, a frozen VM, a blocked event loop)."""

    stall_s = 0.0

    async def events(self, *args: Any, **kwargs: Any) -> Any:
        page = await super().events(*args, **kwargs)
        stall, self.stall_s = self.stall_s, 0.0
        await asyncio.sleep(stall)
        return page


async def test_a_worker_that_stalled_past_its_lease_sends_nothing_beside_the_next(
        dsn: str, service: ReservationService) -> None:
    """Worker A claims the endpoint and stalls past the lease before its first send;
    worker B claims it then and delivers. A, resumed, must not send beside B: each event
    arrives once, in order, one at a time (a send starts only when it ends before the
    lease does)."""
    tenant = await service.create_tenant("stalled")
    config = WebhookConfig(timeout_s=0.5, lease_s=2.0, backoff_base_s=0.02,
                           backoff_cap_s=0.1, idle_poll_s=0.01,
                           loop=LoopConfig(interval_s=0.01), allow_private=True)
    async with receiver() as rec, Database(dsn, max_size=4) as db1, \
            Database(dsn, max_size=4) as db2:
        await service.add_webhook(tenant.id, f"{rec.url}/hook")
        await make_events(service, tenant.id, 5)
        expected = await feed_ids(service, tenant.id)
        stalling = StallingService(db1)
        stalling.stall_s = 2.6  # past the 2 s lease
        async with workers(stalling, config=config):
            await until(lambda: stalling.stall_s == 0.0)  # A has the endpoint, stalled
            async with workers(ReservationService(db2), config=config):
                await until(lambda: len(rec.ok()) >= len(expected))
                await asyncio.sleep(1.2)  # A resumes meanwhile
    got = [d.doc["id"] for d in rec.ok()]
    assert got == expected
    assert len(rec.seen) == len(expected)
