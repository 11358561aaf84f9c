"""Input checks done before any SQL runs: bad input gets InvalidRequest and writes nothing."""

from __future__ import annotations

import ipaddress
import itertools
import math
import re
from collections.abc import Iterable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from .domain import (
    MAX_AVAILABILITY_NAMES,
    MAX_LINES,
    MAX_METADATA_KEY,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE,
    MAX_NAME,
    MAX_QUANTITY,
    MAX_TTL,
    MIN_TTL,
    AllocatedLine,
    Line,
    Strategy,
)
from .errors import InvalidRequest

# The longest a request key may be kept: 100 years (a longer one overflows dates).
MAX_KEY_RETENTION_HOURS = 876_000.0


def name(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{field} must be a string", field=field)
    if not value:
        raise InvalidRequest(f"{field} must not be empty", field=field)
    if len(value) > MAX_NAME:
        raise InvalidRequest(f"{field} must be at most {MAX_NAME} characters", field=field)
    if "\x00" in value:
        raise InvalidRequest(f"{field} must not contain NUL characters", field=field)
    _encodable(value, field)
    return value


def reference(value: Any) -> str | None:
    """A reservation's reference (the shop's cart or order id): None, or a name."""
    return None if value is None else name(value, "reference")


def metadata(value: Any) -> dict[str, str]:
    """A reservation's metadata: None (none, as {}) or an object of at most
    MAX_METADATA_KEYS keys of 1-MAX_METADATA_KEY characters, each value a string of at
    most MAX_METADATA_VALUE characters (may be empty); no NUL, valid Unicode."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("metadata must be an object of string keys and string values",
                             field="metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"metadata has at most {MAX_METADATA_KEYS} keys",
                             field="metadata")
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata keys must be strings of 1 to {MAX_METADATA_KEY} "
                                 f"characters", field="metadata")
        if "\x00" in key:
            raise InvalidRequest("metadata keys must not contain NUL characters",
                                 field="metadata")
        _encodable(key, "metadata")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata value of {key!r} must be a string of at most "
                                 f"{MAX_METADATA_VALUE} characters", field="metadata")
        text(item, "metadata", MAX_METADATA_VALUE)
        out[key] = item
    return out


def names(values: Any, field: str, most: int = MAX_AVAILABILITY_NAMES) -> list[str]:
    """A non-empty list of at most `most` names, each checked like `name`; repeats are
    dropped, the first occurrence keeps its place."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRequest(f"{field} must be a list of names", field=field)
    seen = dict.fromkeys(name(v, field) for v in values)
    if not seen:
        raise InvalidRequest(f"name at least one {field}", field=field)
    if len(seen) > most:
        raise InvalidRequest(f"at most {most} different {field} values per call", field=field)
    return list(seen)


def flag(value: Any, field: str) -> bool:
    """A yes/no option: True or False only (never 1, "yes" or None)."""
    if not isinstance(value, bool):
        raise InvalidRequest(f"{field} must be true or false", field=field)
    return value


def text(value: Any, field: str, longest: int) -> str:
    """Free text (e.g. a reason): a string of at most `longest` characters, may be empty."""
    if not isinstance(value, str) or len(value) > longest:
        raise InvalidRequest(f"{field} must be a string of at most {longest} characters",
                             field=field)
    if "\x00" in value:
        raise InvalidRequest(f"{field} must not contain NUL characters", field=field)
    _encodable(value, field)
    return value


def _encodable(value: str, field: str) -> None:
    # A lone surrogate (e.g. "\ud800") is a Python str but not Unicode text:
    # it has no UTF-8 form, so the database could never store it.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field} must be valid Unicode text (no lone surrogates)",
                             field=field) from None


def integer(value: Any, field: str, low: int, high: int) -> int:
    # bool is an int subclass in Python; True is not a quantity.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{field} must be an integer", field=field)
    if not low <= value <= high:
        raise InvalidRequest(f"{field} must be between {low} and {high}", field=field)
    return value


def quantity(value: Any, field: str = "quantity") -> int:
    return integer(value, field, 1, MAX_QUANTITY)


def request_key(value: Any) -> str:
    return name(value, "request_key")


def api_key_hash(value: Any) -> bytes | None:
    """An API key's SHA-256 (apikeys.hash_key: 32 bytes), or None."""
    if value is None:
        return None
    if type(value) is not bytes or len(value) != 32:
        raise InvalidRequest("api_key_hash must be the 32-byte SHA-256 of an API key "
                             "(apikeys.hash_key)", field="api_key_hash")
    return value


def tenant_id(value: Any) -> int:
    return integer(value, "tenant", 1, 2**63 - 1)


def ttl(value: Any) -> timedelta:
    if isinstance(value, bool):
        raise InvalidRequest("ttl must be a duration", field="ttl")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest("ttl must be a finite number of seconds", field="ttl")
    if isinstance(value, (int, float)):
        if not MIN_TTL.total_seconds() <= value <= MAX_TTL.total_seconds():
            raise InvalidRequest("ttl must be between 1 second and 24 hours", field="ttl")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise InvalidRequest("ttl must be a duration or a number of seconds", field="ttl")
    if not MIN_TTL <= value <= MAX_TTL:
        raise InvalidRequest("ttl must be between 1 second and 24 hours", field="ttl")
    return value


def strategy(value: Any) -> Strategy | None:
    if value is None:
        return None
    try:
        return Strategy(value)
    except ValueError:
        raise InvalidRequest("strategy must be 'row' or 'pool'", field="strategy") from None


def _require_iterable(lines: Any) -> None:
    if isinstance(lines, (str, bytes)) or not isinstance(lines, Iterable):
        raise InvalidRequest("lines must be a list", field="lines")


def cart(lines: Iterable[Any]) -> list[Line]:
    """Validate a cart and return its lines sorted by (sku, location): the lock order."""
    _require_iterable(lines)
    parsed: list[Line] = []
    sku: Any
    loc: Any
    qty: Any
    for i, raw in enumerate(lines):
        if isinstance(raw, Line):
            sku, loc, qty = raw.sku, raw.location, raw.quantity
        elif isinstance(raw, dict):
            raw = _without_split(raw, i)
            unknown = set(raw) - {"sku", "location", "quantity"}
            if unknown:
                raise InvalidRequest(f"line {i + 1} has unknown fields: {sorted(unknown)}")
            sku, loc, qty = raw.get("sku"), raw.get("location"), raw.get("quantity")
        elif isinstance(raw, (tuple, list)) and len(raw) == 3:
            sku, loc, qty = raw
        else:
            raise InvalidRequest(f"line {i + 1} must be (sku, location, quantity)")
        parsed.append(Line(name(sku, "sku"), name(loc, "location"), quantity(qty)))
        if len(parsed) > MAX_LINES:
            raise InvalidRequest(f"a cart has at most {MAX_LINES} lines", field="lines")
    if not parsed:
        raise InvalidRequest("a cart needs at least one line", field="lines")
    parsed.sort(key=lambda line: (line.sku, line.location))
    for a, b in itertools.pairwise(parsed):
        if (a.sku, a.location) == (b.sku, b.location):
            raise InvalidRequest(
                f"two lines for the same stock ({a.sku!r} at {a.location!r}); merge them",
                field="lines",
            )
    return parsed


def _without_split(raw: dict[str, Any], i: int) -> dict[str, Any]:
    """Line i + 1 (a dict that names its location) without its "split": false, the
    default, changes nothing there; anything else is refused."""
    if "split" not in raw:
        return raw
    if raw["split"] is not False:
        raise InvalidRequest(f"line {i + 1} names a location: split applies only "
                             "to a line without one", field="split")
    return {k: v for k, v in raw.items() if k != "split"}


def line_list(lines: Any) -> list[Any]:
    """The raw lines of a cart as a list (checked one by one later)."""
    _require_iterable(lines)
    return list(lines)


def _names_no_location(raw: Any) -> bool:
    """Whether one raw cart line names no location: an AllocatedLine, a dict whose
    location is absent or None, or a (sku, None, quantity) tuple."""
    return (isinstance(raw, AllocatedLine)
            or (isinstance(raw, dict) and raw.get("location") is None)
            or (isinstance(raw, (tuple, list)) and len(raw) == 3 and raw[1] is None))


def allocates(lines: list[Any]) -> bool:
    """Whether a line of the cart names no location (see _names_no_location)."""
    return any(_names_no_location(raw) for raw in lines)


def allocated_cart(lines: list[Any]) -> tuple[list[Line], list[AllocatedLine]]:
    """Validate a cart with lines that name no location: its explicit lines sorted by
    (sku, location) as `cart` returns them, and its allocated lines sorted by SKU, at
    most one per SKU."""
    explicit: list[Any] = []
    allocated: list[AllocatedLine] = []
    sku: Any
    qty: Any
    split: Any
    for i, raw in enumerate(lines):
        if not _names_no_location(raw):
            explicit.append(_without_split(raw, i) if isinstance(raw, dict) else raw)
            continue
        if isinstance(raw, AllocatedLine):
            sku, qty, split = raw.sku, raw.quantity, raw.split
        elif isinstance(raw, dict):
            unknown = set(raw) - {"sku", "location", "quantity", "split"}
            if unknown:
                raise InvalidRequest(f"line {i + 1} has unknown fields: {sorted(unknown)}")
            sku, qty, split = raw.get("sku"), raw.get("quantity"), raw.get("split", False)
        else:  # (sku, None, quantity)
            sku, qty, split = raw[0], raw[2], False
        allocated.append(AllocatedLine(name(sku, "sku"), quantity(qty), flag(split, "split")))
    if len(lines) > MAX_LINES:
        raise InvalidRequest(f"a cart has at most {MAX_LINES} lines", field="lines")
    fixed = cart(explicit) if explicit else []
    allocated.sort(key=lambda line: line.sku)
    for a, b in itertools.pairwise(allocated):
        if a.sku == b.sku:
            raise InvalidRequest(
                f"two lines without a location for the same SKU ({a.sku!r}); merge them",
                field="lines")
    for line in allocated:
        merged = line.quantity + max((x.quantity for x in fixed if x.sku == line.sku),
                                     default=0)
        if merged > MAX_QUANTITY:
            raise InvalidRequest(
                f"{line.sku!r}: an explicit line and the line without a location may share "
                f"a location, at most {MAX_QUANTITY} units together", field="lines")
    return fixed, allocated


def locations(values: Any, field: str = "locations") -> list[str]:
    """A location priority: at most 100 different location names, in order (may be
    empty); a name given twice is refused (its place would be ambiguous)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidRequest(f"{field} must be a list of location names", field=field)
    found = [name(v, field) for v in values]
    if len(found) > MAX_LINES:
        raise InvalidRequest(f"{field} names at most {MAX_LINES} locations", field=field)
    if len(set(found)) != len(found):
        raise InvalidRequest(f"{field} names a location twice", field=field)
    return found


MAX_URL = 2000
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
# No control or space characters, written out: Python's \s and JSON Schema's
# (ECMA-262) differ (U+0085 is one to Python only), and both must agree.
_NOSPACE = (r"\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f"
            r"\u3000\ufeff")
# http(s)://[userinfo@]host[:port][/path?query#fragment], no spaces or control characters.
# The OpenAPI schema publishes the same pattern.
# The host: a name or IPv4 address, or an IPv6 address in brackets (RFC 3986's
# IPv6address, so the published pattern admits exactly the valid ones).
_H16 = "[0-9A-Fa-f]{1,4}"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LS32 = rf"({_H16}:{_H16}|{_OCTET}(\.{_OCTET}){{3}})"


def _before(n: int) -> str:
    """[ *n( h16 ":" ) h16 ]: up to n + 1 groups before a "::"."""
    return "" if n < 0 else rf"({_H16}(:{_H16}){{0,{n}}})?"


_IPV6 = "(" + "|".join([
    rf"({_H16}:){{6}}{_LS32}",
    rf"::({_H16}:){{5}}{_LS32}",
    *(rf"{_before(k - 1)}::({_H16}:){{{4 - k}}}{_LS32}" for k in range(1, 5)),
    rf"{_before(4)}::{_LS32}",
    rf"{_before(5)}::{_H16}",
    rf"{_before(6)}::",
]) + ")"
# a host name's labels: 1 to 63 characters each, one dot between two (a trailing dot
# allowed); no resolver takes an empty label (shop..example.com) or a longer one
_LABEL = rf"[^{_NOSPACE}/?#@:\[\].]{{1,63}}"
URL_PATTERN = (rf"^[Hh][Tt][Tt][Pp][Ss]?://([^{_NOSPACE}/?#@\[\]]+@)?"
               rf"({_LABEL}(\.{_LABEL})*\.?|\[{_IPV6}\])(:{_PORT})?"
               rf"([/?#][^{_NOSPACE}]*)?$")
_URL = re.compile(URL_PATTERN)


def webhook_url(value: Any) -> str:
    """An absolute http:// or https:// URL with a host, at most 2000 characters."""
    if not isinstance(value, str):
        raise InvalidRequest("url must be a string", field="url")
    if len(value) > MAX_URL:
        raise InvalidRequest(f"url must be at most {MAX_URL} characters", field="url")
    _encodable(value, "url")
    if not _URL.fullmatch(value):
        raise InvalidRequest("url must be an http:// or https:// URL with a host (labels "
                             "of 1 to 63 characters, and no spaces)", field="url")
    try:
        host = urlsplit(value).hostname or ""
        if ":" in host:
            ipaddress.IPv6Address(host)
    except ValueError:
        raise InvalidRequest("url has a malformed IPv6 address", field="url") from None
    return value
