"""The API process's one metrics object: the ops metrics plus the HTTP layer's counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from ..ops.metrics import OpsMetrics


class ApiMetrics(OpsMetrics):
    """Every metric of one API process, in one registry (tests build several apps)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.http_requests = Counter(
            "pgreserve_http_requests", "HTTP requests by route and status",
            ["method", "route", "status"], registry=r)
        self.http_reserve_outcomes = Counter(
            "pgreserve_reservation_outcomes", "Reserve requests by outcome",
            ["outcome", "replayed"], registry=r)
        self.http_transitions = Counter(
            "pgreserve_reservation_transitions", "Claims, releases and extends",
            ["operation", "result"], registry=r)
