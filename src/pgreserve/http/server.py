"""uvicorn on uvloop and httptools, inside pgreserve's own event loop or as N processes.

uvloop (libuv) and httptools (the llhttp C parser) instead of the stdlib loop
and the pure-Python h11: the same app answers several times as many requests
per second on the same CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine, Generator, Sequence
from typing import Any, TypeVar

import uvicorn
import uvloop
from fastapi import FastAPI
from prometheus_client.registry import Collector

from .app import create_app
from .ops_app import create_ops_app
from .requestlog import RequestLog

LOOP = "uvloop"
HTTP = "httptools"
# `pgreserve serve --workers N`: each process builds its app from the environment.
APP_FACTORY = "pgreserve.http.app:app_from_env"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the loop the server is configured for (ApiServer.serve runs in it)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class ListenerError(RuntimeError):
    """A listener could not start (its port taken, its app's startup failed)."""


# X-Forwarded-* are believed only when asked (settings: proxy_headers).
DEFAULT_SERVER_OPTIONS: dict[str, Any] = {"proxy_headers": False}


def workers_options(host: str, port: int, workers: int, *, access_log: bool = False,
                    **server_options: Any) -> dict[str, Any]:
    """uvicorn.run's arguments for `serve --workers N` (uvicorn.Config takes the same).

    uvicorn's access log stays off unless asked: the app writes its own request log.
    `log_config=None`: uvicorn's own lines go through the root logger, in the
    process's --log-format. `server_options`: uvicorn.Config's production options
    (Settings.server_options: proxy headers, root path, TLS, Unix socket, timeouts).
    """
    return {"app": APP_FACTORY, "factory": True, "host": host, "port": port,
            "workers": workers, "loop": LOOP, "http": HTTP, "log_level": "warning",
            "access_log": access_log, "log_config": None,
            **DEFAULT_SERVER_OPTIONS, **server_options}


def run_workers(host: str, port: int, workers: int, *,
                ops: tuple[str, int] | None = None, dsn: str | None = None,
                collectors: Sequence[Collector] = (),
                pgbouncer_admin_url: str | None = None,
                server_options: dict[str, Any] | None = None) -> None:
    """Serve the API from `workers` processes sharing one socket, until SIGINT or SIGTERM.

    The ops listener (when `ops` is given) runs in this, the parent, process,
    on a thread with its own loop and pool: it runs the monitors and the page's
    figures once, and /metrics reads every worker's values through
    prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR), and
    PgBouncer's pools (`pgbouncer_admin_url`) are read there, once.
    """
    ops_server: OpsServer | None = None
    thread: threading.Thread | None = None
    if ops is not None:
        assert dsn is not None
        ops_server = OpsServer(create_ops_app(dsn=dsn, collectors=collectors,
                                              pgbouncer_admin_url=pgbouncer_admin_url), *ops)
        thread = threading.Thread(target=run, args=(ops_server.serve(),),
                                  name="pgreserve-ops", daemon=True)
        thread.start()
        while not ops_server.started and thread.is_alive():
            thread.join(0.05)
        if not ops_server.started:
            raise ListenerError(f"the ops listener could not start on {ops[0]}:{ops[1]}")
    try:
        uvicorn.run(**workers_options(host, port, workers, **(server_options or {})))
    finally:
        if ops_server is not None and thread is not None:
            ops_server.should_exit = True
            thread.join(30)


class ListenerServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the caller (who sets should_exit).

    Its log lines go through the root logger (`log_config=None`), so they follow
    --log-format like the service's own.

    uvicorn's own handlers re-raise the signal after shutdown, which would kill
    the process before the embedded database is handed back; `pgreserve up`
    stops the listeners, then the workers, then the database, and exits 0.
    `serve()` runs in the caller's loop: start it with `run()` to have uvloop there too.
    """

    def __init__(self, app: FastAPI, host: str, port: int, **server_options: Any) -> None:
        """`server_options`: more of uvicorn.Config's (see workers_options)."""
        self.app = app
        config = uvicorn.Config(app, host=host, port=port, loop=LOOP, http=HTTP,
                                log_level="warning", lifespan="on", access_log=False,
                                log_config=None, **{**DEFAULT_SERVER_OPTIONS, **server_options})
        super().__init__(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn exits the process when the port is taken or the app's startup
        # fails (after shutting the app down): here the caller is told through
        # `started` staying False, and the other listener stops cleanly.
        try:
            await super().startup(sockets)
        except SystemExit:
            self.should_exit = True

    async def wait_started(self, stop: asyncio.Event) -> None:
        """Return once the socket is listening, startup failed, or a stop was asked for."""
        while not self.started and not stop.is_set() and not self.should_exit:
            await asyncio.sleep(0.05)
            if self.force_exit:
                break


class ApiServer(ListenerServer):
    """The tenant API on uvicorn (see ListenerServer)."""

    def __init__(self, dsn: str, host: str, port: int, *, monitor: bool = False,
                 prepare_threshold: int | None = 5,
                 request_log: RequestLog | None = None,
                 server_options: dict[str, Any] | None = None, **app_options: Any) -> None:
        """`app_options`: more of create_app's options (deadline, tenant limit, ...);
        `server_options`: uvicorn's (see workers_options)."""
        super().__init__(create_app(dsn, monitor=monitor, prepare_threshold=prepare_threshold,
                                    request_log=request_log, **app_options), host, port,
                         **(server_options or {}))


class OpsServer(ListenerServer):
    """The ops listener on uvicorn: /metrics, /ops and the operator routes."""


class Listeners:
    """The tenant API and, unless `ops` is None, the ops listener beside it in one loop.

    The ops app shares the API app's state (its pool, metrics and monitors);
    it starts once the API has opened its pool and stops before it closes it.
    `collectors` are added to the ops listener's /metrics (PgBouncer's pools, say).
    """

    def __init__(self, dsn: str, api: tuple[str, int], ops: tuple[str, int] | None, *,
                 prepare_threshold: int | None = 5, request_log: RequestLog | None = None,
                 monitor: bool = True, collectors: Sequence[Collector] = (),
                 api_options: dict[str, Any] | None = None,
                 server_options: dict[str, Any] | None = None) -> None:
        """`server_options` (uvicorn's production options) apply to the API listener only:
        the ops listener stays a plain HTTP one on its loopback address."""
        self.api = ApiServer(dsn, *api, prepare_threshold=prepare_threshold,
                             request_log=request_log, server_options=server_options,
                             **(api_options or {}))
        self.ops = None if ops is None else OpsServer(
            create_ops_app(state=self.api.app.state, monitor=monitor, collectors=collectors),
            *ops)
        self.should_exit = False

    @property
    def started(self) -> bool:
        return self.api.started and (self.ops is None or self.ops.started)

    async def serve(self, stop: asyncio.Event | None = None,
                    started: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set, `should_exit` is set or a server ends."""
        stop = stop or asyncio.Event()
        servers: list[ListenerServer] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            listeners: list[ListenerServer] = [self.api] if self.ops is None else [self.api,
                                                                                    self.ops]
            for server in listeners:
                servers.append(server)
                tasks.append(asyncio.create_task(server.serve()))
                await server.wait_started(stop)
                if not server.started:
                    return
            if started is not None:
                started.set()
            while not (stop.is_set() or self.should_exit or any(t.done() for t in tasks)):
                await asyncio.wait([*tasks], timeout=0.1)
        finally:
            for listener, task in reversed(list(zip(servers, tasks, strict=True))):
                listener.should_exit = True
                await asyncio.gather(task, return_exceptions=True)
