"""What the route handlers are given: the service, the tenant, keys in flight, metrics.

Per-app objects live on `app.state` (create_app puts them there), so the
handlers are plain module-level functions and several apps can share a process.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import unquote_to_bytes

from fastapi import Depends, Header, Path, Request
from fastapi.routing import APIRoute

from .. import apikeys, errors
from .. import validation as check
from ..core.service import ReservationService
from ..db.database import current_deadline, deadline_at
from ..rollout import Rollout
from . import admission, problems
from .metrics import ApiMetrics
from .middleware import TENANT_KEY
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


class ApiKeyCache:
    """Recently authenticated API keys (by hash) and their tenant, for `ttl_s` seconds.

    Off by default (`ttl_s` 0): every request asks the database, so a key revoked
    there is refused from the next request on. With `ttl_s` > 0 only keys the
    database accepted are kept, at most `max_keys`: a new key works at once, an
    unknown one is asked every time, and a revoked key is still accepted for up
    to `ttl_s` by a process that cached it (a round trip saved per request, for
    that bound).

    With `ttl_s` 0 it also remembers which tenant each accepted key belongs to
    (`hint`): a request whose key the database accepted before can then be routed
    to its tenant's batch at once, and the key is checked in that batch's own
    transaction instead of by a read of its own (`authenticate_in_batch`). A key
    revoked before the request is still refused; the hint only saves the read.
    """

    def __init__(self, ttl_s: float = 0.0, max_keys: int = 10_000) -> None:
        if not (math.isfinite(ttl_s) and 0 <= ttl_s <= 3600):
            raise errors.InvalidRequest("api_key_cache_s must be between 0 and 3600 seconds",
                                        field="api_key_cache_s")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._keys: dict[bytes, tuple[int, float]] = {}
        self._hints: dict[bytes, int] = {}  # accepted once: the key's tenant
        self.lookups = KeyLookups()

    def hint(self, key: str) -> tuple[int, bytes] | None:
        """(tenant, hash) of a key the database accepted before, still to be checked
        where the request runs; None: ask the database first (`tenant`)."""
        if self.ttl_s != 0 or not apikeys.plausible(key):
            return None
        digest = apikeys.hash_key(key)
        tenant = self._hints.get(digest)
        return None if tenant is None else (tenant, digest)

    def refused(self, digest: bytes) -> None:
        """A check where the request ran refused this key: ask the database next time."""
        self._hints.pop(digest, None)

    async def tenant(self, svc: ReservationService, key: str) -> int | None:
        if not apikeys.plausible(key):
            return None  # what the database would say, without asking it
        digest = apikeys.hash_key(key)
        if self.ttl_s == 0:
            tenant = await self.lookups.tenant(svc, digest)
            if tenant is None:
                self._hints.pop(digest, None)
            else:
                if len(self._hints) >= self.max_keys:
                    self._hints.clear()
                self._hints[digest] = tenant
            return tenant
        now = time.monotonic()
        known = self._keys.get(digest)
        if known is not None and known[1] > now:
            return known[0]
        tenant = await self.lookups.tenant(svc, digest)
        if tenant is None:
            self._keys.pop(digest, None)
            return None
        if len(self._keys) >= self.max_keys:
            self._keys = {k: v for k, v in self._keys.items() if v[1] > now}
            if len(self._keys) >= self.max_keys:
                self._keys.clear()
        self._keys[digest] = (tenant, now + self.ttl_s)
        return tenant


class KeyLookups:
    """The database's answer for API keys, one read for the requests that ask together.

    A request's key is looked up by a read that starts after the request asked (never
    by one already in flight), so a key revoked before a request arrives is refused,
    as with a read per request. While a read is in flight, the keys asked meanwhile
    gather (each distinct hash once) and go in the next one: under load one round trip
    and one pool connection answer many requests, instead of one each. The read runs
    under the latest deadline of the requests it answers; its failure (Busy,
    DatabaseUnavailable, ...) is each of theirs.
    """

    def __init__(self) -> None:
        self._pending: dict[bytes, list[asyncio.Future[int | None]]] = {}
        self._latest: float | None = None  # the latest deadline among the pending
        self._unbounded = False  # a pending request has no deadline
        self._task: asyncio.Task[None] | None = None

    async def tenant(self, svc: ReservationService, digest: bytes) -> int | None:
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        waiting = self._pending.get(digest)
        if waiting is None:
            self._pending[digest] = [future]
        else:
            waiting.append(future)
        end = current_deadline()
        if end is None:
            self._unbounded = True
        elif self._latest is None or end > self._latest:
            self._latest = end
        if self._task is None:
            self._task = asyncio.create_task(self._drain(svc))
        return await future

    async def _drain(self, svc: ReservationService) -> None:
        batch: dict[bytes, list[asyncio.Future[int | None]]] = {}
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                end = None if self._unbounded else self._latest
                self._latest, self._unbounded = None, False
                try:
                    with deadline_at(end):
                        found = await svc.tenants_for_api_key_hashes(list(batch))
                except Exception as exc:  # noqa: BLE001 - every waiter of the read gets it
                    _settle(batch, exc)
                    continue
                for digest, futures in batch.items():
                    tenant = found.get(digest)
                    for future in futures:
                        if not future.done():
                            future.set_result(tenant)
                batch = {}
        except BaseException:  # cancelled (shutdown): no waiter is left hanging
            _settle(batch, None)
            _settle(self._pending, None)
            self._pending = {}
            raise
        finally:
            self._task = None


def _settle(batch: dict[bytes, list[asyncio.Future[int | None]]],
            exc: BaseException | None) -> None:
    """Fail every waiter of `batch` with `exc` (None: cancel them)."""
    for futures in batch.values():
        for future in futures:
            if not future.done():
                if exc is None:
                    future.cancel()
                else:
                    future.set_exception(exc)


def service(request: Request) -> ReservationService:
    """The app's service; 503 while its pool is not open."""
    return service_of(request.app.state)


def service_of(state: Any) -> ReservationService:
    """The service of an app's `state`; 503 while its pool is not open."""
    svc: ReservationService | None = getattr(state, "service", None)
    if svc is None:
        raise problems.Unavailable("the database pool is not open")
    return svc


# Dependencies are coroutines: FastAPI runs a plain function in a worker
# thread, a thread handoff per request for a lookup on app.state.
async def service_dependency(request: Request) -> ReservationService:
    return service(request)


async def in_flight(request: Request) -> InFlight:
    return request.app.state.inflight  # type: ignore[no-any-return]  # app.state is untyped


def metrics(request: Request) -> ApiMetrics:
    return request.app.state.metrics  # type: ignore[no-any-return]  # app.state is untyped


async def metrics_dependency(request: Request) -> ApiMetrics:
    return metrics(request)


# The API key is read from the header here rather than by fastapi.security's
# HTTPBearer (a dependency of its own on every request); openapi.py declares
# the same "HTTPBearer" scheme for the routes that depend on tenant_id.
BEARER_SCHEME = "HTTPBearer"
BEARER_DESCRIPTION = "An API key from `pgreserve tenant create`"


async def tenant_id(request: Request) -> int:
    """The tenant of the request's bearer API key; 401 when missing, unknown or sent in
    more than one Authorization header. A repeated Idempotency-Key header is refused
    here too (400), once the caller is known and before anything runs: each header
    names one value, and a request that sends two is ambiguous. (The fast path hands
    such requests to the routes.)"""
    headers = request.headers
    authorization = headers.getlist("authorization")
    if len(authorization) > 1:
        raise problems.Unauthorized(
            f"send one Authorization header, not {len(authorization)}")
    tenant = await authenticate(request.app.state, request.scope,
                                authorization[0] if authorization else None)
    keys = len(headers.getlist("idempotency-key"))
    if keys > 1:
        raise problems.IdempotencyKeyInvalid(
            f"send one Idempotency-Key header, not {keys}", field="Idempotency-Key")
    return tenant


async def authenticate(state: Any, scope: MutableMapping[str, Any],
                       authorization: str | None) -> int:
    """tenant_id for an app's `state` and a request's scope and Authorization header
    (the hot routes' fast path calls it too): 401 when missing or unknown, 503 while
    the pool is not open, 429 over the tenant's in-flight limit."""
    credentials = bearer_key(authorization)
    return admitted(scope, await accepted_tenant(state, credentials))


def bearer_key(authorization: str | None) -> str:
    """The API key of an Authorization header; 401 when it names none."""
    scheme, _, credentials = (authorization or "").partition(" ")
    credentials = credentials.strip()
    if scheme.lower() != "bearer" or not credentials:
        raise problems.Unauthorized("send an API key as 'Authorization: Bearer <key>'")
    return credentials


async def accepted_tenant(state: Any, credentials: str) -> int:
    """The tenant the database (or the key cache) accepts this key for; 503 while the
    pool is not open, 401 for an unknown or revoked key."""
    keys: ApiKeyCache = state.api_keys
    tenant = await keys.tenant(service_of(state), credentials)
    if tenant is None:
        raise problems.Unauthorized(errors.UNKNOWN_API_KEY)
    return tenant


def admitted(scope: MutableMapping[str, Any], tenant: int) -> int:
    """Count the request against its tenant (429 over the in-flight limit) and name the
    tenant for the request log line."""
    admission.admit(tenant)
    scope[TENANT_KEY] = tenant
    return tenant


async def authenticate_in_batch(state: Any, scope: MutableMapping[str, Any],
                                authorization: str | None) -> tuple[int, bytes | None]:
    """`authenticate` for a request whose operation checks its key itself: for a key the
    database accepted before (ApiKeyCache.hint), its tenant at once and the key's hash,
    which the operation must check in its own transaction (api_key_hash=); for any
    other key, `authenticate`'s answer and None."""
    credentials = bearer_key(authorization)
    hinted = state.api_keys.hint(credentials)
    if hinted is None:
        return admitted(scope, await accepted_tenant(state, credentials)), None
    tenant, digest = hinted
    service_of(state)  # 503 while the pool is not open, as for a key read
    try:
        return admitted(scope, tenant), digest
    except errors.TooManyRequests:
        if await refused_now(state, credentials):  # a refused key is 401, not 429
            raise problems.Unauthorized(errors.UNKNOWN_API_KEY) from None
        raise


async def refused_now(state: Any, credentials: str) -> bool:
    """Whether the database refuses now a key a request was let in with on its hint
    (ApiKeyCache.hint) and that nothing has checked yet. Asked when such a request
    fails before its operation checks the key (over its tenant's limit; its request
    key, cart or reservation id refused): FastAPI's routes check the key first, so a
    refused key is their 401, not the request's own error. False when the key is
    accepted, and when the database cannot say now (the request's own error stands)."""
    try:
        await accepted_tenant(state, credentials)
    except problems.Unauthorized:
        return True
    except errors.PgReserveError:
        return False
    return False


def refused_in_batch(state: Any, scope: MutableMapping[str, Any],
                     digest: bytes) -> problems.Unauthorized:
    """The 401 of a key its operation refused (ApiKeyRefused): what authenticate says of
    an unknown key; the next request with it asks the database first."""
    state.api_keys.refused(digest)
    scope.pop(TENANT_KEY, None)
    return problems.Unauthorized(errors.UNKNOWN_API_KEY)


@dataclass(frozen=True)
class Caller:
    """An authenticated request's tenant, with what the hot routes need of the app
    (one dependency instead of four: FastAPI's cost is per dependency)."""

    tenant: int
    service: ReservationService
    keys: InFlight
    metrics: ApiMetrics
    # reserve, claim and release: the rollout layer when a legacy store is configured
    holds: ReservationService | Rollout


async def caller(request: Request, tenant: Annotated[int, Depends(tenant_id)]) -> Caller:
    state = request.app.state
    svc = service(request)
    return Caller(tenant, svc, state.inflight, state.metrics, state.rollout or svc)


async def holds_dependency(request: Request) -> ReservationService | Rollout:
    """The rollout layer when a legacy store is configured, else the service."""
    rollout: Rollout | None = request.app.state.rollout
    return rollout or service(request)


# The query parameters a route declares, found once and kept on the route.
_DECLARED = "_pgreserve_query_params"


def utf8_target(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request's path and query string are UTF-8 once percent-decoded. The
    server hands undecodable bytes on as U+FFFD, so without this check `%E9` and `%E8`
    would both name the line "\ufffd", and a write to one would overwrite the other."""
    raw = scope.get("raw_path")
    if raw is not None and "\ufffd" in str(scope.get("path", "")) and not _utf8(raw):
        return False
    query = scope.get("query_string") or b""
    return b"%" not in query or _utf8(query)


def _utf8(raw: bytes) -> bool:
    """Whether percent-encoded bytes decode as UTF-8."""
    try:
        unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def utf8_only(request: Request) -> None:
    """Refuse a path or query string that is not UTF-8 once percent-decoded (utf8_target)."""
    if not utf8_target(request.scope):
        raise errors.InvalidRequest("the request's path or query string is not UTF-8 once "
                                    "percent-decoded", field="path")


async def known_query_only(request: Request) -> None:
    """Refuse query parameters the route does not declare.

    A misspelt parameter (`afetr=` for `after=`) would otherwise be ignored and
    the request answered as if it had not been sent: the feed from the start.
    """
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known: frozenset[str] | None = getattr(route, _DECLARED, None)
    if known is None:
        names: set[str] = set()
        pending = [route.dependant]
        while pending:
            dependant = pending.pop()
            names.update(param.alias for param in dependant.query_params)
            pending.extend(dependant.dependencies)
        known = frozenset(names)
        setattr(route, _DECLARED, known)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise errors.InvalidRequest(f"unknown query parameters: {unknown}", field="query")


# Declared after Tenant in a handler's parameters: tenant_id has already
# answered 503 when the pool is not open, so the order of checks is unchanged.
Service = Annotated[ReservationService, Depends(service_dependency)]
Tenant = Annotated[int, Depends(tenant_id)]
Holds = Annotated[ReservationService | Rollout, Depends(holds_dependency)]
Authenticated = Annotated[Caller, Depends(caller)]
Keys = Annotated[InFlight, Depends(in_flight)]
Metrics = Annotated[ApiMetrics, Depends(metrics_dependency)]
PathName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]
KeyHeader = Annotated[str | None, Header(
    alias="Idempotency-Key",
    description="A structured-field string (\"order-1\") or the bare key (order-1), the "
                "same key either way; 1 to 200 characters. A repeat with the same key and "
                "body replays the first response (header Idempotent-Replayed: true).")]
MAX_KEY = 200


def parse_idempotency_key(value: str) -> str:
    """The key an Idempotency-Key header names: the content of a structured-field string
    (RFC 8941 sf-string: printable ASCII, `\\"` and `\\\\` escapes), or a bare value as
    sent. IdempotencyKeyInvalid when malformed, empty or longer than 200 characters."""
    if value.startswith('"'):
        out: list[str] = []
        i = 1
        while True:
            if i >= len(value):
                raise problems.IdempotencyKeyInvalid(
                    "Idempotency-Key: the structured-field string has no closing quote")
            ch = value[i]
            if ch == "\\":
                if i + 1 >= len(value) or value[i + 1] not in '"\\':
                    raise problems.IdempotencyKeyInvalid(
                        'Idempotency-Key: only \\" and \\\\ may be escaped in a string')
                out.append(value[i + 1])
                i += 2
                continue
            if ch == '"':
                break
            if not " " <= ch <= "~":
                raise problems.IdempotencyKeyInvalid(
                    "Idempotency-Key: a structured-field string holds printable ASCII only")
            out.append(ch)
            i += 1
        if value[i + 1:].strip():
            raise problems.IdempotencyKeyInvalid(
                "Idempotency-Key: nothing may follow the string (no parameters)")
        key = "".join(out)
    else:
        key = value
    if not key:
        raise problems.IdempotencyKeyInvalid("Idempotency-Key must not be empty")
    if len(key) > MAX_KEY:
        raise problems.IdempotencyKeyInvalid(
            f"Idempotency-Key must be at most {MAX_KEY} characters (got {len(key)})")
    return key


# Checked in the handler body, after FastAPI has validated the request: a
# missing key on an invalid body stays a 422, not a 400.

def stored_name(value: str, field: str) -> str:
    """A path name (sku, location) as stored, or InvalidRequest naming the field."""
    try:
        return storable(value)
    except ValueError as exc:
        raise errors.InvalidRequest(f"{field} {exc}", field=field) from None


def single_query_values(request: Request, *names: str) -> None:
    """422 when a query parameter that takes one value is repeated (FastAPI would
    quietly use one of them)."""
    for name in names:
        if len(request.query_params.getlist(name)) > 1:
            raise errors.InvalidRequest(f"{name} may be given at most once", field=name)


def request_key(value: str | None, required: bool) -> str | None:
    """The Idempotency-Key header, checked; 400 when required and missing, and when
    present but empty (a client that sends a key asked for a keyed request: an empty
    one is refused, never taken as no key)."""
    if value is None:
        if required:
            raise problems.IdempotencyKeyMissing(
                "this request needs an Idempotency-Key header (1 to 200 characters)")
        return None
    key = parse_idempotency_key(value)
    try:
        return check.name(storable(key), "Idempotency-Key")
    except ValueError as exc:
        raise problems.IdempotencyKeyInvalid(f"Idempotency-Key {exc}",
                                             field="Idempotency-Key") from None
