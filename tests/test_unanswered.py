"""A database that stops answering (its backend stopped, as on a network partition or a
frozen host): calls end at their deadline, with the answer their key resolves, and the
requests queued behind them are answered Busy at theirs, never sent."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from pgreserve import Database, ReservationService, errors
from pgreserve.db.database import deadline

GUARD_S = 60  # a hang fails the test here instead of holding the suite


def backends(dsn: str, application_name: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [int(r[0]) for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
            (application_name,))]


@contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """The backends stopped (SIGSTOP): they neither answer nor end; then resumed."""
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def test_a_call_to_a_database_that_stops_answering_ends_at_its_deadline(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A reserve whose backend stops after the call is sent ends at its deadline (and a
    second's grace) with OutcomeUnknown, not when the database answers again, and without
    asking the stopped server to cancel (which psycopg waits up to 10 s for); its key then
    resolves it, with one hold at most."""
    app = "stalled-call"
    async with Database(dsn, min_size=1, max_size=1, application_name=app) as db:
        service = ReservationService(db, batching=False)
        tenant = await service.create_tenant("stalled")
        await service.set_stock(tenant.id, "s", "w", 5)
        with stopped(backends(dsn, app)), deadline(1.0), \
                pytest.raises(errors.OutcomeUnknown):
            await asyncio.wait_for(service.reserve(tenant.id, "k", [("s", "w", 1)]), GUARD_S)
        # (the pool says it discards the dropped connection; nothing asked for a cancel)
        assert not [r for r in caplog.records if "cancel" in r.getMessage()], caplog.text
        again = await service.reserve(tenant.id, "k", [("s", "w", 1)])
        assert again.held
        assert (await service.get_stock(tenant.id, "s", "w")).reserved == 1
        assert await service.invariant_violations() == []


async def test_requests_queued_behind_an_unanswered_batch_are_busy_at_their_deadline(
        dsn: str) -> None:
    """A batch in flight on a backend that stopped: the request queued behind it is
    answered Busy at its own deadline (never sent), and the batch's own request gets
    OutcomeUnknown at the batch's deadline; both keys then resolve them."""
    app = "stalled-batch"
    async with Database(dsn, min_size=1, max_size=1, application_name=app) as db:
        service = ReservationService(db)
        tenant = await service.create_tenant("stalled")
        await service.set_stock(tenant.id, "s", "w", 5)
        assert (await service.reserve(tenant.id, "warm", [("s", "w", 1)])).held
        with stopped(backends(dsn, app)):
            with deadline(30.0):  # the batch's: long past the queued one's
                first = asyncio.create_task(
                    service.reserve(tenant.id, "a", [("s", "w", 1)]))
            # a's batch leaves the queue (no event to await: the combiner's own state)
            combiner = service.combiner
            assert combiner is not None
            while not combiner._tasks or any(combiner._queues.values()):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            with deadline(1.0), pytest.raises(errors.Busy):
                await asyncio.wait_for(service.reserve(tenant.id, "b", [("s", "w", 1)]),
                                       GUARD_S)
            assert not first.done()  # still within its own deadline
        assert (await asyncio.wait_for(first, GUARD_S)).held  # answered once resumed
        assert (await service.reserve(tenant.id, "b", [("s", "w", 1)])).held
        assert (await service.get_stock(tenant.id, "s", "w")).reserved == 3
        assert await service.invariant_violations() == []
