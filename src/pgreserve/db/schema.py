"""The PostgreSQL schema that holds pgreserve's tables and functions.

Every pgreserve object lives in one schema of its own (default `pgreserve`,
or PGRESERVE_SCHEMA), so that it never meets a shop's own `tenant` or
`reservation`. No connection relies on a session-level search_path: a
PgBouncer server connection in transaction pooling would lose it (or hand it
to another client). Each transaction pgreserve runs sets it with SET LOCAL in
the message that begins the transaction, and the functions a caller's own
transaction may call carry their search_path in their definition.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
from psycopg import sql

from ..errors import InvalidRequest
from .queries import queries

DEFAULT_SCHEMA = "pgreserve"
ENV = "PGRESERVE_SCHEMA"

# Lower-case identifiers only: the name is the same quoted or not, in every tool.
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check(name: str) -> str:
    """`name` if it can name pgreserve's schema; InvalidRequest otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or name.startswith("pg_"):
        raise InvalidRequest(
            f"schema name {name!r} is not usable: lower-case letters, digits and _ "
            "(at most 63, not starting with a digit or pg_)")
    return name


def resolve(name: str | None = None) -> str:
    """The schema to use: `name`, else PGRESERVE_SCHEMA, else `pgreserve`."""
    if name is None:
        name = os.environ.get(ENV) or DEFAULT_SCHEMA
    return check(name)


def use(name: str) -> str:
    """Make `name` this process's default schema (and its child processes')."""
    os.environ[ENV] = check(name)
    return name


def search_path(name: str) -> sql.Composed:
    """`SET LOCAL search_path` to the schema alone (pg_catalog is always searched)."""
    return sql.SQL(queries["transaction_search_path"]).format(sql.Identifier(check(name)))


@contextmanager
def transaction(conn: psycopg.Connection[Any], name: str) -> Iterator[None]:
    """A transaction on `conn` whose unqualified names resolve in the schema."""
    with conn.transaction():
        conn.execute(search_path(name))
        yield


@asynccontextmanager
async def atransaction(conn: psycopg.AsyncConnection[Any], name: str) -> AsyncIterator[None]:
    """`transaction` for an async connection."""
    async with conn.transaction():
        await conn.execute(search_path(name))
        yield
