"""A database that stops answering (its backend stopped, as on a network partition or a
frozen host): calls end at their deadline, with the answer their key resolves, and the
requests queued behind them are answered Busy at theirs, never sent."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from pgreserve import Database, ReservationService, TxSettings, errors
from pgreserve.db import database
from pgreserve.db import migrate as migrations
from pgreserve.db.database import deadline
from pgreserve.workers.base import run_forever
from pgreserve.workers.sweeper import Sweeper
from test_cli import clean_env
from test_cli_up import BIN
from test_migrations import _new_database

if TYPE_CHECKING:
    from pgreserve.db.embedded import EmbeddedServer

GUARD_S = 60  # a hang fails the test here instead of holding the suite


def backends(dsn: str, application_name: str) -> list[int]:
    """The backends of this database with this application_name (a LIKE pattern)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [int(r[0]) for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
            " AND datname = current_database() AND pid <> pg_backend_pid()",
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


async def test_a_call_under_a_deadline_waits_for_its_answer_without_spinning(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for an answer under a deadline sleeps until the socket is readable (or
    its interval passes): a half-second statement resumes it a few times, not at every
    turn of the event loop (psycopg's wait_async spins with its default interval of 0,
    which doubled the service's CPU per hold)."""
    real = psycopg.generators.execute
    resumed = 0

    def counted(pgconn: Any) -> Generator[Any, Any, Any]:
        nonlocal resumed
        gen = real(pgconn)
        ready = None
        while True:
            try:
                wait = gen.send(ready)
            except StopIteration as done:
                return done.value
            ready = yield wait
            resumed += 1

    monkeypatch.setattr(database, "generators", SimpleNamespace(execute=counted))
    async with Database(dsn, min_size=1, max_size=1) as db:
        with deadline(30.0):
            assert await db.fetch("SELECT 1 FROM pg_sleep(0.5)") == [(1,)]
    assert 1 <= resumed <= 5 / database.WAIT_INTERVAL_S, resumed


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


async def test_a_worker_round_on_a_database_that_stops_answering_fails_at_its_deadline(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """With `call_deadline_s` (the workers' setting), a sweeper round whose backend stops
    fails at the call's deadline, logged, and the loop goes on and stops when told,
    instead of waiting as long as the database."""
    for bad in (0.0, -1.0, float("nan"), 1e9):
        with pytest.raises(ValueError, match="call_deadline_s"):
            TxSettings(call_deadline_s=bad)
    app = "stalled-sweeper"
    settings = TxSettings(call_deadline_s=1.0)
    async with Database(dsn, min_size=1, max_size=1, application_name=app,
                        settings=settings) as db:
        sweeper = Sweeper(ReservationService(db, batching=False))
        await sweeper.run_once()  # the pool's one connection is warm
        stop = asyncio.Event()
        with stopped(backends(dsn, app)), caplog.at_level(logging.ERROR):
            loop = asyncio.create_task(run_forever(sweeper, stop))
            until = time.monotonic() + GUARD_S
            while not any("round failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < until and not loop.done(), caplog.text
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(loop, GUARD_S)
        failed = [r for r in caplog.records if "round failed" in r.getMessage()]
        assert failed[0].exc_info is not None
        assert isinstance(failed[0].exc_info[1], (errors.OutcomeUnknown, errors.Busy))
        assert await sweeper.run_once() == 0  # answering again: rounds work


def test_the_worker_process_stops_while_its_database_does_not_answer(
        pg_server: EmbeddedServer) -> None:
    """`pgreserve worker` told to stop (SIGTERM) while every one of its backends is
    stopped ends (exit 0) after its shutdown grace (SHUTDOWN_GRACE_S), not when the
    database answers."""
    dsn = _new_database(pg_server, "stalled_worker")
    migrations.migrate(dsn)
    proc = subprocess.Popen([str(BIN), "worker", "--database-url", dsn], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        until = time.monotonic() + GUARD_S
        roles = {"pgreserve:sweeper", "pgreserve:replenisher", "pgreserve:janitor",
                 "pgreserve:webhooks"}
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not roles <= {str(r[0]) for r in conn.execute(
                    "SELECT application_name FROM pg_stat_activity"
                    " WHERE datname = current_database()")}:
                assert time.monotonic() < until and proc.poll() is None
                time.sleep(0.1)
        with stopped(backends(dsn, "pgreserve:%")):
            time.sleep(2.0)  # the next rounds are sent and wait
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=GUARD_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
        out = proc.communicate(timeout=GUARD_S)[0]
        assert code == 0, out
        assert "stopped cleanly" in out and "Traceback" not in out, out
        # (a cancelled call drops its connection: no rollback is sent behind its statement)
        assert "another command is already in progress" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
