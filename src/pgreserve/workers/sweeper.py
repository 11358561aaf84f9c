"""The expiry sweeper: gives back the units of reservations past their expiry.

Availability never waits for it (expired holds stop counting at expires_at);
it turns due reservations into state `expired` and puts their units back,
500 at most per transaction. Several sweepers may run at once (SKIP LOCKED).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.service import SWEEP_BATCH_MAX, ReservationService
from .base import LoopConfig


@dataclass(frozen=True)
class SweeperConfig:
    batch: int = SWEEP_BATCH_MAX
    max_batches_per_round: int = 20
    loop: LoopConfig = field(default_factory=LoopConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= SWEEP_BATCH_MAX:
            raise ValueError(f"batch must be between 1 and {SWEEP_BATCH_MAX}")
        if self.max_batches_per_round < 1:
            raise ValueError("max_batches_per_round must be at least 1")


class Sweeper:
    name = "sweeper"

    def __init__(self, service: ReservationService, config: SweeperConfig | None = None) -> None:
        self.service = service
        self.config = config or SweeperConfig()
        self.loop_config = self.config.loop
        self.expired_total = 0

    async def run_once(self) -> int:
        """Expire due reservations in short transactions; return how many expired."""
        total = 0
        for _ in range(self.config.max_batches_per_round):
            n = await self.service.expire_due(self.config.batch)
            total += n
            if n < self.config.batch:
                break
        self.expired_total += total
        return total
