"""GET /ops: the self-contained dashboard, rendered by headless Chromium, shows the
database's figures."""

from __future__ import annotations

import asyncio
import re
import subprocess
import tempfile
import time
from html.parser import HTMLParser

import httpx
import psycopg
import pytest

import toolcheck
from pgreserve import ReservationService, Tenant
from test_http_schema import Served

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
    """The page loads nothing from elsewhere (no src/href attributes, no scripts) and
    refreshes itself."""
    with Served(dsn) as srv:
        page = httpx.get(f"http://127.0.0.1:{srv.port}/ops?refresh=7").text
    assert '<meta http-equiv="refresh" content="7">' in page
    assert not re.search(r"\b(src|href)\s*=", page) and "<script" not in page


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
    with Served(dsn) as srv:
        url = f"http://127.0.0.1:{srv.port}/ops"
        deadline = time.monotonic() + 30
        while True:  # the server's own sampler has taken a sample
            doc = (await asyncio.to_thread(httpx.get, f"{url}.json")).json()
            if doc["hold_time"]["samples"] > 0 or time.monotonic() > deadline:
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
