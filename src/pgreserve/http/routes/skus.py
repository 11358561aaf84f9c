"""/v1/skus: what is set for a SKU over all its locations (its per-cart limit)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from ...domain import SkuSettings
from .. import problems
from ..dependencies import PathName, Service, Tenant, stored_name
from ..models import SkuSettingsIn, SkuSettingsOut
from ..responses import COMMON, json_response

router = APIRouter(tags=["stock"])


def sku_doc(settings: SkuSettings) -> dict[str, object]:
    return {"sku": settings.sku, "cart_limit": settings.cart_limit}


@router.put("/v1/skus/{sku}", response_model=SkuSettingsOut,
            responses=problems.responses(413, *COMMON),
            summary="Set a SKU's per-cart limit (null removes it), for every location")
async def put_sku(sku: PathName, body: SkuSettingsIn, tenant: Tenant, svc: Service) -> Response:
    settings = await svc.set_cart_limit(tenant, stored_name(sku, "sku"), body.cart_limit)
    return json_response(200, sku_doc(settings))


@router.get("/v1/skus/{sku}", response_model=SkuSettingsOut,
            responses=problems.responses(*COMMON))
async def get_sku(sku: PathName, tenant: Tenant, svc: Service) -> Response:
    return json_response(200, sku_doc(await svc.sku_settings(tenant, stored_name(sku, "sku"))))
