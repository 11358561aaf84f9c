"""Group commit per bucket: the requests of one bucket that queue while its
previous batch is in flight leave together, as one call of `bucket_batch_v1`
(one transaction, one write of the bucket row, one commit).

Natural batching: a request to an idle bucket leaves at once (a batch of one);
under load, batches grow to whatever queued meanwhile, up to `max_batch`. Each
request gets its own answer from the batch. A batch whose call fails as a whole
(other than for a reason every request shares: Busy, an unknown outcome) is
split in halves and each half sent again, so one poison request cannot fail the
others. A full queue answers `Busy` at once.

Several processes may batch the same bucket: their batches serialise on the
bucket's row lock, and requests with one key on the key's advisory lock, as the
unbatched calls do.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .. import errors
from ..db import literals as lit
from ..db.database import Database, Op, Session
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


_Pending = tuple[BatchRequest, "asyncio.Future[dict[str, Any]]"]


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
        `{"error": sqlstate, ...}` or `{"retry": true}`.

        The caller's cancellation does not cancel the request: it stays in its
        batch, which commits, and its key keeps the answer for a retry.
        """
        key = (tenant, bucket)
        queue = self._queues.setdefault(key, deque())
        if len(queue) >= self.config.max_queue:
            self.stats.busy += 1
            raise errors.Busy(f"{len(queue)} requests are already queued for this bucket; "
                              "retry later")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        queue.append((request, future))
        if key not in self._tasks:
            self._tasks[key] = asyncio.create_task(self._drain(key))
        return await asyncio.shield(future)

    async def _drain(self, key: tuple[int, int]) -> None:
        queue = self._queues[key]
        try:
            while queue:
                # A hot bucket's batches run back to back on one session: its
                # compiled function and plans stay warm, no checkout per batch.
                # When others wait for a connection of the pool, the session is
                # handed back after the batch and taken again in turn.
                async with self.db.session(BATCH_OP) as session:
                    while queue:
                        take = min(len(queue), self.config.max_batch)
                        batch = [queue.popleft() for _ in range(take)]
                        await self._send(key, batch, session)
                        if session.lost or session.contended():
                            break
        except Exception as exc:  # noqa: BLE001 (_send answers its own batch's errors)
            # no session in time: the waiting requests were not sent
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

    async def _send(self, key: tuple[int, int], batch: Sequence[_Pending],
                    session: Session) -> None:
        try:
            await self._send_once(key, batch, session)
        except BaseException:
            # cancelled in flight (shutdown): the batch may have committed, so
            # each unanswered request resolves by its key, as after a lost connection
            _fail(batch, errors.OutcomeUnknown(
                "the service stopped while this request's batch was in flight; "
                "retry with the same request key"))
            raise

    async def _send_once(self, key: tuple[int, int], batch: Sequence[_Pending],
                         session: Session) -> None:
        tenant, bucket = key
        requests = [r for r, _ in batch]
        try:
            answers = await self.db.call(queries["bucket_batch"], (
                tenant, bucket,
                lit.text_array(r.kind for r in requests),
                lit.nullable_text_array(r.key for r in requests),
                lit.nullable_text_array(r.digest for r in requests),
                lit.nullable_int_array(r.quantity for r in requests),
                lit.nullable_text_array(None if r.ttl is None else lit.interval(r.ttl)
                                        for r in requests),
                lit.nullable_text_array(None if r.reservation_id is None
                                        else str(r.reservation_id) for r in requests),
                self.clock()), op=BATCH_OP, session=session)
        except (errors.Busy, errors.OutcomeUnknown) as exc:
            # shared by every request of the batch: each resolves it by its key
            _fail(batch, exc)
            return
        except Exception as exc:  # noqa: BLE001 (isolated by splitting, re-raised alone)
            if len(batch) == 1:
                _fail(batch, exc)
                return
            log.warning("a batch of %d failed (%s); sending it in halves", len(batch), exc)
            self.stats.splits += 1
            half = len(batch) // 2
            await self._send(key, batch[:half], session)
            await self._send(key, batch[half:], session)
            return
        self.stats.batches += 1
        self.stats.requests += len(batch)
        self.stats.sizes[len(batch)] += len(batch)
        if not isinstance(answers, list) or len(answers) != len(batch):
            _fail(batch, RuntimeError("bucket_batch_v1 answered a different number of requests"))
            return
        for (_, future), answer in zip(batch, answers, strict=True):
            if not future.done():
                future.set_result(answer)


def _fail(batch: Sequence[_Pending], exc: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)


def _retrieve(future: asyncio.Future[dict[str, Any]]) -> None:
    # A caller that gave up no longer awaits its future: read the exception so
    # asyncio does not report it as never retrieved.
    if not future.cancelled():
        future.exception()
