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


def test_cursor_position_parses_and_refuses_what_no_page_hands_out() -> None:
    """An events cursor becomes its position; one past a bigint (no page hands it out),
    in another script's digits, or junk is InvalidRequest."""
    assert cursor_position(None) is None
    assert cursor_position("12-3") == (12, 3)
    assert cursor_position(f"{2**63 - 1}-1") == (2**63 - 1, 1)
    for junk in ("12", "9" * 19 + "-1", f"1-{2**63}", "\uff11-1", "12-3\n"):
        with pytest.raises(errors.InvalidRequest):
            cursor_position(junk)


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
