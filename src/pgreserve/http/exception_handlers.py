"""How every failure leaves the API: as a problem document (problems.STATUS, one table)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from .. import errors
from . import problems
from .dependencies import metrics
from .problems import PROBLEM_MEDIA_TYPE
from .routes import ROUTERS

log = logging.getLogger(__name__)


async def on_error(request: Request, exc: errors.PgReserveError) -> Response:
    """A typed error: its status and code from problems.STATUS."""
    return problems.error_response(exc)


async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
    """FastAPI's validation errors: 422 invalid_request listing (up to 20 of) them."""
    found = []
    for e in exc.errors()[:20]:
        loc = [x if isinstance(x, int) else str(x) for x in e.get("loc", ())]
        found.append({"loc": loc, "msg": str(e.get("msg", "")),
                      "type": str(e.get("type", ""))})
    first = found[0] if found else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(x) for x in first["loc"])
    detail = f"{where}: {first['msg']}" if where else str(first["msg"])
    return problems.problem_response(errors.InvalidRequest(detail), errors=found)


async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing answers (404, 405 with every allowed method) and unparsable bodies."""
    if exc.status_code == 405:
        # Starlette names only the first matching route's methods; name them all.
        # The routers' own routes: FastAPI >= 0.150 keeps included routers whole
        # in app.routes instead of copying their routes there.
        allowed: set[str] = set()
        for router in ROUTERS:
            for route in router.routes:
                if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE:
                    allowed |= route.methods or set()
        return problems.problem_response(problems.MethodNotAllowed("method not allowed"),
                                         headers={"Allow": ", ".join(sorted(allowed))})
    if exc.status_code == 404:
        return problems.problem_response(problems.NotFound("no such endpoint"))
    if exc.status_code == 400:  # FastAPI could not parse the body
        return problems.problem_response(errors.InvalidRequest(str(exc.detail)))
    doc = {"type": "about:blank", "title": str(exc.detail), "status": exc.status_code,
           "detail": str(exc.detail), "code": "http_error"}
    return Response(problems.render(doc), status_code=exc.status_code,
                    media_type=PROBLEM_MEDIA_TYPE)


async def on_crash(request: Request, exc: Exception) -> Response:
    """Anything else: logged, listed on /ops, answered 500 without its details."""
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    metrics(request).error(f"{request.method} {request.url.path}: {type(exc).__name__}")
    return problems.problem_response(problems.InternalError("internal error"))


Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]

EXCEPTION_HANDLERS: dict[int | type[Exception], Handler] = {
    errors.PgReserveError: on_error,
    RequestValidationError: on_invalid,
    StarletteHTTPException: on_http,
    Exception: on_crash,
}
