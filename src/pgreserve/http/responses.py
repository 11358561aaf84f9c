"""How a handler's answer is encoded (problems.render, so a replay is byte-for-byte)."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from . import problems

REPLAYED_HEADER = "Idempotent-Replayed"
# Every authenticated route can answer these.
COMMON = (401, 422, 429, 503)


def json_response(status: int, doc: dict[str, Any], replayed: bool = False,
                  headers: dict[str, str] | None = None) -> Response:
    out = {**(headers or {}), **({REPLAYED_HEADER: "true"} if replayed else {})}
    return Response(problems.render(doc), status_code=status, headers=out or None,
                    media_type="application/json")
