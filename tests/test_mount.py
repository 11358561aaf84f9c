"""create_app mounted inside a shop's own FastAPI app: the host runs pgreserve's lifespan
(or, failing that, the pool opens on first use), the mounted routes, problems, OpenAPI
document and docs live under the mount path, the host's routes keep working, and shutdown
closes the pool."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from starlette.types import Lifespan

from pgreserve import Database
from pgreserve.http import create_app, lifespan
from pgreserve.http.server import ListenerServer, run
from test_cli_up import free_port
from test_ops_listener import tenant_with_key

MOUNT = "/inventory"


class Served:
    """An ASGI app on a real uvicorn server (lifespan on), in a thread with its own loop."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.server = ListenerServer(app, "127.0.0.1", self.port)
        self.thread = threading.Thread(target=run, args=(self.server.serve(),), daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            self.thread.join(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"


def _backends(dsn: str) -> int:
    """Connections to the test's database other than this one."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname ="
                           " current_database() AND pid <> pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def _backends_gone(dsn: str) -> bool:
    """True once no other connection to the test's database is left (a closed client's
    backend leaves pg_stat_activity a moment after the client hung up); False if one is
    still there after 30 s."""
    deadline = time.monotonic() + 30
    while _backends(dsn) > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def shop_with(inventory: FastAPI, style: str) -> FastAPI:
    """The shop's app: its own /ping route and pgreserve mounted at /inventory, whose
    lifespan it runs as its own ("bound") or inside its own lifespan ("nested")."""
    if style == "bound":
        shop_lifespan: Lifespan[FastAPI] = inventory.router.lifespan_context
    else:
        @asynccontextmanager
        async def shop_lifespan(shop: FastAPI) -> AsyncIterator[None]:
            shop.state.phase = "starting"
            async with lifespan(inventory):
                shop.state.phase = "running"
                yield
            shop.state.phase = "stopped"
    shop = FastAPI(title="shop", lifespan=shop_lifespan)

    @shop.get("/ping")
    async def ping() -> dict[str, str]:
        return {"shop": "ok"}

    shop.mount(MOUNT, inventory)
    return shop


@pytest.mark.parametrize("style", ["bound", "nested"])
def test_a_shop_serves_pgreserve_mounted_and_shutdown_closes_its_pool(
        dsn: str, style: str, caplog: pytest.LogCaptureFixture) -> None:
    """Mounted at /inventory in a shop app run by uvicorn: stock 200, reserve 201 and read
    200 under the mount, a 404 problem of pgreserve's own, OpenAPI with the /inventory
    server and the docs page pointing under it; the shop's route answers; no first-use
    warning; after shutdown the pool is closed and no connection is left."""
    key = tenant_with_key(dsn)
    inventory = create_app(dsn)
    shop = shop_with(inventory, style)
    auth = {"Authorization": f"Bearer {key}"}
    with caplog.at_level(logging.WARNING, logger="pgreserve.http.app"), Served(shop) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        assert client.get("/ping").json() == {"shop": "ok"}
        put = client.put(f"{MOUNT}/v1/stock/wh/tee", json={"on_hand": 5}, headers=auth)
        assert put.status_code == 201 and put.json()["on_hand"] == 5, put.text
        made = client.post(f"{MOUNT}/v1/reservations", headers={**auth, "Idempotency-Key": "o-1"},
                           json={"lines": [{"sku": "tee", "location": "wh", "quantity": 2}]})
        assert made.status_code == 201, made.text
        got = client.get(f"{MOUNT}/v1/reservations/{made.json()['id']}", headers=auth)
        assert got.status_code == 200 and got.json()["status"] == "active"
        assert client.get(f"{MOUNT}/v1/stock/wh/tee", headers=auth).json()["available"] == 3
        missing = client.get(f"{MOUNT}/v1/nothing-here", headers=auth)
        assert missing.status_code == 404 and missing.json()["code"] == "not_found"
        assert client.get("/v1/reservations").status_code == 404  # not at the host's root
        schema = client.get(f"{MOUNT}/openapi.json").json()
        assert schema["servers"] == [{"url": MOUNT}]
        assert "/v1/reservations" in schema["paths"] and "/ping" not in schema["paths"]
        page = client.get(f"{MOUNT}/docs").text
        assert f"'{MOUNT}/openapi.json'" in page or f'"{MOUNT}/openapi.json"' in page
        assert f"{MOUNT}/docs/assets/swagger-ui-bundle.js" in page
        asset = client.get(f"{MOUNT}/docs/assets/swagger-ui-bundle.js")
        assert asset.status_code == 200 and "SwaggerUIBundle" in asset.text
        assert _backends(dsn) > 0
        if style == "nested":
            assert shop.state.phase == "running"
    assert not [r for r in caplog.records if "lifespan did not run" in r.getMessage()]
    assert inventory.state.service.db.pool.closed
    assert _backends_gone(dsn)
    if style == "nested":
        assert shop.state.phase == "stopped"


async def test_mounted_without_its_lifespan_the_pool_opens_on_first_use(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A shop that mounts pgreserve but runs no lifespan of its: the first request opens the
    pool (with one warning naming the mount path and the fix) and gets 201; later ones reuse
    it."""
    key = tenant_with_key(dsn)
    inventory = create_app(dsn)
    shop = FastAPI()
    shop.mount(MOUNT, inventory)
    auth = {"Authorization": f"Bearer {key}"}
    transport = httpx.ASGITransport(app=shop)  # no lifespan at all
    try:
        with caplog.at_level(logging.WARNING, logger="pgreserve.http.app"):
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                for i in range(3):
                    made = await client.post(
                        f"{MOUNT}/v1/reservations", headers={**auth, "Idempotency-Key": f"k{i}"},
                        json={"lines": [{"sku": "cold", "location": "wh", "quantity": 1}]})
                    assert made.status_code == 201, made.text
        warnings = [r.getMessage() for r in caplog.records if "lifespan did not run" in
                    r.getMessage()]
        assert len(warnings) == 1 and f"'{MOUNT}'" in warnings[0], warnings
        assert "lifespan_context" in warnings[0]
    finally:
        await inventory.state.service.db.close()


async def test_mounted_without_its_lifespan_a_pool_still_opening_is_503_at_the_deadline(
) -> None:
    """The database's address takes connections and never answers them, so the pool's
    opening (on first use) goes on for its 30 s. Two requests with a 0.5 s deadline
    each wait for that one opening only until their deadline: 503 database_unavailable,
    "still opening". Before, each waited for the whole open, one after the other (two
    requests: about a minute), and the guard below fired."""
    import asyncio
    import contextlib
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel accepts; nobody ever speaks
        port = silent.getsockname()[1]
        inventory = create_app(f"postgresql://u@127.0.0.1:{port}/db?connect_timeout=20",
                               request_deadline_s=0.5)
        shop = FastAPI()
        shop.mount(MOUNT, inventory)
        transport = httpx.ASGITransport(app=shop)  # no lifespan at all
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                answers = await asyncio.wait_for(asyncio.gather(*(
                    client.get(f"{MOUNT}/v1/stock/wh/tee",
                               headers={"Authorization": "Bearer pgr_none"})
                    for _ in range(2))), 20)
            for answer in answers:
                assert answer.status_code == 503, answer.text
                assert answer.json()["code"] == "database_unavailable", answer.text
                assert "still opening" in answer.json()["detail"]
        finally:
            opening = inventory.state.opening
            if opening is not None:
                opening.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await opening


async def test_an_app_lifespan_runs_once(db: Database) -> None:
    """Entering an app's lifespan a second time (say, by both host and server) is refused."""
    app = create_app(database=db)
    async with lifespan(app):
        with pytest.raises(RuntimeError, match="already run"):
            async with app.router.lifespan_context(app):
                pass
