"""/v1/reservations: hold a cart, read it, change it, claim, release or extend it."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ... import errors
from ...core.service import DEFAULT_RESERVATION_PAGE, MAX_RESERVATION_PAGE
from ...domain import AllocatedLine, Reservation, ReserveOutcome
from .. import conditional, problems
from ..dependencies import (
    Authenticated,
    Caller,
    Holds,
    KeyHeader,
    Tenant,
    request_key,
    single_query_values,
    stored_name,
)
from ..models import (
    ChangeIn,
    ExtendIn,
    ReservationOut,
    ReservationPageOut,
    ReserveIn,
    reservation_doc,
)
from ..responses import COMMON, REPLAYED_HEADER, json_response

router = APIRouter(tags=["reservations"])


@router.post("/v1/reservations", status_code=201, response_model=ReservationOut,
             responses={201: {"headers": {"Location": {
                            "description": "The reservation's URL (under the root path)",
                            "schema": {"type": "string"}}}},
                        **problems.responses(400, 404, 409, 413, 423, *COMMON)},
             summary="Hold every line of a cart, or none")
async def reserve(body: ReserveIn, caller: Authenticated, request: Request,
                  idempotency_key: KeyHeader = None) -> Response:
    key = request_key(idempotency_key, required=True)
    assert key is not None
    tenant = caller.tenant
    async with caller.keys.hold(tenant, key):
        outcome = await caller.holds.reserve(
            tenant, key, [(x.sku, x.location, x.quantity) if x.location is not None
                          else AllocatedLine(x.sku, x.quantity, x.split) for x in body.lines],
            ttl=body.ttl_seconds, reference=body.reference, metadata=body.metadata)
    caller.metrics.http_reserve_outcomes.labels("held" if outcome.held else "rejected",
                                         str(outcome.replayed).lower()).inc()
    return reserve_response(outcome, request)


def reserve_response(outcome: ReserveOutcome, request: Request | None = None) -> Response:
    """201 with the reservation (and, given the request, its Location), 409
    insufficient_stock with its short lines, 409 cart_limit_exceeded with its limited
    lines, or 423 bucket_frozen / tenant_frozen."""
    if outcome.held:
        assert outcome.reservation is not None
        headers = None if request is None else {"Location": conditional.location_of(
            request, "v1", "reservations", outcome.reservation.id)}
        return json_response(201, reservation_doc(outcome.reservation), outcome.replayed,
                             headers=headers)
    headers = {REPLAYED_HEADER: "true"} if outcome.replayed else None
    if outcome.reason == "tenant_frozen":
        return problems.problem_response(
            problems.TenantFrozen("an operator froze new reservations of this tenant"),
            headers=headers)
    if outcome.reason == "cart_limit_exceeded":
        limited = [{"sku": x.sku, "limit": x.limit, "requested": x.requested}
                   for x in outcome.limited_lines]
        return problems.problem_response(
            problems.CartLimitExceeded(f"{len(limited)} SKU(s) over their per-cart limit"),
            headers=headers, limited_lines=limited)
    if outcome.reason == "bucket_frozen":
        frozen = [{"sku": f.sku, "location": f.location} for f in outcome.frozen_lines]
        return problems.problem_response(
            problems.BucketFrozen(f"an operator froze new reservations of {len(frozen)} "
                                  "line(s)"), headers=headers, frozen_lines=frozen)
    short = [{"sku": s.sku, "location": s.location, "requested": s.requested,
              "available": s.available} for s in outcome.short_lines]
    return problems.problem_response(
        problems.InsufficientStock(f"not enough stock for {len(short)} line(s)"),
        headers=headers, short_lines=short)


@router.get("/v1/reservations", response_model=ReservationPageOut,
            responses=problems.responses(400, 409, *COMMON),
            summary="This tenant's reservations, newest first, a page at a time")
async def list_reservations(
        tenant: Tenant, svc: Holds, request: Request,
        cart: Annotated[str | None, Query(
            min_length=1, max_length=200, pattern=r"^[^\x00]+$",
            description="Only reservations with this reference (cart or order id)")] = None,
        status: Annotated[list[Literal["active", "claimed", "released", "expired"]] | None,
                          Query(description=(
                              "Only these statuses, as the documents show them (expired "
                              "includes an active hold past its expiry); repeat the "
                              "parameter for several"))] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_RESERVATION_PAGE)] = DEFAULT_RESERVATION_PAGE,
        cursor: Annotated[str | None, Query(
            min_length=1, max_length=4096,
            description="next_cursor of the previous page")] = None) -> Response:
    single_query_values(request, "cart", "limit", "cursor")
    page = await svc.list_reservations(
        tenant, reference=None if cart is None else stored_name(cart, "cart"),
        status=status, limit=limit, after=cursor)
    return json_response(200, {"reservations": [reservation_doc(r) for r in page.reservations],
                               "next_cursor": page.next_cursor})


@router.get("/v1/reservations/{reservation_id}", response_model=ReservationOut,
            responses=problems.responses(404, *COMMON))
async def get_reservation(reservation_id: str, tenant: Tenant, svc: Holds) -> Response:
    found = await svc.get_reservation(tenant, reservation_id)
    return json_response(200, reservation_doc(found))


async def transition(operation: str, run: Callable[[str | None], Awaitable[Reservation]],
                     caller: Caller, idempotency_key: str | None) -> Response:
    """Claim, release or extend (`run(key)`), counted by result; a keyed one held in flight."""
    key = request_key(idempotency_key, required=False)
    metrics = caller.metrics
    hold: contextlib.AbstractAsyncContextManager[None] = (contextlib.nullcontext() if key is None
                                       else caller.keys.hold(caller.tenant, key))
    try:
        async with hold:
            r = await run(key)
    except errors.ApiKeyRefused:
        raise  # a 401, as a key refused before the operation: not a transition's result
    except errors.PgReserveError as exc:
        metrics.http_transitions.labels(operation, exc.code).inc()
        raise
    metrics.http_transitions.labels(operation, "ok").inc()
    return json_response(200, reservation_doc(r), r.replayed)


@router.post("/v1/reservations/{reservation_id}/claim", response_model=ReservationOut,
             responses=problems.responses(400, 404, 409, *COMMON),
             summary="Payment succeeded: turn the hold into a sale (repeatable)")
async def claim(reservation_id: str, caller: Authenticated,
                idempotency_key: KeyHeader = None) -> Response:
    return await transition(
        "claim", lambda key: caller.holds.claim(caller.tenant, reservation_id, request_key=key),
        caller, idempotency_key)


@router.post("/v1/reservations/{reservation_id}/release", response_model=ReservationOut,
             responses=problems.responses(400, 404, 409, *COMMON),
             summary="Payment failed: give the units back (repeatable)")
async def release(reservation_id: str, caller: Authenticated,
                  idempotency_key: KeyHeader = None) -> Response:
    return await transition(
        "release", lambda key: caller.holds.release(caller.tenant, reservation_id,
                                                      request_key=key),
        caller, idempotency_key)


@router.post("/v1/reservations/{reservation_id}/extend", response_model=ReservationOut,
             responses=problems.responses(400, 404, 409, 413, *COMMON),
             summary="New time to live for an active reservation, counted from now")
async def extend(reservation_id: str, body: ExtendIn, caller: Authenticated,
                 idempotency_key: KeyHeader = None) -> Response:
    return await transition(
        "extend", lambda key: caller.holds.extend(caller.tenant, reservation_id,
                                                    body.ttl_seconds, request_key=key,
                                                    allow_shorten=body.allow_shorten),
        caller, idempotency_key)


@router.put("/v1/reservations/{reservation_id}/lines", response_model=ReservationOut,
            responses=problems.responses(400, 404, 409, 413, 423, *COMMON),
            summary="Replace the cart of an active reservation (the whole new cart), or "
                    "change nothing")
async def change_lines(reservation_id: str, body: ChangeIn, caller: Authenticated,
                       idempotency_key: KeyHeader = None) -> Response:
    key = request_key(idempotency_key, required=True)
    assert key is not None
    try:
        async with caller.keys.hold(caller.tenant, key):
            outcome = await caller.holds.change(
                caller.tenant, reservation_id,
                [(x.sku, x.location, x.quantity) for x in body.lines], request_key=key)
    except errors.PgReserveError as exc:
        caller.metrics.http_transitions.labels("change", exc.code).inc()
        raise
    caller.metrics.http_transitions.labels(
        "change", "ok" if outcome.held else outcome.reason or "rejected").inc()
    return change_response(outcome)


def change_response(outcome: ReserveOutcome) -> Response:
    """200 with the reservation as changed, or the rejection a reserve would get (409
    insufficient_stock / cart_limit_exceeded, 423 bucket_frozen / tenant_frozen)."""
    if outcome.held:
        assert outcome.reservation is not None
        return json_response(200, reservation_doc(outcome.reservation), outcome.replayed)
    return reserve_response(outcome)
