"""Entity tags of stock lines: the ETag header and the If-Match / If-None-Match preconditions.

A stock line's ETag is weak, `W/"<version>"`: the version moves with every write an
operator makes (counts, adjustments, strategy) and never with holds, claims, releases
or expiry, so the body's live counts change under one tag. If-Match is therefore
compared weakly (`W/"7"` and `"7"` both name version 7); the database checks it in the
write itself (sql/functions/stock.sql).
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import quote

from fastapi import Request

from .. import errors
from . import problems

_TAG = r'(?:W/)?"[\x21\x23-\x7e\x80-\xff]*"'
_TAG_LIST = re.compile(rf"^\s*(?:{_TAG}|)\s*(?:,\s*(?:{_TAG}|)\s*)*$")
_TAG_VALUE = re.compile(r'(?:W/)?"([^"]*)"')
_VERSION = re.compile(r"^[1-9][0-9]{0,18}$")
MAX_VERSION = 2**63 - 1


def etag(version: int) -> str:
    return f'W/"{version}"'


def etag_headers(version: int | None) -> dict[str, str]:
    return {} if version is None else {"ETag": etag(version)}


def if_match(value: str | None) -> list[int] | Literal["*"] | None:
    """The versions an If-Match header allows ("*": any, the line must exist). A tag that
    is not one of ours can never match: it is left out, so a list of only such tags is
    empty and the write is refused with 412."""
    if value is None:
        return None
    if value.strip() == "*":
        return "*"
    if not _TAG_LIST.match(value) or not _TAG_VALUE.search(value):
        raise problems.PreconditionInvalid(
            'If-Match must be "*" or a list of entity tags such as W/"3"')
    versions = []
    for opaque in _TAG_VALUE.findall(value):
        if _VERSION.match(opaque) and int(opaque) <= MAX_VERSION:
            versions.append(int(opaque))
    return versions


def create_only(value: str | None) -> bool:
    """If-None-Match on a write: only `*` (create the line, refuse if it exists)."""
    if value is None:
        return False
    if value.strip() != "*":
        raise problems.PreconditionInvalid(
            'only If-None-Match: * (create only) is evaluated on this write')
    return True


def contradiction() -> errors.PreconditionFailed:
    """If-Match and If-None-Match: * together: no line is both there and not there."""
    return errors.PreconditionFailed("If-Match and If-None-Match: * cannot both hold",
                                     version=None)


def location_of(request: Request, *segments: str) -> str:
    """The Location of a created resource: its path under the app's root path. A name
    "." or ".." is sent as %2E or %2E%2E: bare, it is a dot-segment, and a client
    resolving the URL (RFC 3986 5.2.4) would go to another resource."""
    root = str(request.scope.get("root_path") or "").rstrip("/")
    return root + "/" + "/".join(_segment(s) for s in segments)


def _segment(name: str) -> str:
    if name in (".", ".."):
        return "%2E" * len(name)
    return name if _UNRESERVED.fullmatch(name) else quote(name, safe="")


# what quote(safe="") leaves as it is (a reservation id, a route's own segments)
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]*")
