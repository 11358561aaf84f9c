"""Typed clients of the pgreserve HTTP API: `Client` (sync) and `AsyncClient` (asyncio).

    from pgreserve.client import Client

    with Client("http://127.0.0.1:8000", api_key) as shop:
        shop.set_stock("tee-red-m", "berlin", 50)
        out = shop.reserve([("tee-red-m", "berlin", 2)], ttl_seconds=900)
        if out.held:
            shop.claim(out.reservation.id)

Every write carries an Idempotency-Key (the caller's, or one made per call), so a
retry after a lost reply, a 503 (busy, outcome unknown), a 429 (the tenant's
in-flight limit) or a dropped connection gets
the stored outcome instead of acting twice. Retries are bounded (`retries`), with
exponential backoff and jitter, and wait at least what a Retry-After header asks
(up to `max_backoff`). Errors are the typed errors of `pgreserve.errors` (and
`pgreserve.http.problems` for the HTTP-only ones), chosen by the problem's `code`;
`exc.details` holds `status` and the problem document. A sold-out reserve is not an
error: it returns a `ReserveOutcome` with `held` False and the short lines.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, urlencode

import httpx

from . import errors
from .domain import (
    AllocatedLine,
    LimitedLine,
    Line,
    Reservation,
    ReservationPage,
    ReserveOutcome,
    ShortLine,
    SkuSettings,
    Strategy,
)
from .http import problems  # noqa: F401 - defines the HTTP-only error classes mapped below

__all__ = ["AllocatedLine", "ApiError", "AsyncClient", "CartLine", "Client",
           "LocationAvailability", "SkuAvailability", "Stock", "StockPage"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 4
REPLAYED_HEADER = "Idempotent-Replayed"
KEY_PREFIX = "pgr-client-"


class ApiError(errors.PgReserveError):
    """An answer with no known problem code (e.g. a proxy's 502 page)."""

    code = "api_error"


@dataclass(frozen=True)
class Stock:
    """A bucket as the API shows it."""

    sku: str
    location: str
    on_hand: int
    reserved: int
    available: int
    strategy: Strategy
    # what an operator set moves it (not holds or sales); pass it as if_match
    version: int = 0
    safety_stock: int = 0  # never promised: left out of available
    backorder_limit: int = 0  # may be held beyond on_hand
    backorder_held: int = 0  # held beyond on_hand now
    backorder_owed: int = 0  # claimed beyond on_hand, until receipts cover it

    @property
    def etag(self) -> str:
        """The line's ETag, `W/"<version>"`."""
        return f'W/"{self.version}"'

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Stock:
        return cls(str(doc["sku"]), str(doc["location"]), int(doc["on_hand"]),
                   int(doc["reserved"]), int(doc["available"]), Strategy(doc["strategy"]),
                   int(doc.get("version") or 0), int(doc.get("safety_stock") or 0),
                   int(doc.get("backorder_limit") or 0), int(doc.get("backorder_held") or 0),
                   int(doc.get("backorder_owed") or 0))


@dataclass(frozen=True)
class StockPage:
    """One page of GET /v1/stock; `next_cursor` (None on the last page) asks for the next."""

    stock: tuple[Stock, ...]
    next_cursor: str | None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StockPage:
        cursor = doc.get("next_cursor")
        return cls(tuple(Stock.from_json(x) for x in doc["stock"]),
                   None if cursor is None else str(cursor))


@dataclass(frozen=True)
class LocationAvailability:
    location: str
    on_hand: int
    reserved: int
    available: int


@dataclass(frozen=True)
class SkuAvailability:
    """A SKU per location and in total, as `GET /v1/availability` shows it."""

    sku: str
    known: bool
    on_hand: int
    reserved: int
    available: int
    locations: tuple[LocationAvailability, ...]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SkuAvailability:
        return cls(str(doc["sku"]), bool(doc["known"]), int(doc["on_hand"]),
                   int(doc["reserved"]), int(doc["available"]),
                   tuple(LocationAvailability(str(x["location"]), int(x["on_hand"]),
                                              int(x["reserved"]), int(x["available"]))
                         for x in doc["locations"]))


def _availabilities(doc: Mapping[str, Any]) -> list[SkuAvailability]:
    return [SkuAvailability.from_json(item) for item in doc["items"]]


def _error_classes() -> dict[str, type[errors.PgReserveError]]:
    found: dict[str, type[errors.PgReserveError]] = {}
    todo: list[type[errors.PgReserveError]] = [errors.PgReserveError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.code, cls)
        todo.extend(cls.__subclasses__())
    return found


_ERRORS = _error_classes()
_RETRY_STATUS = {502, 503, 504}
_RETRY_CODES = {c.code for c in _ERRORS.values() if c.retryable}


def error_from_response(response: httpx.Response) -> errors.PgReserveError:
    """The typed error a problem response stands for."""
    try:
        doc = response.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("code"), str):
        return ApiError(f"HTTP {response.status_code}: {response.text[:200]}",
                        status=response.status_code, problem=None)
    cls = _ERRORS.get(doc["code"], ApiError)
    return cls(str(doc.get("detail") or doc.get("title") or doc["code"]),
               status=response.status_code, problem=doc)


def _retryable(response: httpx.Response) -> bool:
    """Busy, outcome unknown, database unavailable (503), a tenant over its limit (429),
    the same key in progress (409): every answer whose code is retryable; and a proxy's
    502/503/504 without one."""
    if response.status_code < 400:
        return False
    try:
        code = response.json().get("code")
    except (ValueError, AttributeError):
        code = None
    if code is not None:
        return code in _RETRY_CODES
    return response.status_code in _RETRY_STATUS


def _retry_after(response: httpx.Response | None) -> float:
    if response is None:
        return 0.0
    value = response.headers.get("Retry-After", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0  # an HTTP date: fall back to the backoff


# A cart line: (sku, location, quantity), a Line, or an AllocatedLine (no location:
# the tenant's location priority decides; (sku, None, quantity) is one unsplit).
CartLine = Line | AllocatedLine | tuple[str, str | None, int]


def _lines(lines: Iterable[CartLine]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in lines:
        if isinstance(line, AllocatedLine):
            doc: dict[str, Any] = {"sku": line.sku, "quantity": line.quantity}
            if line.split:
                doc["split"] = True
            out.append(doc)
            continue
        sku, location, quantity = ((line.sku, line.location, line.quantity)
                                   if isinstance(line, Line) else line)
        if location is None:
            out.append({"sku": sku, "quantity": quantity})
        else:
            out.append({"sku": sku, "location": location, "quantity": quantity})
    return out


# the 409 answers of a reserve that are outcomes (stored under the key), not errors
_REJECTIONS = ("insufficient_stock", "cart_limit_exceeded")


def _outcome(response: httpx.Response) -> ReserveOutcome:
    replayed = response.headers.get(REPLAYED_HEADER) == "true"
    if response.status_code in (200, 201):  # 201 reserve, 200 change
        return ReserveOutcome(True, Reservation.from_json(response.json(), replayed),
                              (), replayed)
    doc = response.json()
    if response.status_code != 409 or doc.get("code") not in _REJECTIONS:
        raise error_from_response(response)
    short = tuple(ShortLine(s["sku"], s["location"], int(s["requested"]), int(s["available"]))
                  for s in doc.get("short_lines") or ())
    limited = tuple(LimitedLine(x["sku"], int(x["limit"]), int(x["requested"]))
                    for x in doc.get("limited_lines") or ())
    return ReserveOutcome(False, None, short, replayed, str(doc["code"]),
                          limited_lines=limited)


def _reservation_page(doc: Mapping[str, Any]) -> ReservationPage:
    cursor = doc.get("next_cursor")
    return ReservationPage(tuple(Reservation.from_json(x) for x in doc["reservations"]),
                           None if cursor is None else str(cursor))


def _reservation(response: httpx.Response) -> Reservation:
    return Reservation.from_json(response.json(),
                                 response.headers.get(REPLAYED_HEADER) == "true")


@dataclass(frozen=True)
class _Call:
    method: Literal["GET", "PUT", "POST"]
    path: str
    body: dict[str, Any] | None = None
    key: str | None = None
    ok: tuple[int, ...] = (200,)
    params: tuple[tuple[str, str], ...] = ()
    conditions: tuple[tuple[str, str], ...] = ()

    def headers(self) -> dict[str, str]:
        out = dict(self.conditions)
        if self.key is not None:
            out["Idempotency-Key"] = sf_string(self.key)
        return out


def sf_string(key: str) -> str:
    """`key` as a structured-field string (`"..."`, `\\` and `"` escaped), the draft's form
    of the Idempotency-Key header: any printable-ASCII key, quotes included, arrives as
    itself. Other keys are sent bare."""
    if all(" " <= ch <= "~" for ch in key):
        return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return key


def _path(*parts: str) -> str:
    return "/" + "/".join(quote(p, safe="") for p in parts)


def _new_key(key: str | None) -> str:
    return key if key is not None else KEY_PREFIX + uuid.uuid4().hex


class _Base:
    """What both clients share: the calls, the retry policy and the error mapping."""

    def __init__(self, retries: int, backoff: float, max_backoff: float) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds before retry number `attempt` (1-based): backoff with full jitter, and at
        least the Retry-After the server asked for, all capped at max_backoff."""
        backoff = random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (attempt - 1)))  # noqa: S311
        return min(self.max_backoff, max(backoff, _retry_after(response)))

    @staticmethod
    def _result(call: _Call, response: httpx.Response) -> httpx.Response:
        if response.status_code in call.ok:
            return response
        raise error_from_response(response)

    # -- the calls ---------------------------------------------------------------

    @staticmethod
    def _reserve(lines: Iterable[CartLine], ttl_seconds: int,
                 key: str | None, reference: str | None = None,
                 metadata: Mapping[str, str] | None = None) -> _Call:
        body: dict[str, Any] = {"lines": _lines(lines), "ttl_seconds": ttl_seconds}
        if reference is not None:
            body["reference"] = reference
        if metadata is not None:
            body["metadata"] = dict(metadata)
        return _Call("POST", "/v1/reservations", body, _new_key(key), ok=(201,))

    @staticmethod
    def _list_reservations(cart: str | None, status: Iterable[str] | str | None,
                           limit: int | None, cursor: str | None) -> _Call:
        statuses = [status] if isinstance(status, str) else list(status or ())
        params = [("status", str(s)) for s in statuses]
        for name, value in (("cart", cart), ("limit", None if limit is None else str(limit)),
                            ("cursor", cursor)):
            if value is not None:
                params.append((name, value))
        return _Call("GET", "/v1/reservations", params=tuple(params))

    @staticmethod
    def _change(reservation_id: str, lines: Iterable[Line | tuple[str, str, int]],
                key: str | None) -> _Call:
        return _Call("PUT", _path("v1", "reservations", reservation_id, "lines"),
                     {"lines": _lines(lines)}, _new_key(key), ok=(200, 409))

    @staticmethod
    def _transition(action: str, reservation_id: str, key: str | None,
                    body: dict[str, Any] | None = None) -> _Call:
        return _Call("POST", _path("v1", "reservations", reservation_id, action), body,
                     _new_key(key))

    @classmethod
    def _extend(cls, reservation_id: str, ttl_seconds: int, key: str | None,
                allow_shorten: bool) -> _Call:
        body: dict[str, Any] = {"ttl_seconds": ttl_seconds}
        if allow_shorten:
            body["allow_shorten"] = True
        return cls._transition("extend", reservation_id, key, body)

    @staticmethod
    def _get_reservation(reservation_id: str) -> _Call:
        return _Call("GET", _path("v1", "reservations", reservation_id))

    @staticmethod
    def _get_stock(sku: str, location: str) -> _Call:
        return _Call("GET", _path("v1", "stock", location, sku))

    @staticmethod
    def _availability(skus: Iterable[str], locations: Iterable[str] | None) -> _Call:
        query = [("sku", sku) for sku in skus] + [("location", loc) for loc in locations or ()]
        return _Call("GET", "/v1/availability?" + urlencode(query))

    @staticmethod
    def _set_cart_limit(sku: str, limit: int | None) -> _Call:
        return _Call("PUT", _path("v1", "skus", sku), {"cart_limit": limit})

    @staticmethod
    def _set_sku_priority(sku: str, locations: Iterable[str] | None) -> _Call:
        return _Call("PUT", _path("v1", "skus", sku),
                     {"location_priority": None if locations is None else list(locations)})

    @staticmethod
    def _set_priority(locations: Iterable[str]) -> _Call:
        return _Call("PUT", "/v1/locations/priority", {"locations": list(locations)})

    @staticmethod
    def _set_stock(sku: str, location: str, on_hand: int, strategy: Strategy | str | None,
                   if_match: str | int | None, create_only: bool,
                   safety_stock: int | None = None,
                   backorder_limit: int | None = None) -> _Call:
        body: dict[str, Any] = {"on_hand": on_hand}
        if strategy is not None:
            body["strategy"] = Strategy(strategy).value
        if safety_stock is not None:
            body["safety_stock"] = safety_stock
        if backorder_limit is not None:
            body["backorder_limit"] = backorder_limit
        conditions = []
        if if_match is not None:
            conditions.append(("If-Match", f'W/"{if_match}"' if isinstance(if_match, int)
                               else if_match))
        if create_only:
            conditions.append(("If-None-Match", "*"))
        return _Call("PUT", _path("v1", "stock", location, sku), body, ok=(200, 201),
                     conditions=tuple(conditions))

    @staticmethod
    def _list_stock(sku_prefix: str | None, skus: Iterable[str] | None, location: str | None,
                    limit: int | None, cursor: str | None) -> _Call:
        params = [("sku", s) for s in skus or ()]
        for name, value in (("sku_prefix", sku_prefix), ("location", location),
                            ("limit", None if limit is None else str(limit)),
                            ("cursor", cursor)):
            if value is not None:
                params.append((name, value))
        return _Call("GET", "/v1/stock", params=tuple(params))


def _auth(api_key: str, headers: Mapping[str, str] | None) -> dict[str, str]:
    return {**(headers or {}), "Authorization": f"Bearer {api_key}"}


class Client(_Base):
    """The HTTP API, synchronously (httpx.Client). Use as a context manager or close()."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, backoff: float = 0.1, max_backoff: float = 5.0,
                 headers: Mapping[str, str] | None = None,
                 http: httpx.Client | None = None) -> None:
        """`http`: an httpx.Client of your own (proxies, TLS, event hooks); the base URL,
        key and headers are set on it."""
        super().__init__(retries, backoff, max_backoff)
        self._http = http or httpx.Client(timeout=timeout)
        self._http.base_url = httpx.URL(base_url)
        self._http.headers.update(_auth(api_key, headers))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                # params None: httpx would replace a query string already in the path
                response = self._http.request(call.method, call.path, json=call.body,
                                              headers=call.headers(),
                                              params=list(call.params) or None)
                if not _retryable(response) or attempt >= self.retries:
                    return self._result(call, response)
            except httpx.TransportError:
                if attempt >= self.retries:
                    raise
            attempt += 1
            time.sleep(self._delay(attempt, response))

    def reserve(self, lines: Sequence[CartLine], *, ttl_seconds: int = 900,
                idempotency_key: str | None = None, reference: str | None = None,
                metadata: Mapping[str, str] | None = None) -> ReserveOutcome:
        """Hold every line (sku, location, quantity) or none; a sold-out answer is an
        outcome with held False, not an error. `reference` (the cart or order id) and
        `metadata` (string pairs) are kept on the reservation. An AllocatedLine (or a None
        location) lets the tenant's location priority decide; the reservation's lines say
        where."""
        call = self._reserve(lines, ttl_seconds, idempotency_key, reference, metadata)
        call = _Call(call.method, call.path, call.body, call.key, ok=(201, 409))
        return _outcome(self._send(call))

    def list_reservations(self, *, cart: str | None = None,
                          status: Iterable[str] | str | None = None, limit: int | None = None,
                          cursor: str | None = None) -> ReservationPage:
        """One page of the tenant's reservations, newest first, of one cart reference
        and of some statuses (expired includes active holds past their expiry)."""
        return _reservation_page(self._send(self._list_reservations(
            cart, status, limit, cursor)).json())

    def iter_reservations(self, *, cart: str | None = None,
                          status: Iterable[str] | str | None = None,
                          limit: int | None = None) -> Iterator[Reservation]:
        """Every matching reservation, newest first, page after page."""
        wanted = [status] if isinstance(status, str) else None if status is None else list(status)
        cursor: str | None = None
        while True:
            page = self.list_reservations(cart=cart, status=wanted, limit=limit, cursor=cursor)
            yield from page.reservations
            if page.next_cursor is None:
                return
            cursor = page.next_cursor
    def change(self, reservation_id: str, lines: Sequence[Line | tuple[str, str, int]], *,
               idempotency_key: str | None = None) -> ReserveOutcome:
        """Make an active reservation hold exactly `lines` (the whole new cart), or change
        nothing: a short line is an outcome with held False (its short_lines), as for
        reserve. Retried with the same key, so a lost answer is not applied twice."""
        return _outcome(self._send(self._change(reservation_id, lines, idempotency_key)))

    def claim(self, reservation_id: str, *, idempotency_key: str | None = None) -> Reservation:
        return _reservation(self._send(self._transition("claim", reservation_id,
                                                        idempotency_key)))

    def release(self, reservation_id: str, *,
                idempotency_key: str | None = None) -> Reservation:
        return _reservation(self._send(self._transition("release", reservation_id,
                                                        idempotency_key)))

    def extend(self, reservation_id: str, ttl_seconds: int, *,
               idempotency_key: str | None = None, allow_shorten: bool = False) -> Reservation:
        """A new time to live from now; ExtendWouldShorten if that ends the hold sooner than
        now, unless `allow_shorten`."""
        return _reservation(self._send(self._extend(reservation_id, ttl_seconds,
                                                    idempotency_key, allow_shorten)))

    def get_reservation(self, reservation_id: str) -> Reservation:
        return _reservation(self._send(self._get_reservation(reservation_id)))

    def get_stock(self, sku: str, location: str) -> Stock:
        return Stock.from_json(self._send(self._get_stock(sku, location)).json())

    def availability(self, skus: Iterable[str],
                     locations: Iterable[str] | None = None) -> list[SkuAvailability]:
        """Each SKU per location and in total, from one snapshot (at most 100 SKUs)."""
        return _availabilities(self._send(self._availability(skus, locations)).json())

    def set_stock(self, sku: str, location: str, on_hand: int, *,
                  strategy: Strategy | str | None = None, if_match: str | int | None = None,
                  create_only: bool = False, safety_stock: int | None = None,
                  backorder_limit: int | None = None) -> Stock:
        """Set the count (creating the line). `if_match`: the ETag (or version) the line
        must still have, or "*" (it must exist); `create_only`: it must not exist yet.
        Otherwise PreconditionFailed (412) and nothing is written. `safety_stock` (never
        promised) and `backorder_limit` (may be held beyond on_hand): None keeps them."""
        return Stock.from_json(self._send(self._set_stock(
            sku, location, on_hand, strategy, if_match, create_only, safety_stock,
            backorder_limit)).json())

    def list_stock(self, *, sku_prefix: str | None = None, skus: Iterable[str] | None = None,
                   location: str | None = None, limit: int | None = None,
                   cursor: str | None = None) -> StockPage:
        """One page of the tenant's stock lines in (sku, location) order."""
        return StockPage.from_json(self._send(self._list_stock(
            sku_prefix, skus, location, limit, cursor)).json())

    def iter_stock(self, *, sku_prefix: str | None = None, skus: Iterable[str] | None = None,
                   location: str | None = None, limit: int | None = None) -> Iterator[Stock]:
        """Every matching stock line, page after page."""
        wanted = None if skus is None else list(skus)
        cursor: str | None = None
        while True:
            page = self.list_stock(sku_prefix=sku_prefix, skus=wanted, location=location,
                                   limit=limit, cursor=cursor)
            yield from page.stock
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def set_cart_limit(self, sku: str, limit: int | None) -> SkuSettings:
        """At most `limit` units of the SKU per reservation (None: no limit)."""
        return SkuSettings.from_json(self._send(self._set_cart_limit(sku, limit)).json())

    def set_location_priority(self, locations: Iterable[str]) -> tuple[str, ...]:
        """The tenant's location order for lines without a location (unnamed locations
        follow in name order)."""
        return tuple(self._send(self._set_priority(locations)).json()["locations"])

    def location_priority(self) -> tuple[str, ...]:
        return tuple(self._send(_Call("GET", "/v1/locations/priority")).json()["locations"])

    def set_sku_location_priority(self, sku: str,
                                  locations: Iterable[str] | None) -> SkuSettings:
        """The SKU's own location order, in place of the tenant's (None removes it)."""
        return SkuSettings.from_json(self._send(self._set_sku_priority(sku, locations)).json())


class AsyncClient(_Base):
    """The HTTP API for asyncio (httpx.AsyncClient): the same calls as Client, awaited."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                 retries: int = DEFAULT_RETRIES, backoff: float = 0.1, max_backoff: float = 5.0,
                 headers: Mapping[str, str] | None = None,
                 http: httpx.AsyncClient | None = None) -> None:
        super().__init__(retries, backoff, max_backoff)
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._http.base_url = httpx.URL(base_url)
        self._http.headers.update(_auth(api_key, headers))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = await self._http.request(call.method, call.path, json=call.body,
                                                    headers=call.headers(),
                                                    params=list(call.params) or None)
                if not _retryable(response) or attempt >= self.retries:
                    return self._result(call, response)
            except httpx.TransportError:
                if attempt >= self.retries:
                    raise
            attempt += 1
            await asyncio.sleep(self._delay(attempt, response))

    async def reserve(self, lines: Sequence[CartLine], *,
                      ttl_seconds: int = 900,
                      idempotency_key: str | None = None, reference: str | None = None,
                      metadata: Mapping[str, str] | None = None) -> ReserveOutcome:
        """As Client.reserve."""
        call = self._reserve(lines, ttl_seconds, idempotency_key, reference, metadata)
        call = _Call(call.method, call.path, call.body, call.key, ok=(201, 409))
        return _outcome(await self._send(call))

    async def list_reservations(self, *, cart: str | None = None,
                                status: Iterable[str] | str | None = None,
                                limit: int | None = None,
                                cursor: str | None = None) -> ReservationPage:
        """As Client.list_reservations."""
        return _reservation_page((await self._send(self._list_reservations(
            cart, status, limit, cursor))).json())

    async def iter_reservations(self, *, cart: str | None = None,
                                status: Iterable[str] | str | None = None,
                                limit: int | None = None) -> AsyncIterator[Reservation]:
        """Every matching reservation, newest first, page after page."""
        wanted = [status] if isinstance(status, str) else None if status is None else list(status)
        cursor: str | None = None
        while True:
            page = await self.list_reservations(cart=cart, status=wanted, limit=limit,
                                                cursor=cursor)
            for item in page.reservations:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor
    async def change(self, reservation_id: str, lines: Sequence[Line | tuple[str, str, int]],
                     *, idempotency_key: str | None = None) -> ReserveOutcome:
        """Make an active reservation hold exactly `lines` (the whole new cart), or change
        nothing: a short line is an outcome with held False (its short_lines), as for
        reserve. Retried with the same key, so a lost answer is not applied twice."""
        return _outcome(await self._send(self._change(reservation_id, lines,
                                                      idempotency_key)))

    async def claim(self, reservation_id: str, *,
                    idempotency_key: str | None = None) -> Reservation:
        return _reservation(await self._send(self._transition("claim", reservation_id,
                                                              idempotency_key)))

    async def release(self, reservation_id: str, *,
                      idempotency_key: str | None = None) -> Reservation:
        return _reservation(await self._send(self._transition("release", reservation_id,
                                                              idempotency_key)))

    async def extend(self, reservation_id: str, ttl_seconds: int, *,
                     idempotency_key: str | None = None,
                     allow_shorten: bool = False) -> Reservation:
        """A new time to live from now; ExtendWouldShorten if that ends the hold sooner than
        now, unless `allow_shorten`."""
        return _reservation(await self._send(self._extend(reservation_id, ttl_seconds,
                                                          idempotency_key, allow_shorten)))

    async def get_reservation(self, reservation_id: str) -> Reservation:
        return _reservation(await self._send(self._get_reservation(reservation_id)))

    async def get_stock(self, sku: str, location: str) -> Stock:
        return Stock.from_json((await self._send(self._get_stock(sku, location))).json())

    async def availability(self, skus: Iterable[str],
                           locations: Iterable[str] | None = None) -> list[SkuAvailability]:
        """Each SKU per location and in total, from one snapshot (at most 100 SKUs)."""
        return _availabilities((await self._send(self._availability(skus, locations))).json())

    async def set_stock(self, sku: str, location: str, on_hand: int, *,
                        strategy: Strategy | str | None = None,
                        if_match: str | int | None = None,
                        create_only: bool = False, safety_stock: int | None = None,
                        backorder_limit: int | None = None) -> Stock:
        """As Client.set_stock."""
        return Stock.from_json((await self._send(self._set_stock(
            sku, location, on_hand, strategy, if_match, create_only, safety_stock,
            backorder_limit))).json())

    async def list_stock(self, *, sku_prefix: str | None = None,
                         skus: Iterable[str] | None = None, location: str | None = None,
                         limit: int | None = None, cursor: str | None = None) -> StockPage:
        """One page of the tenant's stock lines in (sku, location) order."""
        return StockPage.from_json((await self._send(self._list_stock(
            sku_prefix, skus, location, limit, cursor))).json())

    async def iter_stock(self, *, sku_prefix: str | None = None,
                         skus: Iterable[str] | None = None, location: str | None = None,
                         limit: int | None = None) -> AsyncIterator[Stock]:
        """Every matching stock line, page after page."""
        wanted = None if skus is None else list(skus)
        cursor: str | None = None
        while True:
            page = await self.list_stock(sku_prefix=sku_prefix, skus=wanted,
                                         location=location, limit=limit, cursor=cursor)
            for item in page.stock:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def set_cart_limit(self, sku: str, limit: int | None) -> SkuSettings:
        """At most `limit` units of the SKU per reservation (None: no limit)."""
        return SkuSettings.from_json((await self._send(self._set_cart_limit(sku, limit))).json())

    async def set_location_priority(self, locations: Iterable[str]) -> tuple[str, ...]:
        """The tenant's location order for lines without a location (unnamed locations
        follow in name order)."""
        return tuple((await self._send(self._set_priority(locations))).json()["locations"])

    async def location_priority(self) -> tuple[str, ...]:
        response = await self._send(_Call("GET", "/v1/locations/priority"))
        return tuple(response.json()["locations"])

    async def set_sku_location_priority(self, sku: str,
                                        locations: Iterable[str] | None) -> SkuSettings:
        """The SKU's own location order, in place of the tenant's (None removes it)."""
        response = await self._send(self._set_sku_priority(sku, locations))
        return SkuSettings.from_json(response.json())

