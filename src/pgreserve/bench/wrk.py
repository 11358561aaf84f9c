"""`pgreserve bench http`: holds through `serve --workers N`, sent by wrk, beside a bare endpoint.

Both servers are started here the same way (uvicorn, the service's own
settings from http/server.py: uvloop, httptools, N processes, factory app) on
free 127.0.0.1 ports, never both at once, and wrk (the C load generator)
sends the same request to each for the same time: `POST /v1/reservations`
with a one-line cart, the tenant's API key and a fresh Idempotency-Key per
request. The figure is the ratio: service holds/s over bare requests/s.

The measured runs alternate in rounds, in the order bare, service | service,
bare | bare, service ... (ABBA), so that a machine growing faster or slower
during the run weighs on both servers alike: on a shared machine the CPU left
to us moves within a minute, and two runs one after the other measured that
as much as the servers. Each server's figures are the sums over its runs;
each round's own ratio is reported beside them.

CPU is read from /proc over wrk's run: the server's process tree (uvicorn's
supervisor and workers), PostgreSQL's (when /proc shows it), and wrk's own
(getrusage of the waited child).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import mask_password
from ..core.service import ReservationService
from ..db.database import Database
from ..db.queries import queries
from ..errors import InvalidRequest
from .http import free_port
from .meter import ServerMeter, tree_cpu_s
from .runner import read_ledger, violation_lines, with_commit_mode

WRK_MISSING = ("wrk is not on PATH: `bench http` drives the servers with wrk, the C load "
               "generator (Debian/Ubuntu: apt-get install wrk)")
SKU, LOCATION = "sku-0", "wh-1"
READY_TIMEOUT_S = 60.0

# wrk's Lua: every thread counts its answers by status (a 201 that says it was replayed
# apart); done() prints one JSON line. Each wrk run gets a prefix of its own for the
# request keys (its first argument): the counter starts again in every run, and a key
# sent in an earlier run would be answered from the ledger instead of holding.
LUA = r"""
local threads = {}
local counter = 0
holds, replayed, rejected, other = 0, 0, 0, 0

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  PREFIX = args[1]
end

function request()
  counter = counter + 1
  return wrk.format("POST", "/v1/reservations", {
    ["Authorization"] = "Bearer " .. API_KEY,
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = PREFIX .. id .. "-" .. counter,
  }, BODY)
end

function response(status, headers, body)
  if status == 201 then
    if headers["idempotent-replayed"] or headers["Idempotent-Replayed"] then
      replayed = replayed + 1
    else
      holds = holds + 1
    end
  elseif status == 409 then rejected = rejected + 1
  else other = other + 1 end
end

function done(summary, latency, requests)
  local h, p, r, o = 0, 0, 0, 0
  for _, t in ipairs(threads) do
    h = h + t:get("holds"); p = p + t:get("replayed")
    r = r + t:get("rejected"); o = o + t:get("other")
  end
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %d, "duration_us": %d, "created": %d, ' ..
    '"replayed": %d, "rejected": %d, "other_status": %d, "connect_errors": %d, ' ..
    '"read_errors": %d, "write_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, ' ..
    '"p99_us": %d, "max_us": %d}\n', summary.requests, summary.duration, h, p, r, o,
    e.connect, e.read, e.write, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
"""


# Environment variables whose values are not written to the JSON: a URL keeps all
# but its password, the others are replaced (a duration in seconds is no secret).
_SECRET_WORDS = ("PASSWORD", "SECRET", "KEY", "TOKEN")


# The flags service_argv gives `serve`, and the variables they override there.
SERVICE_FLAGS = ("--no-request-log",)
_OVERRIDDEN = {"PGRESERVE_REQUEST_LOG": "--no-request-log",
               "PGRESERVE_REQUEST_LOG_FILE": "--no-request-log",
               "PGRESERVE_REQUEST_LOG_FORMAT": "--no-request-log"}


def service_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The PGRESERVE_* variables both servers inherit from the bench, secrets masked;
    one a flag of service_argv overrides in the service is marked so."""
    env = os.environ if environ is None else environ
    out = {}
    for name in sorted(n for n in env if n.startswith("PGRESERVE_")):
        value = env[name]
        if "URL" in name:
            value = mask_password(value)
        elif any(word in name for word in _SECRET_WORDS) and not name.endswith("_SECONDS"):
            value = "***"
        if name in _OVERRIDDEN:
            value += f" (not applied to the service: the bench runs it with {_OVERRIDDEN[name]})"
        out[name] = value
    return out


def wrk_path() -> str:
    """wrk's path; InvalidRequest with what to install when it is missing."""
    path = shutil.which("wrk")
    if path is None:
        raise InvalidRequest(WRK_MISSING)
    return path


@dataclass
class Segment:
    """One measured wrk run against one server, or (`Endpoint.total`, round 0) the sum of
    several."""

    round: int  # 1-based; 0 for a sum
    requests: int
    duration_s: float
    created: int  # 201 answers that are not replays: holds (service) or requests (bare)
    replayed: int  # 201 answers from the request ledger (a key sent before)
    rejected: int
    other_status: int
    socket_errors: int
    latency_ms: dict[str, float]
    wrk_cpu_s: float
    server_cpu_s: float | None = None  # the uvicorn supervisor and its workers
    postgres_cpu_s: float | None = None

    @property
    def created_per_s(self) -> float | None:
        return self.created / self.duration_s if self.duration_s > 0 else None

    @property
    def requests_per_s(self) -> float | None:
        return self.requests / self.duration_s if self.duration_s > 0 else None

    def cores(self, cpu: float | None) -> float | None:
        return None if cpu is None or self.duration_s <= 0 else cpu / self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "created_per_s": self.created_per_s,
                "requests_per_s": self.requests_per_s}


@dataclass
class Endpoint:
    """One server's measured wrk runs (`segments`, in the order run), and its unmeasured
    warm-up runs (`warmups`, one per start, numbered by the first round of that start):
    not in any figure, but their holds are in the books."""

    name: str
    url: str
    segments: list[Segment] = field(default_factory=list)
    warmups: list[Segment] = field(default_factory=list)

    @property
    def total(self) -> Segment:
        """The runs summed. wrk reports percentiles per run: each percentile is its
        largest value over the runs (the worst run's). A CPU figure is None when any
        run's reading was."""
        runs = self.segments

        def add(name: str) -> Any:
            return sum(getattr(run, name) for run in runs)

        def cpu(name: str) -> float | None:
            values = [getattr(run, name) for run in runs]
            return None if not values or None in values else sum(values)

        return Segment(
            round=0, requests=add("requests"), duration_s=add("duration_s"),
            created=add("created"), replayed=add("replayed"), rejected=add("rejected"),
            other_status=add("other_status"), socket_errors=add("socket_errors"),
            latency_ms={name: max(run.latency_ms[name] for run in runs)
                        for name in ("p50", "p90", "p99", "max")} if runs else {},
            wrk_cpu_s=add("wrk_cpu_s"), server_cpu_s=cpu("server_cpu_s"),
            postgres_cpu_s=cpu("postgres_cpu_s"))

    def to_dict(self) -> dict[str, Any]:
        total = self.total
        doc = {"name": self.name, "url": self.url, **total.to_dict()}
        del doc["round"]
        doc["cores"] = {"server": total.cores(total.server_cpu_s),
                        "postgres": total.cores(total.postgres_cpu_s),
                        "wrk": total.cores(total.wrk_cpu_s)}
        doc["segments"] = [segment.to_dict() for segment in self.segments]
        doc["warmups"] = [segment.to_dict() for segment in self.warmups]
        return doc


@dataclass
class HttpBench:
    """Both endpoints, the books of the service's tenant and the ratio."""

    bare: Endpoint
    service: Endpoint
    strategy: str
    reservations: int = 0  # reservations of the tenant after the run (warm-up included)
    commits: int = 0  # pg_stat_database xact_commit from the service's start to its stop
    violations: list[str] = field(default_factory=list)
    oversold: bool = False
    connections: int = 0  # wrk's connections: requests in flight when a wrk run stops

    @property
    def ratio(self) -> float | None:
        """Service holds/s over bare requests/s; None when a measured run of either
        server failed (failing_rounds): its figures do not measure what they name."""
        if self.failing_rounds():
            return None
        bare, held = self.bare.total.created_per_s, self.service.total.created_per_s
        return held / bare if held is not None and bare else None

    def round_ratios(self) -> list[float | None]:
        """Each round's service holds/s over its bare requests/s (None for a round in
        which either server's run failed)."""
        failed = {f["round"] for f in self.failing_rounds()}
        bare = {s.round: s.created_per_s for s in self.bare.segments}
        ratios: list[float | None] = []
        for segment in self.service.segments:
            held, base = segment.created_per_s, bare.get(segment.round)
            ratios.append(held / base if held is not None and base
                          and segment.round not in failed else None)
        return ratios

    def books_check(self) -> dict[str, Any]:
        """wrk's 201s against the database: every hold wrk was told about (201s of every
        run against the service, warm-ups included, replays not) must be a reservation,
        and at most one reservation per connection and wrk run may be one wrk never saw
        answered (in flight when that run stopped), or one per socket error (a request
        whose answer was lost)."""
        runs = self.service.segments + self.service.warmups
        created = sum(run.created for run in runs)
        allowance = self.connections * len(runs)
        lost = sum(run.socket_errors for run in runs)
        high = created + allowance + lost
        return {"created": created, "wrk_runs": len(runs), "in_flight_allowance": allowance,
                "socket_errors": lost, "reservations": self.reservations,
                "ok": created <= self.reservations <= high}

    def books_violations(self) -> list[str]:
        check = self.books_check()
        if check["ok"]:
            return []
        if check["reservations"] < check["created"]:
            return [f"books: wrk was answered {check['created']:,} holds (201, not "
                    f"replayed, warm-ups included) but the database has "
                    f"{check['reservations']:,} reservations"]
        return [f"books: the database has {check['reservations']:,} reservations, more "
                f"than the {check['created']:,} holds wrk was answered (201, warm-ups "
                f"included) and {check['in_flight_allowance'] + check['socket_errors']:,} "
                f"requests in flight when wrk stopped or lost to socket errors"]

    def failing_rounds(self, share: float = 0.01) -> list[dict[str, Any]]:
        """Measured runs, of either server, whose non-201 answers (409s included; replayed
        201s are counted apart, not here) and socket errors exceed `share` of their
        requests: the ratio of such a run does not measure holds."""
        out = []
        for endpoint, name in ((self.bare, "bare"), (self.service, "service")):
            for run in endpoint.segments:
                non_201 = run.rejected + run.other_status
                if run.requests == 0 or non_201 + run.socket_errors > share * run.requests:
                    out.append({"server": name, "round": run.round, "requests": run.requests,
                                "non_201": non_201, "rejected": run.rejected,
                                "other_status": run.other_status,
                                "socket_errors": run.socket_errors})
        return out

    @property
    def ok(self) -> bool:
        return not self.violations and not self.oversold and self.books_check()["ok"]

    def to_dict(self) -> dict[str, Any]:
        return {"bare": self.bare.to_dict(), "service": self.service.to_dict(),
                "strategy": self.strategy,
                "service_holds_over_bare_requests_per_s": self.ratio,
                "round_ratios": self.round_ratios(),
                "failing_rounds": self.failing_rounds(),
                "reservations_in_database": self.reservations,
                "books_check": self.books_check(),
                # every transaction, reads (API key, idempotency lookups) included
                "commits_while_service_ran": self.commits,
                "violations": self.violations, "invariants_ok": self.ok}


def _script(api_key: str, quantity: int) -> str:
    body = json.dumps({"lines": [{"sku": SKU, "location": LOCATION, "quantity": quantity}],
                       "ttl_seconds": 900})
    # json.dumps of a str is a valid Lua string literal for these ASCII values
    return f"API_KEY = {json.dumps(api_key)}\nBODY = {json.dumps(body)}\n{LUA}"


def run_prefix() -> str:
    """A wrk run's request key prefix (each thread adds its number and a counter)."""
    return f"h{uuid.uuid4().hex[:12]}-"


def run_wrk(wrk: str, url: str, script: Path, *, threads: int, connections: int,
            seconds: float) -> tuple[dict[str, Any], float]:
    """wrk's JSON line and its CPU seconds (getrusage of the waited child). The run's
    request keys start with a prefix of its own."""
    before = _children_cpu_s()
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
            "--timeout", "10s", "-s", str(script), url, "--", run_prefix()]
    # argv built here, with the wrk found on PATH
    done = subprocess.run(argv, capture_output=True, text=True,  # noqa: S603
                          timeout=seconds + 60, check=False)
    cpu = _children_cpu_s() - before
    for line in done.stdout.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[len("WRKJSON "):]), cpu
    raise InvalidRequest(f"wrk gave no figures (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[:400]}")


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Server:
    """A server process started here (its own process group), stopped by its pid."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            # our own server's argv
            self.proc = subprocess.Popen(argv, env=env, stdout=out,  # noqa: S603
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InvalidRequest(f"the server exited with code {self.proc.returncode}: "
                                     f"{self.log.read_text(errors='replace')[-800:]}")
            try:
                # an http:// loopback URL this module built
                with urllib.request.urlopen(url + "/healthz", timeout=2) as answer:  # noqa: S310
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise InvalidRequest(f"the server did not answer {url}/healthz in {READY_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: its workers
                self.proc.wait(10)


def service_argv(dsn: str, port: int, workers: int) -> list[str]:
    """`pgreserve serve --workers N` on 127.0.0.1:port over the given database.

    Its ops listener on a free port of its own (never the default one, which
    another server may hold); the request log off, as in the figures measured
    before it existed (docs/benchmarks.md).
    """
    return [sys.executable, "-c", "from pgreserve.cli import main; main()", "serve",
            "--workers", str(workers), "--host", "127.0.0.1", "--port", str(port),
            "--ops-port", str(free_port()), *SERVICE_FLAGS, "--database-url", dsn]


def bare_argv(port: int, workers: int) -> list[str]:
    """The bare app under uvicorn.run with the options `serve --workers N` uses."""
    code = ("import uvicorn\nfrom pgreserve.http.server import workers_options\n"
            f"options = workers_options('127.0.0.1', {port}, {workers})\n"
            "options['app'] = 'pgreserve.bench.bare:create_app'\nuvicorn.run(**options)\n")
    return [sys.executable, "-c", code]


def run_order(rounds: int) -> list[tuple[int, str]]:
    """(round, server) of each measured run: bare, service | service, bare | ... (ABBA)."""
    order: list[tuple[int, str]] = []
    for r in range(1, rounds + 1):
        pair = ("bare", "service") if r % 2 else ("service", "bare")
        order.extend((r, name) for name in pair)
    return order


async def run_http_bench(dsn: str, *, strategy: str, units: int, pool_cap: int,
                         workers: int, threads: int, connections: int, seconds: float,
                         warmup: float, durable: bool, quantity: int = 1,
                         rounds: int = 2) -> HttpBench:
    """Seed a fresh tenant, run wrk against the bare app and the service in alternating
    rounds, check the books.

    Runs of one server that follow each other (service, service in the middle of
    ABBA) share one start of it and its warm-up; a server is stopped before the
    other one starts.
    """
    if rounds < 1:
        raise InvalidRequest(f"rounds must be at least 1, got {rounds}")
    wrk = wrk_path()
    dsn = with_commit_mode(dsn, durable)
    work = Path(tempfile.mkdtemp(prefix="pgreserve-bench-http-"))
    try:
        async with Database(dsn, min_size=1, max_size=2,
                            application_name="pgreserve:bench-admin") as admin:
            service = ReservationService(admin)
            tenant, key = await service.create_tenant_with_key(
                f"bench-http-{uuid.uuid4().hex[:12]}")
            await service.set_stock(tenant.id, SKU, LOCATION, units, strategy=strategy,
                                    pool_cap=pool_cap if strategy == "pool" else None)
            script = work / "holds.lua"
            script.write_text(_script(key, quantity))
            env = {**os.environ}
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            bare_port, service_port = free_port(), free_port()
            endpoints = {
                "bare": (Endpoint("bare FastAPI", f"http://127.0.0.1:{bare_port}"),
                         bare_argv(bare_port, workers)),
                "service": (Endpoint(f"pgreserve serve --workers {workers}",
                                     f"http://127.0.0.1:{service_port}"),
                            service_argv(dsn, service_port, workers))}
            result = HttpBench(endpoints["bare"][0], endpoints["service"][0], strategy,
                               connections=connections)
            meter = await ServerMeter.open(dsn)
            try:
                for name, runs in _starts(run_order(rounds)):
                    endpoint, argv = endpoints[name]
                    commits = await _commits(admin)
                    server = Server(argv, env, work / f"{name}-{runs[0]}.log")
                    try:
                        await asyncio.to_thread(server.wait_ready, endpoint.url)
                        if warmup > 0:  # unmeasured, but its holds are in the books
                            doc, wrk_cpu = await asyncio.to_thread(
                                run_wrk, wrk, endpoint.url, script, threads=threads,
                                connections=connections, seconds=warmup)
                            endpoint.warmups.append(_segment(runs[0], doc, wrk_cpu,
                                                             server_cpu_s=None,
                                                             postgres_cpu_s=None))
                        for r in runs:
                            pg0 = await meter.read()
                            cpu0 = tree_cpu_s(server.proc.pid)
                            doc, wrk_cpu = await asyncio.to_thread(
                                run_wrk, wrk, endpoint.url, script, threads=threads,
                                connections=connections, seconds=seconds)
                            cpu1 = tree_cpu_s(server.proc.pid)
                            pg1 = await meter.read()
                            endpoint.segments.append(_segment(
                                r, doc, wrk_cpu,
                                server_cpu_s=None if cpu0 is None or cpu1 is None
                                else cpu1 - cpu0,
                                postgres_cpu_s=None if pg0.server_cpu_s is None
                                or pg1.server_cpu_s is None
                                else pg1.server_cpu_s - pg0.server_cpu_s))
                    finally:
                        await asyncio.to_thread(server.stop)
                    if name == "service":  # its sessions flush their counters as they exit
                        await _backends_gone(admin, "pgreserve:api")
                        result.commits += await _commits(admin) - commits
            finally:
                await meter.close()
            book = await read_ledger(admin, tenant.id)
            result.reservations = book.reservations
            result.oversold = book.held > units
            result.violations = await violation_lines(service, tenant.id)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _starts(order: list[tuple[int, str]]) -> list[tuple[str, list[int]]]:
    """The server starts: consecutive runs of one server under one start, with their rounds."""
    starts: list[tuple[str, list[int]]] = []
    for r, name in order:
        if starts and starts[-1][0] == name:
            starts[-1][1].append(r)
        else:
            starts.append((name, [r]))
    return starts


async def _commits(admin: Database) -> int:
    rows = await admin.fetch(queries["database_transaction_stats"])
    return int(rows[0][1])


async def _backends_gone(admin: Database, application_name: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = await admin.fetch(queries["backend_count"], (application_name,))
        if not rows[0][0]:
            return
        await asyncio.sleep(0.1)


def _segment(round_: int, doc: dict[str, Any], wrk_cpu: float, *,
             server_cpu_s: float | None, postgres_cpu_s: float | None) -> Segment:
    return Segment(
        round=round_, requests=int(doc["requests"]),
        duration_s=int(doc["duration_us"]) / 1e6, created=int(doc["created"]),
        replayed=int(doc["replayed"]), rejected=int(doc["rejected"]),
        other_status=int(doc["other_status"]),
        socket_errors=sum(int(doc[k]) for k in ("connect_errors", "read_errors",
                                                "write_errors", "timeouts")),
        latency_ms={k: int(doc[f"{k}_us"]) / 1000.0 for k in ("p50", "p90", "p99", "max")},
        wrk_cpu_s=wrk_cpu, server_cpu_s=server_cpu_s, postgres_cpu_s=postgres_cpu_s)
