"""Figures read from the database on demand: hot buckets, holds by state, refills.

Shared by /metrics (at scrape time) and the /ops page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..db.database import Database, Op
from ..db.queries import queries

FIGURES = Op("ops", "figures", "ops/figures")

@dataclass(frozen=True)
class HotBucket:
    tenant_id: int
    tenant: str
    sku: str
    location: str
    strategy: str
    on_hand: int
    free: int
    pool_cap: int
    pool: int
    held: int
    hold_lines: int

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Figures:
    hot_buckets: list[HotBucket] = field(default_factory=list)
    holds: dict[str, int] = field(default_factory=dict)
    refills_all: int = 0  # pool_replenish_v1 calls: every refill, inline or background
    refills_background: int = 0  # pool_refill_v1 calls (the Replenisher)
    track_functions: str = "none"
    frozen: list[dict[str, Any]] = field(default_factory=list)  # the live freezes

    @property
    def refills_inline(self) -> int:
        """Refills made by buyers inside reserve (database-wide, since the stats reset)."""
        return max(0, self.refills_all - self.refills_background)

    def as_json(self) -> dict[str, Any]:
        return {"hot_buckets": [b.as_json() for b in self.hot_buckets], "holds": self.holds,
                "refills": {"inline": self.refills_inline,
                            "background": self.refills_background,
                            "track_functions": self.track_functions},
                "frozen": self.frozen}


async def read_figures(db: Database, hot: int = 10) -> Figures:
    """One consistent-enough read of the figures (three short autocommit queries)."""
    rows = await db.fetch(queries["bucket_hot_list"], (hot,), op=FIGURES)
    buckets = [HotBucket(int(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), int(r[5]),
                         int(r[6]), int(r[7]), int(r[8]), int(r[9]), int(r[10])) for r in rows]
    holds = {str(r[0]): int(r[1])
             for r in await db.fetch(queries["hold_count_by_state"], op=FIGURES)}
    ref = await db.fetch(queries["refill_count"], op=FIGURES)
    all_, background, track = (int(ref[0][0]), int(ref[0][1]), str(ref[0][2])) if ref \
        else (0, 0, "none")
    frozen = [r[0] for r in await db.fetch(queries["freeze_live_list"], (None, None),
                                           op=FIGURES)]
    return Figures(buckets, holds, all_, background, track, frozen)
