"""Drive the buyers: seed a fresh tenant, run the plan through the library API, check the books.

The runner takes a DSN and a Scenario and returns RunResults; it prints nothing.
Tests pass `before_check` to change the database between the run and the checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..core.service import ReservationService
from ..db import schema as schemas
from ..db.connect import connect_async
from ..db.database import Database
from ..db.queries import queries
from ..errors import InvalidRequest
from ..workers.base import run_forever
from ..workers.replenisher import Replenisher
from .buyers import Progress, drive
from .http import HttpBuyer, HttpTarget, client_session, local_app
from .meter import Reading, ServerMeter, Usage
from .processes import drive_processes
from .results import DbSnapshot, Ledger, RunResult
from .scenario import Scenario, plan

BUYERS_APP = "pgreserve:bench-buyer"
ADMIN_APP = "pgreserve:bench-admin"


@dataclass(frozen=True)
class CheckContext:
    """What a before_check hook gets: where the run's data is."""

    dsn: str
    tenant_id: int
    strategy: str


BeforeCheck = Callable[[CheckContext], Awaitable[None]]


def with_commit_mode(dsn: str, durable: bool) -> str:
    """The DSN with synchronous_commit set for every session it opens."""
    params = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    mode = "on" if durable else "off"
    params["options"] = f"{options} -c synchronous_commit={mode}".strip()
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


async def run_scenario(dsn: str, scenario: Scenario, *, progress: Progress | None = None,
                       before_check: BeforeCheck | None = None,
                       http: HttpTarget | None = None) -> list[RunResult]:
    """Run each of the scenario's strategies in turn on the same server, each once per
    batching mode of the scenario (batched first), on a fresh tenant each time.

    `http` sends the buyers' calls through the HTTP API instead of the library; a
    running service (`http.url`) runs once per strategy, with its own setting.
    Progress is reported under each run's label (`run_label`).
    """
    if http is not None and scenario.processes > 1:
        raise InvalidRequest("the HTTP target runs its buyers in one process", field="processes")
    results = []
    for strategy, batching in runs_of(scenario, http):
        results.append(await run_strategy(dsn, scenario, strategy, batching=batching,
                                          progress=progress, before_check=before_check,
                                          http=http))
    return results


def runs_of(scenario: Scenario, http: HttpTarget | None = None) -> list[tuple[str, bool | None]]:
    """(strategy, batching) of each run, in order; batching None: a running service's own."""
    if http is not None and http.url is not None:
        return [(strategy, None) for strategy in scenario.strategies]
    return [(strategy, batching) for strategy in scenario.strategies
            for batching in scenario.batching]


def run_label(strategy: str, batching: bool | None) -> str:
    return f"{strategy} {'service' if batching is None else 'batched' if batching else 'unbatched'}"


async def run_strategy(dsn: str, scenario: Scenario, strategy: str, *,
                       batching: bool | None = True,
                       progress: Progress | None = None,
                       before_check: BeforeCheck | None = None,
                       http: HttpTarget | None = None) -> RunResult:
    """One strategy: a fresh tenant and buckets, the buyers, a final sweep, then the checks.

    `batching`: the buyers' ReservationService (or the API server the bench starts)
    batches one-line requests through its combiner, or sends each on its own."""
    dsn = with_commit_mode(dsn, scenario.durable)
    requests = plan(scenario)
    label = run_label(strategy, batching)
    step: Progress | None = None
    if progress is not None:
        report = progress

        def step(_strategy: str, n: int) -> None:
            report(label, n)
    progress = step
    batched = batching is not False
    async with Database(dsn, min_size=1, max_size=3, application_name=ADMIN_APP) as admin:
        service = ReservationService(admin)
        api_key: str | None = None
        if http is not None and http.url is not None:
            tenant = await _empty_tenant_of(service, admin, http.api_key)
            api_key = http.api_key
        elif http is not None:
            tenant, api_key = await service.create_tenant_with_key(
                f"bench-{strategy}-{uuid.uuid4().hex[:12]}")
        else:
            tenant = await service.create_tenant(f"bench-{strategy}-{uuid.uuid4().hex[:12]}")
        for index in range(scenario.skus):
            await service.set_stock(tenant.id, scenario.sku(index), scenario.location,
                                    scenario.units, strategy=strategy,
                                    pool_cap=scenario.pool_cap if strategy == "pool" else None)
        await admin.fetch(queries["stats_flush"])
        await asyncio.sleep(0.05)
        before = await _snapshot(dsn)
        meter = await ServerMeter.open(dsn)
        readings: list[Reading] = [await meter.read()]

        stop_watch = asyncio.Event()
        watch = asyncio.create_task(_watch_dead_tuples(dsn, stop_watch))
        sampling = asyncio.create_task(meter.sample_until(stop_watch, readings))
        # As deployed: `pgreserve worker` keeps the pools above their
        # low-water mark while buyers take (refilling inline only when dry).
        # A running service (--url) has its own workers.
        replenisher = Replenisher(service) \
            if strategy == "pool" and scenario.replenish and (http is None or http.url is None) \
            else None
        refilling = asyncio.create_task(run_forever(replenisher, stop_watch)) \
            if replenisher is not None else None
        if http is None and scenario.processes > 1:
            try:
                result = await drive_processes(dsn, service, tenant.id, scenario, strategy,
                                               requests, progress, BUYERS_APP,
                                               batching=batched)
            finally:
                stop_watch.set()
                peak = await watch
        elif http is None:
            buyers_db = Database(dsn, min_size=scenario.buyers, max_size=scenario.buyers,
                                 application_name=BUYERS_APP)
            await buyers_db.open()
            buyers_service = ReservationService(buyers_db, batching=batched)
            try:
                result = await drive(buyers_service, service, tenant.id,
                                      scenario, strategy, requests, progress)
            finally:
                await buyers_db.close()
                stop_watch.set()
                peak = await watch
            result.client_stats = {f"client_{k}": v
                                   for k, v in asdict(buyers_db.stats).items()}
            if buyers_service.combiner is not None:
                result.batch = buyers_service.combiner.stats
        else:
            assert api_key is not None  # noqa: S101 - both http branches above set it
            api: list[Any] = []
            try:
                async with _api(dsn, http, scenario.buyers, batched, api) as url, \
                        client_session(scenario.buyers) as session:
                    result = await drive(HttpBuyer(session, url, api_key), service, tenant.id,
                                          scenario, strategy, requests, progress)
            finally:
                stop_watch.set()
                peak = await watch
            result.target = "http"
            combiner = getattr(getattr(api[0].state, "service", None), "combiner", None) \
                if api else None
            result.batch = combiner.stats if combiner is not None else None
        result.batching = batching
        if refilling is not None and replenisher is not None:
            await refilling
            result.background_refills = replenisher.refills
            result.background_refilled_units = replenisher.units_added
        await _settle_expiries(service, scenario, result)
        await _wait_backends_gone(dsn)
        result.db_before, result.db_after = before, await _settled_snapshot(dsn)
        # (the statistics it samples are flushed about once a second: the settled
        # figure may be the highest the run left)
        result.peak_pool_dead_tuples = max(peak, result.db_after.pool_dead_tuples)
        await sampling
        readings.append(await meter.read())
        await meter.close()
        sellout = result.sellout_s
        result.usage = Usage.measure(meter.source, readings, result.t0,
                                     None if sellout is None else result.t0 + sellout)

        if before_check is not None:
            await before_check(CheckContext(dsn, tenant.id, strategy))
        result.ledger = await read_ledger(admin, tenant.id)
        result.violations = await violation_lines(service, tenant.id)
    return result


@asynccontextmanager
async def _api(dsn: str, http: HttpTarget, buyers: int, batching: bool,
               apps: list[Any]) -> AsyncIterator[str]:
    """The API's base URL: the given one, or a server started here for the run (its app
    is appended to `apps`)."""
    if http.url is not None:
        yield http.url
        return
    async with local_app(dsn, pool_size=buyers, application_name=BUYERS_APP,
                         batching=batching) as (url, app):
        apps.append(app)
        yield url


async def _empty_tenant_of(service: ReservationService, admin: Database,
                           api_key: str | None) -> Any:
    """The tenant of a running service's API key; it must have no stock yet, so that its
    books afterwards are the run's alone."""
    from ..domain import Tenant

    tenant = await service.tenant_for_api_key(api_key or "")
    if tenant is None:
        raise InvalidRequest("the API key is unknown to this database (pass the service's "
                             "--database-url)", field="api_key")
    rows = await admin.fetch(queries["bucket_count"], (tenant,))
    if rows[0][0]:
        raise InvalidRequest("the API key's tenant already has stock: use a fresh tenant "
                             "(pgreserve tenant create) for each run", field="api_key")
    return Tenant(tenant, "api-key tenant")


async def _settle_expiries(service: ReservationService, scenario: Scenario,
                           result: RunResult) -> None:
    """Wait out the short TTLs and expire what is due, as the sweeper would."""
    if scenario.expire <= 0:
        return
    await asyncio.sleep(scenario.expire_ttl_s + 0.1)
    while await service.expire_due() > 0:
        pass


async def _wait_backends_gone(dsn: str, timeout_s: float = 10.0) -> None:
    """Buyers' sessions flush their statistics when they exit: wait until they have."""
    deadline = time.monotonic() + timeout_s
    async with await connect_async(dsn) as conn:
        while time.monotonic() < deadline:
            cur = await conn.execute(queries["backend_count"], (BUYERS_APP,))
            row = await cur.fetchone()
            if row is None or row[0] == 0:
                return
            await asyncio.sleep(0.05)


async def _settled_snapshot(dsn: str, timeout_s: float = 3.0) -> DbSnapshot:
    """A snapshot once the counters stop moving (exiting sessions flush theirs late)."""
    deadline = time.monotonic() + timeout_s
    last = await _snapshot(dsn)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = await _snapshot(dsn)
        # (xact_commit moves with these very snapshots, so it is not compared)
        if (now.pool_deleted, now.pool_dead_tuples, now.xact_rollback) == (
                last.pool_deleted, last.pool_dead_tuples, last.xact_rollback):
            return now
        last = now
    return last


async def _snapshot(dsn: str) -> DbSnapshot:
    """Dead and live tuples of the pool partitions, and the database's transaction counters."""
    async with await connect_async(dsn) as conn:
        cur = await conn.execute(queries["pool_partition_tuple_totals"], (schemas.resolve(),))
        dead, live, deleted, vacuums = (await cur.fetchone()) or (0, 0, 0, 0)
        cur = await conn.execute(queries["database_transaction_stats"])
        deadlocks, commits, rollbacks = (await cur.fetchone()) or (0, 0, 0)
    return DbSnapshot(int(dead), int(live), int(deleted), int(vacuums), int(deadlocks),
                      int(commits), int(rollbacks))


async def _watch_dead_tuples(dsn: str, stop: asyncio.Event, every_s: float = 0.5) -> int:
    """The most dead tuples the pool partitions showed while the buyers ran (sampled)."""
    peak = 0
    async with await connect_async(dsn) as conn:
        while not stop.is_set():
            cur = await conn.execute(queries["pool_partition_dead_tuples"],
                                     (schemas.resolve(),))
            row = await cur.fetchone()
            peak = max(peak, int(row[0]) if row else 0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    return peak


async def read_ledger(db: Database, tenant: int) -> Ledger:
    """The tenant's books, read in one statement."""
    rows = await db.fetch(queries["tenant_books_read"], {"t": tenant})
    return Ledger(*(int(v) for v in rows[0]))


async def violation_lines(service: ReservationService, tenant: int) -> list[str]:
    """What the service's invariant checks find for the tenant, one line each."""
    return [f"{v.sku}@{v.location} {v.rule}: {v.detail}"
            for v in await service.invariant_violations(tenant)]
