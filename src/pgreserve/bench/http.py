"""The HTTP target of the bench: buyers that reserve, claim and release through the API.

One aiohttp session carries every buyer's requests. The service is either one the
bench starts itself (uvicorn in this process, on a free 127.0.0.1 port, over the
same database) or a running one named by --url and --api-key.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Generator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aiohttp

from ..errors import Busy, PgReserveError

REPLAYED_HEADER = "Idempotent-Replayed"


class HttpError(PgReserveError):
    """The API answered with an unexpected status (the problem's code is in the message)."""

    code = "http_error"


class HttpTransportError(PgReserveError):
    """The request did not get an answer (connection refused or reset, timeout)."""

    code = "http_transport_error"


@dataclass(frozen=True)
class HttpTarget:
    """Where the API is: None = start one in this process."""

    url: str | None = None
    api_key: str | None = None


@dataclass(frozen=True)
class HeldReservation:
    id: str


@dataclass(frozen=True)
class HttpOutcome:
    held: bool
    replayed: bool
    reservation: HeldReservation | None


class HttpBuyer:
    """The three calls the bench makes, sent to the API with one tenant's key."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str) -> None:
        self.session = session
        self.base = base_url.rstrip("/")
        self.auth = {"Authorization": f"Bearer {api_key}"}

    async def reserve(self, tenant: int, request_key: str, lines: Iterable[Any], *,
                      ttl: timedelta) -> HttpOutcome:
        body = {"lines": [{"sku": s, "location": loc, "quantity": q} for s, loc, q in lines],
                "ttl_seconds": max(1, round(ttl.total_seconds()))}
        status, doc, replayed = await self._post("/v1/reservations", body,
                                                 {"Idempotency-Key": request_key})
        if status == 201:
            return HttpOutcome(True, replayed, HeldReservation(str(doc["id"])))
        if status == 409 and doc.get("code") == "insufficient_stock":
            return HttpOutcome(False, replayed, None)
        raise _error(status, doc)

    async def claim(self, tenant: int, reservation_id: str) -> None:
        await self._transition(reservation_id, "claim")

    async def release(self, tenant: int, reservation_id: str) -> None:
        await self._transition(reservation_id, "release")

    async def _transition(self, reservation_id: str, operation: str) -> None:
        status, doc, _ = await self._post(f"/v1/reservations/{reservation_id}/{operation}",
                                          None, {})
        if status != 200:
            raise _error(status, doc)

    async def _post(self, path: str, body: Any,
                    headers: dict[str, str]) -> tuple[int, dict[str, Any], bool]:
        try:
            async with self.session.post(self.base + path, json=body,
                                         headers={**self.auth, **headers}) as response:
                doc = await response.json(content_type=None)
                return (response.status, doc if isinstance(doc, dict) else {},
                        response.headers.get(REPLAYED_HEADER) == "true")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise HttpTransportError(f"{type(exc).__name__}: {exc}") from None


def _error(status: int, doc: dict[str, Any]) -> PgReserveError:
    message = f"HTTP {status} {doc.get('code', '')}: {doc.get('detail', '')}"
    return Busy(message) if status == 503 else HttpError(message)


@asynccontextmanager
async def client_session(buyers: int) -> AsyncIterator[aiohttp.ClientSession]:
    """One session for all buyers, with a connection per buyer."""
    connector = aiohttp.TCPConnector(limit=buyers, limit_per_host=buyers)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """Leaves SIGINT/SIGTERM alone: Ctrl-C stops the bench, not just its server."""

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return Server


@asynccontextmanager
async def local_service(dsn: str, pool_size: int,
                        application_name: str = "pgreserve:http") -> AsyncIterator[str]:
    """The API on a free 127.0.0.1 port in this event loop; yields its base URL."""
    async with local_app(dsn, pool_size, application_name) as (url, _app):
        yield url


@asynccontextmanager
async def local_app(dsn: str, pool_size: int, application_name: str = "pgreserve:http", *,
                    batching: bool = True) -> AsyncIterator[tuple[str, Any]]:
    """local_service, yielding (base URL, the FastAPI app) so that the caller can read the
    app's ReservationService (`app.state.service`, its combiner's stats) afterwards."""
    import uvicorn

    from ..http.app import create_app

    _Server = _server_class()
    port = free_port()
    app = create_app(dsn, pool_size=pool_size, application_name=application_name,
                     pool_min_size=pool_size)  # opened up front, as the library buyers' pool
    # create_app has no batching parameter: its lifespan builds the service from
    # these options (ReservationService(database, **service_options)).
    app.state.service_options["batching"] = batching
    config = uvicorn.Config(app, host="127.0.0.1",
                            port=port, log_level="warning", lifespan="on", access_log=False)
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                await task
                raise RuntimeError(f"the bench's HTTP server did not start on port {port}")
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task
