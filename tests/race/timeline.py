"""Per-bucket bounds on what a bucket could have served, from the checker's own history.

The checker knows every change it made and when it was in flight: each change
committed at an unknown instant inside [sent, answered]. From those intervals
it bounds, at every instant t,

- P(t), the physical units not sold: the last recount (`set_stock`) that may
  have committed by t, plus the adjustments after it, minus the claims;
- H(t), the units held by holds not yet past their expiry.

A lower bound of P - H is what the bucket surely could serve at t; an upper
bound is the most it could. Each bound takes every uncertain commit the way
that weakens the verdict (see race_checker's docstring for the rules).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

INF = float("inf")


@dataclass(frozen=True)
class AdminChange:
    """A recount (absolute) or an adjustment (delta) of one bucket, committed in [start, end]."""

    start: float
    end: float
    absolute: bool
    value: int


@dataclass(frozen=True)
class Sale:
    """A claim's line: the bucket's physical units fell by quantity at one instant in [start, end]."""

    start: float
    end: float
    quantity: int


@dataclass(frozen=True)
class HoldSpan:
    """A hold's line: committed in [start, end]; surely counting until sure_until; possibly until may_until."""

    rid: str
    start: float
    end: float
    sure_until: float
    may_until: float
    quantity: int


def _prefix(values: list[int]) -> list[int]:
    return [0, *accumulate(values)]


@dataclass
class Timeline:
    """Everything the checker did to one bucket; call build() once, then ask for bounds."""

    admin: list[AdminChange] = field(default_factory=list)
    sales: list[Sale] = field(default_factory=list)
    holds: list[HoldSpan] = field(default_factory=list)
    # instants after which the checker no longer knows the history (an unknown outcome)
    uncertain_from: float = INF

    def build(self) -> None:
        self.admin.sort(key=lambda a: a.start)
        for before, after in zip(self.admin, self.admin[1:], strict=False):
            assert before.end <= after.start, "one admin task per bucket: changes never overlap"
        self._a_start = [a.start for a in self.admin]
        self._a_adjust = _prefix([0 if a.absolute else a.value for a in self.admin])
        self._last_set: list[int] = []
        last = -1
        for i, a in enumerate(self.admin):
            if a.absolute:
                last = i
            self._last_set.append(last)
        self.sales.sort(key=lambda s: s.start)
        self._s_start = [s.start for s in self.sales]
        self._s_start_pre = _prefix([s.quantity for s in self.sales])
        by_end = sorted(self.sales, key=lambda s: s.end)
        self._s_end = [s.end for s in by_end]
        self._s_end_pre = _prefix([s.quantity for s in by_end])

        def sorted_prefix(pairs: list[tuple[float, int]]) -> tuple[list[float], list[int]]:
            pairs.sort()
            return [p[0] for p in pairs], _prefix([p[1] for p in pairs])

        self._h_start = sorted_prefix([(h.start, h.quantity) for h in self.holds])
        self._h_may = sorted_prefix([(h.may_until, h.quantity) for h in self.holds])
        sure = [h for h in self.holds if h.sure_until > h.end]
        self._h_end = sorted_prefix([(h.end, h.quantity) for h in sure])
        self._h_sure = sorted_prefix([(h.sure_until, h.quantity) for h in sure])
        points = {a.start for a in self.admin} | {a.end for a in self.admin}
        points |= {s.start for s in self.sales} | {s.end for s in self.sales}
        for h in self.holds:
            points |= {h.start, h.end, h.sure_until, h.may_until}
        self._points = sorted(p for p in points if p < INF)

    # -- pieces ------------------------------------------------------------------

    def _sales_possibly_between(self, after: float, t: float) -> int:
        """Units of claims that may have committed after `after` and by t."""
        by_t = self._s_start_pre[bisect_right(self._s_start, t)]
        surely_before = self._s_end_pre[bisect_right(self._s_end, after)]
        return by_t - surely_before

    def _sales_surely_between(self, after: float, t: float) -> int:
        """Units of claims that surely committed after `after` and by t."""
        total = 0
        for i in range(bisect_right(self._s_start, after), bisect_right(self._s_start, t)):
            if self.sales[i].end <= t:
                total += self.sales[i].quantity
        return total

    def physical(self, t: float) -> tuple[int, int]:
        """Lower and upper bound of the unsold physical units at instant t."""
        i = bisect_right(self._a_start, t) - 1
        assert i >= 0, "queried before the bucket existed"
        flying = self.admin[i].end > t
        sure = i - 1 if flying else i
        bases: list[tuple[int, int, int]] = []  # (base index, low extra, high extra)
        j = self._last_set[sure] if sure >= 0 else -1
        if j >= 0:
            adj = self._a_adjust[sure + 1] - self._a_adjust[j + 1]
            lo_extra = hi_extra = adj
            if flying and not self.admin[i].absolute:
                lo_extra += min(0, self.admin[i].value)
                hi_extra += max(0, self.admin[i].value)
            bases.append((j, lo_extra, hi_extra))
        if flying and self.admin[i].absolute:
            bases.append((i, 0, 0))
        lows, highs = [], []
        for b, lo_extra, hi_extra in bases:
            base = self.admin[b]
            lows.append(base.value + lo_extra - self._sales_possibly_between(base.start, t))
            highs.append(base.value + hi_extra - self._sales_surely_between(base.end, t))
        return min(lows), max(highs)

    def held_at_most(self, t: float) -> int:
        starts, spre = self._h_start
        mays, mpre = self._h_may
        return spre[bisect_right(starts, t)] - mpre[bisect_left(mays, t)]

    def held_at_least(self, t: float) -> int:
        ends, epre = self._h_end
        sures, spre = self._h_sure
        return epre[bisect_right(ends, t)] - spre[bisect_right(sures, t)]

    def instants(self, start: float, end: float) -> list[float]:
        """Start, then every instant in [start, end] where a bound can change (and just after)."""
        out = [start]
        for p in self._points[bisect_left(self._points, start):bisect_right(self._points, end)]:
            out.append(p)
            if p + 1e-6 <= end:
                out.append(p + 1e-6)
        return out

    # -- verdicts ----------------------------------------------------------------

    def surely_available_throughout(self, start: float, end: float, enough: int) -> int:
        """The fewest units the bucket may have had available at any instant of [start, end]
        (stops early once that is below `enough`)."""
        least = None
        for t in self.instants(start, end):
            lo = self.physical(t)[0] - self.held_at_most(t)
            least = lo if least is None else min(least, lo)
            if least < enough:
                break
        assert least is not None
        return least

    def possibly_available_at_best(self, start: float, end: float, own: HoldSpan | None,
                                   enough: int) -> int:
        """The most units the bucket may have had available at any instant of [start, end],
        not counting the hold `own` being judged (stops early once that reaches `enough`)."""
        most = None
        for t in self.instants(start, end):
            held = self.held_at_least(t)
            if own is not None and own.end <= t < own.sure_until and own.sure_until > own.end:
                held -= own.quantity
            hi = self.physical(t)[1] - held
            most = hi if most is None else max(most, hi)
            if most >= enough:
                break
        assert most is not None
        return most
