"""Connection pool, per-transaction timeouts, retries and error mapping."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
from psycopg import AsyncClientCursor
from psycopg import sql as sql_
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from .. import errors

log = logging.getLogger(__name__)

# Typed failures raised by the SQL functions (see 0002_functions.sql).
_SQLSTATE_ERRORS: dict[str, type[errors.PgReserveError]] = {
    "PR401": errors.UnknownTenant,
    "PR404": errors.UnknownStock,
    "PR410": errors.ReservationNotFound,
    "PR412": errors.WouldOversell,
    "PR422": errors.IdempotencyKeyReused,
    "PR423": errors.ReservationReleased,
    "PR424": errors.ReservationClaimed,
    "PR425": errors.ReservationExpired,
    "PR426": errors.ReservationNotActive,
}
_RETRY_WHOLE = {"40P01", "40001", "PR409"}  # deadlock, serialization, key committed first
_BUSY = {"55P03", "57014"}  # lock_timeout, statement_timeout


@dataclass(frozen=True)
class TxSettings:
    """Limits applied with SET LOCAL-equivalents in every transaction."""

    lock_timeout_ms: int = 2000
    statement_timeout_ms: int = 10000
    max_attempts: int = 6
    backoff_base_s: float = 0.005
    backoff_cap_s: float = 0.2


@dataclass
class Stats:
    """Counters of what the retry loop saw (the bench and metrics read them)."""

    deadlocks_retried: int = 0
    serialization_retried: int = 0
    duplicate_key_retried: int = 0
    connection_retried: int = 0
    busy: int = 0


class Database:
    """An async pool of connections to one database, running one-statement transactions."""

    def __init__(self, conninfo: str, *, min_size: int = 1, max_size: int = 10,
                 application_name: str = "pgreserve:core",
                 settings: TxSettings | None = None,
                 prepare_threshold: int | None = 5) -> None:
        self.conninfo = conninfo
        self.settings = settings or TxSettings()
        self.stats = Stats()
        self._begin = sql_.SQL(
            "BEGIN; SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {}"
        ).format(sql_.Literal(f"{int(self.settings.lock_timeout_ms)}ms"),
                 sql_.Literal(f"{int(self.settings.statement_timeout_ms)}ms"))
        self.pool = AsyncConnectionPool(
            conninfo,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={
                "autocommit": True,
                "application_name": application_name,
                "prepare_threshold": prepare_threshold,
            },
            name=application_name,
        )

    async def open(self) -> Database:
        await self.pool.open(wait=True, timeout=30)
        return self

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> Database:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, sql: LiteralString, params: Sequence[Any] | Mapping[str, Any] = ()) -> Any:
        """Run one statement in its own transaction and return the first column of the first row.

        Deadlocks, serialization failures and lost connections are retried as
        whole transactions with bounded, jittered backoff (every operation is
        idempotent: by request key or by state). Lock and statement timeouts
        surface as Busy. Typed SQLSTATEs become their PgReserveError.
        """
        s = self.settings
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._once(sql, params)
            except psycopg.errors.Error as exc:
                state = exc.sqlstate or ""
                if state in _SQLSTATE_ERRORS:
                    raise _typed(exc, state) from None
                if state in _BUSY:
                    self.stats.busy += 1
                    raise errors.Busy(f"database busy: {exc.diag.message_primary}",
                                      sqlstate=state) from exc
                lost = _connection_lost(exc, state)
                if state in _RETRY_WHOLE or lost:
                    if state == "40P01":
                        self.stats.deadlocks_retried += 1
                    elif state == "40001":
                        self.stats.serialization_retried += 1
                    elif state == "PR409":
                        self.stats.duplicate_key_retried += 1
                        if attempt < s.max_attempts:
                            continue  # the stored outcome is there now
                    else:
                        self.stats.connection_retried += 1
                    if attempt >= s.max_attempts:
                        if lost:
                            raise errors.OutcomeUnknown(
                                "the database connection failed; retry with the same request key",
                            ) from exc
                        raise errors.Busy(f"gave up after {attempt} attempts: {exc}",
                                          sqlstate=state) from exc
                    delay = min(s.backoff_cap_s, s.backoff_base_s * 2 ** (attempt - 1))
                    await asyncio.sleep(random.uniform(0, delay))
                    continue
                raise

    async def _once(self, sql: LiteralString, params: Sequence[Any] | Mapping[str, Any]) -> Any:
        async with self.pool.connection() as conn:
            # One message, one round trip: BEGIN, the transaction-local limits,
            # the call and COMMIT as a multi-statement simple query. The
            # transaction never waits on the client while it holds locks.
            # Values are bound by psycopg's client-side binding (escaped
            # literals); no prepared statement is left on the server, which
            # keeps the call valid through PgBouncer's transaction pooling.
            # (The extended-protocol pipeline did the same in one round trip
            # but cost the client about twice the CPU per call.)
            cur = AsyncClientCursor(conn, row_factory=tuple_row)
            try:
                await cur.execute(self._wrap(sql), params)
            except BaseException:
                if not conn.closed and \
                        conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    await conn.execute("ROLLBACK")
                raise
            while cur.pgresult is not None and \
                    cur.pgresult.status != psycopg.pq.ExecStatus.TUPLES_OK:
                if not cur.nextset():
                    return None
            row = await cur.fetchone()
            return None if row is None else row[0]

    def _wrap(self, sql: LiteralString) -> sql_.Composed:
        return sql_.SQL("{}; {}; COMMIT").format(self._begin, sql_.SQL(sql))

    async def fetch(self, sql: LiteralString,
                    params: Sequence[Any] | Mapping[str, Any] = ()) -> list[tuple[Any, ...]]:
        """Run a read-only query (autocommit) and return all rows."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, params)
            return await cur.fetchall()


def _connection_lost(exc: psycopg.errors.Error, state: str) -> bool:
    """The connection went away: the server was shut down or the backend was
    terminated (57P01-57P03), a connection exception (class 08), or a dead
    socket (no SQLSTATE at all). The outcome of an in-flight COMMIT is unknown."""
    if state:
        return state in {"57P01", "57P02", "57P03"} or state.startswith("08")
    return isinstance(exc, psycopg.OperationalError)


def _typed(exc: psycopg.errors.Error, state: str) -> errors.PgReserveError:
    cls = _SQLSTATE_ERRORS[state]
    detail: Any = exc.diag.message_detail
    if detail is not None and detail[:1] in "[{":
        detail = json.loads(detail)
    return cls(exc.diag.message_primary or cls.__name__, detail=detail)
