"""Value objects of the reservation domain. No database code here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

MAX_LINES = 100
# SKUs (and locations) one availability query may name
MAX_AVAILABILITY_NAMES = 100
MAX_QUANTITY = 1_000_000
# on_hand and a stock delta: exact as JSON numbers, and no sum of them overflows bigint
MAX_ON_HAND = 2**53
MAX_NAME = 200
# a reservation's metadata: at most this many keys, of 1-40 characters, values of 0-500
MAX_METADATA_KEYS = 50
MAX_METADATA_KEY = 40
MAX_METADATA_VALUE = 500
MIN_TTL = timedelta(seconds=1)
MAX_TTL = timedelta(hours=24)
DEFAULT_TTL = timedelta(minutes=15)


class Status(str, enum.Enum):
    ACTIVE = "active"
    CLAIMED = "claimed"
    RELEASED = "released"
    EXPIRED = "expired"


class Strategy(str, enum.Enum):
    ROW = "row"
    POOL = "pool"


@dataclass(frozen=True, order=True)
class Line:
    """One cart line: quantity units of sku at location; in a held reservation,
    `backordered` of them came from the bucket's backorder allowance (not on hand)."""

    sku: str
    location: str
    quantity: int
    backordered: int = 0


@dataclass(frozen=True)
class AllocatedLine:
    """A cart line naming a SKU and no location: the tenant's location priority decides
    where its units come from. Unsplit, all from one location; split, from several."""

    sku: str
    quantity: int
    split: bool = False


@dataclass(frozen=True)
class Reservation:
    id: str
    status: Status
    created_at: datetime
    expires_at: datetime
    lines: tuple[Line, ...]
    claimed_at: datetime | None = None
    released_at: datetime | None = None
    expired_at: datetime | None = None
    replayed: bool = False
    reference: str | None = None  # the shop's cart or order id, given at reserve
    metadata: dict[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def from_json(cls, doc: dict[str, Any], replayed: bool = False) -> Reservation:
        return cls(
            id=str(doc["id"]),
            status=Status(doc["status"]),
            created_at=_ts(doc["created_at"]),
            expires_at=_ts(doc["expires_at"]),
            claimed_at=_ts_opt(doc.get("claimed_at")),
            released_at=_ts_opt(doc.get("released_at")),
            expired_at=_ts_opt(doc.get("expired_at")),
            lines=tuple(Line(x["sku"], x["location"], int(x["quantity"]),
                             int(x.get("backordered", 0))) for x in doc["lines"]),
            replayed=replayed,
            # (documents stored before references existed have neither key)
            reference=None if doc.get("reference") is None else str(doc["reference"]),
            metadata={str(k): str(v) for k, v in (doc.get("metadata") or {}).items()},
        )


@dataclass(frozen=True)
class ShortLine:
    """A line the stock could not serve; location None: an allocated line (available is
    the most one location had for it, or, split, the sum over its locations)."""

    sku: str
    location: str | None
    requested: int
    available: int


@dataclass(frozen=True)
class LimitedLine:
    """A SKU a cart asked more of than its per-cart limit (summed over its lines)."""

    sku: str
    limit: int
    requested: int


@dataclass(frozen=True)
class SkuSettings:
    """What is set for a SKU over all its locations."""

    sku: str
    cart_limit: int | None  # at most this many units of the SKU per reservation
    # the SKU's own location order for allocation (None: the tenant's applies)
    location_priority: tuple[str, ...] | None = None

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SkuSettings:
        limit = doc.get("cart_limit")
        priority = doc.get("location_priority")
        return cls(str(doc["sku"]), None if limit is None else int(limit),
                   None if priority is None else tuple(str(x) for x in priority))


@dataclass(frozen=True)
class ReserveOutcome:
    """What a reserve request came to: held (with the reservation) or rejected.

    `reason` of a rejection: insufficient_stock (see short_lines),
    cart_limit_exceeded (see limited_lines), or bucket_frozen / tenant_frozen (see
    frozen_lines; an operator froze them)."""

    held: bool
    reservation: Reservation | None = None
    short_lines: tuple[ShortLine, ...] = field(default=())
    replayed: bool = False
    reason: str | None = None
    frozen_lines: tuple[StockRef, ...] = field(default=())
    limited_lines: tuple[LimitedLine, ...] = field(default=())

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ReserveOutcome:
        replayed = bool(doc.get("replayed", False))
        if doc["status"] == "held":
            return cls(True, Reservation.from_json(doc["reservation"], replayed), (), replayed)
        short = tuple(
            ShortLine(s["sku"], s["location"], int(s["requested"]), int(s["available"]))
            for s in doc.get("short_lines", ())
        )
        frozen = tuple(StockRef(f["sku"], f["location"]) for f in doc.get("frozen_lines", ()))
        limited = tuple(LimitedLine(x["sku"], int(x["limit"]), int(x["requested"]))
                        for x in doc.get("limited_lines", ()))
        return cls(False, None, short, replayed, str(doc.get("reason", "insufficient_stock")),
                   frozen, limited)

    @property
    def frozen(self) -> bool:
        """Refused because an operator froze the tenant or a bucket of the cart."""
        return self.reason in ("bucket_frozen", "tenant_frozen")

    @property
    def by_rule(self) -> bool:
        """Refused by a rule of the tenant's (a freeze, a per-cart limit), not for stock."""
        return self.frozen or self.reason == "cart_limit_exceeded"


@dataclass(frozen=True)
class StockRef:
    sku: str
    location: str


@dataclass(frozen=True)
class Freeze:
    """An operator's stop on new holds of one bucket (scope "bucket") or a tenant."""

    id: int
    tenant_id: int
    tenant: str
    scope: str
    sku: str | None
    location: str | None
    reason: str
    frozen_by: str
    frozen_at: datetime
    lifted_by: str | None = None
    lifted_at: datetime | None = None
    lift_reason: str | None = None
    already: bool = False

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Freeze:
        return cls(int(doc["id"]), int(doc["tenant_id"]), str(doc["tenant"]), str(doc["scope"]),
                   doc.get("sku"), doc.get("location"), str(doc["reason"]),
                   str(doc["frozen_by"]), _ts(doc["frozen_at"]), doc.get("lifted_by"),
                   _ts_opt(doc.get("lifted_at")), doc.get("lift_reason"),
                   bool(doc.get("already", False)))

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "tenant_id": self.tenant_id, "tenant": self.tenant,
                "scope": self.scope, "sku": self.sku, "location": self.location,
                "reason": self.reason, "frozen_by": self.frozen_by,
                "frozen_at": self.frozen_at.isoformat(), "lifted_by": self.lifted_by,
                "lifted_at": None if self.lifted_at is None else self.lifted_at.isoformat(),
                "lift_reason": self.lift_reason}


@dataclass(frozen=True)
class RequestRecord:
    """The answer stored under a request key, and the reservation it names as it is now."""

    key: str
    operation: str  # reserve | claim | release | extend | adjust
    status: str  # succeeded | rejected (the ledger's)
    outcome: dict[str, Any]  # the stored answer, as first returned
    recorded_at: datetime
    reservation: Reservation | None = None


@dataclass(frozen=True)
class ApiKeyInfo:
    """An API key as `tenant key list` shows it: never the key, only its first characters."""

    prefix: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class StockView:
    sku: str
    location: str
    on_hand: int
    reserved: int
    available: int
    strategy: Strategy
    pool: int
    pool_cap: int
    shortfall: int
    replayed: bool = False
    # What an operator set moves it (counts, adjustments, strategy): the ETag's value.
    # None only in an adjustment's answer stored before versions existed.
    version: int | None = None
    created: bool = False  # this write created the line
    # Units never promised to buyers: `available` leaves them out.
    safety_stock: int = 0
    # Units that may be held beyond on_hand, and those in use: backordered in held
    # lines, and claimed but owed until receipts cover them.
    backorder_limit: int = 0
    backorder_held: int = 0
    backorder_owed: int = 0

    @classmethod
    def from_json(cls, doc: dict[str, Any], replayed: bool = False) -> StockView:
        version = doc.get("version")
        return cls(
            sku=doc["sku"],
            location=doc["location"],
            on_hand=int(doc["on_hand"]),
            reserved=int(doc["reserved"]),
            available=int(doc["available"]),
            strategy=Strategy(doc["strategy"]),
            pool=int(doc["pool"]),
            pool_cap=int(doc["pool_cap"]),
            shortfall=int(doc["shortfall"]),
            replayed=replayed,
            version=None if version is None else int(version),
            created=bool(doc.get("created")),
            # (absent in answers stored before stock policies existed)
            safety_stock=int(doc.get("safety_stock") or 0),
            backorder_limit=int(doc.get("backorder_limit") or 0),
            backorder_held=int(doc.get("backorder_held") or 0),
            backorder_owed=int(doc.get("backorder_owed") or 0),
        )


@dataclass(frozen=True)
class StockPage:
    """One page of a tenant's stock lines in (sku, location) order; `next_cursor` (None on
    the last page) continues after the last of them."""

    stock: tuple[StockView, ...]
    next_cursor: str | None


@dataclass(frozen=True)
class ReservationPage:
    """One page of a tenant's reservations, newest first; `next_cursor` (None on the
    last page) continues after the last of them."""

    reservations: tuple[Reservation, ...]
    next_cursor: str | None


@dataclass(frozen=True)
class Availability:
    """One SKU across its locations, every figure read at one instant."""

    sku: str
    locations: tuple[StockView, ...]  # by location; empty when the SKU has no stock line

    @property
    def known(self) -> bool:
        return bool(self.locations)

    @property
    def on_hand(self) -> int:
        return sum(v.on_hand for v in self.locations)

    @property
    def reserved(self) -> int:
        return sum(v.reserved for v in self.locations)

    @property
    def available(self) -> int:
        return sum(v.available for v in self.locations)


@dataclass(frozen=True)
class Event:
    """One outbox event; (xid, event_id) is its position in commit order."""

    xid: int
    event_id: int
    type: str
    payload: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class EventPage:
    events: tuple[Event, ...]
    cursor: tuple[int, int]  # resume after this position


@dataclass(frozen=True)
class Webhook:
    """A registered endpoint and its delivery state (the secret only when just created)."""

    id: int
    url: str
    created_at: datetime
    delivered: int = 0
    attempts: int = 0  # failed attempts at the next event
    last_error: str | None = None
    last_attempt_at: datetime | None = None
    last_success_at: datetime | None = None
    next_attempt_at: datetime | None = None
    secret: str | None = None


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str


@dataclass(frozen=True)
class Violation:
    tenant_id: int
    sku: str
    location: str
    rule: str
    detail: str


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value)


def _ts_opt(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)
