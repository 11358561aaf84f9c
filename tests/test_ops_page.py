"""GET /ops: the self-contained dashboard, rendered by headless Chromium, shows the
database's figures."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg
import pytest

import toolcheck
from pgreserve import ReservationService, Tenant
from test_cli_up import free_port
from test_ops_listener import OpsServed, tenant_with_key

CHROMIUM = toolcheck.find("chromium")


class Tables(HTMLParser):
    """Every table of the page by id, as rows of cell texts; and every span by id."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.spans: dict[str, str] = {}
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._span: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "span" and (span := a.get("id")):
            self._span = span
            self.spans[span] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._table is not None and self._row:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "span":
            self._span = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        elif self._span is not None:
            self.spans[self._span] += data


def dump_dom(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="pgreserve-chromium-") as profile:
        out = subprocess.run(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
             "--dump-dom", url],
            capture_output=True, timeout=120, check=True)
    return out.stdout.decode()


def test_page_is_self_contained(dsn: str) -> None:
    """The page loads nothing from elsewhere: no src/href attributes, no URL with a host,
    its one script inline, and it fetches only its own listener's /ops paths."""
    with OpsServed(dsn) as srv:
        page = httpx.get(f"{srv.ops}/ops").text
    assert not re.search(r"\b(src|href)\s*=", page)
    assert not re.search(r"(https?:)?//[a-z0-9]", page, re.I)
    assert page.count("<script>") == 1 and "<script " not in page
    assert re.findall(r'fetch\("([^"]+)"', page) == ["/ops/series.json", "/ops/tables"]


@pytest.mark.skipif(CHROMIUM is None, reason=toolcheck.TOOLS["chromium"].reason)
async def test_ops_page_in_chromium_shows_the_database_figures(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """Chromium renders /ops with the hot bucket's pool and held units, the reservations
    by state, the 16 pool partitions and the callers' hold time as the database has them."""
    t = tenant.id
    await service.set_stock(t, "hot", "wh", 50, strategy="pool")
    ids = []
    for i in range(3):
        out = await service.reserve(t, f"k{i}", [("hot", "wh", 2)])
        assert out.reservation is not None
        ids.append(out.reservation.id)
    await service.claim(t, ids[0])
    await service.release(t, ids[1])
    with psycopg.connect(dsn, autocommit=True) as conn:
        pool, held, on_hand = conn.execute(
            "SELECT (SELECT count(*) FROM stock_unit), (SELECT sum(quantity) FROM"
            " reservation_line WHERE held), (SELECT on_hand FROM stock_bucket)").fetchone()  # type: ignore[misc]  # the query always returns one row
        states: dict[str, int] = dict(conn.execute("SELECT status, count(*) FROM reservation GROUP BY 1")
                      .fetchall())
    with OpsServed(dsn) as srv:
        url = f"{srv.ops}/ops"
        deadline = time.monotonic() + 30
        while True:  # the server's own sampler has seen the ops listener's connections
            doc = (await asyncio.to_thread(httpx.get, f"{url}.json")).json()
            seen = {c["application_name"] for c in doc["hold_time"]["connection_seconds"]}
            # (a sample taken before the ops pools connected lists the API's only)
            if ({"pgreserve:ops", "pgreserve:bloat"} & seen
                    or time.monotonic() > deadline):
                break
            await asyncio.sleep(0.2)
        dom = await asyncio.to_thread(dump_dom, url)
    page = Tables()
    page.feed(dom)
    hot = page.tables["hot-buckets"]
    assert hot[0][:3] == ["acme", "hot", "wh"]
    assert (int(hot[0][4]), int(hot[0][6]), int(hot[0][8])) == (on_hand, pool, held)
    assert {r[0]: int(r[1]) for r in page.tables["holds"]} == states
    assert [r[0] for r in page.tables["bloat"]] == [f"stock_unit_p{i}" for i in range(16)]
    callers = {r[0] for r in page.tables["hold-time"]}
    assert {"pgreserve:ops", "pgreserve:bloat"} & callers, callers
    assert page.spans["xid-age"].isdigit()


class Chromium:
    """Headless Chromium driven over the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                result: dict[str, Any] = msg["result"]
                return result

    async def evaluate(self, expression: str) -> Any:
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True)
        return out["result"].get("value")


@contextlib.asynccontextmanager
async def chromium(*flags: str) -> AsyncIterator[Chromium]:
    """Headless Chromium on about:blank, started with these extra command-line `flags`."""
    port = free_port()
    # Chromium's helper processes may still write the profile as the browser exits.
    with tempfile.TemporaryDirectory(prefix="pgreserve-chromium-",
                                     ignore_cleanup_errors=True) as profile:
        proc = await asyncio.create_subprocess_exec(
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", "--disable-dev-shm-usage", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
            "--remote-allow-origins=*", "--window-size=1240,1400", *flags, "about:blank",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession() as http:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                            pages = [t for t in await r.json() if t["type"] == "page"]
                        if pages:
                            break
                    except aiohttp.ClientError:
                        pass
                    assert time.monotonic() < deadline, "chromium did not open its debug port"
                    await asyncio.sleep(0.2)
                async with http.ws_connect(pages[0]["webSocketDebuggerUrl"],
                                           max_msg_size=0) as ws:
                    yield Chromium(ws)
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


CHART_STATE = """JSON.stringify([...document.querySelectorAll("svg[id^=chart-]")].map(s => ({
  id: s.id.slice(6), points: +(s.dataset.points || 0), last_t: +(s.dataset.lastT || 0),
  updates: +(s.dataset.updates || 0), lines: s.querySelectorAll("polyline").length,
  xy: [...s.querySelectorAll("polyline")].map(p => p.getAttribute("points")).join("|")})))"""


def load(base: str, key: str, stop: threading.Event) -> None:
    """Buyers until `stop`: holds on a pool bucket, then claims or releases; sold-out
    answers on a bucket of three units."""
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"},
                      timeout=30) as c:
        i = 0
        while not stop.is_set():
            i += 1
            sku = "hot" if i % 4 else "scarce"
            r = c.post("/v1/reservations", headers={"Idempotency-Key": f"buyer-{i}"},
                       json={"lines": [{"sku": sku, "location": "wh", "quantity": 1}]})
            if r.status_code == 201 and i % 3:
                c.post(f"/v1/reservations/{r.json()['id']}/{'claim' if i % 2 else 'release'}")
            time.sleep(0.02)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed "
                    "(.ci/run installs it); this test renders /ops in headless Chromium")
async def test_live_page_in_chromium_charts_figures_that_move(dsn: str,
                                                              tmp_path: Path) -> None:
    """Under load, Chromium's /ops redraws its seven charts from the ring every second:
    later readings have more points and new times, holds/s and p99 have data, the pool
    level, dead-tuple ratio and connection-seconds charts have lines; a PNG screenshot
    is taken (and copied to docs/ops-page.png with PGRESERVE_UPDATE_SCREENSHOT=1)."""
    key = tenant_with_key(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT stock_set_v1(tenant_id, 'hot', 'wh', 100000, 'pool', false, 200,"
                     " NULL) FROM tenant")
        conn.execute("SELECT stock_set_v1(tenant_id, 'scarce', 'wh', 3, NULL, false, NULL,"
                     " NULL) FROM tenant")
    stop = threading.Event()
    with OpsServed(dsn) as srv:
        buyers = threading.Thread(target=load, args=(srv.api, key, stop), daemon=True)
        buyers.start()
        try:
            async with chromium() as page:
                await page.call("Page.enable")
                await page.call("Page.navigate", url=f"{srv.ops}/ops")
                await asyncio.sleep(4)
                before = {c["id"]: c for c in json.loads(await page.evaluate(CHART_STATE))}
                await asyncio.sleep(5)
                after = {c["id"]: c for c in json.loads(await page.evaluate(CHART_STATE))}
                status = await page.evaluate('document.getElementById("status").textContent')
                shot = await page.call("Page.captureScreenshot", format="png",
                                       captureBeyondViewport=True)
        finally:
            stop.set()
            buyers.join(30)
    assert set(after) == {"holds", "sold-out", "claims", "p99", "pool", "dead", "conn"}
    assert status.startswith("live"), status
    for cid, chart in after.items():
        assert chart["updates"] > before[cid]["updates"] >= 1, (cid, before[cid], chart)
        assert chart["last_t"] > before[cid]["last_t"], cid
        assert chart["lines"] >= 1, (cid, chart)
    for cid in ("holds", "claims", "p99"):
        assert after[cid]["points"] > before[cid]["points"] >= 1, (cid, before[cid], after[cid])
        assert after[cid]["xy"] != before[cid]["xy"], cid
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    (tmp_path / "ops-page.png").write_bytes(png)
    if os.environ.get("PGRESERVE_UPDATE_SCREENSHOT") == "1":
        (Path(__file__).parent.parent / "docs" / "ops-page.png").write_bytes(png)
