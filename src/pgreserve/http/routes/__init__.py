"""One APIRouter per resource, included by create_app in this order (the OpenAPI order)."""

from . import events, operations, reservations, stock, webhooks

ROUTERS = (stock.router, reservations.router, events.router, webhooks.router,
           operations.router)

__all__ = ["ROUTERS"]
