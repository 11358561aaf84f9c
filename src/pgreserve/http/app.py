"""The FastAPI application: parse -> ReservationService -> serialize.

Every error leaves through problems.STATUS (one table, exception_handlers.py);
every body through problems.render (one encoding), which is what makes
idempotent replays byte-for-byte: a replay is rendered from the very outcome
the first request stored in request_ledger, in the same transaction as its
effect. The routes live in routes/, one router per resource.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI

from ..core.service import Clock, ReservationService
from ..db.database import Database
from ..ops import web
from ..ops.pgbouncer import PgBouncerMonitor
from .admission import DEFAULT_REQUEST_DEADLINE_S, Admission, TenantLimit, check_deadline
from .dependencies import ApiKeyCache, InFlight, known_query_only
from .exception_handlers import EXCEPTION_HANDLERS
from .metrics import ApiMetrics
from .middleware import BodyLimit, CountRequests
from .openapi import openapi_schema, operation_id
from .responses import REPLAYED_HEADER
from .routes import ROUTERS

# An accepted API key is trusted this long before the database is asked again.
DEFAULT_API_KEY_CACHE_S = 2.0

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

    def database(self, metrics: ApiMetrics) -> Database:
        # One pool per business process: application_name pgreserve:<role>.
        return Database(self.dsn, min_size=min(self.min_size, self.size), max_size=self.size,
                        application_name=self.application_name, role_pools=True,
                        observer=metrics.db_event, prepare_threshold=self.prepare_threshold)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the app's own pool (when it has one) and run the monitors (when asked)."""
    state = app.state
    owned: OwnedPool | None = state.owned_pool
    pgbouncer: PgBouncerMonitor | None = state.pgbouncer
    try:
        if owned is None:  # the caller's Database: it opens and closes it
            async with web.monitors(app, state.service.db.conninfo, state.metrics,
                                    enabled=state.monitor):
                yield
            return
        database = owned.database(state.metrics)
        await database.open()
        state.service = ReservationService(database, **state.service_options)
        try:
            async with web.monitors(app, database.conninfo, state.metrics,
                                    enabled=state.monitor):
                yield
        finally:
            await database.close()
    finally:
        if pgbouncer is not None:
            await pgbouncer.close()


def create_app(dsn: str | None = None, *, database: Database | None = None,
               pool_size: int = 10, body_limit: int = DEFAULT_BODY_LIMIT,
               clock: Clock | None = None, application_name: str = "pgreserve:api",
               pool_min_size: int = 1, monitor: bool = False,
               prepare_threshold: int | None = 5,
               api_key_cache_s: float = DEFAULT_API_KEY_CACHE_S,
               request_deadline_s: float = DEFAULT_REQUEST_DEADLINE_S,
               tenant_max_in_flight: int = 0,
               pgbouncer_admin_url: str | None = None) -> FastAPI:
    """The API over one database: pass a DSN (the app owns its pool) or an open Database.

    `clock` replaces the database clock (tests move time by hand). `monitor`
    runs the hold-time sampler and the bloat monitor in this process (their
    figures go to /metrics and /ops). `prepare_threshold=None` behind PgBouncer
    older than 1.21. `api_key_cache_s`: how long an accepted API key is
    trusted without asking the database again (a revoked key is refused within
    that time; 0: ask every request). `request_deadline_s`: every request's
    deadline (the connection wait, statement_timeout and retries fit inside it;
    past it: 503 busy). `tenant_max_in_flight`: at most this many requests of one
    tenant at once in this process (429 beyond; 0: no limit).
    `pgbouncer_admin_url`: PgBouncer's admin console, whose pool figures /metrics
    then shows (ops/pgbouncer.py).
    """
    check_deadline(request_deadline_s)
    limit = TenantLimit(tenant_max_in_flight)
    if database is None and dsn is None:
        raise ValueError("create_app needs a dsn or a database")
    metrics = ApiMetrics()
    options: dict[str, Any] = {"observer": metrics}
    if clock is not None:
        options["clock"] = clock
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
    state.service_options = options
    state.tenant_limit = limit
    state.pgbouncer = (PgBouncerMonitor(pgbouncer_admin_url, metrics.registry)
                       if pgbouncer_admin_url else None)
    if database is not None:
        state.owned_pool = None
        state.service = ReservationService(database, **options)
    else:
        assert dsn is not None
        state.owned_pool = OwnedPool(dsn, pool_size, pool_min_size, application_name,
                                     prepare_threshold)
        state.service = None
    app.add_middleware(Admission, deadline_s=request_deadline_s, limit=limit)
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
                      int(threshold),
                      api_key_cache_s=float(os.environ.get("PGRESERVE_API_KEY_CACHE_SECONDS",
                                                           DEFAULT_API_KEY_CACHE_S)),
                      **admission_from_env())


def admission_from_env() -> dict[str, Any]:
    """create_app's admission options from PGRESERVE_REQUEST_DEADLINE_SECONDS,
    PGRESERVE_TENANT_MAX_IN_FLIGHT and PGRESERVE_PGBOUNCER_ADMIN_URL."""
    env = os.environ
    return {"request_deadline_s": float(env.get("PGRESERVE_REQUEST_DEADLINE_SECONDS",
                                                DEFAULT_REQUEST_DEADLINE_S)),
            "tenant_max_in_flight": int(env.get("PGRESERVE_TENANT_MAX_IN_FLIGHT", "0")),
            "pgbouncer_admin_url": env.get("PGRESERVE_PGBOUNCER_ADMIN_URL") or None}
