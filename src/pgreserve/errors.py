"""Typed errors. Every failure a caller can act on has its own class and a stable code."""

from __future__ import annotations

from typing import Any


class PgReserveError(Exception):
    """Base class of every error pgreserve raises on purpose."""

    code = "error"
    retryable = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(PgReserveError, ValueError):
    """The input is malformed; nothing was written."""

    code = "invalid_request"


class UnknownTenant(PgReserveError):
    code = "unknown_tenant"


class UnknownStock(PgReserveError):
    """A line names a (sku, location) bucket this tenant does not have."""

    code = "unknown_stock"


class ReservationNotFound(PgReserveError):
    """No such reservation for this tenant (also said for another tenant's reservation)."""

    code = "reservation_not_found"


class IdempotencyKeyReused(PgReserveError):
    """The request key was used before with different parameters; the original is untouched."""

    code = "idempotency_key_reused"


class WouldOversell(PgReserveError):
    """A correction would leave fewer units than are held; pass force=True to record a shortfall."""

    code = "would_oversell"


class WebhookNotFound(PgReserveError):
    """No such webhook endpoint for this tenant."""

    code = "webhook_not_found"


class ReservationReleased(PgReserveError):
    code = "reservation_released"


class ReservationClaimed(PgReserveError):
    code = "reservation_claimed"


class ReservationExpired(PgReserveError):
    """An expired reservation whose stock can no longer be taken again."""

    code = "reservation_expired"


class ReservationNotActive(PgReserveError):
    code = "reservation_not_active"


class Busy(PgReserveError):
    """A lock or statement timeout fired, or retries ran out: safe to retry later."""

    code = "busy"
    retryable = True


class OutcomeUnknown(PgReserveError):
    """The connection died around COMMIT; retry with the same request key to learn the outcome."""

    code = "outcome_unknown"
    retryable = True


class NoDatabase(PgReserveError):
    """The command was pointed at no usable database (nothing there, or a malformed URL)."""

    code = "no_database"


class DatabaseUnavailable(PgReserveError):
    """The database server does not answer (refused, unknown host, bad credentials)."""

    code = "database_unavailable"
    retryable = True


class MigrationError(PgReserveError):
    code = "migration_error"
