"""A bare FastAPI endpoint: what `bench http` measures the service against.

`POST /v1/reservations` takes the service's request (the same headers and JSON
body, parsed into the same shape by pydantic) and answers 201 with a small JSON
document, without a database. Served by uvicorn with the service's own settings
(`serve --workers N`: uvloop, httptools, N processes), it is the ceiling of the
HTTP stack on this machine.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Header
from pydantic import BaseModel

from ..http.gc_tuning import tune_gc


class Line(BaseModel):
    sku: str
    location: str
    quantity: int


class ReserveBody(BaseModel):
    lines: list[Line]
    ttl_seconds: int = 900


def create_app() -> FastAPI:
    """Factory for uvicorn (`factory=True`, as `serve --workers N` runs the service),
    with the garbage collector set up as the service's workers set theirs."""
    app = FastAPI(title="bare")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/reservations", status_code=201)
    async def reserve(body: ReserveBody,
                      idempotency_key: str = Header()) -> dict[str, object]:
        return {"id": str(uuid.uuid4()), "status": "held", "request_key": idempotency_key,
                "lines": [line.model_dump() for line in body.lines]}

    tune_gc()
    return app
