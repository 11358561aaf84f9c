"""The legacy hold store: stock counters and holds in Redis, as teams run it before pgreserve.

One counter key per (sku, location) holds the units available; a reserve checks
and decrements the counters of every line of a cart in one Lua script (all or
none), a release increments them again, and a hold is a key with a TTL: once
Redis has expired it, the units go back to the counter (the next claim or
release of that hold, or `expire_due`, gives them back, once). A claim removes
the hold; the sale is written elsewhere (the order ledger), after the script.

Every key starts with `<namespace>:t<tenant>:`; names are percent-encoded so a
`:` in a sku or location cannot make two buckets share a key.

    stock:<location>:<sku>   units available (the counter)
    held:<location>:<sku>    units in live or not yet given back holds
    hold:<id>                the hold itself, expiring with the reservation
    rec:<id>                 hash: lines, times, status, the mode it was taken in,
                             the pgreserve reservation id beside it
    req:<request key>        the stored answer to a reserve (idempotent replay)
    deadlines                sorted set of hold ids by expiry (the give-back sweep)
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar, cast
from urllib.parse import quote

import redis
import redis.asyncio as aioredis

from .. import errors
from ..domain import Line, Reservation, ReserveOutcome, ShortLine, Status

# Kept after a hold ends, so a repeated claim or release answers the same.
RETENTION = timedelta(hours=24)
# How long Redis remembers that an adjustment's request key moved its counter: longer
# than pgreserve keeps request keys by default (24 h), so that a retry pgreserve still
# replays never moves the counter again (keep key_retention_hours below it).
ADJUSTMENT_MEMORY = timedelta(days=7)

# A Redis that does not answer within this fails the call (OutcomeUnknown): in the
# modes where Redis is the secondary store the caller never waits longer for it.
DEFAULT_TIMEOUT_S = 1.0

# Connections to Redis per store (process); more concurrent calls wait for one.
MAX_CONNECTIONS = 100

P = ParamSpec("P")
T = TypeVar("T")


def _answered(f: Callable[Concatenate[RedisHoldStore, P], Coroutine[Any, Any, T]],
              ) -> Callable[Concatenate[RedisHoldStore, P], Coroutine[Any, Any, T]]:
    """A lost or silent Redis is OutcomeUnknown (503, retryable): a write may have been
    applied, and a retry with the same request key replays it or applies it once. So
    is a Redis that answers with an error (out of memory under `noeviction`, a replica
    that is read-only after a failover): a script stopped by an error keeps the writes
    it made before it."""

    @functools.wraps(f)
    async def call(store: RedisHoldStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await f(store, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise errors.OutcomeUnknown(
                f"the legacy Redis store did not answer ({type(exc).__name__}); "
                "retry with the same request key") from exc
        except redis.RedisError as exc:
            raise errors.OutcomeUnknown(
                f"the legacy Redis store refused the command ({type(exc).__name__}: "
                f"{exc}); retry with the same request key") from exc

    return call

@dataclass(frozen=True)
class RefusalMark:
    """What a refusal Redis keeps was given in: the mode, and the pgreserve hold it
    was given over (primary mode; '' for none; None: stored before refusals kept it)."""

    mode: str
    over: str | None


def _mark(doc: dict[str, Any]) -> RefusalMark:
    """A refusal document's mark."""
    over = doc.get("over")
    return RefusalMark(str(doc.get("mode", "")), None if over is None else str(over))


# KEYS: req, hold, rec, deadlines, counters[n], helds[n]
# ARGV: n, id, ttl_ms, lines_json, mode, retention_ms, fingerprint, pg_id, quantities[n],
#       over (a refusal's: the pgreserve hold it was given over, '' for none)
_RESERVE = """
local n = tonumber(ARGV[1])
local prior = redis.call('GET', KEYS[1])
if prior then return {'replay', prior} end
local short = {}
for i = 1, n do
  local have = tonumber(redis.call('GET', KEYS[4 + i]) or '0')
  local want = tonumber(ARGV[8 + i])
  if have < want then
    table.insert(short, {i, want, have})
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local doc
if #short > 0 then
  doc = cjson.encode({held = false, short = short, fp = ARGV[7], mode = ARGV[5],
                      over = ARGV[9 + n]})
  redis.call('SET', KEYS[1], doc, 'PX', ARGV[6])
  return {'short', doc}
end
for i = 1, n do
  redis.call('DECRBY', KEYS[4 + i], ARGV[8 + i])
  redis.call('INCRBY', KEYS[4 + n + i], ARGV[8 + i])
end
local expires = now + tonumber(ARGV[3])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
redis.call('HSET', KEYS[3], 'lines', ARGV[4], 'created', now, 'expires', expires,
           'mode', ARGV[5], 'status', 'held', 'pg', ARGV[8])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[3]) + tonumber(ARGV[6]))
redis.call('ZADD', KEYS[4], expires, ARGV[2])
doc = cjson.encode({held = true, id = ARGV[2], fp = ARGV[7]})
redis.call('SET', KEYS[1], doc, 'PX', ARGV[6])
return {'held', doc}
"""

# KEYS: hold, rec, deadlines, counters[n], helds[n]
# ARGV: n, id, action (claim | sold | release | expire), quantities[n]
# A hold whose key Redis has expired gives its units back (once) and answers 'expired'.
# 'sold' is a claim pgreserve already made (primary mode): it stands even if Redis's
# TTL ran out first, and units an expiry gave back are taken out of the counter again.
_FINISH = """
local n = tonumber(ARGV[1])
local status = redis.call('HGET', KEYS[2], 'status')
if not status then return 'missing' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if status ~= 'held' then
  if ARGV[3] == 'sold' and status == 'expired' then
    for i = 1, n do redis.call('DECRBY', KEYS[3 + i], ARGV[3 + i]) end
    redis.call('HSET', KEYS[2], 'status', 'claimed', 'ended', now)
    return 'claimed'
  end
  return status
end
local live = redis.call('EXISTS', KEYS[1]) == 1
if ARGV[3] == 'expire' and live then return 'held' end
local outcome
if ARGV[3] == 'sold' or (live and ARGV[3] == 'claim') then outcome = 'claimed'
elseif not live then outcome = 'expired'
else outcome = 'released' end
for i = 1, n do
  if outcome ~= 'claimed' then redis.call('INCRBY', KEYS[3 + i], ARGV[3 + i]) end
  redis.call('DECRBY', KEYS[3 + n + i], ARGV[3 + i])
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], 'status', outcome, 'ended', now)
redis.call('ZREM', KEYS[3], ARGV[2])
return outcome
"""

# KEYS: hold, rec, deadlines; ARGV: id, ttl_ms, retention_ms, asked_ms ('' allows a
# sooner end: without it a hold that would then end before it ends now is left alone)
_EXTEND = """
local status = redis.call('HGET', KEYS[2], 'status')
if not status then return 'missing' end
if status ~= 'held' or redis.call('EXISTS', KEYS[1]) == 0 then return 'not_active' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + tonumber(ARGV[2])
if ARGV[4] ~= '' then
  if now + tonumber(ARGV[4]) < tonumber(redis.call('HGET', KEYS[2], 'expires')) then
    return 'would_shorten'
  end
end
redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'expires', expires)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]) + tonumber(ARGV[3]))
redis.call('ZADD', KEYS[3], expires, ARGV[1])
return 'held'
"""

# KEYS: counter, held; ARGV: on_hand. The counter becomes on_hand minus the held units.
_SET_STOCK = """
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local available = tonumber(ARGV[1]) - held
redis.call('SET', KEYS[1], available)
return available
"""


@dataclass(frozen=True)
class HoldRecord:
    """A legacy hold as Redis keeps it: the mode it was taken in and its pgreserve twin."""

    id: str
    mode: str
    status: str
    lines: tuple[Line, ...]
    created_at: datetime
    expires_at: datetime
    ended_at: datetime | None
    pg_id: str | None

    def reservation(self, replayed: bool = False) -> Reservation:
        status = {"held": Status.ACTIVE, "claimed": Status.CLAIMED,
                  "released": Status.RELEASED, "expired": Status.EXPIRED}[self.status]
        return Reservation(
            id=self.id, status=status, created_at=self.created_at,
            expires_at=self.expires_at, lines=self.lines,
            claimed_at=self.ended_at if status is Status.CLAIMED else None,
            released_at=self.ended_at if status is Status.RELEASED else None,
            expired_at=self.ended_at if status is Status.EXPIRED else None,
            replayed=replayed)


# KEYS: counter, applied (the request key's marker); ARGV: delta, retention_ms
_ADJUST = """
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[2]) then
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
return tonumber(redis.call('GET', KEYS[1]) or '0')
"""


def _ms(value: bytes | str | None) -> datetime | None:
    if value is None:
        return None
    return datetime.fromtimestamp(int(value) / 1000, UTC)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisHoldStore:
    """The legacy reserve / claim / release / expiry design against one Redis server."""

    def __init__(self, url: str, *, namespace: str = "pgreserve",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if any(c in namespace for c in ": \n"):
            raise errors.InvalidRequest("namespace may not contain ':', spaces or newlines",
                                        field="namespace")
        self.url = url
        self.namespace = namespace
        try:
            # more callers at once than connections wait their turn (up to timeout_s)
            # instead of failing at once with MaxConnectionsError
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=MAX_CONNECTIONS, timeout=timeout_s,
                socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self.redis: aioredis.Redis = aioredis.Redis.from_pool(pool)  # closed with it
        except ValueError as exc:  # not a redis://, rediss:// or unix:// URL
            raise errors.InvalidRequest(f"legacy Redis URL {url!r}: {exc}",
                                        field="legacy_redis_url") from None
        self._reserve = self.redis.register_script(_RESERVE)
        self._finish = self.redis.register_script(_FINISH)
        self._set_stock = self.redis.register_script(_SET_STOCK)
        self._extend = self.redis.register_script(_EXTEND)
        self._adjust = self.redis.register_script(_ADJUST)

    async def aclose(self) -> None:
        await self.redis.aclose()

    # -- keys ------------------------------------------------------------------

    def key(self, tenant: int, kind: str, *parts: str) -> str:
        encoded = ":".join(quote(p, safe="") for p in parts)
        return f"{self.namespace}:t{tenant}:{kind}:{encoded}" if parts else \
            f"{self.namespace}:t{tenant}:{kind}"

    def counter_key(self, tenant: int, sku: str, location: str) -> str:
        return self.key(tenant, "stock", location, sku)

    def held_key(self, tenant: int, sku: str, location: str) -> str:
        return self.key(tenant, "held", location, sku)

    # -- stock -----------------------------------------------------------------

    @_answered
    async def set_stock(self, tenant: int, sku: str, location: str, on_hand: int) -> int:
        """Count a bucket: the counter becomes on_hand minus its held units; return it."""
        available = await self._set_stock(
            keys=[self.counter_key(tenant, sku, location), self.held_key(tenant, sku, location)],
            args=[on_hand])
        return int(available)

    @_answered
    async def adjust_stock(self, tenant: int, sku: str, location: str, delta: int,
                           request_key: str | None = None) -> int:
        """A receipt (delta > 0) or correction (delta < 0) of the counter; return it.
        Under a request key, once: a retry (after a Redis that did not answer, or a
        replay of the key) finds the key's marker and leaves the counter as it is."""
        counter = self.counter_key(tenant, sku, location)
        if request_key is None:
            return int(await self.redis.incrby(counter, delta))
        return int(await self._adjust(
            keys=[counter, self.key(tenant, "adj", request_key)],
            args=[delta, int(ADJUSTMENT_MEMORY.total_seconds() * 1000)]))

    @_answered
    async def available(self, tenant: int, sku: str, location: str) -> int:
        value = await self.redis.get(self.counter_key(tenant, sku, location))
        return int(value or 0)

    @_answered
    async def held(self, tenant: int, sku: str, location: str) -> int:
        value = await self.redis.get(self.held_key(tenant, sku, location))
        return int(value or 0)

    # -- holds -----------------------------------------------------------------

    async def reserve(self, tenant: int, request_key: str, fingerprint: str,
                      cart: Sequence[Line], ttl: timedelta, *, mode: str = "legacy",
                      hold_id: str | None = None, pg_id: str | None = None) -> ReserveOutcome:
        """Hold every line of a (validated, sorted) cart or none; the answer is kept
        under the request key, and the same key with another cart raises
        IdempotencyKeyReused."""
        outcome, _ = await self.reserve_answer(tenant, request_key, fingerprint, cart, ttl,
                                               mode=mode, hold_id=hold_id, pg_id=pg_id)
        return outcome

    @_answered
    async def reserve_answer(self, tenant: int, request_key: str, fingerprint: str,
                             cart: Sequence[Line], ttl: timedelta, *, mode: str = "legacy",
                             hold_id: str | None = None, pg_id: str | None = None,
                             over: str | None = None) -> tuple[ReserveOutcome, RefusalMark | None]:
        """`reserve`, with what the key's refusal (this one, or the one replayed) was
        given in and over: `over`, the pgreserve hold a refusal in primary mode is given
        over, is kept with it. The mark is None for a hold."""
        hid = hold_id or str(uuid.uuid4())
        lines = [{"sku": x.sku, "location": x.location, "quantity": x.quantity} for x in cart]
        keys = [self.key(tenant, "req", request_key), self.key(tenant, "hold", hid),
                self.key(tenant, "rec", hid), self.key(tenant, "deadlines"),
                *(self.counter_key(tenant, x.sku, x.location) for x in cart),
                *(self.held_key(tenant, x.sku, x.location) for x in cart)]
        args: list[Any] = [len(cart), hid, int(ttl.total_seconds() * 1000), json.dumps(lines),
                           mode, int(RETENTION.total_seconds() * 1000), fingerprint,
                           pg_id or "", *(x.quantity for x in cart), over or ""]
        kind, raw = await self._reserve(keys=keys, args=args)
        doc = json.loads(raw)
        replayed = _text(kind) == "replay"
        if doc["fp"] != fingerprint:
            raise errors.IdempotencyKeyReused(
                "this request key was used before with other parameters")
        if doc["held"]:
            record = await self.record(tenant, doc["id"])
            if record is None:  # retained answer outlived its record: the hold is long over
                raise errors.ReservationNotFound(f"unknown reservation {doc['id']}")
            return ReserveOutcome(True, record.reservation(replayed), (), replayed), None
        short = tuple(ShortLine(cart[int(i) - 1].sku, cart[int(i) - 1].location, int(want),
                                int(have)) for i, want, have in doc["short"])
        return ReserveOutcome(False, None, short, replayed), _mark(doc)

    @_answered
    async def answered(self, tenant: int, request_key: str, fingerprint: str,
                       cart: Sequence[Line],
                       ) -> tuple[ReserveOutcome, str, RefusalMark | None] | None:
        """The answer Redis keeps under a request key, as its replay, with the mode it
        was given in (its hold's; a refusal's own, '' when it predates the field) and a
        refusal's mark (`reserve_answer`); None when Redis keeps none or its hold record
        is gone. Writes nothing."""
        raw = await self.redis.get(self.key(tenant, "req", request_key))
        if raw is None:
            return None
        doc = json.loads(raw)
        if doc["fp"] != fingerprint:
            raise errors.IdempotencyKeyReused(
                "this request key was used before with other parameters")
        if doc["held"]:
            record = await self.record(tenant, doc["id"])
            if record is None:
                return None
            return ReserveOutcome(True, record.reservation(True), (), True), record.mode, None
        short = tuple(ShortLine(cart[int(i) - 1].sku, cart[int(i) - 1].location, int(want),
                                int(have)) for i, want, have in doc["short"])
        return (ReserveOutcome(False, None, short, True), str(doc.get("mode", "")),
                _mark(doc))

    @_answered
    async def answer_mode(self, tenant: int, request_key: str) -> str | None:
        """The mode Redis's answer under a request key was given in (its hold's; a
        refusal's own, '' when it predates the field), or None when Redis keeps none
        (or its hold record is gone). Writes nothing."""
        raw = await self.redis.get(self.key(tenant, "req", request_key))
        if raw is None:
            return None
        doc = json.loads(raw)
        if doc["held"]:
            record = await self.record(tenant, doc["id"])
            return None if record is None else record.mode
        return str(doc.get("mode", ""))

    @_answered
    async def record(self, tenant: int, hold_id: str) -> HoldRecord | None:
        """The hold as Redis keeps it, or None (never taken here, or ended over a day ago)."""
        raw = cast(dict[bytes, bytes],
                   await self.redis.hgetall(self.key(tenant, "rec", hold_id)))
        if not raw:
            return None
        doc = {_text(k): _text(v) for k, v in raw.items()}
        lines = tuple(Line(x["sku"], x["location"], int(x["quantity"]))
                      for x in json.loads(doc["lines"]))
        created = datetime.fromtimestamp(int(doc["created"]) / 1000, UTC)
        expires = datetime.fromtimestamp(int(doc["expires"]) / 1000, UTC)
        return HoldRecord(hold_id, doc["mode"], doc["status"], lines, created, expires,
                          _ms(doc.get("ended")), doc.get("pg") or None)

    @_answered
    async def link(self, tenant: int, hold_id: str, pg_id: str) -> None:
        """Note the pgreserve reservation that mirrors a legacy hold."""
        await self.redis.hset(self.key(tenant, "rec", hold_id), "pg", pg_id)

    @_answered
    async def finish(self, tenant: int, record: HoldRecord, action: str) -> str:
        """Claim, release or expire one hold (action); return its status afterwards."""
        keys = [self.key(tenant, "hold", record.id), self.key(tenant, "rec", record.id),
                self.key(tenant, "deadlines"),
                *(self.counter_key(tenant, x.sku, x.location) for x in record.lines),
                *(self.held_key(tenant, x.sku, x.location) for x in record.lines)]
        args: list[Any] = [len(record.lines), record.id, action,
                           *(x.quantity for x in record.lines)]
        return _text(await self._finish(keys=keys, args=args))

    @_answered
    async def claim(self, tenant: int, hold_id: str, *, sold: bool = False) -> Reservation:
        """Remove the hold for good (the units are sold); repeating it changes nothing.
        `sold`: pgreserve already sold the units, so the claim stands even if Redis's
        TTL ran out first."""
        record = await self._known(tenant, hold_id)
        outcome = await self.finish(tenant, record, "sold" if sold else "claim")
        if outcome == "released":
            raise errors.ReservationReleased(f"reservation {hold_id} was released")
        if outcome == "expired":
            raise errors.ReservationExpired(f"reservation {hold_id} expired")
        return await self._after(tenant, hold_id, replayed=record.status != "held")

    @_answered
    async def release(self, tenant: int, hold_id: str) -> Reservation:
        """Give the units back once; repeating it, or releasing an expired hold, changes nothing."""
        record = await self._known(tenant, hold_id)
        outcome = await self.finish(tenant, record, "release")
        if outcome == "claimed":
            raise errors.ReservationClaimed(f"reservation {hold_id} was claimed")
        return await self._after(tenant, hold_id, replayed=record.status != "held")

    @_answered
    async def extend(self, tenant: int, hold_id: str, ttl: timedelta, *,
                     asked: timedelta | None = None) -> Reservation:
        """A new time to live, counted from now, for a hold that is still live. With
        `asked`, a hold that would then end sooner than it ends now (judged by `asked`, the
        caller's time to live, which may be longer than `ttl`) is left as it is:
        ExtendWouldShorten."""
        await self._known(tenant, hold_id)
        outcome = _text(await self._extend(
            keys=[self.key(tenant, "hold", hold_id), self.key(tenant, "rec", hold_id),
                  self.key(tenant, "deadlines")],
            args=[hold_id, int(ttl.total_seconds() * 1000),
                  int(RETENTION.total_seconds() * 1000),
                  "" if asked is None else int(asked.total_seconds() * 1000)]))
        if outcome == "missing":
            raise errors.ReservationNotFound(f"unknown reservation {hold_id}")
        if outcome == "would_shorten" and asked is not None:
            raise errors.ExtendWouldShorten(
                f"reservation {hold_id} ends later than {asked.total_seconds():g} s from now; "
                "set allow_shorten to end it sooner")
        if outcome != "held":
            raise errors.ReservationNotActive(f"reservation {hold_id} is not active")
        return await self._after(tenant, hold_id, replayed=False)

    @_answered
    async def expire_due(self, tenant: int, limit: int = 500) -> int:
        """Give back the units of holds whose key Redis has expired; return how many."""
        now_s, now_us = await self.redis.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        due = await self.redis.zrangebyscore(self.key(tenant, "deadlines"), "-inf", now_ms,
                                             start=0, num=limit)
        done = 0
        for raw in due:
            hid = _text(cast(bytes, raw))
            record = await self.record(tenant, hid)
            if record is None:
                await self.redis.zrem(self.key(tenant, "deadlines"), hid)
                continue
            if await self.finish(tenant, record, "expire") == "expired" and \
                    record.status == "held":
                done += 1
        return done

    async def _known(self, tenant: int, hold_id: str) -> HoldRecord:
        record = await self.record(tenant, hold_id)
        if record is None:
            raise errors.ReservationNotFound(f"unknown reservation {hold_id}")
        return record

    async def _after(self, tenant: int, hold_id: str, *, replayed: bool) -> Reservation:
        record = await self._known(tenant, hold_id)
        return record.reservation(replayed)
