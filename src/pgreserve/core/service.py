"""The reservation service: the async Python API every other layer calls.

Each operation validates its input in Python, then makes exactly one call to a
server-side function that does the whole transaction (see
sql/functions/). Python never decides whether there is
enough stock; the conditional writes in the database do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from time import perf_counter
from typing import Any, Literal, LiteralString, Protocol, TypeVar, cast

import psycopg
from psycopg import sql as sql_

from .. import apikeys, webhook_targets
from .. import validation as check
from ..db import literals as lit
from ..db.database import Database, Op, typed_error
from ..db.queries import queries
from ..domain import (
    DEFAULT_TTL,
    MAX_ON_HAND,
    MAX_QUANTITY,
    AllocatedLine,
    ApiKeyInfo,
    Availability,
    Event,
    EventPage,
    Freeze,
    Line,
    RequestRecord,
    Reservation,
    ReservationPage,
    ReserveOutcome,
    SkuSettings,
    Status,
    StockPage,
    StockView,
    Strategy,
    Tenant,
    Violation,
    Webhook,
)
from ..errors import (
    ApiKeyNotFound,
    ApiKeyRefused,
    FreezeNotFound,
    InvalidCursor,
    InvalidRequest,
    PreconditionFailed,
    RequestInProgress,
    RequestNotFound,
    ReservationNotFound,
    TenantNameTaken,
    UnknownStock,
    WebhookNotFound,
)
from .batching import BatchConfig, BatchRequest, Combiner

T = TypeVar("T")

Clock = Callable[[], datetime | None]


class Unset:
    """The value of an optional setting that was not given (unlike None, which removes
    it)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset()

SWEEP_BATCH_MAX = 500
WEBHOOK_SECRET_PREFIX = "whsec_"  # noqa: S105 - the public prefix of generated secrets

# Every call site's business process (its connection's application_name is
# pgreserve:<role>) and static statement tag. See docs/operations.md.
OPS: dict[str, Op] = {op.action: op for op in (
    Op("admin", "tenant_create", "cli/tenant"),
    Op("admin", "api_key_create", "cli/tenant/key"),
    Op("admin", "api_key_list", "cli/tenant/key"),
    Op("admin", "api_key_revoke", "cli/tenant/key"),
    Op("admin", "freeze_set", "ops/freeze"),
    Op("admin", "freeze_lift", "ops/freeze"),
    Op("api", "freeze_list", "ops/freeze"),
    Op("api", "request_get", "GET /v1/requests/{key}"),
    Op("api", "authenticate", "auth/bearer"),
    Op("api", "tenant_lookup", "cli/tenant"),
    Op("stock", "stock_set", "PUT /v1/stock/{location}/{sku}"),
    Op("stock", "stock_adjust", "POST /v1/stock/{location}/{sku}/adjustments"),
    Op("api", "stock_get", "GET /v1/stock/{location}/{sku}"),
    Op("stock", "sku_limit_set", "PUT /v1/skus/{sku}"),
    Op("api", "sku_get", "GET /v1/skus/{sku}"),
    Op("stock", "location_priority_set", "PUT /v1/locations/priority"),
    Op("api", "location_priority_get", "GET /v1/locations/priority"),
    Op("api", "stock_list", "GET /v1/stock"),
    Op("api", "availability", "GET /v1/availability"),
    Op("reserve", "reserve", "POST /v1/reservations"),
    Op("claim", "claim", "POST /v1/reservations/{id}/claim"),
    Op("release", "release", "POST /v1/reservations/{id}/release"),
    Op("extend", "extend", "POST /v1/reservations/{id}/extend"),
    Op("reserve", "change", "PUT /v1/reservations/{id}/lines"),
    Op("api", "reservation_get", "GET /v1/reservations/{id}"),
    Op("api", "reservation_list", "GET /v1/reservations"),
    Op("sweeper", "expire_due", "worker/sweeper"),
    Op("replenisher", "refill_candidates", "worker/replenisher"),
    Op("replenisher", "refill", "worker/replenisher"),
    Op("janitor", "purge_request_keys", "worker/janitor"),
    Op("api", "events", "GET /v1/events"),
    Op("api", "webhook_register", "POST /v1/webhooks"),
    Op("api", "webhook_list", "GET /v1/webhooks"),
    Op("api", "webhook_delete", "DELETE /v1/webhooks/{id}"),
    Op("webhooks", "webhook_lease", "worker/webhooks"),
    Op("webhooks", "webhook_events", "worker/webhooks"),
    Op("webhooks", "webhook_advance", "worker/webhooks"),
    Op("webhooks", "webhook_fail", "worker/webhooks"),
    Op("webhooks", "webhook_release", "worker/webhooks"),
    Op("ops", "invariants", "ops/invariants"),
)}


class ServiceObserver(Protocol):
    """What the metrics layer hears from the service (see ops/metrics.py)."""

    def operation(self, action: str, outcome: str, seconds: float) -> None: ...


def _db_clock() -> datetime | None:
    return None  # the database's clock_timestamp()


def digest(operation: str, params: dict[str, Any]) -> str:
    """A stable fingerprint of a request's parameters, stored with its key."""
    canonical = json.dumps({"op": operation, **params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def reserve_digest(cart: Iterable[Line], life: timedelta, reference: str | None = None,
                   metadata: dict[str, str] | None = None) -> str:
    """The fingerprint of a reserve: its sorted cart, time to live, reference and metadata.
    (reference and metadata are named only when given: a key stored before they existed
    still matches the same cart without them)"""
    return digest("reserve", _with_reference({
        "lines": [[line.sku, line.location, line.quantity] for line in cart],
        "ttl_ms": int(life.total_seconds() * 1000),
    }, reference, metadata))


def _with_reference(params: dict[str, Any], reference: str | None,
                    metadata: dict[str, str] | None) -> dict[str, Any]:
    """A reserve's digest parameters with its reference and metadata, each named only
    when given."""
    if reference is not None:
        params["reference"] = reference
    if metadata:
        params["metadata"] = metadata
    return params


DEFAULT_STOCK_PAGE = 100
MAX_STOCK_PAGE = 1000
MAX_STOCK_FILTER = 100
_CURSOR_PREFIX = "s1."

# A stock precondition: a version, several, "*" (the line exists) or None.
IfMatch = int | Iterable[int] | Literal["*"] | None


def _preconditions(if_match: IfMatch) -> tuple[list[int] | None, bool | None]:
    """(versions the line must have one of, whether it must exist) for the SQL function."""
    if if_match is None:
        return None, None
    if isinstance(if_match, str):
        if if_match != "*":
            raise InvalidRequest('if_match must be a version, versions or "*"',
                                 field="if_match")
        return None, True
    if isinstance(if_match, int):
        values: list[Any] = [if_match]
    elif isinstance(if_match, Iterable) and not isinstance(if_match, (bytes, bytearray)):
        values = list(if_match)
    else:
        raise InvalidRequest('if_match must be a version, versions or "*"', field="if_match")
    return [check.integer(v, "if_match", 1, 2**63 - 1) for v in values], True


def _name_taken(name: str) -> TenantNameTaken:
    return TenantNameTaken(f"tenant {name!r} already exists; nothing was created",
                           name=name)


def _raise_if_precondition_failed(doc: dict[str, Any], sku: str, location: str) -> None:
    if not doc.get("precondition_failed"):
        return
    version = doc.get("version")
    where = f"stock {sku!r} at {location!r}"
    raise PreconditionFailed(f"{where} does not exist" if version is None
                             else f"{where} is at version {version}; the condition did not hold",
                             version=version)


def stock_cursor(sku: str, location: str) -> str:
    """The opaque cursor that continues a stock listing after (sku, location)."""
    raw = json.dumps([sku, location], ensure_ascii=False, separators=(",", ":")).encode()
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def stock_cursor_position(cursor: str) -> tuple[str, str]:
    """The (sku, location) a stock cursor continues after; InvalidCursor if it is not one
    that stock_cursor made."""
    bad = InvalidCursor("cursor must be a next_cursor returned by the stock listing",
                        field="cursor")
    if not isinstance(cursor, str) or not cursor.startswith(_CURSOR_PREFIX):
        raise bad
    body = cursor[len(_CURSOR_PREFIX):]
    try:
        doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode())
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise bad from None
    # only what stock_cursor makes, byte for byte (no other padding, spacing or escapes)
    if (not isinstance(doc, list) or len(doc) != 2
            or not all(isinstance(x, str) for x in doc) or stock_cursor(*doc) != cursor):
        raise bad
    try:
        return check.name(doc[0], "sku"), check.name(doc[1], "location")
    except InvalidRequest:
        raise bad from None


DEFAULT_RESERVATION_PAGE = 50
MAX_RESERVATION_PAGE = 200
_RESERVATION_CURSOR_PREFIX = "r1."
# PostgreSQL takes time-zone offsets below 16 hours only (Python's go to 24)
_MOST_OFFSET = timedelta(hours=16)
# before every reservation: the first page's position (newest first)
_NEWEST = (datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
           uuid.UUID("ffffffff-ffff-ffff-ffff-ffffffffffff"))


def reservation_cursor(created_at: datetime, reservation_id: str | uuid.UUID) -> str:
    """The opaque cursor that continues a reservation listing after this reservation."""
    raw = json.dumps([created_at.isoformat(), str(reservation_id)],
                     separators=(",", ":")).encode()
    return _RESERVATION_CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def reservation_cursor_position(cursor: Any) -> tuple[datetime, uuid.UUID]:
    """The (created_at, id) a reservation cursor continues after; InvalidCursor if it is
    not one that reservation_cursor made."""
    bad = InvalidCursor("cursor must be a next_cursor returned by the reservation listing",
                        field="cursor")
    if not isinstance(cursor, str) or not cursor.startswith(_RESERVATION_CURSOR_PREFIX):
        raise bad
    body = cursor[len(_RESERVATION_CURSOR_PREFIX):]
    try:
        doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode())
        if (not isinstance(doc, list) or len(doc) != 2
                or not all(isinstance(x, str) for x in doc)):
            raise bad
        created_at, rid = datetime.fromisoformat(doc[0]), uuid.UUID(doc[1])
        # only what reservation_cursor makes, byte for byte; then as UTC (the database
        # takes offsets up to 15:59 only, Python's up to 23:59)
        offset = created_at.utcoffset()
        if (offset is None or abs(offset) >= _MOST_OFFSET
                or reservation_cursor(created_at, rid) != cursor):
            raise bad
        return created_at.astimezone(UTC), rid
    except (ValueError, binascii.Error, UnicodeDecodeError, RecursionError, OverflowError):
        raise bad from None


def reservation_statuses(values: Any) -> list[str] | None:
    """The statuses a listing is narrowed to (None: every status), each one of
    active, claimed, released or expired; repeats dropped."""
    if values is None:
        return None
    if isinstance(values, (str, Status)):
        values = [values]
    if not isinstance(values, Iterable):
        raise InvalidRequest("status must be a list of statuses", field="status")
    wanted: list[str] = []
    for value in values:
        try:
            status = Status(value).value
        except ValueError:
            raise InvalidRequest(
                f"status must be one of {', '.join(s.value for s in Status)}, not {value!r}",
                field="status") from None
        if status not in wanted:
            wanted.append(status)
    if not wanted:
        raise InvalidRequest("name at least one status, or none to list every status",
                             field="status")
    return sorted(wanted)


def parse_reservation_id(value: Any) -> uuid.UUID:
    """A reservation id in any spelling uuid.UUID reads (upper case, braces, no dashes,
    a urn:uuid: prefix); ReservationNotFound for anything else."""
    try:
        return uuid.UUID(str(value))
    except ValueError:
        # A malformed id is answered like any id the tenant does not have.
        raise ReservationNotFound(f"unknown reservation {value!r}") from None


class ReservationService:
    """Stock, holds and their lifecycle for every tenant of one database."""

    def __init__(self, db: Database, *, clock: Clock = _db_clock,
                 observer: ServiceObserver | None = None, batching: bool = True,
                 batch_config: BatchConfig | None = None,
                 allow_private_webhooks: bool | None = None) -> None:
        """`batching`: one-line reserves, and claims and releases of one-line
        reservations, go through a per-bucket combiner (group commit, see
        core/batching.py); off, every request is its own transaction.
        `allow_private_webhooks`: accept webhook URLs on loopback, private and
        other non-public addresses (default: PGRESERVE_WEBHOOK_ALLOW_PRIVATE,
        see webhook_targets.py)."""
        self.db = db
        self.allow_private_webhooks = (webhook_targets.allow_private_default()
                                       if allow_private_webhooks is None
                                       else bool(allow_private_webhooks))
        self.clock = clock
        self.observer = observer
        self.combiner = Combiner(db, batch_config, clock=clock) if batching else None
        # Buckets are never deleted and their ids never change: cache the lookups
        # (at most 100,000; the oldest entry goes first, and is looked up again if needed).
        self._bucket_ids: OrderedDict[tuple[int, str, str], int] = OrderedDict()
        # The bucket of the one-line reservations this process created (most recent).
        self._reservation_buckets: OrderedDict[tuple[int, uuid.UUID], int] = OrderedDict()
        self._qualified: dict[str, LiteralString] = {}

    def _observe(self, action: str, outcome: str, started: float) -> None:
        if self.observer is not None:
            self.observer.operation(action, outcome, perf_counter() - started)

    # -- tenants -------------------------------------------------------------

    async def create_tenant(self, name: str) -> Tenant:
        """A new tenant; TenantNameTaken when another has the name."""
        name = check.name(name, "tenant name")
        try:
            row = await self.db.call(
                queries["tenant_create"], (name,),
                op=OPS["tenant_create"], replay_safe=False)
        except psycopg.errors.UniqueViolation:
            raise _name_taken(name) from None
        return Tenant(int(row), name)

    async def create_tenant_with_key(self, name: str) -> tuple[Tenant, str]:
        """Create a tenant and its first API key; return both (the key is shown only once)."""
        name = check.name(name, "tenant name")
        key = apikeys.new_key()
        try:
            row = await self.db.call(queries["tenant_create_with_key"],
                                     (name, apikeys.hash_key(key), apikeys.shown_prefix(key)),
                                     op=OPS["tenant_create"], replay_safe=False)
        except psycopg.errors.UniqueViolation:
            raise _name_taken(name) from None
        return Tenant(int(row), name), key

    async def create_api_key(self, tenant: int) -> str:
        """Issue another API key for an existing tenant (a tenant may have several)."""
        tenant = check.tenant_id(tenant)
        await self._require_tenant(tenant)
        key = apikeys.new_key()
        await self.db.call(queries["api_key_create_with_prefix"],
                           (tenant, apikeys.hash_key(key), apikeys.shown_prefix(key)),
                           op=OPS["api_key_create"], replay_safe=False)
        return key

    async def api_keys(self, tenant: int) -> list[ApiKeyInfo]:
        """A tenant's API keys, newest first: prefix, created and revoked times only."""
        tenant = check.tenant_id(tenant)
        await self._require_tenant(tenant)
        rows = await self.db.fetch(queries["api_key_list"], (tenant,), op=OPS["api_key_list"])
        return [ApiKeyInfo(str(r[0]), r[1], r[2]) for r in rows]

    async def revoke_api_key(self, tenant: int, prefix: str) -> str:
        """Revoke the tenant's unrevoked key shown with `prefix` (as `api_keys` lists it).

        The API refuses it from its next request on (http/dependencies.py)."""
        tenant = check.tenant_id(tenant)
        prefix = check.name(prefix, "prefix")
        revoked = await self.db.call(queries["api_key_revoke"], (tenant, prefix),
                                     op=OPS["api_key_revoke"], replay_safe=False)
        if revoked is None:
            await self._require_tenant(tenant)
            raise ApiKeyNotFound(f"no unrevoked API key shown as {prefix!r}")
        return str(revoked)

    async def tenant_for_api_key(self, key: str) -> int | None:
        """The tenant an unrevoked API key belongs to, or None."""
        if not isinstance(key, str):
            raise InvalidRequest("an API key must be a string", field="api_key")
        if not apikeys.plausible(key):
            return None
        digest = apikeys.hash_key(key)
        return (await self.tenants_for_api_key_hashes([digest])).get(digest)

    async def tenants_for_api_key_hashes(self, hashes: Sequence[bytes]) -> dict[bytes, int]:
        """The tenants of the unrevoked API keys among these hashes (apikeys.hash_key), in
        one read; a hash that names no such key is left out."""
        if isinstance(hashes, (bytes, bytearray, str)) or not isinstance(hashes, Iterable):
            raise InvalidRequest("hashes must be a list of bytes", field="hashes")
        wanted = [bytes(h) if isinstance(h, bytearray) else h for h in hashes]
        if not all(isinstance(h, bytes) for h in wanted):
            raise InvalidRequest("hashes must be a list of bytes", field="hashes")
        rows = await self.db.fetch(queries["api_key_authenticate_many"], (wanted,),
                                   op=OPS["authenticate"])
        return {bytes(digest): int(tenant) for digest, tenant in rows}

    async def _check_api_key(self, tenant: int, api_key_hash: bytes | None) -> None:
        """ApiKeyRefused unless the key of this hash is an active key of `tenant` (None:
        nothing to check)."""
        if api_key_hash is None:
            return
        found = await self.tenants_for_api_key_hashes([api_key_hash])
        if found.get(api_key_hash) != tenant:
            raise ApiKeyRefused()

    async def tenant_by_name(self, name: str) -> Tenant | None:
        """The tenant of this name, None when there is none; a name no tenant can have
        (empty, too long, NUL, not Unicode text) is InvalidRequest."""
        name = check.name(name, "tenant name")
        rows = await self.db.fetch(queries["tenant_find_by_name"], (name,),
                                   op=OPS["tenant_lookup"])
        return Tenant(int(rows[0][0]), name) if rows else None

    async def tenants(self) -> list[tuple[Tenant, datetime]]:
        """Every tenant with its creation time, oldest first (an admin's list)."""
        rows = await self.db.fetch(queries["tenant_list"], (), op=OPS["tenant_lookup"])
        return [(Tenant(int(r[0]), str(r[1])), r[2]) for r in rows]

    # -- stock ---------------------------------------------------------------

    async def set_stock(self, tenant: int, sku: str, location: str, on_hand: int, *,
                        strategy: Strategy | str | None = None, pool_cap: int | None = None,
                        force: bool = False, if_match: IfMatch = None,
                        create_only: bool = False, safety_stock: int | None = None,
                        backorder_limit: int | None = None) -> StockView:
        """Set a bucket's count (creating it), optionally switching its strategy live.

        `safety_stock`: units of the line never promised to buyers; `backorder_limit`:
        units that may be held beyond on_hand (None keeps either as it is; a new line
        starts with 0). Both are written with the count and move the version.
        `if_match`: a version (or several) the line must have, or "*" (it must exist);
        `create_only`: the line must not exist yet. The database checks them in the
        write itself; when one does not hold, PreconditionFailed and nothing is written.
        The answer's `created` says whether this call created the line."""
        tenant = check.tenant_id(tenant)
        sku, location = check.name(sku, "sku"), check.name(location, "location")
        on_hand = check.integer(on_hand, "on_hand", 0, MAX_ON_HAND)
        chosen = check.strategy(strategy)
        if pool_cap is not None:
            pool_cap = check.integer(pool_cap, "pool_cap", 1, 100_000)
        if safety_stock is not None:
            safety_stock = check.integer(safety_stock, "safety_stock", 0, MAX_ON_HAND)
        if backorder_limit is not None:
            backorder_limit = check.integer(backorder_limit, "backorder_limit", 0, MAX_ON_HAND)
        force = check.flag(force, "force")
        create_only = check.flag(create_only, "create_only")
        versions, exists = _preconditions(if_match)
        if create_only:
            if if_match is not None:
                raise InvalidRequest("if_match and create_only exclude each other",
                                     field="create_only")
            exists = False
        doc = await self.db.call(
            queries["stock_set"],
            (tenant, sku, location, on_hand, chosen.value if chosen else None, force,
             pool_cap, versions, exists, safety_stock, backorder_limit, self.clock()),
            op=OPS["stock_set"],
            # not run again after a lost reply: the second run would say the line was
            # not created by it, write a second stock.changed event, or be refused
            # (412: the version moved, or the line exists now)
            replay_safe=False,
        )
        _raise_if_precondition_failed(doc, sku, location)
        return StockView.from_json(doc)

    async def set_cart_limit(self, tenant: int, sku: str, limit: int | None) -> SkuSettings:
        """At most `limit` units of `sku` (over all its lines and locations) in one
        reservation, for its buckets now and later; None removes the limit. A cart over it
        is refused (reason cart_limit_exceeded, stored under its key) and takes nothing."""
        return await self.update_sku(tenant, sku, cart_limit=limit)

    async def sku_settings(self, tenant: int, sku: str) -> SkuSettings:
        """What is set for a SKU (a SKU never set: no limit)."""
        tenant = check.tenant_id(tenant)
        sku = check.name(sku, "sku")
        rows = await self.db.fetch(queries["sku_settings"], (tenant, sku), op=OPS["sku_get"])
        return SkuSettings.from_json(rows[0][0])

    async def adjust_stock(self, tenant: int, request_key: str, sku: str, location: str,
                           delta: int, *, reason: str = "", force: bool = False,
                           if_match: IfMatch = None) -> StockView:
        """Receipt (delta > 0) or correction (delta < 0), applied once per request key.

        `if_match` as for set_stock ("*" adds nothing: the line must exist anyway); a
        replay of the key returns the stored answer whatever the version is now, and a
        failed precondition stores nothing under the key."""
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        sku, location = check.name(sku, "sku"), check.name(location, "location")
        delta = check.integer(delta, "delta", -MAX_ON_HAND, MAX_ON_HAND)
        reason = check.text(reason, "reason", 1000)
        force = check.flag(force, "force")
        versions, _ = _preconditions(if_match)
        fingerprint = digest("adjust", {"sku": sku, "location": location, "delta": delta,
                                        "reason": reason, "force": force})
        doc = await self.db.call(
            queries["stock_adjust"],
            (tenant, key, fingerprint, sku, location, delta, reason, force, versions,
             self.clock()),
            op=OPS["stock_adjust"],
        )
        _raise_if_precondition_failed(doc, sku, location)
        return StockView.from_json(doc["stock"], replayed=bool(doc.get("replayed")))

    async def list_stock(self, tenant: int, *, sku_prefix: str | None = None,
                         skus: Iterable[str] | None = None, location: str | None = None,
                         limit: int = DEFAULT_STOCK_PAGE, after: str | None = None) -> StockPage:
        """A page of the tenant's stock lines in (sku, location) order (code-point order),
        narrowed by an SKU prefix, a list of SKUs and a location.

        `after` is the `next_cursor` of the previous page: a keyset position, so lines
        created or changed meanwhile never make a line appear twice or be skipped (a line
        created behind the cursor shows up on no later page)."""
        tenant = check.tenant_id(tenant)
        limit = check.integer(limit, "limit", 1, MAX_STOCK_PAGE)
        prefix = None if sku_prefix is None else check.name(sku_prefix, "sku_prefix")
        sku_list = None
        if skus is not None:
            if isinstance(skus, str) or not isinstance(skus, Iterable):
                raise InvalidRequest("skus must be a list of SKUs", field="skus")
            sku_list = sorted({check.name(x, "sku") for x in skus})
            if not 1 <= len(sku_list) <= MAX_STOCK_FILTER:
                raise InvalidRequest(f"give 1 to {MAX_STOCK_FILTER} SKUs", field="skus")
        loc = None if location is None else check.name(location, "location")
        start = ("", "") if after is None else stock_cursor_position(after)
        if prefix is not None and start < (prefix, ""):
            start = (prefix, "")  # the prefix's lines all sort at or after it
        rows = await self.db.fetch(
            queries["stock_list"],
            {"now": self.clock(), "tenant": tenant, "after_sku": start[0],
             "after_location": start[1], "prefix": prefix, "skus": sku_list,
             "location": loc, "limit": limit + 1},
            op=OPS["stock_list"],
        )
        if not rows:
            await self._require_tenant(tenant)
        views = tuple(StockView.from_json(r[0]) for r in rows[:limit])
        more = len(rows) > limit
        return StockPage(views, stock_cursor(views[-1].sku, views[-1].location)
                         if more else None)

    async def get_stock(self, tenant: int, sku: str, location: str) -> StockView:
        tenant = check.tenant_id(tenant)
        sku, location = check.name(sku, "sku"), check.name(location, "location")
        rows = await self.db.fetch(
            queries["bucket_view"],
            (self.clock(), tenant, sku, location), op=OPS["stock_get"],
        )
        if not rows:
            await self._require_tenant(tenant)
            raise UnknownStock(f"unknown stock {sku!r} at {location!r}",
                               detail=[{"sku": sku, "location": location}])
        return StockView.from_json(rows[0][0])

    async def availability(self, tenant: int, skus: Iterable[str],
                           locations: Iterable[str] | None = None) -> list[Availability]:
        """Each SKU's stock per location and in total, all read in one snapshot.

        One entry per SKU asked for (repeats dropped), in the order asked; a SKU
        without a stock line comes back with no locations (`known` False).
        `locations` narrows the answer to those locations. At most
        MAX_AVAILABILITY_NAMES SKUs and as many locations per call.
        """
        tenant = check.tenant_id(tenant)
        wanted = check.names(skus, "sku")
        where = None if locations is None else check.names(locations, "location")
        rows = await self.db.fetch(
            queries["availability_list"],
            (self.clock(), tenant, lit.text_array(wanted), None if where is None
             else lit.text_array(where), None if where is None else lit.text_array(where)),
            op=OPS["availability"],
        )
        if not rows:
            await self._require_tenant(tenant)
        found: dict[str, list[StockView]] = {sku: [] for sku in wanted}
        for (doc,) in rows:
            view = StockView.from_json(doc)
            found[view.sku].append(view)
        return [Availability(sku, tuple(views)) for sku, views in found.items()]

    # -- reservations --------------------------------------------------------

    async def reserve(self, tenant: int, request_key: str, lines: Iterable[Any], *,
                      ttl: timedelta | float = DEFAULT_TTL,
                      conn: psycopg.AsyncConnection[Any] | None = None,
                      reference: str | None = None,
                      metadata: dict[str, str] | None = None,
                      api_key_hash: bytes | None = None) -> ReserveOutcome:
        """Hold every line of a cart, or none of them.

        The outcome (held or rejected) is stored under the request key: the
        same key with the same cart returns it again without taking stock; the
        same key with another cart (or another reference or metadata) raises
        IdempotencyKeyReused.

        `reference` (the shop's cart or order id) and `metadata` (string pairs, see
        validation.metadata) are kept on the reservation; absent, the reservation
        shows reference None and metadata {}.

        `conn`: run it on this connection, inside its open transaction (see
        `_call`): the hold commits or rolls back with the caller's own writes.

        `api_key_hash` (apikeys.hash_key of the key the caller presented): refuse
        the request with ApiKeyRefused, doing nothing, unless that key is an active
        key of `tenant` when the request runs. A batched reserve checks it in its
        batch's own transaction (no read of its own); any other first reads it.
        """
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        lines = check.line_list(lines)
        checked = check.api_key_hash(api_key_hash)
        if check.allocates(lines):
            await self._check_api_key(tenant, checked)
            return await self._reserve_allocated(tenant, key, lines, ttl, conn, reference,
                                                 metadata)
        cart = check.cart(lines)  # sorted by (sku, location): the lock order
        life = check.ttl(ttl)
        ref, meta = check.reference(reference), check.metadata(metadata)
        fingerprint = reserve_digest(cart, life, ref, meta)
        started = perf_counter()

        async def alone() -> ReserveOutcome:
            await self._check_api_key(tenant, checked)  # not decided in a batch: read it
            return await self._reserve_call(
                queries["reservation_reserve"], queries["reservation_reserve_in"],
                (tenant, key, fingerprint, lit.text_array(x.sku for x in cart),
                 lit.text_array(x.location for x in cart),
                 lit.int_array(x.quantity for x in cart), lit.interval(life), self.clock(),
                 ref, json.dumps(meta) if meta else None),
                conn, started)

        if conn is None and self.combiner is not None and len(cart) == 1:
            outcome = await self._reserve_batched(tenant, key, fingerprint, cart[0], life,
                                                  started, alone, ref, meta, checked)
            if outcome is not None:
                return outcome
        return await alone()

    async def _reserve_call(self, sql: LiteralString, sql_in: LiteralString,
                            params: tuple[Any, ...],
                            conn: psycopg.AsyncConnection[Any] | None,
                            started: float, op: Op = OPS["reserve"]) -> ReserveOutcome:
        """One unbatched call whose answer is a reserve's outcome (a reserve, or a cart
        change with `op`; see `_call`), observed under `op`'s action."""
        try:
            doc = await self._call(sql, sql_in, params, op, conn)
        except Exception as exc:
            self._observe(op.action, _failure(exc), started)
            raise
        outcome = ReserveOutcome.from_json(doc)
        self._observe(op.action, "idempotent_replay" if outcome.replayed
                      else _reserve_label(outcome), started)
        return outcome

    async def _reserve_allocated(self, tenant: int, key: str, lines: list[Any],
                                 ttl: timedelta | float,
                                 conn: psycopg.AsyncConnection[Any] | None,
                                 reference: str | None,
                                 metadata: dict[str, str] | None) -> ReserveOutcome:
        """A cart with lines that name no location (see `reserve` and docs/api.md,
        "Allocation across locations"): never batched; one call to reserve_allocated_v1."""
        explicit, allocated = check.allocated_cart(lines)
        life = check.ttl(ttl)
        ref, meta = check.reference(reference), check.metadata(metadata)
        fingerprint = digest("reserve", _with_reference({
            "lines": [[line.sku, line.location, line.quantity] for line in explicit],
            "allocate": [[line.sku, line.quantity, line.split] for line in allocated],
            "ttl_ms": int(life.total_seconds() * 1000),
        }, ref, meta))
        return await self._reserve_call(
            queries["reservation_reserve_allocated"],
            queries["reservation_reserve_allocated_in"],
            (tenant, key, fingerprint, [x.sku for x in explicit],
             [x.location for x in explicit], [x.quantity for x in explicit],
             [x.sku for x in allocated], [x.quantity for x in allocated],
             [x.split for x in allocated], life, self.clock(), ref,
             json.dumps(meta) if meta else None),
            conn, perf_counter())

    async def set_location_priority(self, tenant: int,
                                    locations: Iterable[str]) -> tuple[str, ...]:
        """The tenant's location order for lines that name no location (an empty list:
        name order). A SKU's own order (`update_sku`) replaces it for that SKU; locations
        an order does not name come after the named ones, in name order."""
        tenant = check.tenant_id(tenant)
        order = check.locations(locations)
        doc = await self.db.call(queries["location_priority_set"], (tenant, order),
                                 op=OPS["location_priority_set"])
        return tuple(str(x) for x in doc["locations"])

    async def location_priority(self, tenant: int) -> tuple[str, ...]:
        """The tenant's location order (empty when never set)."""
        tenant = check.tenant_id(tenant)
        rows = await self.db.fetch(queries["location_priority_get"], (tenant,),
                                   op=OPS["location_priority_get"])
        return tuple(str(x) for x in rows[0][0]["locations"])

    async def update_sku(self, tenant: int, sku: str, *,
                         cart_limit: int | Unset | None = UNSET,
                         location_priority: Iterable[str] | Unset | None = UNSET,
                         ) -> SkuSettings:
        """Set what is given of a SKU's settings, in one transaction: its per-cart limit
        (None removes it, see `set_cart_limit`) and its own location order (None removes
        it: the tenant's applies again). Everything is checked before anything is
        written."""
        tenant = check.tenant_id(tenant)
        sku = check.name(sku, "sku")
        limit: int | None = None
        if not isinstance(cart_limit, Unset) and cart_limit is not None:
            limit = check.integer(cart_limit, "cart_limit", 1, MAX_QUANTITY)
        order: list[str] | None = None
        if not isinstance(location_priority, Unset) and location_priority is not None:
            order = check.locations(location_priority, "location_priority")
        doc = await self.db.call(
            queries["sku_update"],
            (tenant, sku, not isinstance(cart_limit, Unset), limit,
             not isinstance(location_priority, Unset), order),
            op=OPS["sku_limit_set"])
        return SkuSettings.from_json(doc)

    async def claim(self, tenant: int, reservation_id: str | uuid.UUID, *,
                    request_key: str | None = None,
                    conn: psycopg.AsyncConnection[Any] | None = None,
                    api_key_hash: bytes | None = None) -> Reservation:
        """Payment succeeded: deduct the held units for good. Repeating it changes nothing.

        `conn`: run it on this connection, inside its open transaction (see `_call`).
        `api_key_hash`: as for `reserve`, the key is checked where the claim runs."""
        return await self._transition("claim", queries["reservation_claim"],
                                      queries["reservation_claim_in"], tenant, reservation_id,
                                      request_key, conn, api_key_hash)

    async def release(self, tenant: int, reservation_id: str | uuid.UUID, *,
                      request_key: str | None = None,
                      conn: psycopg.AsyncConnection[Any] | None = None,
                      api_key_hash: bytes | None = None) -> Reservation:
        """Payment failed: give the units back, once. Repeating it changes nothing.

        `conn`: run it on this connection, inside its open transaction (see `_call`).
        `api_key_hash`: as for `reserve`, the key is checked where the release runs."""
        return await self._transition("release", queries["reservation_release"],
                                      queries["reservation_release_in"], tenant, reservation_id,
                                      request_key, conn, api_key_hash)

    async def extend(self, tenant: int, reservation_id: str | uuid.UUID,
                     ttl: timedelta | float, *, request_key: str | None = None,
                     allow_shorten: bool = False) -> Reservation:
        """Give an active reservation a new time to live, counted from now.

        A time to live that would end the hold sooner than it ends now raises
        ExtendWouldShorten (nothing changes) unless `allow_shorten`. With a
        request key the first answer is stored and replayed for the same key,
        so a retried extend does not push the expiry again.
        """
        shorten = check.flag(allow_shorten, "allow_shorten")
        if request_key is not None:
            return await self._keyed(tenant, request_key, "extend", reservation_id, ttl,
                                     shorten)
        tenant = check.tenant_id(tenant)
        rid = parse_reservation_id(reservation_id)
        life = check.ttl(ttl)
        started = perf_counter()
        try:
            doc = await self.db.call(queries["reservation_extend"],
                                     (tenant, rid, life, shorten, self.clock()),
                                     op=OPS["extend"])
        except Exception as exc:
            self._observe("extend", _failure(exc), started)
            raise
        self._observe("extend", "ok", started)
        return Reservation.from_json(doc)

    async def change(self, tenant: int, reservation_id: str | uuid.UUID,
                     lines: Iterable[Any], *, request_key: str,
                     conn: psycopg.AsyncConnection[Any] | None = None) -> ReserveOutcome:
        """Make an active reservation hold exactly `lines` (the whole new cart), or change
        nothing.

        A line whose quantity is the same keeps its units untouched; a raised line takes
        only the difference, a lowered one gives back only the difference, a line left
        out is given back and a new line is taken. When a line that takes cannot be
        served (or the new cart is over a per-cart limit, or what it takes is frozen)
        nothing changes and the outcome is rejected, with its short lines, like a
        reserve's. Either outcome is stored under the request key and replayed for the
        same key and cart; the same key with another cart raises IdempotencyKeyReused.
        The expiry stays as it is. A reservation that is not active raises
        ReservationClaimed, ReservationReleased or ReservationNotActive (expired); an
        empty cart raises InvalidRequest (release the reservation instead).

        `conn`: run it on this connection, inside its open transaction (see `_call`).
        """
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        rid = parse_reservation_id(reservation_id)
        cart = check.cart(lines)  # sorted by (sku, location)
        fingerprint = digest("change", {
            "id": str(rid),
            "lines": [[line.sku, line.location, line.quantity] for line in cart],
        })
        outcome = await self._reserve_call(
            queries["reservation_change"], queries["reservation_change_in"],
            (tenant, key, fingerprint, rid, lit.text_array(x.sku for x in cart),
             lit.text_array(x.location for x in cart),
             lit.int_array(x.quantity for x in cart), self.clock()),
            conn, perf_counter(), OPS["change"])
        # The cart may have moved to other buckets, or to several: the next claim or
        # release looks its buckets up again (bucket_batch_v1 checks them anyway).
        self._reservation_buckets.pop((tenant, rid), None)
        return outcome

    async def _keyed(self, tenant: int, request_key: str, operation: str,
                     reservation_id: str | uuid.UUID, ttl: timedelta | float | None,
                     shorten: bool = False, *,
                     conn: psycopg.AsyncConnection[Any] | None = None) -> Reservation:
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        rid = parse_reservation_id(reservation_id)
        life = check.ttl(ttl) if ttl is not None else None
        params: dict[str, Any] = {"id": str(rid)}
        if life is not None:
            params["ttl_ms"] = int(life.total_seconds() * 1000)
        if shorten:  # (absent when false: keys stored before the flag existed still match)
            params["shorten"] = True
        started = perf_counter()
        try:
            doc = await self._call(
                queries["reservation_transition_keyed"],
                queries["reservation_transition_keyed_in"],
                (tenant, key, operation, digest(operation, params), rid, life, shorten,
                 self.clock()),
                OPS[operation], conn)
        except Exception as exc:
            self._observe(operation, _failure(exc), started)
            raise
        replayed = bool(doc.get("replayed"))
        self._observe(operation, "idempotent_replay" if replayed else "ok", started)
        return Reservation.from_json(doc["reservation"], replayed=replayed)

    async def get_reservation(self, tenant: int, reservation_id: str | uuid.UUID) -> Reservation:
        tenant = check.tenant_id(tenant)
        rid = parse_reservation_id(reservation_id)
        rows = await self.db.fetch(
            queries["reservation_view"],
            (tenant, rid, self.clock()), op=OPS["reservation_get"],
        )
        if not rows or rows[0][0] is None:
            await self._require_tenant(tenant)
            raise ReservationNotFound(f"unknown reservation {rid}")
        return Reservation.from_json(rows[0][0])

    async def list_reservations(self, tenant: int, *, reference: str | None = None,
                                status: Iterable[str] | str | None = None,
                                limit: int = DEFAULT_RESERVATION_PAGE,
                                after: str | None = None) -> ReservationPage:
        """A page of the tenant's reservations, newest first (by creation, then id),
        narrowed to one reference (cart or order id) and to statuses as the documents
        show them (`expired` includes an active hold past its expiry).

        `after` is the `next_cursor` of the previous page: a keyset position, so
        reservations created meanwhile never make one appear twice or be skipped (they
        are newer than the cursor and show on no later page)."""
        tenant = check.tenant_id(tenant)
        ref = check.reference(reference)
        statuses = reservation_statuses(status)
        limit = check.integer(limit, "limit", 1, MAX_RESERVATION_PAGE)
        before = _NEWEST if after is None else reservation_cursor_position(after)
        params = {"now": self.clock(), "tenant": tenant, "reference": ref,
                  "before_created": before[0], "before_id": before[1],
                  "statuses": statuses, "limit": limit + 1}
        sql = (queries["reservation_list"] if ref is None
               else queries["reservation_list_by_reference"])
        rows = await self.db.fetch(sql, params, op=OPS["reservation_list"])
        if not rows:
            await self._require_tenant(tenant)
        found = tuple(Reservation.from_json(r[2]) for r in rows[:limit])
        more = len(rows) > limit
        return ReservationPage(found, reservation_cursor(rows[limit - 1][0], rows[limit - 1][1])
                               if more else None)

    async def lookup_request(self, tenant: int, request_key: str) -> RequestRecord:
        """The answer stored under a request key (reserve, or keyed claim, release, extend
        or adjustment) and, when it names a reservation, that reservation as it is now.

        Raises RequestNotFound for a key this tenant never used (or that the janitor
        has forgotten), and RequestInProgress while a request under the key runs and has
        no answer yet (it may still commit one: retry shortly)."""
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        rows = await self.db.fetch(queries["request_view"], (self.clock(), tenant, key),
                                   op=OPS["request_get"], read_committed=True)
        if not rows:
            await self._require_tenant(tenant)
            raise RequestNotFound(f"no request under key {key!r}")
        operation, status, outcome, created_at, view, in_progress = rows[0]
        if in_progress:
            await self._require_tenant(tenant)
            raise RequestInProgress(
                f"a request under key {key!r} is running and has no answer yet; "
                "look it up again shortly")
        return RequestRecord(key, str(operation), str(status), outcome, created_at,
                             None if view is None else Reservation.from_json(view))

    # -- freezes -------------------------------------------------------------------

    async def freeze(self, tenant: int, reason: str, by: str, *, sku: str | None = None,
                     location: str | None = None) -> Freeze:
        """Stop new holds of one bucket (sku and location) or of the whole tenant.

        Claims, releases, extends, expiry, lookups and replays go on. Once this
        returns, no hold of the frozen scope is created; a reserve gets a stored
        rejection (reason bucket_frozen / tenant_frozen). Freezing a frozen scope
        returns the live freeze (`already`)."""
        tenant, bucket = await self._freeze_scope(tenant, sku, location)
        reason = check.text(reason, "reason", 1000)
        by = check.name(by, "by")
        if not reason:
            raise InvalidRequest("a freeze needs a reason", field="reason")
        doc = await self.db.call(queries["freeze_set"], (tenant, bucket, reason, by),
                                 op=OPS["freeze_set"], replay_safe=False)
        return Freeze.from_json(doc)

    async def unfreeze(self, tenant: int, reason: str, by: str, *, sku: str | None = None,
                       location: str | None = None) -> Freeze:
        """Lift the live freeze of a bucket or tenant; the freeze stays on record."""
        tenant, bucket = await self._freeze_scope(tenant, sku, location)
        reason = check.text(reason, "reason", 1000)
        by = check.name(by, "by")
        if not reason:
            raise InvalidRequest("an unfreeze needs a reason", field="reason")
        doc = await self.db.call(queries["freeze_lift"], (tenant, bucket, reason, by),
                                 op=OPS["freeze_lift"], replay_safe=False)
        if doc is None:
            what = "tenant" if bucket == 0 else f"{sku!r} at {location!r}"
            raise FreezeNotFound(f"{what} is not frozen")
        return Freeze.from_json(doc)

    async def freezes(self, tenant: int | None = None) -> list[Freeze]:
        """The live freezes (of one tenant, or of every tenant), oldest first."""
        if tenant is not None:
            tenant = check.tenant_id(tenant)
        rows = await self.db.fetch(queries["freeze_live_list"], (tenant, tenant),
                                   op=OPS["freeze_list"])
        return [Freeze.from_json(r[0]) for r in rows]

    async def _freeze_scope(self, tenant: int, sku: str | None,
                            location: str | None) -> tuple[int, int]:
        tenant = check.tenant_id(tenant)
        if sku is None and location is None:
            await self._require_tenant(tenant)
            return tenant, 0
        if sku is None or location is None:
            raise InvalidRequest("a bucket freeze needs both sku and location",
                                 field="sku" if sku is None else "location")
        sku, location = check.name(sku, "sku"), check.name(location, "location")
        rows = await self.db.fetch(queries["bucket_id_find"], (tenant, sku, location),
                                   op=OPS["freeze_list"])
        if not rows:
            await self._require_tenant(tenant)
            raise UnknownStock(f"unknown stock {sku!r} at {location!r}",
                               detail=[{"sku": sku, "location": location}])
        return tenant, int(rows[0][0])

    async def expire_due(self, batch: int = SWEEP_BATCH_MAX) -> int:
        """Expire up to `batch` (at most 500) due reservations.

        Batching, the due holds of one line go through their bucket's combiner
        (one write of each bucket row, shared with the buyers' batches of this
        process); `expire_due_v1` then expires the rest (carts of several lines,
        anything a batch did not take) in one transaction.
        """
        batch = check.integer(batch, "batch", 1, SWEEP_BATCH_MAX)
        started = perf_counter()
        n = await self._expire_batched(self.combiner, batch) if self.combiner else 0
        if n < batch:
            n += int(await self.db.call(queries["reservation_expire_due"],
                                        (batch - n, self.clock()), op=OPS["expire_due"]))
        self._observe("expire_due", str(n), started)
        return n

    async def _expire_batched(self, combiner: Combiner, batch: int) -> int:
        due = await self._lookup(queries["reservation_due_one_line"], (self.clock(), batch),
                                 "expire_due")
        if not due:
            return 0
        answers = await asyncio.gather(
            *(combiner.submit(int(tenant), int(bucket),
                              BatchRequest("expire", reservation_id=rid))
              for tenant, bucket, rid in due),
            return_exceptions=True)
        # Busy or an unknown outcome: expire_due_v1 or the next sweep finds it due
        return sum(1 for a in answers if isinstance(a, dict) and "ok" in a)

    async def refill_candidates(self, low_water: float, limit: int) -> list[tuple[int, int]]:
        """Pool buckets under `low_water` x pool_cap with free stock, most depleted first."""
        if (isinstance(low_water, bool) or not isinstance(low_water, (int, float))
                or not 0.0 <= low_water <= 1.0):
            raise InvalidRequest("low_water must be a number from 0 to 1", field="low_water")
        limit = check.integer(limit, "limit", 1, 2**31 - 1)
        rows = await self.db.fetch(
            queries["pool_refill_candidate_list"],
            (low_water, limit), op=OPS["refill_candidates"],
        )
        return [(int(r[0]), int(r[1])) for r in rows]

    async def refill(self, tenant: int, bucket_id: int) -> int | None:
        """Refill one pool bucket to its cap; None when another transaction holds it.

        A bucket this process is batching right now gets its refill in its next
        batch (after that batch's holds), instead of a transaction of its own
        that would only find the bucket locked."""
        tenant = check.tenant_id(tenant)
        bucket_id = check.integer(bucket_id, "bucket_id", 1, 2**63 - 1)
        started = perf_counter()
        combiner = self.combiner
        if combiner is not None and combiner.busy(tenant, bucket_id):
            doc = _batch_answer(await combiner.submit(tenant, bucket_id,
                                                      BatchRequest("refill")))
            added = None if doc is None else int(doc["added"])
        else:
            added = await self.db.call(queries["pool_refill"],
                                       (tenant, bucket_id, self.clock()), op=OPS["refill"])
        self._observe("refill", str(added or 0), started)
        return None if added is None else int(added)

    async def purge_request_keys(self, keep: timedelta, batch: int = 1000) -> int:
        """Forget request keys older than `keep` (at most `batch` per transaction)."""
        if (not isinstance(keep, timedelta) or keep < timedelta(0)
                or keep > timedelta(hours=check.MAX_KEY_RETENTION_HOURS)):
            raise InvalidRequest("keep must be a duration from 0 to 100 years", field="keep")
        batch = check.integer(batch, "batch", 1, 100_000)
        return int(await self.db.call(queries["request_key_purge"],
                                      (keep, batch, self.clock()),
                                      op=OPS["purge_request_keys"]))

    # -- events ----------------------------------------------------------------

    async def events(self, tenant: int, after: tuple[int, int] | Sequence[int] | None = None,
                     limit: int = 100, *, op: Op | None = None) -> EventPage:
        """This tenant's outbox events in commit order, after a (xid, event_id) cursor.

        Only events of transactions older than the snapshot's xmin are returned:
        every transaction below xmin has ended, so no event can later appear
        before the cursor (see docs/api.md, "Events"). `op` tags the read for a caller
        other than GET /v1/events (the webhook deliverer).
        """
        op = op or OPS["events"]
        tenant = check.tenant_id(tenant)
        limit = check.integer(limit, "limit", 1, 1000)
        if after is not None and not (isinstance(after, (tuple, list)) and len(after) == 2):
            raise InvalidCursor("after must be an (xid, event_id) cursor", field="after")
        xid, event_id = after if after is not None else (0, 0)
        check.integer(xid, "cursor", 0, 2**63 - 1)
        check.integer(event_id, "cursor", 0, 2**63 - 1)
        rows = await self.db.fetch(
            queries["event_list"], (tenant, str(xid), event_id, limit), op=op,
        )
        if not rows:
            await self._require_tenant(tenant)
        events = tuple(Event(int(r[0]), int(r[1]), str(r[2]), r[3], r[4]) for r in rows)
        cursor = (events[-1].xid, events[-1].event_id) if events else (xid, event_id)
        return EventPage(events, cursor)

    # -- webhooks --------------------------------------------------------------

    async def add_webhook(self, tenant: int, url: str) -> Webhook:
        """Register an endpoint; it gets the tenant's events from now on, signed with the
        returned secret (shown only here). A host that is, or resolves to, a
        non-public address raises WebhookUrlRefused (see webhook_targets.py)."""
        tenant = check.tenant_id(tenant)
        url = check.webhook_url(url)
        await webhook_targets.check_url(url, allow_private=self.allow_private_webhooks)
        secret = WEBHOOK_SECRET_PREFIX + secrets.token_urlsafe(32)
        doc = await self.db.call(queries["webhook_register"], (tenant, url, secret),
                                 op=OPS["webhook_register"], replay_safe=False)
        due = doc.get("next_attempt_at")  # (absent from a function older than this release)
        return Webhook(int(doc["id"]), str(doc["url"]), datetime.fromisoformat(doc["created_at"]),
                       next_attempt_at=None if due is None else datetime.fromisoformat(due),
                       secret=secret)

    async def webhooks(self, tenant: int) -> list[Webhook]:
        """This tenant's endpoints with their delivery state (never their secrets)."""
        tenant = check.tenant_id(tenant)
        rows = await self.db.fetch(
            queries["webhook_list"], (tenant,), op=OPS["webhook_list"],
        )
        if not rows:
            await self._require_tenant(tenant)  # none, or no such tenant (UnknownTenant)
        return [Webhook(int(r[0]), r[1], r[2], int(r[3]), int(r[4]), r[5], r[6], r[7], r[8])
                for r in rows]

    async def delete_webhook(self, tenant: int, webhook_id: int | str) -> None:
        """Remove an endpoint and its delivery state; nothing more is sent to it."""
        tenant = check.tenant_id(tenant)
        try:
            wid = int(str(webhook_id))
        except ValueError:
            raise WebhookNotFound(f"unknown webhook {webhook_id!r}") from None
        if not 1 <= wid <= 2**63 - 1:
            raise WebhookNotFound(f"unknown webhook {webhook_id!r}")
        gone = await self.db.call(queries["webhook_delete"], (tenant, wid),
                                  op=OPS["webhook_delete"], replay_safe=False)
        if not gone:
            raise WebhookNotFound(f"unknown webhook {wid}")

    # -- checks ----------------------------------------------------------------

    async def invariant_violations(self, tenant: int | None = None) -> list[Violation]:
        """Every breach of the accounting rules (empty when all hold)."""
        if tenant is not None:
            tenant = check.tenant_id(tenant)
        rows = await self.db.fetch(
            queries["invariant_violation_list"],
            (tenant, self.clock()), op=OPS["invariants"],
        )
        return [Violation(int(r[0]), r[1], r[2], r[3], r[4]) for r in rows]

    async def _call(self, sql: LiteralString, sql_in: LiteralString, params: tuple[Any, ...],
                    op: Op, conn: psycopg.AsyncConnection[Any] | None) -> Any:
        """`sql` in a transaction of its own, or, with `conn`, on the caller's
        connection inside its open transaction: `sql_in`, the same call with its
        function named with the schema ({}), run under a savepoint. There nothing
        is committed, retried or batched, and a refusal (typed as usual) leaves
        the caller's transaction as it was."""
        if conn is None:
            return await self.db.call(sql, params, op=op)
        return await self.db.call_on(conn, self._in_schema(sql_in), params, op=op)

    def _in_schema(self, sql: LiteralString) -> LiteralString:
        text = self._qualified.get(sql)
        if text is None:
            composed = sql_.SQL(sql).format(sql_.Identifier(self.db.schema))
            # The schema name is checked (db/schema.py), the rest is the block's text.
            # mypy reads LiteralString as str; the cast is for checkers that enforce it
            text = cast(LiteralString, composed.as_string(None))  # type: ignore[redundant-cast]
            self._qualified[sql] = text
        return text

    async def _transition(self, action: str, sql: LiteralString, sql_in: LiteralString,
                          tenant: int, reservation_id: str | uuid.UUID,
                          request_key: str | None,
                          conn: psycopg.AsyncConnection[Any] | None,
                          api_key_hash: bytes | None) -> Reservation:
        """claim or release (`action`; `sql`/`sql_in`: its call without a request key):
        through the bucket's batch when it can be, else on its own, the key checked
        first."""
        checked = check.api_key_hash(api_key_hash)

        async def alone() -> Reservation:
            await self._check_api_key(tenant, checked)  # not decided in a batch: read it
            if request_key is not None:
                return await self._keyed(tenant, request_key, action, reservation_id, None,
                                         conn=conn)
            t = check.tenant_id(tenant)
            rid = parse_reservation_id(reservation_id)
            started = perf_counter()
            try:
                doc = await self._call(sql, sql_in, (t, rid, self.clock()), OPS[action], conn)
            except Exception as exc:
                self._observe(action, _failure(exc), started)
                raise
            self._observe(action, "ok", started)
            return Reservation.from_json(doc)

        if conn is None and self.combiner is not None:
            done = await self._transition_batched(action, tenant, reservation_id, request_key,
                                                  alone, checked)
            if done is not None:
                return done
        return await alone()

    # -- group commit (core/batching.py) ---------------------------------------

    async def _reserve_batched(self, tenant: int, key: str, fingerprint: str, line: Line,
                               life: timedelta, started: float,
                               alone: Callable[[], Awaitable[ReserveOutcome]],
                               reference: str | None = None,
                               metadata: dict[str, str] | None = None,
                               api_key: bytes | None = None) -> ReserveOutcome | None:
        """A one-line reserve through its bucket's combiner; None: send it unbatched.
        One the batch cannot decide is sent `alone` in its turn (Combiner.request)."""
        combiner = self.combiner
        if combiner is None:
            return None
        bucket = await self._bucket_id(tenant, line.sku, line.location)
        if bucket is None:
            return None  # the unbatched call says what is unknown
        request = BatchRequest("reserve", key=key, digest=fingerprint, quantity=line.quantity,
                               ttl=life, reference=reference, metadata=metadata or None,
                               api_key=api_key)
        doc, sent = await self._through_batch(combiner, "reserve", tenant, bucket, request,
                                              started, alone)
        if doc is None:
            return sent
        outcome = ReserveOutcome.from_json(doc)
        if outcome.reservation is not None:
            self._remember_bucket(tenant, uuid.UUID(outcome.reservation.id), bucket)
        self._observe("reserve", "idempotent_replay" if outcome.replayed
                      else _reserve_label(outcome), started)
        return outcome

    async def _transition_batched(self, action: str, tenant: int,
                                  reservation_id: str | uuid.UUID,
                                  request_key: str | None,
                                  alone: Callable[[], Awaitable[Reservation]],
                                  api_key: bytes | None = None) -> Reservation | None:
        """A claim or release of a one-line reservation through its bucket's combiner;
        None: send it unbatched. One the batch cannot decide is sent `alone` in its
        turn (Combiner.request)."""
        combiner = self.combiner
        if combiner is None:
            return None
        try:
            tenant = check.tenant_id(tenant)
            rid = parse_reservation_id(reservation_id)
            key = check.request_key(request_key) if request_key is not None else None
        except (InvalidRequest, ReservationNotFound):
            # the unbatched call says what is wrong, after the API key's check, as it
            # would without batching
            return None
        bucket = await self._reservation_bucket(tenant, rid)
        if bucket is None:
            return None
        started = perf_counter()
        request = BatchRequest(
            action, key=key, digest=digest(action, {"id": str(rid)}) if key is not None else None,
            reservation_id=rid, api_key=api_key)
        doc, sent = await self._through_batch(combiner, action, tenant, bucket, request,
                                              started, alone)
        if doc is None:
            return sent
        if key is None:
            self._observe(action, "ok", started)
            return Reservation.from_json(doc)
        replayed = bool(doc.get("replayed"))
        self._observe(action, "idempotent_replay" if replayed else "ok", started)
        return Reservation.from_json(doc["reservation"], replayed=replayed)

    async def _through_batch(self, combiner: Combiner, action: str, tenant: int, bucket: int,
                             request: BatchRequest, started: float,
                             alone: Callable[[], Awaitable[T]]) -> tuple[dict[str, Any] | None,
                                                                         T | None]:
        """The document the bucket's batch answered `request` with (and None); or, for a
        request the batch cannot decide, None and what `alone` answered, sent in the
        request's turn (Combiner.request). A failure of the batch is observed under
        `action`; `alone` observes its own."""
        sent_alone = False
        try:
            async with combiner.request(tenant, bucket, request) as answer:
                doc = _batch_answer(answer)
                if doc is None:
                    sent_alone = True
                    return None, await alone()
        except Exception as exc:
            if not sent_alone:
                self._observe(action, _failure(exc), started)
            raise
        return doc, None

    async def _bucket_id(self, tenant: int, sku: str, location: str) -> int | None:
        found = self._bucket_ids.get((tenant, sku, location))
        if found is None:
            rows = await self._lookup(queries["bucket_id_find"], (tenant, sku, location),
                                      "reserve")
            if not rows:
                return None
            found = self._bucket_ids[(tenant, sku, location)] = int(rows[0][0])
            if len(self._bucket_ids) > _REMEMBERED_BUCKETS:
                self._bucket_ids.popitem(last=False)
        return found

    async def _reservation_bucket(self, tenant: int, rid: uuid.UUID) -> int | None:
        """The bucket of a reservation's only line; None for several lines or none."""
        found = self._reservation_buckets.get((tenant, rid))
        if found is not None:
            return found
        rows = await self._lookup(queries["reservation_line_buckets"], (tenant, rid),
                                  "reservation_get")
        if rows is None or len(rows) != 1:
            return None
        return int(rows[0][0])

    async def _lookup(self, sql: LiteralString, params: tuple[Any, ...],
                      action: str) -> list[tuple[Any, ...]] | None:
        """A read that only routes a request to its batch: when its statement fails,
        the request goes unbatched, whose call reports the failure as it always has.
        Busy (no connection before the deadline) and DatabaseUnavailable (the
        connection lost and not regained in time) come out as they are: the request
        was not started."""
        try:
            return await self.db.fetch(sql, params, op=OPS[action])
        except psycopg.Error:
            return None

    def _remember_bucket(self, tenant: int, rid: uuid.UUID, bucket: int) -> None:
        self._reservation_buckets[(tenant, rid)] = bucket
        if len(self._reservation_buckets) > _REMEMBERED_RESERVATIONS:
            self._reservation_buckets.popitem(last=False)

    async def _require_tenant(self, tenant: int) -> None:
        from ..errors import UnknownTenant

        rows = await self.db.fetch(queries["tenant_exists"], (tenant,),
                                   op=OPS["tenant_lookup"])
        if not rows:
            raise UnknownTenant(f"unknown tenant {tenant}")


_REMEMBERED_RESERVATIONS = 100_000
_REMEMBERED_BUCKETS = 100_000


def _batch_answer(answer: dict[str, Any]) -> dict[str, Any] | None:
    """A request's answer from its batch: its document, or None to send it unbatched;
    a typed failure is raised."""
    if "ok" in answer:
        return cast(dict[str, Any], answer["ok"])
    if "error" in answer:
        raise typed_error(str(answer["error"]), answer.get("message"), answer.get("detail"))
    return None


def _reserve_label(outcome: ReserveOutcome) -> str:
    """The outcome label of an answered reserve: held, sold_out or frozen."""
    return "held" if outcome.held else "frozen" if outcome.frozen else "sold_out"


def _failure(exc: BaseException) -> str:
    """The outcome label of a failed operation: its error code (busy, key reused, ...)."""
    from ..errors import PgReserveError

    if isinstance(exc, PgReserveError):
        return str(getattr(exc, "code", type(exc).__name__))
    return "error"


__all__ = ["OPS", "UNSET", "AllocatedLine", "Line", "ReservationService", "Unset", "digest"]
