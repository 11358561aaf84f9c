"""The migration runner: versioned files, checksums, one runner at a time."""

from __future__ import annotations

import threading

import psycopg
import pytest

from pgreserve.db import migrate as migrations
from pgreserve.errors import MigrationError
from pgreserve.db.embedded import EmbeddedServer


@pytest.fixture
def empty_dsn(pg_server: EmbeddedServer) -> str:
    name = "empty_migrations"
    with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return pg_server.dsn(name)


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
        except Exception as exc:  # recorded and asserted below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 0, 0, len(migrations.available())]  # type: ignore[type-var]
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgreserve_migration").fetchone() == (
            len(migrations.available()),
        )
