"""Operator controls over HTTP: freeze and unfreeze new reservations of a bucket or tenant.

One router (`router`) with no tenant API key: it belongs behind the operator's
perimeter, beside /ops and /metrics, never on a port tenants reach.

    GET  /ops/freezes          the live freezes (?tenant=NAME for one tenant)
    POST /ops/freezes          {"tenant", "sku"?, "location"?, "reason", "by"}: freeze
    POST /ops/freezes/lift     the same body: lift the live freeze

Without sku and location the whole tenant is frozen. The answers are the
freeze documents the CLI prints (`pgreserve freeze list --json`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import Field, StrictStr
from starlette.responses import Response

from ..core.service import ReservationService
from ..domain import MAX_NAME
from ..http import problems
from ..http.dependencies import service
from ..http.models import Name, Strict
from ..http.responses import json_response

router = APIRouter(tags=["operator controls"], include_in_schema=False)

Text = Annotated[StrictStr, Field(min_length=1, max_length=1000, pattern=r"^[^\x00]+$")]


class FreezeIn(Strict):
    tenant: Name
    sku: Name | None = None
    location: Name | None = None
    reason: Text
    by: Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[^\x00]+$")]


async def _tenant_id(svc: ReservationService, name: str) -> int:
    found = await svc.tenant_by_name(name)
    if found is None:
        raise problems.NotFound(f"no tenant named {name!r}")
    return found.id


@router.get("/ops/freezes")
async def list_freezes(request: Request,
                       tenant: Annotated[str | None, Query(max_length=MAX_NAME)] = None
                       ) -> Response:
    svc = service(request)
    tenant_id = None if tenant is None else await _tenant_id(svc, tenant)
    return json_response(200, {"freezes": [f.as_json() for f in await svc.freezes(tenant_id)]})


@router.post("/ops/freezes")
async def freeze(body: FreezeIn, request: Request) -> Response:
    svc = service(request)
    done = await svc.freeze(await _tenant_id(svc, body.tenant), body.reason, body.by,
                            sku=body.sku, location=body.location)
    return json_response(200 if done.already else 201, {**done.as_json(), "already": done.already})


@router.post("/ops/freezes/lift")
async def unfreeze(body: FreezeIn, request: Request) -> Response:
    svc = service(request)
    done = await svc.unfreeze(await _tenant_id(svc, body.tenant), body.reason, body.by,
                              sku=body.sku, location=body.location)
    return json_response(200, done.as_json())
