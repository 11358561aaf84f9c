"""Versioned .sql migrations with recorded checksums; one runner at a time."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from ..errors import MigrationError

# Any constant works: all runners of one database take the same lock.
_LOCK_KEY = 0x70677265_73657276  # "pgreserv"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


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


def migrate(conninfo: str) -> list[Migration]:
    """Apply pending migrations in one transaction; return the ones applied.

    A transaction-scoped advisory lock makes a second runner wait, after which
    it finds nothing left to do. Checksums of applied files are verified first.
    """
    files = available()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            conn.execute(
                """CREATE TABLE IF NOT EXISTS pgreserve_migration (
                       version    integer PRIMARY KEY,
                       name       text NOT NULL,
                       checksum   text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            applied = {
                row[0]: (row[1], row[2])
                for row in conn.execute(
                    "SELECT version, name, checksum FROM pgreserve_migration"
                ).fetchall()
            }
            by_version = {m.version: m for m in files}
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
            pending = [m for m in files if m.version not in applied]
            for migration in pending:
                conn.execute(migration.sql.encode())
                conn.execute(
                    "INSERT INTO pgreserve_migration (version, name, checksum) VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )
    return pending


def applied_versions(conninfo: str) -> list[tuple[int, str, str]]:
    with psycopg.connect(conninfo) as conn:
        exists = conn.execute("SELECT to_regclass('pgreserve_migration')").fetchone()
        if not exists or exists[0] is None:
            return []
        return [
            (int(r[0]), str(r[1]), str(r[2]))
            for r in conn.execute(
                "SELECT version, name, checksum FROM pgreserve_migration ORDER BY version"
            ).fetchall()
        ]
