"""Array and interval values as PostgreSQL text, for the hottest call.

psycopg adapts a Python list element by element in Python, which cost the
reserve call more client CPU than anything else it does. A cart's arrays are
plain text and integers, so they are written here as array literals and sent
as one text value each (cast in the statement); psycopg then only has to quote
a string, which it does in C.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta


def text_array(values: Iterable[str]) -> str:
    """`{"a","b"}`: every element double-quoted, with backslash and quote escaped.

    Quoted elements keep their spaces and braces and are never read as NULL.
    NUL characters are refused before this is called (PostgreSQL text cannot hold them).
    """
    return "{" + ",".join(_quoted(v) for v in values) + "}"


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def int_array(values: Iterable[int]) -> str:
    """`{1,2}` from Python ints (bools and other types are refused before this)."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"


def interval(value: timedelta) -> str:
    """An exact interval literal: whole microseconds."""
    return f"{value // timedelta(microseconds=1)} microseconds"


def nullable_text_array(values: Iterable[str | None]) -> str:
    """`{"a",NULL}`: like text_array, with None as an SQL NULL element."""
    return "{" + ",".join("NULL" if v is None else _quoted(v) for v in values) + "}"


def nullable_int_array(values: Iterable[int | None]) -> str:
    """`{1,NULL}` from Python ints and None."""
    return "{" + ",".join("NULL" if v is None else str(int(v)) for v in values) + "}"


def nullable_bytea_array(values: Iterable[bytes | None]) -> str:
    """`{"\\x0a1b",NULL}`: bytea elements in hex form, None as an SQL NULL element."""
    return "{" + ",".join("NULL" if v is None else '"\\\\x' + v.hex() + '"'
                          for v in values) + "}"
