"""uvicorn on uvloop and httptools, inside pgreserve's own event loop or as N processes.

uvloop (libuv) and httptools (the llhttp C parser) instead of the stdlib loop
and the pure-Python h11: the same app answers several times as many requests
per second on the same CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

import uvicorn
import uvloop

from .app import create_app

LOOP = "uvloop"
HTTP = "httptools"
# `pgreserve serve --workers N`: each process builds its app from the environment.
APP_FACTORY = "pgreserve.http.app:app_from_env"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the loop the server is configured for (ApiServer.serve runs in it)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def workers_options(host: str, port: int, workers: int) -> dict[str, Any]:
    """uvicorn.run's arguments for `serve --workers N` (uvicorn.Config takes the same)."""
    return {"app": APP_FACTORY, "factory": True, "host": host, "port": port,
            "workers": workers, "loop": LOOP, "http": HTTP, "log_level": "warning"}


def run_workers(host: str, port: int, workers: int) -> None:
    """Serve the API from `workers` processes sharing one socket, until SIGINT or SIGTERM."""
    uvicorn.run(**workers_options(host, port, workers))


class ApiServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the caller (who sets should_exit).

    uvicorn's own handlers re-raise the signal after shutdown, which would kill
    the process before the embedded database is handed back; `pgreserve up`
    stops the API, then the workers, then the database, and exits 0. `serve()`
    runs in the caller's loop: start it with `run()` to have uvloop there too.
    """

    def __init__(self, dsn: str, host: str, port: int, *, monitor: bool = False,
                 prepare_threshold: int | None = 5, **app_options: Any) -> None:
        """`app_options`: more of create_app's options (deadline, tenant limit, ...)."""
        app = create_app(dsn, monitor=monitor, prepare_threshold=prepare_threshold,
                         **app_options)
        config = uvicorn.Config(app, host=host, port=port, loop=LOOP, http=HTTP,
                                log_level="warning", lifespan="on", access_log=False)
        super().__init__(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's serve, except that a failed startup (a port in use) returns with
        `started` False instead of raising SystemExit out of the caller's task."""
        try:
            await super().serve(sockets)
        except SystemExit:
            self.should_exit = True

    async def wait_started(self, stop: asyncio.Event) -> None:
        """Return once the socket is listening, startup failed, or a stop was asked for."""
        while not self.started and not stop.is_set() and not self.should_exit:
            await asyncio.sleep(0.05)
            if self.force_exit:
                break
