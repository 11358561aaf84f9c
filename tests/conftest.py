"""Fixtures: one PostgreSQL per test run (the embedded 18, or the installed server that
PGRESERVE_TEST_PG_BIN names), a migrated template, a fresh database per test."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from pgreserve import Database, ReservationService, Tenant
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgserver import ExternalServer
from quiet import WATCHED
from toolcheck import pytest_report_header, pytest_terminal_summary, require

__all__ = ["pytest_report_header", "pytest_terminal_summary"]  # hooks of tests/toolcheck.py

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

    from pgbouncer import PgBouncer

TEMPLATE = "pgreserve_template"
_counter = itertools.count()

# Tests do not test durability against power loss; fault tests that crash the
# server rely on WAL replay, which works with fsync off as long as the OS stays up.
DEFAULT_COLLECTOR = gc.get_threshold()
TEST_SETTINGS = {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "off"}

# An installed server's bin directory (e.g. /usr/lib/postgresql/15/bin): the session's
# server is a temporary cluster made with it instead of the embedded PostgreSQL 18.
EXTERNAL_PG_BIN = os.environ.get("PGRESERVE_TEST_PG_BIN") or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Against an installed server, run only the tests that use the session's server;
    the others start embedded servers of their own (or none) and ran in the main run."""
    if EXTERNAL_PG_BIN is None:
        return
    keep = [i for i in items if "pg_server" in getattr(i, "fixturenames", ())]
    dropped = [i for i in items if "pg_server" not in getattr(i, "fixturenames", ())]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(autouse=True)
def collector_untouched() -> Iterator[None]:
    """No test leaves this process's garbage collector frozen or retuned (tune_gc is
    for the processes that serve the API; tests that check it run it elsewhere)."""
    yield
    assert gc.get_freeze_count() == 0, "a test froze the test process's heap"
    assert gc.get_threshold() == DEFAULT_COLLECTOR, gc.get_threshold()


def log_levels() -> dict[str, int]:
    return {name: logging.getLogger(name).level for name in WATCHED}


# as the libraries leave them (psycopg sets its own to WARNING), before any test module
DEFAULT_LOG_LEVELS = log_levels()


@pytest.fixture(autouse=True)
def loggers_untouched() -> Iterator[None]:
    """Every test sees pgreserve's and psycopg's log lines (caplog checks them): no
    module turned those loggers down at import, no test leaves them turned down."""
    assert log_levels() == DEFAULT_LOG_LEVELS, log_levels()
    yield
    assert log_levels() == DEFAULT_LOG_LEVELS, log_levels()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedServer]:
    root = Path(tempfile.mkdtemp(prefix="pgreserve-test-"))
    server = (ExternalServer(EXTERNAL_PG_BIN, root / "data", extra_settings=TEST_SETTINGS)
              if EXTERNAL_PG_BIN else
              EmbeddedServer(root / "data", extra_settings=TEST_SETTINGS))
    server.start()
    admin = server.dsn("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE}")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    migrations.migrate(server.dsn(TEMPLATE))
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


def in_schema(dsn: str, schema: str = "pgreserve") -> str:
    """`dsn` whose sessions search `schema` first, for the tests' own direct connections
    that read pgreserve's tables by their bare names. pgreserve itself never needs it
    (it sets search_path per transaction), and PgBouncer 1.18 would refuse it."""
    return f"{dsn}{'&' if '?' in dsn else '?'}options=-c%20search_path%3D{schema}"


@pytest.fixture
def plain_dsn(pg_server: EmbeddedServer) -> Iterator[str]:
    """A fresh, migrated database for one test, addressed as an application would."""
    name = f"t{os.getpid()}_{next(_counter)}"
    admin = pg_server.dsn("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    yield pg_server.dsn(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def dsn(plain_dsn: str) -> str:
    """The test's database, with pgreserve's schema on the search_path (in_schema)."""
    return in_schema(plain_dsn)


@pytest_asyncio.fixture
async def db(dsn: str) -> AsyncIterator[Database]:
    async with Database(dsn, max_size=16) as database:
        yield database


@pytest_asyncio.fixture
async def service(db: Database) -> ReservationService:
    return ReservationService(db)


@pytest_asyncio.fixture
async def tenant(service: ReservationService) -> Tenant:
    return await service.create_tenant("acme")


class Clock:
    """A clock the test moves by hand (`ReservationService(clock=...)`)."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def timed(db: Database, clock: Clock) -> ReservationService:
    """A service whose clock is `clock`."""
    return ReservationService(db, clock=clock)


@pytest.fixture(params=["row", "pool"])
def strategy(request: pytest.FixtureRequest) -> str:
    """Run a test once per stock strategy."""
    return str(request.param)


def table_counts(dsn: str) -> dict[str, int]:
    """Row counts of every table that a write would touch."""
    tables = ["tenant", "stock_bucket", "stock_unit", "reservation", "reservation_line",
              "request_ledger", "stock_movement", "outbox_event"]
    counts: dict[str, int] = {}
    with psycopg.connect(dsn) as conn:
        for t in tables:
            row = conn.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(t))).fetchone()
            assert row is not None
            counts[t] = int(row[0])
    return counts


# -- the HTTP API ---------------------------------------------------------------

class ApiTenant:
    """A tenant with its API key and an authenticated client."""

    def __init__(self, tenant: Tenant, key: str, client: httpx.AsyncClient) -> None:
        self.tenant = tenant
        self.key = key
        self.client = client


@pytest.fixture(scope="session")
def pgbouncer(pg_server: EmbeddedServer) -> Iterator[PgBouncer]:
    """A real PgBouncer (transaction pooling) in front of the session's server."""
    from pgbouncer import PgBouncer

    require("pgbouncer")
    bouncer = PgBouncer(pg_server).start()
    yield bouncer
    bouncer.stop()


@pytest.fixture(params=["direct", "pgbouncer"])
def via(request: pytest.FixtureRequest) -> str:
    """How the API reaches PostgreSQL: directly, or through PgBouncer."""
    return str(request.param)


@pytest.fixture
def api_dsn(dsn: str, via: str, request: pytest.FixtureRequest) -> tuple[str, int | None]:
    """The DSN and prepare_threshold the API uses: direct, or through PgBouncer."""
    if via == "direct":
        return dsn, 5
    bouncer = request.getfixturevalue("pgbouncer")
    return bouncer.dsn(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]), None


@pytest_asyncio.fixture
async def api_db(db: Database, via: str,
                 api_dsn: tuple[str, int | None]) -> AsyncIterator[Database]:
    """The API's database: the test's own pool, or one through PgBouncer with prepared
    statements off (PgBouncer < 1.21 cannot route them in transaction mode)."""
    if via == "direct":
        yield db
        return
    async with Database(api_dsn[0], max_size=16, prepare_threshold=api_dsn[1]) as through:
        yield through


@pytest_asyncio.fixture
async def app(api_db: Database) -> FastAPI:
    from pgreserve.http import create_app

    return create_app(database=api_db)


@pytest_asyncio.fixture
async def api(app: FastAPI, service: ReservationService) -> AsyncIterator[ApiTenant]:
    """An httpx client on the real app, authenticated as tenant 'acme'."""
    import httpx

    created, key = await service.create_tenant_with_key("acme")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        yield ApiTenant(created, key, client)


@pytest_asyncio.fixture
async def other(app: FastAPI, service: ReservationService) -> AsyncIterator[ApiTenant]:
    """A second tenant, 'globex', with its own client."""
    import httpx

    created, key = await service.create_tenant_with_key("globex")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        yield ApiTenant(created, key, client)
