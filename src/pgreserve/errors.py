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


class TenantNameTaken(PgReserveError):
    """Another tenant has this name already; nothing was created."""

    code = "tenant_name_taken"


# What every refusal of an API key says, whoever refuses it (the HTTP layer, the service,
# the batch function in sql/functions/batch.sql): an unknown key and a revoked one alike.
UNKNOWN_API_KEY = "unknown API key"


class ApiKeyRefused(PgReserveError):
    """The API key an operation was to check in its own transaction is not an active key
    of the tenant (revoked, or never issued to it); nothing was done."""

    code = "api_key_refused"

    def __init__(self, message: str = UNKNOWN_API_KEY, **details: Any) -> None:
        super().__init__(message, **details)


class UnknownStock(PgReserveError):
    """A line names a (sku, location) bucket this tenant does not have."""

    code = "unknown_stock"


class ReservationNotFound(PgReserveError):
    """No such reservation for this tenant (also said for another tenant's reservation)."""

    code = "reservation_not_found"


class IdempotencyKeyReused(PgReserveError):
    """The request key was used before with different parameters; the original is untouched."""

    code = "idempotency_key_reused"


class PreconditionFailed(PgReserveError):
    """A conditional stock write (if_match / create_only, HTTP If-Match / If-None-Match)
    whose condition did not hold when the database made the write; nothing was written.
    `details["version"]` is the line's current version (None: no such line)."""

    code = "precondition_failed"


class InvalidCursor(InvalidRequest):
    """A page cursor that this listing did not hand out."""

    code = "invalid_cursor"


class WouldOversell(PgReserveError):
    """A correction would leave fewer units than are held; pass force=True to record a shortfall."""

    code = "would_oversell"


class WebhookNotFound(PgReserveError):
    """No such webhook endpoint for this tenant."""

    code = "webhook_not_found"


class RequestNotFound(PgReserveError):
    """No answer is stored under this request key for this tenant."""

    code = "request_not_found"


class RequestInProgress(PgReserveError):
    """A request under this key is running right now: it has no answer yet, and may
    still commit one (retry shortly)."""

    code = "request_in_progress"
    retryable = True


class ApiKeyNotFound(PgReserveError):
    """No unrevoked API key of this tenant is shown with this prefix."""

    code = "api_key_not_found"


class FreezeNotFound(PgReserveError):
    """The bucket or tenant to unfreeze has no live freeze."""

    code = "freeze_not_found"


class WebhookUrlRefused(InvalidRequest):
    """A webhook URL whose host is (or resolves to) a loopback, private, link-local,
    multicast, reserved or unspecified address; nothing was registered or sent."""

    code = "webhook_url_refused"


class AllocationUnavailable(InvalidRequest):
    """A cart line without a location while the tenant's rollout mode lets the legacy
    Redis store take part (legacy, shadow, primary): Redis cannot allocate across
    locations. Nothing was written; name each line's location."""

    code = "allocation_unavailable"


class ReservationReleased(PgReserveError):
    code = "reservation_released"


class ReservationClaimed(PgReserveError):
    code = "reservation_claimed"


class ReservationExpired(PgReserveError):
    """An expired reservation whose stock can no longer be taken again."""

    code = "reservation_expired"


class ReservationNotActive(PgReserveError):
    code = "reservation_not_active"


class ChangeNotMirrored(PgReserveError):
    """A change of a hold kept in the legacy Redis store (taken while its tenant's rollout
    mode wrote Redis), which cannot change a held cart; nothing changed."""

    code = "change_not_mirrored"


class BackorderedHoldUnchangeable(PgReserveError):
    """A change of a reservation that holds backordered units: release it and reserve
    the new cart instead; nothing changed."""

    code = "backordered_hold_unchangeable"


class ExtendWouldShorten(PgReserveError):
    """An extend asked for an expiry sooner than the reservation's current one without
    `allow_shorten`; nothing changed."""

    code = "extend_would_shorten"


class StockPolicyUnsupported(PgReserveError):
    """Safety stock or a backorder limit asked for while the legacy Redis store decides
    the tenant's holds (rollout modes legacy and shadow), which knows neither; nothing
    was written."""

    code = "stock_policy_unsupported"


class RedisMissedWrites(PgReserveError):
    """A tenant in rollout mode primary would go back to a mode where Redis answers while
    Redis missed writes since it entered primary (it did not answer): Redis does not have
    every hold and count, and would sell units pgreserve holds. Nothing was switched."""

    code = "redis_missed_writes"


class UnsupportedInRolloutMode(PgReserveError):
    """Asked for what the legacy Redis store cannot keep (a reservation's reference or
    metadata, the reservation listing) while Redis answers for the tenant (rollout modes
    legacy and shadow); nothing was done."""

    code = "unsupported_in_rollout_mode"


class Busy(PgReserveError):
    """The work could not be started or finished in time (no connection free before the
    deadline, a lock or statement timeout, retries ran out) and nothing was committed:
    safe to retry later."""

    code = "busy"
    retryable = True


class OutcomeUnknown(PgReserveError):
    """The statement was sent and its connection was lost before the answer came (it may
    have committed); retry with the same request key to learn the outcome."""

    code = "outcome_unknown"
    retryable = True


class NoDatabase(PgReserveError):
    """The command was pointed at no usable database (nothing there, or a malformed URL)."""

    code = "no_database"


class DatabaseUnavailable(Busy):
    """A read lost its database connection and could not be read again in time. Reads
    change nothing (a write whose routing read failed was not started): a Busy."""

    code = "database_unavailable"


class TooManyRequests(PgReserveError):
    """This tenant already has as many requests in flight as it may; nothing was done."""

    code = "too_many_requests"
    retryable = True


class MigrationError(PgReserveError):
    code = "migration_error"


class DatabaseNotMigrated(PgReserveError):
    """The database lacks migrations (or SQL functions) this pgreserve needs: it was never
    migrated, or only partly. Nothing was done; `pgreserve migrate` applies what is missing.
    `details`: `missing` (migration names), `functions` (function files not applied as
    shipped) and `command` (the command that migrates this database)."""

    code = "database_not_migrated"


class DatabaseTooNew(MigrationError):
    """The database was migrated by a newer pgreserve than this one: it holds migrations
    this code does not know. Nothing was done (a database is never migrated down); run a
    pgreserve at least as new as the one that migrated it."""

    code = "database_too_new"
