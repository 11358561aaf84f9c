"""The API process's one metrics object: the ops metrics plus the HTTP layer's counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..ops.metrics import LATENCY_BUCKETS, OpsMetrics


class ApiMetrics(OpsMetrics):
    """Every metric of one API process, in one registry (tests build several apps)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        # `route` is the route template (/v1/reservations/{reservation_id}) or
        # "unmatched", never the raw path: the label set stays bounded.
        self.http_requests = Counter(
            "pgreserve_http_requests", "HTTP requests by route and status",
            ["method", "route", "status"], registry=r)
        self.http_duration = Histogram(
            "pgreserve_http_request_duration_seconds", "Time from the request's arrival to "
            "the end of its response, by route template and status",
            ["method", "route", "status"], buckets=LATENCY_BUCKETS, registry=r)
        self.http_reserve_outcomes = Counter(
            "pgreserve_reservation_outcomes", "Reserve requests by outcome",
            ["outcome", "replayed"], registry=r)
        self.http_transitions = Counter(
            "pgreserve_reservation_transitions", "Claims, releases and extends",
            ["operation", "result"], registry=r)
