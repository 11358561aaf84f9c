"""Health on the tenant API; Prometheus metrics and the /ops page on the ops listener.

`router` (/healthz) is part of the tenant API. `ops_router` is served only by
the ops listener (http/ops_app.py), never on the API's port: its figures name
every tenant's buckets.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import HTMLResponse, Response

from ...db.database import Op
from ...db.queries import queries
from ...ops import web
from ...ops.ring import RecentFigures
from .. import problems
from ..dependencies import Metrics, service
from ..models import Health
from ..responses import json_response

router = APIRouter(tags=["operations"])
ops_router = APIRouter(tags=["operations"])

HEALTH = Op("api", "health_check", "GET /healthz")

# These routes look the service up in their body (not as a dependency) so
# that a closed pool is answered after the request's own validation, as it
# always was; /healthz reports it as the database being unreachable.


@router.get("/healthz", response_model=Health, responses=problems.responses(503))
async def healthz(request: Request) -> Response:
    try:
        await service(request).db.fetch(queries["health_check"], op=HEALTH)
    except Exception as exc:  # noqa: BLE001 (any failure to answer means unavailable)
        raise problems.Unavailable(f"database unreachable: {type(exc).__name__}") from None
    return json_response(200, {"status": "ok"})


@ops_router.get("/metrics", response_class=Response,
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                 "description": "Prometheus text format"}})
async def prometheus(request: Request, metrics: Metrics) -> Response:
    await web.refresh_metrics(request.app, service(request), metrics)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@ops_router.get("/ops", response_class=HTMLResponse)
async def ops_page(request: Request, metrics: Metrics) -> Response:
    doc = await web.snapshot(request.app, service(request), metrics)
    return HTMLResponse(web.render_page(doc))


@ops_router.get("/ops/tables", response_class=HTMLResponse)
async def ops_tables(request: Request, metrics: Metrics) -> Response:
    """The page's tables alone: the page swaps them in every few seconds."""
    doc = await web.snapshot(request.app, service(request), metrics)
    return HTMLResponse(web.render_tables(doc))


@ops_router.get("/ops.json")
async def ops_json(request: Request, metrics: Metrics) -> Response:
    return json_response(200, await web.snapshot(request.app, service(request), metrics))


@ops_router.get("/ops/series.json")
async def ops_series(request: Request) -> Response:
    """The recent figures the page charts (kept in this process, one point a second)."""
    ring: RecentFigures | None = getattr(request.app.state, "ring", None)
    if ring is None:
        raise problems.Unavailable("the recent figures are not being sampled")
    return json_response(200, ring.as_json())
