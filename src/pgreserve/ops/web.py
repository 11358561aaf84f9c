"""The /ops page and the glue between the API process and the monitors."""

from __future__ import annotations

import asyncio
import html
import json
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
async def monitors(app: Any, dsn: str, ops: OpsMetrics, *, enabled: bool,
                   schema: str | None = None) -> AsyncIterator[None]:
    """Run the hold-time sampler and the bloat monitor (of the installation in
    `schema`) beside the app (when enabled)."""
    if not enabled:
        yield
        return
    sampler = HoldTimeSampler(dsn, metrics=ops)
    bloat = BloatMonitor(dsn, metrics=ops, schema=schema)
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
        bloat = BloatMonitor(db.conninfo, schema=db.schema)
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


def render_tables(doc: dict[str, Any]) -> str:
    """The page's tables and figures as HTML (the page swaps them in every few seconds)."""
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
    frozen = [[f["tenant"], "(whole tenant)" if f["scope"] == "tenant" else f["sku"],
               f["location"], f["frozen_at"], f["frozen_by"], f["reason"]]
              for f in doc.get("frozen", [])]
    refills = doc["refills"]
    oldest = ht["oldest_xact"]
    warn = doc["bloat"]["warnings"]
    return f"""<p>Oldest transaction:
<span id="oldest-xact">{oldest['seconds']}</span> s
({html.escape(str(oldest['application_name']))}).
xid age: <span id="xid-age">{doc['bloat']['xid_age']}</span>.
Pool refills: inline <span id="refills-inline">{refills['inline']}</span>,
background <span id="refills-background">{refills['background']}</span>.</p>
{'<p class="warn" id="bloat-warning">Bloat warning: ' + html.escape(', '.join(warn)) + '</p>'
 if warn else ''}
<h2>Frozen (no new reservations)</h2>
{_table(["tenant", "sku", "location", "since", "by", "reason"], frozen, "frozen")}
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
"""


# (element id, title, key in a point of /ops/series.json, multi-series, top n, scale)
CHARTS = (
    ("holds", "holds/s", "holds_per_s", False, 0, 1),
    ("sold-out", "sold-out answers/s", "sold_out_per_s", False, 0, 1),
    ("claims", "claims/s", "claims_per_s", False, 0, 1),
    ("p99", "reserve p99 latency (ms, last 5 s)", "reserve_p99_seconds", False, 0, 1000),
    ("pool", "pool units per hot bucket", "pool_units", True, 0, 1),
    ("dead", "dead-tuple ratio (top 5 partitions)", "dead_tuple_ratio", True, 5, 1),
    ("conn", "connection-seconds per second by caller (not idle)",
     "connection_seconds_per_s", True, 6, 1),
)

_SCRIPT = """
const CHARTS = %(charts)s;
const MAX_WINDOW = 300, W = 560, H = 150, PAD = 40, BASE = H - 22;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
                                                       '"': "&quot;"})[c]);
const lastOf = s => s.length ? s[s.length - 1][1] : 0;
const fmt = v => v >= 100 ? v.toFixed(0) : v >= 1 ? v.toFixed(2) : v.toFixed(3);
function seriesOf(c, points) {
  const [, title, key, multi, top, scale] = c, out = {};
  for (const p of points) {
    if (multi) {
      const m = p[key] || {};
      for (const k in m) (out[k] = out[k] || []).push([p.t, m[k] * scale]);
    } else if (p[key] !== null && p[key] !== undefined) {
      (out[title] = out[title] || []).push([p.t, p[key] * scale]);
    }
  }
  if (!top) return out;
  const kept = {};
  Object.keys(out).sort((a, b) => lastOf(out[b]) - lastOf(out[a])).slice(0, top)
    .forEach(n => { kept[n] = out[n]; });
  return kept;
}
function draw(c, points) {
  const svg = document.getElementById("chart-" + c[0]), series = seriesOf(c, points);
  // The x axis spans the points held, at least 30 s and at most five minutes.
  const t1 = points.length ? points[points.length - 1].t : 0;
  const WINDOW = Math.min(MAX_WINDOW, Math.max(30, points.length ? t1 - points[0].t : 0));
  const t0 = t1 - WINDOW;
  let max = 0;
  for (const n in series) for (const [, v] of series[n]) max = Math.max(max, v);
  max = max > 0 ? max * 1.1 : 1;
  const parts = [`<line class="axis" x1="${PAD}" y1="${BASE}" x2="${W}" y2="${BASE}"/>`,
                 `<text class="tick" x="2" y="12">${fmt(max)}</text>`,
                 `<text class="tick" x="2" y="${BASE}">0</text>`,
                 `<text class="tick" x="${PAD}" y="${H - 6}">-${WINDOW.toFixed(0)} s</text>`,
                 `<text class="tick" x="${W - 24}" y="${H - 6}">now</text>`];
  const legend = [];
  let i = 0, count = 0;
  for (const n in series) {
    const color = COLORS[i++ %% COLORS.length];
    const xy = series[n].map(([t, v]) => (PAD + (t - t0) / WINDOW * (W - PAD)).toFixed(1) +
                                         "," + (BASE - v / max * (BASE - 8)).toFixed(1));
    count += xy.length;
    parts.push(`<polyline fill="none" stroke="${color}" stroke-width="1.5"` +
               ` points="${xy.join(" ")}"/>`);
    legend.push(`<span style="color:${color}">&#9632; ${esc(n)} ${fmt(lastOf(series[n]))}</span>`);
  }
  svg.innerHTML = parts.join("");
  svg.dataset.points = count;
  svg.dataset.lastT = t1;
  svg.dataset.updates = (+svg.dataset.updates || 0) + 1;
  document.getElementById("legend-" + c[0]).innerHTML = legend.join(" ") || "no data yet";
}
let lastT = null;
async function tick() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/ops/series.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const points = (await r.json()).points;
    const t = points.length ? points[points.length - 1].t : null;
    if (t !== lastT) {
      lastT = t;
      CHARTS.forEach(c => draw(c, points));
    }
    status.textContent = "live, " + points.length + " points, updated " +
      new Date().toLocaleTimeString();
    status.className = "ok";
  } catch (e) {
    status.textContent = "not updating: " + e.message;
    status.className = "warn";
  }
  setTimeout(tick, 1000);
}
async function tables() {
  try {
    const r = await fetch("/ops/tables", {cache: "no-store"});
    if (r.ok) document.getElementById("tables").innerHTML = await r.text();
  } catch (e) { /* the charts' status line says so */ }
  setTimeout(tables, 5000);
}
tick();
setTimeout(tables, 5000);
"""


def render_page(doc: dict[str, Any]) -> str:
    """A self-contained page (inline CSS, SVG and script; nothing loaded from elsewhere):
    charts of the last five minutes, redrawn every second from /ops/series.json, and
    the tables, refreshed every 5 s from /ops/tables."""
    charts = "\n".join(
        f'<div class="chart"><h3>{html.escape(title)}</h3>'
        f'<svg id="chart-{cid}" viewBox="0 0 560 150" width="560" height="150" '
        f'role="img" aria-label="{html.escape(title)}"></svg>'
        f'<div class="legend" id="legend-{cid}">waiting for data</div></div>'
        for cid, title, *_ in CHARTS)
    script = _SCRIPT % {"charts": json.dumps([list(c) for c in CHARTS])}
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>pgreserve ops</title>
<style>
body{{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}}
table{{border-collapse:collapse;margin:.4em 0 1.2em}}
th,td{{border:1px solid #ccc;padding:.2em .6em;text-align:right}}
th{{background:#f3f3f3}} td:first-child,th:first-child{{text-align:left}}
.warn{{color:#a40000;font-weight:bold}} .ok{{color:#1a7f37}} .none{{color:#888;text-align:center}}
.charts{{display:flex;flex-wrap:wrap;gap:1em}}
.chart{{border:1px solid #ddd;padding:.3em .6em;background:#fcfcfc}}
.chart h3{{margin:.1em 0;font-size:13px}} .legend{{font-size:12px;max-width:560px}}
svg .axis{{stroke:#999}} svg .tick{{font-size:10px;fill:#666}}
</style></head><body>
<h1>pgreserve ops</h1>
<p id="status">loading…</p>
<div class="charts">
{charts}
</div>
<div id="tables">
{render_tables(doc)}
</div>
<script>{script}</script>
</body></html>
"""
