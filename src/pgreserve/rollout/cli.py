"""`pgreserve rollout`: switch a tenant's mode, see the modes, the plan and the comparison."""

from __future__ import annotations

import asyncio
import getpass
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from .. import errors, settings
from ..config import database_url
from ..core.service import ReservationService
from ..db import migrate as migrations
from ..db.database import Database
from . import report as reports
from .modes import Mode, set_mode

T = TypeVar("T")


def _db_options(f: Any) -> Any:
    """--database-url, --schema and --data-dir, and --config FILE whose values they fall
    back on (PGRESERVE_CONFIG), as every command of the service's database takes them."""
    return settings.config_option(settings.options(*settings.DB_KEYS)(f))


def _with_db(database_url_: str | None, data_dir: str | None,
             go: Callable[[Database], Awaitable[T]]) -> T:
    async def run(dsn: str) -> T:
        async with Database(dsn, min_size=1, max_size=1) as db:
            return await go(db)

    with database_url(database_url_, data_dir, create=False) as dsn:
        migrations.upgrade(dsn)
        try:
            return asyncio.run(run(dsn))
        except errors.PgReserveError as exc:
            raise click.ClickException(exc.message) from None


async def _tenant_id(db: Database, name: str) -> int:
    found = await ReservationService(db).tenant_by_name(name)
    if found is None:
        raise click.ClickException(f"no tenant named {name!r}")
    return found.id


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@click.group()
def rollout() -> None:
    """Roll out beside a legacy Redis hold store: modes per tenant, the comparison."""


@rollout.command("set")
@click.argument("tenant")
@click.argument("mode", type=click.Choice([m.value for m in Mode]))
@click.option("--by", "changed_by", default=None,
              help="Who makes the switch (default: user@host).")
@click.option("--force", is_flag=True,
              help="Go back to legacy or shadow although Redis missed writes (in primary, "
                   "or every write while in pgreserve mode), after counting every bucket "
                   "again in primary.")
@_db_options
def rollout_set(tenant: str, mode: str, changed_by: str | None, force: bool,
                database_url: str | None, data_dir: str | None) -> None:
    """Switch TENANT to MODE (legacy, shadow, primary, pgreserve); running servers follow
    within a second. Holds already taken finish under the mode they were taken in. Back
    to legacy or shadow is refused while Redis missed writes since the switch to primary,
    and after a stay in pgreserve mode (see --force)."""
    # (an empty --by is refused by set_mode, never taken for the default)
    who = (changed_by if changed_by is not None
           else f"{getpass.getuser()}@{socket.gethostname()}")

    async def go(db: Database) -> Mode:
        return await set_mode(db, await _tenant_id(db, tenant), mode, who, force=force)

    before = _with_db(database_url, data_dir, go)
    click.echo(f"{tenant}: {before.value} -> {mode} (by {who})")


@rollout.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_db_options
def rollout_status(as_json: bool, database_url: str | None, data_dir: str | None) -> None:
    """Every tenant's mode, and who set it when."""
    rows = _with_db(database_url, data_dir, reports.status)
    if as_json:
        click.echo(json.dumps([reports.as_json(r) for r in rows]))
        return
    for r in rows:
        when = f"  set {r.changed_at:%Y-%m-%d %H:%M:%S%z} by {r.changed_by}" if r.changed_at \
            else ""
        click.echo(f"{r.tenant:<24} {r.mode:<10}{when}")


@rollout.command("plan")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_db_options
def rollout_plan(as_json: bool, database_url: str | None, data_dir: str | None) -> None:
    """Tenants from the smallest traffic (requests, last 7 days) to the largest, with their
    mode and agreement ratio: ramp from the top, the riskiest last."""
    rows = _with_db(database_url, data_dir, reports.plan)
    if as_json:
        click.echo(json.dumps([reports.as_json(r) for r in rows]))
        return
    click.echo(f"{'tenant':<24} {'mode':<10} {'traffic':>10} {'compared':>10} {'agreement':>10}")
    for r in rows:
        click.echo(f"{r.tenant:<24} {r.mode:<10} {r.traffic:>10} {r.compared:>10} "
                   f"{_pct(r.agreement):>10}")


@rollout.command("rehearse")
@click.option("--legacy-redis-url", envvar="PGRESERVE_LEGACY_REDIS_URL", required=True,
              help="redis:// URL of the legacy store (a scratch tenant's keys are written).")
@click.option("--buyers", default=64, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--stock", default=40, show_default=True, type=click.IntRange(0, 1_000_000))
@click.option("--seed", default=None, type=int, help="Seed of the buyers' claim-or-release.")
@_db_options
def rollout_rehearse(legacy_redis_url: str, buyers: int, stock: int, seed: int | None,
                     database_url: str | None, data_dir: str | None) -> None:
    """Run a shadow-mode sale on a new scratch tenant (BUYERS concurrent buyers of one SKU
    with STOCK units in both stores) and print its comparison report."""
    from .rehearsal import rehearse

    async def go(db: Database) -> Any:
        done = await rehearse(ReservationService(db), legacy_redis_url, buyers=buyers,
                              stock=stock, seed=seed)
        return done, await reports.report(db, done.tenant.id)

    done, (summary, latest) = _with_db(database_url, data_dir, go)
    click.echo(f"tenant {done.tenant.name}: {done.buyers} buyers, {done.held} held, "
               f"{done.claimed} claimed in {done.seconds:.2f} s")
    _print_report(summary, latest)


@rollout.command("report")
@click.option("--tenant", "tenant_name", default=None, help="Only this tenant.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(0, 1000),
              help="Latest disagreements shown.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_db_options
def rollout_report(tenant_name: str | None, limit: int, as_json: bool,
                   database_url: str | None, data_dir: str | None) -> None:
    """Requests compared, agreement ratio, latency p50 / p99 per store, the latest
    disagreements (request key, both outcomes, both latencies)."""

    async def go(db: Database) -> Any:
        tenant = await _tenant_id(db, tenant_name) if tenant_name is not None else None
        return await reports.report(db, tenant, limit)

    summary, latest = _with_db(database_url, data_dir, go)
    if as_json:
        click.echo(json.dumps({"tenants": [reports.as_json(r) for r in summary],
                               "disagreements": [reports.as_json(d) for d in latest]}))
        return
    _print_report(summary, latest)


def _print_report(summary: list[reports.TenantReport],
                  latest: list[reports.Disagreement]) -> None:
    click.echo(f"{'tenant':<20} {'compared':>9} {'agreed':>9} {'agreement':>10} {'errors':>7} "
               f"{'legacy p50':>11} {'legacy p99':>11} {'pg p50':>9} {'pg p99':>9}  (ms)")
    for r in summary:
        click.echo(f"{r.tenant:<20} {r.compared:>9} {r.agreed:>9} {_pct(r.agreement):>10} "
                   f"{r.errors:>7} {_ms(r.legacy_p50_ms):>11} {_ms(r.legacy_p99_ms):>11} "
                   f"{_ms(r.pgreserve_p50_ms):>9} {_ms(r.pgreserve_p99_ms):>9}")
    if latest:
        click.echo("latest disagreements:")
    for d in latest:
        click.echo(f"  {d.at:%Y-%m-%d %H:%M:%S} {d.tenant} {d.mode} {d.operation} "
                   f"key={d.request_key} legacy={json.dumps(d.legacy)} ({d.legacy_ms:.2f} ms) "
                   f"pgreserve={json.dumps(d.pgreserve)} ({d.pgreserve_ms:.2f} ms)")
