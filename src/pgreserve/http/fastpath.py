"""The hot routes without FastAPI's per-request machinery: reserve, claim and release.

A flash sale is one request shape sent many times: `POST /v1/reservations` with a
JSON cart, and `POST /v1/reservations/{id}/claim` or `/release` without a body.
FastAPI answers it after routing, dependency solving, pydantic validation and its
exception wrappers, which cost about three times the CPU of the work itself
(docs/benchmarks.md). `FastPath` sits inside the app's own middleware (body limit,
metrics and request log, admission, pool opening) just in front of FastAPI's
router. It serves a request itself only when the request is one it knows exactly:

- POST, no query string, one of the three paths;
- at most one Authorization, Idempotency-Key and Content-Type header each;
- reserve: `Content-Type: application/json` and a body of exactly the shape
  `{"lines": [{"sku", "location", "quantity"}, ...], "ttl_seconds"?}` whose values
  pydantic would accept as they are (ASCII names, integers in range);
- claim and release: an empty body.

It then calls what the routes call (the tenant check of dependencies.authenticate,
request_key, the in-flight keys, the service or rollout layer, the same metrics,
reserve_response and transition), and renders the typed errors they raise with the
route's exception handler (problems.error_response): the same status, headers and
body bytes. Every other request (another field, another content type, a float, a
non-ASCII name, a query string, another route) goes to the FastAPI app untouched,
with its body, which FastAPI then validates and answers as it always has.

`create_app(fast_path=False)` (or PGRESERVE_HTTP_FAST_PATH=0) leaves it out.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request

from .. import errors
from ..domain import MAX_LINES, MAX_NAME, MAX_QUANTITY
from . import problems
from .dependencies import (
    Caller,
    authenticate,
    authenticate_in_batch,
    bearer_key,
    refused_in_batch,
    refused_now,
    request_key,
    utf8_target,
)
from .middleware import ASGIApp, Receive, Scope, Send, replaying
from .models import MAX_TTL_SECONDS
from .routes import reservations

PREFIX = "/v1/reservations"
_CLAIM, _RELEASE = "/claim", "/release"
_RESERVE_KEYS = frozenset({"lines"})
_RESERVE_TTL_KEYS = frozenset({"lines", "ttl_seconds"})
_LINE_KEYS = frozenset({"sku", "location", "quantity"})
_AUTHORIZATION = b"authorization"
_IDEMPOTENCY_KEY = b"idempotency-key"
_CONTENT_TYPE = b"content-type"
_JSON = b"application/json"
DEFAULT_TTL_SECONDS = 900  # ReserveIn.ttl_seconds' default


def _route(endpoint: Any) -> APIRoute:
    for route in reservations.router.routes:
        if isinstance(route, APIRoute) and route.endpoint is endpoint:
            return route
    raise RuntimeError(f"no route serves {endpoint!r}")


def _name(value: Any) -> bool:
    """A name pydantic's Name accepts as it is (a non-ASCII one is left to it)."""
    return (type(value) is str and 0 < len(value) <= MAX_NAME and value.isascii()
            and "\x00" not in value)


def _int(value: Any, most: int) -> bool:
    return type(value) is int and 1 <= value <= most


def cart_of(body: bytes) -> tuple[list[tuple[str, str, int]], int] | None:
    """The (lines, ttl_seconds) of a reserve body of exactly the known shape, else None."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # FastAPI answers these its own way
        return None
    if type(doc) is not dict:
        return None
    keys = doc.keys()
    if keys == _RESERVE_KEYS:
        ttl: Any = DEFAULT_TTL_SECONDS
    elif keys == _RESERVE_TTL_KEYS:
        ttl = doc["ttl_seconds"]
        if not _int(ttl, MAX_TTL_SECONDS):
            return None
    else:
        return None
    lines = doc["lines"]
    if type(lines) is not list or not 1 <= len(lines) <= MAX_LINES:
        return None
    cart: list[tuple[str, str, int]] = []
    for line in lines:
        if type(line) is not dict or line.keys() != _LINE_KEYS:
            return None
        sku, location, quantity = line["sku"], line["location"], line["quantity"]
        if not (_name(sku) and _name(location) and _int(quantity, MAX_QUANTITY)):
            return None
        cart.append((sku, location, quantity))
    return cart, ttl


def route_path(scope: Scope) -> str:
    """The request's path inside this app, as Starlette's router matches it."""
    path = str(scope["path"])
    root = str(scope.get("root_path") or "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


class FastPath:
    """Serve the well-formed hot requests; hand every other one to `app` (see above)."""

    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.api = api
        self.reserve_route = _route(reservations.reserve)
        self.claim_route = _route(reservations.claim)
        self.release_route = _route(reservations.release)
        # (held, replayed) -> its pgreserve_reservation_outcomes child (four at most)
        self._outcomes: dict[tuple[bool, bool], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] != "POST" or scope.get("query_string")
                or self.api.state.service is None):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if "\ufffd" in path and not utf8_target(scope):  # the app answers it (422)
            await self.app(scope, receive, send)
            return
        operation: str | None = None
        reservation_id = ""
        if path != PREFIX:
            if not path.startswith(PREFIX + "/"):
                await self.app(scope, receive, send)
                return
            if path.endswith(_CLAIM):
                operation, reservation_id = "claim", path[len(PREFIX) + 1:-len(_CLAIM)]
            elif path.endswith(_RELEASE):
                operation, reservation_id = "release", path[len(PREFIX) + 1:-len(_RELEASE)]
            if operation is None or not reservation_id or "/" in reservation_id:
                await self.app(scope, receive, send)
                return
        authorization: bytes | None = None
        key: bytes | None = None
        content_type: bytes | None = None
        for name, value in scope["headers"]:
            if name == _AUTHORIZATION:
                if authorization is not None:
                    await self.app(scope, receive, send)
                    return
                authorization = value
            elif name == _IDEMPOTENCY_KEY:
                if key is not None:
                    await self.app(scope, receive, send)
                    return
                key = value
            elif name == _CONTENT_TYPE:
                if content_type is not None:
                    await self.app(scope, receive, send)
                    return
                content_type = value
        body, receive = await _read_body(receive)
        if body is None:  # the client went away: FastAPI sees that as it would have
            await self.app(scope, receive, send)
            return
        if operation is None:
            cart = cart_of(body) if content_type == _JSON else None
            if cart is None:
                await self.app(scope, receive, send)
                return
            scope["route"] = self.reserve_route
        elif body:
            await self.app(scope, receive, send)
            return
        else:
            cart = None
            scope["route"] = self.claim_route if operation == "claim" else self.release_route
        state = self.api.state
        state.fast_path_served += 1
        bearer = None if authorization is None else authorization.decode("latin-1")
        digest: bytes | None = None
        try:
            if state.rollout is None:
                # a key accepted before is checked in the operation's own batch
                tenant, digest = await authenticate_in_batch(state, scope, bearer)
            else:
                tenant = await authenticate(state, scope, bearer)
            svc = state.service
            caller = Caller(tenant, svc, state.inflight, state.metrics, state.rollout or svc)
            header = None if key is None else key.decode("latin-1")
            if cart is None:
                response = await self.transition(caller, operation or "", reservation_id,
                                                 header, digest)
            else:
                response = await self.reserve(caller, header, cart, scope, digest)
        except errors.ApiKeyRefused:
            assert digest is not None
            response = problems.error_response(refused_in_batch(state, scope, digest))
        except errors.PgReserveError as exc:
            if (digest is not None and not isinstance(exc, errors.OutcomeUnknown)
                    and await refused_now(state, bearer_key(bearer))):
                # the request failed before its batch checked the key (its request key,
                # its cart, its reservation id, a request in flight under its key): as
                # on FastAPI's route, which checks the key first, the key's 401 wins
                response = problems.error_response(refused_in_batch(state, scope, digest))
            else:
                response = problems.error_response(exc)
        await response(scope, receive, send)

    async def reserve(self, caller: Caller, header: str | None,
                      cart: tuple[list[tuple[str, str, int]], int], scope: Scope,
                      api_key_hash: bytes | None = None) -> Any:
        """What routes.reservations.reserve does once FastAPI has validated the body;
        `api_key_hash`: the key still to be checked where the reserve runs."""
        key = request_key(header, required=True)
        assert key is not None
        lines, ttl = cart
        async with caller.keys.hold(caller.tenant, key):
            if api_key_hash is None:
                outcome = await caller.holds.reserve(caller.tenant, key, lines, ttl=ttl)
            else:
                outcome = await caller.service.reserve(caller.tenant, key, lines, ttl=ttl,
                                                       api_key_hash=api_key_hash)
        counted = (outcome.held, outcome.replayed)
        child = self._outcomes.get(counted)
        if child is None:
            child = self._outcomes[counted] = caller.metrics.http_reserve_outcomes.labels(
                "held" if outcome.held else "rejected", str(outcome.replayed).lower())
        child.inc()
        return reservations.reserve_response(outcome, Request(scope))

    async def transition(self, caller: Caller, operation: str, reservation_id: str,
                         header: str | None, api_key_hash: bytes | None = None) -> Any:
        """What routes.reservations.claim and release do; `api_key_hash`: the key still
        to be checked where the operation runs."""
        holds = caller.holds
        run = holds.claim if operation == "claim" else holds.release
        if api_key_hash is not None:  # (no legacy store then: the service checks the key)
            svc = caller.service
            run = functools.partial(svc.claim if operation == "claim" else svc.release,
                                    api_key_hash=api_key_hash)
        return await reservations.transition(
            operation, lambda key: run(caller.tenant, reservation_id, request_key=key),
            caller, header)


async def _read_body(receive: Receive) -> tuple[bytes | None, Receive]:
    """The request's body (None when the client went away first), and a receive that
    hands the same on again (to FastAPI)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None, replaying(message, receive)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return body, replaying({"type": "http.request", "body": body, "more_body": False}, receive)
