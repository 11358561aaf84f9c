"""Webhooks go to public addresses only: refused at registration and again at delivery,
after a real name resolution, unless private addresses are allowed explicitly."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from aiohttp import web
from click.testing import CliRunner

from conftest import ApiTenant
from pgreserve import Database, ReservationService, Tenant
from pgreserve.cli import main
from pgreserve.errors import WebhookUrlRefused
from pgreserve.webhook_targets import ALLOW_PRIVATE_ENV, refusal
from pgreserve.workers.webhooks import WebhookConfig
from test_http_api import assert_problem
from test_webhooks import FAST, make_events, receiver, serving, until, workers

# (address class, URL host) for every class that must be refused.
REFUSED = [
    ("loopback", "127.0.0.1"), ("loopback", "127.8.9.10"),
    ("private", "10.1.2.3"), ("private", "172.16.0.1"), ("private", "192.168.1.1"),
    ("link-local", "169.254.169.254"),
    ("multicast", "224.0.0.251"), ("multicast", "239.1.2.3"),
    ("unspecified", "0.0.0.0"),  # noqa: S104 - an address to refuse, nothing binds it
    ("non-public", "100.64.0.1"),
    ("loopback", "[::1]"), ("unspecified", "[::]"), ("link-local", "[fe80::1]"),
    ("private", "[fd12:3456::1]"), ("multicast", "[ff02::1]"),
    ("loopback", "[::ffff:127.0.0.1]"), ("private", "[::ffff:10.0.0.1]"),
    ("loopback", "[2002:7f00:1::]"), ("loopback", "[64:ff9b::7f00:1]"),
    # numeric forms the system resolver maps onto 127.0.0.1
    ("loopback", "2130706433"), ("loopback", "127.1"),
    # a trailing dot (a fully qualified name) is the same address
    ("loopback", "127.0.0.1."), ("unspecified", "0.0.0.0."),
]
ALLOWED = ["93.184.215.14", "[2606:2800:21f:cb07:6820:80da:af6b:8b2c]"]
BLOCKED = WebhookConfig(timeout_s=2.0, lease_s=5.0, backoff_base_s=0.02, backoff_cap_s=0.1,
                        idle_poll_s=0.02, loop=FAST.loop, allow_private=False)


def test_each_address_class_is_classified() -> None:
    """refusal() names the class of every refused address literal and passes public ones."""
    for what, host in REFUSED:
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            continue  # a numeric form: resolved below, not a literal
        assert refusal(address) in (f"a {what} address", f"an {what} address"), host
    for host in ALLOWED:
        assert refusal(ipaddress.ip_address(host.strip("[]"))) is None


async def test_registration_refuses_every_class(db: Database, tenant: Tenant) -> None:
    """Registering a URL on each refused address class, or on a name the real resolver
    maps to loopback (localhost, 127.1), raises WebhookUrlRefused and stores nothing;
    public addresses are accepted."""
    service = ReservationService(db, allow_private_webhooks=False)
    for what, host in REFUSED:
        with pytest.raises(WebhookUrlRefused) as refused:
            await service.add_webhook(tenant.id, f"http://{host}:8080/hook")
        assert refused.value.code == "webhook_url_refused"
        assert "address" in refused.value.message, host
        assert what in refused.value.message, host
    with pytest.raises(WebhookUrlRefused, match=r"resolves to (127\.0\.0\.1|::1), a loopback address"):
        await service.add_webhook(tenant.id, "http://localhost:8080/hook")
    assert await service.webhooks(tenant.id) == []
    for host in ALLOWED:
        await service.add_webhook(tenant.id, f"https://{host}/hook")
    assert len(await service.webhooks(tenant.id)) == len(ALLOWED)


async def test_registration_allows_private_when_told(db: Database, tenant: Tenant,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the setting (option or PGRESERVE_WEBHOOK_ALLOW_PRIVATE=1) loopback and private
    URLs are accepted; without it the default is to refuse them."""
    monkeypatch.delenv(ALLOW_PRIVATE_ENV, raising=False)
    with pytest.raises(WebhookUrlRefused):
        await ReservationService(db).add_webhook(tenant.id, "http://127.0.0.1:9/x")
    await ReservationService(db, allow_private_webhooks=True).add_webhook(
        tenant.id, "http://127.0.0.1:9/x")
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    await ReservationService(db).add_webhook(tenant.id, "http://[::1]:9/x")
    assert len(await ReservationService(db).webhooks(tenant.id)) == 2


async def test_http_and_cli_refuse_private_urls(api: ApiTenant, dsn: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """POST /v1/webhooks answers 422 webhook_url_refused and `webhook add` fails with the
    same message; nothing is registered."""
    monkeypatch.delenv(ALLOW_PRIVATE_ENV, raising=False)
    for url in ("http://127.0.0.1:9/x", "http://[::ffff:192.168.0.1]/x", "http://localhost/x"):
        doc = assert_problem(await api.client.post("/v1/webhooks", json={"url": url}), 422,
                             "webhook_url_refused")
        assert "only public addresses" in doc["detail"]
    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["webhook", "add", "acme", "http://169.254.169.254/latest",
                                   "--database-url", dsn])
    assert result.exit_code != 0 and "link-local" in result.output
    assert (await api.client.get("/v1/webhooks")).json() == {"webhooks": []}


async def test_delivery_refuses_without_connecting(db: Database, tenant: Tenant) -> None:
    """An endpoint registered while private addresses were allowed is refused by a
    deliverer that does not allow them, for each address class and for a name that
    resolves to loopback (localhost, through the system resolver): nothing reaches the
    receiver and last_error says why; allowed, the same endpoint gets its events."""
    allowing = ReservationService(db, allow_private_webhooks=True)
    async with receiver() as rec:
        port = rec.url.rsplit(":", 1)[1]
        live = await allowing.add_webhook(tenant.id, f"http://localhost:{port}/hook")
        literal = await allowing.add_webhook(tenant.id, f"http://127.0.0.1:{port}/hook")
        others = [await allowing.add_webhook(tenant.id, f"http://{host}:9/x")
                  for _, host in REFUSED]
        await make_events(allowing, tenant.id, 3)
        async with workers(allowing, config=BLOCKED):
            await until(lambda: False, timeout_s=0.5)
            state = {w.id: w for w in await allowing.webhooks(tenant.id)}
        assert rec.seen == []
        assert state[live.id].delivered == 0 and state[live.id].attempts >= 1
        error = state[live.id].last_error or ""
        assert error.startswith("refused, not sent") and "resolves to" in error
        assert "loopback" in error
        for hook in (literal, *others):
            assert state[hook.id].delivered == 0, hook.url
            assert (state[hook.id].last_error or "").startswith("refused, not sent"), hook.url
        for hook in others:
            await allowing.delete_webhook(tenant.id, hook.id)  # never sent to, also later
        async with workers(allowing, config=FAST):
            await until(lambda: len(rec.ok()) >= 4 * 2)
        assert len(rec.ok()) >= 4 * 2  # both loopback endpoints, once allowed


async def test_redirects_are_not_followed(service: ReservationService, tenant: Tenant) -> None:
    """A 3xx answer is a failed attempt: the Location is never requested."""
    hit: list[str] = []

    async def moved(request: web.Request) -> web.Response:
        hit.append(request.path)
        raise web.HTTPFound(location="/inside")

    async with serving(moved) as url:
        allowing = ReservationService(service.db, allow_private_webhooks=True)
        await allowing.add_webhook(tenant.id, f"{url}/hook")
        await make_events(allowing, tenant.id, 1)
        async with workers(allowing, config=FAST):
            await until(lambda: len(hit) >= 2)
        state = (await allowing.webhooks(tenant.id))[0]
    assert hit and set(hit) == {"/hook"}
    assert state.delivered == 0 and state.last_error == "HTTP 302"


async def test_a_registration_waits_for_the_resolver_within_its_deadline(
        db: Database, tenant: Tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolver that does not answer is waited for at most half the time left before
    the request's deadline, then the name is accepted as one that does not resolve (the
    delivery worker checks it before every connection) and the endpoint is written.
    Before, the wait was a fixed 5 s: with the default 5 s deadline every registration
    under a stalled resolver ended in 503 busy, past its deadline."""
    from pgreserve.db.database import deadline

    asked: list[str] = []
    stalled = asyncio.Event()

    async def no_answer(host: str, *args: object, **kwargs: object) -> object:
        asked.append(host)
        await stalled.wait()  # never set: only the timeout ends it
        raise AssertionError("unreachable")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_answer)
    service = ReservationService(db, allow_private_webhooks=False)
    with deadline(1.0):
        hook = await service.add_webhook(tenant.id, "https://hooks.example.com/in")
    assert asked == ["hooks.example.com"]
    assert [w.id for w in await service.webhooks(tenant.id)] == [hook.id]
