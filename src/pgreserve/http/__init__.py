"""The HTTP API: a thin FastAPI layer over ReservationService (see docs/api.md)."""

from .app import create_app, lifespan

__all__ = ["create_app", "lifespan"]
