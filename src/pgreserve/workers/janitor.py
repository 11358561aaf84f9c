"""The request-key janitor: forgets Idempotency-Keys (request keys) past their retention.

A key must be kept at least as long as clients may retry with it (default 24 h);
after that its stored outcome is deleted, in batches, so request_ledger stays small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from ..core.service import ReservationService
from .base import LoopConfig

DEFAULT_KEEP = timedelta(hours=24)


@dataclass(frozen=True)
class JanitorConfig:
    keep: timedelta = DEFAULT_KEEP
    batch: int = 1000
    max_batches_per_round: int = 20
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(interval_s=60.0))

    def __post_init__(self) -> None:
        if self.keep < timedelta(0):
            raise ValueError("keep must not be negative")
        if not 1 <= self.batch <= 100_000:
            raise ValueError("batch must be between 1 and 100000")
        if self.max_batches_per_round < 1:
            raise ValueError("max_batches_per_round must be at least 1")


class Janitor:
    name = "janitor"

    def __init__(self, service: ReservationService, config: JanitorConfig | None = None) -> None:
        self.service = service
        self.config = config or JanitorConfig()
        self.loop_config = self.config.loop
        self.purged_total = 0

    async def run_once(self) -> int:
        """Delete request keys older than the retention; return how many went."""
        total = 0
        for _ in range(self.config.max_batches_per_round):
            n = await self.service.purge_request_keys(self.config.keep, self.config.batch)
            total += n
            if n < self.config.batch:
                break
        self.purged_total += total
        return total
