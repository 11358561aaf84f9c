"""The FastAPI application: parse -> ReservationService -> serialize.

Every error leaves through problems.STATUS (one table); every body through
problems.render (one encoding), which is what makes idempotent replays
byte-for-byte: a replay is rendered from the very outcome the first request
stored in request_ledger, in the same transaction as its effect.
"""

import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, Response
from starlette.routing import Match

from .. import errors
from .. import validation as check
from ..core.service import Clock, ReservationService
from ..db.database import Database
from ..domain import ReserveOutcome
from ..ops.metrics import OpsMetrics
from . import problems
from .models import (
    EventsOut,
    ExtendIn,
    Health,
    ReservationOut,
    ReserveIn,
    StockAdjust,
    StockOut,
    StockSet,
    WebhookCreated,
    WebhookIn,
    WebhooksOut,
    reservation_doc,
    stock_doc,
    storable,
    webhook_doc,
)
from .problems import PROBLEM_MEDIA_TYPE, Problem

log = logging.getLogger(__name__)

DEFAULT_BODY_LIMIT = 64 * 1024
REPLAYED_HEADER = "Idempotent-Replayed"
_CURSOR = re.compile(r"^(\d{1,19})-(\d{1,19})$")
KEYED_REQUIRED = {("post", "/v1/reservations"),
                  ("post", "/v1/stock/{location}/{sku}/adjustments")}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    reservations: Counter
    transitions: Counter

    @classmethod
    def new(cls, registry: CollectorRegistry | None = None) -> "Metrics":
        registry = registry or CollectorRegistry()
        return cls(
            registry,
            Counter("pgreserve_http_requests", "HTTP requests by route and status",
                    ["method", "route", "status"], registry=registry),
            Counter("pgreserve_reservation_outcomes", "Reserve requests by outcome",
                    ["outcome", "replayed"], registry=registry),
            Counter("pgreserve_reservation_transitions", "Claims, releases and extends",
                    ["operation", "result"], registry=registry),
        )


class BodyLimit:
    """Reject bodies over `limit` bytes with 413 before any parsing (chunked too)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = problems.PayloadTooLarge(f"the request body exceeds {self.limit} bytes")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await problems.problem_response(too_large)(scope, receive, send)
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
                await problems.problem_response(too_large)(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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


class CountRequests:
    """Count every response by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope.get("method", ""), path, str(status)).inc()


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


def json_response(status: int, doc: dict[str, Any], replayed: bool = False) -> Response:
    headers = {REPLAYED_HEADER: "true"} if replayed else None
    return Response(problems.render(doc), status_code=status, headers=headers,
                    media_type="application/json")


def _name(value: str, field: str) -> str:
    try:
        return storable(value)
    except ValueError as exc:
        raise errors.InvalidRequest(f"{field} {exc}", field=field) from None


def _key(value: str | None, required: bool) -> str | None:
    if value is None or value == "":
        if required:
            raise problems.IdempotencyKeyMissing(
                "this request needs an Idempotency-Key header (1 to 200 characters)")
        return None
    try:
        return check.name(storable(value), "Idempotency-Key")
    except ValueError as exc:
        raise errors.InvalidRequest(f"Idempotency-Key {exc}", field="Idempotency-Key") from None


_bearer = HTTPBearer(auto_error=False, description="An API key from `pgreserve tenant create`")


def _service(request: Request) -> ReservationService:
    svc = getattr(request.app.state, "service", None)
    if svc is None:
        raise problems.Unavailable("the database pool is not open")
    return svc  # type: ignore[no-any-return]


async def tenant_id(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> int:
    """The tenant of the request's bearer API key; 401 when missing or unknown."""
    if credentials is None:
        raise problems.Unauthorized("send an API key as 'Authorization: Bearer <key>'")
    tenant = await _service(request).tenant_for_api_key(credentials.credentials)
    if tenant is None:
        raise problems.Unauthorized("unknown API key")
    return tenant


Tenant = Annotated[int, Depends(tenant_id)]
PathName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^\x00]+$")]
KeyHeader = Annotated[str | None, Header(
    alias="Idempotency-Key",
    description="Up to 200 characters. A repeat with the same key and body replays the "
                "first response (header Idempotent-Replayed: true).")]


def create_app(dsn: str | None = None, *, database: Database | None = None,
               pool_size: int = 10, body_limit: int = DEFAULT_BODY_LIMIT,
               clock: Clock | None = None, application_name: str = "pgreserve:api",
               pool_min_size: int = 1, monitor: bool = False,
               prepare_threshold: int | None = 5) -> FastAPI:
    """The API over one database: pass a DSN (the app owns its pool) or an open Database.

    `clock` replaces the database clock (tests move time by hand). `monitor`
    runs the hold-time sampler and the bloat monitor in this process (their
    figures go to /metrics and /ops). `prepare_threshold=None` behind PgBouncer
    older than 1.21.
    """
    from ..ops import web

    ops = OpsMetrics()
    extra: dict[str, Any] = {"clock": clock} if clock is not None else {}
    extra["observer"] = ops
    if database is None and dsn is None:
        raise ValueError("create_app needs a dsn or a database")
    if database is not None and database.observer is None:
        database.observer = ops.db_event
    metrics = Metrics.new(ops.registry)
    inflight = InFlight()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if database is None:
            assert dsn is not None
            # One pool per business process: application_name pgreserve:<role>.
            owned = Database(dsn, min_size=min(pool_min_size, pool_size), max_size=pool_size,
                             application_name=application_name, role_pools=True,
                             observer=ops.db_event, prepare_threshold=prepare_threshold)
            await owned.open()
            app.state.service = ReservationService(owned, **extra)
            try:
                async with web.monitors(app, owned.conninfo, ops, enabled=monitor):
                    yield
            finally:
                await owned.close()
        else:
            async with web.monitors(app, database.conninfo, ops, enabled=monitor):
                yield


    def service() -> ReservationService:
        svc = getattr(app.state, "service", None)
        if svc is None:
            raise problems.Unavailable("the database pool is not open")
        return svc  # type: ignore[no-any-return]

    app = FastAPI(
        title="pgreserve",
        version="1",
        summary="Inventory reservations (holds, claims, releases, expiry) that never oversell.",
        lifespan=lifespan,
        dependencies=[Depends(known_query_only)],
    )
    common = (401, 422, 503)

    # -- errors --------------------------------------------------------------

    @app.exception_handler(errors.PgReserveError)
    async def on_error(request: Request, exc: errors.PgReserveError) -> Response:
        return problems.problem_response(exc, unknown_stock=problems.unknown_stock_refs(exc))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        found = []
        for e in exc.errors()[:20]:
            loc = [x if isinstance(x, int) else str(x) for x in e.get("loc", ())]
            found.append({"loc": loc, "msg": str(e.get("msg", "")),
                          "type": str(e.get("type", ""))})
        first = found[0] if found else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(x) for x in first["loc"])
        detail = f"{where}: {first['msg']}" if where else str(first["msg"])
        return problems.problem_response(errors.InvalidRequest(detail), errors=found)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette names only the first matching route's methods; name them all.
            allowed: set[str] = set()
            for route in app.routes:
                if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE:
                    allowed |= route.methods or set()
            return problems.problem_response(problems.MethodNotAllowed("method not allowed"),
                                             headers={"Allow": ", ".join(sorted(allowed))})
        if exc.status_code == 404:
            return problems.problem_response(problems.NotFound("no such endpoint"))
        if exc.status_code == 400:  # FastAPI could not parse the body
            return problems.problem_response(errors.InvalidRequest(str(exc.detail)))
        doc = {"type": "about:blank", "title": str(exc.detail), "status": exc.status_code,
               "detail": str(exc.detail), "code": "http_error"}
        return Response(problems.render(doc), status_code=exc.status_code,
                        media_type=PROBLEM_MEDIA_TYPE)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        ops.error(f"{request.method} {request.url.path}: {type(exc).__name__}")
        return problems.problem_response(problems.InternalError("internal error"))

    # -- stock ---------------------------------------------------------------

    @app.put("/v1/stock/{location}/{sku}", response_model=StockOut, tags=["stock"],
             responses=problems.responses(*common, 413),
             summary="Set the on-hand count of a SKU at a location (creates it)")
    async def put_stock(location: PathName, sku: PathName, body: StockSet,
                        tenant: Tenant) -> Response:
        view = await service().set_stock(tenant, _name(sku, "sku"),
                                         _name(location, "location"), body.on_hand,
                                         strategy=body.strategy)
        return json_response(200, stock_doc(view))

    @app.post("/v1/stock/{location}/{sku}/adjustments", response_model=StockOut, tags=["stock"],
              responses=problems.responses(400, 404, 409, 413, *common),
              summary="Receipt (delta > 0) or correction (delta < 0)")
    async def adjust_stock(location: PathName, sku: PathName, body: StockAdjust, tenant: Tenant,
                           idempotency_key: KeyHeader = None) -> Response:
        key = _key(idempotency_key, required=True)
        assert key is not None
        async with inflight.hold(tenant, key):
            view = await service().adjust_stock(tenant, key, _name(sku, "sku"),
                                                _name(location, "location"), body.delta,
                                                reason=body.reason)
        return json_response(200, stock_doc(view), view.replayed)

    @app.get("/v1/stock/{location}/{sku}", response_model=StockOut, tags=["stock"],
             responses=problems.responses(404, *common))
    async def get_stock(location: PathName, sku: PathName, tenant: Tenant) -> Response:
        view = await service().get_stock(tenant, _name(sku, "sku"), _name(location, "location"))
        return json_response(200, stock_doc(view))

    # -- reservations ----------------------------------------------------------

    @app.post("/v1/reservations", status_code=201, response_model=ReservationOut,
              tags=["reservations"], responses=problems.responses(400, 404, 409, 413, *common),
              summary="Hold every line of a cart, or none")
    async def reserve(body: ReserveIn, tenant: Tenant,
                      idempotency_key: KeyHeader = None) -> Response:
        key = _key(idempotency_key, required=True)
        assert key is not None
        async with inflight.hold(tenant, key):
            outcome = await service().reserve(
                tenant, key, [(x.sku, x.location, x.quantity) for x in body.lines],
                ttl=body.ttl_seconds)
        metrics.reservations.labels("held" if outcome.held else "rejected",
                                    str(outcome.replayed).lower()).inc()
        return _reserve_response(outcome)

    @app.get("/v1/reservations/{reservation_id}", response_model=ReservationOut,
             tags=["reservations"], responses=problems.responses(404, *common))
    async def get_reservation(reservation_id: str, tenant: Tenant) -> Response:
        found = await service().get_reservation(tenant, reservation_id)
        return json_response(200, reservation_doc(found))

    async def _transition(operation: str, tenant: int, reservation_id: str,
                          key: str | None, ttl: int | None = None) -> Response:
        svc = service()
        try:
            if key is None:
                if operation == "claim":
                    r = await svc.claim(tenant, reservation_id)
                elif operation == "release":
                    r = await svc.release(tenant, reservation_id)
                else:
                    assert ttl is not None
                    r = await svc.extend(tenant, reservation_id, ttl)
            else:
                async with inflight.hold(tenant, key):
                    if operation == "claim":
                        r = await svc.claim(tenant, reservation_id, request_key=key)
                    elif operation == "release":
                        r = await svc.release(tenant, reservation_id, request_key=key)
                    else:
                        assert ttl is not None
                        r = await svc.extend(tenant, reservation_id, ttl, request_key=key)
        except errors.PgReserveError as exc:
            metrics.transitions.labels(operation, exc.code).inc()
            raise
        metrics.transitions.labels(operation, "ok").inc()
        return json_response(200, reservation_doc(r), r.replayed)

    @app.post("/v1/reservations/{reservation_id}/claim", response_model=ReservationOut,
              tags=["reservations"], responses=problems.responses(404, 409, *common),
              summary="Payment succeeded: turn the hold into a sale (repeatable)")
    async def claim(reservation_id: str, tenant: Tenant,
                    idempotency_key: KeyHeader = None) -> Response:
        return await _transition("claim", tenant, reservation_id,
                                 _key(idempotency_key, required=False))

    @app.post("/v1/reservations/{reservation_id}/release", response_model=ReservationOut,
              tags=["reservations"], responses=problems.responses(404, 409, *common),
              summary="Payment failed: give the units back (repeatable)")
    async def release(reservation_id: str, tenant: Tenant,
                      idempotency_key: KeyHeader = None) -> Response:
        return await _transition("release", tenant, reservation_id,
                                 _key(idempotency_key, required=False))

    @app.post("/v1/reservations/{reservation_id}/extend", response_model=ReservationOut,
              tags=["reservations"], responses=problems.responses(404, 409, 413, *common),
              summary="New time to live for an active reservation, counted from now")
    async def extend(reservation_id: str, body: ExtendIn, tenant: Tenant,
                     idempotency_key: KeyHeader = None) -> Response:
        return await _transition("extend", tenant, reservation_id,
                                 _key(idempotency_key, required=False), body.ttl_seconds)

    # -- events ------------------------------------------------------------------

    @app.get("/v1/events", response_model=EventsOut, tags=["events"],
             responses=problems.responses(*common),
             summary="This tenant's events in commit order, after a cursor")
    async def events(tenant: Tenant,
                     after: Annotated[str | None, Query(
                         max_length=39, pattern=_CURSOR.pattern,
                         description="next_cursor of the previous page")] = None,
                     limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Response:
        position: tuple[int, int] | None = None
        if after:
            match = _CURSOR.match(after)
            if not match:
                raise errors.InvalidRequest("after must be a cursor returned by this endpoint",
                                            field="after")
            # Positions beyond every bigint are past every event: clamp, answer empty.
            position = (min(int(match[1]), 2**63 - 1), min(int(match[2]), 2**63 - 1))
        page = await service().events(tenant, position, limit)
        return json_response(200, {
            "events": [{"id": e.event_id, "type": e.type, "created_at": e.created_at.isoformat(),
                        "data": e.payload} for e in page.events],
            "next_cursor": f"{page.cursor[0]}-{page.cursor[1]}",
        })

    # -- webhooks ----------------------------------------------------------------

    @app.post("/v1/webhooks", status_code=201, response_model=WebhookCreated, tags=["webhooks"],
              responses=problems.responses(413, *common),
              summary="Register a URL for this tenant's events (the secret is shown only now)")
    async def add_webhook(body: WebhookIn, tenant: Tenant) -> Response:
        created = await service().add_webhook(tenant, body.url)
        return json_response(201, webhook_doc(created))

    @app.get("/v1/webhooks", response_model=WebhooksOut, tags=["webhooks"],
             responses=problems.responses(*common),
             summary="This tenant's webhook endpoints and their delivery state")
    async def list_webhooks(tenant: Tenant) -> Response:
        found = await service().webhooks(tenant)
        return json_response(200, {"webhooks": [webhook_doc(w) for w in found]})

    @app.delete("/v1/webhooks/{webhook_id}", status_code=204, tags=["webhooks"],
                response_class=Response, responses=problems.responses(404, *common),
                summary="Remove an endpoint; nothing more is sent to it")
    async def delete_webhook(webhook_id: Annotated[int, Path(ge=1)], tenant: Tenant) -> Response:
        await service().delete_webhook(tenant, webhook_id)
        return Response(status_code=204)

    # -- operations --------------------------------------------------------------

    @app.get("/healthz", response_model=Health, tags=["operations"],
             responses=problems.responses(503))
    async def healthz() -> Response:
        try:
            await service().db.fetch("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - any failure to reach the database is a 503
            raise problems.Unavailable(f"database unreachable: {type(exc).__name__}") from None
        return json_response(200, {"status": "ok"})

    @app.get("/metrics", tags=["operations"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def prometheus() -> Response:
        await web.refresh_metrics(app, service(), ops)
        return Response(ops.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ops", tags=["operations"], response_class=HTMLResponse, include_in_schema=False)
    async def ops_page(refresh: Annotated[int, Query(ge=1, le=3600)] = 5) -> Response:
        doc = await web.snapshot(app, service(), ops)
        return HTMLResponse(web.render_page(doc, refresh))

    @app.get("/ops.json", tags=["operations"], include_in_schema=False)
    async def ops_json() -> Response:
        return json_response(200, await web.snapshot(app, service(), ops))

    def _reserve_response(outcome: ReserveOutcome) -> Response:
        if outcome.held:
            assert outcome.reservation is not None
            return json_response(201, reservation_doc(outcome.reservation), outcome.replayed)
        short = [{"sku": s.sku, "location": s.location, "requested": s.requested,
                  "available": s.available} for s in outcome.short_lines]
        headers = {REPLAYED_HEADER: "true"} if outcome.replayed else None
        return problems.problem_response(
            problems.InsufficientStock(f"not enough stock for {len(short)} line(s)"),
            headers=headers, short_lines=short)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             routes=app.routes)
        problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(problem.pop("$defs", {}))
        components["Problem"] = problem
        # Idempotency-Key is declared optional so that its absence reaches the
        # handler (400 idempotency_key_missing, not a generic 422); document
        # where it is required.
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                for param in op.get("parameters", []):
                    if param["name"] == "Idempotency-Key":
                        param["schema"] = {"type": "string", "minLength": 1, "maxLength": 200,
                                           "pattern": r"^\S(.*\S)?$"}
                        param["required"] = (method, path) in KEYED_REQUIRED
        # Links: what a client (and a stateful test) can do with a reservation
        # it has just created.
        created = schema["paths"]["/v1/reservations"]["post"]["responses"]["201"]
        by_id = {"reservation_id": "$response.body#/id"}
        created["links"] = {
            name: {"operationId": schema["paths"][target][verb]["operationId"],
                   "parameters": by_id}
            for name, target, verb in (
                ("GetReservation", "/v1/reservations/{reservation_id}", "get"),
                ("ClaimReservation", "/v1/reservations/{reservation_id}/claim", "post"),
                ("ReleaseReservation", "/v1/reservations/{reservation_id}/release", "post"),
                ("ExtendReservation", "/v1/reservations/{reservation_id}/extend", "post"),
            )
        }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.metrics = metrics
    app.state.ops = ops
    app.state.service = (ReservationService(database, **extra)
                         if database is not None else None)
    app.add_middleware(CountRequests, metrics=metrics)
    app.add_middleware(BodyLimit, limit=body_limit)
    return app


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (pgreserve serve --workers N): reads the DSN from env."""
    dsn = os.environ.get("PGRESERVE_DATABASE_URL")
    if not dsn:
        raise RuntimeError("PGRESERVE_DATABASE_URL is not set")
    threshold = os.environ.get("PGRESERVE_PREPARE_THRESHOLD", "5")
    return create_app(dsn, pool_size=int(os.environ.get("PGRESERVE_POOL_SIZE", "10")),
                      monitor=os.environ.get("PGRESERVE_OPS_MONITOR", "") == "1",
                      prepare_threshold=None if threshold.lower() in ("", "none") else
                      int(threshold))
