"""What a flash-sale run does: a validated, frozen configuration and its request plan."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from ..errors import InvalidRequest

Fate = Literal["claim", "release", "expire", "keep"]
STRATEGIES = ("row", "pool")
MAX_BUYERS = 250  # the embedded server allows 300 connections
MAX_UNITS = 10_000_000
MAX_PROCESSES = 32


@dataclass(frozen=True)
class Scenario:
    """One benchmark configuration; every field is checked when it is built."""

    units: int = 5_000
    """Units seeded in each SKU's bucket."""
    requests: int = 15_000
    """Reserve requests sent in total (retries included)."""
    buyers: int = 64
    """Concurrent buyers, one connection each."""
    processes: int = 1
    """Client processes the buyers are spread over (each an asyncio loop)."""
    quantity: int = 1
    """Units per request."""
    skus: int = 1
    hot_share: float = 1.0
    """Share of requests for SKU 0; the rest spread evenly over the other SKUs."""
    retry_rate: float = 0.0
    """Share of requests that re-send the buyer's previous request with the same key."""
    claim: float = 0.0
    release: float = 0.0
    expire: float = 0.0
    """Shares of granted holds that are claimed, released, or left to expire; the rest stay held."""
    expire_ttl_s: float = 1.0
    hold_ttl_s: float = 900.0
    strategies: tuple[str, ...] = ("row",)
    batching: tuple[bool, ...] = (True,)
    """Each strategy runs once per mode: True batches one-line requests through the
    service's per-bucket combiner (group commit), False sends each on its own."""
    pool_cap: int = 1_000
    replenish: bool = True
    """Run the background replenisher during pool runs, as `pgreserve worker` does."""
    durable: bool = True
    seed: int = 1
    window: int = 10_000
    """Size of the first and last windows of holds compared for latency climb."""
    location: str = field(default="wh-1")

    def __post_init__(self) -> None:
        _int(self.units, "units", 1, MAX_UNITS)
        _int(self.requests, "requests", 1, 50_000_000)
        _int(self.buyers, "buyers", 1, MAX_BUYERS)
        _int(self.processes, "processes", 1, min(MAX_PROCESSES, self.buyers))
        _int(self.quantity, "quantity", 1, self.units)
        _int(self.skus, "skus", 1, 10_000)
        _int(self.pool_cap, "pool_cap", 1, 100_000)
        _int(self.seed, "seed", 0, 2**63 - 1)
        _int(self.window, "window", 1, 10_000_000)
        for name in ("hot_share", "retry_rate", "claim", "release", "expire"):
            _share(getattr(self, name), name)
        if self.retry_rate >= 1.0:
            raise InvalidRequest("retry_rate must be below 1")
        if self.claim + self.release + self.expire > 1.0 + 1e-9:
            raise InvalidRequest("claim + release + expire shares must not exceed 1")
        if not 1.0 <= self.expire_ttl_s <= 3600.0:
            raise InvalidRequest("expire_ttl_s must be between 1 and 3600 seconds")
        if not self.expire_ttl_s <= self.hold_ttl_s <= 86_400.0:
            raise InvalidRequest("hold_ttl_s must be between expire_ttl_s and 86400 seconds")
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise InvalidRequest(f"strategies must be a non-empty subset of {STRATEGIES}")
        if len(set(self.strategies)) != len(self.strategies):
            raise InvalidRequest("strategies must not repeat")
        if not self.batching or any(not isinstance(b, bool) for b in self.batching) \
                or len(set(self.batching)) != len(self.batching):
            raise InvalidRequest("batching must be a non-empty tuple of distinct booleans")

    @classmethod
    def long_run(cls, takes: int, **overrides: Any) -> Scenario:
        """The latency-climb run: `takes` single-unit holds on one never-sold-out pool bucket."""
        base: dict[str, Any] = {"units": takes, "requests": takes, "quantity": 1, "skus": 1,
                                "hot_share": 1.0, "retry_rate": 0.0, "strategies": ("pool",)}
        base.update(overrides)
        return cls(**base)

    def with_(self, **changes: Any) -> Scenario:
        return replace(self, **changes)

    @property
    def seeded_units(self) -> int:
        return self.units * self.skus

    def sku(self, index: int) -> str:
        return f"sku-{index}"

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["strategies"] = list(self.strategies)
        doc["batching"] = list(self.batching)
        return doc


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan. A retry re-sends the buyer's previous request as it was."""

    seq: int
    sku: int
    quantity: int
    retry: bool
    fate: Fate


def plan(scenario: Scenario) -> list[PlannedRequest]:
    """The requests of a run, the same for every strategy and every run with the same seed."""
    rng = random.Random(scenario.seed)  # noqa: S311 - a plan replayable by its seed, no secret
    fates: list[Fate] = ["claim", "release", "expire", "keep"]
    weights = [scenario.claim, scenario.release, scenario.expire,
               max(0.0, 1.0 - scenario.claim - scenario.release - scenario.expire)]
    out: list[PlannedRequest] = []
    for seq in range(scenario.requests):
        if scenario.skus == 1 or rng.random() < scenario.hot_share:
            sku = 0
        else:
            sku = rng.randrange(1, scenario.skus)
        retry = seq > 0 and rng.random() < scenario.retry_rate
        fate = rng.choices(fates, weights)[0]
        out.append(PlannedRequest(seq, sku, scenario.quantity, retry, fate))
    return out


def _int(value: Any, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer between {low} and {high}")


def _share(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidRequest(f"{name} must be a number between 0 and 1")
