"""A real PgBouncer (transaction pooling) in front of the embedded test server."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from pgreserve.db.embedded import EmbeddedServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """pgbouncer started in the foreground as the server's system user (it refuses root)."""

    def __init__(self, server: EmbeddedServer, pool_size: int = 40) -> None:
        self.server = server
        self.pool_size = pool_size
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pgreserve-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        lines = (self.server.data_dir / "postmaster.pid").read_text().splitlines()
        pg_port, socket_dir = lines[3].strip(), lines[4].strip()
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        (self.dir / "pgbouncer.ini").write_text(f"""\
[databases]
* = host={socket_dir} port={pg_port} user=postgres

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/users.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = {self.pool_size}
max_db_connections = 60
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
admin_users = postgres
stats_period = 1
logfile = {self.dir}/pgbouncer.log
pidfile = {self.dir}/pgbouncer.pid
""")
        cmd = [binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:
            user = "embedded_postgres"
            pw = pwd.getpwnam(user)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            cmd = [binary, "-u", user, str(self.dir / "pgbouncer.ini")]
        # stderr to a file, never a pipe: nobody reads a pipe during the run,
        # and once its buffer is full pgbouncer blocks writing its log and
        # stops answering (seen in full-suite runs).
        self.stderr = open(self.dir / "stderr.log", "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.stderr)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.dir / "stderr.log").read_text(errors="replace")
                log = (self.dir / "pgbouncer.log")
                raise RuntimeError(f"pgbouncer exited: {err} "
                                   f"{log.read_text() if log.exists() else ''}")
            try:
                with psycopg.connect(self.dsn("postgres"), prepare_threshold=None,
                                     connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return self
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise RuntimeError("pgbouncer did not accept connections within 15 s")

    def dsn(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "stderr", None) is not None:
            self.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)
