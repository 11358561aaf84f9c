"""The webhook deliverer: POSTs each tenant's events to its registered endpoints.

At least once, in feed order per endpoint: event N+1 is sent only after N was
acknowledged with a 2xx. A failure is recorded on the endpoint's cursor row
(attempts, last error) and the endpoint is tried again after a capped
exponential backoff. Each endpoint is claimed with FOR UPDATE SKIP LOCKED and
leased for `lease_s`; the HTTP request goes out with no transaction open and a
timeout shorter than the lease, so several copies of this worker never send to
one endpoint at once, and a dead endpoint holds up nothing but itself.

Only public addresses are sent to unless `allow_private` (webhook_targets.py):
an IP literal is checked before the request, a name by the connector's
resolver, on the very addresses it is about to connect to (a name that
resolved elsewhere at registration is refused here without connecting). Redirects
are never followed.

Every request is signed: header `Pgreserve-Signature: t=<unix seconds>,v1=<hex>`
where v1 = HMAC-SHA256(secret, f"{t}." + body) (see `verify`).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import json
import logging
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from .. import webhook_targets
from ..core.service import OPS, ReservationService
from ..db.queries import queries
from ..domain import Event
from ..errors import WebhookUrlRefused
from .base import LoopConfig

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Pgreserve-Signature"
USER_AGENT = "pgreserve-webhooks/1"


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header value for `body` sent at `timestamp` (unix seconds)."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(secret: str, header: str, body: bytes, *, tolerance_s: float = 300.0,
           now: float | None = None) -> bool:
    """True when `header` is a valid signature of `body` made within `tolerance_s`."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def event_body(event: Event) -> bytes:
    """The JSON body of one delivery: the same shape as an item of GET /v1/events."""
    doc = {"id": event.event_id, "type": event.type,
           "created_at": event.created_at.isoformat(), "data": event.payload}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class WebhookConfig:
    timeout_s: float = 10.0  # one HTTP request, connect to last byte
    lease_s: float = 60.0  # how long a claimed endpoint stays with this worker
    backoff_base_s: float = 1.0  # first retry after ~this, doubling per failed attempt
    backoff_cap_s: float = 600.0
    idle_poll_s: float = 1.0  # an endpoint with nothing to send is looked at again after this
    concurrency: int = 16  # endpoints one worker delivers to at the same time
    # at most this many of them of one tenant (None: half of concurrency, at least 1):
    # a tenant's hanging endpoints leave the other slots to other tenants
    per_tenant: int | None = None
    events_per_claim: int = 100  # then the endpoint goes back in the queue
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(interval_s=0.5))
    # send to loopback, private and other non-public addresses too (local
    # development, tests); default: PGRESERVE_WEBHOOK_ALLOW_PRIVATE
    allow_private: bool = field(default_factory=webhook_targets.allow_private_default)

    def __post_init__(self) -> None:
        if not 0.05 <= self.timeout_s <= 300:
            raise ValueError("timeout_s must be between 0.05 and 300 seconds")
        if self.lease_s < 2 * self.timeout_s + 1:
            raise ValueError("lease_s must be at least 2 x timeout_s + 1 second")
        if not 0.001 <= self.backoff_base_s <= self.backoff_cap_s <= 86_400:
            raise ValueError("need 0.001 <= backoff_base_s <= backoff_cap_s <= 86400")
        if not 0.001 <= self.idle_poll_s <= 3600:
            raise ValueError("idle_poll_s must be between 0.001 and 3600 seconds")
        if not 1 <= self.concurrency <= 1000:
            raise ValueError("concurrency must be between 1 and 1000")
        if not 1 <= self.events_per_claim <= 10_000:
            raise ValueError("events_per_claim must be between 1 and 10000")
        if self.per_tenant is not None and not 1 <= self.per_tenant <= self.concurrency:
            raise ValueError("per_tenant must be between 1 and concurrency")

    @property
    def tenant_share(self) -> int:
        """Endpoints of one tenant one worker delivers to at the same time, at most."""
        return self.per_tenant if self.per_tenant is not None else max(1, self.concurrency // 2)


class AddressRefused(OSError):
    """A delivery's host resolved to an address webhooks may not go to."""


class PublicOnlyResolver(AbstractResolver):
    """The connector's resolver: the system's answer, refused whole when any address
    in it is not public (aiohttp connects only to the addresses returned here)."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        try:
            webhook_targets.check_addresses(host, [str(r["host"]) for r in found])
        except WebhookUrlRefused as exc:
            raise AddressRefused(errno.EACCES, exc.message) from None
        return found

    async def close(self) -> None:
        await self._inner.close()


# A send starts only if it ends (timeout_s) this long before the lease does: the
# lease is counted from before the call that took or renewed it, on this host's clock.
LEASE_MARGIN_S = 1.0


@dataclass(frozen=True)
class Claim:
    tenant: int
    endpoint: int
    token: str
    cursor: tuple[int, int]
    url: str
    secret: str
    lease_until: float  # monotonic time by which the lease has surely ended

    @classmethod
    def from_json(cls, doc: dict[str, Any], lease_until: float) -> Claim:
        return cls(int(doc["tenant"]), int(doc["endpoint"]), str(doc["token"]),
                   (int(doc["xid"]), int(doc["event_id"])), str(doc["url"]),
                   str(doc["secret"]), lease_until)


class WebhookDeliverer:
    name = "webhooks"

    def __init__(self, service: ReservationService, config: WebhookConfig | None = None) -> None:
        self.service = service
        self.config = config or WebhookConfig()
        self.loop_config = self.config.loop
        self.delivered = 0
        self.failed_attempts = 0
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[asyncio.Task[int], Claim] = {}

    async def run_once(self) -> int:
        """Start deliveries to due endpoints, collect finished ones; return events delivered
        plus endpoints claimed (0 = nothing due and nothing finished)."""
        done = self._reap()
        claimed: list[Claim] = []
        free = self.config.concurrency - len(self._inflight)
        if free > 0:
            claimed = await self._claim(free)
            for claim in claimed:
                task = asyncio.create_task(self._deliver(claim))
                self._inflight[task] = claim
        if not claimed and done == 0 and self._inflight:
            await asyncio.wait(list(self._inflight), timeout=self.loop_config.interval_s,
                               return_when=asyncio.FIRST_COMPLETED)
            done += self._reap()
        return done + len(claimed)

    async def aclose(self) -> None:
        """Stop in-flight deliveries (their events are sent again later) and hand back leases."""
        claims = list(self._inflight.values())
        for task in self._inflight:
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        self._inflight.clear()
        for claim in claims:
            try:
                await self._release(claim, 0.0)
            except Exception:  # noqa: BLE001 - shutdown goes on; an unreturned lease expires
                log.warning("webhooks: could not hand back the lease of endpoint %s",
                            claim.endpoint)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- internals ---------------------------------------------------------------

    def _reap(self) -> int:
        total = 0
        for task in [t for t in self._inflight if t.done()]:
            claim = self._inflight.pop(task)
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                log.error("webhooks: delivery to endpoint %s failed: %r", claim.endpoint, exc)
                continue
            total += task.result()
        return total

    async def _claim(self, limit: int) -> list[Claim]:
        busy = Counter(claim.tenant for claim in self._inflight.values())
        until = time.monotonic() + self.config.lease_s
        docs = await self.service.db.call(queries["webhook_lease"],
                                          (limit, timedelta(seconds=self.config.lease_s),
                                           self.config.tenant_share, list(busy),
                                           list(busy.values())),
                                          op=OPS["webhook_lease"])
        return [Claim.from_json(d, until) for d in docs]

    async def _release(self, claim: Claim, after_s: float) -> None:
        await self.service.db.call(queries["webhook_release"],
                                   (claim.tenant, claim.endpoint, claim.token,
                                    timedelta(seconds=after_s)), op=OPS["webhook_release"])

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = (aiohttp.TCPConnector() if self.config.allow_private
                         else aiohttp.TCPConnector(resolver=PublicOnlyResolver()))
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
                headers={"User-Agent": USER_AGENT}, trust_env=False)
        return self._session

    async def _deliver(self, claim: Claim) -> int:
        """Send this endpoint's events after its cursor, one at a time; return how many."""
        cfg = self.config
        lease = timedelta(seconds=cfg.lease_s)
        cursor = claim.cursor
        until = claim.lease_until
        sent = 0
        while sent < cfg.events_per_claim:
            page = await self.service.events(claim.tenant, after=cursor,
                                             limit=min(100, cfg.events_per_claim - sent),
                                             op=OPS["webhook_events"])
            if not page.events:
                await self._release(claim, cfg.idle_poll_s)
                return sent
            for event in page.events:
                if time.monotonic() + cfg.timeout_s + LEASE_MARGIN_S > until:
                    # (a worker that stalled: the send could end after the lease, when
                    # another worker may be sending to the endpoint; a lease already
                    # lost is not handed back, the token no longer matches)
                    await self._release(claim, 0.0)
                    return sent
                error = await self._post(claim, event)
                if error is not None:
                    self.failed_attempts += 1
                    attempts = await self.service.db.call(
                        queries["webhook_fail"],
                        (claim.tenant, claim.endpoint, claim.token, error,
                         timedelta(seconds=cfg.backoff_base_s),
                         timedelta(seconds=cfg.backoff_cap_s)), op=OPS["webhook_fail"])
                    log.info("webhooks: endpoint %s, event %s: %s (attempt %s)",
                             claim.endpoint, event.event_id, error, attempts)
                    return sent
                renewed = time.monotonic() + cfg.lease_s
                kept = await self.service.db.call(
                    queries["webhook_advance"],
                    (claim.tenant, claim.endpoint, claim.token, event.xid, event.event_id,
                     lease), op=OPS["webhook_advance"])
                sent += 1
                self.delivered += 1
                if not kept:  # lease lost (endpoint deleted, or the lease ran out)
                    return sent
                until = renewed
                cursor = (event.xid, event.event_id)
        await self._release(claim, 0.0)  # more may be waiting: due again at once
        return sent

    async def _post(self, claim: Claim, event: Event) -> str | None:
        """POST one event; None on a 2xx, else what went wrong."""
        if not self.config.allow_private:
            refused = _refused_literal(claim.url)
            if refused is not None:
                return refused
        body = event_body(event)
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(claim.secret, int(time.time()), body),
            "Pgreserve-Event-Id": str(event.event_id),
            "Pgreserve-Event-Type": event.type,
        }
        try:
            async with self._client().post(claim.url, data=body, headers=headers,
                                           allow_redirects=False) as response:
                if 200 <= response.status < 300:
                    return None
                return f"HTTP {response.status}"
        except TimeoutError:
            return f"timed out after {self.config.timeout_s:g} s"
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, AddressRefused):
                return f"refused, not sent: {exc.os_error.strerror}"[:1000]
            return f"{type(exc).__name__}: {exc}"[:1000]
        except (aiohttp.ClientError, ValueError) as exc:
            # (ValueError: a URL the client cannot send to, say a host name IDNA refuses,
            # registered before such names were refused: a failed attempt, with backoff)
            return f"{type(exc).__name__}: {exc}"[:1000]


def _refused_literal(url: str) -> str | None:
    """The error of a URL whose host is a refused IP literal (no resolver sees those)."""
    try:
        host = webhook_targets.host_of(url)
    except (ValueError, WebhookUrlRefused):
        return "refused, not sent: the URL has no valid host"
    address = webhook_targets.literal(host)
    if address is None:
        return None
    why = webhook_targets.refusal(address)
    if why is None:
        return None
    return f"refused, not sent: webhook host {host} is {why}"
