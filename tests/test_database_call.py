"""Database.call: one statement in its own transaction, values bound as literals on the client."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pgreserve import Database
from pgreserve.db.database import _Statement
from test_literals import HOSTILE


def test_statement_splits_at_placeholders_only() -> None:
    st = _Statement.parse(b"SELECT %s, '100%%', %s")
    assert st.parts == (b"SELECT ", b", '100%', ", b"")


def test_named_placeholders_are_refused() -> None:
    with pytest.raises(psycopg.ProgrammingError, match="only %s placeholders"):
        _Statement.parse(b"SELECT %(x)s")


async def test_values_of_every_kind_come_back_as_sent(db: Database) -> None:
    when = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)
    values = [1, -5, 2**62, None, True, uuid.uuid4(), when, timedelta(seconds=90), *HOSTILE]
    for value in values:
        assert await db.call("SELECT %s", (value,)) == value
    assert await db.call("SELECT %s::text || '%%'", ("100",)) == "100%"


async def test_placeholder_count_must_match(db: Database) -> None:
    with pytest.raises(psycopg.ProgrammingError, match="2 placeholders but 1 parameters"):
        await db.call("SELECT %s, %s", (1,))


async def test_a_failed_call_leaves_nothing_and_the_connection_idle(db: Database,
                                                                     dsn: str) -> None:
    """An error inside the one-message transaction rolls it back whole; the pool's
    connection is idle again and serves the next call."""
    name = f"t_{uuid.uuid4().hex[:8]}"
    # `name` is this test's own random identifier: no input reaches the SQL
    await db.call(f"CREATE TABLE {name} (x int CHECK (x > 0))")
    with pytest.raises(psycopg.errors.CheckViolation):
        await db.call(f"WITH a AS (INSERT INTO {name} VALUES (1)) "  # noqa: S608 - see above
                      f"INSERT INTO {name} VALUES (%s)", (-1,))
    assert await db.call(f"SELECT count(*) FROM {name}") == 0  # noqa: S608 - see above
    assert await db.call("SELECT 7") == 7
    assert await db.call("SELECT 1 WHERE false") is None
