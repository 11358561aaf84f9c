"""/v1/stock: set, adjust, read and list a tenant's stock lines (buckets)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from pydantic import StringConstraints
from starlette.responses import Response

from ...core.service import DEFAULT_STOCK_PAGE, MAX_STOCK_FILTER, MAX_STOCK_PAGE
from .. import conditional, problems
from ..dependencies import (
    Holds,
    KeyHeader,
    Keys,
    PathName,
    Service,
    Tenant,
    request_key,
    single_query_values,
    stored_name,
)
from ..models import StockAdjust, StockOut, StockPageOut, StockSet, stock_doc
from ..responses import COMMON, json_response

router = APIRouter(tags=["stock"])

IfMatchHeader = Annotated[str | None, Header(
    alias="If-Match",
    description='Write only if the line\'s ETag is one of these (W/"3", compared weakly), '
                'or, with *, only if the line exists; otherwise 412 and nothing is written.')]
IfNoneMatchHeader = Annotated[str | None, Header(
    alias="If-None-Match",
    description="* : create the line only; 412 if it exists.")]
AdjustIfNoneMatchHeader = Annotated[str | None, Header(
    alias="If-None-Match",
    description="Not evaluated on an adjustment: any value is 400 precondition_invalid.")]

NAME_PATTERN = r"^[^\x00]+$"
QueryName = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=NAME_PATTERN)]

_ETAG = {"ETag": {"description": 'The line\'s version as a weak entity tag, W/"<version>"',
                  "schema": {"type": "string"}}}
_LOCATION = {"Location": {"description": "The created line's URL (under the root path)",
                          "schema": {"type": "string"}}}


def _with_headers(responses: dict[int | str, dict[str, Any]],
                  by_status: dict[int, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses with the response headers of the success statuses."""
    for status, headers in by_status.items():
        responses.setdefault(status, {}).setdefault("headers", {}).update(headers)
    return responses


@router.put("/v1/stock/{location}/{sku}", response_model=StockOut,
            responses=_with_headers(
                {201: {"description": "The line was created", "model": StockOut},
                 **problems.responses(400, 412, *COMMON, 413)},
                {200: _ETAG, 201: {**_ETAG, **_LOCATION}}),
            summary="Set the on-hand count of a SKU at a location (creates it)")
async def put_stock(location: PathName, sku: PathName, body: StockSet, tenant: Tenant,
                    svc: Holds, request: Request, if_match: IfMatchHeader = None,
                    if_none_match: IfNoneMatchHeader = None) -> Response:
    match = conditional.if_match(if_match)
    create = conditional.create_only(if_none_match)
    sku, location = stored_name(sku, "sku"), stored_name(location, "location")
    if match is not None and create:
        # "exists" and "does not exist" at once: no line can satisfy both
        raise conditional.contradiction()
    view = await svc.set_stock(tenant, sku, location, body.on_hand, strategy=body.strategy,
                               if_match=match, create_only=create,
                               safety_stock=body.safety_stock,
                               backorder_limit=body.backorder_limit)
    headers = conditional.etag_headers(view.version)
    if view.created:
        headers["Location"] = conditional.location_of(request, "v1", "stock", location, sku)
        return json_response(201, stock_doc(view), headers=headers)
    return json_response(200, stock_doc(view), headers=headers)


@router.post("/v1/stock/{location}/{sku}/adjustments", response_model=StockOut,
             responses=_with_headers(problems.responses(400, 404, 409, 412, 413, *COMMON),
                                     {200: _ETAG}),
             summary="Receipt (delta > 0) or correction (delta < 0)")
async def adjust_stock(location: PathName, sku: PathName, body: StockAdjust, tenant: Tenant,
                       svc: Holds, keys: Keys, idempotency_key: KeyHeader = None,
                       if_match: IfMatchHeader = None,
                       if_none_match: AdjustIfNoneMatchHeader = None) -> Response:
    key = request_key(idempotency_key, required=True)
    assert key is not None
    if if_none_match is not None:  # (never ignored: the write would go through unasked)
        raise problems.PreconditionInvalid(
            "If-None-Match is not evaluated on an adjustment: the line it adjusts exists "
            "(an adjustment of no line is 404); use If-Match for its version")
    match = conditional.if_match(if_match)
    async with keys.hold(tenant, key):
        view = await svc.adjust_stock(tenant, key, stored_name(sku, "sku"),
                                      stored_name(location, "location"), body.delta,
                                      reason=body.reason, if_match=match)
    return json_response(200, stock_doc(view), view.replayed,
                         headers=conditional.etag_headers(view.version))


@router.get("/v1/stock/{location}/{sku}", response_model=StockOut,
            responses=_with_headers(problems.responses(404, *COMMON), {200: _ETAG}))
async def get_stock(location: PathName, sku: PathName, tenant: Tenant,
                    svc: Service) -> Response:
    view = await svc.get_stock(tenant, stored_name(sku, "sku"), stored_name(location, "location"))
    return json_response(200, stock_doc(view), headers=conditional.etag_headers(view.version))


@router.get("/v1/stock", response_model=StockPageOut,
            responses=problems.responses(400, *COMMON),
            summary="This tenant's stock lines in (sku, location) order, a page at a time")
async def list_stock(
        tenant: Tenant, svc: Service, request: Request,
        sku: Annotated[list[QueryName] | None, Query(
            max_length=MAX_STOCK_FILTER,
            description="Only these SKUs (repeat the parameter, at most 100)")] = None,
        sku_prefix: Annotated[str | None, Query(
            min_length=1, max_length=200, pattern=NAME_PATTERN,
            description="Only SKUs starting with this")] = None,
        location: Annotated[str | None, Query(
            min_length=1, max_length=200, pattern=NAME_PATTERN,
            description="Only this location")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_STOCK_PAGE)] = DEFAULT_STOCK_PAGE,
        cursor: Annotated[str | None, Query(
            min_length=1, max_length=4096,
            description="next_cursor of the previous page")] = None) -> Response:
    single_query_values(request, "sku_prefix", "location", "limit", "cursor")
    page = await svc.list_stock(
        tenant, skus=None if sku is None else [stored_name(s, "sku") for s in sku],
        sku_prefix=None if sku_prefix is None else stored_name(sku_prefix, "sku_prefix"),
        location=None if location is None else stored_name(location, "location"),
        limit=limit, after=cursor)
    return json_response(200, {"stock": [stock_doc(v) for v in page.stock],
                               "next_cursor": page.next_cursor})
