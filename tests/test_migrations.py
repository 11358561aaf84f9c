"""The migration runner: versioned files, checksums, one runner at a time."""

from __future__ import annotations

import re
import threading

import psycopg
import pytest

from conftest import in_schema
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import MigrationError


@pytest.fixture
def empty_dsn(pg_server: EmbeddedServer) -> str:
    name = "empty_migrations"
    with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return in_schema(pg_server.dsn(name))


def test_migrating_twice_is_a_no_op(empty_dsn: str) -> None:
    """The second run applies nothing and leaves the schema as it was."""
    first = migrations.migrate(empty_dsn)
    assert [m.version for m in first] == [m.version for m in migrations.available()]
    before = migrations.applied_versions(empty_dsn)
    assert migrations.migrate(empty_dsn) == []
    assert migrations.applied_versions(empty_dsn) == before


def test_changed_file_is_refused(empty_dsn: str) -> None:
    """An applied migration whose checksum no longer matches its file stops the runner."""
    migrations.migrate(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("UPDATE pgreserve_migration SET checksum = 'x' WHERE version = 1")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        migrations.migrate(empty_dsn)


def test_concurrent_runners_apply_once(empty_dsn: str) -> None:
    """Four runners started together: every migration is applied exactly once, none fails."""
    results: list[object] = []

    def run() -> None:
        try:
            results.append(len(migrations.migrate(empty_dsn)))
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 0, 0, len(migrations.available())]  # type: ignore[type-var]  # results mixes ints and recorded exceptions
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgreserve_migration").fetchone() == (
            len(migrations.available()),
        )


# -- the schema is what the files say ----------------------------------------------

_CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind::text, coalesce(array_to_string(c.reloptions, ','), '')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               coalesce(pg_get_expr(d.adbin, d.adrelid), ''), a.attidentity::text,
               a.attstattarget::text
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = %(schema)s AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relkind IN ('r', 'p', 'v', 'm')
        ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s ORDER BY 1, 2""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(schema)s ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %(schema)s ORDER BY 1, 2""",
    "triggers": """
        SELECT t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT t.tgisinternal ORDER BY 1""",
}


def _catalog(dsn: str, schema: str = "pgreserve") -> dict[str, list[tuple[object, ...]]]:
    with psycopg.connect(dsn) as conn:
        return {part: conn.execute(query, {"schema": schema}).fetchall()
                for part, query in _CATALOG.items()}


def _new_database(pg_server: EmbeddedServer, name: str) -> str:
    with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return pg_server.dsn(name)


def test_fresh_schema_equals_the_step_by_step_upgrade(pg_server: EmbeddedServer) -> None:
    """Migrating from scratch and upgrading one migration at a time (the function files
    applied at each step) give the same tables, columns, constraints, indexes, functions
    with their settings, and triggers."""
    fresh = _new_database(pg_server, "schema_fresh")
    stepwise = _new_database(pg_server, "schema_stepwise")
    migrations.migrate(fresh)
    for migration in migrations.available():
        done = migrations.migrate_all(stepwise, target=migration.version)
        assert [m.version for m in done.migrations] == [migration.version]
    fresh_catalog, stepwise_catalog = _catalog(fresh), _catalog(stepwise)
    assert fresh_catalog["functions"] and fresh_catalog["triggers"]
    for part in _CATALOG:
        assert stepwise_catalog[part] == fresh_catalog[part], part


def test_every_function_is_defined_once_and_only_in_function_files() -> None:
    """No migration defines a function or trigger, and each function name has exactly
    one definition across sql/functions/."""
    definition = re.compile(
        r"CREATE\s+(?:OR\s+REPLACE\s+)?(FUNCTION|TRIGGER)\s+(\w+)", re.IGNORECASE)
    for migration in migrations.available():
        assert not definition.search(migration.sql), migration.name
    names = [(m[1].upper(), m[2]) for f in migrations.function_files()
             for m in definition.finditer(f.sql)]
    assert names and len(names) == len(set(names))


def test_only_changed_function_files_are_applied(empty_dsn: str) -> None:
    """A second run re-applies no function file; a file whose recorded checksum differs
    is applied again, and only that one."""
    first = migrations.migrate_all(empty_dsn)
    assert sorted(f.name for f in first.functions) == sorted(
        f.name for f in migrations.function_files())
    assert migrations.migrate_all(empty_dsn).functions == []
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("UPDATE pgreserve_function_file SET checksum = 'x' WHERE name = 'bucket'")
    again = migrations.migrate_all(empty_dsn)
    assert again.migrations == [] and [f.name for f in again.functions] == ["bucket"]


def test_replacing_a_function_file_keeps_its_settings(empty_dsn: str) -> None:
    """Settings written inside CREATE FUNCTION survive a re-application of the file."""
    migrations.migrate(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("ALTER FUNCTION reserve_v1 RESET ALL")
        conn.execute("UPDATE pgreserve_function_file SET checksum = 'x'"
                     " WHERE name = 'reservation'")
    migrations.migrate(empty_dsn)
    with psycopg.connect(empty_dsn) as conn:
        row = conn.execute("SELECT proconfig FROM pg_proc WHERE proname = 'reserve_v1'").fetchone()
    assert row is not None
    assert sorted(row[0]) == ["enable_seqscan=off", "plan_cache_mode=force_generic_plan",
                              "search_path=pgreserve, pg_temp"]


def test_a_database_of_the_old_history_is_refused_with_a_clear_message(empty_dsn: str) -> None:
    """A database made by the unreleased 0001_core..0006 history is not touched: the
    runner says to recreate it, and `pgreserve migrate` prints that without a traceback."""
    from click.testing import CliRunner

    from pgreserve.cli import main

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("""CREATE TABLE public.pgreserve_migration (
                            version integer PRIMARY KEY, name text NOT NULL,
                            checksum text NOT NULL,
                            applied_at timestamptz NOT NULL DEFAULT now())""")
        conn.execute("INSERT INTO public.pgreserve_migration (version, name, checksum)"
                     " VALUES (1, 'core', 'c'), (2, 'functions', 'f')")
    with pytest.raises(MigrationError, match="Recreate it"):
        migrations.migrate(empty_dsn)
    result = CliRunner().invoke(main, ["migrate", "--database-url", empty_dsn])
    assert result.exit_code == 1
    assert "Recreate it" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT to_regclass('stock_bucket'), to_regnamespace('pgreserve')"
                            ).fetchone() == (None, None)
