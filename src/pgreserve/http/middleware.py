"""ASGI middleware of the API: the body limit, and the request metrics and log line."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.routing import Mount, Route

from .. import errors
from . import problems
from .metrics import ApiMetrics
from .requestlog import KEY_CHARS, RequestLog, outcome_of
from .responses import REPLAYED_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def replaying(first: Message, receive: Receive) -> Receive:
    """A receive that gives `first` (a message already read), then what `receive` gives."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay


class BodyLimit:
    """Reject bodies over `limit` bytes with 413 before any parsing (chunked too)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await self.refuse(scope, receive, send)
                return
        # Buffer the body (at most `limit` bytes), then hand it on.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self.refuse(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        await self.app(scope, replaying({"type": "http.request", "body": body,
                                         "more_body": False}, receive), send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        too_large = problems.PayloadTooLarge(f"the request body exceeds {self.limit} bytes")
        await problems.problem_response(too_large)(scope, receive, send)


# Set on the ASGI scope by the tenant_id dependency and by problem responses,
# read back here once the response is out.
TENANT_KEY = "pgreserve.tenant"
ERROR_KEY = problems.ERROR_SCOPE_KEY
_REPLAYED = REPLAYED_HEADER.lower().encode()
_KEY_HEADER = b"idempotency-key"


class ObserveRequests:
    """Count and time every response by method, route template and status; log it.

    Only the route template (or "unmatched") is a label, so the series stay
    bounded whatever paths clients send. The log line (when `log` is given) is
    an entry on RequestLog's queue: formatting and writing happen off the loop.
    """

    def __init__(self, app: ASGIApp, metrics: ApiMetrics, log: RequestLog | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.log = log
        # (method, route, status) -> the counter's and the histogram's child: labels()
        # costs more than the count itself. Bounded: past _SERIES, labels() each time.
        self._series: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        replayed = False
        error: str | None = None

        async def capture(message: Message) -> None:
            nonlocal status, replayed
            if message["type"] == "http.response.start":
                status = int(message["status"])
                replayed = any(name == _REPLAYED for name, _ in message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, capture)
        except Exception as exc:
            error = type(exc).__name__
            raise
        finally:
            seconds = time.perf_counter() - started
            route = scope.get("route")
            path = getattr(route, "path", None) or _template(scope) or "unmatched"
            method = scope.get("method", "")
            code = str(status)
            series = self._series.get((method, path, code))
            if series is None:
                series = (self.metrics.http_requests.labels(method, path, code),
                          self.metrics.http_duration.labels(method, path, code))
                if len(self._series) < _SERIES:
                    self._series[method, path, code] = series
            series[0].inc()
            series[1].observe(seconds)
            if self.log is not None:
                key = None
                for name, value in scope.get("headers", ()):
                    if name == _KEY_HEADER:
                        key = _logged_key(value.decode("latin-1"))
                        break
                self.log.emit((time.time(), method, path, status, outcome_of(status, replayed),
                               scope.get(TENANT_KEY), key, seconds,
                               error or scope.get(ERROR_KEY), _client(scope)))


_SERIES = 1000


def _template(scope: Scope) -> str | None:
    """The path template of a request served by a plain Starlette route or mount (the
    documentation pages, /openapi.json, the pages' assets): FastAPI's router names only
    its own API routes in scope["route"]. None when nothing matched."""
    endpoint = scope.get("endpoint")
    if endpoint is None:
        return None
    for route in getattr(scope.get("app"), "routes", ()):
        if isinstance(route, Route) and route.endpoint is endpoint:
            return route.path
        if isinstance(route, Mount) and route.app is endpoint:
            return route.path + "/{path:path}"
    return None


def _client(scope: Scope) -> str | None:
    """The client's address (behind a trusted proxy: the one it forwarded), None on a
    Unix socket."""
    client = scope.get("client")
    return str(client[0]) if client else None


def _logged_key(raw: str) -> str:
    """The key the service used (a quoted sf-string's content), or the raw value when
    the header was refused as malformed; at most KEY_CHARS characters."""
    from .dependencies import parse_idempotency_key  # dependencies imports this module

    try:
        return parse_idempotency_key(raw)[:KEY_CHARS]
    except errors.PgReserveError:
        return raw[:KEY_CHARS]
