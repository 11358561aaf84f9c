"""/v1/locations/priority: the tenant's location order for cart lines without a location."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from .. import problems
from ..dependencies import Service, Tenant
from ..models import LocationPriority
from ..responses import COMMON, json_response

router = APIRouter(tags=["stock"])


@router.put("/v1/locations/priority", response_model=LocationPriority,
            responses=problems.responses(413, *COMMON),
            summary="Set the order in which lines without a location take from locations")
async def set_location_priority(body: LocationPriority, tenant: Tenant, svc: Service) -> Response:
    order = await svc.set_location_priority(tenant, body.locations)
    return json_response(200, {"locations": list(order)})


@router.get("/v1/locations/priority", response_model=LocationPriority,
            responses=problems.responses(*COMMON))
async def get_location_priority(tenant: Tenant, svc: Service) -> Response:
    return json_response(200, {"locations": list(await svc.location_priority(tenant))})
