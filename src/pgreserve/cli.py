"""The pgreserve command line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psycopg
import psycopg.conninfo
from rich.console import Console

from . import errors, settings
from .config import database_url, mask_password
from .core.service import ReservationService
from .db import migrate as migrations
from .db import schema as schemas
from .db.database import Database, TxSettings, deadline
from .db.embedded import data_dir_from_env
from .db.migration_check import check_database
from .settings import Settings
from .workers.base import SHUTDOWN_GRACE_S, WORKER_CALL_DEADLINE_S, run_forever
from .workers.janitor import Janitor, JanitorConfig
from .workers.replenisher import Replenisher
from .workers.sweeper import Sweeper
from .workers.webhooks import WebhookDeliverer

if TYPE_CHECKING:
    from .http.requestlog import RequestLog

console = Console(stderr=True, soft_wrap=True)


def with_db(f: Any) -> Any:
    """--database-url and --data-dir, and --config FILE whose values they fall back on."""
    return settings.config_option(settings.options(*settings.DB_KEYS)(f))


def with_http(f: Any) -> Any:
    """The API's and the ops listener's settings (settings.API_KEYS)."""
    return settings.options(*settings.API_KEYS)(f)


retention_option = settings.options("key_retention_hours")
pgbouncer_option = settings.options("pgbouncer_admin_url")
legacy_option = settings.options("legacy_redis_url")
workers_option = settings.options("workers")


def _api_options(s: Settings) -> dict[str, Any]:
    """create_app's options from the settings."""
    return {"request_deadline_s": s.request_deadline_seconds,
            "tenant_max_in_flight": s.tenant_max_in_flight,
            "pgbouncer_admin_url": s.pgbouncer_admin_url,
            "legacy_redis_url": s.legacy_redis_url}


def _request_log(s: Settings) -> RequestLog | None:
    """The request log the settings ask for (None when off); sets up the other log lines."""
    from .http.requestlog import RequestLog, configure_logging

    configure_logging(s.log_format)
    if not s.request_log:
        return None
    return RequestLog(s.request_log_fmt, stream=s.open_request_log(),
                      owns_stream=s.request_log_file is not None)


def _settings(params: dict[str, Any]) -> Settings:
    return Settings.from_params(params, click.get_current_context())


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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
        _tenant_service_call(dsn, tenant_name, lambda s, t: s.delete_webhook(t, webhook_id))
    click.echo(f"webhook {webhook_id} deleted")


@main.command()
@with_db
@retention_option
def worker(database_url: str | None, data_dir: str | None, key_retention_hours: float) -> None:
    """Run the background workers (expiry sweeper, pool replenisher, key janitor, webhook
    deliverer) until SIGTERM or Ctrl-C."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.upgrade(dsn)
        asyncio.run(_run(dsn, http=False, workers=True, key_retention_hours=key_retention_hours))
    console.print("pgreserve stopped cleanly")


@main.command()
@with_db
@with_http
@retention_option
@legacy_option
def up(**params: Any) -> None:
    """Start everything: the database (embedded unless a URL is given), migrated, the HTTP API,
    the ops listener and the workers, in one process."""
    s = _settings(params)
    _check_listen(s)
    _check_gc_threshold()
    with _dsn(s.database_url, s.data_dir, create=True) as dsn:
        applied = migrations.upgrade(dsn)
        for m in applied:
            console.print(f"applied migration {m.version:04d}_{m.name}")
        from .http.server import run

        run(_run(dsn, settings=s, http=True, workers=True,
                 key_retention_hours=s.key_retention_hours, announce=True))
    console.print("pgreserve stopped cleanly")


@main.command()
@with_db
@with_http
@workers_option
@legacy_option
def serve(**params: Any) -> None:
    """Run the HTTP API and the ops listener (run `pgreserve worker` beside them).

    With --workers N the API runs in N processes and the ops listener in the
    parent process, which aggregates the workers' metrics."""
    s = _settings(params)
    _check_listen(s)
    _check_gc_threshold()
    with _dsn(s.database_url, s.data_dir) as dsn:
        migrations.upgrade(dsn)
        if s.workers == 1:
            from .http.server import run

            run(_run(dsn, settings=s, http=True, workers=False, announce=True))
        else:
            _serve_processes(dsn, s)
    console.print("pgreserve stopped cleanly")


def _check_gc_threshold() -> None:
    """PGRESERVE_GC_THRESHOLD (http/gc_tuning.py), checked before anything starts."""
    from .http.gc_tuning import threshold_from_env

    try:
        threshold_from_env()
    except errors.InvalidRequest as exc:
        raise click.ClickException(exc.message) from None


def _serve_processes(dsn: str, s: Settings) -> None:
    """`serve --workers N`: each process builds its app from the environment set here."""
    env = os.environ
    env["PGRESERVE_DATABASE_URL"] = dsn
    # each process's create_app reads these (http/app.py admission_from_env)
    env["PGRESERVE_REQUEST_DEADLINE_SECONDS"] = str(s.request_deadline_seconds)
    env["PGRESERVE_TENANT_MAX_IN_FLIGHT"] = str(s.tenant_max_in_flight)
    env["PGRESERVE_PREPARE_THRESHOLD"] = s.prepare_threshold
    if s.pgbouncer_admin_url:
        env["PGRESERVE_PGBOUNCER_ADMIN_URL"] = s.pgbouncer_admin_url
    if s.legacy_redis_url:
        env["PGRESERVE_LEGACY_REDIS_URL"] = s.legacy_redis_url
    # and their logging (http/requestlog.py from_env)
    env["PGRESERVE_LOG_FORMAT"] = s.log_format
    env["PGRESERVE_REQUEST_LOG"] = "1" if s.request_log else "0"
    env["PGRESERVE_REQUEST_LOG_FORMAT"] = s.request_log_fmt
    if s.request_log_file:
        env["PGRESERVE_REQUEST_LOG_FILE"] = str(Path(s.request_log_file).resolve())
    # prometheus_client multiprocess mode: each worker writes its values
    # to files in this directory and /metrics aggregates them.
    made: str | None = None  # a directory of this run's own, removed when it ends
    if not env.get("PROMETHEUS_MULTIPROC_DIR"):
        import tempfile

        made = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="pgreserve-metrics-")
    try:
        _run_processes(dsn, s)
    finally:
        if made is not None:
            import shutil

            shutil.rmtree(made, ignore_errors=True)


def _run_processes(dsn: str, s: Settings) -> None:
    from .http.requestlog import configure_logging
    from .http.server import ListenerError, run_workers

    configure_logging(s.log_format)
    console.print(f"pgreserve API on {s.api_url} ({s.workers} processes)", highlight=False)
    if s.ops_address is not None:
        console.print(f"ops: http://{s.ops_host}:{s.ops_port}/ops", highlight=False)
    try:
        run_workers(s.host, s.port, s.workers, ops=s.ops_address, dsn=dsn,
                    pgbouncer_admin_url=s.pgbouncer_admin_url,
                    server_options=s.server_options())
    except ListenerError as exc:
        raise click.ClickException(str(exc)) from None


@main.group("config")
def config_group() -> None:
    """The settings `up` and `serve` would run with."""


@config_group.command("show")
@with_db
@with_http
@retention_option
@legacy_option
@workers_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def config_show(as_json: bool, **params: Any) -> None:
    """Print every setting, its value (secrets masked) and where it came from: a flag, a
    PGRESERVE_* variable, the --config file, or the default. Starts nothing."""
    s = _settings(params)
    rows = s.shown()
    if as_json:
        click.echo(json.dumps({"config_file": s.config_file,
                               "settings": [{"key": k, "value": v, "source": src}
                                            for k, v, src in rows]}, indent=2))
        return
    click.echo(f"# settings file: {s.config_file or '- (none: --config / PGRESERVE_CONFIG)'}")
    width = max(len(k) for k, _, _ in rows)
    for key, value, source in rows:
        click.echo(f"{key:<{width}}  {value}  ({source})")


async def _run(dsn: str, *, http: bool, workers: bool, settings: Settings | None = None,
               key_retention_hours: float = 24.0, announce: bool = False) -> None:
    """Run the API and/or the workers in this event loop until SIGINT or SIGTERM."""
    from datetime import timedelta

    s = settings or Settings(request_log=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    worker_tasks: list[asyncio.Task[None]] = []
    deliverer: WebhookDeliverer | None = None
    server = None
    # The workers' statements run on pools of their own business process
    # (pgreserve:sweeper, :replenisher, :janitor, :webhooks).
    # Each of their calls has a deadline (WORKER_CALL_DEADLINE_S): a database that
    # stops answering fails a round, logged, instead of holding it (and a shutdown).
    async with Database(dsn, max_size=5, application_name="pgreserve:workers",
                        role_pools=True, role_max_size=2,
                        settings=TxSettings(call_deadline_s=WORKER_CALL_DEADLINE_S),
                        prepare_threshold=s.prepare_after) as database:
        service = ReservationService(database)
        if workers:
            keep = timedelta(hours=key_retention_hours)
            deliverer = WebhookDeliverer(service)
            for w in (Sweeper(service), Replenisher(service),
                      Janitor(service, JanitorConfig(keep=keep)), deliverer):
                worker_tasks.append(asyncio.create_task(run_forever(w, stop)))
            tasks.extend(worker_tasks)
        if http:
            from .http.server import Listeners

            server = Listeners(dsn, (s.host, s.port), s.ops_address,
                               prepare_threshold=s.prepare_after,
                               request_log=_request_log(s), api_options=_api_options(s),
                               server_options=s.server_options())
            serving_started = asyncio.Event()
            tasks.append(asyncio.create_task(server.serve(stop, serving_started)))
            waiter = asyncio.create_task(serving_started.wait())
            await asyncio.wait([waiter, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if server.started:
                from .http.gc_tuning import tune_gc

                tune_gc()  # this process serves the API: its collector is ours to set
            if announce and server.started:
                url = s.api_url
                console.print(f"[bold green]pgreserve is up[/] API: {url}  (docs: {url}/docs)",
                              highlight=False)
                if s.ops_address is not None:
                    ops_url = f"http://{s.ops_host}:{s.ops_port}"
                    console.print(f"ops: {ops_url}/ops  metrics: {ops_url}/metrics",
                                  highlight=False)
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
        # The workers finish their round; one still waiting on the database after
        # SHUTDOWN_GRACE_S is cancelled (its transaction is the server's to end).
        if worker_tasks:
            _, late = await asyncio.wait(worker_tasks, timeout=SHUTDOWN_GRACE_S)
            for task in late:
                task.cancel()
        results = [r for r in await asyncio.gather(*tasks, return_exceptions=True)
                   if not isinstance(r, asyncio.CancelledError)]
        if server is not None and server.api.app.state.request_log is not None:
            server.api.app.state.request_log.close()
        if deliverer is not None:
            with deadline(SHUTDOWN_GRACE_S):  # a lease not handed back expires
                await deliverer.aclose()  # hand back endpoint leases while the pool is open
        stop_task.cancel()
    failed = [r for r in results if isinstance(r, BaseException)]
    if server is not None and not server.started:
        where = f" on {s.uds or f'{s.host}:{s.port}'}"
        if s.ops_address is not None:
            where += f" (ops listener {s.ops_host}:{s.ops_port})"
        raise click.ClickException(f"the HTTP server could not start{where}")
    if failed:
        raise failed[0]


@main.command()
@with_db
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--pool-size", default=10, show_default=True, type=click.IntRange(1, 1000),
              envvar="PGRESERVE_POOL_SIZE",
              help="Connections per business-process pool of each API process.")
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
@click.option("--grace-seconds", default=60.0, show_default=True,
              type=settings.FiniteFloatRange(0, 366 * 86400),
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
            migrations.upgrade(dsn)  # the freeze table and its functions
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
        migrations.upgrade(dsn)
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
        migrations.upgrade(dsn)
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
@click.option("--seconds", default=10.0, show_default=True,
              type=settings.FiniteFloatRange(1, 86400),
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
    """Live and dead tuples, % dead, state and last autovacuum of every pool partition
    (one look: a partition over the dead share is a warning when no vacuum finished on
    it for 5 minutes)."""
    from .ops.bloat import BloatMonitor

    async def go(dsn: str) -> Any:
        monitor = BloatMonitor(dsn)
        try:
            return await monitor.check(once=True)
        finally:
            await monitor.close()

    with _dsn(database_url, data_dir) as dsn:
        check_database(dsn)  # a schema with no installation: a message, not "no partitions"
        report = asyncio.run(go(dsn))
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
        return
    click.echo(f"age(datfrozenxid) {report.xid_age}; pgstattuple "
               f"{'on' if report.pgstattuple else 'unavailable'}")
    for p in report.partitions:
        click.echo(f"{p.name:<14} live {p.live:>9} dead {p.dead:>9} {p.dead_pct:6.1f}% dead"
                   f"  {p.state:<7}  last autovacuum {p.last_autovacuum or '-'}")


from .bench.cli import bench  # noqa: E402  (the bench group imports the core, not the CLI)
from .rollout.cli import rollout  # noqa: E402  (like bench: a group of its own module)

main.add_command(bench)
main.add_command(rollout)


def _dsn(database_url: str | None, data_dir: str | None, *, create: bool = False) -> Any:
    """The database of a command; only `up` and `migrate` may create an embedded one."""
    return database_url_ctx(database_url, data_dir, create=create)


def _check_listen(s: Settings) -> None:
    """Fail with a message, before anything starts, when the API's address or the ops
    listener's cannot be listened on, naming the option to change (a Unix socket's
    directory is checked with the settings)."""
    import socket

    api = None if s.uds is not None else (s.host, s.port)
    ops = s.ops_address
    bound = []  # (listening, so that a second address overlapping the first fails too)
    try:
        for address, what, option in (
                (api, "the API", "--port N (PGRESERVE_PORT)"),
                (ops, "the ops listener", "--ops-port N (PGRESERVE_OPS_PORT), or --no-ops")):
            if address is None:
                continue
            host, port = address
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_PASSIVE)
            except socket.gaierror as exc:
                raise click.ClickException(
                    f"cannot listen on {host}:{port} ({what}): {exc.strerror}") from None
            family, kind, proto, _, addr = infos[0]
            probe = socket.socket(family, kind, proto)
            bound.append(probe)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(addr)
                probe.listen(1)
            except OSError as exc:
                shared = (" (the API's address is that port too)"
                          if api is not None and address is ops and api[1] == port else "")
                raise click.ClickException(
                    f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}{shared}; "
                    f"stop what uses it or pass {option}") from None
    finally:
        for probe in bound:
            probe.close()


def _same_database_hint(dsn: str) -> str:
    """How another command reaches the database `dsn` names (and the schema in use)."""
    where = schemas.resolve()
    schema = "" if where == schemas.DEFAULT_SCHEMA else f" --schema {where}"
    host = psycopg.conninfo.conninfo_to_dict(dsn).get("host")
    if host and str(host).startswith("/") and (Path(str(host)) / "PG_VERSION").exists():
        return f" --data-dir {host}{schema}"
    return f"{schema}  (with the same --database-url / PGRESERVE_DATABASE_URL)"


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
