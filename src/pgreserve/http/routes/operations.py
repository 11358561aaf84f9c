"""Health, Prometheus metrics and the /ops page: no tenant, no API key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import HTMLResponse, Response

from ...db.database import Op
from ...db.queries import queries
from ...ops import web
from .. import problems
from ..dependencies import Metrics, service
from ..models import Health
from ..responses import json_response

router = APIRouter(tags=["operations"])

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


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"}})
async def prometheus(request: Request, metrics: Metrics) -> Response:
    await web.refresh_metrics(request.app, service(request), metrics)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/ops", response_class=HTMLResponse, include_in_schema=False)
async def ops_page(request: Request, metrics: Metrics,
                   refresh: Annotated[int, Query(ge=1, le=3600)] = 5) -> Response:
    doc = await web.snapshot(request.app, service(request), metrics)
    return HTMLResponse(web.render_page(doc, refresh))


@router.get("/ops.json", include_in_schema=False)
async def ops_json(request: Request, metrics: Metrics) -> Response:
    return json_response(200, await web.snapshot(request.app, service(request), metrics))
