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
from .workers.replenisher import Replenisher
from .workers.sweeper import Sweeper

console = Console(stderr=True)

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
    """Create a tenant and print its id."""

    async def go(dsn: str) -> Any:
        async with Database(dsn, max_size=1) as database:
            return await ReservationService(database).create_tenant(name)

    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        try:
            created = asyncio.run(go(dsn))
        except errors.PgReserveError as exc:
            raise click.ClickException(exc.message) from None
        except Exception as exc:
            if "unique" in str(exc).lower():
                raise click.ClickException(f"tenant {name!r} already exists") from None
            raise
    if as_json:
        click.echo(json.dumps({"tenant": created.name, "tenant_id": created.id}))
    else:
        click.echo(f"tenant {created.name!r} created with id {created.id}")


@main.command()
@with_db
def worker(database_url: str | None, data_dir: str | None) -> None:
    """Run the background workers (expiry sweeper, pool replenisher) until SIGTERM or Ctrl-C."""
    with _dsn(database_url, data_dir) as dsn:
        migrations.migrate(dsn)
        asyncio.run(_run_workers(dsn, announce=None))


@main.command()
@with_db
def up(database_url: str | None, data_dir: str | None) -> None:
    """Start everything: the database (embedded unless a URL is given), migrated, and the workers."""
    with _dsn(database_url, data_dir) as dsn:
        applied = migrations.migrate(dsn)
        for m in applied:
            console.print(f"applied migration {m.version:04d}_{m.name}")
        asyncio.run(_run_workers(dsn, announce=dsn))


async def _run_workers(dsn: str, announce: str | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Database(dsn, max_size=1, application_name="pgreserve:sweeper") as sweep_db, \
            Database(dsn, max_size=1, application_name="pgreserve:replenisher") as refill_db:
        sweeper = Sweeper(ReservationService(sweep_db))
        replenisher = Replenisher(ReservationService(refill_db))
        if announce:
            console.print(f"[bold green]pgreserve is up[/] database: {announce}")
            console.print("workers: expiry sweeper, pool replenisher. Press Ctrl-C to stop.")
        await asyncio.gather(run_forever(sweeper, stop), run_forever(replenisher, stop))
    console.print("pgreserve stopped cleanly")


def _dsn(database_url: str | None, data_dir: str | None) -> Any:
    return database_url_ctx(database_url, data_dir)


database_url_ctx = database_url

from .bench.cli import bench  # noqa: E402

main.add_command(bench)

if __name__ == "__main__":
    sys.exit(main())
