"""uvicorn inside pgreserve's own event loop, with pgreserve owning the signals."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator

import uvicorn

from .app import create_app


class ApiServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the caller (who sets should_exit).

    uvicorn's own handlers re-raise the signal after shutdown, which would kill
    the process before the embedded database is handed back; `pgreserve up`
    stops the API, then the workers, then the database, and exits 0.
    """

    def __init__(self, dsn: str, host: str, port: int, *, monitor: bool = False,
                 prepare_threshold: int | None = 5) -> None:
        app = create_app(dsn, monitor=monitor, prepare_threshold=prepare_threshold)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                lifespan="on", access_log=False)
        super().__init__(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def wait_started(self, stop: asyncio.Event) -> None:
        """Return once the socket is listening, startup failed, or a stop was asked for."""
        while not self.started and not stop.is_set() and not self.should_exit:
            await asyncio.sleep(0.05)
            if self.force_exit:
                break
