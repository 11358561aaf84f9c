"""The serving settings of `up`, `serve` and `config show`: one frozen model.

Each setting has one key, used three ways: the TOML file's key (`port = 8000`), the
environment variable (`PGRESERVE_PORT`) and the flag (`--port`). A value is taken from
the first of: the flag, the environment, the file (`--config FILE` /
`PGRESERVE_CONFIG`), the default. Every source goes through the same click type, so a
file value is checked exactly as a flag would be; an error in the file names the file
and the key and exits 2 before anything starts.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import tomllib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import click
from click.core import ParameterSource

from .config import mask_password
from .db.schema import DEFAULT_SCHEMA
from .schema_cli import check_option, use_option
from .validation import MAX_KEY_RETENTION_HOURS

CONFIG_ENVVAR = "PGRESERVE_CONFIG"
# ctx.meta keys: the parsed file, and where each setting came from
_FILE_META = "pgreserve.settings.file"
_SOURCES_META = "pgreserve.settings.sources"
_HIDDEN_META = "pgreserve.settings.hidden"


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan, inf and -inf: a comparison with NaN is
    always false, so FloatRange lets it through every bound."""

    name = "float range"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class SettingsError(click.ClickException):
    """A setting that cannot be used: printed as one line, exit code 2, nothing started."""

    exit_code = 2


Callback = Callable[[click.Context, click.Parameter, Any], Any]


@dataclass(frozen=True)
class Spec:
    """One setting: its key, its click option, and whether it is a secret."""

    key: str
    decls: tuple[str, ...]
    type: Any
    default: Any
    help: str
    dest: str | None = None  # the command's parameter name, when not the key
    secret: bool = False
    callback: Callback | None = None
    numbers_too: bool = False  # a string setting whose file value may be an integer
    # False: the command does not receive it (it acts on the process, e.g. --schema);
    # Settings still has it
    exposed: bool = True

    @property
    def envvar(self) -> str:
        return "PGRESERVE_" + self.key.upper()

    @property
    def param(self) -> str:
        return self.dest or self.key

    @property
    def is_flag(self) -> bool:
        return any("/" in d for d in self.decls)

    @property
    def names(self) -> tuple[str, ...]:
        """The click option's declarations (and its parameter name, when not the key)."""
        return (*self.decls, self.param) if self.dest else self.decls

    def option(self) -> Callable[[Any], Any]:
        extra: dict[str, Any] = {} if self.is_flag else {"type": self.type}
        return click.option(*self.names, envvar=self.envvar, default=self.default,
                            show_default=self.default is not None, show_envvar=True,
                            help=self.help, callback=_resolver(self),
                            expose_value=self.exposed, **extra)


def _redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A URL redis-py can use (its schemes), checked before anything starts."""
    if value is None:
        return None
    from urllib.parse import urlsplit

    if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise click.BadParameter(
            f"{mask_password(value)!r} is not a Redis URL (redis://, rediss:// or unix://)")
    return value


def _ips(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A comma-separated list of addresses or networks (or `*`, every address)."""
    if value is None:
        return None
    for item in (v.strip() for v in value.split(",")):
        if item == "*":
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise click.BadParameter(
                f"{item!r} is not an IP address or network (a list like "
                f"'127.0.0.1,10.0.0.0/8', or '*')") from None
    return value


def _root_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value and (not value.startswith("/") or value.endswith("/")):
        raise click.BadParameter(f"{value!r} must start with / and not end with / "
                                 "(e.g. /reservations)")
    return value


def _schema(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--schema: checked, then this process's (and its children's) schema (db/schema.py);
    kept for the Settings the command does not receive it in."""
    ctx.meta.setdefault(_HIDDEN_META, {})["schema"] = use_option(ctx, param, value)
    return value


def _threshold(ctx: click.Context, param: click.Parameter, value: Any) -> str:
    text = str(value).strip().lower()
    if text != "none" and not (text.isdigit() and int(text) >= 0):
        raise click.BadParameter(f"{value!r} is neither a number of executions (0 or more) "
                                 "nor none")
    return text


_FILE = click.Path(exists=True, dir_okay=False, readable=True)
_FORMAT = click.Choice(["text", "json"])

SPECS: tuple[Spec, ...] = (
    Spec("database_url", ("--database-url",), str, None,
         "PostgreSQL >= 15 URL; default: the embedded server.", secret=True),
    Spec("schema", ("--schema",), str, None,
         f"PostgreSQL schema of pgreserve's tables and functions (default {DEFAULT_SCHEMA}).",
         callback=_schema, exposed=False),
    Spec("data_dir", ("--data-dir",), str, None,
         "Data directory of the embedded server (default ./.pgreserve/data, relative to the "
         "current directory; only `up` and `migrate` create it)."),
    Spec("host", ("--host",), str, "127.0.0.1", "Address the HTTP API listens on."),
    Spec("port", ("--port",), click.IntRange(0, 65535), 8000, "Port of the HTTP API."),
    Spec("uds", ("--uds",), click.Path(dir_okay=False), None,
         "Listen on this Unix socket instead of --host/--port."),
    Spec("request_deadline_seconds", ("--request-deadline-seconds",),
         FiniteFloatRange(0.1, 600), 5.0,
         "Every request's deadline: the wait for a connection, the transaction's "
         "statement_timeout and every retry fit inside it (past it: 503 busy, not run)."),
    Spec("tenant_max_in_flight", ("--tenant-max-in-flight",), click.IntRange(0, 1_000_000), 0,
         "At most this many requests of one tenant at once per API process (429 beyond); "
         "0: no limit."),
    Spec("pgbouncer_admin_url", ("--pgbouncer-admin-url",), str, None,
         "PgBouncer's admin console (postgresql://USER@HOST:PORT/pgbouncer); its pool "
         "figures are then checked (doctor) or exported (/metrics).", secret=True),
    Spec("prepare_threshold", ("--prepare-threshold",), str, "5",
         "Executions after which psycopg prepares a statement; none behind PgBouncer "
         "older than 1.21 (transaction pooling).", callback=_threshold, numbers_too=True),
    Spec("proxy_headers", ("--proxy-headers/--no-proxy-headers",), bool, False,
         "Take the client address and scheme from X-Forwarded-For / X-Forwarded-Proto, "
         "from the addresses of --forwarded-allow-ips only."),
    Spec("forwarded_allow_ips", ("--forwarded-allow-ips",), str, "127.0.0.1,::1",
         "Proxies whose X-Forwarded-* headers are believed (addresses or networks, "
         "comma-separated; '*' for all).", callback=_ips),
    Spec("root_path", ("--root-path",), str, "",
         "The path prefix a reverse proxy serves the API under (e.g. /reservations); "
         "shown in the OpenAPI servers and the docs' URLs.", callback=_root_path),
    Spec("ssl_certfile", ("--ssl-certfile",), _FILE, None,
         "Serve HTTPS with this PEM certificate (chain) file."),
    Spec("ssl_keyfile", ("--ssl-keyfile",), _FILE, None,
         "The PEM private key of --ssl-certfile."),
    Spec("ssl_keyfile_password", ("--ssl-keyfile-password",), str, None,
         "The password of an encrypted --ssl-keyfile.", secret=True),
    Spec("timeout_graceful_shutdown", ("--timeout-graceful-shutdown",), click.IntRange(0),
         None, "On SIGTERM, wait at most this many seconds for in-flight requests "
         "(default: until every one has answered)."),
    Spec("timeout_keep_alive", ("--timeout-keep-alive",), click.IntRange(1), 5,
         "Close an idle keep-alive connection after this many seconds (behind a proxy: "
         "longer than the proxy keeps an idle upstream connection)."),
    Spec("backlog", ("--backlog",), click.IntRange(1), 2048,
         "Connections the kernel queues before the API accepts them."),
    Spec("limit_concurrency", ("--limit-concurrency",), click.IntRange(1), None,
         "Answer 503 at once beyond this many open connections and tasks per process "
         "(default: no limit)."),
    Spec("ops_host", ("--ops-host",), str, "127.0.0.1",
         "Address of the ops listener (/metrics, /ops, operator routes)."),
    Spec("ops_port", ("--ops-port",), click.IntRange(1, 65535), 9187,
         "Port of the ops listener."),
    Spec("ops", ("--ops/--no-ops",), bool, True, "Serve the ops listener.",
         dest="ops_enabled"),
    Spec("log_format", ("--log-format",), _FORMAT, "text",
         "Format of the request log and the other log lines."),
    Spec("request_log", ("--request-log/--no-request-log",), bool, True,
         "One line per request (uvicorn's access log stays off)."),
    Spec("request_log_file", ("--request-log-file",), click.Path(dir_okay=False), None,
         "Append the request log to this file instead of stderr."),
    Spec("request_log_format", ("--request-log-format",), _FORMAT, None,
         "Format of the request log alone (default: --log-format)."),
    Spec("key_retention_hours", ("--key-retention-hours",),
         FiniteFloatRange(1.0, MAX_KEY_RETENTION_HOURS), 24.0,
         "Keep Idempotency-Keys at least this long before the janitor forgets them."),
    Spec("legacy_redis_url", ("--legacy-redis-url",), str, None,
         "redis:// URL of the legacy hold store to roll out beside (see `pgreserve "
         "rollout`).", secret=True, callback=_redis_url),
    Spec("workers", ("--workers",), click.IntRange(1, 64), 1, "HTTP server processes.",
         dest="processes"),
)
BY_KEY: Mapping[str, Spec] = {s.key: s for s in SPECS}
BY_PARAM: Mapping[str, Spec] = {s.param: s for s in SPECS}

DB_KEYS = ("database_url", "schema", "data_dir")
API_KEYS = ("host", "port", "uds", "request_deadline_seconds", "tenant_max_in_flight",
            "pgbouncer_admin_url", "prepare_threshold", "proxy_headers", "forwarded_allow_ips",
            "root_path", "ssl_certfile", "ssl_keyfile", "ssl_keyfile_password",
            "timeout_graceful_shutdown", "timeout_keep_alive", "backlog", "limit_concurrency",
            "ops_host", "ops_port", "ops", "log_format", "request_log", "request_log_file",
            "request_log_format")


def options(*keys: str) -> Callable[[Any], Any]:
    """A decorator adding the click options of `keys` (in that order in --help)."""
    def decorate(f: Any) -> Any:
        for key in reversed(keys):
            f = BY_KEY[key].option()(f)
        return f

    return decorate


# -- the file ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigFile:
    """A parsed settings file: every key known, every value not yet converted."""

    path: Path
    values: Mapping[str, Any]

    @classmethod
    def read(cls, path: Path, taken: Collection[str] = ()) -> ConfigFile:
        try:
            with path.open("rb") as f:
                doc = tomllib.load(f)
        except OSError as exc:
            raise SettingsError(f"{path}: cannot read the settings file: "
                                f"{exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: not a valid TOML file: {exc}") from None
        for key in doc:
            if key not in BY_KEY:
                close = difflib.get_close_matches(key, list(BY_KEY), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise SettingsError(f"{path}: {key}: unknown setting{hint}")
        found = cls(path, doc)
        found.check_values(skip=taken)
        return found

    def check_values(self, skip: Collection[str] = ()) -> None:
        """The values of the keys a command does not take (`skip`: those it takes, which
        its own options check where flags and PGRESERVE_* variables win over the file)
        checked as their options would check them, so that a file shared by several
        commands is refused by the first that reads a bad value. A key its
        environment variable sets is left to it; a file path's type is checked, not
        whether this user can read that file now (another command will use it)."""
        ctx = click.Context(click.Command("settings"))
        for key in self.values:
            spec = BY_KEY[key]
            if key in skip or spec.envvar in os.environ:
                continue
            kind = click.STRING if isinstance(spec.type, click.Path) else spec.type
            param = (click.Option(list(spec.names), is_flag=True) if spec.is_flag
                     else click.Option(list(spec.names), type=kind))
            value = self.convert(spec, param, ctx)
            # (the checks only: --schema's own callback also makes it the process's)
            check = check_option if spec.callback is _schema else spec.callback
            if check is not None:
                try:
                    check(ctx, param, value)
                except click.BadParameter as exc:
                    raise SettingsError(f"{self.path}: {spec.key}: {exc.message}") from None

    def convert(self, spec: Spec, param: click.Parameter, ctx: click.Context) -> Any:
        """The file's value of `spec`, checked by type, then by the option's own type."""
        value = self.values[spec.key]
        if spec.numbers_too and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        want = _python_type(param.type)
        ok = (isinstance(value, want) and not (want is not bool and isinstance(value, bool)))
        if not ok:
            name = ("true or false" if want is bool else "an integer" if want is int
                    else "a string" if want is str else "a number")
            raise SettingsError(f"{self.path}: {spec.key}: {value!r} is not {name}")
        try:
            return param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise SettingsError(f"{self.path}: {spec.key}: {exc.message}") from None


def _python_type(kind: click.ParamType[Any]) -> type | tuple[type, ...]:
    if isinstance(kind, click.types.BoolParamType):
        return bool
    if isinstance(kind, click.types.IntParamType):
        return int
    if isinstance(kind, click.types.FloatParamType):
        return (int, float)
    return str


def _load_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        options = {p.name for p in ctx.command.params}
        ctx.meta[_FILE_META] = ConfigFile.read(
            Path(value), taken=[s.key for s in SPECS if s.param in options])
    return value


config_option = click.option(
    "--config", "config_file", envvar=CONFIG_ENVVAR, default=None, show_envvar=True,
    is_eager=True, expose_value=False, callback=_load_file, type=click.Path(dir_okay=False),
    help="A TOML file of settings (keys as the options' names with _: port = 8000); "
         "flags and PGRESERVE_* variables win over it.")


def _resolver(spec: Spec) -> Callback:
    """The option's callback: the file's value when neither flag nor environment gave one;
    records where the value came from."""

    def resolve(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        sources: dict[str, str] = ctx.meta.setdefault(_SOURCES_META, {})
        given = ctx.get_parameter_source(param.name or spec.param)
        file: ConfigFile | None = ctx.meta.get(_FILE_META)
        from_file = False
        if given is ParameterSource.ENVIRONMENT:
            sources[spec.key] = f"env {spec.envvar}"
        elif given is ParameterSource.COMMANDLINE:
            sources[spec.key] = "flag " + spec.decls[0].split("/")[0]
        elif file is not None and spec.key in file.values:
            value = file.convert(spec, param, ctx)
            sources[spec.key] = f"file {file.path}"
            from_file = True
        else:
            sources[spec.key] = "default"
        if spec.callback is not None:
            try:
                value = spec.callback(ctx, param, value)
            except click.BadParameter as exc:
                if not from_file or file is None:
                    raise
                raise SettingsError(f"{file.path}: {spec.key}: {exc.message}") from None
        return value

    return resolve


# -- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Every serving option, resolved. `sources`: where each came from."""

    database_url: str | None = None
    schema: str | None = None  # None: PGRESERVE_SCHEMA or the default (db/schema.py)
    data_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    request_deadline_seconds: float = 5.0
    tenant_max_in_flight: int = 0
    pgbouncer_admin_url: str | None = None
    prepare_threshold: str = "5"
    proxy_headers: bool = False
    forwarded_allow_ips: str = "127.0.0.1,::1"
    root_path: str = ""
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = None
    timeout_graceful_shutdown: int | None = None
    timeout_keep_alive: int = 5
    backlog: int = 2048
    limit_concurrency: int | None = None
    ops_host: str = "127.0.0.1"
    ops_port: int = 9187
    ops: bool = True
    log_format: str = "text"
    request_log: bool = True
    request_log_file: str | None = None
    request_log_format: str | None = None
    key_retention_hours: float = 24.0
    legacy_redis_url: str | None = None
    workers: int = 1
    config_file: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def from_params(cls, params: Mapping[str, Any],
                    ctx: click.Context | None = None) -> Settings:
        """The settings of a command's parameters (as click passed them), checked."""
        values = {BY_PARAM[name].key: value for name, value in params.items()
                  if name in BY_PARAM}
        if ctx is not None:  # settings the command does not receive (Spec.exposed)
            values.update(ctx.meta.get(_HIDDEN_META, {}))
        sources = dict(ctx.meta.get(_SOURCES_META, {})) if ctx is not None else {}
        file: ConfigFile | None = None if ctx is None else ctx.meta.get(_FILE_META)
        made = cls(**values, config_file=None if file is None else str(file.path),
                   sources=sources)
        made.check()
        return made

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")

    def _where(self, key: str) -> str:
        src = self.source(key)
        if src.startswith("file "):
            return f"{src[5:]}: {key}"
        if src.startswith("env "):
            return src[4:]
        return "--" + key.replace("_", "-")

    def check(self) -> None:
        """Refuse combinations no single option can see (SettingsError)."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            missing = "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile"
            given = "ssl_certfile" if missing == "ssl_keyfile" else "ssl_keyfile"
            raise SettingsError(f"{self._where(given)}: needs {missing} too "
                                f"(--{missing.replace('_', '-')})")
        for key in ("uds", "request_log_file"):
            path = getattr(self, key)
            if path is None:
                continue
            parent = Path(path).resolve().parent
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise SettingsError(f"{self._where(key)}: cannot create {path}: "
                                    f"{parent} is not a writable directory")
        if self.request_log_file is not None:
            target = Path(self.request_log_file)
            if target.exists() and not os.access(target, os.W_OK):
                raise SettingsError(f"{self._where('request_log_file')}: "
                                    f"{target} is not writable")

    # -- what the listeners are given ---------------------------------------------------

    def server_options(self) -> dict[str, Any]:
        """uvicorn.Config's arguments for the API listener (besides host and port)."""
        out: dict[str, Any] = {
            "proxy_headers": self.proxy_headers,
            "forwarded_allow_ips": self.forwarded_allow_ips,
            "root_path": self.root_path,
            "timeout_keep_alive": self.timeout_keep_alive,
            "backlog": self.backlog,
        }
        optional = {"uds": self.uds, "ssl_certfile": self.ssl_certfile,
                    "ssl_keyfile": self.ssl_keyfile,
                    "ssl_keyfile_password": self.ssl_keyfile_password,
                    "timeout_graceful_shutdown": self.timeout_graceful_shutdown,
                    "limit_concurrency": self.limit_concurrency}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    @property
    def api_url(self) -> str:
        """Where the API answers, as a client would write it."""
        scheme = "https" if self.ssl_certfile else "http"
        if self.uds:
            return f"{scheme}+unix://{self.uds}{self.root_path}"
        return f"{scheme}://{self.host}:{self.port}{self.root_path}"

    @property
    def prepare_after(self) -> int | None:
        """psycopg's prepare_threshold (None: never prepare)."""
        return None if self.prepare_threshold == "none" else int(self.prepare_threshold)

    @property
    def ops_address(self) -> tuple[str, int] | None:
        return (self.ops_host, self.ops_port) if self.ops else None

    @property
    def request_log_fmt(self) -> str:
        return self.request_log_format or self.log_format

    def open_request_log(self) -> IO[str] | None:
        """The request log's stream: the file (opened for appending), or None for stderr."""
        if self.request_log_file is None:
            return None
        try:
            return open(self.request_log_file, "a", encoding="utf-8")
        except OSError as exc:
            raise SettingsError(f"{self._where('request_log_file')}: cannot open "
                                f"{self.request_log_file}: {exc.strerror or exc}") from None

    # -- `pgreserve config show` --------------------------------------------------------

    def shown(self) -> list[tuple[str, str, str]]:
        """(key, value, source) of every setting, secrets masked."""
        rows = []
        for f in fields(self):
            if f.name in ("sources", "config_file"):
                continue
            value = getattr(self, f.name)
            rows.append((f.name, display(f.name, value), self.source(f.name)))
        return rows


def display(key: str, value: Any) -> str:
    """A setting's value as printed: TOML-like, a secret masked."""
    if value is None:
        return "-"
    if BY_KEY[key].secret:
        return mask_password(value) if "://" in str(value) or "=" in str(value) else "***"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
