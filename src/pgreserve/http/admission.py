"""Admission: every request's deadline, and how many requests one tenant may have in flight.

The deadline is set per request by `Admission` (ASGI middleware) and read by
Database.call / fetch and the combiner (db.database.deadline): the wait for a
connection, the transaction's statement_timeout and every retry fit inside it.
A request that cannot start in time is `Busy` (503, Retry-After) and was not run.

The tenant limit is in-process (no round trip): a counter per tenant, taken once
the API key is known (`admit`, called by the tenant dependency) and given back
when the response is done. Over the limit the answer is 429 `too_many_requests`
(Retry-After) before any work.
"""

from __future__ import annotations

import math
from contextvars import ContextVar

from .. import errors
from ..db.database import deadline
from .middleware import ASGIApp, Receive, Scope, Send

# Fits the transaction limits (db.database.TxSettings): a connection is waited
# for at most 1 s, a lock at most 2 s, and a retry after a deadlock or a lost
# connection still fits; statement_timeout (10 s) is cut to what is left.
DEFAULT_REQUEST_DEADLINE_S = 5.0


class TenantLimit:
    """At most `max_in_flight` requests per tenant at once in this process (0: no limit)."""

    def __init__(self, max_in_flight: int = 0, retry_after_s: int = 1) -> None:
        if not 0 <= max_in_flight <= 1_000_000:
            raise errors.InvalidRequest("tenant_max_in_flight must be between 0 and 1000000",
                                        field="tenant_max_in_flight")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight: dict[int, int] = {}

    def take(self, tenant: int) -> None:
        n = self.in_flight.get(tenant, 0)
        if n >= self.max_in_flight:
            raise errors.TooManyRequests(
                f"this tenant already has {n} requests in flight on this server (at most "
                f"{self.max_in_flight}); nothing was done, retry later",
                retry_after_s=self.retry_after_s)
        self.in_flight[tenant] = n + 1

    def give_back(self, tenant: int) -> None:
        n = self.in_flight.get(tenant, 0) - 1
        if n > 0:
            self.in_flight[tenant] = n
        else:
            self.in_flight.pop(tenant, None)


class _Ticket:
    """What one request took from the tenant limit (given back at its end)."""

    __slots__ = ("limit", "tenant")

    def __init__(self, limit: TenantLimit) -> None:
        self.limit = limit
        self.tenant: int | None = None


_ticket: ContextVar[_Ticket | None] = ContextVar("pgreserve_admission", default=None)


def admit(tenant: int) -> None:
    """Count this request against its tenant's limit (429 when over it); once per request."""
    ticket = _ticket.get()
    if ticket is None or ticket.tenant is not None or ticket.limit.max_in_flight == 0:
        return
    ticket.limit.take(tenant)
    ticket.tenant = tenant


def check_deadline(seconds: float) -> float:
    if not (math.isfinite(seconds) and 0.1 <= seconds <= 600):
        raise errors.InvalidRequest("request_deadline_s must be between 0.1 and 600 seconds",
                                    field="request_deadline_s")
    return seconds


class Admission:
    """Run each HTTP request under its deadline and give back its tenant slot at the end."""

    def __init__(self, app: ASGIApp, deadline_s: float, limit: TenantLimit) -> None:
        self.app = app
        self.deadline_s = check_deadline(deadline_s)
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ticket = _Ticket(self.limit)
        token = _ticket.set(ticket)
        try:
            with deadline(self.deadline_s):
                await self.app(scope, receive, send)
        finally:
            _ticket.reset(token)
            if ticket.tenant is not None:
                self.limit.give_back(ticket.tenant)
