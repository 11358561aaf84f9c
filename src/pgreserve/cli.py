"""The pgreserve command line."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from typing import Any

import click
from rich.console import Console

from . import errors
from .config import database_url
from .core.service import ReservationService
from .db import migrate as migrations
from .db.database import Database
from .workers.base import run_forever
from .workers.janitor import Janitor, JanitorConfig
from .workers.replenisher import Replenisher
from .workers.sweeper import Sweeper
from .workers.webhooks import WebhookDeliverer

console = Console(stderr=True, soft_wrap=True)

db_options = [
    click.option("--database-url", envvar="PGRESERVE_DATABASE_URL", default=None,
                 help="PostgreSQL >= 15 URL; default: the embedded server."),
    click.option("--data-dir", envvar="PGRESERVE_DATA_DIR", default=None,
                 help="Data directory of the embedded server (default ./.pgreserve/data)."),
]


def with_db(f: Any) -> Any:
    for option in reversed(db_options):
        f = option(f)
    return f


http_options = [
    click.option("--host", envvar="PGRESERVE_HOST", default="127.0.0.1", show_default=True,
                 help="Address the HTTP API listens on."),
    click.option("--port", envvar="PGRESERVE_PORT", default=8000, show_default=True, type=int,
                 help="Port of the HTTP API."),
]

retention_option = click.option(
    "--key-retention-hours", envvar="PGRESERVE_KEY_RETENTION_HOURS", default=24.0,
    show_default=True, type=click.FloatRange(min=1.0),
    help="Keep Idempotency-Keys at least this long before the janitor forgets them.")


def with_http(f: Any) -> Any:
    for option in reversed(http_options):
        f = option(f)
    return f


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def main(verbose: bool) -> None:
    """pgreserve: inventory reservations inside PostgreSQL."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@with_db
def migrate(database_url: str | None, data_dir: str | None) -> None:
    """Apply pending schema migrations (safe to run concurrently and repeatedly)."""
    with _dsn(database_url, data_dir) as dsn:
        try:
            applied = migrations.migrate(dsn)
        except errors.MigrationError as exc:
            raise click.ClickException(str(exc)) from None
    if applied:
        for m in applied:
            click.echo(f"applied {m.version:04d}_{m.name}")
    else:
        click.echo("schema is up to date")


@main.group()
def db() -> None:
    """The database."""


@db.command("url")
@with_db
def db_url(database_url: str | None, data_dir: str | None) -> None:
    """Print the DSN (starts the embedded server if it is not running)."""
    with _dsn(database_url, data_dir) as dsn:
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


@tenant.command("key")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@with_db
def tenant_key(name: str, as_json: bool, database_url: str | None, data_dir: str | None) -> None:
    """Issue another API key for an existing tenant."""

    async def go(dsn: str) -> str:
        async with Database(dsn, min_size=1, max_size=1) as database:
            svc = ReservationService(database)
            found = await svc.tenant_by_name(name)
            if found is None:
                raise click.ClickException(f"no tenant named {name!r}")
            return await svc.create_api_key(found.id)

    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        key = asyncio.run(go(dsn))
    click.echo(json.dumps({"tenant": name, "api_key": key}) if as_json else key)


@main.group()
def webhook() -> None:
    """Webhook endpoints that receive a tenant's events."""


def _tenant_service_call(dsn: str, name: str, op: Any) -> Any:
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
def up(database_url: str | None, data_dir: str | None, host: str, port: int,
       key_retention_hours: float) -> None:
    """Start everything: the database (embedded unless a URL is given), migrated, the HTTP API
    and the workers, in one process."""
    with _dsn(database_url, data_dir) as dsn:
        applied = migrations.migrate(dsn)
        for m in applied:
            console.print(f"applied migration {m.version:04d}_{m.name}")
        asyncio.run(_run(dsn, http=(host, port), workers=True,
                         key_retention_hours=key_retention_hours, announce=True))
    console.print("pgreserve stopped cleanly")


@main.command()
@with_db
@with_http
@click.option("--workers", "processes", default=1, show_default=True,
              type=click.IntRange(1, 64), help="HTTP server processes.")
def serve(database_url: str | None, data_dir: str | None, host: str, port: int,
          processes: int) -> None:
    """Run the HTTP API only (run `pgreserve worker` beside it)."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        if processes == 1:
            asyncio.run(_run(dsn, http=(host, port), workers=False, announce=True))
        else:
            import os

            import uvicorn

            os.environ["PGRESERVE_DATABASE_URL"] = dsn
            console.print(f"pgreserve API on http://{host}:{port} ({processes} processes)")
            uvicorn.run("pgreserve.http.app:app_from_env", factory=True, host=host, port=port,
                        workers=processes, log_level="warning")
    console.print("pgreserve stopped cleanly")


async def _run(dsn: str, *, http: tuple[str, int] | None, workers: bool,
               key_retention_hours: float = 24.0, announce: bool = False) -> None:
    """Run the API and/or the workers in this event loop until SIGINT or SIGTERM."""
    from datetime import timedelta

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    deliverer: WebhookDeliverer | None = None
    server = None
    async with Database(dsn, max_size=5, application_name="pgreserve:workers") as database:
        service = ReservationService(database)
        if workers:
            keep = timedelta(hours=key_retention_hours)
            deliverer = WebhookDeliverer(service)
            for w in (Sweeper(service), Replenisher(service),
                      Janitor(service, JanitorConfig(keep=keep)), deliverer):
                tasks.append(asyncio.create_task(run_forever(w, stop)))
        if http is not None:
            from .http.server import ApiServer

            server = ApiServer(dsn, *http)
            tasks.append(asyncio.create_task(server.serve()))
            await server.wait_started(stop)
            if announce and server.started:
                url = f"http://{http[0]}:{http[1]}"
                console.print(f"[bold green]pgreserve is up[/] API: {url}  (docs: {url}/docs)")
                console.print(f"database: {dsn}")
                console.print("create a tenant and its API key with:  pgreserve tenant create "
                              "NAME  (with the same --data-dir / --database-url)")
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
        if deliverer is not None:
            await deliverer.aclose()  # hand back endpoint leases while the pool is open
        stop_task.cancel()
    failed = [r for r in results if isinstance(r, BaseException)]
    if server is not None and not server.started:
        raise click.ClickException(f"the HTTP server could not start on {http[0]}:{http[1]}"
                                   if http else "the HTTP server could not start")
    if failed:
        raise failed[0]


from .bench.cli import bench  # noqa: E402  (the bench group imports the core, not the CLI)

main.add_command(bench)


def _dsn(database_url: str | None, data_dir: str | None) -> Any:
    return database_url_ctx(database_url, data_dir)


database_url_ctx = database_url

if __name__ == "__main__":
    sys.exit(main())
