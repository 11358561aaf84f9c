"""/v1/skus: what is set for a SKU over all its locations (its per-cart limit and its own
location priority)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from ...core.service import UNSET
from ...domain import SkuSettings
from .. import problems
from ..dependencies import PathName, Service, Tenant, stored_name
from ..models import SkuSettingsIn, SkuSettingsOut
from ..responses import COMMON, json_response

router = APIRouter(tags=["stock"])


def sku_doc(settings: SkuSettings) -> dict[str, object]:
    priority = settings.location_priority
    return {"sku": settings.sku, "cart_limit": settings.cart_limit,
            "location_priority": None if priority is None else list(priority)}


@router.put("/v1/skus/{sku}", response_model=SkuSettingsOut,
            responses=problems.responses(413, *COMMON),
            summary="Set a SKU's per-cart limit and/or its own location priority (null "
                    "removes either; what is not given stays)")
async def put_sku(sku: PathName, body: SkuSettingsIn, tenant: Tenant, svc: Service) -> Response:
    given = body.model_fields_set
    settings = await svc.update_sku(
        tenant, stored_name(sku, "sku"),
        cart_limit=body.cart_limit if "cart_limit" in given else UNSET,
        location_priority=body.location_priority if "location_priority" in given else UNSET)
    return json_response(200, sku_doc(settings))


@router.get("/v1/skus/{sku}", response_model=SkuSettingsOut,
            responses=problems.responses(*COMMON))
async def get_sku(sku: PathName, tenant: Tenant, svc: Service) -> Response:
    return json_response(200, sku_doc(await svc.sku_settings(tenant, stored_name(sku, "sku"))))
