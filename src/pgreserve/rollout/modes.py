"""Rollout modes per tenant, read from `rollout_mode` and cached per process.

A switch (`pgreserve rollout set`) is seen by every process within
`ModeBook.ttl_s` (1 s by default): a tenant's mode is read at most once per
that time, never once per request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from .. import errors
from ..db.database import Database, Op
from ..db.queries import queries

DEFAULT_MODE_TTL_S = 1.0

OP_MODE = Op("rollout", "rollout_mode_get", "rollout/mode")
OP_MODE_SET = Op("admin", "rollout_mode_set", "cli/rollout")


class Mode(str, enum.Enum):
    LEGACY = "legacy"  # Redis answers; pgreserve is not written
    SHADOW = "shadow"  # Redis answers; pgreserve is written too and compared
    PRIMARY = "primary"  # pgreserve answers; Redis is written too and compared
    PGRESERVE = "pgreserve"  # pgreserve only

    @property
    def writes_redis(self) -> bool:
        return self is not Mode.PGRESERVE

    @property
    def answers_from_redis(self) -> bool:
        return self in (Mode.LEGACY, Mode.SHADOW)

    @classmethod
    def parse(cls, value: Any) -> Mode:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise errors.InvalidRequest(f"mode must be one of {names}, not {value!r}",
                                        field="mode") from None


@dataclass(frozen=True)
class TenantMode:
    mode: Mode
    redis_until: datetime | None  # holds taken while Redis was written may live until then

    def redis_may_hold(self, now: datetime) -> bool:
        """Whether a hold of this tenant may live in Redis (so Redis is asked)."""
        return self.mode.writes_redis or (self.redis_until is not None and self.redis_until > now)


PGRESERVE_ONLY = TenantMode(Mode.PGRESERVE, None)


class ModeBook:
    """Each tenant's mode, read from the database at most once per `ttl_s`."""

    def __init__(self, db: Database, ttl_s: float = DEFAULT_MODE_TTL_S) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self._cache: dict[int, tuple[TenantMode, float]] = {}

    async def get(self, tenant: int) -> TenantMode:
        now = time.monotonic()
        known = self._cache.get(tenant)
        if known is not None and known[1] > now:
            return known[0]
        rows = await self.db.fetch(queries["rollout_mode_get"], (tenant,), op=OP_MODE)
        found = PGRESERVE_ONLY if not rows else TenantMode(Mode(rows[0][0]), rows[0][1])
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[tenant] = (found, now + self.ttl_s)
        return found

    def forget(self, tenant: int | None = None) -> None:
        """Read the mode again on next use (all tenants when None)."""
        if tenant is None:
            self._cache.clear()
        else:
            self._cache.pop(tenant, None)


async def set_mode(db: Database, tenant: int, mode: Mode | str, changed_by: str, *,
                   force: bool = False) -> Mode:
    """Switch a tenant's mode, recording who and when; return the mode it had.

    Going back to a mode where Redis answers is refused (RedisMissedWrites) when the
    comparison recorded writes Redis missed since the tenant entered `primary` (Redis
    did not answer), and when the tenant was in `pgreserve` since Redis last answered
    for it (Redis missed every write then): Redis lacks those holds or counts. Setting
    the mode a tenant has again changes nothing (the misses still count from when it
    entered it). `force` switches anyway (after every bucket was counted again in
    `primary` and the holds Redis does not know have ended). The
    comparison is written within a second or so of each request: a miss in the last
    moments before the switch may not be seen yet."""
    chosen = Mode.parse(mode.value if isinstance(mode, Mode) else mode)
    changed_by = changed_by.strip()
    if not 1 <= len(changed_by) <= 200:
        raise errors.InvalidRequest("changed_by must be 1 to 200 characters", field="by")
    if chosen.answers_from_redis and not force:
        since = await db.fetch(queries["rollout_pgreserve_since_redis"], {"tenant": tenant},
                               op=OP_MODE)
        if since and since[0][0] is not None:
            raise errors.RedisMissedWrites(
                f"this tenant was in pgreserve mode (from {since[0][0]:%Y-%m-%d %H:%M:%S%z}) "
                "since Redis last answered for it: Redis missed every write from then on "
                "and would sell units pgreserve holds. In primary, count every bucket "
                "again (PUT /v1/stock) and let the holds taken in pgreserve mode end, then "
                "switch with --force; or stay in primary.")
        missed = await db.fetch(queries["rollout_redis_miss_list"], (tenant,), op=OP_MODE)
        count, first_at, first_key = missed[0] if missed else (0, None, None)
        if count:
            raise errors.RedisMissedWrites(
                f"Redis missed {count} write(s) since this tenant entered primary (the "
                f"first at {first_at:%Y-%m-%d %H:%M:%S%z}, request key {first_key}): it "
                "does not have every hold and count, and would sell units pgreserve holds. "
                "Count every bucket again (PUT /v1/stock) and let the holds taken since "
                "end, then switch with --force; or stay in primary.")
    try:
        # (not run again after a lost reply: its second run would report the new mode
        # as the prior one and record a second switch)
        rows = await db.fetch(queries["rollout_mode_set"],
                              {"tenant": tenant, "mode": chosen.value, "by": changed_by},
                              op=OP_MODE_SET, replay_safe=False)
    except psycopg.errors.ForeignKeyViolation:
        raise errors.UnknownTenant(f"unknown tenant {tenant}") from None
    return Mode(rows[0][0])


def utcnow() -> datetime:
    return datetime.now(UTC)
