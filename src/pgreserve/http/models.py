"""Request and response bodies. Strict: unknown fields, bools as numbers, and
strings PostgreSQL cannot store are rejected before the service is called."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    WithJsonSchema,
    model_validator,
)

from .. import validation
from ..domain import (
    MAX_LINES,
    MAX_METADATA_KEY,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE,
    MAX_NAME,
    MAX_QUANTITY,
    Reservation,
    StockView,
    Webhook,
)
from ..validation import URL_PATTERN

MAX_TTL_SECONDS = 24 * 3600
MAX_COUNT = 2**53  # the largest integer every JSON client represents exactly


def storable(value: str) -> str:
    """Text PostgreSQL can store: no NUL, valid UTF-8 (no lone surrogates)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text") from None
    return value


def integer(value: Any) -> int:
    """A JSON integer: 3 or 3.0 (JSON Schema calls both integers), never true, "3" or 3.5."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


# Integers in [ge, le]; bool is an int in Python, the validator keeps it out.
Count = Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(integer)]
Delta = Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT), BeforeValidator(integer)]
Quantity = Annotated[int, Field(ge=1, le=MAX_QUANTITY), BeforeValidator(integer)]
TtlSeconds = Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS), BeforeValidator(integer)]
# The pattern puts "no NUL" into the published schema too (PostgreSQL text
# cannot hold it); storable() also refuses lone surrogates.
Name = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[^\x00]+$"),
                 AfterValidator(storable)]
Reason = Annotated[StrictStr, Field(max_length=MAX_NAME, pattern=r"^[^\x00]*$"),
                   AfterValidator(storable)]


# A location priority: at most 100 names, none twice (the service refuses a repeat).
LocationNames = Annotated[list[Name], Field(max_length=MAX_LINES,
                                            json_schema_extra={"uniqueItems": True})]


METADATA_RULES = (f"at most {MAX_METADATA_KEYS} keys of 1 to {MAX_METADATA_KEY} characters, "
                  f"each value a string of at most {MAX_METADATA_VALUE} characters")
# The rules are validation.metadata's (its message names the one broken); the schema
# publishes them.
Metadata = Annotated[dict[str, Any], AfterValidator(validation.metadata), WithJsonSchema({
    "type": "object", "maxProperties": MAX_METADATA_KEYS,
    "propertyNames": {"minLength": 1, "maxLength": MAX_METADATA_KEY, "pattern": r"^[^\x00]+$"},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE,
                             "pattern": r"^[^\x00]*$"},
})]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- requests --------------------------------------------------------------------

class StockSet(Strict):
    on_hand: Count
    strategy: Literal["row", "pool"] | None = None
    safety_stock: Count | None = Field(
        default=None, description="units of the line never promised to buyers (left out "
                                  "of available); omitted: unchanged (0 for a new line)")
    backorder_limit: Count | None = Field(
        default=None, description="units that may be held beyond on_hand, as backorders; "
                                  "omitted: unchanged (0 for a new line)")


class StockAdjust(Strict):
    delta: Delta
    reason: Reason = ""


class LineIn(Strict):
    sku: Name
    location: Name
    quantity: Quantity


class ReserveLineIn(Strict):
    """A line of a cart to hold: a SKU at a location, or a SKU without one."""

    sku: Name
    location: Name | None = Field(
        default=None, description="absent or null: the tenant's location priority decides "
                                  "where the units come from (at most one such line per SKU)")
    quantity: Quantity
    split: StrictBool = Field(
        default=False, description="only for a line without a location: may take the units "
                                   "from several locations, in priority order (otherwise all "
                                   "from the first location that has them all)")

    @model_validator(mode="after")
    def _split_needs_allocation(self) -> ReserveLineIn:
        if self.split and self.location is not None:
            raise ValueError("split applies only to a line without a location")
        return self


class ReserveIn(Strict):
    """A cart: at most 100 lines, each naming a different (sku, location), or a SKU
    without a location."""

    lines: Annotated[list[ReserveLineIn], Field(min_length=1, max_length=MAX_LINES)]
    ttl_seconds: TtlSeconds = 900
    reference: Name | None = Field(default=None, description=(
        "The shop's cart or order id (1 to 200 characters); list by it with "
        "GET /v1/reservations?cart=..."))
    metadata: Metadata | None = Field(default=None, description=(
        f"Free-form string pairs kept with the reservation: {METADATA_RULES}"))


class ChangeIn(Strict):
    """The whole new cart of a held reservation: at most 100 lines, each naming a
    different (sku, location)."""

    lines: Annotated[list[LineIn], Field(min_length=1, max_length=MAX_LINES)]


class SkuSettingsIn(Strict):
    """The settings to change (at least one); a setting not given stays as it is."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"minProperties": 1})

    cart_limit: Quantity | None = Field(
        default=None,
        description="at most this many units of the SKU in one reservation, over all its "
                    "lines and locations; null: no limit")
    location_priority: LocationNames | None = Field(
        default=None,
        description="the SKU's own location order for lines without a location, in place "
                    "of the tenant's; null: none (the tenant's applies)")

    @model_validator(mode="after")
    def _something(self) -> SkuSettingsIn:
        if not self.model_fields_set:
            raise ValueError("give cart_limit, location_priority or both")
        return self


class SkuSettingsOut(BaseModel):
    sku: str
    cart_limit: int | None
    location_priority: list[str] | None


class LocationPriority(Strict):
    """The tenant's location order for lines without a location. Locations it does not
    name come after the named ones, in name order; an empty list: name order."""

    locations: LocationNames


class ExtendIn(Strict):
    ttl_seconds: TtlSeconds
    allow_shorten: StrictBool = Field(
        default=False, description="allow a time to live that ends the hold sooner than now "
                                   "(otherwise 409 extend_would_shorten)")


class WebhookIn(Strict):
    """An http:// or https:// URL that will receive this tenant's events."""

    url: Annotated[StrictStr, Field(min_length=1, max_length=2000, pattern=URL_PATTERN),
                   AfterValidator(storable)]


# -- responses -------------------------------------------------------------------

class StockOut(BaseModel):
    sku: str
    location: str
    on_hand: int
    reserved: int
    available: int
    strategy: Literal["row", "pool"]
    version: int = Field(1, description=(
        "Moves with every count, adjustment or strategy change, never with holds, claims, "
        "releases or expiry; the ETag is W/\"<version>\""))
    safety_stock: int = Field(0, description="Units never promised to buyers")
    backorder_limit: int = Field(0, description="Units that may be held beyond on_hand")
    backorder_held: int = Field(0, description=(
        "Units of active holds beyond on_hand (backordered), within backorder_limit"))
    backorder_owed: int = Field(0, description=(
        "Backordered units claimed and not yet received; receipts pay them first"))


class StockPageOut(BaseModel):
    stock: list[StockOut]
    next_cursor: str | None = Field(description=(
        "Pass as cursor for the next page; null on the last page"))


class LocationAvailabilityOut(BaseModel):
    location: str
    on_hand: int
    reserved: int
    available: int


class SkuAvailabilityOut(BaseModel):
    sku: str
    known: bool = Field(description="false when the SKU has no stock line (at these locations)")
    on_hand: int
    reserved: int
    available: int = Field(description="the sum over `locations`")
    locations: list[LocationAvailabilityOut]


class AvailabilityOut(BaseModel):
    items: list[SkuAvailabilityOut] = Field(description="one per SKU asked for, in that order")


class LineOut(BaseModel):
    sku: str
    location: str
    quantity: int
    backordered: int = Field(0, description=(
        "Units of the line held beyond on_hand, from the backorder allowance (present only "
        "when there are some)"))


class ReservationOut(BaseModel):
    id: str
    status: Literal["active", "claimed", "released", "expired"]
    created_at: str
    expires_at: str
    claimed_at: str | None
    released_at: str | None
    expired_at: str | None
    lines: list[LineOut]
    reference: str | None = Field(description="given at reserve; null when none was")
    metadata: dict[str, str] = Field(description="given at reserve; {} when none was")


class ReservationPageOut(BaseModel):
    reservations: list[ReservationOut] = Field(description="newest first")
    next_cursor: str | None = Field(description=(
        "Pass as cursor for the next page; null on the last page"))


class EventOut(BaseModel):
    id: int
    type: str
    created_at: str
    data: dict[str, Any]


class EventsOut(BaseModel):
    events: list[EventOut]
    next_cursor: str


class WebhookOut(BaseModel):
    id: int
    url: str
    created_at: str
    delivered: int
    attempts: int
    last_error: str | None
    last_attempt_at: str | None
    last_success_at: str | None
    next_attempt_at: str | None


class WebhookCreated(WebhookOut):
    secret: str


class WebhooksOut(BaseModel):
    webhooks: list[WebhookOut]


class RequestOut(BaseModel):
    key: str
    operation: Literal["reserve", "claim", "release", "extend", "adjust", "change"]
    outcome: Literal["held", "rejected", "applied"]
    recorded_at: str
    status: int = Field(description="The HTTP status the request was answered with")
    answer: dict[str, Any] = Field(
        description="The body it was answered with (a replay returns the same)")
    reservation: ReservationOut | None = Field(
        description="The reservation the answer names, as it is now")


class Health(BaseModel):
    status: Literal["ok"]


def stock_doc(view: StockView) -> dict[str, Any]:
    doc: dict[str, Any] = {"sku": view.sku, "location": view.location,
                           "on_hand": view.on_hand, "reserved": view.reserved,
                           "available": view.available, "strategy": view.strategy.value}
    if view.version is not None:  # absent only in answers stored before versions existed
        doc["version"] = view.version
    doc.update(safety_stock=view.safety_stock, backorder_limit=view.backorder_limit,
               backorder_held=view.backorder_held, backorder_owed=view.backorder_owed)
    return doc


def reservation_doc(r: Reservation) -> dict[str, Any]:
    def ts(value: Any) -> str | None:
        return None if value is None else value.isoformat()

    return {
        "id": r.id,
        "status": r.status.value,
        "created_at": ts(r.created_at),
        "expires_at": ts(r.expires_at),
        "claimed_at": ts(r.claimed_at),
        "released_at": ts(r.released_at),
        "expired_at": ts(r.expired_at),
        "lines": [{"sku": x.sku, "location": x.location, "quantity": x.quantity,
                   **({"backordered": x.backordered} if x.backordered else {})}
                  for x in r.lines],
        "reference": r.reference,
        "metadata": r.metadata,
    }


def webhook_doc(w: Webhook) -> dict[str, Any]:
    def ts(value: Any) -> str | None:
        return None if value is None else value.isoformat()

    doc: dict[str, Any] = {
        "id": w.id, "url": w.url, "created_at": ts(w.created_at), "delivered": w.delivered,
        "attempts": w.attempts, "last_error": w.last_error,
        "last_attempt_at": ts(w.last_attempt_at), "last_success_at": ts(w.last_success_at),
        "next_attempt_at": ts(w.next_attempt_at),
    }
    if w.secret is not None:
        doc["secret"] = w.secret
    return doc
