"""The settings model: flag > PGRESERVE_* > --config TOML file > default, checked at start."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pgreserve.cli import main
from pgreserve.settings import SPECS, ConfigFile, Settings
from test_cli import pgr
from test_cli_up import free_port


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short temporary directory (an embedded server's socket would live in it)."""
    root = Path(tempfile.mkdtemp(prefix="pgr-set-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def show(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`pgreserve config show --json ARGS` in this process, as {key: (value, source)}."""
    base = {k: None for k in os.environ if k.startswith("PGRESERVE_")}
    result = CliRunner().invoke(main, ["config", "show", "--json", *args],
                                env={**base, **(env or {})})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    return {"config_file": doc["config_file"],
            **{row["key"]: (row["value"], row["source"]) for row in doc["settings"]}}


def test_flag_beats_environment_beats_file_beats_default(folder: Path) -> None:
    """Each setting is taken from the flag, else the PGRESERVE_* variable, else the file,
    else the default, and `config show` names which."""
    conf = folder / "pgreserve.toml"
    conf.write_text('port = 9001\nhost = "10.0.0.5"\nops_port = 9300\nproxy_headers = true\n'
                    "prepare_threshold = 0\n")
    got = show("--config", str(conf), "--port", "9002",
               env={"PGRESERVE_PORT": "9003", "PGRESERVE_HOST": "10.1.2.3"})
    assert got["port"] == ("9002", "flag --port")
    assert got["host"] == ("10.1.2.3", "env PGRESERVE_HOST")
    assert got["ops_port"] == ("9300", f"file {conf}")
    assert got["proxy_headers"] == ("true", f"file {conf}")
    assert got["prepare_threshold"] == ("0", f"file {conf}")
    assert got["backlog"] == ("2048", "default")
    assert got["config_file"] == str(conf)


def test_the_file_can_be_named_by_pgreserve_config(folder: Path) -> None:
    """PGRESERVE_CONFIG names the file as --config does."""
    conf = folder / "p.toml"
    conf.write_text("timeout_keep_alive = 30\n")
    assert show(env={"PGRESERVE_CONFIG": str(conf)})["timeout_keep_alive"] == (
        "30", f"file {conf}")


def test_config_show_masks_every_secret(folder: Path) -> None:
    """The database URL's password, PgBouncer's and Redis's passwords and the TLS key's
    password are never printed, whichever source they came from."""
    conf = folder / "p.toml"
    conf.write_text('database_url = "postgresql://shop:db-secret-1@db.internal/pgreserve"\n'
                    'legacy_redis_url = "redis://:redis-secret-2@cache:6379/0"\n')
    cert = folder / "c.pem"
    cert.write_text("x")
    result = CliRunner().invoke(main, [
        "config", "show", "--config", str(conf), "--ssl-certfile", str(cert),
        "--ssl-keyfile", str(cert),
        "--pgbouncer-admin-url", "postgresql://stats:bouncer-secret-3@127.0.0.1:6432/pgbouncer"],
        env={"PGRESERVE_SSL_KEYFILE_PASSWORD": "key-secret-4"})
    assert result.exit_code == 0, result.output
    for secret in ("db-secret-1", "redis-secret-2", "bouncer-secret-3", "key-secret-4"):
        assert secret not in result.output
    assert "postgresql://shop:***@db.internal/pgreserve" in result.output
    assert "ssl_keyfile_password" in result.output and "***" in result.output


@pytest.mark.parametrize(("text", "message"), [
    ("prot = 80\n", "prot: unknown setting (did you mean 'port'?)"),
    ('port = "80"\n', "port: '80' is not an integer"),
    ("port = 70000\n", "port: 70000 is not in the range 0<=x<=65535"),
    ("proxy_headers = 1\n", "proxy_headers: 1 is not true or false"),
    ('log_format = "yaml"\n', "log_format: 'yaml' is not one of 'text', 'json'"),
    ('forwarded_allow_ips = "10.0.0.0/8,proxy"\n',
     "forwarded_allow_ips: 'proxy' is not an IP address or network"),
    ('root_path = "api/"\n', "root_path: 'api/' must start with /"),
    ('ssl_certfile = "/no/such/cert.pem"\n', "ssl_certfile: File '/no/such/cert.pem' does not exist"),
    ('prepare_threshold = "sometimes"\n', "prepare_threshold: 'sometimes' is neither"),
    ("[api]\nport = 1\n", "api: unknown setting"),
    ("port = \n", "not a valid TOML file"),
    ("request_deadline_seconds = nan\n", "request_deadline_seconds: nan is not a finite number"),
    ("key_retention_hours = inf\n", "key_retention_hours: inf is not in the range"),
])
def test_a_bad_file_is_one_line_naming_file_and_key_with_exit_2(
        folder: Path, text: str, message: str) -> None:
    """A settings file with an unknown key, a wrong type, a bad value or bad TOML is refused
    with one line naming the file and the key, exit code 2."""
    conf = folder / "pgreserve.toml"
    conf.write_text(text)
    result = CliRunner().invoke(main, ["config", "show", "--config", str(conf)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {conf}: "), result.output
    assert message in lines[0], lines[0]


@pytest.mark.parametrize("args", [
    ["config", "show", "--request-deadline-seconds", "nan"],
    ["config", "show", "--request-deadline-seconds", "-inf"],
    ["config", "show", "--key-retention-hours", "nan"],
    ["config", "show", "--key-retention-hours", "1e300"],
    ["worker", "--key-retention-hours", "inf"],
    ["up", "--request-deadline-seconds", "NaN"],
    ["serve", "--request-deadline-seconds", "nan"],
    ["reconcile", "--grace-seconds", "nan"],
    ["reconcile", "--grace-seconds", "inf"],
    ["reconcile", "--grace-seconds", "1e300"],
    ["ops", "holdtime", "--seconds", "nan"],
])
def test_a_number_that_is_not_finite_or_too_large_is_refused_with_exit_2(
        folder: Path, args: list[str]) -> None:
    """nan passes every bound of click's FloatRange (each comparison with it is false), and
    inf or 1e300 overflowed the dates made from them: such a value is a usage error, exit
    2, naming the option, before anything starts (no data directory is made)."""
    data = folder / "data"
    result = CliRunner().invoke(main, [*args, "--data-dir", str(data)]
                                if args[0] not in ("config",) else args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{args[-2]}'" in result.output, result.output
    assert ("is not a finite number" in result.output
            or "is not in the range" in result.output), result.output
    assert not data.exists()


def test_an_unreadable_file_is_a_message_with_exit_2(folder: Path) -> None:
    """A settings file that cannot be read is one line naming it, exit code 2."""
    result = CliRunner().invoke(main, ["config", "show", "--config", str(folder / "none.toml")])
    assert result.exit_code == 2
    assert result.output.strip() == (f"Error: {folder / 'none.toml'}: cannot read the "
                                     "settings file: No such file or directory")


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_bad_file_starts_nothing(folder: Path, command: str) -> None:
    """`up` / `serve` with a bad settings file exit 2 before creating a database or
    listening (the data directory stays uncreated)."""
    conf = folder / "pgreserve.toml"
    conf.write_text(f'data_dir = "{folder / "data"}"\nport = {free_port()}\ntls = true\n')
    result = pgr(command, "--config", str(conf), cwd=folder)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"Error: {conf}: tls: unknown setting"
    assert sorted(p.name for p in folder.iterdir()) == ["pgreserve.toml"]


def test_combinations_are_checked_naming_the_source(folder: Path) -> None:
    """A TLS key without its certificate is refused naming where the key came from."""
    key = folder / "k.pem"
    key.write_text("x")
    conf = folder / "p.toml"
    conf.write_text(f'ssl_keyfile = "{key}"\n')
    result = CliRunner().invoke(main, ["config", "show", "--config", str(conf)])
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: {conf}: ssl_keyfile: needs ssl_certfile too " \
                                    "(--ssl-certfile)"
    result = CliRunner().invoke(main, ["config", "show", "--uds", str(folder / "no" / "s")])
    assert result.exit_code == 2 and "--uds: cannot create" in result.output


def test_every_setting_is_an_option_of_up_or_serve_and_a_model_field() -> None:
    """Each setting of the model has its flag and environment variable on `up` or `serve`,
    named in --help, and a field of the same name in Settings."""
    runner = CliRunner()
    help_text = " ".join((runner.invoke(main, ["up", "--help"]).output
                          + runner.invoke(main, ["serve", "--help"]).output).split())
    names = set(Settings.__dataclass_fields__)
    for spec in SPECS:
        assert spec.key in names, spec.key
        assert spec.decls[0].split("/")[0] in help_text, spec.key
        assert f"env var: {spec.envvar}" in help_text, spec.key


def test_other_commands_find_the_database_in_the_file(folder: Path, dsn: str) -> None:
    """`tenant create --config FILE` uses the file's database_url (the same file `up`
    reads), and a flag still wins over it."""
    conf = folder / "p.toml"
    conf.write_text(f"database_url = {json.dumps(dsn)}\n")
    created = CliRunner().invoke(main, ["tenant", "create", "shop", "--json", "--config",
                                        str(conf)], env={"PGRESERVE_DATABASE_URL": None})
    assert created.exit_code == 0, created.output
    assert json.loads(created.output)["tenant"] == "shop"
    listed = CliRunner().invoke(main, ["tenant", "list", "--json", "--config", str(conf)],
                                env={"PGRESERVE_DATABASE_URL": None})
    assert [t["name"] for t in json.loads(listed.output)] == ["shop"]
    other = CliRunner().invoke(main, ["tenant", "list", "--config", str(conf), "--data-dir",
                                      str(folder / "empty"), "--database-url", ""],
                               env={"PGRESERVE_DATABASE_URL": None})
    assert other.exit_code == 1 and "no embedded pgreserve database" in other.output


def test_the_schema_comes_from_the_file_and_a_bad_one_is_one_line(folder: Path) -> None:
    """`schema = "shop_inventory"` in the file is the command's schema (shown with its
    source); a name that is not a plain identifier is one line naming file and key, exit 2."""
    before = os.environ.get("PGRESERVE_SCHEMA")
    conf = folder / "pgreserve.toml"
    conf.write_text('schema = "shop_inventory"\n')
    got = show("--config", str(conf), env={"PGRESERVE_SCHEMA": None})  # type: ignore[dict-item]  # None unsets
    assert got["schema"] == ("shop_inventory", f"file {conf}")
    assert os.environ.get("PGRESERVE_SCHEMA") == before
    conf.write_text('schema = "drop table"\n')
    result = CliRunner().invoke(main, ["config", "show", "--config", str(conf)],
                                env={"PGRESERVE_SCHEMA": None})
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {conf}: schema: "), result.output


def test_a_bad_value_in_the_settings_file_is_refused_by_every_command(
        tmp_path: Path) -> None:
    """A value the file's key cannot take is refused (exit 2, one line naming the file and
    the key) by every command that reads the file, also one that does not take that
    option: a file shared by `serve` and `reconcile` with `workers = 0` made `reconcile`
    run and `serve` fail later. Good values of keys a command does not take are still
    accepted, and checking a schema name does not make it the process's."""
    for line in ("workers = 0", "request_deadline_seconds = -5", 'port = "x"',
                 'schema = "Bad-Name"', 'proxy_headers = "yes"'):
        bad = tmp_path / "bad.toml"
        bad.write_text(line + "\n")
        result = CliRunner().invoke(main, ["tenant", "list", "--config", str(bad),
                                           "--database-url", "postgresql:///nowhere"])
        key = line.split(" ")[0]
        assert result.exit_code == 2, (line, result.output)
        assert str(bad) in result.output and key in result.output, (line, result.output)
    good = tmp_path / "good.toml"
    good.write_text('workers = 4\nschema = "elsewhere"\n')
    before = os.environ.get("PGRESERVE_SCHEMA")
    assert ConfigFile.read(good).values["workers"] == 4  # (read checks every value)
    assert os.environ.get("PGRESERVE_SCHEMA") == before


def test_the_files_values_keep_their_precedence_when_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking every value of the file keeps "flags and PGRESERVE_* variables win over
    it": a stale TLS path in the file is no error when flags give the paths, nor for a
    command that does not use them (a path is checked where it is used: another
    command's certificates need not exist here); a bad value an environment variable
    overrides is no error either."""
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    conf = tmp_path / "shared.toml"
    conf.write_text(f'ssl_certfile = "{tmp_path}/old.pem"\nssl_keyfile = "{tmp_path}/old.key"\n'
                    "workers = 0\n")
    monkeypatch.setenv("PGRESERVE_WORKERS", "2")
    shown = CliRunner().invoke(main, ["config", "show", "--config", str(conf),
                                      "--ssl-certfile", str(cert), "--ssl-keyfile", str(cert)])
    assert shown.exit_code == 0, shown.output
    elsewhere = CliRunner().invoke(main, ["tenant", "list", "--config", str(conf),
                                          "--database-url", "postgresql:///nowhere"])
    assert "ssl_" not in elsewhere.output and "workers" not in elsewhere.output, \
        elsewhere.output
    monkeypatch.delenv("PGRESERVE_WORKERS")
    refused = CliRunner().invoke(main, ["tenant", "list", "--config", str(conf),
                                        "--database-url", "postgresql:///nowhere"])
    assert refused.exit_code == 2 and "workers" in refused.output, refused.output
