"""The /ops page and the glue between the API process and the monitors."""

from __future__ import annotations

import asyncio
import html
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ..core.service import ReservationService
from ..workers.base import run_forever
from .bloat import BloatMonitor
from .figures import read_figures
from .metrics import OpsMetrics
from .sampler import HoldTimeSampler

log = logging.getLogger(__name__)


@asynccontextmanager
async def monitors(app: Any, dsn: str, ops: OpsMetrics, *, enabled: bool) -> AsyncIterator[None]:
    """Run the hold-time sampler and the bloat monitor beside the app (when enabled)."""
    if not enabled:
        yield
        return
    sampler = HoldTimeSampler(dsn, metrics=ops)
    bloat = BloatMonitor(dsn, metrics=ops)
    app.state.sampler, app.state.bloat = sampler, bloat
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_forever(w, stop)) for w in (sampler, bloat)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sampler.close()
        await bloat.close()


async def refresh_metrics(app: Any, service: ReservationService, ops: OpsMetrics) -> None:
    """Before a scrape: the figures read at scrape time and the client pools' stats."""
    ops.pool_stats(service.db.pool_stats())
    pgbouncer = getattr(app.state, "pgbouncer", None)  # create_app(pgbouncer_admin_url=)
    if pgbouncer is not None:
        await pgbouncer.refresh()
    try:
        ops.figures(await read_figures(service.db))
    except Exception as exc:  # noqa: BLE001 - a scrape still answers with what it has
        log.warning("figures unavailable: %s", exc)


async def snapshot(app: Any, service: ReservationService, ops: OpsMetrics) -> dict[str, Any]:
    """Everything the ops page shows, as JSON-able data."""
    db = service.db
    figures = await read_figures(db)
    sampler: HoldTimeSampler | None = getattr(app.state, "sampler", None)
    bloat: BloatMonitor | None = getattr(app.state, "bloat", None)
    if sampler is None or sampler.report.samples == 0:
        sampler = HoldTimeSampler(db.conninfo)  # one sample now: who holds connections
        try:
            await sampler.sample()
        finally:
            await sampler.close()
    if bloat is None or not bloat.report.partitions:
        bloat = BloatMonitor(db.conninfo)
        try:
            await bloat.check()
        finally:
            await bloat.close()
    return {
        **figures.as_json(),
        "hold_time": sampler.report.as_json(),
        "bloat": bloat.report.as_json(),
        "client_pools": db.pool_stats(),
        "recent_errors": list(ops.recent_errors),
    }


def _table(headers: list[str], rows: list[list[Any]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in row)
        + "</tr>" for row in rows)
    if not rows:
        body = f'<tr><td colspan="{len(headers)}" class="none">none</td></tr>'
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def render_page(doc: dict[str, Any], refresh_s: int = 5) -> str:
    """A self-contained HTML page (inline CSS, no scripts or external assets) that reloads."""
    buckets = [[b["tenant"], b["sku"], b["location"], b["strategy"], b["on_hand"], b["free"],
                b["pool"], b["pool_cap"], b["held"], b["hold_lines"]]
               for b in doc["hot_buckets"]]
    holds = [[k, v] for k, v in sorted(doc["holds"].items())]
    ht = doc["hold_time"]
    callers = [[c["application_name"], c["state"], c["seconds"], c["backends_now"]]
               for c in ht["connection_seconds"]]
    idle = [[s["pid"], s["application_name"], s["idle_seconds"], s["xact_seconds"]]
            for s in ht["idle_in_transaction"]]
    bloat = [[p["partition"], p["live"], p["dead"], p["dead_pct"], p["state"],
              p["last_autovacuum"], p["pgstattuple_dead_pct"]]
             for p in doc["bloat"]["partitions"]]
    errors = [[e["at"], e["error"]] for e in doc["recent_errors"]]
    refills = doc["refills"]
    oldest = ht["oldest_xact"]
    warn = doc["bloat"]["warnings"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(refresh_s)}">
<title>pgreserve ops</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}}
table{{border-collapse:collapse;margin:.4em 0 1.2em}}
th,td{{border:1px solid #ccc;padding:.2em .6em;text-align:right}}
th{{background:#f3f3f3}} td:first-child,th:first-child{{text-align:left}}
.warn{{color:#a40000;font-weight:bold}} .none{{color:#888;text-align:center}}
</style></head><body>
<h1>pgreserve ops</h1>
<p>Refreshes every {int(refresh_s)} s. Oldest transaction:
<span id="oldest-xact">{oldest['seconds']}</span> s
({html.escape(str(oldest['application_name']))}).
xid age: <span id="xid-age">{doc['bloat']['xid_age']}</span>.
Pool refills: inline <span id="refills-inline">{refills['inline']}</span>,
background <span id="refills-background">{refills['background']}</span>.</p>
{'<p class="warn" id="bloat-warning">Bloat warning: ' + html.escape(', '.join(warn)) + '</p>'
 if warn else ''}
<h2>Hot buckets and pool levels</h2>
{_table(["tenant", "sku", "location", "strategy", "on_hand", "free", "pool", "pool_cap",
         "held", "hold lines"], buckets, "hot-buckets")}
<h2>Reservations by state</h2>
{_table(["state", "count"], holds, "holds")}
<h2>Hold time per caller (connection-seconds)</h2>
{_table(["application_name", "state", "seconds", "backends now"], callers, "hold-time")}
<h2>Idle in transaction</h2>
{_table(["pid", "application_name", "idle s", "transaction s"], idle, "idle-in-transaction")}
<h2>Bloat per pool partition</h2>
{_table(["partition", "live", "dead", "% dead", "state", "last autovacuum",
         "pgstattuple % dead"], bloat, "bloat")}
<h2>Recent errors</h2>
{_table(["at", "error"], errors, "recent-errors")}
</body></html>
"""
