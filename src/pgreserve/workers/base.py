"""The shape every background worker shares: config, run_once(), a loop, clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# The deadline of each database call a worker makes (TxSettings.call_deadline_s):
# past the statement_timeout and its retries, so only a database that stops
# answering meets it; the round fails (logged) and the next one starts.
WORKER_CALL_DEADLINE_S = 30.0
# How long a stopping process lets its workers finish their round; then the
# ones still waiting (on a database that does not answer) are cancelled.
SHUTDOWN_GRACE_S = 5.0


@dataclass(frozen=True)
class LoopConfig:
    interval_s: float = 1.0  # sleep between rounds that found nothing to do

    def __post_init__(self) -> None:
        if not 0.01 <= self.interval_s <= 3600:
            raise ValueError("interval_s must be between 0.01 and 3600 seconds")


class Worker(Protocol):
    name: str
    loop_config: LoopConfig

    async def run_once(self) -> int:
        """Do one round of work; return how much was done (0 = nothing to do)."""
        ...


async def run_forever(worker: Worker, stop: asyncio.Event) -> None:
    """Run rounds back to back while they find work; sleep only after an idle round."""
    while not stop.is_set():
        try:
            done = await worker.run_once()
        except Exception:  # a worker must outlive a failed round; the error is logged
            log.exception("%s: round failed", worker.name)
            done = 0
        if done == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=worker.loop_config.interval_s)
