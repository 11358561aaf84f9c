"""A Hypothesis state machine: an in-memory model of stock and holds against the real database.

Rules: set-stock, adjust (receipt), reserve (carts of 1-3 lines), claim,
release, extend, advance the (injected) clock, sweep, switch strategy, set a
safety stock or a backorder limit, and retry a previous reserve with its key.
A line beyond what its bucket can promise takes the rest from the allowance:
the model knows how much, and that a claim makes it owed until receipts pay it. After every step each bucket's
on_hand/reserved/available must equal the model's and invariant_violations()
must be empty. One database for the whole test, a fresh tenant per example.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pgreserve import Database, ReservationService, Status
from pgreserve.errors import (
    ExtendWouldShorten,
    ReservationClaimed,
    ReservationExpired,
    ReservationNotActive,
    ReservationReleased,
)

BUCKETS = ("b0", "b1", "b2")
LOC = "w"
T = TypeVar("T")


@dataclass
class Hold:
    """The model of one reservation."""

    id: str
    lines: dict[str, int]
    status: str  # active | claimed | released | expired (as stored)
    expires_at: datetime
    backordered: dict[str, int]  # of each line, units beyond on_hand


class Clock:
    """The injected clock the machine moves."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class ReservationModel(RuleBasedStateMachine):
    """The service against a model that knows what must be true."""

    loop: asyncio.AbstractEventLoop
    db: Database

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.svc = ReservationService(self.db, clock=self.clock)
        self.tenant = self.run(self.svc.create_tenant(f"model-{uuid.uuid4()}")).id
        self.on_hand = dict.fromkeys(BUCKETS, 5)
        self.safety = dict.fromkeys(BUCKETS, 0)
        self.limit = dict.fromkeys(BUCKETS, 0)
        self.owed = dict.fromkeys(BUCKETS, 0)
        self.holds: dict[str, Hold] = {}
        self.requests: list[tuple[str, tuple[tuple[str, str, int], ...], int, str | None]] = []
        self.n = 0
        # b0 plain, b1 with a backorder allowance, b2 with safety stock and an allowance
        self.safety.update(b2=1)
        self.limit.update(b1=3, b2=2)
        for b in BUCKETS:
            self.run(self.svc.set_stock(self.tenant, b, LOC, 5, strategy="row",
                                        safety_stock=self.safety[b],
                                        backorder_limit=self.limit[b]))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # -- the model's arithmetic -----------------------------------------------------

    def live(self, h: Hold) -> bool:
        return h.status == "active" and h.expires_at > self.clock.now

    def reserved(self, bucket: str) -> int:
        return sum(h.lines.get(bucket, 0) for h in self.holds.values() if self.live(h))

    def live_backordered(self, bucket: str) -> int:
        return sum(h.backordered.get(bucket, 0) for h in self.holds.values() if self.live(h))

    def promisable(self, bucket: str) -> int:
        """On hand, less what live holds keep of it, less the safety stock."""
        on_hand_held = self.reserved(bucket) - self.live_backordered(bucket)
        return max(0, self.on_hand[bucket] - on_hand_held - self.safety[bucket])

    def allowance(self, bucket: str) -> int:
        """The backorder allowance left: the limit less live backorders and what is owed."""
        return max(0, self.limit[bucket] - self.live_backordered(bucket) - self.owed[bucket])

    def available(self, bucket: str) -> int:
        return self.promisable(bucket) + self.allowance(bucket)

    def held_any(self, bucket: str) -> int:
        """Units on hand still set aside, counting holds past expiry nobody has given up yet
        (upper bound); backordered units are not on hand."""
        return sum(h.lines.get(bucket, 0) - h.backordered.get(bucket, 0)
                   for h in self.holds.values() if h.status == "active")

    # -- rules ---------------------------------------------------------------------

    @rule(bucket=st.sampled_from(BUCKETS), extra=st.integers(0, 6))
    def set_stock(self, bucket: str, extra: int) -> None:
        """A count never below what is held: applied exactly."""
        target = self.held_any(bucket) + extra
        if self.on_hand[bucket] - self.held_any(bucket) < 0:
            return
        self.run(self.svc.set_stock(self.tenant, bucket, LOC, target))
        self.on_hand[bucket] = target

    @rule(bucket=st.sampled_from(BUCKETS), delta=st.integers(1, 5))
    def adjust(self, bucket: str, delta: int) -> None:
        """A receipt pays what is owed first; the rest is on hand."""
        self.n += 1
        view = self.run(self.svc.adjust_stock(self.tenant, f"adj-{self.n}", bucket, LOC, delta))
        paid = min(self.owed[bucket], delta)
        self.owed[bucket] -= paid
        self.on_hand[bucket] += delta - paid
        assert (view.on_hand, view.backorder_owed) == (self.on_hand[bucket], self.owed[bucket])

    @rule(cart=st.dictionaries(st.sampled_from(BUCKETS), st.integers(1, 4), min_size=1,
                               max_size=3),
          ttl=st.sampled_from([5, 30, 120]))
    def reserve(self, cart: dict[str, int], ttl: int) -> None:
        self.n += 1
        key = f"r-{self.n}"
        lines = tuple((b, LOC, q) for b, q in sorted(cart.items()))
        fits = all(q <= self.available(b) for b, q in cart.items())
        backordered = {b: q - min(q, self.promisable(b)) for b, q in cart.items()}
        out = self.run(self.svc.reserve(self.tenant, key, list(lines), ttl=ttl))
        assert out.held == fits, (cart, {b: self.available(b) for b in cart})
        rid = out.reservation.id if out.reservation else None
        if rid is not None:
            assert out.reservation is not None
            assert {x.sku: x.backordered for x in out.reservation.lines} == backordered
            self.holds[rid] = Hold(rid, dict(cart), "active",
                                   self.clock.now + timedelta(seconds=ttl), backordered)
        self.requests.append((key, lines, ttl, rid))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def retry_same_key(self, data: st.DataObject) -> None:
        """The same key and cart again: the first answer, no new effect."""
        key, lines, ttl, rid = data.draw(st.sampled_from(self.requests))
        out = self.run(self.svc.reserve(self.tenant, key, list(lines), ttl=ttl))
        assert out.replayed
        assert (out.reservation.id if out.reservation else None) == rid

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        h = self.holds[data.draw(st.sampled_from(list(self.holds)))]
        if h.status == "active" and not self.live(h) and any(h.backordered.values()):
            # past expiry, not swept: whether a reserve gave it up already (its
            # backorders back) is not the model's to know
            return
        try:
            res = self.run(self.svc.claim(self.tenant, h.id))
        except ReservationReleased:
            assert h.status == "released"
            return
        except ReservationExpired:
            # past expiry and its units went to someone else: nothing changed
            assert not self.live(h) and h.status in ("active", "expired")
            return
        assert res.status is Status.CLAIMED
        if h.status != "claimed":
            assert h.status in ("active", "expired")
            # a claim past expiry takes the units again only if they are there;
            # a held line's backordered units become owed
            for b, q in h.lines.items():
                owed = h.backordered[b] if h.status == "active" else 0
                self.on_hand[b] -= q - owed
                self.owed[b] += owed
            h.status = "claimed"

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        h = self.holds[data.draw(st.sampled_from(list(self.holds)))]
        try:
            res = self.run(self.svc.release(self.tenant, h.id))
        except ReservationClaimed:
            assert h.status == "claimed"
            return
        assert h.status != "claimed"
        if h.status == "active":
            h.status = "released"
        assert res.status.value == h.status

    @precondition(lambda self: self.holds)
    @rule(data=st.data(), ttl=st.sampled_from([5, 60]), shorten=st.booleans())
    def extend(self, data: st.DataObject, ttl: int, shorten: bool) -> None:
        h = self.holds[data.draw(st.sampled_from(list(self.holds)))]
        if not self.live(h):
            try:
                self.run(self.svc.extend(self.tenant, h.id, ttl, allow_shorten=shorten))
            except ReservationNotActive:
                return
            raise AssertionError(f"extended a {h.status} reservation past its expiry")
        wanted = self.clock.now + timedelta(seconds=ttl)
        if wanted < h.expires_at and not shorten:
            try:
                self.run(self.svc.extend(self.tenant, h.id, ttl))
            except ExtendWouldShorten:
                return  # and the hold keeps its expiry (the model's stays)
            raise AssertionError("an extend ended a hold sooner without allow_shorten")
        res = self.run(self.svc.extend(self.tenant, h.id, ttl, allow_shorten=shorten))
        h.expires_at = wanted
        assert res.expires_at == h.expires_at

    @rule(seconds=st.integers(1, 90))
    def advance_clock(self, seconds: int) -> None:
        self.clock.now += timedelta(seconds=seconds)

    @rule()
    def sweep(self) -> None:
        due = [h for h in self.holds.values()
               if h.status == "active" and h.expires_at <= self.clock.now]
        n = self.run(self.svc.expire_due(500))
        # other tenants' examples left due holds too; ours are all among them
        assert n >= len(due)
        for h in due:
            h.status = "expired"
            assert self.run(self.svc.get_reservation(self.tenant, h.id)).status is Status.EXPIRED

    @rule(bucket=st.sampled_from(BUCKETS), strategy=st.sampled_from(["row", "pool"]),
          cap=st.sampled_from([None, 1, 3, 1000]))
    def switch_strategy(self, bucket: str, strategy: str, cap: int | None) -> None:
        view = self.run(self.svc.set_stock(self.tenant, bucket, LOC, self.on_hand[bucket],
                                           strategy=strategy, pool_cap=cap))
        assert view.strategy.value == strategy

    @rule(bucket=st.sampled_from(BUCKETS), safety=st.integers(0, 4))
    def set_safety_stock(self, bucket: str, safety: int) -> None:
        """A new safety stock with the same count: applied, whatever is held."""
        view = self.run(self.svc.set_stock(self.tenant, bucket, LOC, self.on_hand[bucket],
                                           safety_stock=safety))
        self.safety[bucket] = safety
        assert view.safety_stock == safety

    @rule(bucket=st.sampled_from(BUCKETS), limit=st.integers(0, 4))
    def set_backorder_limit(self, bucket: str, limit: int) -> None:
        """A new backorder limit with the same count: applied, whatever is backordered."""
        view = self.run(self.svc.set_stock(self.tenant, bucket, LOC, self.on_hand[bucket],
                                           backorder_limit=limit))
        self.limit[bucket] = limit
        assert view.backorder_limit == limit

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def matches_the_database(self) -> None:
        for b in BUCKETS:
            view = self.run(self.svc.get_stock(self.tenant, b, LOC))
            want = (self.on_hand[b], self.reserved(b), self.available(b))
            assert (view.on_hand, view.reserved, view.available) == want, (b, view)
        assert self.run(self.svc.invariant_violations(self.tenant)) == []
        for h in self.holds.values():
            got = self.run(self.svc.get_reservation(self.tenant, h.id)).status.value
            shown = "expired" if h.status == "active" and not self.live(h) else h.status
            assert got == shown, (h, got)


def test_model_against_database(dsn: str) -> None:
    """Random sequences of every operation keep the database equal to the model, with no invariant breach."""
    loop = asyncio.new_event_loop()
    db = loop.run_until_complete(Database(dsn, min_size=1, max_size=2).open())
    ReservationModel.loop, ReservationModel.db = loop, db
    try:
        run_state_machine_as_test(ReservationModel, settings=settings(
            max_examples=20, stateful_step_count=30, deadline=None, derandomize=True,
            suppress_health_check=list(HealthCheck), database=None))
    finally:
        loop.run_until_complete(db.close())
        loop.close()
