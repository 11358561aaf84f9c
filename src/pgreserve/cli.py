"""The pgreserve command line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psycopg
import psycopg.conninfo
from rich.console import Console

from . import errors
from .config import database_url, mask_password
from .core.service import ReservationService
from .db import migrate as migrations
from .db.database import Database
from .db.embedded import data_dir_from_env
from .db.migration_check import check_database
from .workers.base import run_forever
from .workers.janitor import Janitor, JanitorConfig
from .workers.replenisher import Replenisher
from .workers.sweeper import Sweeper
from .workers.webhooks import WebhookDeliverer

if TYPE_CHECKING:
    from .http.requestlog import RequestLog

console = Console(stderr=True, soft_wrap=True)

db_options = [
    click.option("--database-url", envvar="PGRESERVE_DATABASE_URL", default=None,
                 show_envvar=True, help="PostgreSQL >= 15 URL; default: the embedded server."),
    click.option("--data-dir", envvar="PGRESERVE_DATA_DIR", default=None, show_envvar=True,
                 help="Data directory of the embedded server (default ./.pgreserve/data, "
                      "relative to the current directory; only `up` and `migrate` create it)."),
]


def with_db(f: Any) -> Any:
    for option in reversed(db_options):
        f = option(f)
    return f


http_options = [
    click.option("--host", envvar="PGRESERVE_HOST", default="127.0.0.1", show_default=True,
                 show_envvar=True, help="Address the HTTP API listens on."),
    click.option("--port", envvar="PGRESERVE_PORT", default=8000, show_default=True,
                 show_envvar=True, type=click.IntRange(0, 65535), help="Port of the HTTP API."),
]

ops_options = [
    click.option("--ops-host", envvar="PGRESERVE_OPS_HOST", default="127.0.0.1",
                 show_default=True,
                 help="Address of the ops listener (/metrics, /ops, operator routes)."),
    click.option("--ops-port", envvar="PGRESERVE_OPS_PORT", default=9187, show_default=True,
                 type=click.IntRange(1, 65535), help="Port of the ops listener."),
    click.option("--ops/--no-ops", "ops_enabled", envvar="PGRESERVE_OPS", default=True,
                 show_default=True, help="Serve the ops listener."),
    click.option("--log-format", envvar="PGRESERVE_LOG_FORMAT", default="text",
                 show_default=True, type=click.Choice(["text", "json"]),
                 help="Format of the request log and the other log lines."),
    click.option("--request-log/--no-request-log", envvar="PGRESERVE_REQUEST_LOG",
                 default=True, show_default=True,
                 help="One line per request on stderr (uvicorn's access log stays off)."),
]

retention_option = click.option(
    "--key-retention-hours", envvar="PGRESERVE_KEY_RETENTION_HOURS", default=24.0,
    show_default=True, show_envvar=True, type=click.FloatRange(min=1.0),
    help="Keep Idempotency-Keys at least this long before the janitor forgets them.")


pgbouncer_option = click.option(
    "--pgbouncer-admin-url", envvar="PGRESERVE_PGBOUNCER_ADMIN_URL", default=None,
    show_envvar=True,
    help="PgBouncer's admin console (postgresql://USER@HOST:PORT/pgbouncer); its pool "
         "figures are then checked (doctor) or exported (/metrics).")

http_options += [
    click.option("--request-deadline-seconds", envvar="PGRESERVE_REQUEST_DEADLINE_SECONDS",
                 default=5.0, show_default=True, show_envvar=True,
                 type=click.FloatRange(0.1, 600),
                 help="Every request's deadline: the wait for a connection, the transaction's "
                      "statement_timeout and every retry fit inside it (past it: 503 busy, "
                      "not run)."),
    click.option("--tenant-max-in-flight", envvar="PGRESERVE_TENANT_MAX_IN_FLIGHT", default=0,
                 show_default=True, show_envvar=True, type=click.IntRange(0, 1_000_000),
                 help="At most this many requests of one tenant at once per API process "
                      "(429 beyond); 0: no limit."),
    pgbouncer_option,
]


def with_http(f: Any) -> Any:
    for option in reversed(http_options + ops_options):
        f = option(f)
    return f


def _redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A URL redis-py can use (its schemes), checked before anything starts."""
    if value is None:
        return None
    from urllib.parse import urlsplit

    if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise click.BadParameter(
            f"{value!r} is not a Redis URL (redis://, rediss:// or unix://)")
    return value


legacy_option = click.option(
    "--legacy-redis-url", envvar="PGRESERVE_LEGACY_REDIS_URL", default=None,
    callback=_redis_url,
    help="redis:// URL of the legacy hold store to roll out beside (see `pgreserve rollout`).")


def _api_options(request_deadline_seconds: float, tenant_max_in_flight: int,
                 pgbouncer_admin_url: str | None,
                 legacy_redis_url: str | None = None) -> dict[str, Any]:
    return {"request_deadline_s": request_deadline_seconds,
            "tenant_max_in_flight": tenant_max_in_flight,
            "pgbouncer_admin_url": pgbouncer_admin_url,
            "legacy_redis_url": legacy_redis_url}


@dataclass(frozen=True)
class Serving:
    """What `up` and `serve` were asked to serve besides the API itself."""

    ops: tuple[str, int] | None
    log_format: str
    request_log: bool

    def log(self) -> RequestLog | None:
        from .http.requestlog import RequestLog, configure_logging

        configure_logging(self.log_format)
        return RequestLog(self.log_format) if self.request_log else None


def _serving(ops_host: str, ops_port: int, ops_enabled: bool, log_format: str,
             request_log: bool) -> Serving:
    return Serving((ops_host, ops_port) if ops_enabled else None, log_format, request_log)


class _Group(click.Group):
    """The top-level group: a user's error (a database that is not there or does not
    answer, a schema the runner refuses, a data directory that cannot be made) is a
    message and exit code 1, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.PgReserveError as exc:
            raise click.ClickException(exc.message) from None
        except psycopg.OperationalError as exc:
            raise click.ClickException(f"database error: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@click.group(cls=_Group)
@click.version_option(package_name="pgreserve", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def main(verbose: bool) -> None:
    """pgreserve: inventory reservations inside PostgreSQL."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@with_db
def migrate(database_url: str | None, data_dir: str | None) -> None:
    """Apply pending schema migrations (safe to run concurrently and repeatedly); creates
    the embedded database when the data directory has none."""
    with _dsn(database_url, data_dir, create=True) as dsn:
        applied = migrations.migrate_all(dsn)
    for m in applied.migrations:
        click.echo(f"applied {m.version:04d}_{m.name}")
    for f in applied.functions:
        click.echo(f"applied functions/{f.name}.sql")
    if not applied.migrations and not applied.functions:
        click.echo("schema is up to date")


@main.group()
def db() -> None:
    """The database."""


@db.command("url")
@with_db
def db_url(database_url: str | None, data_dir: str | None) -> None:
    """Print the DSN of the running embedded server (or the given URL, checked).

    The embedded server's DSN works only while it runs (`pgreserve up`): when no server
    runs on the data directory this exits 1 and starts nothing."""
    from .config import embedded_running_dsn

    if database_url or os.environ.get("PGRESERVE_DATABASE_URL"):
        with _dsn(database_url, data_dir) as dsn:
            click.echo(dsn)
        return
    dsn = embedded_running_dsn(data_dir)
    if dsn is None:
        where = data_dir_from_env(data_dir)
        state = ("no database" if not (where / "PG_VERSION").exists()
                 else "a database, but no server runs on it")
        raise click.ClickException(
            f"{where} holds {state}; its address is valid only while `pgreserve up` "
            f"(or another pgreserve command) runs on it. Start `pgreserve up --data-dir "
            f"{where}` and ask again, or pass --data-dir / --database-url.")
    click.echo(dsn)


@main.group()
def tenant() -> None:
    """Tenants."""


@tenant.command("create")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def tenant_create(name: str, as_json: bool, database_url: str | None,
                  data_dir: str | None) -> None:
    """Create a tenant and print its API key (shown once; only its hash is stored)."""

    async def go(dsn: str) -> Any:
        async with Database(dsn, min_size=1, max_size=1) as database:
            return await ReservationService(database).create_tenant_with_key(name)

    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        try:
            created, key = asyncio.run(go(dsn))
        except errors.PgReserveError as exc:
            raise click.ClickException(exc.message) from None
        except Exception as exc:
            if "unique" in str(exc).lower():
                raise click.ClickException(f"tenant {name!r} already exists") from None
            raise
    if as_json:
        click.echo(json.dumps({"tenant": created.name, "api_key": key}))
    else:
        click.echo(f"tenant {created.name!r} created (id {created.id})")
        click.echo(f"API key (shown only now): {key}")


@tenant.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def tenant_list(as_json: bool, database_url: str | None, data_dir: str | None) -> None:
    """Every tenant: id, name and when it was created (never a key)."""

    async def go(dsn: str) -> Any:
        async with Database(dsn, min_size=1, max_size=1) as database:
            return await ReservationService(database).tenants()

    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        rows = asyncio.run(go(dsn))
    if as_json:
        click.echo(json.dumps([{"id": t.id, "name": t.name, "created_at": at.isoformat()}
                               for t, at in rows]))
        return
    if not rows:
        click.echo("no tenants")
    for t, at in rows:
        click.echo(f"{t.id:>6}  {t.name}  created {at.isoformat()}")


class _KeyGroup(click.Group):
    """`tenant key NAME` (no subcommand), as before: `tenant key create NAME`."""

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            return "create", self.commands["create"], args
        return super().resolve_command(ctx, args)


@tenant.group("key", cls=_KeyGroup)
def tenant_key() -> None:
    """A tenant's API keys: create, list (prefix only), revoke."""


def _tenant_call(dsn: str, name: str, op: Any) -> Any:
    """Run `op(service, tenant_id)` for the tenant called `name`; typed errors as messages."""
    async def go() -> Any:
        async with Database(dsn, min_size=1, max_size=1) as database:
            svc = ReservationService(database)
            found = await svc.tenant_by_name(name)
            if found is None:
                raise click.ClickException(f"no tenant named {name!r}")
            try:
                return await op(svc, found.id)
            except errors.PgReserveError as exc:
                raise click.ClickException(exc.message) from None

    return asyncio.run(go())


@tenant_key.command("create")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def tenant_key_create(name: str, as_json: bool, database_url: str | None,
                      data_dir: str | None) -> None:
    """Issue another API key for tenant NAME (shown once; its prefix is listed later)."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        key = _tenant_call(dsn, name, lambda s, t: s.create_api_key(t))
    click.echo(json.dumps({"tenant": name, "api_key": key}) if as_json else key)


@tenant_key.command("list")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def tenant_key_list(name: str, as_json: bool, database_url: str | None,
                    data_dir: str | None) -> None:
    """Tenant NAME's API keys, newest first: prefix, created and revoked times (never a key)."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        keys = _tenant_call(dsn, name, lambda s, t: s.api_keys(t))
    rows = [{"prefix": k.prefix, "created_at": k.created_at.isoformat(),
             "revoked_at": None if k.revoked_at is None else k.revoked_at.isoformat()}
            for k in keys]
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        state = f"revoked {r['revoked_at']}" if r["revoked_at"] else "active"
        click.echo(f"{r['prefix']:<20} created {r['created_at']}  {state}")


@tenant_key.command("revoke")
@click.argument("name")
@click.argument("prefix")
@with_db
def tenant_key_revoke(name: str, prefix: str, database_url: str | None,
                      data_dir: str | None) -> None:
    """Revoke tenant NAME's key shown as PREFIX by `tenant key list`; the API refuses it
    (401) from its next request on."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        done = _tenant_call(dsn, name, lambda s, t: s.revoke_api_key(t, prefix))
    click.echo(f"revoked {done}")


@main.group()
def webhook() -> None:
    """Webhook endpoints that receive a tenant's events."""


_tenant_service_call = _tenant_call


@webhook.command("add")
@click.argument("tenant_name", metavar="TENANT")
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def webhook_add(tenant_name: str, url: str, as_json: bool, database_url: str | None,
                data_dir: str | None) -> None:
    """Register URL for TENANT's events; prints the signing secret (shown only now)."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        hook = _tenant_service_call(dsn, tenant_name, lambda s, t: s.add_webhook(t, url))
    if as_json:
        click.echo(json.dumps({"id": hook.id, "url": hook.url, "secret": hook.secret}))
    else:
        click.echo(f"webhook {hook.id} -> {hook.url}")
        click.echo(f"signing secret (shown only now): {hook.secret}")


@webhook.command("list")
@click.argument("tenant_name", metavar="TENANT")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def webhook_list(tenant_name: str, as_json: bool, database_url: str | None,
                 data_dir: str | None) -> None:
    """TENANT's webhook endpoints and their delivery state."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        hooks = _tenant_service_call(dsn, tenant_name, lambda s, t: s.webhooks(t))

    def ts(value: Any) -> str | None:
        return None if value is None else value.isoformat()

    rows = [{"id": h.id, "url": h.url, "delivered": h.delivered, "attempts": h.attempts,
             "last_error": h.last_error, "last_success_at": ts(h.last_success_at),
             "next_attempt_at": ts(h.next_attempt_at)} for h in hooks]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no webhooks")
    for r in rows:
        state = f"delivered {r['delivered']}"
        if r["attempts"]:
            state += f", {r['attempts']} failed attempt(s), last error: {r['last_error']}"
        click.echo(f"{r['id']}  {r['url']}  {state}")


@webhook.command("delete")
@click.argument("tenant_name", metavar="TENANT")
@click.argument("webhook_id", metavar="ID")
@with_db
def webhook_delete(tenant_name: str, webhook_id: str, database_url: str | None,
                   data_dir: str | None) -> None:
    """Remove TENANT's webhook endpoint ID (`webhook list` shows the ids); nothing more is
    sent to it."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        _tenant_service_call(dsn, tenant_name, lambda s, t: s.delete_webhook(t, webhook_id))
    click.echo(f"webhook {webhook_id} deleted")


@main.command()
@with_db
@retention_option
def worker(database_url: str | None, data_dir: str | None, key_retention_hours: float) -> None:
    """Run the background workers (expiry sweeper, pool replenisher, key janitor, webhook
    deliverer) until SIGTERM or Ctrl-C."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        asyncio.run(_run(dsn, http=None, workers=True, key_retention_hours=key_retention_hours))
    console.print("pgreserve stopped cleanly")


@main.command()
@with_db
@with_http
@retention_option
@legacy_option
def up(database_url: str | None, data_dir: str | None, host: str, port: int, ops_host: str,
       ops_port: int, ops_enabled: bool, log_format: str, request_log: bool,
       request_deadline_seconds: float, tenant_max_in_flight: int,
       pgbouncer_admin_url: str | None, key_retention_hours: float,
       legacy_redis_url: str | None) -> None:
    """Start everything: the database (embedded unless a URL is given), migrated, the HTTP API,
    the ops listener and the workers, in one process."""
    serving = _serving(ops_host, ops_port, ops_enabled, log_format, request_log)
    _check_listen(host, port)
    with _dsn(database_url, data_dir, create=True) as dsn:
        applied = migrations.migrate(dsn)
        for m in applied:
            console.print(f"applied migration {m.version:04d}_{m.name}")
        from .http.server import run

        run(_run(dsn, http=(host, port), workers=True, serving=serving,
                 key_retention_hours=key_retention_hours, announce=True,
                 api_options=_api_options(request_deadline_seconds, tenant_max_in_flight,
                                          pgbouncer_admin_url, legacy_redis_url)))
    console.print("pgreserve stopped cleanly")


@main.command()
@with_db
@with_http
@click.option("--workers", "processes", default=1, show_default=True,
              type=click.IntRange(1, 64), help="HTTP server processes.")
@legacy_option
def serve(database_url: str | None, data_dir: str | None, host: str, port: int, ops_host: str,
          ops_port: int, ops_enabled: bool, log_format: str, request_log: bool,
          request_deadline_seconds: float, tenant_max_in_flight: int,
          pgbouncer_admin_url: str | None, processes: int,
          legacy_redis_url: str | None) -> None:
    """Run the HTTP API and the ops listener (run `pgreserve worker` beside them).

    With --workers N the API runs in N processes and the ops listener in the
    parent process, which aggregates the workers' metrics."""
    serving = _serving(ops_host, ops_port, ops_enabled, log_format, request_log)
    _check_listen(host, port)
    api_options = _api_options(request_deadline_seconds, tenant_max_in_flight,
                               pgbouncer_admin_url, legacy_redis_url)
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        if processes == 1:
            from .http.server import run

            run(_run(dsn, http=(host, port), workers=False, serving=serving, announce=True,
                     api_options=api_options))
        else:
            os.environ["PGRESERVE_DATABASE_URL"] = dsn
            # each process's create_app reads these (http/app.py admission_from_env)
            os.environ["PGRESERVE_REQUEST_DEADLINE_SECONDS"] = str(request_deadline_seconds)
            os.environ["PGRESERVE_TENANT_MAX_IN_FLIGHT"] = str(tenant_max_in_flight)
            if pgbouncer_admin_url:
                os.environ["PGRESERVE_PGBOUNCER_ADMIN_URL"] = pgbouncer_admin_url
            if legacy_redis_url:
                os.environ["PGRESERVE_LEGACY_REDIS_URL"] = legacy_redis_url
            # The worker processes build their app from the environment.
            os.environ["PGRESERVE_LOG_FORMAT"] = log_format
            os.environ["PGRESERVE_REQUEST_LOG"] = "1" if request_log else "0"
            # prometheus_client multiprocess mode: each worker writes its values
            # to files in this directory and /metrics aggregates them.
            if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                import tempfile

                os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
                    prefix="pgreserve-metrics-")
            from .http.requestlog import configure_logging
            from .http.server import ListenerError, run_workers

            configure_logging(log_format)
            console.print(f"pgreserve API on http://{host}:{port} ({processes} processes)")
            if serving.ops is not None:
                console.print(f"ops: http://{serving.ops[0]}:{serving.ops[1]}/ops")
            try:
                run_workers(host, port, processes, ops=serving.ops, dsn=dsn,
                            pgbouncer_admin_url=pgbouncer_admin_url)
            except ListenerError as exc:
                raise click.ClickException(str(exc)) from None
    console.print("pgreserve stopped cleanly")


async def _run(dsn: str, *, http: tuple[str, int] | None, workers: bool,
               serving: Serving | None = None, key_retention_hours: float = 24.0,
               announce: bool = False, api_options: dict[str, Any] | None = None) -> None:
    """Run the API and/or the workers in this event loop until SIGINT or SIGTERM."""
    from datetime import timedelta

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    deliverer: WebhookDeliverer | None = None
    server = None
    # The workers' statements run on pools of their own business process
    # (pgreserve:sweeper, :replenisher, :janitor, :webhooks).
    async with Database(dsn, max_size=5, application_name="pgreserve:workers",
                        role_pools=True, role_max_size=2) as database:
        service = ReservationService(database)
        if workers:
            keep = timedelta(hours=key_retention_hours)
            deliverer = WebhookDeliverer(service)
            for w in (Sweeper(service), Replenisher(service),
                      Janitor(service, JanitorConfig(keep=keep)), deliverer):
                tasks.append(asyncio.create_task(run_forever(w, stop)))
        if http is not None:
            from .http.server import Listeners

            serving = serving or Serving(None, "text", False)
            request_log = serving.log()
            server = Listeners(dsn, http, serving.ops, request_log=request_log,
                               api_options=api_options)
            serving_started = asyncio.Event()
            tasks.append(asyncio.create_task(server.serve(stop, serving_started)))
            waiter = asyncio.create_task(serving_started.wait())
            await asyncio.wait([waiter, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if announce and server.started:
                url = f"http://{http[0]}:{http[1]}"
                console.print(f"[bold green]pgreserve is up[/] API: {url}  (docs: {url}/docs)")
                if serving.ops is not None:
                    ops_url = f"http://{serving.ops[0]}:{serving.ops[1]}"
                    console.print(f"ops: {ops_url}/ops  metrics: {ops_url}/metrics")
                console.print(f"database: {mask_password(dsn)}", highlight=False)
                console.print("create a tenant and its API key with:  pgreserve tenant create "
                              f"NAME{_same_database_hint(dsn)}", highlight=False)
                console.print("Press Ctrl-C to stop.")
        elif announce:
            console.print("workers: expiry sweeper, pool replenisher, key janitor, webhook "
                          "deliverer. Press Ctrl-C to stop.")
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait([stop_task, *tasks], return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        if server is not None:
            server.should_exit = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None and server.api.app.state.request_log is not None:
            server.api.app.state.request_log.close()
        if deliverer is not None:
            await deliverer.aclose()  # hand back endpoint leases while the pool is open
        stop_task.cancel()
    failed = [r for r in results if isinstance(r, BaseException)]
    if server is not None and not server.started:
        where = f" on {http[0]}:{http[1]}" if http else ""
        if serving is not None and serving.ops is not None:
            where += f" (ops listener {serving.ops[0]}:{serving.ops[1]})"
        raise click.ClickException(f"the HTTP server could not start{where}")
    if failed:
        raise failed[0]


@main.command()
@with_db
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--pool-size", default=10, show_default=True, type=click.IntRange(1, 1000),
              help="Connections per business-process pool (PGRESERVE_POOL_SIZE).")
@click.option("--processes", default=1, show_default=True, type=click.IntRange(1, 256),
              help="API processes that will connect (serve --workers).")
@pgbouncer_option
def doctor(database_url: str | None, data_dir: str | None, as_json: bool, pool_size: int,
           processes: int, pgbouncer_admin_url: str | None) -> None:
    """Check the database's settings against what pgreserve needs; print each fix.

    Reports what the server has (never what pgreserve would set); exit code 1
    when a check fails."""
    from .ops import doctor as doc

    with _dsn(database_url, data_dir) as dsn:
        findings = doc.diagnose(dsn, pool_size=pool_size, processes=processes,
                                pgbouncer_admin_url=pgbouncer_admin_url)
    if as_json:
        click.echo(json.dumps(doc.as_json(findings), indent=2))
    else:
        for f in findings:
            mark = {"ok": "[green]ok  [/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
            Console(soft_wrap=True).print(f"{mark[f.status]} {f.check}: found {f.found}"
                                          f" (want {f.want})", highlight=False)
            if f.status != "ok":
                click.echo(f"      fix: {f.fix}")
    if doc.failed(findings):
        sys.exit(1)


@main.command()
@with_db
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--tenant", "tenant_id", type=int, default=None, help="Only this tenant id.")
@click.option("--grace-seconds", default=60.0, show_default=True, type=click.FloatRange(0),
              help="An active reservation this long past its expiry is a drift.")
@click.option("--repair", is_flag=True,
              help="Repair the drifts that have a safe repair (overdue holds are expired "
                   "through the sweeper's own function); each repair is logged.")
@click.option("--freeze", "freeze_drifted", is_flag=True,
              help="Freeze every bucket with a drift (no new holds until `pgreserve "
                   "unfreeze bucket`); prints what it froze.")
def reconcile(database_url: str | None, data_dir: str | None, as_json: bool,
              tenant_id: int | None, grace_seconds: float, repair: bool,
              freeze_drifted: bool) -> None:
    """Prove the stock accounting per bucket; exit code 1 on any drift."""
    from .ops.reconcile import reconcile as run

    with _dsn(database_url, data_dir) as dsn:
        if freeze_drifted:
            migrations.migrate(dsn)  # the freeze table and its functions
        else:
            check_database(dsn)  # an unmigrated database: a message, not a traceback
        result = run(dsn, tenant=tenant_id, grace_s=grace_seconds, repair=repair,
                     freeze=freeze_drifted)
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2, default=str))
    else:
        click.echo(f"{'tenant':>6} {'sku@location':<30} {'on_hand':>8} {'free':>8} {'pool':>8}"
                   f" {'held':>8} {'active':>8} {'claimed':>8} {'restored':>8} {'ledger':>8}")
        for b in result.books:
            click.echo(f"{b.tenant_id:>6} {(b.sku + '@' + b.location)[:30]:<30} {b.on_hand:>8}"
                       f" {b.free:>8} {b.pool:>8} {b.held:>8} {b.active_held:>8}"
                       f" {b.claimed:>8} {b.restored:>8} {b.ledger_on_hand:>8}")
        for msg in result.repaired:
            click.echo(f"repaired: {msg}")
        for d in result.drifts:
            where = f" {d.bucket}" if d.bucket else ""
            click.echo(f"DRIFT {d.kind} tenant {d.tenant_id}{where}: {d.detail}"
                       + ("  (--repair can fix this)" if d.repairable else ""))
        for f in result.frozen:
            already = " (already frozen)" if f.get("already") else ""
            click.echo(f"FROZE tenant {f['tenant_id']} {f['sku']}@{f['location']}{already}")
        if not result.drifts:
            click.echo("no drift")
    if result.drifts:
        sys.exit(1)


def _operator() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


freeze_options = [
    click.option("--reason", required=True, help="Why (kept with the freeze)."),
    click.option("--by", "by", default=None, help="Who (default: user@host)."),
    click.option("--json", "as_json", is_flag=True, help="Print JSON."),
]


def with_freeze(f: Any) -> Any:
    for option in reversed(freeze_options):
        f = option(f)
    return with_db(f)


def _print_freeze(doc: dict[str, Any], verb: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(doc))
        return
    what = (f"tenant {doc['tenant']!r}" if doc["scope"] == "tenant"
            else f"{doc['sku']}@{doc['location']} of tenant {doc['tenant']!r}")
    click.echo(f"{verb} {what}")


def _freeze_cmd(database_url: str | None, data_dir: str | None, tenant_name: str,
                sku: str | None, location: str | None, reason: str, by: str | None,
                as_json: bool, lift: bool) -> None:
    who = by or _operator()
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        if lift:
            done = _tenant_call(dsn, tenant_name, lambda s, t: s.unfreeze(
                t, reason, who, sku=sku, location=location))
        else:
            done = _tenant_call(dsn, tenant_name, lambda s, t: s.freeze(
                t, reason, who, sku=sku, location=location))
    doc = {**done.as_json(), "already": done.already}
    verb = "unfroze" if lift else ("already frozen:" if done.already else "froze")
    _print_freeze(doc, verb, as_json)


@main.group()
def freeze() -> None:
    """Stop new reservations of a bucket or tenant (claims, releases, expiry go on)."""


@freeze.command("bucket")
@click.argument("tenant_name", metavar="TENANT")
@click.argument("sku")
@click.argument("location")
@with_freeze
def freeze_bucket(tenant_name: str, sku: str, location: str, reason: str, by: str | None,
                  as_json: bool, database_url: str | None, data_dir: str | None) -> None:
    """Freeze SKU at LOCATION of TENANT: new reservations get 423 bucket_frozen."""
    _freeze_cmd(database_url, data_dir, tenant_name, sku, location, reason, by, as_json, False)


@freeze.command("tenant")
@click.argument("tenant_name", metavar="TENANT")
@with_freeze
def freeze_tenant(tenant_name: str, reason: str, by: str | None, as_json: bool,
                  database_url: str | None, data_dir: str | None) -> None:
    """Freeze all of TENANT: new reservations get 423 tenant_frozen."""
    _freeze_cmd(database_url, data_dir, tenant_name, None, None, reason, by, as_json, False)


@freeze.command("list")
@click.option("--tenant", "tenant_name", default=None, help="Only this tenant.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def freeze_list(tenant_name: str | None, as_json: bool, database_url: str | None,
                data_dir: str | None) -> None:
    """The live freezes: what, who froze it, when and why."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        if tenant_name is None:
            async def go() -> Any:
                async with Database(dsn, min_size=1, max_size=1) as database:
                    return await ReservationService(database).freezes()

            found = asyncio.run(go())
        else:
            found = _tenant_call(dsn, tenant_name, lambda s, t: s.freezes(t))
    docs = [f.as_json() for f in found]
    if as_json:
        click.echo(json.dumps(docs))
        return
    if not docs:
        click.echo("nothing is frozen")
    for d in docs:
        what = "(whole tenant)" if d["scope"] == "tenant" else f"{d['sku']}@{d['location']}"
        click.echo(f"{d['tenant']:<20} {what:<30} since {d['frozen_at']} by {d['frozen_by']}: "
                   f"{d['reason']}")


@main.group()
def unfreeze() -> None:
    """Lift a freeze (the freeze stays on record with who lifted it, when and why)."""


@unfreeze.command("bucket")
@click.argument("tenant_name", metavar="TENANT")
@click.argument("sku")
@click.argument("location")
@with_freeze
def unfreeze_bucket(tenant_name: str, sku: str, location: str, reason: str, by: str | None,
                    as_json: bool, database_url: str | None, data_dir: str | None) -> None:
    """Let SKU at LOCATION of TENANT take new reservations again."""
    _freeze_cmd(database_url, data_dir, tenant_name, sku, location, reason, by, as_json, True)


@unfreeze.command("tenant")
@click.argument("tenant_name", metavar="TENANT")
@with_freeze
def unfreeze_tenant(tenant_name: str, reason: str, by: str | None, as_json: bool,
                    database_url: str | None, data_dir: str | None) -> None:
    """Let TENANT take new reservations again (bucket freezes stay)."""
    _freeze_cmd(database_url, data_dir, tenant_name, None, None, reason, by, as_json, True)


@main.group()
def ops() -> None:
    """Live views: hold time per caller, pool bloat."""


@ops.command("holdtime")
@with_db
@click.option("--seconds", default=10.0, show_default=True, type=click.FloatRange(1, 86400),
              help="Sample for this long (once a second), then print.")
@click.option("--all-databases", is_flag=True, help="Every database, not only this one.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ops_holdtime(database_url: str | None, data_dir: str | None, seconds: float,
                 all_databases: bool, as_json: bool) -> None:
    """Connection-seconds per caller (application_name) and state, the oldest transaction
    and the sessions idle in transaction, sampled from pg_stat_activity."""
    from .ops.sampler import HoldTimeSampler, SamplerConfig

    async def go(dsn: str) -> Any:
        sampler = HoldTimeSampler(dsn, SamplerConfig(all_databases=all_databases))
        try:
            for _ in range(max(1, int(seconds))):
                await sampler.sample()
                await asyncio.sleep(sampler.loop_config.interval_s)
        finally:
            await sampler.close()
        return sampler.report

    with _dsn(database_url, data_dir) as dsn:
        report = asyncio.run(go(dsn))
    doc = report.as_json()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"{'application_name':<32} {'state':<28} {'conn-s':>9} {'now':>5}")
    for row in doc["connection_seconds"]:
        click.echo(f"{row['application_name'][:32]:<32} {row['state'][:28]:<28}"
                   f" {row['seconds']:>9.1f} {row['backends_now']:>5}")
    o = doc["oldest_xact"]
    click.echo(f"oldest transaction: {o['seconds']:.1f}s ({o['application_name']}, pid {o['pid']})")
    for s in doc["idle_in_transaction"]:
        click.echo(f"idle in transaction: pid {s['pid']} {s['application_name']}"
                   f" for {s['idle_seconds']:.1f}s")


@ops.command("bloat")
@with_db
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ops_bloat(database_url: str | None, data_dir: str | None, as_json: bool) -> None:
    """Live and dead tuples, % dead and last autovacuum of every pool partition."""
    from .ops.bloat import BloatMonitor

    async def go(dsn: str) -> Any:
        monitor = BloatMonitor(dsn)
        try:
            return await monitor.check()
        finally:
            await monitor.close()

    with _dsn(database_url, data_dir) as dsn:
        report = asyncio.run(go(dsn))
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
        return
    click.echo(f"age(datfrozenxid) {report.xid_age}; pgstattuple "
               f"{'on' if report.pgstattuple else 'unavailable'}")
    for p in report.partitions:
        click.echo(f"{p.name:<14} live {p.live:>9} dead {p.dead:>9} {p.dead_pct:6.1f}% dead"
                   f"  last autovacuum {p.last_autovacuum or '-'}")


from .bench.cli import bench  # noqa: E402  (the bench group imports the core, not the CLI)
from .rollout.cli import rollout  # noqa: E402  (like bench: a group of its own module)

main.add_command(bench)
main.add_command(rollout)


def _dsn(database_url: str | None, data_dir: str | None, *, create: bool = False) -> Any:
    """The database of a command; only `up` and `migrate` may create an embedded one."""
    return database_url_ctx(database_url, data_dir, create=create)


def _check_listen(host: str, port: int) -> None:
    """Fail with a message, before anything starts, when host:port cannot be listened on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as exc:
            raise click.ClickException(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what uses it "
                f"or pass --port N (PGRESERVE_PORT)") from None


def _same_database_hint(dsn: str) -> str:
    """How another command reaches the database `dsn` names."""
    host = psycopg.conninfo.conninfo_to_dict(dsn).get("host")
    if host and str(host).startswith("/") and (Path(str(host)) / "PG_VERSION").exists():
        return f" --data-dir {host}"
    return "  (with the same --database-url / PGRESERVE_DATABASE_URL)"


database_url_ctx = database_url


def _show_envvars(command: click.Command) -> None:
    """Every option read from an environment variable names it in --help."""
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            param.show_envvar = True
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _show_envvars(sub)


_show_envvars(main)

if __name__ == "__main__":
    sys.exit(main())
