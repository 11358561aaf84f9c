"""A temporary PostgreSQL cluster from an installed server's binaries (initdb, pg_ctl).

`PGRESERVE_TEST_PG_BIN=/usr/lib/postgresql/15/bin pytest` runs every test that uses the
session's server (the `pg_server` fixture) against that version instead of the
embedded PostgreSQL 18. The cluster gets the settings the embedded server gets
(pgreserve.db.embedded.SERVER_SETTINGS, ROLE_SETTINGS) plus the test settings, listens
on a Unix socket in its own directory only, and runs as an unprivileged user when the
tests run as root (initdb and postgres refuse root), as the embedded server does.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile
from pathlib import Path

import psycopg
from psycopg import sql

from pgreserve.db.embedded import ROLE_SETTINGS, SERVER_SETTINGS, EmbeddedServer

SYSTEM_USER = "embedded_postgres"  # the embedded server's unprivileged user, shared


def _conf_value(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class ExternalServer(EmbeddedServer):
    """An EmbeddedServer look-alike (start, dsn, stop, stop_now, data_dir) on a cluster of
    its own made with the installed binaries of `bin_dir`."""

    def __init__(self, bin_dir: str | os.PathLike[str], data_dir: Path,
                 extra_settings: dict[str, str] | None = None) -> None:
        super().__init__(data_dir, extra_settings)
        self.bin_dir = Path(bin_dir)
        self.socket_dir = self.data_dir.parent / "sock"
        self.started = False

    def _as_user(self, *argv: str) -> list[str]:
        if os.geteuid() != 0:
            return list(argv)
        try:
            pwd.getpwnam(SYSTEM_USER)
        except KeyError:
            subprocess.run(["useradd", "-s", "/bin/bash", SYSTEM_USER],  # noqa: S607
                           check=True, capture_output=True)
        return ["runuser", "-u", SYSTEM_USER, "--", *argv]

    def _chown(self, *paths: Path) -> None:
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SYSTEM_USER)
            for path in paths:
                os.chown(path, entry.pw_uid, entry.pw_gid)

    def version(self) -> str:
        out = subprocess.run([str(self.bin_dir / "postgres"), "--version"], check=True,
                             capture_output=True, text=True)
        return out.stdout.strip()

    def start(self) -> str:
        root = self.data_dir.parent
        root.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        os.chmod(root, 0o755)  # noqa: S103 - the server's user must traverse it
        if os.geteuid() == 0:
            self._as_user("true")  # makes the user if missing
            self._chown(root, self.socket_dir)
        subprocess.run(self._as_user(str(self.bin_dir / "initdb"), "-D", str(self.data_dir),
                                     "-U", "postgres", "-A", "trust", "-E", "UTF8",
                                     "--no-instructions"),
                       check=True, capture_output=True)
        settings = {**SERVER_SETTINGS, **self.extra_settings,
                    "listen_addresses": "", "unix_socket_directories": str(self.socket_dir)}
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# pgreserve test settings\n")
            for key, value in settings.items():
                conf.write(f"{key} = {_conf_value(value)}\n")
        log = root / "server.log"
        log.touch()
        self._chown(log)
        subprocess.run(self._as_user(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir),
                                     "-w", "-t", "120", "-l", str(log), "start"),
                       check=True, capture_output=True)
        self.started = True
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            for key, value in ROLE_SETTINGS.items():
                conn.execute(sql.SQL("ALTER ROLE postgres SET {} = {}").format(
                    sql.Identifier(key), sql.Literal(value)))
        return self.dsn("postgres")

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres:@/{database}?host={self.socket_dir}"

    def stop(self) -> None:
        if self.started:
            subprocess.run(self._as_user(str(self.bin_dir / "pg_ctl"), "-D",
                                         str(self.data_dir), "-w", "-m", "fast", "stop"),
                           check=False, capture_output=True)
            self.started = False

    def stop_now(self, mode: str = "fast") -> None:
        subprocess.run(self._as_user(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir),
                                     "-w", "-m", mode, "stop"), check=True, capture_output=True)
        self.started = False


def temp_external_server(bin_dir: str, extra_settings: dict[str, str]) -> ExternalServer:
    root = Path(tempfile.mkdtemp(prefix="pgreserve-ext-"))
    return ExternalServer(bin_dir, root / "data", extra_settings)
