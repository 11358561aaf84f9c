"""A database that does not match this pgreserve's migrations (never migrated, migrated
only partly, or migrated by a newer pgreserve) is refused with a typed error naming what is
missing and the command that mends it: by Database.open, the app's startup, a request
(503 problem), the library's first call and the command line."""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from conftest import in_schema
from pgreserve import Database, ReservationService, apikeys
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import DatabaseNotMigrated, DatabaseTooNew
from pgreserve.http import create_app, lifespan
from test_cli import clean_env, pgr, with_password

_names = itertools.count()
ALL = [f"{m.version:04d}_{m.name}" for m in migrations.available()]
NEWER = migrations.available()[-1].version + 1


@pytest.fixture
def blank_dsn(pg_server: EmbeddedServer) -> Iterator[str]:
    """A new database with nothing of pgreserve in it."""
    name = f"blank{os.getpid()}_{next(_names)}"
    admin = pg_server.dsn("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield pg_server.dsn(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def half_dsn(blank_dsn: str) -> str:
    """A database migrated up to its second migration only (an upgrade not run)."""
    done = migrations.migrate_all(blank_dsn, target=2)
    assert [m.version for m in done.migrations] == [1, 2]
    return blank_dsn


@pytest.fixture
def newer_dsn(blank_dsn: str) -> str:
    """A database a newer pgreserve migrated: one migration past the last this code ships."""
    migrations.migrate(blank_dsn)
    with psycopg.connect(in_schema(blank_dsn), autocommit=True) as conn:
        conn.execute("INSERT INTO pgreserve_migration (version, name, checksum)"
                     " VALUES (%s, 'from_a_newer_release', 'c0ffee')", (NEWER,))
    return blank_dsn


def _tables(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(r[0]) for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname NOT IN"
            " ('pg_catalog', 'information_schema') ORDER BY 1").fetchall()]


async def test_opening_an_empty_database_names_every_migration_and_the_command(
        blank_dsn: str) -> None:
    """Database.open on an empty database raises DatabaseNotMigrated listing all the
    migrations and the `pgreserve migrate --database-url` command, creates nothing and
    leaves its pool closed."""
    db = Database(blank_dsn)
    with pytest.raises(DatabaseNotMigrated) as caught:
        await db.open()
    exc = caught.value
    assert exc.details["missing"] == ALL
    assert f"none of the {len(ALL)} migrations is applied" in exc.message
    assert exc.details["command"].startswith("pgreserve migrate --database-url ")
    assert f"run `{exc.details['command']}`" in exc.message
    assert db.pool.closed
    assert _tables(blank_dsn) == []


async def test_a_half_migrated_database_names_the_missing_migrations(half_dsn: str) -> None:
    """After the first two migrations only, opening names exactly the later ones."""
    with pytest.raises(DatabaseNotMigrated) as caught:
        await Database(half_dsn).open()
    assert caught.value.details["missing"] == ALL[2:]
    assert f"missing migration(s) {', '.join(ALL[2:])}" in caught.value.message


async def test_function_files_not_applied_as_shipped_are_named(dsn: str) -> None:
    """A migrated database whose recorded bucket.sql differs from the shipped file is not
    this pgreserve's schema: DatabaseNotMigrated names functions/bucket.sql."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE pgreserve_function_file SET checksum = 'x' WHERE name = 'bucket'")
    with pytest.raises(DatabaseNotMigrated) as caught:
        await Database(dsn).open()
    assert caught.value.details == {"missing": [], "functions": ["bucket"],
                                    "command": caught.value.details["command"]}
    assert "functions/bucket.sql" in caught.value.message


async def test_a_migrated_database_opens(dsn: str) -> None:
    """The check passes a database migrated by this pgreserve: open and a call work."""
    async with Database(dsn) as db:
        tenant = await ReservationService(db).create_tenant("fine")
    assert tenant.id > 0


async def test_a_database_of_a_newer_pgreserve_is_refused(newer_dsn: str) -> None:
    """Opening, and the migration runner, refuse a database with a migration this code does
    not know (DatabaseTooNew naming it), and the runner writes nothing."""
    name = f"{NEWER:04d}_from_a_newer_release"
    with pytest.raises(DatabaseTooNew, match=f"newer pgreserve.*{name}"):
        await Database(newer_dsn).open()
    with psycopg.connect(in_schema(newer_dsn), autocommit=True) as conn:
        conn.execute("UPDATE pgreserve_function_file SET checksum = 'x' WHERE name = 'bucket'")
    with pytest.raises(DatabaseTooNew, match="never migrated down"):
        migrations.migrate(newer_dsn)
    with psycopg.connect(in_schema(newer_dsn)) as conn:
        assert conn.execute("SELECT checksum FROM pgreserve_function_file"
                            " WHERE name = 'bucket'").fetchone() == ("x",)


async def test_the_library_first_call_on_an_unchecked_database_is_typed(blank_dsn: str) -> None:
    """With check_schema=False, the first call on an empty database raises
    DatabaseNotMigrated (not psycopg's UndefinedFunction), naming the command."""
    async with Database(blank_dsn, check_schema=False) as db:
        with pytest.raises(DatabaseNotMigrated, match="run `pgreserve migrate --database-url"):
            await ReservationService(db).create_tenant("nope")


async def test_the_app_refuses_to_start_on_a_half_migrated_database(half_dsn: str) -> None:
    """create_app(dsn)'s startup raises DatabaseNotMigrated; the pool it opened is closed."""
    app = create_app(half_dsn, application_name="pgreserve:unmigrated")
    with pytest.raises(DatabaseNotMigrated, match="0003_freeze"):
        async with lifespan(app):
            pass
    with psycopg.connect(half_dsn) as conn:
        left = conn.execute("SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name = 'pgreserve:unmigrated'").fetchone()
    assert left == (0,)


def _problem(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["type"] == f"urn:pgreserve:problem:{code}" and doc["code"] == code
    assert "pgreserve migrate" in doc["detail"] or code == "database_too_new"
    assert "postgresql://" not in response.text and "host=" not in response.text


async def test_a_request_reaching_an_unmigrated_database_gets_a_503_problem(
        blank_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """An app whose pool opens on first use answers 503 database_not_migrated (no database
    address in the body; the full message in the log), and serves once migrated."""
    app = create_app(blank_dsn)
    transport = httpx.ASGITransport(app=app)  # no lifespan: the pool opens on first use
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        with caplog.at_level(logging.ERROR, logger="pgreserve.http.problems"):
            _problem(await client.get("/healthz"), "database_not_migrated")
        assert any("none of the" in r.getMessage() and "pgreserve migrate --database-url"
                   in r.getMessage() for r in caplog.records)
        migrations.migrate(blank_dsn)
        assert (await client.get("/healthz")).status_code == 200
    await app.state.service.db.close()


async def test_a_request_on_an_unchecked_empty_database_gets_a_503_problem(
        blank_dsn: str) -> None:
    """An app given a Database opened without the check answers a request that reaches a
    missing table or function with 503 database_not_migrated, not a 500."""
    async with Database(blank_dsn, check_schema=False) as db:
        app = create_app(database=db)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     headers={"Authorization": f"Bearer {apikeys.new_key()}"}) as client:
            _problem(await client.get("/v1/stock/wh/tee"), "database_not_migrated")


async def test_a_request_reaching_a_newer_database_gets_a_503_problem(newer_dsn: str) -> None:
    """An app opening its pool on first use over a newer pgreserve's database answers 503
    database_too_new."""
    app = create_app(newer_dsn)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        _problem(await client.get("/healthz"), "database_too_new")


def test_migrate_on_a_newer_database_says_so_in_one_line(newer_dsn: str) -> None:
    """`pgreserve migrate` on a newer pgreserve's database exits 1 with one line saying so,
    no traceback."""
    result = pgr("migrate", "--database-url", newer_dsn, env=clean_env())
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "migrated by a newer pgreserve" in lines[0], result.stderr


def test_reconcile_on_a_half_migrated_database_names_the_command(half_dsn: str) -> None:
    """`reconcile` on a half-migrated database exits 1 with one line naming the missing
    migrations and `pgreserve migrate` (its URL's password masked), instead of psycopg's
    UndefinedTable traceback."""
    secret = "s3cr3t-pw"  # noqa: S105 - the test server trusts; this shows the masking
    result = pgr("reconcile", "--database-url", with_password(half_dsn, secret),
                 env=clean_env())
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr and secret not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "0003_freeze" in lines[0] and "pgreserve migrate --database-url" in lines[0]


def test_doctor_fails_its_schema_check_on_a_half_migrated_database(half_dsn: str) -> None:
    """`doctor --json` on a half-migrated database reports the schema check as failed,
    naming the missing migrations, with the migrate command as its fix (exit 1)."""
    result = pgr("doctor", "--json", "--database-url", half_dsn, env=clean_env())
    assert result.returncode == 1, result
    schema = [f for f in json.loads(result.stdout)["findings"] if f["check"] == "schema"]
    assert len(schema) == 1 and schema[0]["status"] == "fail", schema
    assert "0003_freeze" in schema[0]["found"]
    assert schema[0]["fix"].startswith("pgreserve migrate --database-url ")


async def test_the_check_reads_the_installations_own_schema(blank_dsn: str) -> None:
    """A database migrated in schema `pgreserve` opens in that schema; opened for schema
    `other`, which holds nothing, it is DatabaseNotMigrated with a command naming
    --schema other."""
    migrations.migrate(blank_dsn)
    await (await Database(blank_dsn).open()).close()
    with pytest.raises(DatabaseNotMigrated) as caught:
        await Database(blank_dsn, schema="other").open()
    assert "--schema other" in str(caught.value.details["command"])
