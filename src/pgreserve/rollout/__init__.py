"""Rolling pgreserve out beside a legacy Redis hold store: modes per tenant,
the comparison of both stores' answers, and its report."""

from .modes import Mode, ModeBook, set_mode
from .redis_store import RedisHoldStore
from .router import Rollout

__all__ = ["Mode", "ModeBook", "RedisHoldStore", "Rollout", "set_mode"]
