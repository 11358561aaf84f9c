"""The API's documentation pages, served with their scripts from the installed packages.

FastAPI's own /docs and /redoc load Swagger UI and ReDoc from a CDN, so they are blank
on a network without one. Here the pages load them from /docs/assets/, the files of
the `fastapi-offline` package (swagger-ui-dist 5, Apache-2.0; Redoc 2, MIT), and every
URL in a page starts from the app's root path, so the pages also work where the app is
mounted inside another (`/inventory/docs`).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS = "/docs/assets"
ASSET_PACKAGE = ("fastapi_offline", "static")
# No request to the public validator service: a page that checks its spec there has
# its badge fetched from another host.
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}
# ReDoc's menu shows its maker's logo from their CDN (hidden when it fails to load): the
# browser is told to load images from this app only.
REDOC_CSP = "img-src 'self' data:"


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def add_routes(app: FastAPI, *, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve Swagger UI at `docs_url` and ReDoc at `redoc_url` (outside the OpenAPI
    document), and their assets under /docs/assets."""
    app.mount(ASSETS, StaticFiles(packages=[ASSET_PACKAGE]), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or f"{docs_url}/oauth2-redirect"

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_swagger_ui_html(
            openapi_url=root + openapi_url, title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=root + redirect_url,
            swagger_ui_parameters=SWAGGER_UI_PARAMETERS)

    async def swagger_ui_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = _root(request)
        page = get_redoc_html(
            openapi_url=root + openapi_url, title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png", with_google_fonts=False)
        page.headers["Content-Security-Policy"] = REDOC_CSP
        return page

    app.add_route(docs_url, swagger_ui, include_in_schema=False)
    app.add_route(redirect_url, swagger_ui_redirect, include_in_schema=False)
    app.add_route(redoc_url, redoc, include_in_schema=False)
