"""Errors as RFC 9457 problem details; ONE table maps error classes to HTTP status."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from .. import errors

PROBLEM_MEDIA_TYPE = "application/problem+json"

log = logging.getLogger(__name__)


# -- errors that only exist at the HTTP layer ----------------------------------

class Unauthorized(errors.PgReserveError):
    code = "unauthorized"


class IdempotencyKeyMissing(errors.PgReserveError):
    code = "idempotency_key_missing"


class IdempotencyKeyInvalid(errors.PgReserveError):
    """A malformed Idempotency-Key: a bad structured-field string, empty or too long."""

    code = "idempotency_key_invalid"


class PreconditionInvalid(errors.PgReserveError):
    """An If-Match / If-None-Match header that is not a list of entity tags (or `*`), or
    a condition this endpoint does not evaluate."""

    code = "precondition_invalid"


RequestInProgress = errors.RequestInProgress  # the same key running now (409)


class InsufficientStock(errors.PgReserveError):
    """Not an exception in the core (a rejected ReserveOutcome); raised to render it."""

    code = "insufficient_stock"


class BucketFrozen(errors.PgReserveError):
    """A rejected ReserveOutcome (a bucket of the cart is frozen); raised to render it."""

    code = "bucket_frozen"


class CartLimitExceeded(errors.PgReserveError):
    """A rejected ReserveOutcome (over a SKU's per-cart limit); raised to render it."""

    code = "cart_limit_exceeded"


class TenantFrozen(errors.PgReserveError):
    """A rejected ReserveOutcome (the tenant is frozen); raised to render it."""

    code = "tenant_frozen"


class PayloadTooLarge(errors.PgReserveError):
    code = "payload_too_large"


class NotFound(errors.PgReserveError):
    code = "not_found"


class MethodNotAllowed(errors.PgReserveError):
    code = "method_not_allowed"


class Unavailable(errors.PgReserveError):
    code = "unavailable"
    retryable = True


class InternalError(errors.PgReserveError):
    code = "internal_error"


# (status, title) per error class; the most specific class in the MRO wins.
STATUS: dict[type[errors.PgReserveError], tuple[int, str]] = {
    errors.InvalidRequest: (422, "Invalid request"),
    errors.UnknownTenant: (401, "Unauthorized"),
    errors.ApiKeyRefused: (401, "Unauthorized"),
    errors.UnknownStock: (404, "Unknown stock"),
    errors.ReservationNotFound: (404, "Reservation not found"),
    errors.WebhookNotFound: (404, "Webhook not found"),
    errors.RequestNotFound: (404, "Request not found"),
    errors.ApiKeyNotFound: (404, "API key not found"),
    errors.FreezeNotFound: (404, "Not frozen"),
    errors.WebhookUrlRefused: (422, "Webhook URL refused"),
    errors.AllocationUnavailable: (422, "Allocation across locations unavailable"),
    errors.IdempotencyKeyReused: (422, "Idempotency-Key reused with another request"),
    errors.WouldOversell: (409, "Adjustment would oversell"),
    errors.PreconditionFailed: (412, "Precondition failed"),
    errors.InvalidCursor: (400, "Invalid cursor"),
    errors.ReservationReleased: (409, "Reservation was released"),
    errors.ReservationClaimed: (409, "Reservation was claimed"),
    errors.ReservationExpired: (409, "Reservation expired"),
    errors.ReservationNotActive: (409, "Reservation is not active"),
    errors.ExtendWouldShorten: (409, "Extend would shorten the reservation"),
    errors.UnsupportedInRolloutMode: (409, "Not supported while the legacy store answers"),
    errors.ChangeNotMirrored: (409, "Hold kept in the legacy store cannot be changed"),
    errors.BackorderedHoldUnchangeable: (409, "Hold with backordered units cannot be changed"),
    errors.StockPolicyUnsupported: (409, "Stock policy not supported in this rollout mode"),
    errors.Busy: (503, "Busy, retry later"),
    errors.OutcomeUnknown: (503, "Outcome unknown, retry with the same Idempotency-Key"),
    errors.DatabaseUnavailable: (503, "Database unavailable, retry later"),
    errors.TooManyRequests: (429, "Too many requests for this tenant, retry later"),
    errors.DatabaseNotMigrated: (503, "Database not migrated"),
    errors.DatabaseTooNew: (503, "Database migrated by a newer pgreserve"),
    Unauthorized: (401, "Unauthorized"),
    IdempotencyKeyMissing: (400, "Idempotency-Key header required"),
    IdempotencyKeyInvalid: (400, "Invalid Idempotency-Key"),
    PreconditionInvalid: (400, "Invalid precondition header"),
    RequestInProgress: (409, "A request with this Idempotency-Key is in progress"),
    InsufficientStock: (409, "Insufficient stock"),
    BucketFrozen: (423, "Bucket frozen"),
    TenantFrozen: (423, "Tenant frozen"),
    CartLimitExceeded: (409, "Cart limit exceeded"),
    PayloadTooLarge: (413, "Request body too large"),
    NotFound: (404, "Not found"),
    MethodNotAllowed: (405, "Method not allowed"),
    Unavailable: (503, "Service unavailable"),
    InternalError: (500, "Internal server error"),
}


def status_of(exc: errors.PgReserveError) -> tuple[int, str]:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500, "Internal server error"


# -- the problem document (also the OpenAPI schema of every error) -------------

class ShortLine(BaseModel):
    sku: str
    location: str | None  # null: a line without a location (allocated)
    requested: int
    available: int


class StockRef(BaseModel):
    sku: str
    location: str


class UnknownStockRef(BaseModel):
    sku: str
    location: str | None  # null: a line without a location whose SKU has no stock line


class LimitedLine(BaseModel):
    sku: str
    limit: int
    requested: int


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """application/problem+json (RFC 9457) with a stable machine-readable `code`."""

    model_config = ConfigDict(extra="forbid")

    type: str
    title: str
    status: int
    detail: str
    code: str
    short_lines: list[ShortLine] | None = None
    unknown_stock: list[UnknownStockRef] | None = None
    frozen_lines: list[StockRef] | None = None
    limited_lines: list[LimitedLine] | None = None
    errors: list[FieldError] | None = None


def render(doc: dict[str, Any]) -> bytes:
    """The one JSON encoding of every response body: deterministic, so replays match bytes."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# Errors whose message is for the operator (it names the database and the command that
# mends it): a client is told this instead, and the message goes to the log.
OPERATOR_ONLY: dict[type[errors.PgReserveError], str] = {
    errors.DatabaseNotMigrated: "the service's database is not migrated for this version of "
                                "pgreserve (its operator must run `pgreserve migrate`); "
                                "nothing was done",
    errors.DatabaseTooNew: "the service's database was migrated by a newer pgreserve than "
                           "this server runs; nothing was done",
}


def public_detail(exc: errors.PgReserveError) -> str:
    """The problem's `detail`: the error's message, unless it is for the operator only."""
    for cls in type(exc).__mro__:
        if cls in OPERATOR_ONLY:
            log.error("%s", exc.message)
            return OPERATOR_ONLY[cls]
    return exc.message


def problem_doc(exc: errors.PgReserveError, **extra: Any) -> dict[str, Any]:
    status, title = status_of(exc)
    doc: dict[str, Any] = {
        "type": f"urn:pgreserve:problem:{exc.code}",
        "title": title,
        "status": status,
        "detail": public_detail(exc),
        "code": exc.code,
    }
    doc.update({k: v for k, v in extra.items() if v is not None})
    return doc


# The ASGI scope key where a problem response leaves its code for the request log.
ERROR_SCOPE_KEY = "pgreserve.error"


class ProblemResponse(Response):
    """A problem document that also names its code on the request's scope (for the log)."""

    def __init__(self, content: bytes, status_code: int, headers: dict[str, str],
                 code: str) -> None:
        super().__init__(content, status_code=status_code, headers=headers,
                         media_type=PROBLEM_MEDIA_TYPE)
        self.code = code

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[ERROR_SCOPE_KEY] = self.code
        await super().__call__(scope, receive, send)


def problem_response(exc: errors.PgReserveError, headers: dict[str, str] | None = None,
                     **extra: Any) -> Response:
    doc = problem_doc(exc, **extra)
    hdrs = dict(headers or {})
    if doc["status"] == 401:
        hdrs.setdefault("WWW-Authenticate", "Bearer")
    if exc.retryable:
        hdrs.setdefault("Retry-After", str(exc.details.get("retry_after_s", 1)))
    return ProblemResponse(render(doc), doc["status"], hdrs, str(doc["code"]))


def error_response(exc: errors.PgReserveError) -> Response:
    """How a typed error raised by a route leaves the API (its exception handler, and the
    hot routes' fast path): its problem document, with the unknown stock it names."""
    return problem_response(exc, unknown_stock=unknown_stock_refs(exc))


def unknown_stock_refs(exc: errors.PgReserveError) -> list[dict[str, str | None]] | None:
    detail = exc.details.get("detail")
    if isinstance(detail, list):
        return [{"sku": str(d["sku"]),
                 "location": None if d["location"] is None else str(d["location"])}
                for d in detail if isinstance(d, dict) and "sku" in d and "location" in d]
    return None


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting problem+json for these statuses."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {
            "description": _DESCRIPTIONS.get(status, "Problem"),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
    return out


_DESCRIPTIONS = {
    400: "Bad request (idempotency_key_missing, idempotency_key_invalid, "
         "precondition_invalid, invalid_cursor)",
    401: "Missing or unknown API key (unauthorized)",
    404: "Not found (unknown_stock, reservation_not_found, webhook_not_found, "
         "request_not_found)",
    409: "Conflict with the current state (insufficient_stock and cart_limit_exceeded are "
         "stored under the key; unsupported_in_rollout_mode: the legacy store answers for "
         "the tenant)",
    412: "Precondition failed (precondition_failed): If-Match or If-None-Match did not "
         "hold; nothing was written",
    413: "Request body too large",
    422: "Invalid request (invalid_request, idempotency_key_reused, webhook_url_refused)",
    423: "Frozen by an operator (bucket_frozen, tenant_frozen); stored under the key",
    429: "Too many requests of this tenant in flight (too_many_requests); retry after "
         "Retry-After seconds, nothing was done",
    503: "busy (not run), outcome_unknown (may have run: retry with the same key) or "
         "database_unavailable; retry after Retry-After seconds. database_not_migrated "
         "or database_too_new: the service's database does not match its version (no "
         "Retry-After; its operator must act)",
}
