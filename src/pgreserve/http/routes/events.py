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

# ASCII digits only (\d would take any script's digits, which the published pattern,
# read by JSON Schema clients, does not)
CURSOR = re.compile(r"^([0-9]{1,19})-([0-9]{1,19})$")
BIGINT = 2**63 - 1


def cursor_position(after: str | None) -> tuple[int, int] | None:
    """The (commit, event) position of an `after` cursor; None for the start."""
    if not after:
        return None
    match = CURSOR.fullmatch(after)
    # (no cursor this endpoint returns is past a bigint)
    if not match or int(match[1]) > BIGINT or int(match[2]) > BIGINT:
        raise errors.InvalidRequest("after must be a cursor returned by this endpoint",
                                    field="after")
    return int(match[1]), int(match[2])


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
