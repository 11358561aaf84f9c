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
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI

from ..core.service import Clock, ReservationService
from ..db import schema as schemas
from ..db.database import Database
from ..ops import web
from ..ops.pgbouncer import PgBouncerMonitor
from ..rollout import Rollout
from .admission import DEFAULT_REQUEST_DEADLINE_S, Admission, TenantLimit, check_deadline
from .dependencies import ApiKeyCache, InFlight, known_query_only
from .exception_handlers import EXCEPTION_HANDLERS
from .metrics import ApiMetrics
from .middleware import BodyLimit, ObserveRequests
from .openapi import openapi_schema, operation_id
from .requestlog import RequestLog
from .requestlog import from_env as request_log_from_env
from .responses import REPLAYED_HEADER
from .routes import ROUTERS

# An accepted API key is trusted this long before the database is asked again:
# 0, every request asks, so a revoked key is refused from the next request on.
DEFAULT_API_KEY_CACHE_S = 0.0

__all__ = ["DEFAULT_BODY_LIMIT", "REPLAYED_HEADER", "app_from_env", "create_app"]

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
    """Open the app's own pool (when it has one) and run the monitors (when asked)."""
    state = app.state
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
        if pgbouncer is not None:
            await pgbouncer.close()


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
               schema: str | None = None) -> FastAPI:
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
        lifespan=lifespan,
        dependencies=[Depends(known_query_only)],
        exception_handlers=EXCEPTION_HANDLERS,
        generate_unique_id_function=operation_id,
    )
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
    app.add_middleware(Admission, deadline_s=request_deadline_s, limit=limit)
    app.add_middleware(ObserveRequests, metrics=metrics, log=request_log)
    app.add_middleware(BodyLimit, limit=body_limit)
    return app


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory` (pgreserve serve --workers N): reads the DSN from env.

    No monitors here: the parent process, which serves the ops listener, runs them once.
    """
    dsn = os.environ.get("PGRESERVE_DATABASE_URL")
    if not dsn:
        raise RuntimeError("PGRESERVE_DATABASE_URL is not set")
    threshold = os.environ.get("PGRESERVE_PREPARE_THRESHOLD", "5")
    return create_app(dsn, pool_size=int(os.environ.get("PGRESERVE_POOL_SIZE", "10")),
                      prepare_threshold=None if threshold.lower() in ("", "none") else
                      int(threshold),
                      api_key_cache_s=float(os.environ.get("PGRESERVE_API_KEY_CACHE_SECONDS",
                                                           DEFAULT_API_KEY_CACHE_S)),
                      request_log=request_log_from_env(),
                      legacy_redis_url=os.environ.get("PGRESERVE_LEGACY_REDIS_URL") or None,
                      **admission_from_env())


def admission_from_env() -> dict[str, Any]:
    """create_app's admission options from PGRESERVE_REQUEST_DEADLINE_SECONDS,
    PGRESERVE_TENANT_MAX_IN_FLIGHT and PGRESERVE_PGBOUNCER_ADMIN_URL."""
    env = os.environ
    return {"request_deadline_s": float(env.get("PGRESERVE_REQUEST_DEADLINE_SECONDS",
                                                DEFAULT_REQUEST_DEADLINE_S)),
            "tenant_max_in_flight": int(env.get("PGRESERVE_TENANT_MAX_IN_FLIGHT", "0")),
            "pgbouncer_admin_url": env.get("PGRESERVE_PGBOUNCER_ADMIN_URL") or None}
