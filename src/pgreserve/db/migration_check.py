"""Is a database migrated for this pgreserve? Asked when a Database opens.

A database this code cannot serve is refused before any request reaches it, with a
typed error that says what is wrong and the command that mends it:

- DatabaseNotMigrated: migrations or function files this pgreserve ships are not
  applied (an empty database, or one migrated only partly), so a statement would
  fail on a missing table or function;
- DatabaseTooNew: it holds migrations of a newer pgreserve (raised by the runner's
  own check, which `pgreserve migrate` runs too).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import psycopg.conninfo

from ..config import mask_password
from ..errors import DatabaseNotMigrated
from . import schema as schemas
from .connect import connect
from .embedded import DATABASE
from .migrate import _check_applied, available, function_files
from .queries import queries


@dataclass(frozen=True)
class Recorded:
    """What the runner recorded in a database: migrations by version (name, checksum)
    and function files by name (checksum)."""

    migrations: dict[int, tuple[str, str]]
    functions: dict[str, str]


def check(recorded: Recorded, conninfo: str, schema: str | None = None) -> None:
    """Raise DatabaseNotMigrated or DatabaseTooNew (or the runner's MigrationError) when
    the database `recorded` describes is not exactly what this pgreserve ships."""
    shipped = {m.version: m for m in available()}
    _check_applied(recorded.migrations, shipped)
    missing = [f"{m.version:04d}_{m.name}" for m in shipped.values()
               if m.version not in recorded.migrations]
    stale = [f.name for f in function_files() if recorded.functions.get(f.name) != f.checksum]
    if not missing and not stale:
        return
    command = migrate_command(conninfo, schema)
    if len(missing) == len(shipped):
        message = (f"this database has no pgreserve schema (none of the {len(shipped)} "
                   f"migrations is applied): run `{command}`, then start again")
    elif missing:
        message = (f"this database is missing migration(s) {', '.join(missing)}: "
                   f"run `{command}`, then start again")
    else:
        # Only function bodies differ: an upgrade not migrated yet, or a database a newer
        # release migrated (whose migrate is then the one to run). Checksums cannot tell.
        files = ", ".join(f"functions/{name}.sql" for name in stale)
        message = (f"this database's SQL functions differ from this pgreserve's ({files}): "
                   f"run `{command}` with this pgreserve if it is the newer one (or with "
                   f"the newer pgreserve that migrated the database), then start again")
    raise DatabaseNotMigrated(message, missing=missing, functions=stale, command=command)


def migrate_command(conninfo: str, schema: str | None = None) -> str:
    """The `pgreserve migrate` command line that migrates the database `conninfo` names
    (its password, if any, shown as ***), for the installation in `schema` (named when it
    is not the default)."""
    name = schemas.resolve(schema)
    where = "" if name == schemas.DEFAULT_SCHEMA else f" --schema {name}"
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return f"pgreserve migrate --database-url URL{where}"
    host = str(params.get("host") or "")
    if (host.startswith("/") and (Path(host) / "PG_VERSION").exists()
            and params.get("dbname") == DATABASE):
        return f"pgreserve migrate --data-dir {shlex.quote(host)}{where}"
    return (f"pgreserve migrate --database-url {shlex.quote(mask_password(conninfo))}"
            f"{where}")


def _recorded(migrations: list[Any], functions: list[Any]) -> Recorded:
    return Recorded({int(r[0]): (str(r[1]), str(r[2])) for r in migrations},
                    {str(r[0]): str(r[1]) for r in functions})


async def check_connection(conn: psycopg.AsyncConnection[Any], conninfo: str,
                           schema: str | None = None) -> None:
    """`check` on what `conn`'s database recorded in `schema` (nothing recorded: never
    migrated)."""
    name = schemas.resolve(schema)
    migrations: list[Any] = []
    functions: list[Any] = []
    async with conn.transaction():
        await conn.execute(schemas.search_path(name))
        row = await (await conn.execute(queries["schema_migration_table_exists"])).fetchone()
        if row is not None and row[0] is not None:
            migrations = await (await conn.execute(queries["schema_migration_list"])).fetchall()
        row = await (await conn.execute(queries["schema_function_file_table_exists"])).fetchone()
        if row is not None and row[0] is not None:
            functions = await (await conn.execute(
                queries["schema_function_file_list"])).fetchall()
    check(_recorded(migrations, functions), conninfo, name)


def check_database(conninfo: str, schema: str | None = None) -> None:
    """`check` on the database `conninfo` names, over a connection of its own, for the
    installation in `schema`."""
    name = schemas.resolve(schema)
    with connect(conninfo) as conn, schemas.transaction(conn, name):
        migrations: list[Any] = []
        functions: list[Any] = []
        row = conn.execute(queries["schema_migration_table_exists"]).fetchone()
        if row is not None and row[0] is not None:
            migrations = conn.execute(queries["schema_migration_list"]).fetchall()
        row = conn.execute(queries["schema_function_file_table_exists"]).fetchone()
        if row is not None and row[0] is not None:
            functions = conn.execute(queries["schema_function_file_list"]).fetchall()
    check(_recorded(migrations, functions), conninfo, name)
