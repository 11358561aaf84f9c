"""/v1/stock: set, adjust and read a bucket's on-hand count."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from .. import problems
from ..dependencies import (
    Holds,
    KeyHeader,
    Keys,
    PathName,
    Service,
    Tenant,
    request_key,
    stored_name,
)
from ..models import StockAdjust, StockOut, StockSet, stock_doc
from ..responses import COMMON, json_response

router = APIRouter(tags=["stock"])


@router.put("/v1/stock/{location}/{sku}", response_model=StockOut,
            responses=problems.responses(*COMMON, 413),
            summary="Set the on-hand count of a SKU at a location (creates it)")
async def put_stock(location: PathName, sku: PathName, body: StockSet, tenant: Tenant,
                    svc: Holds) -> Response:
    view = await svc.set_stock(tenant, stored_name(sku, "sku"),
                               stored_name(location, "location"), body.on_hand,
                               strategy=body.strategy)
    return json_response(200, stock_doc(view))


@router.post("/v1/stock/{location}/{sku}/adjustments", response_model=StockOut,
             responses=problems.responses(400, 404, 409, 413, *COMMON),
             summary="Receipt (delta > 0) or correction (delta < 0)")
async def adjust_stock(location: PathName, sku: PathName, body: StockAdjust, tenant: Tenant,
                       svc: Holds, keys: Keys, idempotency_key: KeyHeader = None) -> Response:
    key = request_key(idempotency_key, required=True)
    assert key is not None
    async with keys.hold(tenant, key):
        view = await svc.adjust_stock(tenant, key, stored_name(sku, "sku"),
                                      stored_name(location, "location"), body.delta,
                                      reason=body.reason)
    return json_response(200, stock_doc(view), view.replayed)


@router.get("/v1/stock/{location}/{sku}", response_model=StockOut,
            responses=problems.responses(404, *COMMON))
async def get_stock(location: PathName, sku: PathName, tenant: Tenant,
                    svc: Service) -> Response:
    view = await svc.get_stock(tenant, stored_name(sku, "sku"), stored_name(location, "location"))
    return json_response(200, stock_doc(view))
