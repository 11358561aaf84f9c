"""The command line's answers to a user's mistakes: messages and exit codes, never a traceback
or a silently created second database."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import psycopg
import psycopg.conninfo
import pytest
from click.testing import CliRunner

import pgreserve
from pgreserve.cli import main
from pgreserve.config import mask_password
from pgreserve.http.server import ApiServer
from procs import running
from test_cli_up import BIN, free_port


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGRESERVE_")}
    env.update(extra)
    return env


def pgr(*args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, cwd=cwd,
                          env=env or clean_env(), timeout=timeout, check=False)


def with_password(dsn: str, password: str) -> str:
    """The test server's DSN (trust authentication) with a password in it."""
    assert "postgres:@" in dsn, dsn
    return dsn.replace("postgres:@", f"postgres:{password}@", 1)


@contextmanager
def running_up(*args: str, cwd: str | Path | None = None,
               env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """`pgreserve up ARGS` in a subprocess until it says it is up; SIGTERM at the end.
    The ops listener gets a free port unless ARGS name one; `env` (default: this
    environment without PGRESERVE_*) is the process's environment."""
    if "--ops-port" not in args:
        args = (*args, "--ops-port", str(free_port()))
    with running([str(BIN), "up", *args], env=clean_env() if env is None else env,
                 cwd=cwd) as up:
        yield up.lines


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temporary directory (the embedded server's socket lives in its data dir)."""
    root = Path(tempfile.mkdtemp(prefix="pgr-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_version_prints_the_package_version() -> None:
    """`pgreserve --version` prints the installed version and exits 0."""
    result = pgr("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"pgreserve {pgreserve.__version__}"


def test_help_shows_the_environment_variables() -> None:
    """`--help` of a command names the environment variable of each option that has one."""
    result = CliRunner().invoke(main, ["up", "--help"])
    assert result.exit_code == 0
    for var in ("PGRESERVE_DATABASE_URL", "PGRESERVE_DATA_DIR", "PGRESERVE_HOST",
                "PGRESERVE_PORT", "PGRESERVE_KEY_RETENTION_HOURS"):
        assert f"env var: {var}" in " ".join(result.output.split()), var


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


def test_every_command_names_its_options_environment_variables() -> None:
    """Every option of every command (rollout, freeze, tenant key, ... included) that is
    read from an environment variable names it in that command's --help."""
    for path in _commands(main):
        command: click.Command = main
        for name in path:
            assert isinstance(command, click.Group)
            command = command.commands[name]
        envvars = [p.envvar for p in command.params
                   if isinstance(p, click.Option) and isinstance(p.envvar, str)]
        result = CliRunner().invoke(main, [*path, "--help"], terminal_width=400)
        assert result.exit_code == 0, path
        text = " ".join(result.output.split())
        for var in envvars:
            assert f"env var: {var}" in text, (path, var)


def test_an_unreachable_database_is_a_message_without_the_password() -> None:
    """A URL whose server refuses the connection exits 1 with one message naming it, its
    password masked, and no traceback."""
    url = f"postgresql://shop:hunter2@127.0.0.1:{free_port()}/shop"
    result = pgr("tenant", "list", "--database-url", url)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr
    assert result.stderr.startswith("Error: cannot connect to postgresql://shop:***@127.0.0.1")


def test_a_malformed_database_url_is_a_message() -> None:
    """A URL psycopg cannot parse exits 1 saying it is not a PostgreSQL URL."""
    result = pgr("doctor", "--database-url", "not a url")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is not a PostgreSQL URL" in result.stderr


@pytest.mark.parametrize("url", [
    "postgresql://shop:hunter2@[::1",  # an unclosed IPv6 bracket
    "postgresql://shop:hunter2@127.0.0.1:5432/shop?connect_timeout=abc",
])
def test_a_url_only_libpq_refuses_is_a_message_without_the_password(url: str) -> None:
    """A URL no parser takes, or with a connect_timeout libpq refuses, exits 1 with one
    line, its password masked, and no traceback, from any command (before: a traceback
    from the masking itself, or from doctor's own connection)."""
    for command in (["tenant", "list"], ["doctor"]):
        result = pgr(*command, "--database-url", url)
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr and "hunter2" not in result.stderr
        assert result.stderr.startswith("Error: --database-url / PGRESERVE_DATABASE_URL is "
                                        "not a PostgreSQL URL (postgresql://shop:***@")
        assert len(result.stderr.strip().splitlines()) == 1


def test_an_uncreatable_data_directory_is_a_message(short_dir: Path) -> None:
    """`up` with a data directory that cannot be created exits 1 naming it, no traceback."""
    blocker = short_dir / "file"
    blocker.write_text("not a directory")
    result = pgr("up", "--data-dir", str(blocker / "data"), "--port", str(free_port()))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot create the data directory {blocker / 'data'}" in result.stderr


def test_waiting_on_another_start_of_the_embedded_server_ends_with_a_message(
        short_dir: Path) -> None:
    """A process that waits too long for another's start of the same data directory
    gets NoDatabase naming that process, and creates nothing (it used to wait forever)."""
    import fcntl

    from pgreserve.db.embedded import EmbeddedServer
    from pgreserve.errors import NoDatabase

    with open(short_dir / ".data.start.lock", "w") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(NoDatabase, match=r"another process \(pid 4242, .*0\.3 s"):
            EmbeddedServer(short_dir / "data", start_wait_s=0.3).start()
    assert not (short_dir / "data").exists()


def test_a_busy_port_is_a_message(short_dir: Path) -> None:
    """`up` on a port something else listens on exits 1 before starting a database."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = pgr("up", "--data-dir", str(short_dir / "data"), "--port", str(port))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert not (short_dir / "data").exists()


def test_a_busy_ops_port_is_a_message_naming_it(short_dir: Path) -> None:
    """`up` whose ops listener's port is taken exits 1 before starting a database, with
    one line naming that address and --ops-port (before: uvicorn's error line, then a
    message about the HTTP server on the API's free port); the same port for both (as
    localhost and 127.0.0.1) is refused the same way."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            free = spare.getsockname()[1]
        result = pgr("up", "--data-dir", str(short_dir / "data"), "--port", str(free),
                     "--ops-port", str(busy))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{busy}" in result.stderr, result.stderr
    assert "--ops-port" in result.stderr and "uvicorn" not in result.stderr
    same = pgr("up", "--data-dir", str(short_dir / "data"), "--port", str(free),
               "--ops-port", str(free), "--host", "localhost")
    assert same.returncode == 1 and "the API's address is that port too" in same.stderr, \
        same.stderr
    assert not (short_dir / "data").exists()


def test_api_server_on_a_busy_port_returns_instead_of_raising_systemexit(dsn: str) -> None:
    """ApiServer.serve on a port taken after the check returns with started False (the
    caller reports it) instead of raising uvicorn's SystemExit out of its task."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        api = ApiServer(dsn, "127.0.0.1", taken.getsockname()[1])
        asyncio.run(api.serve())
    assert not api.started


@pytest.mark.parametrize("args", [["tenant", "create", "shop"], ["tenant", "list"],
                                  ["tenant", "key", "list", "shop"], ["freeze", "list"],
                                  ["rollout", "status"], ["reconcile"],
                                  ["webhook", "list", "shop"], ["doctor"], ["worker"]])
def test_commands_other_than_up_and_migrate_refuse_to_create_a_database(
        short_dir: Path, args: list[str]) -> None:
    """Run in a folder with no database, a command exits 1 naming the directory it looked
    at and how to point it elsewhere, and creates nothing."""
    result = pgr(*args, cwd=short_dir)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    looked = short_dir.resolve() / ".pgreserve" / "data"
    assert f"no embedded pgreserve database in {looked}" in result.stderr
    assert "--data-dir" in result.stderr and "--database-url" in result.stderr
    assert list(short_dir.iterdir()) == []


def test_migrate_creates_the_embedded_database(short_dir: Path) -> None:
    """`migrate` (like `up`) creates the embedded database in a new data directory; once
    it has exited, `db url` says no server runs there instead of printing a dead address."""
    result = pgr("migrate", "--data-dir", str(short_dir / "data"))
    assert result.returncode == 0, result.stderr
    assert "applied 0001_baseline" in result.stdout
    assert (short_dir / "data" / "PG_VERSION").exists()
    printed = pgr("db", "url", "--data-dir", str(short_dir / "data"))
    assert printed.returncode == 1 and printed.stdout == ""
    assert "holds a database, but no server runs on it" in printed.stderr


def test_db_url_without_a_running_server_says_so_and_starts_nothing(short_dir: Path) -> None:
    """`db url` on a data directory where no server runs exits 1 and creates nothing."""
    result = pgr("db", "url", "--data-dir", str(short_dir / "data"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "holds no database" in result.stderr and "pgreserve up" in result.stderr
    assert not (short_dir / "data").exists()


def test_up_db_url_and_commands_from_another_folder(short_dir: Path) -> None:
    """While `up` runs, `db url` prints a DSN that still connects after it exits; a command
    run from another folder refuses instead of starting a second database, and with
    PGRESERVE_DATA_DIR joins the served one; the banner names that directory."""
    data = short_dir / "data"
    elsewhere = short_dir / "elsewhere"
    elsewhere.mkdir()
    with running_up("--data-dir", str(data), "--port", str(free_port())) as lines:
        printed = pgr("db", "url", "--data-dir", str(data))
        assert printed.returncode == 0, printed.stderr
        with psycopg.connect(printed.stdout.strip()) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("pgreserve",)
        assert any(f"tenant create NAME --data-dir {data}" in x for x in lines), lines
        refused = pgr("tenant", "create", "shop", cwd=elsewhere)
        assert refused.returncode == 1 and "no embedded pgreserve database" in refused.stderr
        assert list(elsewhere.iterdir()) == []
        made = pgr("tenant", "create", "shop", "--json", cwd=elsewhere,
                   env=clean_env(PGRESERVE_DATA_DIR=str(data)))
        assert made.returncode == 0, made.stderr
        listed = pgr("tenant", "list", "--json", "--data-dir", str(data))
        assert [t["name"] for t in json.loads(listed.stdout)] == ["shop"]


def test_up_banner_masks_the_database_password(dsn: str) -> None:
    """`up --database-url` with a password prints the URL with the password masked."""
    url = with_password(dsn, "hunter2")
    with running_up("--database-url", url, "--port", str(free_port())) as lines:
        banner = "".join(lines)
    assert "hunter2" not in banner
    assert "database: postgresql://postgres:***@/" in banner


@pytest.mark.parametrize(("url", "masked"), [
    ("postgresql://u:p%40ss@db.example:5432/x?sslmode=require",
     "postgresql://u:***@db.example:5432/x?sslmode=require"),
    ("postgresql://u@db/x?password=s3cret&sslmode=require",
     "postgresql://u@db/x?password=***&sslmode=require"),
    ("postgresql://postgres:@/x?host=/tmp/d", "postgresql://postgres:@/x?host=/tmp/d"),
    # the SSL key's password too; nothing else of the URL changes, also where a parser
    # would rewrite it (an empty host) or refuse it (an unclosed IPv6 bracket)
    ("postgresql://u@db/x?sslpassword=k3y&sslmode=require",
     "postgresql://u@db/x?sslpassword=***&sslmode=require"),
    ("postgresql:///x?host=/tmp&password=s3cret", "postgresql:///x?host=/tmp&password=***"),
    ("postgresql://u:s3cret@[::1", "postgresql://u:***@[::1"),
    # as libpq reads it: the user info ends at the first "@" before the first "/"
    ("postgresql://u:pa?ss@db.example/app", "postgresql://u:***@db.example/app"),
    ("postgresql://u:p@ss@h/db", "postgresql://u:***@ss@h/db"),
])
def test_mask_password_hides_every_form_of_password(url: str, masked: str) -> None:
    """mask_password replaces the password of a URL, a URL parameter and a key=value
    string, and leaves a URL without one as it is."""
    assert mask_password(url) == masked
    keywords = mask_password("host=db user=u password=s3cret dbname=x")
    assert "s3cret" not in keywords
    assert psycopg.conninfo.conninfo_to_dict(keywords) == {
        "host": "db", "user": "u", "password": "***", "dbname": "x"}


def test_tenant_list_and_webhook_delete(dsn: str) -> None:
    """`tenant list` shows every tenant; `webhook delete` removes an endpoint, and a second
    delete of it is a message and exit 1."""
    runner = CliRunner()
    assert runner.invoke(main, ["tenant", "list", "--database-url", dsn]).output == \
        "no tenants\n"
    for name in ("shop", "outlet"):
        assert runner.invoke(main, ["tenant", "create", name, "--database-url", dsn]) \
            .exit_code == 0
    listed = json.loads(runner.invoke(main, ["tenant", "list", "--json",
                                             "--database-url", dsn]).output)
    assert [t["name"] for t in listed] == ["shop", "outlet"]
    added = json.loads(runner.invoke(main, ["webhook", "add", "shop", "https://shop.example/h",
                                            "--json", "--database-url", dsn]).output)
    gone = runner.invoke(main, ["webhook", "delete", "shop", str(added["id"]),
                                "--database-url", dsn])
    assert gone.exit_code == 0 and f"webhook {added['id']} deleted" in gone.output
    assert json.loads(runner.invoke(main, ["webhook", "list", "shop", "--json",
                                           "--database-url", dsn]).output) == []
    again = runner.invoke(main, ["webhook", "delete", "shop", str(added["id"]),
                                 "--database-url", dsn])
    assert again.exit_code == 1 and "Traceback" not in again.output


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_malformed_legacy_redis_url_is_refused_before_anything_starts(
        short_dir: Path, command: str) -> None:
    """`up` / `serve --legacy-redis-url not-a-url` exits 2 with a message naming the
    option, no traceback, and creates nothing."""
    result = pgr(command, "--data-dir", str(short_dir / "data"), "--port", str(free_port()),
                 "--legacy-redis-url", "not-a-url", cwd=short_dir)
    assert result.returncode == 2, result.stderr
    assert "--legacy-redis-url" in result.stderr and "Traceback" not in result.stderr
    assert list(short_dir.iterdir()) == []


@pytest.mark.parametrize("command", [
    ("tenant", "key", "list", "bad\udcff"),
    ("freeze", "list", "--tenant", "\udcff"),
    ("rollout", "set", "\udcff", "shadow"),
    ("rollout", "report", "--tenant", "\udcff"),
    ("webhook", "add", "cli-bytes", "https://example.com/\udcff"),
])
def test_bytes_that_are_not_utf8_are_a_message_not_a_traceback(
        dsn: str, command: tuple[str, ...]) -> None:
    """A tenant name or webhook URL given as bytes that are not UTF-8 (the shell's
    `$'\\xff'`; Python reads it as a lone surrogate) is the typed message, exit 1,
    as for `tenant create`, not a traceback from the driver."""
    assert pgr("tenant", "create", "cli-bytes", "--database-url", dsn).returncode in (0, 1)
    result = pgr(*command, "--database-url", dsn)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("Error: ")
    assert "must be valid Unicode text" in result.stderr, result.stderr
