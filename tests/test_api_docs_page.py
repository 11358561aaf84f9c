"""/docs (Swagger UI) and /redoc (ReDoc) work offline: their pages and scripts come from
the app itself, under its root path, and headless Chromium with every other host out of
reach renders every operation of the OpenAPI document."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI

import toolcheck
from pgreserve.http import create_app
from test_mount import MOUNT, Served, shop_with
from test_ops_page import CHROMIUM, Chromium, chromium

# Every host but loopback resolves to nothing, and whatever is not loopback goes to a
# proxy that is not there: a page that needs another host fails to load it.
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
           "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=127.0.0.1")

SWAGGER_OPERATIONS = """JSON.stringify([...document.querySelectorAll(".opblock[id]")]
    .map(e => e.id.split("-").pop()))"""
REDOC_OPERATIONS = """JSON.stringify([...document.querySelectorAll('[id^="operation/"]')]
    .map(e => e.id.slice("operation/".length)))"""


class RecordingChromium:
    """The DevTools session, keeping every event it receives (the network's requests)."""

    def __init__(self, page: Chromium) -> None:
        self.page = page
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        page = self.page
        page.next_id += 1
        await page.ws.send_json({"id": page.next_id, "method": method, "params": params})
        while True:
            msg = await page.ws.receive_json(timeout=60)
            if "method" in msg:
                self.events.append(msg)
            elif msg.get("id") == page.next_id:
                assert "error" not in msg, msg
                result: dict[str, Any] = msg["result"]
                return result

    async def evaluate(self, expression: str) -> Any:
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True)
        return out["result"].get("value")

    def requested(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events
                if e["method"] == "Network.requestWillBeSent"]

    def failed(self) -> list[dict[str, Any]]:
        return [e["params"] for e in self.events if e["method"] == "Network.loadingFailed"]

    def sent(self) -> list[str]:
        """The URLs requested, less those the page's Content-Security-Policy stopped in
        the browser (they never left it)."""
        stopped = {f["requestId"] for f in self.failed() if f.get("blockedReason") == "csp"}
        return [e["params"]["request"]["url"] for e in self.events
                if e["method"] == "Network.requestWillBeSent"
                and e["params"]["requestId"] not in stopped]


async def rendered(page: RecordingChromium, url: str, operations: str) -> list[str]:
    """Open `url` and wait until the page lists operations (`operations` reads their ids)."""
    page.events.clear()
    await page.call("Page.navigate", url=url)
    deadline = time.monotonic() + 60
    while True:
        found = await page.evaluate(operations)
        if found and found != "[]":
            break
        assert time.monotonic() < deadline, f"{url} rendered no operation"
        await asyncio.sleep(0.25)
    await asyncio.sleep(1)  # late requests (fonts, images) would show up by now
    import json

    ids: list[str] = json.loads(await page.evaluate(operations))
    return ids


def operation_ids(base: str) -> set[str]:
    schema = httpx.get(f"{base}/openapi.json").json()
    return {op["operationId"] for ops in schema["paths"].values() for op in ops.values()}


def only_from(urls: list[str], origin: str) -> list[str]:
    """The URLs not on `origin` (and not data: or about: URLs)."""
    return [u for u in urls if urlsplit(u).scheme not in ("data", "about", "blob")
            and f"{urlsplit(u).scheme}://{urlsplit(u).netloc}" != origin]


@pytest.mark.parametrize("mount", ["", MOUNT])
def test_the_doc_pages_name_no_other_host(dsn: str, mount: str) -> None:
    """The /docs and /redoc pages (alone and mounted) link only to the app's own paths
    under its root path: no URL with a host, no Google fonts."""
    inventory = create_app(dsn)
    app: FastAPI = shop_with(inventory, "bound") if mount else inventory
    with Served(app) as srv:
        for name, script in (("docs", "swagger-ui-bundle.js"), ("redoc", "redoc.standalone.js")):
            page = httpx.get(f"{srv.url}{mount}/{name}")
            assert page.status_code == 200
            assert not re.search(r"(https?:)?//[a-z0-9]", page.text, re.I), page.text
            assert f'src="{mount}/docs/assets/{script}"' in page.text
            assert f"{mount}/openapi.json" in page.text
            asset = httpx.get(f"{srv.url}{mount}/docs/assets/{script}")
            assert asset.status_code == 200 and len(asset.content) > 100_000


@pytest.mark.skipif(CHROMIUM is None, reason=toolcheck.TOOLS["chromium"].reason)
async def test_docs_and_redoc_render_every_operation_offline(dsn: str) -> None:
    """With every other host unreachable, Chromium renders all the OpenAPI document's
    operations in Swagger UI (/docs) and ReDoc (/redoc), served alone and mounted at
    /inventory; every request the pages made went to the app's own origin and none failed."""
    alone = create_app(dsn)
    shop = shop_with(create_app(dsn), "bound")
    with Served(alone) as one, Served(shop) as mounted:
        expected = operation_ids(one.url)
        assert expected == operation_ids(f"{mounted.url}{MOUNT}")
        assert "createReservation" in expected
        async with chromium(*OFFLINE) as session:
            page = RecordingChromium(session)
            await page.call("Network.enable")
            await page.call("Page.enable")
            for base, prefix in ((one.url, ""), (mounted.url, MOUNT)):
                for name, operations in (("docs", SWAGGER_OPERATIONS),
                                         ("redoc", REDOC_OPERATIONS)):
                    shown = await rendered(page, f"{base}{prefix}/{name}", operations)
                    where = f"{prefix}/{name}"
                    assert set(shown) == expected, (where, set(shown) ^ expected)
                    urls = page.requested()
                    assert f"{base}{prefix}/openapi.json" in urls, (where, urls)
                    assert any(u.startswith(f"{base}{prefix}/docs/assets/") for u in urls)
                    assert only_from(page.sent(), base) == [], (where, urls)
                    assert [f for f in page.failed() if f.get("blockedReason") != "csp"] == []
