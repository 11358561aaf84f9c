"""The ops listener: /metrics, /ops and /ops.json live there and nowhere on the tenant API;
metric names follow Prometheus conventions; the latency histogram and the request log."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pgreserve import Database, ReservationService, apikeys
from pgreserve.http import create_app, server
from pgreserve.http.requestlog import RequestLog, format_text
from pgreserve.http.server import Listeners
from test_cli_up import BIN, free_port

OPS_PATHS = ("/metrics", "/ops", "/ops.json", "/ops/series.json", "/ops/tables", "/ops/freezes")


class OpsServed:
    """The API and the ops listener (one loop, in a background thread), as `up` runs them."""

    def __init__(self, dsn: str, request_log: RequestLog | None = None) -> None:
        self.port, self.ops_port = free_port(), free_port()
        self.listeners = Listeners(dsn, ("127.0.0.1", self.port), ("127.0.0.1", self.ops_port),
                                   request_log=request_log)
        self.thread = threading.Thread(target=server.run, args=(self.listeners.serve(),),
                                       daemon=True)
        self.api = f"http://127.0.0.1:{self.port}"
        self.ops = f"http://127.0.0.1:{self.ops_port}"

    def __enter__(self) -> OpsServed:
        self.thread.start()
        while not self.listeners.started:
            if not self.thread.is_alive():
                raise RuntimeError("the listeners did not start")
            self.thread.join(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.listeners.should_exit = True
        self.thread.join(30)


def tenant_with_key(dsn: str, name: str = "acme") -> str:
    """A tenant created in SQL with stock in two buckets; its API key."""
    key = apikeys.new_key()
    with psycopg.connect(dsn, autocommit=True) as conn:
        tenant = conn.execute("SELECT tenant_create_v1(%s, %s)",
                              (name, apikeys.hash_key(key))).fetchone()[0]  # type: ignore[index]  # the query always returns one row
        conn.execute("SELECT stock_set_v1(%s, 'hot', 'wh', 3, 'pool', false, NULL, NULL)",
                     (tenant,))
        conn.execute("SELECT stock_set_v1(%s, 'cold', 'wh', 100, NULL, false, NULL, NULL)",
                     (tenant,))
    return key


def traffic(base: str, key: str, marker: str = "") -> None:
    """Holds, a sold-out answer, a replay, a claim, a release, an unknown path, a bad key."""
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as c:
        def hold(k: str, sku: str, n: int) -> httpx.Response:
            return c.post("/v1/reservations", headers={"Idempotency-Key": k},
                          json={"lines": [{"sku": sku, "location": "wh", "quantity": n}],
                                "ttl_seconds": 60 if not marker else 61})
        first = hold(f"order-1{marker}", "hot", 2)
        assert first.status_code == 201, first.text
        assert hold(f"order-1{marker}", "hot", 2).headers.get("Idempotent-Replayed") == "true"
        assert hold(f"order-2{marker}", "hot", 2).status_code == 409
        second = hold(f"order-3{marker}", "cold", 1)
        c.post(f"/v1/reservations/{first.json()['id']}/claim")
        c.post(f"/v1/reservations/{second.json()['id']}/release")
        assert c.get("/v1/no/such/path/42").status_code == 404
        assert c.get("/v1/stock/wh/hot", headers={"Authorization": "Bearer pgr_wrong"}
                     ).status_code == 401


def wait_for(ops: str, ready: Any) -> dict[str, Any]:
    """/ops.json once `ready(doc)` holds (the monitors have sampled), within 60 s."""
    deadline = time.monotonic() + 60
    while True:
        doc: dict[str, Any] = httpx.get(f"{ops}/ops.json", timeout=30).json()
        if ready(doc) or time.monotonic() > deadline:
            return doc
        time.sleep(0.2)


@pytest.fixture
def served(dsn: str) -> Iterator[OpsServed]:
    """The API and its ops listener on two loopback ports."""
    with OpsServed(dsn) as srv:
        yield srv


def test_ops_endpoints_are_404_on_the_api_and_served_on_the_ops_listener(
        served: OpsServed) -> None:
    """Every operations path answers 404 not_found on the tenant API's port and 200 on the
    ops listener's; /healthz stays on the API."""
    for path in OPS_PATHS:
        on_api = httpx.get(served.api + path, timeout=30)
        assert on_api.status_code == 404 and on_api.json()["code"] == "not_found", path
        assert httpx.get(served.ops + path, timeout=30).status_code == 200, path
    assert httpx.get(served.api + "/healthz", timeout=30).json() == {"status": "ok"}
    schema = httpx.get(served.api + "/openapi.json", timeout=30).json()
    assert not set(schema["paths"]) & set(OPS_PATHS)


# Prometheus naming: base units, _total on counters only, ratios not percentages.
UNIT_SUFFIXES = ("_seconds", "_bytes", "_ratio", "_timestamp_seconds")
FORBIDDEN_PARTS = ("percent", "_pct", "_ms", "millis", "micros", "_minutes", "_hours",
                   "_kb", "_mb", "kilobytes", "megabytes")


def conformance_problems(text: str) -> list[str]:
    """Every breach of the naming conventions in a Prometheus text exposition."""
    found = []
    for family in text_string_to_metric_families(text):
        name, kind = family.name, family.type
        exposed = name + "_total" if kind == "counter" else name
        if not re.fullmatch(r"pgreserve_[a-z][a-z0-9_]*", exposed):
            found.append(f"{exposed}: not snake_case under pgreserve_")
        if kind != "counter" and name.endswith("_total"):
            found.append(f"{name}: a {kind} named _total")
        if kind == "histogram" and not name.endswith(("_seconds", "_bytes")):
            found.append(f"{name}: a histogram without a base unit")
        if any(part in name for part in FORBIDDEN_PARTS):
            found.append(f"{name}: not in base units")
        if name.endswith("_ratio"):
            bad = [s.value for s in family.samples if not 0 <= s.value <= 1]
            if bad:
                found.append(f"{name}: ratio values outside 0..1: {bad}")
        for sample in family.samples:
            # A label that says which quantity a sample is mixes units in one metric.
            if {"stat", "unit", "quantity"} & set(sample.labels):
                found.append(f"{name}: mixes quantities under label {set(sample.labels)}")
                break
    return found


def test_every_metric_name_follows_the_prometheus_conventions(served: OpsServed,
                                                              dsn: str) -> None:
    """After real traffic and a sample of every monitor, each family /metrics exposes is
    snake_case under pgreserve_, counters end in _total and nothing else does, histograms
    are in seconds or bytes, ratios stay within 0..1, no percent or milliseconds, and no
    metric mixes quantities under a label."""
    traffic(served.api, tenant_with_key(dsn))
    wait_for(served.ops, lambda d: d["hold_time"]["samples"] > 0 and d["bloat"]["partitions"])
    text = httpx.get(served.ops + "/metrics", timeout=30).text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert conformance_problems(text) == []
    assert families["pgreserve_http_request_duration_seconds"] == "histogram"
    assert families["pgreserve_partition_dead_tuple_ratio"] == "gauge"
    assert families["pgreserve_client_pool_request_wait_seconds"] == "counter"
    assert families["pgreserve_client_pool_connections"] == "gauge"
    assert families["pgreserve_connection_seconds"] == "counter"
    assert families["pgreserve_partition_last_autovacuum_timestamp_seconds"] == "gauge"
    assert families["pgreserve_db_pool_refills"] == "counter"
    assert "pgreserve_client_pool" not in families
    assert "pgreserve_partition_dead_percent" not in families


def test_the_conformance_check_catches_each_breach() -> None:
    """The checker flags a percent gauge, a counter-like gauge named _total, a histogram
    in milliseconds, a ratio above 1 and a metric with a `stat` label."""
    text = "\n".join([
        "# TYPE pgreserve_dead_percent gauge", "pgreserve_dead_percent 3",
        "# TYPE pgreserve_things_total gauge", "pgreserve_things_total 3",
        "# TYPE pgreserve_wait_ms histogram", 'pgreserve_wait_ms_bucket{le="+Inf"} 1',
        "pgreserve_wait_ms_count 1", "pgreserve_wait_ms_sum 1",
        "# TYPE pgreserve_full_ratio gauge", "pgreserve_full_ratio 1.5",
        "# TYPE pgreserve_pool gauge", 'pgreserve_pool{stat="usage_ms"} 1', ""])
    problems = conformance_problems(text)
    for name in ("pgreserve_dead_percent", "pgreserve_things_total", "pgreserve_wait_ms",
                 "pgreserve_full_ratio", "pgreserve_pool"):
        assert any(p.startswith(name + ":") for p in problems), (name, problems)


def test_latency_histogram_is_labelled_by_route_template_and_status(served: OpsServed,
                                                                    dsn: str) -> None:
    """The HTTP latency histogram has method, route and status labels; routes are the
    templates (the reservation id is not a label value) and an unknown path is
    "unmatched", so the series stay bounded."""
    traffic(served.api, tenant_with_key(dsn))
    text = httpx.get(served.ops + "/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "pgreserve_http_request_duration_seconds")
    counts = {(s.labels["method"], s.labels["route"], s.labels["status"]): s.value
              for s in family.samples if s.name.endswith("_count")}
    assert counts[("POST", "/v1/reservations", "201")] == 3  # two holds and the replay
    assert counts[("POST", "/v1/reservations", "409")] == 1
    assert counts[("POST", "/v1/reservations/{reservation_id}/claim", "200")] == 1
    assert counts[("POST", "/v1/reservations/{reservation_id}/release", "200")] == 1
    assert counts[("GET", "unmatched", "404")] == 1
    assert counts[("GET", "/v1/stock/{location}/{sku}", "401")] == 1
    routes = {route for _, route, _ in counts}
    assert not any("/no/such" in r or re.search(r"/[0-9a-f]{8}-", r) for r in routes), routes
    buckets = [s for s in family.samples if s.name.endswith("_bucket")
               and s.labels["route"] == "/v1/reservations" and s.labels["status"] == "201"]
    assert {s.labels["le"] for s in buckets} >= {"0.005", "1.0", "+Inf"}


def test_documentation_pages_are_labelled_by_their_own_routes(served: OpsServed) -> None:
    """/docs, /redoc, /openapi.json and the pages' assets are counted under their own
    route templates, not as "unmatched" (which stays for paths nothing serves)."""
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css",
                 "/docs/no-such-page"):
        httpx.get(served.api + path, timeout=30)
    text = httpx.get(served.ops + "/metrics", timeout=30).text
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "pgreserve_http_requests")
    counts = {(s.labels["method"], s.labels["route"], s.labels["status"]): s.value
              for s in family.samples if s.name.endswith("_total")}
    assert counts[("GET", "/docs", "200")] >= 1
    assert counts[("GET", "/redoc", "200")] >= 1
    assert counts[("GET", "/openapi.json", "200")] >= 1
    assert counts[("GET", "/docs/assets/{path:path}", "200")] >= 1
    assert counts[("GET", "unmatched", "404")] >= 1


def test_request_log_has_one_line_per_request_and_no_secret(dsn: str) -> None:
    """Each request gives one JSON line with route template, tenant id, request key,
    outcome, status, duration and error class; the API key, the Authorization header and
    the bodies appear nowhere in the log."""
    stream = io.StringIO()
    log = RequestLog("json", stream=stream)
    key = tenant_with_key(dsn)
    with OpsServed(dsn, request_log=log) as srv:
        traffic(srv.api, key, marker="-body-marker-61")
        log.flush()
    text = stream.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == 8, text
    fields = {"ts", "event", "method", "route", "status", "outcome", "tenant_id",
              "request_key", "duration_seconds", "error_class", "client"}
    assert all(set(line) == fields for line in lines)
    with psycopg.connect(dsn) as conn:
        tenant = conn.execute("SELECT tenant_id FROM tenant WHERE name = 'acme'").fetchone()
    assert tenant is not None
    held, replay, sold_out = lines[0], lines[1], lines[2]
    assert (held["route"], held["status"], held["outcome"], held["tenant_id"],
            held["request_key"], held["error_class"]) == (
        "/v1/reservations", 201, "ok", tenant[0], "order-1-body-marker-61", None)
    assert held["duration_seconds"] > 0
    assert (replay["outcome"], replay["status"]) == ("replayed", 201)
    assert (sold_out["outcome"], sold_out["status"], sold_out["error_class"]) == (
        "refused", 409, "insufficient_stock")
    unknown, unauthorized = lines[-2], lines[-1]
    assert (unknown["route"], unknown["error_class"], unknown["tenant_id"]) == (
        "unmatched", "not_found", None)
    assert (unauthorized["status"], unauthorized["error_class"], unauthorized["tenant_id"]) == (
        401, "unauthorized", None)
    assert key not in text and key[:12] not in text
    assert "Bearer" not in text and "pgr_wrong" not in text and "authorization" not in text
    assert '"quantity"' not in text and "ttl_seconds" not in text
    assert "/no/such/path" not in text


def test_text_request_log_line_keeps_a_hostile_key_on_one_line() -> None:
    """A request key with a newline and a fake field is quoted: one line, no forged field."""
    line = format_text((0.0, "POST", "/v1/reservations", 201, "ok", 7,
                        'k\nstatus=500 "x"', 0.01, None, None))
    assert "\n" not in line
    assert line.count(" status=") == 1 and 'request_key="k\\nstatus=500 \\"x\\""' in line


class Process:
    """`pgreserve ARGS` in a subprocess, its output collected line by line."""

    def __init__(self, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PGRESERVE_", "PROMETHEUS_"))}
        self.proc = subprocess.Popen([str(BIN), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_answering(self, url: str) -> None:
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.output
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.output
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def requests_counted(ops: str) -> float:
    """pgreserve_http_requests_total summed over every label (and every process)."""
    text = httpx.get(ops + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "pgreserve_http_requests" for s in f.samples)


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_puts_ops_on_its_own_listener(dsn: str, workers: int) -> None:
    """`pgreserve serve` (one process, and --workers 2 with the ops listener in the
    parent) answers the operations paths 404 on the API port and serves them on
    --ops-port, where /metrics counts every worker's requests and the page's figures
    see their holds; each request is one JSON log line without the API key."""
    key = tenant_with_key(dsn)
    port, ops_port = free_port(), free_port()
    api, ops = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ops_port}"
    metrics_dirs = set(Path(tempfile.gettempdir()).glob("pgreserve-metrics-*"))
    proc = Process(["serve", "--database-url", dsn, "--port", str(port), "--ops-port",
                    str(ops_port), "--workers", str(workers), "--log-format", "json"])
    try:
        proc.wait_answering(api + "/healthz")
        proc.wait_answering(ops + "/ops/series.json")
        for path in OPS_PATHS:
            assert httpx.get(api + path, timeout=30).status_code == 404, path
            assert httpx.get(ops + path, timeout=30).status_code == 200, path
        before = requests_counted(ops)
        traffic(api, key)
        assert requests_counted(ops) - before == 8  # traffic() sends eight requests
        text = httpx.get(ops + "/metrics", timeout=30).text
        assert conformance_problems(text) == []
        deadline = time.monotonic() + 60
        auth = {"Authorization": f"Bearer {key}"}
        moving = False
        while not moving and time.monotonic() < deadline:
            httpx.post(api + "/v1/reservations", headers={**auth, "Idempotency-Key":
                                                          f"more-{time.monotonic()}"},
                       json={"lines": [{"sku": "cold", "location": "wh", "quantity": 1}]},
                       timeout=30)
            time.sleep(1.2)
            points = httpx.get(ops + "/ops/series.json", timeout=30).json()["points"]
            moving = any(p["holds_per_s"] > 0 for p in points)
        assert moving, "the ops listener's figures never saw a hold"
        # the figures' gauges are set by the ops listener's own monitors (the parent
        # under --workers 2, whose gauges no file holds): /metrics shows them too
        text = httpx.get(ops + "/metrics", timeout=30).text
        by_state = {s.labels["state"]: s.value for f in text_string_to_metric_families(text)
                    if f.name == "pgreserve_reservations_by_state" for s in f.samples}
        assert by_state.get("active", 0) >= 1, by_state
        assert conformance_problems(text) == []
        assert proc.stop() == 0, proc.output
    finally:
        proc.kill()
    logged = [json.loads(line) for line in proc.lines if line.startswith('{"ts"')]
    requests = [x for x in logged if x.get("event") == "request"]
    assert any(x["route"] == "/v1/reservations" and x["status"] == 201 and x["tenant_id"]
               for x in requests), proc.output
    assert key not in proc.output and "Bearer" not in proc.output
    assert '"GET /healthz' not in proc.output  # uvicorn's own access log is off
    # the workers' metrics directory the run made is gone with it
    assert set(Path(tempfile.gettempdir()).glob("pgreserve-metrics-*")) <= metrics_dirs


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_with_the_ops_port_taken_exits_with_a_message(dsn: str, workers: int) -> None:
    """When the ops listener's port is taken, `serve` (one process or --workers 2)
    exits 1 naming the ops listener's address, without a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PGRESERVE_", "PROMETHEUS_"))}
        out = subprocess.run([str(BIN), "serve", "--database-url", dsn, "--port",
                              str(free_port()), "--ops-port", str(busy), "--workers",
                              str(workers)], capture_output=True, text=True, timeout=120,
                             env=env)
    assert out.returncode == 1, out.stderr
    assert f"127.0.0.1:{busy}" in out.stderr and "ops listener" in out.stderr
    assert "Traceback" not in out.stderr


async def test_request_log_shows_the_key_the_service_used(
        db: Database, service: ReservationService) -> None:
    """A quoted (sf-string) Idempotency-Key is logged as the key it names, the one a
    lookup by key finds; a malformed one is logged as sent."""
    _, key = await service.create_tenant_with_key("acme")
    await service.set_stock(1, "hot", "wh", 5)
    out = io.StringIO()
    log = RequestLog("json", stream=out)
    app = create_app(database=db, request_log=log)
    auth = {"Authorization": f"Bearer {key}"}
    body = {"lines": [{"sku": "hot", "location": "wh", "quantity": 1}], "ttl_seconds": 60}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", headers=auth) as client:
        held = await client.post("/v1/reservations", json=body,
                                 headers={"Idempotency-Key": '"order-7"'})
        assert held.status_code == 201
        bad = await client.post("/v1/reservations", json=body,
                                headers={"Idempotency-Key": '"no-closing-quote'})
        assert bad.status_code == 400
    log.flush()
    keys = [json.loads(line)["request_key"] for line in out.getvalue().splitlines()]
    assert keys == ["order-7", '"no-closing-quote']
