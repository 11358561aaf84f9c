"""The FastAPI application: parse -> ReservationService -> serialize.

Every error leaves through problems.STATUS (one table, exception_handlers.py);
every body through problems.render (one encoding), which is what makes
idempotent replays byte-for-byte: a replay is rendered from the very outcome
the first request stored in request_ledger, in the same transaction as its
effect. The routes live in routes/, one router per resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from fastapi import Depends, FastAPI
from psycopg_pool import PoolTimeout

from .. import errors
from ..core.service import Clock, ReservationService
from ..db import schema as schemas
from ..db.database import Database, current_deadline, deadline_at
from ..ops import web
from ..ops.pgbouncer import PgBouncerMonitor
from ..rollout import Rollout
from . import docs, problems
from .admission import DEFAULT_REQUEST_DEADLINE_S, Admission, TenantLimit, check_deadline
from .dependencies import ApiKeyCache, InFlight, known_query_only, utf8_only
from .exception_handlers import EXCEPTION_HANDLERS
from .fastpath import FastPath
from .gc_tuning import threshold_from_env, tune_gc
from .metrics import ApiMetrics
from .middleware import ASGIApp, BodyLimit, ObserveRequests, Receive, Scope, Send
from .openapi import openapi_schema, operation_id
from .requestlog import RequestLog
from .requestlog import from_env as request_log_from_env
from .responses import REPLAYED_HEADER
from .routes import ROUTERS

# An accepted API key is trusted this long before the database is asked again:
# 0, every request asks, so a revoked key is refused from the next request on.
DEFAULT_API_KEY_CACHE_S = 0.0

__all__ = ["DEFAULT_BODY_LIMIT", "REPLAYED_HEADER", "app_from_env", "create_app", "lifespan"]

log = logging.getLogger(__name__)

DEFAULT_BODY_LIMIT = 64 * 1024


@dataclass(frozen=True)
class OwnedPool:
    """The pool create_app(dsn) opens at startup and closes at shutdown."""

    dsn: str
    size: int
    min_size: int
    application_name: str
    prepare_threshold: int | None
    schema: str | None = None

    def database(self, metrics: ApiMetrics) -> Database:
        # One pool per business process: application_name pgreserve:<role>.
        return Database(self.dsn, min_size=min(self.min_size, self.size), max_size=self.size,
                        application_name=self.application_name, role_pools=True,
                        observer=metrics.db_event, prepare_threshold=self.prepare_threshold,
                        schema=self.schema)


# How often an API process copies its client pools' statistics into its
# metrics (for the ops listener, which may be another process).
POOL_STATS_INTERVAL_S = 5.0


async def _copy_pool_stats(app: FastAPI, stop: asyncio.Event) -> None:
    while not stop.is_set():
        svc = app.state.service
        if svc is not None:
            app.state.metrics.pool_stats(svc.db.pool_stats())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POOL_STATS_INTERVAL_S)


@asynccontextmanager
async def _background(app: FastAPI, conninfo: str) -> AsyncIterator[None]:
    state = app.state
    stop = asyncio.Event()
    copier = asyncio.create_task(_copy_pool_stats(app, stop))
    try:
        async with web.monitors(app, conninfo, state.metrics, enabled=state.monitor,
                                schema=state.service.db.schema):
            yield
    finally:
        stop.set()
        await copier
        if state.request_log is not None:
            state.request_log.flush()


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Run a pgreserve app: open its own pool (when it has one; a database this version
    cannot serve is refused: DatabaseNotMigrated, DatabaseTooNew), run the monitors (when
    asked), and close the pool at the end.

    Served alone, this is the app's lifespan. Mounted inside another ASGI app, whose
    server runs only the host's lifespan, the host runs it: `FastAPI(lifespan=
    app.router.lifespan_context)`, or `async with lifespan(app):` inside the host's own
    (docs/api.md, "Inside your own FastAPI app")."""
    state = app.state
    if state.lifecycle != NEW:
        raise RuntimeError(f"this pgreserve app's lifespan has already run ({state.lifecycle}):"
                           " an app runs once; make another with create_app")
    state.lifecycle = RUNNING
    owned: OwnedPool | None = state.owned_pool
    pgbouncer: PgBouncerMonitor | None = state.pgbouncer
    try:
        if owned is None:  # the caller's Database: it opens and closes it
            if state.rollout is not None:
                state.rollout.start()  # the legacy holds' expiry sweep
            async with _background(app, state.service.db.conninfo):
                yield
            return
        database = owned.database(state.metrics)
        await database.open()
        state.service = ReservationService(database, **state.service_options)
        try:
            async with _background(app, database.conninfo), legacy_store(app):
                yield
        finally:
            await database.close()
    finally:
        state.lifecycle = STOPPED
        if pgbouncer is not None:
            await pgbouncer.close()


# app.state.lifecycle: the lifespan has not run yet, runs, has run.
NEW, RUNNING, STOPPED = "new", "running", "stopped"


def _own_lifespan(app: FastAPI) -> Callable[[object], AbstractAsyncContextManager[None]]:
    """The app's lifespan bound to the app itself, whatever app the server passes: a
    host may then hand it on as its own (`FastAPI(lifespan=app.router.lifespan_context)`)."""
    def run(_served: object) -> AbstractAsyncContextManager[None]:
        return lifespan(app)
    return run


# Paths answered without the database: a mounted app whose pool is not open yet serves
# its documentation without opening it.
_NO_DATABASE_PATHS = ("/docs", "/redoc", "/openapi.json")


class OpenOnFirstUse:
    """A fallback for an app mounted where its lifespan does not run: the first request
    that needs the database opens the app's own pool (once; a failed open is tried again
    by the next request), with a warning in the log. The pool is then never closed before
    the process exits and the monitors do not run: run the lifespan from the host's."""

    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.api = api
        self.warned = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.api.state
        if (state.service is None and scope["type"] == "http"
                and state.lifecycle == NEW and state.owned_pool is not None
                and not _route_path(scope).startswith(_NO_DATABASE_PATHS)):
            try:
                await self.open(scope)
            except errors.PgReserveError as exc:
                await problems.problem_response(exc)(scope, receive, send)
                return
            except (psycopg.Error, PoolTimeout, OSError) as exc:
                log.error("pgreserve could not open its database pool: %s", exc)
                await problems.problem_response(problems.Unavailable(
                    "the database pool could not be opened; see the server's log"))(
                        scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def open(self, scope: Scope) -> None:
        """Wait for the one opening of the pool (the first request that needs it starts
        it; one that failed is started again by the next), within this request's
        deadline: past it the request is 503 unavailable, and the opening goes on for
        the requests after it. (Waiting for it whole, each request queued behind the
        last for up to the pool's 30 s open timeout.)"""
        state = self.api.state
        task: asyncio.Task[None] | None = state.opening
        if task is None or (task.done() and state.service is None):
            with deadline_at(None):  # (not this request's: the opening outlives it, and
                # what it starts, the rollout's sweeper, runs for the process's life)
                task = state.opening = asyncio.create_task(self._open(scope))
            # (its failure is read by the requests waiting, or here if none is left)
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        end = current_deadline()
        try:
            await asyncio.wait_for(asyncio.shield(task),
                                   None if end is None else max(0.0, end - time.monotonic()))
        except TimeoutError:
            raise errors.DatabaseUnavailable(
                "the database pool is still opening (no connection was made within the "
                "request's deadline); retry later") from None

    async def _open(self, scope: Scope) -> None:
        state = self.api.state
        if state.service is not None or state.lifecycle != NEW:
            return
        if not self.warned:
            self.warned = True
            log.warning(
                "pgreserve app at %r: its lifespan did not run (mounted inside another "
                "app?), so its database pool opens on this first request, and is not "
                "closed at shutdown. Run it from the host's lifespan: FastAPI(lifespan="
                "app.router.lifespan_context) or `async with pgreserve.http.lifespan(app)`"
                " (docs/api.md, 'Inside your own FastAPI app').",
                scope.get("root_path") or "/")
        owned: OwnedPool = state.owned_pool
        database = owned.database(state.metrics)
        await database.open()
        service = ReservationService(database, **state.service_options)
        url: str | None = state.legacy_redis_url
        if url is not None:
            rollout = Rollout.from_url(service, url, registry=state.metrics.registry)
            rollout.start()
            state.rollout = rollout
        state.service = service


def _route_path(scope: Scope) -> str:
    """The request's path inside this app (without the mount point)."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    return path[len(root):] if root and path.startswith(root) else path


@asynccontextmanager
async def legacy_store(app: FastAPI) -> AsyncIterator[None]:
    """With a legacy Redis store configured, the rollout layer (and its expiry sweep)
    serves reserve, claim and release by each tenant's mode."""
    url: str | None = app.state.legacy_redis_url
    if url is None:
        yield
        return
    rollout = Rollout.from_url(app.state.service, url, registry=app.state.metrics.registry)
    rollout.start()
    app.state.rollout = rollout
    try:
        yield
    finally:
        app.state.rollout = None
        await rollout.aclose()


def create_app(dsn: str | None = None, *, database: Database | None = None,
               pool_size: int = 10, body_limit: int = DEFAULT_BODY_LIMIT,
               clock: Clock | None = None, application_name: str = "pgreserve:api",
               pool_min_size: int = 1, monitor: bool = False,
               prepare_threshold: int | None = 5,
               api_key_cache_s: float = DEFAULT_API_KEY_CACHE_S,
               request_deadline_s: float = DEFAULT_REQUEST_DEADLINE_S,
               tenant_max_in_flight: int = 0,
               pgbouncer_admin_url: str | None = None,
               request_log: RequestLog | None = None,
               allow_private_webhooks: bool | None = None,
               legacy_redis_url: str | None = None, rollout: Rollout | None = None,
               schema: str | None = None, fast_path: bool | None = None) -> FastAPI:
    """The API over one database: pass a DSN (the app owns its pool) or an open Database.

    `clock` replaces the database clock (tests move time by hand). `monitor`
    runs the hold-time sampler and the bloat monitor in this process (their
    figures go to /metrics and /ops). `prepare_threshold=None` behind PgBouncer
    older than 1.21. `api_key_cache_s`: how long an accepted API key is
    trusted without asking the database again (a revoked key is refused within
    that time; 0, the default: ask on every request, so a revoked key is refused
    at once). `request_deadline_s`: every request's
    deadline (the connection wait, statement_timeout and retries fit inside it;
    past it: 503 busy). `tenant_max_in_flight`: at most this many requests of one
    tenant at once in this process (429 beyond; 0: no limit).
    `pgbouncer_admin_url`: PgBouncer's admin console, whose pool figures the ops
    listener's /metrics then shows (ops/pgbouncer.py). `request_log`: where one
    line per request goes (none when None). The operations endpoints (/metrics,
    /ops) are not part of this app: see ops_app.create_ops_app.
    `allow_private_webhooks`: accept webhook URLs on loopback and private
    addresses (default: PGRESERVE_WEBHOOK_ALLOW_PRIVATE).
    `legacy_redis_url` (an owned pool or an open Database) or `rollout`: reserve,
    claim and release go through the rollout layer beside the legacy Redis store
    (rollout/). `schema`: where pgreserve's tables are, for the pool the app owns
    (default PGRESERVE_SCHEMA, else pgreserve; an open Database brings its own).
    `fast_path`: serve the well-formed reserve, claim and release requests without
    FastAPI's per-request machinery, with the same answers (fastpath.py; default
    PGRESERVE_HTTP_FAST_PATH, else on).
    """
    check_deadline(request_deadline_s)
    limit = TenantLimit(tenant_max_in_flight)
    if database is None and dsn is None:
        raise ValueError("create_app needs a dsn or a database")
    metrics = ApiMetrics()
    options: dict[str, Any] = {"observer": metrics}
    if clock is not None:
        options["clock"] = clock
    if allow_private_webhooks is not None:
        options["allow_private_webhooks"] = allow_private_webhooks
    if database is not None and database.observer is None:
        database.observer = metrics.db_event

    app = FastAPI(
        title="pgreserve",
        version="1",
        summary="Inventory reservations (holds, claims, releases, expiry) that never oversell.",
        dependencies=[Depends(utf8_only), Depends(known_query_only)],
        exception_handlers=EXCEPTION_HANDLERS,
        generate_unique_id_function=operation_id,
        docs_url=None, redoc_url=None,  # docs.py serves them from the package, offline
    )
    app.state.opening = None  # OpenOnFirstUse's opening of the pool, once started
    app.router.lifespan_context = _own_lifespan(app)
    docs.add_routes(app)
    for router in ROUTERS:
        app.include_router(router)
    app.openapi = functools.partial(openapi_schema, app)  # type: ignore[method-assign]  # FastAPI's documented way to override the schema
    state = app.state
    state.metrics = metrics
    state.inflight = InFlight()
    state.api_keys = ApiKeyCache(api_key_cache_s)
    state.monitor = monitor
    state.request_log = request_log
    state.service_options = options
    state.legacy_redis_url = legacy_redis_url
    state.rollout = rollout
    state.tenant_limit = limit
    state.lifecycle = NEW
    state.fast_path_served = 0  # requests the fast path answered itself (fastpath.py)
    state.pgbouncer = (PgBouncerMonitor(pgbouncer_admin_url, metrics.registry)
                       if pgbouncer_admin_url else None)
    if database is not None:
        state.owned_pool = None
        state.service = ReservationService(database, **options)
        if rollout is None and legacy_redis_url is not None:
            state.rollout = Rollout.from_url(state.service, legacy_redis_url,
                                             registry=metrics.registry)
    else:
        assert dsn is not None
        state.owned_pool = OwnedPool(dsn, pool_size, pool_min_size, application_name,
                                     prepare_threshold, schemas.resolve(schema))
        state.service = None
    if fast_path_enabled(fast_path):
        app.add_middleware(FastPath, api=app)  # innermost: every middleware below runs
    app.add_middleware(OpenOnFirstUse, api=app)
    app.add_middleware(Admission, deadline_s=request_deadline_s, limit=limit)
    app.add_middleware(ObserveRequests, metrics=metrics, log=request_log)
    app.add_middleware(BodyLimit, limit=body_limit)
    return app


FAST_PATH_ENV = "PGRESERVE_HTTP_FAST_PATH"


def fast_path_enabled(value: bool | None) -> bool:
    """create_app's `fast_path`, or PGRESERVE_HTTP_FAST_PATH (on unless 0/off/false/no)."""
    if value is not None:
        return value
    return os.environ.get(FAST_PATH_ENV, "1").strip().lower() not in ("0", "off", "false",
                                                                     "no")


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (pgreserve serve --workers N): reads the DSN from env.

    No monitors here: the parent process, which serves the ops listener, runs them once.
    """
    dsn = os.environ.get("PGRESERVE_DATABASE_URL")
    if not dsn:
        raise RuntimeError("PGRESERVE_DATABASE_URL is not set")
    threshold_from_env()  # a malformed value: before any work
    threshold = os.environ.get("PGRESERVE_PREPARE_THRESHOLD", "5")
    app = create_app(dsn, pool_size=int(os.environ.get("PGRESERVE_POOL_SIZE", "10")),
                     prepare_threshold=None if threshold.lower() in ("", "none") else
                     int(threshold),
                     api_key_cache_s=float(os.environ.get("PGRESERVE_API_KEY_CACHE_SECONDS",
                                                          DEFAULT_API_KEY_CACHE_S)),
                     request_log=request_log_from_env(),
                     legacy_redis_url=os.environ.get("PGRESERVE_LEGACY_REDIS_URL") or None,
                     **admission_from_env())
    tune_gc()  # a process of our own: its collector is ours to set
    return app


def admission_from_env() -> dict[str, Any]:
    """create_app's admission options from PGRESERVE_REQUEST_DEADLINE_SECONDS,
    PGRESERVE_TENANT_MAX_IN_FLIGHT and PGRESERVE_PGBOUNCER_ADMIN_URL."""
    env = os.environ
    return {"request_deadline_s": float(env.get("PGRESERVE_REQUEST_DEADLINE_SECONDS",
                                                DEFAULT_REQUEST_DEADLINE_S)),
            "tenant_max_in_flight": int(env.get("PGRESERVE_TENANT_MAX_IN_FLIGHT", "0")),
            "pgbouncer_admin_url": env.get("PGRESERVE_PGBOUNCER_ADMIN_URL") or None}
