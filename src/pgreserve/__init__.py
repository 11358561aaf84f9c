"""pgreserve: inventory reservations inside PostgreSQL."""

from .core.service import ReservationService
from .db.database import Database, TxSettings, deadline
from .domain import (
    AllocatedLine,
    ApiKeyInfo,
    Freeze,
    Line,
    RequestRecord,
    Reservation,
    ReserveOutcome,
    Status,
    StockView,
    Strategy,
    Tenant,
)
from .errors import *  # noqa: F403  (the typed errors are part of the public API)

__version__ = "0.1.0"

__all__ = [
    "AllocatedLine",
    "ApiKeyInfo",
    "Database",
    "Freeze",
    "Line",
    "RequestRecord",
    "Reservation",
    "ReservationService",
    "ReserveOutcome",
    "Status",
    "StockView",
    "Strategy",
    "Tenant",
    "TxSettings",
    "deadline",
]
