"""The background replenisher: keeps pool buckets above their low-water mark.

Buyers refill inline only when the pool is dry; this worker refills earlier,
off the checkout path, one bucket per short transaction. A bucket another
transaction is refilling is skipped (SKIP LOCKED), so several copies can run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.service import ReservationService
from .base import LoopConfig


@dataclass(frozen=True)
class ReplenisherConfig:
    low_water: float = 0.3  # refill when the pool is below this share of pool_cap
    buckets_per_round: int = 100
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(interval_s=0.2))

    def __post_init__(self) -> None:
        if not 0.0 < self.low_water <= 1.0:
            raise ValueError("low_water must be in (0, 1]")
        if self.buckets_per_round < 1:
            raise ValueError("buckets_per_round must be at least 1")


class Replenisher:
    name = "replenisher"

    def __init__(self, service: ReservationService,
                 config: ReplenisherConfig | None = None) -> None:
        self.service = service
        self.config = config or ReplenisherConfig()
        self.loop_config = self.config.loop
        self.units_added = 0
        self.refills = 0

    async def run_once(self) -> int:
        """Refill every bucket below the low-water mark; return the units added."""
        added = 0
        due = await self.service.refill_candidates(self.config.low_water,
                                                   self.config.buckets_per_round)
        for tenant, bucket in due:
            n = await self.service.refill(tenant, bucket)
            if n:
                added += n
                self.refills += 1
        self.units_added += added
        return added
