"""The OpenAPI document: FastAPI's, plus the Problem schema, key rules and links."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from .dependencies import BEARER_DESCRIPTION, BEARER_SCHEME, tenant_id
from .problems import Problem

# Idempotency-Key is declared optional so that its absence reaches the handler
# (400 idempotency_key_missing, not a generic 422); the document says where it
# is required.
# A bare key (1 to 200 characters, not starting with a quote) or an RFC 8941
# string of 1 to 200 characters (each printable ASCII or an escaped " or \).
KEY_PATTERN = (r'^(?:[^"\s](?:.{0,198}\S)?'
               r'|"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\]){1,200}")$')
# If-Match: * or a list of entity tags; If-None-Match on a write: only *. Documented, not
# enforced by FastAPI, so a malformed header is 400 precondition_invalid (http/conditional.py).
PRECONDITION_PATTERNS = {
    "If-Match": r'^(\*|(W/)?"[!#-~]*"(, ?(W/)?"[!#-~]*")*)$',
    "If-None-Match": r"^\*$",
}
KEYED_REQUIRED = {("post", "/v1/reservations"),
                  ("put", "/v1/reservations/{reservation_id}/lines"),
                  ("post", "/v1/stock/{location}/{sku}/adjustments")}


# Stable operation ids (what generated clients name their methods), by handler; a
# handler not listed gets its name in camelCase.
OPERATION_IDS = {
    "put_stock": "setStock",
    "get_stock": "getStock",
    "adjust_stock": "adjustStock",
    "list_stock": "listStock",
    "reserve": "createReservation",
    "get_reservation": "getReservation",
    "list_reservations": "listReservations",
    "claim": "claimReservation",
    "release": "releaseReservation",
    "extend": "extendReservation",
    "change_lines": "changeReservation",
    "events": "listEvents",
    "list_webhooks": "listWebhooks",
    "add_webhook": "createWebhook",
    "delete_webhook": "deleteWebhook",
    "healthz": "getHealth",
}


def operation_id(route: APIRoute) -> str:
    """FastAPI's generate_unique_id_function: the route's stable operation id."""
    if route.name in OPERATION_IDS:
        return OPERATION_IDS[route.name]
    head, *rest = route.name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's document, built once and cached on the app."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                         routes=app.routes)
    problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(problem.pop("$defs", {}))
    components["Problem"] = problem
    schema["components"]["securitySchemes"] = {
        BEARER_SCHEME: {"type": "http", "description": BEARER_DESCRIPTION, "scheme": "bearer"}}
    authenticated = {(method.lower(), route.path) for route in _api_routes(app.routes)
                     if _needs_tenant(route.dependant) for method in route.methods or ()}
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            if (method, path) in authenticated:
                op["security"] = [{BEARER_SCHEME: []}]
            for param in op.get("parameters", []):
                if param["name"] == "Idempotency-Key":
                    param["schema"] = {"type": "string", "minLength": 1, "maxLength": 402,
                                       "pattern": KEY_PATTERN}
                    param["required"] = (method, path) in KEYED_REQUIRED
                elif param["name"] in PRECONDITION_PATTERNS:
                    param["schema"] = {"type": "string", "minLength": 1,
                                       "pattern": PRECONDITION_PATTERNS[param["name"]]}
    # Links: what a client (and a stateful test) can do with a reservation it
    # has just created.
    created = schema["paths"]["/v1/reservations"]["post"]["responses"]["201"]
    by_id = {"reservation_id": "$response.body#/id"}
    created["links"] = {
        name: {"operationId": schema["paths"][target][verb]["operationId"],
               "parameters": by_id}
        for name, target, verb in (
            ("GetReservation", "/v1/reservations/{reservation_id}", "get"),
            ("ClaimReservation", "/v1/reservations/{reservation_id}/claim", "post"),
            ("ReleaseReservation", "/v1/reservations/{reservation_id}/release", "post"),
            ("ExtendReservation", "/v1/reservations/{reservation_id}/extend", "post"),
            ("ChangeReservation", "/v1/reservations/{reservation_id}/lines", "put"),
        )
    }
    app.openapi_schema = schema
    return schema


def _needs_tenant(dependant: Dependant) -> bool:
    return dependant.call is tenant_id or any(_needs_tenant(d) for d in dependant.dependencies)


def _api_routes(routes: Iterable[Any]) -> Iterator[APIRoute]:
    """The app's APIRoutes, inside included routers too."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif (router := getattr(route, "original_router", None)) is not None:
            yield from _api_routes(router.routes)
