"""/v1/events: the tenant's outbox feed, paged by cursor."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ... import errors
from .. import problems
from ..dependencies import Service, Tenant, single_query_values
from ..models import EventsOut
from ..responses import COMMON, json_response

router = APIRouter(tags=["events"])

CURSOR = re.compile(r"^(\d{1,19})-(\d{1,19})$")


def cursor_position(after: str | None) -> tuple[int, int] | None:
    """The (commit, event) position of an `after` cursor; None for the start."""
    if not after:
        return None
    match = CURSOR.match(after)
    if not match:
        raise errors.InvalidRequest("after must be a cursor returned by this endpoint",
                                    field="after")
    # Positions beyond every bigint are past every event: clamp, answer empty.
    return (min(int(match[1]), 2**63 - 1), min(int(match[2]), 2**63 - 1))


@router.get("/v1/events", response_model=EventsOut, responses=problems.responses(*COMMON),
            summary="This tenant's events in commit order, after a cursor")
async def events(tenant: Tenant, svc: Service, request: Request,
                 after: Annotated[str | None, Query(
                     max_length=39, pattern=CURSOR.pattern,
                     description="next_cursor of the previous page")] = None,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Response:
    single_query_values(request, "after", "limit")
    page = await svc.events(tenant, cursor_position(after), limit)
    return json_response(200, {
        "events": [{"id": e.event_id, "type": e.type, "created_at": e.created_at.isoformat(),
                    "data": e.payload} for e in page.events],
        "next_cursor": f"{page.cursor[0]}-{page.cursor[1]}",
    })
