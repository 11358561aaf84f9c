"""The schema runner: versioned migrations for tables, then the function files.

Migrations (`sql/migrations/NNNN_name.sql`) hold tables, indexes, partitions
and data changes, and never change once applied (their checksums are
recorded). Every function and trigger is defined once, in
`sql/functions/<noun>.sql`, with `CREATE OR REPLACE`; after the migrations the
runner re-applies each function file whose checksum differs from the one it
recorded. Both steps run in one transaction under one advisory lock, so a
second runner waits and then finds nothing to do.

Everything is created in pgreserve's own schema (db/schema.py): the runner
creates it and sets the transaction's search_path to it. An installation made
before pgreserve had a schema of its own (its tables in `public`) is moved into
the schema first, data and all.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from ..errors import DatabaseNotMigrated, DatabaseTooNew, MigrationError
from . import schema as schemas
from .connect import connect
from .queries import queries

# Any constant works: all runners of one database take the same lock.
_LOCK_KEY = 0x70677265_73657276  # "pgreserv"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_FUNCTION_FILE = re.compile(r"^([a-z0-9_]+)\.sql$")

# The first migration of the unreleased development history that the baseline
# replaced. A database made by it has another schema under the same versions.
_LEGACY_FIRST = "core"


def _checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return _checksum(self.sql)


@dataclass(frozen=True)
class FunctionFile:
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return _checksum(self.sql)


@dataclass
class Applied:
    """What one run applied: pending migrations, then changed function files."""

    migrations: list[Migration] = field(default_factory=list)
    functions: list[FunctionFile] = field(default_factory=list)


def available() -> list[Migration]:
    found = []
    folder = resources.files("pgreserve") / "sql" / "migrations"
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError("two migration files share a version number")
    return found


def function_files() -> list[FunctionFile]:
    """The function files, in name order (the order they are applied in)."""
    found = []
    folder = resources.files("pgreserve") / "sql" / "functions"
    for entry in folder.iterdir():
        match = _FUNCTION_FILE.match(entry.name)
        if match:
            found.append(FunctionFile(match[1], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda f: f.name)
    return found


def migrate(conninfo: str, *, target: int | None = None,
            schema: str | None = None) -> list[Migration]:
    """Apply pending migrations (up to `target`) and changed function files in
    `schema` (default PGRESERVE_SCHEMA, else `pgreserve`); return the
    migrations applied."""
    return migrate_all(conninfo, target=target, schema=schema).migrations


def upgrade(conninfo: str, *, schema: str | None = None) -> list[Migration]:
    """What the commands other than `pgreserve migrate` run first: `migrate`, except that
    a schema other than the default which holds no installation yet is not created.

    A mistyped `--schema` (or PGRESERVE_SCHEMA) would otherwise start a new, empty
    installation beside the real one, and a tenant or a webhook made there would be
    lost to the service. Such a schema raises DatabaseNotMigrated naming the command
    that creates it (`pgreserve migrate --schema NAME`); the default schema is still
    created on first use (the quick start's `make run` needs no `migrate`)."""
    where = schemas.resolve(schema)
    if where != schemas.DEFAULT_SCHEMA and not applied_versions(conninfo, schema=where):
        from .migration_check import migrate_command

        command = migrate_command(conninfo, where)
        raise DatabaseNotMigrated(
            f"schema {where!r} holds no pgreserve installation in this database: check "
            f"the name (--schema, PGRESERVE_SCHEMA), or run `{command}` to create one",
            missing=[f"{m.version:04d}_{m.name}" for m in available()], functions=[],
            command=command)
    return migrate(conninfo, schema=where)


def migrate_all(conninfo: str, *, target: int | None = None,
                schema: str | None = None) -> Applied:
    """Apply pending migrations (up to `target`, default all), then every
    function file whose checksum changed, in one transaction, in `schema`."""
    where = schemas.resolve(schema)
    files = available()
    if target is not None:
        files = [m for m in files if m.version <= target]
    done = Applied()
    with connect(conninfo) as conn, conn.transaction():
        conn.execute(queries["schema_lock"], (_LOCK_KEY,))
        conn.execute(sql.SQL(queries["schema_create"]).format(sql.Identifier(where)))
        conn.execute(sql.SQL(queries["schema_search_path"]).format(sql.Identifier(where)))
        if where != "public":
            _adopt_public(conn, where)
        conn.execute(queries["schema_migration_table_create"])
        conn.execute(queries["schema_function_file_table_create"])
        applied = {
            int(row[0]): (str(row[1]), str(row[2]))
            for row in conn.execute(queries["schema_migration_list"]).fetchall()
        }
        _check_applied(applied, {m.version: m for m in available()})
        for migration in files:
            if migration.version in applied:
                continue
            conn.execute(migration.sql.encode())
            conn.execute(queries["schema_migration_record"],
                         (migration.version, migration.name, migration.checksum))
            done.migrations.append(migration)
        recorded = {
            str(row[0]): str(row[1])
            for row in conn.execute(queries["schema_function_file_list"]).fetchall()
        }
        for function_file in function_files():
            if recorded.get(function_file.name) == function_file.checksum:
                continue
            try:
                conn.execute(function_file.sql.encode())
            except psycopg.errors.Error as exc:
                raise MigrationError(
                    f"functions/{function_file.name}.sql failed: {exc}") from exc
            conn.execute(queries["schema_function_file_record"],
                         (function_file.name, function_file.checksum))
            done.functions.append(function_file)
    return done


def _adopt_public(conn: psycopg.Connection[Any], where: str) -> None:
    """Move an installation made in `public` (before pgreserve had a schema of its
    own) into `where`, when `where` has none yet."""
    row = conn.execute(queries["schema_public_install_exists"], (where,)).fetchone()
    if not row or not row[0]:
        return
    legacy = {int(r[0]): (str(r[1]), str(r[2]))
              for r in conn.execute(queries["schema_public_migration_list"]).fetchall()}
    _check_applied(legacy, {m.version: m for m in available()})
    conn.execute(queries["schema_adopt_public"])
    conn.execute(queries["schema_function_file_forget"])


def _check_applied(applied: dict[int, tuple[str, str]], by_version: dict[int, Migration]) -> None:
    if applied.get(1, ("",))[0] == _LEGACY_FIRST:
        raise MigrationError(
            "this database was created by pgreserve's unreleased development schema "
            "(migrations 0001_core to 0006_fewer_relations), which the 0001_baseline "
            "migration replaced; it cannot be upgraded. Recreate it: drop the database "
            "(for the embedded server, remove its data directory) and run "
            "`pgreserve migrate` again.")
    latest = max(by_version, default=0)
    newer = [f"{version:04d}_{name}" for version, (name, _) in sorted(applied.items())
             if version > latest]
    if newer:
        raise DatabaseTooNew(
            f"this database was migrated by a newer pgreserve: it has migration(s) "
            f"{', '.join(newer)}, which this pgreserve ({_version()}, migrations up to "
            f"{latest:04d}) does not know. Nothing was changed (a database is never "
            f"migrated down): run a pgreserve at least as new as the one that migrated it.",
            newer=newer)
    for version, (name, checksum) in sorted(applied.items()):
        migration = by_version.get(version)
        if migration is None:
            raise MigrationError(
                f"migration {version:04d}_{name} is applied but its file is missing"
            )
        if migration.checksum != checksum:
            raise MigrationError(
                f"migration {version:04d}_{name}.sql changed after it was applied "
                f"(recorded {checksum[:12]}, file {migration.checksum[:12]})"
            )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pgreserve")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown version"


def applied_versions(conninfo: str, *,
                     schema: str | None = None) -> list[tuple[int, str, str]]:
    """The migrations applied in `schema` (default as `migrate`): version, name, checksum."""
    with connect(conninfo) as conn, \
            schemas.transaction(conn, schemas.resolve(schema)):
        exists = conn.execute(queries["schema_migration_table_exists"]).fetchone()
        if not exists or exists[0] is None:
            return []
        return [
            (int(r[0]), str(r[1]), str(r[2]))
            for r in conn.execute(queries["schema_migration_list"]).fetchall()
        ]
