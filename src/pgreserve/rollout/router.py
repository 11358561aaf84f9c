"""Every reserve, claim and release of a tenant, sent to the store(s) its mode names.

- `legacy`: Redis answers; pgreserve holds nothing (a claim's sale goes to
  `rollout_legacy_sale` after Redis dropped the hold, as the legacy design does, and
  its units leave pgreserve's count, which counts and adjustments keep too).
- `shadow`: Redis answers; pgreserve gets the same request (same request key). A
  reserve pgreserve refuses by a rule (a freeze, a per-cart limit) is refused
  (`_refused_by_rule_in_shadow`).
- `primary`: pgreserve answers; Redis gets the same request, so going back is one
  command and Redis has every hold (a cart Redis refuses is refused: see
  `_reserve_primary`).
- `pgreserve`: pgreserve only.

A hold finishes under the mode it was taken in: the Redis record of a hold
says its mode, and a hold Redis never saw is pgreserve's. In the two modes that
write both stores, the store that did not answer never fails the caller: its
failure is counted and recorded as a disagreement. Both stores see each
bucket's requests in the same order (per process), so a sale's last units go
to the same buyers in both; and when they still answer differently, the
hold the caller was not told about is released at once, so neither store keeps
a hold nobody will claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from datetime import timedelta
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry

from .. import validation as check
from ..core.service import (
    DEFAULT_RESERVATION_PAGE,
    IfMatch,
    ReservationService,
    parse_reservation_id,
    reserve_digest,
)
from ..db.database import Op
from ..db.queries import queries
from ..domain import (
    DEFAULT_TTL,
    MIN_TTL,
    Line,
    RequestRecord,
    Reservation,
    ReservationPage,
    ReserveOutcome,
    Status,
    StockView,
    Strategy,
)
from ..errors import (
    AllocationUnavailable,
    Busy,
    ChangeNotMirrored,
    IdempotencyKeyReused,
    InvalidRequest,
    OutcomeUnknown,
    RequestInProgress,
    RequestNotFound,
    ReservationClaimed,
    ReservationExpired,
    ReservationNotActive,
    ReservationNotFound,
    ReservationReleased,
    StockPolicyUnsupported,
    UnsupportedInRolloutMode,
)
from .comparison import (
    MISSING_IN_REDIS,
    Comparison,
    Recorder,
    RolloutMetrics,
    error_outcome,
    reserve_outcome,
    transition_outcome,
)
from .modes import DEFAULT_MODE_TTL_S, Mode, ModeBook, utcnow
from .redis_store import HoldRecord, RedisHoldStore, RefusalMark

log = logging.getLogger(__name__)

CLOCK_MARGIN = timedelta(seconds=5)
# The pgreserve id a Redis hold is linked to when the caller was told pgreserve's
# refusal instead (shadow mode: a freeze or a per-cart limit; primary: any refusal of
# pgreserve's; the value dates from when freezes were the only such rule): the hold
# was given back at once, and a replay of the key in any mode is that refusal.
FROZEN_LINK = "frozen"

OP_SALE = Op("rollout", "rollout_legacy_sale_record", "rollout/legacy-sale")
# the modes in which Redis answered the caller
_REDIS_ANSWERED = frozenset({Mode.LEGACY.value, Mode.SHADOW.value})
OP_REFUSAL = Op("rollout", "rollout_refusal_record", "rollout/primary-refusal")
OP_TOLD = Op("rollout", "rollout_hold_told", "rollout/primary-hold-told")
OP_MODE_AT = Op("rollout", "rollout_mode_at_request", "rollout/adjust-replay")
OP_TENANTS = Op("sweeper", "rollout_redis_tenant_list", "worker/rollout-expiry")


class BucketLocks:
    """Per-process order of each bucket's requests in the two dual-write modes."""

    def __init__(self) -> None:
        self._locks: dict[tuple[int, str, str], tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, tenant: int, cart: Sequence[Line]) -> AsyncIterator[None]:
        keys = sorted({(tenant, x.sku, x.location) for x in cart})  # one order: no deadlock
        taken: list[tuple[int, str, str]] = []
        acquired: set[tuple[int, str, str]] = set()
        try:
            for k in keys:
                lock, users = self._locks.get(k) or (asyncio.Lock(), 0)
                self._locks[k] = (lock, users + 1)
                taken.append(k)
                await lock.acquire()
                acquired.add(k)
            yield
        finally:
            for k in reversed(taken):
                lock, users = self._locks[k]
                if k in acquired:  # a waiter cancelled in acquire() never held it
                    lock.release()
                if users <= 1:
                    del self._locks[k]
                else:
                    self._locks[k] = (lock, users - 1)


class Rollout:
    """reserve / claim / release with ReservationService's signatures, routed by mode."""

    def __init__(self, service: ReservationService, store: RedisHoldStore, *,
                 mode_ttl_s: float = DEFAULT_MODE_TTL_S,
                 registry: CollectorRegistry | None = None,
                 flush_every_s: float = 0.5) -> None:
        self.service = service
        self.store = store
        self.modes = ModeBook(service.db, mode_ttl_s)
        self.metrics = RolloutMetrics(registry)
        self.recorder = Recorder(service.db, self.metrics, flush_every_s=flush_every_s)
        self.locks = BucketLocks()
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, service: ReservationService, url: str, *,
                 registry: CollectorRegistry | None = None) -> Rollout:
        """The rollout layer over the legacy store at a redis:// URL."""
        return cls(service, RedisHoldStore(url), registry=registry)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.recorder.aclose()
        await self.store.aclose()

    # -- stock ---------------------------------------------------------------------

    async def set_stock(self, tenant: int, sku: str, location: str, on_hand: int, *,
                        strategy: Strategy | str | None = None, pool_cap: int | None = None,
                        force: bool = False, if_match: IfMatch = None,
                        create_only: bool = False, safety_stock: int | None = None,
                        backorder_limit: int | None = None) -> StockView:
        """Count a bucket in pgreserve and, while Redis is written, in Redis (its counter
        becomes the count minus the units Redis holds). A precondition is pgreserve's:
        when it fails, neither store is written. Safety stock and backorders are
        pgreserve's alone: while Redis answers (legacy, shadow) a non-zero one is refused
        with StockPolicyUnsupported, before anything is written."""
        mode = (await self.modes.get(tenant)).mode
        if mode.answers_from_redis and (safety_stock or backorder_limit):
            raise StockPolicyUnsupported(
                f"safety stock and backorders are not kept by the legacy store, which "
                f"decides holds in rollout mode {mode.value}")
        view = await self.service.set_stock(tenant, sku, location, on_hand, strategy=strategy,
                                            pool_cap=pool_cap, force=force, if_match=if_match,
                                            create_only=create_only, safety_stock=safety_stock,
                                            backorder_limit=backorder_limit)
        if mode.writes_redis:
            await self._stock_step(tenant, mode, self.store.set_stock(
                tenant, view.sku, view.location, view.on_hand), "set_stock",
                f"{view.sku}@{view.location}")
        return view

    async def adjust_stock(self, tenant: int, request_key: str, sku: str, location: str,
                           delta: int, *, reason: str = "", force: bool = False,
                           if_match: IfMatch = None) -> StockView:
        """A receipt or correction, once per request key in each store: pgreserve's
        ledger and, while Redis is written, the key's marker in Redis. A replay goes to
        Redis again, so a retry after a Redis that did not answer (OutcomeUnknown)
        moves its counter then, once; but not the replay of one first applied while
        Redis was not written (mode pgreserve): Redis has been counted again since, or
        will be, and never had that adjustment to catch up on."""
        view = await self.service.adjust_stock(tenant, request_key, sku, location, delta,
                                               reason=reason, force=force, if_match=if_match)
        mode = (await self.modes.get(tenant)).mode
        if not mode.writes_redis:
            return view
        if view.replayed:
            rows = await self.service.db.fetch(queries["rollout_mode_at_request"],
                                               (tenant, request_key), op=OP_MODE_AT)
            if rows and not Mode(rows[0][0]).writes_redis:
                return view
        await self._stock_step(tenant, mode, self.store.adjust_stock(
            tenant, view.sku, view.location, delta, request_key=request_key),
            "adjust_stock", request_key)
        return view

    async def _stock_step(self, tenant: int, mode: Mode, step: Awaitable[Any], operation: str,
                          key: str) -> None:
        """A count written to Redis: where Redis answers, its failure is the caller's;
        in primary it is counted and recorded as a disagreement (Redis missed it)."""
        if mode.answers_from_redis:
            await step
            return
        started = perf_counter()
        try:
            await step
        except Exception as exc:  # noqa: BLE001 - the secondary side never fails the caller
            self.metrics.secondary_failures.labels("legacy", operation).inc()
            self._compare(tenant, mode, operation, key, error_outcome(exc), {"applied": True},
                          _ms(started), 0.0)

    # -- reserve -----------------------------------------------------------------

    async def reserve(self, tenant: int, request_key: str, lines: Iterable[Any], *,
                      ttl: timedelta | float = DEFAULT_TTL, reference: str | None = None,
                      metadata: dict[str, str] | None = None) -> ReserveOutcome:
        """Hold every line of a cart, or none, in the store(s) of the tenant's mode.

        Redis keeps no reference or metadata: while it answers (legacy, shadow), a
        reserve that gives either raises UnsupportedInRolloutMode."""
        entry = await self.modes.get(tenant)
        mode = entry.mode
        if mode is Mode.PGRESERVE and not entry.redis_may_hold(utcnow()):
            return await self.service.reserve(tenant, request_key, lines, ttl=ttl,
                                              reference=reference, metadata=metadata)
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        lines = check.line_list(lines)
        if check.allocates(lines) and mode is Mode.PGRESERVE:
            return await self.service.reserve(tenant, key, lines, ttl=ttl,
                                              reference=reference, metadata=metadata)
        if check.allocates(lines):
            # Redis keeps one counter per (sku, location) and mirrors each cart line as
            # given: it cannot allocate, nor mirror an allocation before it is made.
            raise AllocationUnavailable(
                f"lines without a location need the tenant in mode pgreserve (it is in "
                f"mode {mode.value}); name each line's location", mode=mode.value)
        cart = check.cart(lines)
        life = check.ttl(ttl)
        ref, meta = check.reference(reference), check.metadata(metadata)
        if mode.answers_from_redis and (ref is not None or meta):
            raise UnsupportedInRolloutMode(
                f"the tenant is in rollout mode {mode.value}: the legacy store answers and "
                "keeps no reference or metadata")
        fingerprint = reserve_digest(cart, life, ref, meta)
        if mode is Mode.PGRESERVE:
            # the day after leaving primary: a key Redis answered first keeps that answer
            found = await self._redis_answer(tenant, key, fingerprint, cart)
            if found is not None and found[1] in _REDIS_ANSWERED:
                return await self._as_told(tenant, key, found[0])
            pg = await self.service.reserve(tenant, key, cart, ttl=life, reference=ref,
                                            metadata=meta)
            if (pg.held and found is not None and found[2] is not None
                    and found[1] == Mode.PRIMARY.value
                    and await self._refusal_is_the_answer(tenant, found[2], pg)
                    and await self._record_refusal(tenant, key, _rid(pg), found[0])):
                # Redis refused over this hold in primary, and the refusal was not yet
                # the key's answer in pgreserve (a request of the key in a process still
                # in primary is recording it, or could not; or pgreserve forgot the key
                # and held anew): it is now
                return found[0]
            if (pg.held and pg.replayed and found is None
                    and not await self._hold_told(tenant, key, _rid(pg))):
                # Redis keeps no answer (it is down, or a process still in primary has
                # not reached it yet and may keep a refusal over this hold): the hold
                # is told only once marked, as in primary; false: that refusal was
                # recorded meanwhile, and is the answer
                return await self.service.reserve(tenant, key, cart, ttl=life,
                                                  reference=ref, metadata=meta)
            return pg
        self.recorder.request(tenant)
        if mode is Mode.LEGACY:
            return await self._as_told(
                tenant, key, await self.store.reserve(tenant, key, fingerprint, cart, life))
        async with self.locks.hold(tenant, cart):
            if mode is Mode.SHADOW:
                return await self._reserve_shadow(tenant, key, fingerprint, cart, life)
            first = await self._redis_first(tenant, key, fingerprint, cart, Mode.SHADOW)
            if first is not None:
                return first
            return await self._reserve_primary(tenant, key, fingerprint, cart, life, ref, meta)

    async def _redis_first(self, tenant: int, key: str, fingerprint: str,
                           cart: list[Line], last: Mode) -> ReserveOutcome | None:
        """The answer Redis gave first to this key while it answered (legacy, and up to
        `last`: shadow, whose hold finishes in both stores), replayed as it stands; None
        when there is none (or Redis does not answer: pgreserve decides). pgreserve is
        not asked then, so it keeps no answer of its own under the key."""
        answering = _REDIS_ANSWERED if last is Mode.SHADOW else {Mode.LEGACY.value}
        found = await self._redis_answer(tenant, key, fingerprint, cart)
        if found is None or found[1] not in answering:
            return None
        return await self._as_told(tenant, key, found[0])

    async def _as_told(self, tenant: int, key: str, legacy: ReserveOutcome) -> ReserveOutcome:
        """Redis's answer under the key as the caller was told it: a replay of a hold
        Redis gave back because the caller was told pgreserve's refusal (linked
        FROZEN_LINK: shadow's rules, primary's refusals) is that refusal, as pgreserve
        keeps it under the key, whatever the mode now; any other answer as it is (also
        when pgreserve no longer keeps the key). When pgreserve cannot be read, its
        error is the caller's (a retry decides), never the hold the caller was not
        told."""
        if not (legacy.held and legacy.replayed):
            return legacy
        try:
            record = await self.store.record(tenant, _rid(legacy))
            if record is None or record.pg_id != FROZEN_LINK:
                return legacy
            stored = await self.service.lookup_request(tenant, key)
        except (RequestNotFound, RequestInProgress):
            return legacy
        if stored.operation != "reserve" or stored.outcome.get("status") != "rejected":
            return legacy
        return ReserveOutcome.from_json({**stored.outcome, "replayed": True})

    async def _redis_answer(self, tenant: int, key: str, fingerprint: str, cart: list[Line],
                            ) -> tuple[ReserveOutcome, str, RefusalMark | None] | None:
        """What Redis keeps under the key (store.answered); None also when Redis does not
        answer (it is the secondary store where this is asked)."""
        try:
            return await self.store.answered(tenant, key, fingerprint, cart)
        except IdempotencyKeyReused:
            raise
        except Exception:  # noqa: BLE001 - Redis is the secondary store here
            self.metrics.secondary_failures.labels("legacy", "read").inc()
            return None

    async def _reserve_shadow(self, tenant: int, key: str, fingerprint: str,
                              cart: list[Line], life: timedelta) -> ReserveOutcome:
        started = perf_counter()
        try:
            legacy = await self.store.reserve(tenant, key, fingerprint, cart, life,
                                              mode=Mode.SHADOW.value)
        except Exception as exc:
            legacy_ms = _ms(started)
            pg, pg_out, pg_ms = await self._pg_reserve(tenant, key, cart, life)
            self._compare(tenant, Mode.SHADOW, "reserve", key, error_outcome(exc), pg_out,
                          legacy_ms, pg_ms)
            if pg is not None and pg.held and not pg.replayed:
                await self._secondary(self.service.release(tenant, _rid(pg)), "pgreserve",
                                      "release")
            raise
        legacy_ms = _ms(started)
        if legacy.replayed and await self._answered_in_legacy(tenant, key, fingerprint, cart):
            return legacy  # the key's first answer was legacy's: pgreserve has no part in it
        pg, pg_out, pg_ms = await self._pg_reserve(tenant, key, cart, life)
        self._compare(tenant, Mode.SHADOW, "reserve", key, reserve_outcome(legacy), pg_out,
                      legacy_ms, pg_ms)
        if pg is not None and pg.by_rule and legacy.held:
            refused = await self._refused_by_rule_in_shadow(tenant, legacy, pg)
            if refused is not None:
                return refused
        if pg is not None and pg.held and not pg.replayed:
            if legacy.held and not await self._redis_answered_first(
                    tenant, legacy, pg, twin_of=Mode.LEGACY):
                await self._secondary(self.store.link(tenant, _rid(legacy), _rid(pg)),
                                      "legacy", "link")
            elif not legacy.held:
                # the caller was told Redis's refusal: pgreserve's hold goes back and
                # the refusal is the key's answer there too, for when Redis no longer
                # answers it (a later mode, Redis's 24 h)
                await self._secondary(self._record_refusal(tenant, key, _rid(pg), legacy),
                                      "pgreserve", "release")
            else:  # the caller has Redis's own earlier hold: nobody will claim this one
                await self._secondary(self.service.release(tenant, _rid(pg)), "pgreserve",
                                      "release")
        return await self._as_told(tenant, key, legacy)

    async def _answered_in_legacy(self, tenant: int, key: str, fingerprint: str,
                                  cart: list[Line]) -> bool:
        """Whether Redis's answer to this key was given in mode legacy."""
        return await self._redis_first(tenant, key, fingerprint, cart, Mode.LEGACY) is not None

    async def _redis_answered_first(self, tenant: int, legacy: ReserveOutcome,
                                    pg: ReserveOutcome, *,
                                    twin_of: Mode | None = None) -> bool:
        """Whether Redis replayed a hold that is its own, not the mirror of `pg`'s: one
        taken while Redis answered (in legacy or shadow; `twin_of`: in that mode only,
        whose holds have no pgreserve twin to link), for a key retried since the
        tenant's mode changed. Such a hold finishes where it was taken."""
        if not (legacy.replayed and legacy.held) or (
                pg.held and _rid(pg) == _rid(legacy)):
            return False
        try:
            record = await self.store.record(tenant, _rid(legacy))
        except Exception:  # noqa: BLE001 - Redis just answered; without it, as before
            self.metrics.secondary_failures.labels("legacy", "read").inc()
            return False
        if record is None:
            return False
        if twin_of is not None:
            return record.mode == twin_of.value
        return Mode(record.mode).answers_from_redis

    async def _refused_by_rule_in_shadow(self, tenant: int, legacy: ReserveOutcome,
                                         pg: ReserveOutcome) -> ReserveOutcome | None:
        """A freeze or a per-cart limit stops new holds in shadow mode too: the caller gets
        pgreserve's stored refusal and Redis's hold goes back. The Redis hold is marked
        first, so a replay of the key gives the same refusal. None: Redis's answer stands
        (it could not be marked, or a replay whose first answer was Redis's)."""
        rid = _rid(legacy)
        if legacy.replayed:
            record = await self.store.record(tenant, rid)
            return pg if record is not None and record.pg_id == FROZEN_LINK else None
        try:
            await self.store.link(tenant, rid, FROZEN_LINK)
        except Exception:  # noqa: BLE001 - unmarked, Redis's answer has to stand
            self.metrics.secondary_failures.labels("legacy", "link").inc()
            return None
        await self._secondary(self.store.release(tenant, rid), "legacy", "release")
        return pg

    async def _pg_reserve(self, tenant: int, key: str, cart: list[Line],
                          life: timedelta) -> tuple[ReserveOutcome | None, dict[str, Any], float]:
        started = perf_counter()
        try:
            pg = await self.service.reserve(tenant, key, cart, ttl=life)
        except Exception as exc:  # noqa: BLE001 - the secondary side never fails the caller
            self.metrics.secondary_failures.labels("pgreserve", "reserve").inc()
            return None, error_outcome(exc), _ms(started)
        return pg, reserve_outcome(pg), _ms(started)

    async def _reserve_primary(self, tenant: int, key: str, fingerprint: str,
                               cart: list[Line], life: timedelta, reference: str | None = None,
                               metadata: dict[str, str] | None = None) -> ReserveOutcome:
        started = perf_counter()
        pg = await self.service.reserve(tenant, key, cart, ttl=life, reference=reference,
                                        metadata=metadata)  # its failure is the caller's
        pg_ms = _ms(started)
        hold_id = _rid(pg) if pg.held else None
        started = perf_counter()
        try:
            legacy, mark = await self.store.reserve_answer(
                tenant, key, fingerprint, cart, life, mode=Mode.PRIMARY.value, hold_id=hold_id,
                pg_id=hold_id, over=None if pg.replayed else hold_id)
        except Exception as exc:  # noqa: BLE001 - the secondary side never fails the caller
            self.metrics.secondary_failures.labels("legacy", "reserve").inc()
            self._compare(tenant, Mode.PRIMARY, "reserve", key, error_outcome(exc),
                          reserve_outcome(pg), _ms(started), pg_ms)
            if pg.held and not await self._hold_told(tenant, key, _rid(pg)):
                # a request of this key in another process recorded Redis's refusal
                # meanwhile: that is the key's answer now
                return await self.service.reserve(tenant, key, cart, ttl=life,
                                                  reference=reference, metadata=metadata)
            return pg
        self._compare(tenant, Mode.PRIMARY, "reserve", key, reserve_outcome(legacy),
                      reserve_outcome(pg), _ms(started), pg_ms)
        if await self._redis_answered_first(tenant, legacy, pg):
            # the key's first answer was Redis's hold (taken in legacy or shadow, and
            # finished there): it is the caller's; a hold pgreserve took now is not
            if pg.held and not pg.replayed:
                await self._secondary(self.service.release(tenant, _rid(pg)), "pgreserve",
                                      "release")
            return legacy
        if pg.replayed and not legacy.replayed:
            # Redis first sees this key now (it failed the first time): pgreserve's stored
            # answer was the caller's and stays theirs. A Redis hold beside a pgreserve
            # hold that is no longer active would keep units nobody will claim.
            active = pg.reservation is not None and pg.reservation.status is Status.ACTIVE
            if legacy.held and not (pg.held and active):
                await self._give_back(tenant, legacy, refused=not pg.held)
            return pg
        if legacy.held and not pg.held and not legacy.replayed:
            await self._give_back(tenant, legacy, refused=True)
        if pg.held and not legacy.held:
            if (legacy.replayed and mark is not None
                    and not await self._refusal_is_the_answer(tenant, mark, pg)):
                # Redis refused a retry of a key whose hold pgreserve answered alone
                # (Redis did not answer the first time): the hold stays the caller's,
                # a disagreement, never taken back
                return pg
            # Redis has every hold of every mode: a refusal means its units are held
            # elsewhere (a process still in legacy during a switch). Selling anyway
            # would sell them twice; the caller gets the refusal, once it is the
            # key's answer in pgreserve too (ledger_refusal_record_v1: its hold goes
            # back in the same transaction), so that no later mode replays the hold.
            # A hold a caller was told stays (false).
            if not await self._record_refusal(tenant, key, _rid(pg), legacy):
                return pg
            return legacy
        return pg

    async def _give_back(self, tenant: int, legacy: ReserveOutcome, *, refused: bool) -> None:
        """Give Redis's hold back (primary: the caller has pgreserve's answer instead);
        `refused`: that answer is pgreserve's refusal, so the hold is marked first
        (FROZEN_LINK), and its replay in a later mode is that refusal too."""
        if refused:
            await self._secondary(self.store.link(tenant, _rid(legacy), FROZEN_LINK),
                                  "legacy", "link")
        await self._secondary(self.store.release(tenant, _rid(legacy)), "legacy", "release")

    async def _refusal_is_the_answer(self, tenant: int, mark: RefusalMark,
                                     pg: ReserveOutcome) -> bool:
        """Whether a refusal Redis keeps under the key (`mark`) is the key's answer over
        pgreserve's hold `pg`, unless a caller was told that hold (ledger_refusal_record_v1
        decides that). A refusal given while Redis answered (legacy, shadow) is; one given
        in primary over a hold is; one given in primary over none (a retry of a key whose
        hold pgreserve answered alone, Redis being down) is not; one stored before
        refusals were marked is over a new hold (pgreserve forgot the key), and over a
        replayed one if that hold was given back then, as the code of that time did when
        it told the refusal."""
        if mark.mode != Mode.PRIMARY.value:
            return True
        if mark.over is None and pg.replayed:
            try:
                now = await self.service.get_reservation(tenant, _rid(pg))
            except ReservationNotFound:
                return True
            return now.status is Status.RELEASED
        return mark.over != ""

    async def _record_refusal(self, tenant: int, key: str, hold_id: str,
                              refusal: ReserveOutcome) -> bool:
        """Make Redis's refusal of pgreserve's hold the key's answer in pgreserve; False
        when the hold stands (a caller was told it). Not recorded, the refusal is not
        told: OutcomeUnknown, and the retry decides."""
        doc = {"status": "rejected", "reason": refusal.reason or "insufficient_stock",
               "short_lines": [{"sku": s.sku, "location": s.location,
                                "requested": s.requested, "available": s.available}
                               for s in refusal.short_lines]}
        try:
            rows = await self.service.db.fetch(
                queries["rollout_refusal_record"],
                (tenant, key, uuid.UUID(hold_id), json.dumps(doc)), op=OP_REFUSAL)
        except Exception as exc:
            raise OutcomeUnknown(
                f"the legacy store refused this cart and pgreserve did not record the "
                f"refusal ({type(exc).__name__}); retry with the same request key") from exc
        return bool(rows[0][0])

    async def _hold_told(self, tenant: int, key: str, hold_id: str) -> bool:
        """Before pgreserve's hold is told while Redis did not answer: keep it the key's
        answer, so that a refusal Redis may still store under the key (its reserve ran
        after this process stopped waiting) never replaces it. False: a refusal was
        recorded meanwhile. Not kept, the hold is not told: OutcomeUnknown."""
        try:
            rows = await self.service.db.fetch(queries["rollout_hold_told"],
                                               (tenant, key, uuid.UUID(hold_id)), op=OP_TOLD)
        except Exception as exc:
            raise OutcomeUnknown(
                f"pgreserve could not keep its hold as this key's answer while the legacy "
                f"store may still keep a refusal over it ({type(exc).__name__}); retry "
                f"with the same request key") from exc
        return bool(rows[0][0])

    # -- change ------------------------------------------------------------------

    async def change(self, tenant: int, reservation_id: str | uuid.UUID,
                     lines: Iterable[Any], *, request_key: str) -> ReserveOutcome:
        """Change a held cart: pgreserve's alone. The legacy store cannot change a held
        cart, so a hold kept there (taken while the tenant's mode wrote Redis: legacy,
        shadow or primary) raises ChangeNotMirrored and nothing changes; a hold taken in
        mode pgreserve changes as ReservationService.change does."""
        entry = await self.modes.get(tenant)
        rid = str(parse_reservation_id(reservation_id))  # Redis knows one spelling
        if entry.redis_may_hold(utcnow()):
            try:
                record = await self.store.record(check.tenant_id(tenant), rid)
            except Exception as exc:
                if entry.mode.answers_from_redis:
                    raise
                # whether Redis keeps this hold (and could not change it) is unknown
                self.metrics.secondary_failures.labels("legacy", "change").inc()
                raise Busy(f"reservation {rid} may be held in the legacy store, which did "
                           f"not answer ({exc}); nothing changed, retry later") from exc
            if record is not None and record.mode != Mode.PGRESERVE.value:
                raise ChangeNotMirrored(
                    f"reservation {rid} is held in the legacy store (mode "
                    f"{record.mode}), which cannot change a held cart")
        return await self.service.change(tenant, rid, lines, request_key=request_key)

    # -- claim and release ---------------------------------------------------------

    async def claim(self, tenant: int, reservation_id: str | uuid.UUID, *,
                    request_key: str | None = None) -> Reservation:
        """Payment succeeded: the hold becomes a sale, under the mode it was taken in."""
        return await self._finish("claim", tenant, reservation_id, request_key)

    async def release(self, tenant: int, reservation_id: str | uuid.UUID, *,
                      request_key: str | None = None) -> Reservation:
        """Payment failed: the units go back, under the mode the hold was taken in."""
        return await self._finish("release", tenant, reservation_id, request_key)

    async def get_reservation(self, tenant: int,
                              reservation_id: str | uuid.UUID) -> Reservation:
        """A reservation as the store that answered for it sees it."""
        entry = await self.modes.get(tenant)
        rid = str(parse_reservation_id(reservation_id))  # Redis knows one spelling
        if not entry.redis_may_hold(utcnow()):
            return await self.service.get_reservation(tenant, rid)
        try:
            record = await self.store.record(check.tenant_id(tenant), rid)
        except Exception as exc:
            if entry.mode.answers_from_redis:
                raise
            # pgreserve answers now: its own holds are read without Redis; one it does
            # not have may be a hold Redis answered for (taken in legacy or shadow)
            self.metrics.secondary_failures.labels("legacy", "read").inc()
            try:
                return await self.service.get_reservation(tenant, rid)
            except ReservationNotFound as missing:
                raise _maybe_redis_only(rid, exc) from missing
        if record is not None and Mode(record.mode).answers_from_redis:
            return record.reservation()
        return await self.service.get_reservation(tenant, rid)

    async def lookup_request(self, tenant: int, request_key: str) -> RequestRecord:
        """The answer stored under a request key (ReservationService.lookup_request).

        While Redis answers for the tenant (legacy, shadow) the answers to reserves,
        claims, releases and extends are Redis's: pgreserve keeps none, or in shadow
        its twin's, naming an id the caller was never told (a claim of the twin's id
        would sell beside Redis's hold). So the lookup then answers only what pgreserve
        itself answered, an adjustment, and raises UnsupportedInRolloutMode for any
        other key; afterwards, while Redis may still hold (primary, and the day after),
        it raises it for a key Redis answered in one of those modes. Busy when Redis
        does not answer then (whose answer it was cannot be told)."""
        tenant = check.tenant_id(tenant)
        key = check.request_key(request_key)
        entry = await self.modes.get(tenant)
        if entry.mode.answers_from_redis:
            try:
                found = await self.service.lookup_request(tenant, key)
            except RequestNotFound:
                found = None
            if found is None or found.operation != "adjust":
                raise UnsupportedInRolloutMode(
                    f"the tenant is in rollout mode {entry.mode.value}: the legacy store "
                    "answers its reserves, whose answers are not looked up by request key")
            return found
        if entry.redis_may_hold(utcnow()):
            try:
                given_in = await self.store.answer_mode(tenant, key)
            except Exception as exc:
                self.metrics.secondary_failures.labels("legacy", "read").inc()
                raise Busy("the legacy store did not answer, and it may have answered "
                           "this request key; retry later") from exc
            if given_in in ("", *_REDIS_ANSWERED):
                raise UnsupportedInRolloutMode(
                    f"this request key was answered by the legacy store (in mode "
                    f"{given_in or 'legacy'}), whose answers are not looked up by key: "
                    "read the reservation by the id that answer gave")
        return await self.service.lookup_request(tenant, key)

    async def list_reservations(self, tenant: int, *, reference: str | None = None,
                                status: Iterable[str] | str | None = None,
                                limit: int = DEFAULT_RESERVATION_PAGE,
                                after: str | None = None) -> ReservationPage:
        """pgreserve's reservations of the tenant (ReservationService.list_reservations);
        while Redis answers (legacy, shadow) the caller's holds are Redis's, so the
        listing raises UnsupportedInRolloutMode."""
        mode = (await self.modes.get(check.tenant_id(tenant))).mode
        if mode.answers_from_redis:
            raise UnsupportedInRolloutMode(
                f"the tenant is in rollout mode {mode.value}: the legacy store answers, "
                "and reservations are listed from pgreserve only")
        return await self.service.list_reservations(tenant, reference=reference,
                                                    status=status, limit=limit, after=after)

    async def extend(self, tenant: int, reservation_id: str | uuid.UUID,
                     ttl: timedelta | float, *, request_key: str | None = None,
                     allow_shorten: bool = False) -> Reservation:
        """A new time to live for an active hold, in the store(s) of the mode it was taken in
        (never sooner than it ends now unless `allow_shorten`, in either store)."""
        return await self._finish("extend", tenant, reservation_id, request_key,
                                  check.ttl(ttl), check.flag(allow_shorten, "allow_shorten"))

    def _pg(self, action: str, tenant: int, reservation_id: str | uuid.UUID,
            request_key: str | None, ttl: timedelta | None = None,
            shorten: bool = False) -> Awaitable[Reservation]:
        if action == "extend":
            return self.service.extend(tenant, reservation_id, _needed(ttl),
                                       request_key=request_key, allow_shorten=shorten)
        run = self.service.claim if action == "claim" else self.service.release
        return run(tenant, reservation_id, request_key=request_key)

    async def _finish(self, action: str, tenant: int, reservation_id: str | uuid.UUID,
                      request_key: str | None, ttl: timedelta | None = None,
                      shorten: bool = False) -> Reservation:
        entry = await self.modes.get(tenant)
        if not entry.redis_may_hold(utcnow()):
            return await self._pg(action, tenant, reservation_id, request_key, ttl, shorten)
        tenant = check.tenant_id(tenant)
        reservation_id = str(parse_reservation_id(reservation_id))  # Redis's one spelling
        try:
            record = await self.store.record(tenant, reservation_id)
        except Exception as exc:
            if entry.mode.answers_from_redis:
                raise
            # Redis is the secondary store now: pgreserve answers without it; in
            # primary the write Redis may have missed is recorded (going back to
            # legacy is refused)
            self.metrics.secondary_failures.labels("legacy", action).inc()
            started = perf_counter()
            try:
                pg = await self._pg(action, tenant, reservation_id, request_key, ttl,
                                    shorten)
            except ReservationNotFound as missing:
                raise _maybe_redis_only(reservation_id, exc) from missing
            except Exception as pg_exc:
                if not entry.mode.writes_redis:
                    raise
                self._compare(tenant, entry.mode, action, request_key or reservation_id,
                              error_outcome(exc), error_outcome(pg_exc), 0.0, _ms(started))
                raise
            if entry.mode.writes_redis:  # pgreserve mode writes nothing to Redis
                self._compare(tenant, entry.mode, action, request_key or reservation_id,
                              error_outcome(exc), transition_outcome(pg), 0.0, _ms(started))
            return pg
        if record is None and entry.mode is Mode.PRIMARY:
            # Redis has every hold taken while it is written: pgreserve's hold it does
            # not have (lost with Redis's data, or taken while Redis was not written)
            # is a write Redis missed, and going back to legacy stays refused
            started = perf_counter()
            pg = await self._pg(action, tenant, reservation_id, request_key, ttl, shorten)
            self._compare(tenant, entry.mode, action, request_key or reservation_id,
                          {"error": MISSING_IN_REDIS}, transition_outcome(pg), 0.0,
                          _ms(started))
            return pg
        if record is None or record.mode == Mode.PGRESERVE.value:
            return await self._pg(action, tenant, reservation_id, request_key, ttl, shorten)
        self.recorder.request(tenant)
        mode = Mode(record.mode)
        # what Redis judges "sooner than now" by: the caller's time to live, not the
        # clamped one below (None: the caller allows a shorter hold)
        asked = None if shorten else ttl
        if ttl is not None and entry.redis_until is not None:
            # a Redis hold may not outlive the time its tenant's claims still look there
            # (less a margin for the clocks of this host, the database and Redis)
            ttl = max(MIN_TTL, min(ttl, entry.redis_until - utcnow() - CLOCK_MARGIN))
        if mode is Mode.LEGACY:
            return await self.legacy_finish(action, tenant, record, ttl=ttl, asked=asked)
        compared_key = request_key or record.id
        async with self.locks.hold(tenant, record.lines):
            # Redis decides first where it answers the caller: a hold of a shadow tenant,
            # and a hold taken in primary once its tenant went back to legacy or shadow
            # (pgreserve's claim first would stand while Redis, refusing the write, kept
            # the hold and gave its units back at its expiry: sold in both)
            if mode is Mode.SHADOW or entry.mode.answers_from_redis:
                started = perf_counter()
                try:
                    legacy = await self.legacy_finish(action, tenant, record, ttl=ttl,
                                                      asked=asked)
                except (OutcomeUnknown, Busy):
                    # Redis decided nothing the caller knows of (it did not answer, or
                    # answered with an error): pgreserve's hold stays as it is, and the
                    # retry the caller is asked for settles both
                    raise
                except Exception as exc:
                    legacy_ms = _ms(started)
                    # Redis refused the claim (its hold expired or was released): the caller
                    # is told no, so pgreserve gives its units back rather than sell them
                    twin = "release" if action == "claim" and isinstance(
                        exc, (ReservationExpired, ReservationReleased)) else action
                    before = (await self._pg_state(tenant, record.pg_id) if twin != action
                              else None)
                    out, pg_ms = await self._pg_finish(twin, tenant, record.pg_id, request_key,
                                                       ttl, shorten)
                    self._compare(tenant, mode, action, compared_key, error_outcome(exc),
                                  _stand_in(exc, before, out), legacy_ms, pg_ms)
                    raise
                legacy_ms = _ms(started)
                out, pg_ms = await self._pg_finish(action, tenant, record.pg_id, request_key,
                                                   ttl, shorten)
                self._compare(tenant, mode, action, compared_key, transition_outcome(legacy),
                              out, legacy_ms, pg_ms)
                if action == "claim" and record.pg_id is not None and "error" in out:
                    await self._secondary(self._settle_twin(tenant, record, out["error"]),
                                          "pgreserve", "legacy_sale")
                return legacy
            started = perf_counter()
            try:
                pg = await self._pg(action, tenant, reservation_id, request_key, ttl, shorten)
            except Exception as exc:
                pg_ms = _ms(started)
                if action == "extend" and isinstance(exc, _HOLD_ENDED):
                    # pgreserve refused the extend, its hold having ended: Redis's hold
                    # keeps the end it had. Extended there, it would outlive pgreserve's
                    # and keep its units from Redis's buyers after pgreserve gave them
                    # back. (A refusal of the arguments, a shorter end, goes on to
                    # Redis below, which judges them alike.)
                    now = await self._legacy_state(tenant, record)
                    self._compare(tenant, mode, action, compared_key,
                                  {"status": now} if now is not None
                                  else {"error": MISSING_IN_REDIS},
                                  error_outcome(exc), 0.0, pg_ms)
                    raise
                # pgreserve refused the claim (expired or released): Redis gives back too
                twin = "release" if action == "claim" and isinstance(
                    exc, (ReservationExpired, ReservationReleased)) else action
                before = await self._legacy_state(tenant, record) if twin != action else None
                legacy_out, legacy_ms = await self._legacy_secondary(twin, tenant, record,
                                                                    ttl, asked)
                self._compare(tenant, mode, action, compared_key,
                              _stand_in(exc, before, legacy_out), error_outcome(exc),
                              legacy_ms, pg_ms)
                raise
            pg_ms = _ms(started)
            legacy_out, legacy_ms = await self._legacy_secondary(action, tenant, record,
                                                                 ttl, asked)
            self._compare(tenant, mode, action, compared_key, legacy_out,
                          transition_outcome(pg), legacy_ms, pg_ms)
            return pg

    async def _settle_twin(self, tenant: int, record: HoldRecord, error: str) -> None:
        """Redis sold a shadow hold whose twin pgreserve did not claim (`error`). A twin
        released or expired there did not, and will not, sell it; one whose claim failed
        otherwise (busy, outcome unknown) is released now, unless that claim did sell
        it. The units of a twin that sold nothing leave pgreserve's count, as a legacy
        sale's do; left active, the twin would give them back at its expiry."""
        if error not in _NOT_SOLD_BY_TWIN and record.pg_id is not None:
            try:
                await self.service.release(tenant, record.pg_id)
            except (ReservationReleased, ReservationExpired):
                pass  # it ended unsold meanwhile
            except ReservationClaimed:
                return  # the claim that failed did sell it
        await self._legacy_sale(tenant, record, uncounted=True)

    async def _pg_state(self, tenant: int, pg_id: str | None) -> str | None:
        """The status pgreserve's twin of a hold shows now (None: none, or no answer)."""
        if pg_id is None or pg_id == FROZEN_LINK:
            return None
        try:
            return (await self.service.get_reservation(tenant, pg_id)).status.value
        except Exception:  # noqa: BLE001 - only for the comparison
            return None

    async def _legacy_state(self, tenant: int, record: HoldRecord) -> str | None:
        """The status Redis's record of a hold shows now, expired once past its TTL
        (None: gone, or no answer)."""
        try:
            now = await self.store.record(tenant, record.id)
        except Exception:  # noqa: BLE001 - only for the comparison
            return None
        if now is None:
            return None
        if now.status == "held" and now.expires_at <= utcnow():
            return Status.EXPIRED.value
        return now.reservation().status.value

    async def _pg_finish(self, action: str, tenant: int, pg_id: str | None,
                         request_key: str | None, ttl: timedelta | None,
                         shorten: bool) -> tuple[dict[str, Any], float]:
        started = perf_counter()
        try:
            if pg_id is None or pg_id == FROZEN_LINK:
                raise ReservationNotFound("pgreserve has no reservation beside this hold")
            done = await self._pg(action, tenant, pg_id, request_key, ttl, shorten)
        except Exception as exc:  # noqa: BLE001 - the secondary side never fails the caller
            self.metrics.secondary_failures.labels("pgreserve", action).inc()
            return error_outcome(exc), _ms(started)
        return transition_outcome(done), _ms(started)

    async def _legacy_secondary(self, action: str, tenant: int, record: HoldRecord,
                                ttl: timedelta | None,
                                asked: timedelta | None) -> tuple[dict[str, Any], float]:
        started = perf_counter()
        try:
            done = await self.legacy_finish(action, tenant, record, ttl=ttl, asked=asked,
                                            ledger=False)
        except Exception as exc:  # noqa: BLE001 - the secondary side never fails the caller
            self.metrics.secondary_failures.labels("legacy", action).inc()
            return error_outcome(exc), _ms(started)
        return transition_outcome(done), _ms(started)

    async def legacy_finish(self, action: str, tenant: int, record: HoldRecord, *,
                            ttl: timedelta | None = None, asked: timedelta | None = None,
                            ledger: bool = True,
                            ledger_first: bool = False,
                            between: Callable[[], Awaitable[None]] | None = None) -> Reservation:
        """The legacy design's claim, release or extend: Redis, and for a claim the sale
        written to the order ledger in a transaction of its own (after Redis, or before it
        with `ledger_first`; not when pgreserve keeps the ledger, `ledger=False`).
        `between` runs between the two writes."""
        if action == "extend":
            return await self.store.extend(tenant, record.id, _needed(ttl), asked=asked)
        if action != "claim":
            return await self.store.release(tenant, record.id)
        if not ledger:  # pgreserve keeps the ledger (primary mode) and sold the units
            return await self.store.claim(tenant, record.id, sold=True)
        if ledger_first:
            await self._legacy_sale(tenant, record)
            if between is not None:
                await between()
            return await self.store.claim(tenant, record.id)
        done = await self.store.claim(tenant, record.id)
        if between is not None:
            await between()
        await self._legacy_sale(tenant, record)
        return done

    async def _legacy_sale(self, tenant: int, record: HoldRecord, *,
                           uncounted: bool | None = None) -> None:
        """The legacy design's sale record. A hold pgreserve has no twin of (taken in
        `legacy`, or one whose twin pgreserve never made) was never held in pgreserve,
        whose count still has its units: they leave it with the sale, once, so that a
        tenant moving on to `primary` and `pgreserve` does not offer them again.
        `uncounted=True`: a sold shadow hold whose twin pgreserve refused to claim
        (released or expired there): its units leave pgreserve's count the same way."""
        await self.service.db.fetch(queries["rollout_legacy_sale_record"], {
            "tenant": tenant, "reservation": uuid.UUID(record.id),
            "skus": [x.sku for x in record.lines],
            "locations": [x.location for x in record.lines],
            "quantities": [x.quantity for x in record.lines],
            "uncounted": record.pg_id is None if uncounted is None else uncounted},
            op=OP_SALE)

    # -- expiry of legacy holds ----------------------------------------------------

    async def expire_due(self) -> int:
        """Give back the units of every expired legacy hold (tenants that may have some)."""
        rows = await self.service.db.fetch(queries["rollout_redis_tenant_list"], (),
                                           op=OP_TENANTS)
        done = 0
        for (tenant,) in rows:
            done += await self.store.expire_due(int(tenant))
        return done

    def start(self, every_s: float = 1.0) -> None:
        """Run expire_due in the background (pgreserve up and serve)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(every_s))

    async def _sweep(self, every_s: float) -> None:
        while True:
            try:
                if await self.expire_due() == 0:
                    await asyncio.sleep(every_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # the sweep is retried; the holds stay due
                log.exception("legacy hold expiry failed; retrying")
                await asyncio.sleep(every_s)

    # -- recording -------------------------------------------------------------------

    def _compare(self, tenant: int, mode: Mode, operation: str, key: str,
                 legacy: dict[str, Any], pgreserve: dict[str, Any], legacy_ms: float,
                 pgreserve_ms: float) -> None:
        self.recorder.add(Comparison(tenant, mode.value, operation, key, legacy, pgreserve,
                                     legacy_ms, pgreserve_ms))

    async def _secondary(self, step: Awaitable[Any], side: str, operation: str) -> None:
        try:
            await step
        except Exception:  # noqa: BLE001 - the secondary side never fails the caller
            self.metrics.secondary_failures.labels(side, operation).inc()


# pgreserve's refusals of an extend that say its hold has ended (or never was)
_HOLD_ENDED = (ReservationNotActive, ReservationReleased, ReservationClaimed,
               ReservationExpired, ReservationNotFound)

# pgreserve's refusals of a twin's claim that say it did not, and will not, sell it
_NOT_SOLD_BY_TWIN = frozenset({ReservationReleased.code, ReservationExpired.code,
                               ReservationNotFound.code})


def _stand_in(exc: BaseException, before: str | None,
              outcome: dict[str, Any]) -> dict[str, Any]:
    """The other store's answer to a claim one store refused as released or expired,
    for the comparison. That store got a release in its stead (`outcome`); when the
    reservation already was as the refusal says (`before`: released, expired), it
    would have refused the claim the same way, and that refusal is its answer. One
    it still held (its release gave units back) stays a disagreement."""
    status = ("released" if isinstance(exc, ReservationReleased)
              else "expired" if isinstance(exc, ReservationExpired) else None)
    if status is not None and before == status:
        return {**error_outcome(exc),
                "message": f"(the reservation was {status} here too; released in its stead)"}
    return outcome


def _maybe_redis_only(rid: str, silent: Exception) -> Busy:
    """For a hold pgreserve does not have while Redis, which may keep it (taken in
    legacy), does not answer: whether it exists is Redis's to say; nothing was written."""
    return Busy(f"reservation {rid} is not pgreserve's and may be held in the legacy "
                f"store, which did not answer ({silent}); nothing changed, retry later")


def _ms(started: float) -> float:
    return (perf_counter() - started) * 1000


def _needed(ttl: timedelta | None) -> timedelta:
    if ttl is None:
        raise InvalidRequest("an extend needs a ttl", field="ttl")
    return ttl


def _rid(outcome: ReserveOutcome) -> str:
    if outcome.reservation is None:
        raise ValueError("a rejected reserve has no reservation")
    return outcome.reservation.id


