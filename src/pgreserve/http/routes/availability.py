"""/v1/availability: many SKUs per location and in total, from one snapshot."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import StringConstraints
from starlette.responses import Response

from ...domain import MAX_AVAILABILITY_NAMES, MAX_NAME, Availability
from .. import problems
from ..dependencies import Service, Tenant
from ..models import AvailabilityOut
from ..responses import COMMON, json_response

router = APIRouter(tags=["stock"])

QueryName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME,
                                             pattern=r"^[^\x00]+$")]


def availability_doc(item: Availability) -> dict[str, object]:
    return {
        "sku": item.sku, "known": item.known, "on_hand": item.on_hand,
        "reserved": item.reserved, "available": item.available,
        "locations": [{"location": v.location, "on_hand": v.on_hand, "reserved": v.reserved,
                       "available": v.available} for v in item.locations],
    }


@router.get("/v1/availability", response_model=AvailabilityOut,
            responses=problems.responses(*COMMON),
            summary="Availability of many SKUs, per location and in total, at one instant")
async def get_availability(
        tenant: Tenant, svc: Service,
        sku: Annotated[list[QueryName], Query(
            min_length=1, max_length=MAX_AVAILABILITY_NAMES,
            description=f"a SKU to report; repeat for more (at most {MAX_AVAILABILITY_NAMES})")],
        location: Annotated[list[QueryName], Query(
            max_length=MAX_AVAILABILITY_NAMES,
            description="only these locations; repeat for more (default: every location)")]
        = []) -> Response:  # noqa: B006 - FastAPI copies a query parameter's default
    # (an empty list cannot be sent in a query string: absent means every location)
    items = await svc.availability(tenant, sku, location or None)
    return json_response(200, {"items": [availability_doc(i) for i in items]})
