"""A shadow-mode sale on a scratch tenant: the comparison, seen before a real tenant moves."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from ..core.service import ReservationService
from ..domain import Tenant
from ..errors import Busy
from .modes import Mode, set_mode
from .redis_store import RedisHoldStore
from .router import Rollout


@dataclass(frozen=True)
class Rehearsal:
    tenant: Tenant
    buyers: int
    held: int
    claimed: int
    seconds: float


async def rehearse(service: ReservationService, redis_url: str, *, buyers: int = 64,
                   stock: int = 40, claim: float = 0.9, seed: int | None = None) -> Rehearsal:
    """`buyers` concurrent buyers of one SKU (`stock` units in both stores) on a new tenant
    in shadow mode: each holds one unit, then claims it (probability `claim`) or releases it."""
    rng = random.Random(seed)  # noqa: S311 - a simulated buyer's choice, not a secret
    rollout = Rollout(service, RedisHoldStore(redis_url), mode_ttl_s=0)  # a bad URL: no tenant
    held = claimed = 0
    try:
        try:
            # before the scratch tenant is made: a Redis that does not answer leaves none
            await rollout.store.redis.ping()
        except (RedisError, OSError) as exc:
            raise Busy(f"the legacy Redis store did not answer ({exc}); nothing was "
                       "written, no tenant was made") from None
        tenant = await service.create_tenant(f"rehearsal-{secrets.token_hex(3)}")
        await service.set_stock(tenant.id, "hot", "rehearsal", stock)
        await rollout.store.set_stock(tenant.id, "hot", "rehearsal", stock)
        await set_mode(service.db, tenant.id, Mode.SHADOW, "rehearsal")
        choices = [rng.random() < claim for _ in range(buyers)]

        async def buyer(i: int) -> None:
            nonlocal held, claimed
            out = await rollout.reserve(tenant.id, f"buyer-{i}", [("hot", "rehearsal", 1)],
                                        ttl=60)
            if out.reservation is None:
                return
            held += 1
            if choices[i]:
                await rollout.claim(tenant.id, out.reservation.id)
                claimed += 1
            else:
                await rollout.release(tenant.id, out.reservation.id)

        started = time.perf_counter()
        await asyncio.gather(*(buyer(i) for i in range(buyers)))
        seconds = time.perf_counter() - started
        await rollout.recorder.flush()
    finally:
        await rollout.aclose()
    return Rehearsal(tenant, buyers, held, claimed, seconds)
