"""Connection pool, per-transaction timeouts, retries and error mapping."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import re
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, LiteralString, cast

import psycopg
from psycopg import generators, pq, waiting
from psycopg import sql as sql_
from psycopg.abc import Transformer as _Adapt
from psycopg.adapt import Transformer
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .. import errors
from . import migration_check
from . import schema as schemas
from .queries import queries

log = logging.getLogger(__name__)

# Typed failures raised by the SQL functions (sql/functions/).
_SQLSTATE_ERRORS: dict[str, type[errors.PgReserveError]] = {
    "PR400": errors.InvalidRequest,
    "PR401": errors.UnknownTenant,
    "PR403": errors.ApiKeyRefused,
    "PR404": errors.UnknownStock,
    "PR410": errors.ReservationNotFound,
    "PR412": errors.WouldOversell,
    "PR422": errors.IdempotencyKeyReused,
    "PR423": errors.ReservationReleased,
    "PR424": errors.ReservationClaimed,
    "PR425": errors.ReservationExpired,
    "PR426": errors.ReservationNotActive,
    "PR427": errors.ExtendWouldShorten,
    "PR429": errors.BackorderedHoldUnchangeable,
}
_CONTENTION = {"40P01", "40001"}  # deadlock, serialization failure
_RETRY_WHOLE = _CONTENTION | {"PR409"}  # and a key committed first
_BUSY = {"55P03", "57014"}  # lock_timeout, statement_timeout
# A pool take that held some of a bucket's units and needed lower ones that other
# buyers held may not wait for them (a wait that could close a cycle): it fails with
# this hint and the bucket's id as DETAIL, and the retry names that bucket in
# pgreserve.wait_for_units, so that its take there waits for them (bucket_take_v1).
_WAIT_FOR_UNITS_HINT = "pgreserve: wait for units"


def _wait_for_units(exc: psycopg.errors.Error) -> str | None:
    """The bucket id a hinted serialization failure names, else None."""
    detail = exc.diag.message_detail or ""
    if exc.diag.message_hint == _WAIT_FOR_UNITS_HINT and detail.isascii() and detail.isdigit():
        return detail
    return None
# undefined_table, undefined_function, invalid_schema_name: pgreserve's schema is not there
_NOT_MIGRATED = {"42P01", "42883", "3F000"}


@dataclass(frozen=True)
class TxSettings:
    """Limits applied with SET LOCAL-equivalents in every transaction.

    `pool_wait_s`: the longest a call waits for a connection of the pool (less
    when its deadline is nearer); past it the call is `Busy`, never sent.

    `contention_retry_s`: contention (a deadlock, a serialization failure, a
    bucket short of units other transactions are taking) is retried for at
    least this long from the call's start, even past `max_attempts`, and never
    past the call's deadline. Under a sale's load one bucket row is rarely
    free, and a count of attempts alone runs out within a few hundred
    milliseconds; 0 leaves `max_attempts` the only bound. A group-commit
    batch (a call on a `Session`) keeps `max_attempts` alone: while it
    retries, its bucket's queue waits.

    `call_deadline_s`: the deadline of a call made outside any (`deadline()`,
    `deadline=`), from its start; None (the default) sets none, and then a
    server that stops answering (a frozen host, a partition) is waited for as
    long as it takes. The background workers run with one.
    """

    lock_timeout_ms: int = 2000
    statement_timeout_ms: int = 10000
    max_attempts: int = 6
    backoff_base_s: float = 0.005
    backoff_cap_s: float = 0.2
    pool_wait_s: float = 1.0
    contention_retry_s: float = 5.0
    call_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.call_deadline_s is not None and not 0 < self.call_deadline_s <= 86400:
            raise ValueError("call_deadline_s must be None or between 0 and 86400 seconds")


# The monotonic time by which the calls of the current request must be done
# (None: no deadline). Set by `deadline()`; the HTTP layer sets one per request.
_deadline: ContextVar[float | None] = ContextVar("pgreserve_deadline", default=None)


@contextmanager
def deadline(seconds: float | None) -> Iterator[float | None]:
    """Run the calls inside under a deadline `seconds` from now (None: no new one).

    An enclosing earlier deadline stays in force. Inside, a call waits for a pool
    connection at most until the deadline (and `pool_wait_s`), its transaction's
    statement_timeout is cut to the time left, and no retry starts after it.
    """
    outer = _deadline.get()
    if seconds is None:
        yield outer
        return
    end = time.monotonic() + seconds
    if outer is not None:
        end = min(end, outer)
    token = _deadline.set(end)
    try:
        yield end
    finally:
        _deadline.reset(token)


@contextmanager
def deadline_at(end: float | None) -> Iterator[None]:
    """Run the calls inside under exactly this monotonic deadline (None: none)."""
    token = _deadline.set(end)
    try:
        yield
    finally:
        _deadline.reset(token)


def current_deadline() -> float | None:
    """The monotonic deadline of the calls made here, or None."""
    return _deadline.get()


@dataclass(frozen=True)
class Op:
    """Who runs a statement: the business process (a pool of its own, so its
    connections carry application_name `pgreserve:<role>`) and a static
    sqlcommenter-style tag appended to the statement text.

    The tag holds no per-request value, so every execution of one call site has
    one text: pg_stat_statements keeps it (comments do not change the query id)
    and psycopg's prepared-statement cache keeps working.
    """

    role: str
    action: str
    route: str
    comment: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for part in (self.role, self.action, self.route):
            if any(c in part for c in "%*\n") or "," in part:
                raise ValueError(f"op tag part {part!r} may not contain % * , or newline")
        object.__setattr__(self, "comment",
                           f" /* app=pgreserve,route={self.route},action={self.action} */")


def tagged(sql: str, op: Op | None) -> LiteralString:
    """The statement with its op's static comment appended (after the last token)."""
    # mypy reads LiteralString as str; the cast is for checkers that enforce it
    return cast(LiteralString, sql if op is None else sql + op.comment)  # type: ignore[redundant-cast]


Observer = Callable[[str, str], None]  # (action, event) e.g. ("reserve", "deadlock_retried")


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
                 prepare_threshold: int | None = 5,
                 role_pools: bool = False, role_max_size: int | None = None,
                 observer: Observer | None = None, schema: str | None = None,
                 check_schema: bool = True) -> None:
        """`role_pools`: run each tagged statement on the pool of its Op's role
        (application_name `pgreserve:<role>`, opened on first use, min_size 0);
        untagged statements use the main pool named `application_name`.
        `schema`: where pgreserve's tables and functions are (default
        PGRESERVE_SCHEMA, else `pgreserve`); every transaction sets its
        search_path to it, in the message that begins it.
        `check_schema`: `open()` refuses a database this pgreserve's migrations do not
        match (DatabaseNotMigrated, DatabaseTooNew; db/migration_check.py)."""
        self.conninfo = conninfo
        self.schema = schemas.resolve(schema)
        self.check_schema = check_schema
        self.settings = settings or TxSettings()
        self.stats = Stats()
        self.observer = observer
        self._statements: dict[str, _Statement] = {}
        where = sql_.Identifier(self.schema)
        begin = sql_.SQL(queries["transaction_begin"]).format(
            where, sql_.Literal(f"{int(self.settings.lock_timeout_ms)}ms"),
            sql_.Literal(_TIMEOUT_MARK)).as_bytes(None)
        self._begin_read = sql_.SQL(queries["transaction_begin_read"]).format(
            where).as_bytes(None) + b"; "
        self._begin_read_committed = sql_.SQL(
            queries["transaction_begin_read_committed"]).format(where).as_bytes(None) + b"; "
        self._commit = b"; " + queries["transaction_commit"].encode()
        # Under a deadline the statement_timeout literal is the time left (in ms).
        head, _, tail = begin.partition(b"'" + _TIMEOUT_MARK.encode() + b"'")
        self._begin_parts = (head, tail)
        self._begin = self._begin_for(int(self.settings.statement_timeout_ms))
        self.prepare_threshold = prepare_threshold
        self.role_pools = role_pools
        self.role_max_size = role_max_size or max_size
        self.pool = self._new_pool(application_name, min_size, max_size)
        self.pools: dict[str, AsyncConnectionPool] = {application_name: self.pool}
        self._opening = asyncio.Lock()

    def _new_pool(self, name: str, min_size: int, max_size: int) -> AsyncConnectionPool:
        return AsyncConnectionPool(
            self.conninfo,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={
                "autocommit": True,
                "application_name": name,
                "prepare_threshold": self.prepare_threshold,
            },
            name=name,
        )

    async def _pool_for(self, op: Op | None) -> AsyncConnectionPool:
        if op is None or not self.role_pools:
            return self.pool
        name = f"pgreserve:{op.role}"
        pool = self.pools.get(name)
        if pool is not None:
            return pool
        async with self._opening:
            pool = self.pools.get(name)
            if pool is None:
                pool = self._new_pool(name, 0, self.role_max_size)
                await pool.open(wait=False)
                self.pools[name] = pool
        return pool

    def pool_stats(self) -> dict[str, dict[str, int]]:
        """psycopg_pool's counters of every pool, by application_name."""
        return {name: dict(pool.get_stats()) for name, pool in self.pools.items()}

    def _begin_for(self, statement_timeout_ms: int) -> bytes:
        head, tail = self._begin_parts
        return b"%s'%dms'%s; " % (head, statement_timeout_ms, tail)

    def _end(self) -> float | None:
        """The deadline of a call starting now without one of its own: the
        enclosing `deadline()`, else `call_deadline_s` from now, else none."""
        end = _deadline.get()
        if end is None and self.settings.call_deadline_s is not None:
            end = time.monotonic() + self.settings.call_deadline_s
        return end

    def _pool_wait(self, end: float | None) -> float:
        """How long an attempt starting now may wait for a connection; _Late when
        the deadline has passed."""
        if end is None:
            return self.settings.pool_wait_s
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise _Late
        return min(self.settings.pool_wait_s, remaining)

    def _begin_until(self, end: float | None) -> bytes:
        """The BEGIN text of a transaction starting now: its statement_timeout is
        cut to the time left before the deadline; _Late when none is left."""
        if end is None:
            return self._begin
        ms = int((end - time.monotonic()) * 1000)
        if ms <= 0:
            raise _Late
        return self._begin if ms >= self.settings.statement_timeout_ms else self._begin_for(ms)

    def _gave_up(self, op: Op | None, maybe_ran: bool, why: str,
                 sqlstate: str | None = None) -> errors.PgReserveError:
        """Busy when no attempt can have reached the database; OutcomeUnknown otherwise."""
        if maybe_ran:
            self._emit(op, "unknown_outcome")
            return errors.OutcomeUnknown(
                f"{why}; an earlier attempt lost its connection after the statement was "
                "sent, so it may have committed: retry with the same request key")
        self.stats.busy += 1
        self._emit(op, "busy")
        return errors.Busy(f"{why}; nothing was done, retry later", sqlstate=sqlstate)

    def _not_run_again(self, op: Op | None, exc: psycopg.errors.Error) -> errors.OutcomeUnknown:
        """A write that is not replay-safe lost its connection after it was sent."""
        self._emit(op, "unknown_outcome")
        return errors.OutcomeUnknown(
            f"the database connection was lost after the statement was sent "
            f"({_said(exc)}), so it may have committed; it is not run again, since a "
            "second run would not answer as the first did: read the state before "
            "trying again")

    def _raise_refused(self, op: Op | None, exc: psycopg.errors.Error,
                       maybe_ran: bool) -> None:
        """End the call (of `call` or `fetch`) on an error no retry can change: a typed
        SQLSTATE as its PgReserveError, a lock or statement timeout as Busy (or
        OutcomeUnknown when an earlier attempt may have run). Returns otherwise."""
        state = exc.sqlstate or ""
        if state in _SQLSTATE_ERRORS:
            raise _typed(exc, state) from None
        if state in _NOT_MIGRATED:
            raise errors.DatabaseNotMigrated(
                f"the database lacks part of pgreserve's schema ({exc.diag.message_primary}): "
                f"run `{migration_check.migrate_command(self.conninfo, self.schema)}`",
                command=migration_check.migrate_command(self.conninfo, self.schema)) from exc
        if state in _BUSY:
            raise self._gave_up(op, maybe_ran, f"database busy: {exc.diag.message_primary}",
                                state) from exc

    def _backoff(self, attempt: int) -> float:
        """The jittered wait before retry number `attempt` (1-based)."""
        s = self.settings
        # (the exponent stops growing long before the cap: retries under the
        # contention window may run to hundreds, and 2.0 ** 1024 overflows)
        return random.uniform(  # noqa: S311 - jitter, no secret
            0, min(s.backoff_cap_s, s.backoff_base_s * 2.0 ** min(attempt - 1, 60)))

    def _emit(self, op: Op | None, event: str) -> None:
        if self.observer is not None:
            try:
                self.observer(op.action if op else "other", event)
            except Exception:  # metrics must never fail an operation
                log.exception("metrics observer failed")

    async def open(self) -> Database:
        try:
            await self.pool.open(wait=True, timeout=30)
        except BaseException:
            await self.close()  # (a pool that did not fill in time stops trying)
            raise
        if self.check_schema:
            try:
                async with self.pool.connection() as conn:
                    await migration_check.check_connection(conn, self.conninfo, self.schema)
            except BaseException:
                await self.close()
                raise
        return self

    async def close(self) -> None:
        for pool in list(self.pools.values()):
            await pool.close()

    async def __aenter__(self) -> Database:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def session(self, op: Op | None = None) -> Session:
        """A connection of the pool kept for a run of calls (`call(..., session=)`):
        back-to-back transactions on one warm session (its plans and compiled
        functions), without a pool checkout each. A call whose connection is lost
        hands it back and retries on a new one; `Session.contended` tells the
        holder to let others have a turn."""
        return Session(self, op)

    async def call(self, sql: LiteralString,
                   params: Sequence[Any] | Callable[[bool], Sequence[Any]] = (),
                   *, op: Op | None = None, session: Session | None = None,
                   deadline: float | None = None, replay_safe: bool = True) -> Any:
        """Run one statement in its own transaction and return the first column of the first row.

        Deadlocks, serialization failures and lost connections are retried as
        whole transactions with bounded, jittered backoff (the operation is
        idempotent: by request key or by state). Lock and statement timeouts
        surface as Busy. Typed SQLSTATEs become their PgReserveError.

        `params` may be a function, called for each attempt's values once it has its
        connection (a batch sends again only the requests not answered yet), with
        whether an earlier attempt's statement may have committed; an exception it
        raises ends the call.

        `replay_safe=False`: an operation whose second run would answer otherwise
        once the first committed (a conditional write: its condition no longer holds;
        a create: the name is taken, or a second one is made; a removal: nothing is
        left to remove). A connection lost after its statement was sent ends the call
        at once with OutcomeUnknown instead of a retry whose refusal would be taken
        for the answer.

        `deadline` (monotonic time; default: the one `deadline()` set here)
        bounds the whole call: the wait for a connection, the transaction's
        statement_timeout and every retry. A call that cannot start in time, or
        whose every attempt was refused before or without committing, is Busy;
        one whose statement was sent on a connection that was then lost, and not
        resolved by a retry, is OutcomeUnknown.
        """
        s = self.settings
        sql = tagged(sql, op)
        end = deadline if deadline is not None else self._end()
        started = time.monotonic()
        attempt = 0
        lost_before = False  # an earlier attempt's statement may have reached the database
        wait_for_units: set[str] = set()  # buckets whose takes wait for units first
        while True:
            attempt += 1
            wait = 0.0
            progress = _Progress()
            values = functools.partial(params, lost_before) if callable(params) else params
            try:
                wait = self._pool_wait(end)
                if session is not None:
                    conn = await session.connection(wait)
                    result = await self._run(conn, sql, values, end, wait_for_units,
                                             not replay_safe, progress)
                else:
                    result = await self._once(sql, values, op, wait, end, wait_for_units,
                                              not replay_safe, progress)
                if lost_before:
                    self._emit(op, "unknown_outcome_resolved")
                return result
            except _Late:
                raise self._gave_up(op, lost_before, "the request deadline passed before "
                                    "the statement could be sent") from None
            except PoolTimeout as exc:
                self._emit(op, "pool_timeout")
                raise self._gave_up(op, lost_before, "no database connection was free "
                                    f"within {wait:.3g} s") from exc
            except psycopg.errors.Error as exc:
                self._raise_refused(op, exc, lost_before)
                state = exc.sqlstate or ""
                lost = _connection_lost(exc, state)
                sent = lost and progress.sent
                if sent and not replay_safe:
                    raise self._not_run_again(op, exc) from exc
                if state in _RETRY_WHOLE or lost:
                    if state == "40P01":
                        self.stats.deadlocks_retried += 1
                        self._emit(op, "deadlock_retried")
                    elif state == "40001":
                        self.stats.serialization_retried += 1
                        self._emit(op, "serialization_retried")
                        bucket = _wait_for_units(exc)
                        if bucket is not None:
                            wait_for_units.add(bucket)
                    elif state == "PR409":
                        self.stats.duplicate_key_retried += 1
                        self._emit(op, "duplicate_key_retried")
                        if attempt < s.max_attempts:
                            continue  # the stored outcome is there now
                    else:
                        self.stats.connection_retried += 1
                        self._emit(op, "connection_retried")
                        lost_before = lost_before or sent
                    delay = self._backoff(attempt)
                    # (a batch's session keeps max_attempts: its retries hold
                    # the bucket's queue, whose requests have deadlines of their own)
                    contended = state in _CONTENTION and session is None and (
                        time.monotonic() + delay - started < s.contention_retry_s)
                    if attempt >= s.max_attempts and not contended:
                        raise self._gave_up(op, lost_before,
                                            f"gave up after {attempt} attempts: {_said(exc)}",
                                            state) from exc
                    if end is not None and time.monotonic() + delay >= end:
                        raise self._gave_up(op, lost_before, f"the request deadline passed "
                                            f"after {attempt} attempt(s): {_said(exc)}",
                                            state) from exc
                    await asyncio.sleep(delay)
                    continue
                if lost_before:  # an earlier attempt may have committed
                    raise self._gave_up(op, True, f"a retry failed: {_said(exc)}") from exc
                raise

    async def _once(self, sql: LiteralString,
                    params: Sequence[Any] | Callable[[], Sequence[Any]],
                    op: Op | None, wait: float, end: float | None,
                    wait_for_units: Collection[str] = (), alive_first: bool = False,
                    progress: _Progress | None = None) -> Any:
        pool = await self._pool_for(op)
        async with pool.connection(timeout=wait) as conn:
            return await self._run(conn, sql, params, end, wait_for_units, alive_first,
                                   progress)

    async def _run(self, conn: psycopg.AsyncConnection[Any], sql: LiteralString,
                   params: Sequence[Any] | Callable[[], Sequence[Any]],
                   end: float | None = None,
                   wait_for_units: Collection[str] = (), alive_first: bool = False,
                   progress: _Progress | None = None) -> Any:
        statement = self._statement(sql)
        begin = self._begin_until(end)  # before anything is sent
        if callable(params):  # (its values as of now, once a connection is had)
            params = params()
        if wait_for_units:  # bucket ids: digits only (_wait_for_units)
            begin += b"SET LOCAL pgreserve.wait_for_units = '%s'; " % ",".join(
                sorted(wait_for_units)).encode()
        # One message, one round trip: BEGIN, the transaction-local limits,
        # the call and COMMIT as a multi-statement simple query. The
        # transaction never waits on the client while it holds locks.
        # Values are bound on the client as escaped literals by psycopg's
        # own dumpers; no prepared statement is left on the server, which
        # keeps the call valid through PgBouncer's transaction pooling.
        # The query goes to libpq directly: a cursor's machinery (query
        # parsing, result sets, row makers) cost a third of the client's
        # CPU per call, and an extended-protocol pipeline twice as much.
        adapt = Transformer(conn)
        pgconn = conn.pgconn
        try:
            _send(pgconn, begin + statement.render(adapt, params), alive_first)
            if progress is not None:
                progress.sent = True
            results = await _results(conn, end)
        except BaseException:
            await _roll_back(conn)
            raise
        value = None
        for res in results:
            if res.status == _FATAL_ERROR:
                await _roll_back(conn)
                raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
            if res.status == _TUPLES_OK and value is None and res.ntuples:
                adapt.set_pgresult(res)
                value = adapt.load_row(0, tuple)[0]
        return value

    def _statement(self, sql: LiteralString) -> _Statement:
        # A handful of statement texts (one per call site): wrap and split
        # each once.
        # The BEGIN text (its limits) goes in front at each call.
        statement = self._statements.get(sql)
        if statement is None:
            wrapped = sql_.SQL("; ").join(
                [sql_.SQL(sql), sql_.SQL(queries["transaction_commit"])])
            statement = self._statements[sql] = _Statement.parse(wrapped.as_bytes(None))
        return statement

    async def fetch(self, sql: LiteralString,
                    params: Sequence[Any] | Mapping[str, Any] = (), *,
                    op: Op | None = None, read_committed: bool = False,
                    replay_safe: bool = True) -> list[tuple[Any, ...]]:
        """Run a query in a transaction of its own and return all rows.

        Like `call`, one message: BEGIN with the schema's search_path, the query
        (values bound on the client) and COMMIT; the server's own isolation and
        limits apply, as they do to an autocommit statement (`read_committed`: READ
        COMMITTED whatever the server's default, for a function whose statements
        must each see what committed before them). `replay_safe=False`: a statement
        that writes and whose second run would answer otherwise, as for `call`. The wait for a
        connection is bounded as in `call`; a lost connection is retried within
        the deadline, then DatabaseUnavailable (a read changes nothing); lock
        and statement timeouts are Busy."""
        s = self.settings
        end = self._end()
        attempt = 0
        while True:
            attempt += 1
            wait = 0.0
            progress = _Progress()
            try:
                wait = self._pool_wait(end)
                pool = await self._pool_for(op)
                async with pool.connection(timeout=wait) as conn:
                    return await self._read(conn, tagged(sql, op), params, end,
                                            read_committed, progress, not replay_safe)
            except _Late:
                raise self._gave_up(op, False, "the request deadline passed") from None
            except PoolTimeout as exc:
                self._emit(op, "pool_timeout")
                raise self._gave_up(op, False, "no database connection was free "
                                    f"within {wait:.3g} s") from exc
            except psycopg.errors.Error as exc:
                self._raise_refused(op, exc, False)
                if not _connection_lost(exc, exc.sqlstate or ""):
                    raise
                if progress.sent and not replay_safe:
                    raise self._not_run_again(op, exc) from exc
                self.stats.connection_retried += 1
                self._emit(op, "connection_retried")
                delay = self._backoff(attempt)
                if attempt >= s.max_attempts or (
                        end is not None and time.monotonic() + delay >= end):
                    raise errors.DatabaseUnavailable(
                        f"the database connection failed during a read ({_said(exc)}); "
                        "nothing was changed, retry later") from exc
                await asyncio.sleep(delay)

    async def _read(self, conn: psycopg.AsyncConnection[Any], sql: LiteralString,
                    params: Sequence[Any] | Mapping[str, Any],
                    end: float | None = None, read_committed: bool = False,
                    progress: _Progress | None = None,
                    alive_first: bool = False) -> list[tuple[Any, ...]]:
        text = psycopg.AsyncClientCursor(conn).mogrify(sql, params).encode(
            conn.info.encoding)
        pgconn = conn.pgconn
        try:
            begin = self._begin_read_committed if read_committed else self._begin_read
            _send(pgconn, begin + text + self._commit, alive_first)
            if progress is not None:
                progress.sent = True
            results = await _results(conn, end)
        except BaseException:
            await _roll_back(conn)
            raise
        rows: list[tuple[Any, ...]] = []
        for res in results:
            if res.status == _FATAL_ERROR:
                await _roll_back(conn)
                raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
            if res.status == _TUPLES_OK and not rows:
                adapt = Transformer(conn)
                adapt.set_pgresult(res)
                rows = adapt.load_rows(0, res.ntuples, tuple)
        return rows

    async def call_on(self, conn: psycopg.AsyncConnection[Any], sql: LiteralString,
                      params: Sequence[Any] = (), *, op: Op | None = None) -> Any:
        """Run one statement on the caller's connection, inside the caller's open
        transaction, and return the first column of the first row.

        Nothing is committed, retried or rolled back beyond the statement itself:
        it runs under a savepoint, so a refusal (a typed PgReserveError) or any
        other error leaves the caller's transaction as it was before the call,
        still open. The statement must name pgreserve's objects with their schema
        (the caller's search_path is not touched). The transaction must be READ
        COMMITTED (InvalidRequest otherwise, nothing done)."""
        status = conn.info.transaction_status
        if status == pq.TransactionStatus.INERROR:
            raise errors.InvalidRequest(
                "conn= needs the caller's transaction usable, and it has already failed: "
                "roll it back (or back to a savepoint) first")
        if status != pq.TransactionStatus.INTRANS:
            raise errors.InvalidRequest(
                "conn= runs the operation inside the caller's open transaction: start "
                "one first (async with conn.transaction(): ...), then pass the connection")
        # pgreserve's functions read what committed before each of their statements (a
        # reserve that waited on a freeze's lock sees the freeze); under a snapshot the
        # caller took earlier they would not, and a hold could pass a freeze
        cur = await conn.execute(queries["transaction_isolation_get"], prepare=False)
        isolation = await cur.fetchone()
        if isolation is None or isolation[0] != "read committed":
            level = "unknown" if isolation is None else isolation[0]
            raise errors.InvalidRequest(
                f"conn= needs a READ COMMITTED transaction (this one is {level}): "
                "pgreserve's operations must see what committed before each of their "
                "statements (a freeze, another buyer's take), which a snapshot taken "
                "earlier hides")
        try:
            async with conn.transaction():
                cur = await conn.execute(tagged(sql, op), params, prepare=False)
                row = await cur.fetchone()
        except psycopg.errors.Error as exc:
            state = exc.sqlstate or ""
            if state in _SQLSTATE_ERRORS:
                raise _typed(exc, state) from None
            raise
        return None if row is None else row[0]


class _Late(Exception):
    """The deadline passed before an attempt could start."""


_TIMEOUT_MARK = "pgreserve:statement_timeout"
_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_PLACEHOLDER = re.compile(rb"%(.)", re.DOTALL)


@dataclass(frozen=True)
class _Statement:
    """A statement text split at its `%s` placeholders (`%%` is a literal `%`)."""

    parts: tuple[bytes, ...]

    @classmethod
    def parse(cls, text: bytes) -> _Statement:
        parts = [b""]
        at = 0
        for m in _PLACEHOLDER.finditer(text):
            parts[-1] += text[at:m.start()]
            if m.group(1) == b"s":
                parts.append(b"")
            elif m.group(1) == b"%":
                parts[-1] += b"%"
            else:
                raise psycopg.ProgrammingError(
                    f"only %s placeholders are supported here, not %{m.group(1).decode()}")
            at = m.end()
        parts[-1] += text[at:]
        return cls(tuple(parts))

    def render(self, adapt: _Adapt, params: Sequence[Any]) -> bytes:
        if len(params) != len(self.parts) - 1:
            raise psycopg.ProgrammingError(
                f"the statement has {len(self.parts) - 1} placeholders"
                f" but {len(params)} parameters were passed")
        out = [self.parts[0]]
        for value, part in zip(params, self.parts[1:], strict=True):
            out.append(adapt.as_literal(value))
            out.append(part)
        return b"".join(out)


class Session:
    """One connection of a pool, kept across calls (`Database.session`)."""

    def __init__(self, db: Database, op: Op | None) -> None:
        self._db = db
        self._op = op
        self._pool: AsyncConnectionPool | None = None
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def __aenter__(self) -> Session:
        await self.connection()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._hand_back()

    async def connection(self, wait: float | None = None) -> psycopg.AsyncConnection[Any]:
        """The kept connection; a broken one is handed back (the pool discards
        it) before another is taken, so a retry never waits on the pool while
        holding a dead connection. A new one is waited for at most `wait`
        seconds (default: `pool_wait_s`, less when the deadline is nearer);
        then PoolTimeout."""
        if self._conn is not None and self._conn.broken:
            await self._hand_back()
        if self._conn is None:
            if wait is None:
                try:
                    wait = self._db._pool_wait(self._db._end())
                except _Late:
                    raise PoolTimeout("the deadline passed before a connection "
                                      "was asked for") from None
            self._pool = await self._db._pool_for(self._op)
            self._conn = await self._pool.getconn(timeout=wait)
        return self._conn

    @property
    def lost(self) -> bool:
        return self._conn is None or self._conn.broken

    def contended(self) -> bool:
        """Whether others are waiting for a connection of this pool."""
        return self._pool is not None and \
            self._pool.get_stats().get("requests_waiting", 0) > 0

    async def _hand_back(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pool is not None:
            await self._pool.putconn(conn)


# How long past a call's deadline its answer is waited for. The statement_timeout sent
# with the call makes a server that runs end it at the deadline; this bounds the wait
# on one that does not answer at all (stopped, partitioned away).
ANSWER_GRACE_S = 1.0
# How often a wait for an answer wakes without one (psycopg's own interval). psycopg's
# wait_async defaults to 0: the loop would spin, resuming the wait at every turn, for
# as long as the database takes to answer.
WAIT_INTERVAL_S = 0.1


async def _results(conn: psycopg.AsyncConnection[Any], end: float | None) -> list[Any]:
    """The results of the query just sent; with a deadline, waited for until it (and
    ANSWER_GRACE_S) only: then the connection is dropped without a round trip (the pool
    discards it) and the call fails as on a lost connection, its outcome unknown."""
    if end is None:
        return await conn.wait(generators.execute(conn.pgconn))
    try:
        async with asyncio.timeout(max(0.0, end - time.monotonic()) + ANSWER_GRACE_S):
            # (psycopg's own wait, cancelled, would ask the server to cancel the query
            # and wait for it up to twice 5 s more: the server is not answering)
            return await waiting.wait_async(generators.execute(conn.pgconn),
                                            conn.pgconn.socket, interval=WAIT_INTERVAL_S)
    except TimeoutError:
        conn.pgconn.finish()
        raise psycopg.OperationalError(
            "the database did not answer within the request's deadline") from None


async def _roll_back(conn: psycopg.AsyncConnection[Any]) -> None:
    """End a transaction a failed call left open, so the pool gets the connection back
    idle; a connection whose statement is still running (the call was cancelled while
    waiting for its answer) is dropped instead (the pool discards it)."""
    if conn.closed:
        return
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.ACTIVE:
        conn.pgconn.finish()
    elif status != pq.TransactionStatus.IDLE:
        await conn.execute(queries["transaction_rollback"], prepare=False)


class _Progress:
    """How far one attempt of a call got: `sent` once its statement was handed to the
    connection whole. Until then nothing of it can have run (the server runs a
    simple-query message only once it has all of it): a failure taking a connection
    (a closed pool), or the connection's before or while sending, is retried, never
    reported as a possible commit."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


def _send(pgconn: Any, query: bytes, alive_first: bool = False) -> None:
    """Send `query`; `alive_first`: read what the server sent the idle connection first
    (non-blocking reads), so a connection the server ended while it sat in the pool (a
    restart, a terminated backend: its goodbye and end of stream are waiting) fails
    here, unsent, and is retried on another, instead of failing after the send, where
    the outcome of a call that must not run twice would be unknown."""
    if alive_first:
        # (the goodbye first, then a second read meets the end of stream)
        pgconn.consume_input()
        pgconn.consume_input()
        if pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError("the connection was closed while idle")
    pgconn.send_query(query)


def _said(exc: psycopg.errors.Error) -> str:
    """What the server (or the driver) said, in one line: its primary message, without
    the CONTEXT, DETAIL and HINT lines (which name pgreserve's functions and their
    lines) that psycopg appends. Busy and OutcomeUnknown carry it to API answers."""
    primary = exc.diag.message_primary
    if primary:
        return str(primary)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _connection_lost(exc: psycopg.errors.Error, state: str) -> bool:
    """The connection went away: the server was shut down or the backend was
    terminated (57P01-57P03), a connection exception (class 08), or a dead
    socket (no SQLSTATE at all). The outcome of an in-flight COMMIT is unknown."""
    if state:
        return state in {"57P01", "57P02", "57P03"} or state.startswith("08")
    return isinstance(exc, psycopg.OperationalError)


def _typed(exc: psycopg.errors.Error, state: str) -> errors.PgReserveError:
    detail: Any = exc.diag.message_detail
    if detail is not None and detail[:1] in "[{":
        detail = json.loads(detail)
    return typed_error(state, exc.diag.message_primary, detail)


def typed_error(state: str, message: str | None, detail: Any = None) -> errors.PgReserveError:
    """The PgReserveError of a typed SQLSTATE (PR4xx) raised, or reported, by a function."""
    cls = _SQLSTATE_ERRORS[state]
    return cls(message or cls.__name__, detail=detail)
