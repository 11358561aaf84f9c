"""Schemathesis against /openapi.json: no 500s, every response matches the documented schema."""

from __future__ import annotations

import asyncio
import copy
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from pgreserve import apikeys, validation, webhook_targets
from pgreserve.errors import InvalidRequest, WebhookUrlRefused
from pgreserve.http import create_app
from pgreserve.http.server import ApiServer
from test_cli_up import free_port


class Served:
    """The real app on uvicorn in a background thread with its own event loop."""

    def __init__(self, dsn: str, prepare_threshold: int | None = 5) -> None:
        self.port = free_port()
        self.server = ApiServer(dsn, "127.0.0.1", self.port, prepare_threshold=prepare_threshold)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()),
                                       daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server did not start")
            self.thread.join(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def served(dsn: str, api_dsn: tuple[str, int | None]) -> Iterator[tuple[Any, dict[str, str]]]:
    """A running server (direct or through PgBouncer) on a fresh database with one tenant
    holding some stock."""
    key = apikeys.new_key()
    with psycopg.connect(dsn, autocommit=True) as conn:
        tenant = conn.execute("SELECT tenant_create_v1('acme', %s)",
                              (apikeys.hash_key(key),)).fetchone()[0]  # type: ignore[index]  # the query always returns one row
        conn.execute("SELECT stock_set_v1(%s, 'sku-1', 'wh', 100, NULL, false, NULL, NULL)",
                     (tenant,))
    with Served(*api_dsn) as srv:
        base_url = f"http://127.0.0.1:{srv.port}"
        served_schema = httpx.get(f"{base_url}/openapi.json").json()
        assert served_schema == OPENAPI, "the served schema is the one tested"
        yield base_url, {"Authorization": f"Bearer {key}"}


# The schema is the app's own, built without a database; the test checks the
# server serves exactly this document.
OPENAPI = create_app("postgresql:///unused").openapi()
# schemathesis resolves references in the dict it is given: hand it a copy.
schema = schemathesis.openapi.from_dict(copy.deepcopy(OPENAPI))


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case: schemathesis.Case[Any],
                                    served: tuple[Any, dict[str, str]]) -> None:
    """Generated requests never get a 5xx and every response matches /openapi.json."""
    excluded = []
    if duplicate_lines(case.body):
        # Two lines for the same stock are schema-valid JSON but rejected by
        # design (422, documented on ReserveIn): not a schema violation.
        excluded.append(schemathesis.checks.positive_data_acceptance)
    if refused_webhook(case.body):
        # A URL on a loopback or private address matches the URL pattern but is
        # refused by policy (422 webhook_url_refused, documented on the route).
        excluded.append(schemathesis.checks.positive_data_acceptance)
    if conditional(case):
        # A schema-valid If-Match / If-None-Match that the line does not satisfy is 412, and
        # a schema-valid cursor that the listing did not hand out is 400 invalid_cursor:
        # refused by the state they name, not by the schema.
        excluded.append(schemathesis.checks.positive_data_acceptance)
    case.call_and_validate(base_url=served[0], headers=served[1], excluded_checks=excluded)


def conditional(case: schemathesis.Case[Any]) -> bool:
    """True when the request carries a precondition header or a page cursor of GET /v1/stock
    or GET /v1/reservations."""
    headers = {k.lower() for k in (case.headers or {})}
    return bool(headers & {"if-match", "if-none-match"}) or (
        case.path in ("/v1/stock", "/v1/reservations") and "cursor" in (case.query or {}))


def refused_webhook(body: Any) -> bool:
    """True when `body` registers a webhook URL the address policy refuses."""
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        return False
    try:
        validation.webhook_url(body["url"])
        asyncio.run(webhook_targets.check_url(body["url"], allow_private=False))
    except WebhookUrlRefused:
        return True
    except InvalidRequest:
        return False
    return False


def duplicate_lines(body: Any) -> bool:
    """True when the cart is refused by design though schema-valid (422, documented on
    ReserveIn and ReserveLineIn): two lines for one stock line (or two without a location for
    one SKU), split on a line that names a location, or a SKU's line without a location
    that could join one naming a location beyond 1,000,000 units."""
    if not isinstance(body, dict) or not isinstance(body.get("lines"), list):
        return False
    lines = [x for x in body["lines"] if isinstance(x, dict)]
    pairs = [repr((x.get("sku"), x.get("location"))) for x in lines]
    if len(set(pairs)) < len(pairs):
        return True
    if any(x.get("split") is True and x.get("location") is not None for x in lines):
        return True
    def units(x: dict[str, Any]) -> float:
        q = x.get("quantity")
        return q if isinstance(q, (int, float)) and not isinstance(q, bool) else 0

    allocated = {repr(x.get("sku")): units(x) for x in lines if x.get("location") is None}
    return any(x.get("location") is not None and repr(x.get("sku")) in allocated
               and units(x) + allocated[repr(x.get("sku"))] > 1_000_000 for x in lines)


def test_stateful_links_create_then_claim_release_get(
        served: tuple[Any, dict[str, str]]) -> None:
    """Chains along the schema's links (create -> get/claim/release/extend/change) never get a 5xx and match the schema."""
    base_url, headers = served

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]  # schemathesis builds the base class at run time
        def get_call_kwargs(self, case: schemathesis.Case[Any]) -> dict[str, Any]:
            return {"base_url": base_url, "headers": headers}

        def validate_response(self, response: Any, case: schemathesis.Case[Any],
                              additional_checks: Any = None, **kwargs: Any) -> None:
            excluded = []
            if duplicate_lines(case.body) or conditional(case):
                excluded.append(schemathesis.checks.positive_data_acceptance)
            case.validate_response(response, additional_checks=additional_checks,
                                   excluded_checks=excluded)

    links = set(OPENAPI["paths"]["/v1/reservations"]["post"]["responses"]["201"]["links"])
    assert links == {"GetReservation", "ClaimReservation", "ReleaseReservation",
                     "ExtendReservation", "ChangeReservation"}
    Workflow.run(settings=settings(max_examples=12, stateful_step_count=6, deadline=None,
                                   derandomize=True, suppress_health_check=list(HealthCheck)))


def test_operation_ids_are_stable_camel_case_names() -> None:
    """Every operation has a unique camelCase id, and the existing ones keep their names
    (no path-derived ids such as put_stock_v1_stock__location___sku__put)."""
    ids = {(method, path): op["operationId"] for path, ops in OPENAPI["paths"].items()
           for method, op in ops.items()}
    assert len(set(ids.values())) == len(ids)
    assert all(re.fullmatch(r"[a-z][A-Za-z0-9]*", i) for i in ids.values()), ids
    assert {
        ("put", "/v1/stock/{location}/{sku}"): "setStock",
        ("get", "/v1/stock/{location}/{sku}"): "getStock",
        ("post", "/v1/stock/{location}/{sku}/adjustments"): "adjustStock",
        ("get", "/v1/stock"): "listStock",
        ("post", "/v1/reservations"): "createReservation",
        ("get", "/v1/reservations/{reservation_id}"): "getReservation",
        ("post", "/v1/reservations/{reservation_id}/claim"): "claimReservation",
        ("post", "/v1/reservations/{reservation_id}/release"): "releaseReservation",
        ("post", "/v1/reservations/{reservation_id}/extend"): "extendReservation",
        ("put", "/v1/reservations/{reservation_id}/lines"): "changeReservation",
        ("get", "/v1/events"): "listEvents",
        ("get", "/v1/webhooks"): "listWebhooks",
        ("post", "/v1/webhooks"): "createWebhook",
        ("delete", "/v1/webhooks/{webhook_id}"): "deleteWebhook",
        ("get", "/healthz"): "getHealth",
    }.items() <= ids.items()
