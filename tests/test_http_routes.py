"""Route modules and their handlers work on their own, outside create_app."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from pgreserve import errors
from pgreserve.core.service import ReservationService
from pgreserve.db.database import Database
from pgreserve.http.metrics import ApiMetrics
from pgreserve.http.routes import operations
from pgreserve.http.routes.events import cursor_position


def test_cursor_position_parses_and_clamps() -> None:
    """An events cursor becomes its position, clamped to bigint; junk is InvalidRequest."""
    assert cursor_position(None) is None
    assert cursor_position("12-3") == (12, 3)
    assert cursor_position("9" * 19 + "-1") == (2**63 - 1, 1)
    with pytest.raises(errors.InvalidRequest):
        cursor_position("12")


async def test_operations_router_serves_healthz_alone(db: Database) -> None:
    """The operations router in a bare FastAPI app answers /healthz through the app's service."""
    app = FastAPI()
    app.include_router(operations.router)
    app.state.service = ReservationService(db)
    app.state.metrics = ApiMetrics()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
