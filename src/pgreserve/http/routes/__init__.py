"""One APIRouter per resource, included by create_app in this order (the OpenAPI order)."""

from . import (
    availability,
    events,
    locations,
    operations,
    requests,
    reservations,
    skus,
    stock,
    webhooks,
)

ROUTERS = (stock.router, availability.router, skus.router, locations.router, reservations.router,
           requests.router, events.router, webhooks.router, operations.router)

__all__ = ["ROUTERS"]
