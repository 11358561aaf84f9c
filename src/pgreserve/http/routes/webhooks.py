"""/v1/webhooks: register, list and remove a tenant's endpoints."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from .. import conditional, problems
from ..dependencies import Service, Tenant
from ..models import WebhookCreated, WebhookIn, WebhooksOut, webhook_doc
from ..responses import COMMON, json_response

router = APIRouter(tags=["webhooks"])


@router.post("/v1/webhooks", status_code=201, response_model=WebhookCreated,
             responses={201: {"headers": {"Location": {
                            "description": "The endpoint's URL (under the root path)",
                            "schema": {"type": "string"}}}},
                        **problems.responses(413, *COMMON)},
             summary="Register a URL for this tenant's events (the secret is shown only now)")
async def add_webhook(body: WebhookIn, tenant: Tenant, svc: Service,
                      request: Request) -> Response:
    created = await svc.add_webhook(tenant, body.url)
    return json_response(201, webhook_doc(created), headers={
        "Location": conditional.location_of(request, "v1", "webhooks", str(created.id))})


@router.get("/v1/webhooks", response_model=WebhooksOut, responses=problems.responses(*COMMON),
            summary="This tenant's webhook endpoints and their delivery state")
async def list_webhooks(tenant: Tenant, svc: Service) -> Response:
    found = await svc.webhooks(tenant)
    return json_response(200, {"webhooks": [webhook_doc(w) for w in found]})


@router.delete("/v1/webhooks/{webhook_id}", status_code=204, response_class=Response,
               responses=problems.responses(404, *COMMON),
               summary="Remove an endpoint; nothing more is sent to it")
async def delete_webhook(webhook_id: Annotated[int, Path(ge=1)], tenant: Tenant,
                         svc: Service) -> Response:
    await svc.delete_webhook(tenant, webhook_id)
    return Response(status_code=204)
