"""The server stack: uvicorn on uvloop and httptools for `up`, `serve`, `serve --workers N`."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pgreserve.http import server
from pgreserve.http.server import ApiServer
from test_cli_up import free_port


def test_api_server_selects_uvloop_and_httptools() -> None:
    """The in-process server (`up`, `serve`) is configured for the uvloop loop and httptools."""
    api = ApiServer("postgresql:///unused", "127.0.0.1", free_port())
    api.config.load()
    assert (api.config.loop, api.config.http) == ("uvloop", "httptools")
    assert api.config.http_protocol_class is HttpToolsProtocol
    assert api.config.get_loop_factory() is uvloop.new_event_loop


def test_serve_workers_selects_uvloop_and_httptools(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --workers N` hands uvicorn the app factory with uvloop, httptools and N processes."""
    monkeypatch.setenv("PGRESERVE_DATABASE_URL", "postgresql:///unused")
    monkeypatch.setenv("PGRESERVE_GC_THRESHOLD", "off")  # load() runs the factory here
    config = uvicorn.Config(**server.workers_options("127.0.0.1", free_port(), 2))
    config.load()
    assert (config.loop, config.http, config.workers) == ("uvloop", "httptools", 2)
    assert config.http_protocol_class is HttpToolsProtocol
    assert config.get_loop_factory() is uvloop.new_event_loop


def test_run_starts_a_uvloop_loop() -> None:
    """server.run, which `up` and `serve` use, runs its coroutine on a uvloop loop."""
    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    assert server.run(loop_type()) is uvloop.Loop


def test_api_server_answers_on_uvloop(dsn: str) -> None:
    """ApiServer started with server.run on a loopback port answers /healthz from a uvloop loop."""
    api = ApiServer(dsn, "127.0.0.1", free_port())
    loops: list[type] = []

    async def serve() -> None:
        loops.append(type(asyncio.get_running_loop()))
        await api.serve()

    thread = threading.Thread(target=server.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        while not api.started:
            assert thread.is_alive(), "the server did not start"
            thread.join(0.02)
        response = httpx.get(f"http://127.0.0.1:{api.config.port}/healthz", timeout=30)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        assert loops == [uvloop.Loop]
    finally:
        api.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
