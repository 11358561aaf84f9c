"""What the route handlers are given: the service, the tenant, keys in flight, metrics.

Per-app objects live on `app.state` (create_app puts them there), so the
handlers are plain module-level functions and several apps can share a process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, Header, Path, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .. import errors
from .. import validation as check
from ..core.service import ReservationService
from . import problems
from .metrics import ApiMetrics
from .models import storable


class InFlight:
    """Idempotency keys being processed by this process: a concurrent duplicate gets 409.

    Across processes the database serializes duplicates instead: the second
    waits for the first and replays its stored outcome.
    """

    def __init__(self) -> None:
        self.keys: set[tuple[int, str]] = set()

    @asynccontextmanager
    async def hold(self, tenant: int, key: str) -> AsyncIterator[None]:
        if (tenant, key) in self.keys:
            raise problems.RequestInProgress(
                "a request with this Idempotency-Key is still in progress; retry shortly")
        self.keys.add((tenant, key))
        try:
            yield
        finally:
            self.keys.discard((tenant, key))


def service(request: Request) -> ReservationService:
    """The app's service; 503 while its pool is not open."""
    svc = getattr(request.app.state, "service", None)
    if svc is None:
        raise problems.Unavailable("the database pool is not open")
    return svc  # type: ignore[no-any-return]  # app.state is untyped


def in_flight(request: Request) -> InFlight:
    return request.app.state.inflight  # type: ignore[no-any-return]  # app.state is untyped


def metrics(request: Request) -> ApiMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]  # app.state is untyped


_bearer = HTTPBearer(auto_error=False, description="An API key from `pgreserve tenant create`")


async def tenant_id(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> int:
    """The tenant of the request's bearer API key; 401 when missing or unknown."""
    if credentials is None:
        raise problems.Unauthorized("send an API key as 'Authorization: Bearer <key>'")
    tenant = await service(request).tenant_for_api_key(credentials.credentials)
    if tenant is None:
        raise problems.Unauthorized("unknown API key")
    return tenant


async def known_query_only(request: Request) -> None:
    """Refuse query parameters the route does not declare.

    A misspelt parameter (`afetr=` for `after=`) would otherwise be ignored and
    the request answered as if it had not been sent: the feed from the start.
    """
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known: set[str] = set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        known.update(param.alias for param in dependant.query_params)
        pending.extend(dependant.dependencies)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise errors.InvalidRequest(f"unknown query parameters: {unknown}", field="query")


# Declared after Tenant in a handler's parameters: tenant_id has already
# answered 503 when the pool is not open, so the order of checks is unchanged.
Service = Annotated[ReservationService, Depends(service)]
Tenant = Annotated[int, Depends(tenant_id)]
Keys = Annotated[InFlight, Depends(in_flight)]
Metrics = Annotated[ApiMetrics, Depends(metrics)]
PathName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]
KeyHeader = Annotated[str | None, Header(
    alias="Idempotency-Key",
    description="Up to 200 characters. A repeat with the same key and body replays the "
                "first response (header Idempotent-Replayed: true).")]


# Checked in the handler body, after FastAPI has validated the request: a
# missing key on an invalid body stays a 422, not a 400.

def stored_name(value: str, field: str) -> str:
    """A path name (sku, location) as stored, or InvalidRequest naming the field."""
    try:
        return storable(value)
    except ValueError as exc:
        raise errors.InvalidRequest(f"{field} {exc}", field=field) from None


def request_key(value: str | None, required: bool) -> str | None:
    """The Idempotency-Key header, checked; 400 when required and missing."""
    if value is None or value == "":
        if required:
            raise problems.IdempotencyKeyMissing(
                "this request needs an Idempotency-Key header (1 to 200 characters)")
        return None
    try:
        return check.name(storable(value), "Idempotency-Key")
    except ValueError as exc:
        raise errors.InvalidRequest(f"Idempotency-Key {exc}", field="Idempotency-Key") from None
