"""The ops listener's app: /metrics, /ops and every operator route, off the tenant API.

It runs on its own host and port (loopback by default) and is never mounted
on the API. Operator routers are listed in OPS_ROUTERS; extra Prometheus
collectors (PgBouncer's pools, say) are passed as `collectors` or added later
with `app.state.metrics.register(collector)`.

Two shapes:
- beside the API in one process (`up`, `serve`): `state=` the API app's state,
  so both apps share the pool, the metrics and the monitors;
- alone (`serve --workers N`, in the parent process): `dsn=`, its own small
  pool and its own metrics object, which in multiprocess mode reads every
  worker's values (ops/metrics.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from prometheus_client.registry import Collector
from starlette.datastructures import State

from ..core.service import ReservationService
from ..db.database import Database
from ..ops import controls, web
from ..ops.pgbouncer import PgBouncerMonitor
from ..ops.ring import RecentFigures, RingConfig
from ..workers.base import run_forever
from .exception_handlers import EXCEPTION_HANDLERS
from .metrics import ApiMetrics
from .routes import operations

# Every router the ops listener serves, in this order.
OPS_ROUTERS: list[APIRouter] = [operations.ops_router, controls.router]

OPS_APPLICATION_NAME = "pgreserve:ops"


@asynccontextmanager
async def ops_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the own pool (when alone), run the monitors (when asked) and the figures ring."""
    state = app.state
    database: Database | None = None
    if state.ops_dsn is not None:
        database = Database(state.ops_dsn, min_size=1, max_size=2,
                            application_name=OPS_APPLICATION_NAME, observer=state.metrics.db_event)
        await database.open()
        state.service = ReservationService(database)
    try:
        db = state.service.db
        async with web.monitors(app, db.conninfo, state.metrics, enabled=state.ops_monitor,
                                schema=db.schema):
            ring = RecentFigures(state.metrics, state, db, state.ops_ring_config)
            state.ring = ring
            stop = asyncio.Event()
            task = asyncio.create_task(run_forever(ring, stop))
            try:
                yield
            finally:
                stop.set()
                await task
    finally:
        if database is not None:
            await database.close()
            if state.pgbouncer is not None:
                await state.pgbouncer.close()


def create_ops_app(*, state: State | None = None, dsn: str | None = None, monitor: bool = True,
                   routers: Sequence[APIRouter] | None = None,
                   collectors: Sequence[Collector] = (),
                   ring: RingConfig | None = None,
                   pgbouncer_admin_url: str | None = None) -> FastAPI:
    """The ops listener's app, sharing an API app's `state`, or alone on `dsn`.

    `monitor` runs the hold-time sampler and the bloat monitor in this process
    (their figures go to /metrics, /ops and the page's charts). Alone, it reads
    PgBouncer's pools for /metrics itself when given `pgbouncer_admin_url`
    (sharing `state`, the API app's monitor does).
    """
    if (state is None) == (dsn is None):
        raise ValueError("create_ops_app needs either the API app's state or a dsn")
    app = FastAPI(title="pgreserve operations", version="1", lifespan=ops_lifespan,
                  exception_handlers=EXCEPTION_HANDLERS, docs_url=None, redoc_url=None,
                  openapi_url=None)
    for router in OPS_ROUTERS if routers is None else routers:
        app.include_router(router)
    if state is not None:
        app.state = state  # the API app's service, metrics and monitors
    else:
        app.state.metrics = ApiMetrics()
        app.state.service = None
        app.state.pgbouncer = (PgBouncerMonitor(pgbouncer_admin_url, app.state.metrics.registry)
                               if pgbouncer_admin_url else None)
    app.state.ops_dsn = dsn
    app.state.ops_monitor = monitor
    app.state.ops_ring_config = ring
    for collector in collectors:
        app.state.metrics.register(collector)
    return app
