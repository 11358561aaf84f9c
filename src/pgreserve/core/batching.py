"""Group commit per bucket: the requests of one bucket that queue while its
previous batch is in flight leave together, as one call of `bucket_batch_v1`
(one transaction, one write of the bucket row, one commit).

Natural batching: a request to an idle bucket leaves at once (a batch of one);
under load, batches grow to whatever queued meanwhile, up to `max_batch`. Each
request gets its own answer from the batch. A batch whose call fails as a whole
(other than for a reason every request shares: Busy, an unknown outcome) is
split in halves and each half sent again, so one poison request cannot fail the
others. A full queue answers `Busy` at once.

Deadlines: each request keeps its caller's deadline (`db.database.deadline`).
One whose deadline passes while it is queued is answered `Busy` and never sent;
the wait for the drain's connection is bounded by the earliest deadline queued.
A batch's call runs to the latest deadline of its requests (one without any: the
statement_timeout), so no request's deadline cuts the statement of the others;
a sent request whose own deadline comes first is answered OutcomeUnknown then.

Arrival order: a request the batch cannot decide (answered retry: its caller
sends it alone, unbatched) stops the batch there. The requests after it are
not decided in that batch (answered deferred) but go back to the head of the
queue, and the next batch leaves only once the caller has had its turn
(`Combiner.request`), so every request is decided after those that arrived
before it, as if each had been sent alone in arrival order.

Several processes may batch the same bucket: their batches serialise on the
bucket's row lock, and requests with one key on the key's advisory lock, as the
unbatched calls do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from psycopg_pool import PoolTimeout

from .. import errors
from ..db import literals as lit
from ..db.database import Database, Op, Session, current_deadline, deadline_at
from ..db.queries import queries

log = logging.getLogger(__name__)

BATCH_OP = Op("reserve", "bucket_batch", "batch/bucket")


@dataclass(frozen=True)
class BatchConfig:
    """Limits of the combiner (per process)."""

    max_batch: int = 256
    max_queue: int = 4096

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 1000:
            raise errors.InvalidRequest("max_batch must be between 1 and 1000",
                                        field="max_batch")
        if not 1 <= self.max_queue <= 1_000_000:
            raise errors.InvalidRequest("max_queue must be between 1 and 1000000",
                                        field="max_queue")


@dataclass(frozen=True)
class BatchRequest:
    """One request for a bucket's batch: a one-line reserve; a claim, release or expiry
    of a one-line reservation; or a refill of the bucket's pool."""

    kind: str  # "reserve" | "claim" | "release" | "expire" | "refill"
    key: str | None = None
    digest: str | None = None
    quantity: int | None = None
    ttl: timedelta | None = None
    reservation_id: uuid.UUID | None = None
    reference: str | None = None  # a reserve's reference and metadata (None: none)
    metadata: dict[str, str] | None = None
    # the SHA-256 of the API key its caller presented, to check in the batch's own
    # transaction (None: the caller was checked before)
    api_key: bytes | None = None


@dataclass
class BatchStats:
    """What the combiner did: batches sent and their sizes (the bench reads them)."""

    batches: int = 0
    requests: int = 0
    splits: int = 0
    busy: int = 0
    sizes: Counter[int] = field(default_factory=Counter)

    def percentile(self, p: float) -> int:
        """The batch size at percentile p (0-100) over requests sent, 0 when none."""
        total = sum(self.sizes.values())
        if total == 0:
            return 0
        rank = p / 100 * total
        seen = 0
        for size in sorted(self.sizes):
            seen += self.sizes[size]
            if seen >= rank:
                return size
        return max(self.sizes)


@dataclass(eq=False, slots=True)
class _Pending:
    """A queued request, its caller's answer, its deadline (monotonic, or None) and
    whether its caller is done with it (for a request answered retry: the end of the
    caller's turn, which the drain waits for on `turn`, made only then)."""

    request: BatchRequest
    future: asyncio.Future[dict[str, Any]]
    end: float | None
    done: bool = False
    turn: asyncio.Event | None = None
    timer: asyncio.TimerHandle | None = None  # its deadline, until it is answered
    sent_until: float = 0.0  # the deadline of the batch it was last sent in
    queued: float = 0.0  # when it began to wait for a connection (monotonic)

    def gone(self) -> bool:
        """Its caller gave up before it was answered."""
        return self.done and not self.future.done()

    def finish(self) -> None:
        self.done = True
        if self.turn is not None:
            self.turn.set()


class _Turn:
    """`Combiner.request`'s context: the answer on entry, the caller done on exit
    (a class rather than a generator: it is on every batched request's path)."""

    __slots__ = ("pending",)

    def __init__(self, pending: _Pending) -> None:
        self.pending = pending

    async def __aenter__(self) -> dict[str, Any]:
        pending = self.pending
        try:
            return await asyncio.shield(pending.future)
        except BaseException:
            pending.finish()  # the caller is gone: nobody takes the turn
            raise
        finally:
            if pending.timer is not None:
                pending.timer.cancel()

    async def __aexit__(self, *exc: object) -> None:
        self.pending.finish()


# How long the next batch waits at most for a retried request's caller to end its
# turn when the request has no deadline (its unbatched call is bounded by the
# database's own timeouts; this only keeps a caller that never ends it from
# stopping the bucket's queue).
TURN_WAIT_S = 60.0


class Combiner:
    """One queue per (tenant, bucket); at most one batch in flight for each."""

    def __init__(self, db: Database, config: BatchConfig | None = None, *,
                 clock: Callable[[], datetime | None] = lambda: None) -> None:
        """`clock`: the time each batch runs at (None: the database's clock_timestamp())."""
        self.db = db
        self.config = config or BatchConfig()
        self.clock = clock
        self.stats = BatchStats()
        self._queues: dict[tuple[int, int], deque[_Pending]] = {}
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}

    def busy(self, tenant: int, bucket: int) -> bool:
        """Whether a batch of this bucket is in flight in this process."""
        return (tenant, bucket) in self._tasks

    async def submit(self, tenant: int, bucket: int, request: BatchRequest) -> dict[str, Any]:
        """Queue a request and wait for its own answer: `{"ok": doc}`,
        `{"error": sqlstate, ...}`, `{"skipped": true}` or `{"retry": true}`; a
        caller that sends a retried request alone uses `request` instead.

        The caller's cancellation does not take the request out of a batch in flight:
        that batch may commit it, and its key keeps the answer for a retry. A request
        not sent yet is not sent (nothing of it is written).
        """
        async with self.request(tenant, bucket, request) as answer:
            return answer

    def request(self, tenant: int, bucket: int, request: BatchRequest) -> _Turn:
        """`submit`, with the caller's turn: `async with combiner.request(...) as answer`.
        When the answer is `{"retry": true}`, the bucket's later requests wait until
        the block ends, so what the caller does in it (the request's unbatched call)
        comes before them. Busy at once when the bucket's queue is full."""
        key = (tenant, bucket)
        queue = self._queues.setdefault(key, deque())
        if len(queue) >= self.config.max_queue:
            self.stats.busy += 1
            raise errors.Busy(f"{len(queue)} requests are already queued for this bucket; "
                              "retry later")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        pending = _Pending(request, future, current_deadline(), queued=time.monotonic())
        queue.append(pending)
        if pending.end is not None:
            # answered Busy at its deadline if it is still queued then, also while
            # the batch before it waits on a database that does not answer
            pending.timer = asyncio.get_running_loop().call_later(
                max(0.0, pending.end - time.monotonic()), self._expire, queue, pending)
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(self._drain(key))
        return _Turn(pending)

    def _expire(self, queue: deque[_Pending], pending: _Pending) -> None:
        """A request's deadline passed. Still queued: Busy (never sent). Sent: its
        batch runs to its latest request's deadline, and may commit, so this one's
        answer is OutcomeUnknown now, which its key resolves; the batch's latest
        request is answered by the batch, which ends by then. (A deferred request put
        back at the head of the queue is in it again: Busy.)"""
        if pending.future.done():
            return
        try:
            queue.remove(pending)
        except ValueError:
            if pending.end is not None and pending.end >= pending.sent_until:
                return  # the batch's own deadline: its statement_timeout ends it
            _fail([pending], errors.OutcomeUnknown(
                "the request deadline passed while its batch was in flight; retry with "
                "the same request key"))
            return
        self.stats.busy += 1
        _fail([pending], _late_busy())

    async def _drain(self, key: tuple[int, int]) -> None:
        queue = self._queues[key]
        # This task was created in its first caller's context: its deadline is
        # not the drain's. Each wait and batch below names its own.
        with deadline_at(None):
            await self._drain_queue(key, queue)

    async def _drain_queue(self, key: tuple[int, int], queue: deque[_Pending]) -> None:
        try:
            while queue:
                # A hot bucket's batches run back to back on one session: its
                # compiled function and plans stay warm, no checkout per batch.
                # When others wait for a connection of the pool, the session is
                # handed back after the batch and taken again in turn; and while
                # a retried request's caller has its turn (its unbatched call
                # needs a connection too).
                self._drop_late(queue)
                if not queue:
                    break
                session = self.db.session(BATCH_OP)
                if not await self._connect(session, queue):
                    break
                retried: _Pending | None = None
                async with session:
                    while queue:
                        batch = self._next_batch(queue)
                        if batch:
                            retried, later = await self._send(key, batch, session)
                            queue.extendleft(reversed(later))
                            if retried is not None:
                                break
                        if session.lost or session.contended():
                            break
                if retried is not None:
                    await self._turn_over(retried, queue)
        except Exception as exc:  # noqa: BLE001 (_send answers its own batch's errors)
            # the waiting requests were not sent
            log.warning("no connection for the batches of bucket %s: %s", key, exc)
            _fail(list(queue), errors.Busy(f"no database connection was free: {exc}"))
            queue.clear()
        except BaseException:
            _fail(list(queue), errors.Busy("the service is shutting down; retry"))
            queue.clear()
            raise
        finally:
            del self._tasks[key]
            if not queue:
                self._queues.pop(key, None)

    async def _connect(self, session: Session, queue: deque[_Pending]) -> bool:
        """Take the drain's connection. Each queued request waits for it as long as an
        unbatched call would: `pool_wait_s`, never past its own deadline. A wait that
        ends without one answers Busy to the requests whose wait is over; the others
        wait on. False when none is left."""
        wait = self.db.settings.pool_wait_s
        started = time.monotonic()
        for p in queue:  # (time behind a batch in flight or a turn is no pool wait)
            p.queued = max(p.queued, started)
        while queue:
            limit = min(p.queued for p in queue) + wait
            bound = _before(limit, _earliest(queue))
            try:
                await session.connection(wait=max(0.0, bound - time.monotonic()))
                return True
            except PoolTimeout as exc:
                self._drop_late(queue, errors.Busy(f"no database connection was free: {exc}"),
                                waited=wait)
        return False

    async def _turn_over(self, pending: _Pending, queue: deque[_Pending]) -> None:
        """Wait until the caller of a retried request has ended its turn (at most until
        its deadline, or TURN_WAIT_S without one). The requests queued meanwhile keep
        their own deadlines: one that passes is answered Busy at once."""
        wait = TURN_WAIT_S if pending.end is None else max(0.0, pending.end - time.monotonic())
        limit = time.monotonic() + wait + 1.0
        if pending.turn is None:
            pending.turn = asyncio.Event()
        while not pending.done:
            now = time.monotonic()
            if now >= limit:
                log.warning("a retried request's caller kept its turn over %.0f s; the "
                            "bucket's next batch leaves without it", wait + 1.0)
                return
            bound = _before(limit, _earliest(queue))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pending.turn.wait(), max(0.001, bound - now))
            self._drop_late(queue)

    def _batch_deadline(self, batch: Sequence[_Pending]) -> float:
        """The deadline a batch runs to: its latest request's, so that no request's
        nearer deadline cuts the statement of the others (each is answered at its own,
        `_expire`); with a request that has none, the statement_timeout an unbatched
        call of it has, and the answer is not waited for past it either (a database
        that stops answering holds no bucket's queue for good)."""
        ends = [p.end for p in batch]
        if None in ends:
            return time.monotonic() + self.db.settings.statement_timeout_ms / 1000
        return max(e for e in ends if e is not None)

    def _drop_late(self, queue: deque[_Pending], busy: errors.Busy | None = None, *,
                   waited: float | None = None) -> None:
        """Answer Busy (`busy`, else the late one) to the queued requests past their
        deadline and, given `waited`, to those queued that long ago or longer."""
        now = time.monotonic()
        # (a pool wait may end a hair early: its requests count as having waited)
        queued_by = None if waited is None else now + 0.001 - waited

        def late(p: _Pending) -> bool:
            return ((p.end is not None and p.end <= now)
                    or (queued_by is not None and p.queued <= queued_by))

        dropped = [p for p in queue if late(p)]
        if dropped:
            kept = [p for p in queue if not late(p)]
            queue.clear()
            queue.extend(kept)
            self.stats.busy += len(dropped)
            _fail(dropped, busy or _late_busy())

    def _next_batch(self, queue: deque[_Pending]) -> list[_Pending]:
        """Up to max_batch queued requests; those past their deadline are answered
        Busy instead (they were never sent)."""
        batch: list[_Pending] = []
        now = time.monotonic()
        while queue and len(batch) < self.config.max_batch:
            pending = queue.popleft()
            end = pending.end
            if pending.gone():
                # its caller gave up before it was sent: nothing of it was written and
                # no lock shows it, so a lookup of its key rightly says it was never
                # used; sent now, it would commit after that (unbatched, a cancelled
                # call is never sent either)
                pending.future.cancel()
                continue
            if end is not None and end <= now:
                self.stats.busy += 1
                _fail([pending], _late_busy())
            else:
                batch.append(pending)
        return batch

    async def _send(self, key: tuple[int, int], batch: Sequence[_Pending],
                    session: Session) -> tuple[_Pending | None, list[_Pending]]:
        """Send a batch; the request answered retry (if one was), and the requests
        after it, not decided, to queue again in their order."""
        try:
            return await self._send_once(key, batch, session)
        except BaseException:
            # cancelled in flight (shutdown): the batch may have committed, so
            # each unanswered request resolves by its key, as after a lost connection
            _fail(batch, errors.OutcomeUnknown(
                "the service stopped while this request's batch was in flight; "
                "retry with the same request key"))
            raise

    async def _send_once(self, key: tuple[int, int], batch: Sequence[_Pending],
                         session: Session) -> tuple[_Pending | None, list[_Pending]]:
        tenant, bucket = key
        # requests that bring an API key to check go through the keyed function
        keyed = any(p.request.api_key is not None for p in batch)
        sql = queries["bucket_batch_keyed"] if keyed else queries["bucket_batch"]
        until = self._batch_deadline(batch)
        for pending in batch:
            pending.sent_until = until
        sent: Sequence[_Pending] = batch
        after_lost = False  # an earlier attempt's statement may have committed

        def values(may_have_committed: bool) -> tuple[Any, ...]:
            # Each attempt (a retry after a lost connection or a conflict, the halves
            # of a split) sends only the requests not answered yet and whose caller
            # still waits. One answered already (OutcomeUnknown at its deadline, while
            # its batch was in flight) or whose caller gave up is not sent again:
            # between attempts no transaction holds its key, and a lookup of the key
            # then rightly says it has no answer; one sent again would commit after
            # that.
            nonlocal sent, after_lost
            after_lost = may_have_committed
            sent = [p for p in batch if not p.future.done() and not p.gone()]
            if not sent:
                raise _NothingLeft
            requests = [p.request for p in sent]
            api_keys = ((lit.nullable_bytea_array(r.api_key for r in requests),) if keyed
                        else ())
            return (
                *api_keys, tenant, bucket,
                lit.text_array(r.kind for r in requests),
                lit.nullable_text_array(r.key for r in requests),
                lit.nullable_text_array(r.digest for r in requests),
                lit.nullable_int_array(r.quantity for r in requests),
                lit.nullable_text_array(None if r.ttl is None else lit.interval(r.ttl)
                                        for r in requests),
                lit.nullable_text_array(None if r.reservation_id is None
                                        else str(r.reservation_id) for r in requests),
                self.clock(), *_references(requests))

        try:
            answers = await self.db.call(sql, values, op=BATCH_OP, session=session,
                                         deadline=until)
        except _NothingLeft:
            return None, []
        except (errors.Busy, errors.OutcomeUnknown) as exc:
            # shared by every request of the batch: each resolves it by its key
            _fail(batch, exc)
            return None, []
        except Exception as exc:  # noqa: BLE001 (isolated by splitting, re-raised alone)
            if len(batch) == 1:
                _fail(batch, exc)
                return None, []
            log.warning("a batch of %d failed (%s); sending it in halves", len(batch), exc)
            self.stats.splits += 1
            half = len(batch) // 2
            first, rest = await self._send(key, batch[:half], session)
            if first is not None:  # the second half waits behind the first's retry
                return first, [*rest, *batch[half:]]
            return await self._send(key, batch[half:], session)
        self.stats.batches += 1
        self.stats.requests += len(sent)
        if not isinstance(answers, list) or len(answers) != len(sent):
            self.stats.sizes[len(sent)] += len(sent)
            _fail(sent, RuntimeError("bucket_batch_v1 answered a different number of requests"))
            return None, []
        retried = None
        later: list[_Pending] = []
        for pending, answer in zip(sent, answers, strict=True):
            if isinstance(answer, dict) and answer.get("deferred"):
                later.append(pending)
                continue
            if retried is None and isinstance(answer, dict) and answer.get("retry"):
                retried = pending
            if pending.future.done():
                continue
            if after_lost and isinstance(answer, dict) and answer.get("error") == "PR403":
                # The key is refused now, but the attempt that lost its connection
                # checked it before: if it was accepted then, that attempt may have
                # committed this request, whose stored answer a refusal now hides.
                pending.future.set_exception(errors.OutcomeUnknown(
                    "the API key was refused when the batch was sent again after a lost "
                    "connection; the earlier attempt may have committed this request: "
                    "look its request key up with a key that is still valid"))
            else:
                pending.future.set_result(answer)
        decided = len(sent) - len(later)  # at least the retried one
        self.stats.requests -= len(later)
        self.stats.sizes[decided] += decided
        return retried, later


def _late_busy() -> errors.Busy:
    return errors.Busy("the request deadline passed while it waited for its bucket's "
                       "batch; it was not sent, retry later")


def _references(requests: Sequence[BatchRequest]) -> tuple[str | None, str | None]:
    """The batch's references and metadata as arrays, or NULLs when no request has any
    (the common case: nothing more to send)."""
    if not any(r.reference is not None or r.metadata for r in requests):
        return None, None
    return (lit.nullable_text_array(r.reference for r in requests),
            lit.nullable_text_array(json.dumps(r.metadata) if r.metadata else None
                                    for r in requests))


def _before(limit: float, end: float | None) -> float:
    """The earlier of a limit and a deadline (None: none)."""
    return limit if end is None else min(limit, end)


def _earliest(batch: Sequence[_Pending] | deque[_Pending]) -> float | None:
    """The earliest deadline of these requests (None: none has one)."""
    ends = [p.end for p in batch if p.end is not None]
    return min(ends) if ends else None


class _NothingLeft(Exception):
    """Every request of a batch was answered before an attempt to send it."""


def _fail(batch: Sequence[_Pending], exc: BaseException) -> None:
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(exc)


def _retrieve(future: asyncio.Future[dict[str, Any]]) -> None:
    # A caller that gave up no longer awaits its future: read the exception so
    # asyncio does not report it as never retrieved.
    if not future.cancelled():
        future.exception()
