"""/v1/requests/{key}: what a request key was answered, for a client that lost the reply."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from starlette.convertors import Convertor, register_url_convertor
from starlette.responses import Response

from ... import errors
from ...domain import RequestRecord, Reservation, ReserveOutcome, StockView
from .. import problems
from ..dependencies import Holds, PathName, Tenant, stored_name
from ..models import RequestOut, reservation_doc, stock_doc
from ..responses import COMMON, json_response
from .reservations import change_response, reserve_response

router = APIRouter(tags=["requests"])


class RequestKeyConvertor(Convertor[str]):
    """The rest of the path, "/" and line breaks included (a key may hold both, sent
    percent-encoded, and the router sees the path decoded); never NUL."""

    regex = "[^\x00]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("request_key", RequestKeyConvertor())


@router.get("/v1/requests/{key:request_key}", response_model=RequestOut,
            responses=problems.responses(404, 409, *COMMON),
            summary="The stored answer under an Idempotency-Key, and the reservation it "
                    "names as it is now")
async def get_request(key: PathName, tenant: Tenant, holds: Holds) -> Response:
    wanted = stored_name(key, "key")
    try:
        record = await holds.lookup_request(tenant, wanted)
    except errors.RequestNotFound as missing:
        # The path is read as UTF-8, a header as ISO-8859-1 (as HTTP reads it): a key
        # sent in Idempotency-Key as UTF-8 bytes was stored as those bytes' ISO-8859-1
        # reading. Look that up too, so the key sent is the key looked up.
        sent = wanted.encode("utf-8").decode("latin-1")
        if sent == wanted:
            raise
        try:
            record = await holds.lookup_request(tenant, sent)
        except (errors.RequestNotFound, errors.InvalidRequest):
            raise missing from None
    return json_response(200, request_doc(record))


def request_doc(record: RequestRecord) -> dict[str, Any]:
    """The lookup's body: the first answer as it was sent, and the reservation now."""
    stored = record.outcome
    status, answer = _answer(record.operation, stored)
    outcome = (stored.get("status") if record.operation in ("reserve", "change")
               else "applied")
    return {
        "key": record.key,
        "operation": record.operation,
        "outcome": outcome if outcome in ("held", "rejected") else "applied",
        "recorded_at": record.recorded_at.isoformat(),
        "status": status,
        "answer": answer,
        "reservation": None if record.reservation is None
        else reservation_doc(record.reservation),
    }


def _answer(operation: str, stored: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The status and body first sent for this stored outcome (rendered the same way)."""
    if operation == "reserve":
        response = reserve_response(ReserveOutcome.from_json(stored))
        return response.status_code, json.loads(bytes(response.body))
    if operation == "change":
        response = change_response(ReserveOutcome.from_json(stored))
        return response.status_code, json.loads(bytes(response.body))
    if "stock" in stored:
        return 200, stock_doc(StockView.from_json(stored["stock"]))
    return 200, reservation_doc(Reservation.from_json(stored["reservation"]))
