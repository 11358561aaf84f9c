"""Fault injection under load: clients, an injector, an auditor and the final report.

A dedicated embedded PostgreSQL (its own temporary data directory) takes 32
clients over a few hot and many cold buckets of both strategies. The clients
use the whole service, mixed by the weights in ``MIX`` and ``FOLLOW`` (printed
with the report): 1- to 3-line carts (some larger than the stock, some with a
1 s TTL), claims, releases and extends (with and without request keys),
receipts, corrections with and without force, recounts and live strategy
switches, and keyed retries of every write; the sweeper and the pool refill
run beside them. A quarter of the clients each go through one of four
services: group commit on or off, a Database that retries lost connections
itself or one that reports them as OutcomeUnknown.

The injector meanwhile terminates backends mid-transaction and while their
COMMIT waits after the commit record is written (single requests and
group-commit batches, counted apart), terminates any backend, crashes the
server with ``pg_ctl stop -m immediate`` and starts it again, holds bucket
locks past lock_timeout, pauses transactions past statement_timeout, freezes
a backend with SIGSTOP (then SIGCONT) and drops requests mid-flight by
cancelling the client's task. Each kind is counted; a run of at least
``ALL_KINDS_AFTER_S`` fails when a kind never fired.

Every client writes down what it sent and what came back. Afterwards each
unknown outcome is settled (keyed writes: re-sent with the same key; unkeyed
claims, releases and extends: re-read; recounts: re-sent, a count being
absolute), and the whole history is checked against the database in one pass
(``final_audit``, indexed by request key, reservation id and bucket).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import tempfile
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg import sql

from conftest import in_schema
from pgreserve import Database, ReservationService, Status, TxSettings
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import (
    Busy,
    OutcomeUnknown,
    PgReserveError,
    ReservationClaimed,
    ReservationExpired,
    ReservationNotActive,
    ReservationReleased,
    WouldOversell,
)
from quiet import quiet_loggers

APP = "pgreserve:faults"
# fsync off is safe here (the OS survives an immediate stop: written WAL is in
# its page cache); a commit acknowledged before its WAL was written is not, so
# every commit waits for its local flush (synchronous_commit = local). The
# standby named here never connects: a transaction the commit trigger switches
# to synchronous_commit = on writes and flushes its commit record, then waits
# at COMMIT for that standby, with its reply not yet sent, until the injector
# terminates it (the reply is lost after the commit) or cancels the wait (the
# reply is sent).
TEST_SETTINGS = {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "local",
                 "synchronous_standby_names": "pgreserve_faults_nobody"}
HOT = [("hot-0", "w", "row"), ("hot-1", "w", "pool"), ("hot-2", "w", "row"),
       ("hot-3", "w", "pool")]
COLD = [(f"cold-{i:02d}", "w", "row" if i % 2 else "pool") for i in range(40)]
HOT_STOCK, COLD_STOCK = 120, 10
BASE = {sku: HOT_STOCK for sku, _, _ in HOT} | {sku: COLD_STOCK for sku, _, _ in COLD}
CLIENTS = 32
SERVICES = ("retrying+batched", "raw+batched", "retrying+unbatched", "raw+unbatched")
MAX_OPS_PER_CLIENT = 10_000_000
MAX_FAULTS = 1_000_000
RECOVERY_S = 90.0
ALL_KINDS_AFTER_S = 60.0
RESOLVERS = 16
HOT_TABLES = ("stock_bucket", "stock_unit", "reservation", "reservation_line",
              "request_ledger", "stock_movement", "outbox_event")

# What a client does next, by weight; then what it does with a hold.
MIX: dict[str, int] = {"reserve": 84, "receipt": 4, "correction": 3, "forced correction": 1,
                       "recount": 3, "forced recount": 1, "strategy switch": 2, "sweep": 1,
                       "refill": 1}
FOLLOW: dict[str, float] = {
    "multi-line cart": 0.25, "line above the stock": 0.04, "1 s TTL": 0.3,
    "keyed retry of a reserve": 0.05, "extend": 0.10, "claim": 0.40, "release": 0.30,
    "left to expire": 0.30, "keyed claim/release/extend": 0.4,
    "keyed retry of a claim/release/extend/adjustment": 0.2,
    "unkeyed repeat of a claim/release": 0.05,
}

FAULT_KINDS = (
    "terminate mid-transaction",
    "terminate during COMMIT (after the commit record)",
    "terminate during a group-commit batch's COMMIT",
    "terminate any backend",
    "server crash (stop -m immediate) and restart",
    "bucket lock held past lock_timeout",
    "transaction paused past statement_timeout",
    "backend paused (SIGSTOP, then SIGCONT)",
    "client dropped mid-request",
)

# Planted defects (test-only, PGRESERVE_SOAK_DEFECT, comma-separated): each
# must make the audit report a violation (tests/faults/test_faults.py).
DEFECTS = {
    "drop-ack": "the history forgets one acknowledged hold",
    "phantom-unit": "a unit appears in a hot bucket without a movement",
}

# Test scaffolding, installed only in the fault server's database: a pause
# inside a reserve transaction (after its reservation row is written), and at
# COMMIT (a deferred constraint trigger on outbox_event, which every writing
# transaction fills) a switch to synchronous_commit = on, which makes that
# COMMIT wait for the absent standby after its commit record is flushed. Each
# has a probability the injector sets in fault_control.
FAULT_SQL = """
CREATE TABLE fault_control (
    id integer PRIMARY KEY CHECK (id = 1),
    mid_ms integer NOT NULL DEFAULT 0, mid_p float8 NOT NULL DEFAULT 0,
    commit_p float8 NOT NULL DEFAULT 0);
INSERT INTO fault_control (id) VALUES (1);
CREATE FUNCTION fault_pause_mid() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE c fault_control;
BEGIN
    SELECT * INTO c FROM fault_control WHERE id = 1;
    IF c.mid_ms > 0 AND random() < c.mid_p THEN PERFORM pg_sleep(c.mid_ms / 1000.0); END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER fault_pause_mid AFTER INSERT ON reservation
    FOR EACH ROW EXECUTE FUNCTION fault_pause_mid();
CREATE FUNCTION fault_wait_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE c fault_control;
BEGIN
    SELECT * INTO c FROM fault_control WHERE id = 1;
    IF c.commit_p > 0 AND random() < c.commit_p THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fault_wait_commit AFTER INSERT ON outbox_event
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fault_wait_commit();
"""

T = TypeVar("T")

UNSETTLED = ("unknown", "busy", "dropped")
# kinds whose call starts with a read (refill: refill_candidates)
READS = ("refill",)
REFUSED = (ReservationClaimed, ReservationReleased, ReservationExpired, ReservationNotActive,
           WouldOversell)
# what a refused claim or release says the reservation is (expired is left
# out: a late claim of an expired reservation may still succeed)
REFUSAL_STATUS = {"ReservationClaimed": "claimed", "ReservationReleased": "released"}


@dataclass(slots=True)
class Record:
    """One request a client sent and what it learnt."""

    client: int
    kind: str  # reserve claim release extend adjust recount switch
    key: str | None
    params: Any
    outcome: str = "pending"  # held rejected ok refused busy unknown dropped raw
    reservation_id: str | None = None
    resolved: str | None = None
    error: str | None = None
    answer: Any = None

    @property
    def state(self) -> str:
        return self.resolved or self.outcome


@dataclass
class Report:
    """What the run did, printed at the end."""

    seconds: float = 0.0
    asked: float = 0.0
    load_s: float = 0.0
    resolve_s: float = 0.0
    audit_s: float = 0.0
    window_s: float = 0.0
    operations: int = 0
    ops: Counter[tuple[str, str]] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    unknown_resolved: Counter[str] = field(default_factory=Counter)
    busy_resolved: int = 0
    violations: list[str] = field(default_factory=list)
    checks: int = 0
    audit_max_s: float = 0.0
    raw_errors: Counter[str] = field(default_factory=Counter)
    raw_examples: dict[str, str] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)
    latency: dict[tuple[int, str], array[float]] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)
    xid: str = ""
    combiner: str = ""
    defects: tuple[str, ...] = ()

    @property
    def silent_kinds(self) -> list[str]:
        return [k for k in FAULT_KINDS if self.faults[k] == 0]

    def latency_lines(self) -> list[str]:
        kinds = sorted({k for _, k in self.latency})
        windows = sorted({w for w, _ in self.latency})
        out = [f"latency p50/p99 in ms per {self.window_s:.0f} s window "
               "(every call, whatever its outcome):",
               "  window      " + "".join(f"{k:>18}" for k in kinds)]
        for w in windows:
            cells = []
            for k in kinds:
                xs = self.latency.get((w, k))
                if not xs:
                    cells.append(f"{'-':>18}")
                    continue
                s = sorted(xs)
                p50, p99 = s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]
                cells.append(f"{p50 * 1000:>8.1f}/{p99 * 1000:<7.0f}".rjust(18))
            lo, hi = w * self.window_s, (w + 1) * self.window_s
            out.append(f"  {lo:>5.0f}-{hi:<5.0f}" + "".join(cells))
        return out

    def lines(self) -> list[str]:
        by_kind: dict[str, Counter[str]] = defaultdict(Counter)
        for (kind, outcome), n in self.ops.items():
            by_kind[kind][outcome] += n
        out = [
            f"fault run: {self.seconds:.1f} s of load ({self.asked:.0f} s asked), {CLIENTS} "
            f"clients ({CLIENTS // len(SERVICES)} each on " + ", ".join(SERVICES) + "), "
            f"{len(HOT)} hot + {len(COLD)} cold buckets (row and pool)",
            f"timing: load {self.load_s:.1f} s, resolution {self.resolve_s:.1f} s, "
            f"final audit {self.audit_s:.1f} s",
            "mix (weights): " + ", ".join(f"{k} {v}" for k, v in MIX.items()),
            "follow-ups (probabilities): " + ", ".join(f"{k} {v}" for k, v in FOLLOW.items()),
            "operations: " + "; ".join(
                f"{kind} {sum(c.values())} (" + ", ".join(
                    f"{o} {n}" for o, n in sorted(c.items())) + ")"
                for kind, c in sorted(by_kind.items())),
            "faults: " + ", ".join(f"{k} {self.faults[k]}" for k in FAULT_KINDS),
            "fault kinds that never fired: " + (", ".join(self.silent_kinds) or "none"),
            "unknown outcomes resolved: " + (", ".join(
                f"{k} {v}" for k, v in sorted(self.unknown_resolved.items())) or "none")
            + f"; busy outcomes re-checked: {self.busy_resolved}",
            f"audits under load: {self.checks} (slowest {self.audit_max_s:.2f} s)",
            f"group commit: {self.combiner}",
        ]
        if self.notes:
            out.append("notes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.notes.items())))
        out += self.latency_lines()
        out += self.tables
        out.append(self.xid)
        if self.defects:
            out.append("planted defects: " + ", ".join(self.defects))
        if self.raw_errors:
            out.append("unexpected errors: " + ", ".join(
                f"{k} {v}" for k, v in sorted(self.raw_errors.items())))
        out += [f"violation: {v}" for v in self.violations[:50]]
        out.append(f"soak: {self.operations} operations, {sum(self.faults.values())} faults "
                   f"injected, {sum(self.unknown_resolved.values())} unknown outcomes "
                   f"resolved, {len(self.violations)} invariant violations")
        return out


class FaultServer:
    """An embedded server in its own temporary data directory, safe to crash."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pgreserve-faults-"))
        self.server = EmbeddedServer(self.root / "data", extra_settings=TEST_SETTINGS)
        self.dsn = ""

    def start(self) -> str:
        self.dsn = in_schema(self.server.start())
        return self.dsn

    def install(self) -> None:
        migrations.migrate(self.dsn)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(FAULT_SQL)

    def crash(self) -> None:
        self.server.stop_now("immediate")

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already down
            self.server.stop_now("immediate")
        with contextlib.suppress(Exception):
            self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


async def until_up(fn: Callable[[], Awaitable[T]], deadline_s: float = RECOVERY_S) -> T:
    """Run fn until it stops failing for connection reasons (bounded)."""
    end = time.monotonic() + deadline_s
    for attempt in range(100_000):
        try:
            return await fn()
        except (psycopg.OperationalError, Busy, OutcomeUnknown):
            if time.monotonic() > end:
                raise
            await asyncio.sleep(min(0.5, 0.02 * (attempt + 1)))
    raise AssertionError("unreachable")


def planted_defects() -> tuple[str, ...]:
    """The defects PGRESERVE_SOAK_DEFECT plants (none by default)."""
    names = tuple(d for d in os.environ.get("PGRESERVE_SOAK_DEFECT", "").split(",") if d)
    unknown = set(names) - DEFECTS.keys()
    if unknown:
        raise ValueError(f"unknown planted defect(s) {sorted(unknown)}; known: {sorted(DEFECTS)}")
    return names


class FaultRun:
    """The load, the faults and the audit of one run."""

    def __init__(self, fs: FaultServer, seconds: float, seed: int,
                 defects: tuple[str, ...] = ()) -> None:
        self.fs = fs
        self.seconds = seconds
        self.seed = seed
        self.defects = defects
        self.report = Report(asked=seconds, defects=defects,
                             window_s=max(seconds / 12, 5.0))
        self.records: list[Record] = []
        self.tenant = 0
        self.started = time.monotonic()
        self.db = Database(fs.dsn, min_size=4, max_size=24, application_name=APP,
                           settings=TxSettings(lock_timeout_ms=300, statement_timeout_ms=1000,
                                               max_attempts=6))
        # Half the clients go through a Database that does not retry a lost
        # connection itself: their lost commits surface as OutcomeUnknown and
        # are settled afterwards through the request key, as a caller would.
        self.raw_db = Database(fs.dsn, min_size=2, max_size=16, application_name=APP,
                               settings=TxSettings(lock_timeout_ms=300,
                                                   statement_timeout_ms=1000, max_attempts=1))
        self.services = (ReservationService(self.db), ReservationService(self.raw_db),
                         ReservationService(self.db, batching=False),
                         ReservationService(self.raw_db, batching=False))
        self.service = self.services[0]
        self.stop = asyncio.Event()
        self.last_audit = 0.0
        self.drops = 0
        # pg_stat counters start again from zero after crash recovery: add up
        # what each crash discarded
        self.stat_lost: Counter[str] = Counter()
        self.stat_last: Counter[str] = Counter()
        self.dead_max: Counter[str] = Counter()
        self.last_sample = 0.0

    # -- setup -------------------------------------------------------------------

    async def seed_stock(self) -> None:
        await self.db.open()
        await self.raw_db.open()
        self.tenant = (await self.service.create_tenant("faults")).id
        for sku, loc, strategy in HOT:
            await self.service.set_stock(self.tenant, sku, loc, HOT_STOCK, strategy=strategy,
                                         pool_cap=20)
        for sku, loc, strategy in COLD:
            await self.service.set_stock(self.tenant, sku, loc, COLD_STOCK, strategy=strategy)

    # -- clients -------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.started

    async def attempt(self, rec: Record, call: Callable[[], Awaitable[Any]]) -> Any:
        """Send one request and write down the outcome class and the latency."""
        self.records.append(rec)
        self.report.operations += 1
        sent = self.now()
        try:
            result = await call()
        except OutcomeUnknown as exc:
            rec.outcome, rec.error = "unknown", str(exc)
        except Busy as exc:
            rec.outcome, rec.error = "busy", str(exc)
        except REFUSED as exc:
            rec.outcome, rec.error = "refused", type(exc).__name__
        except PgReserveError as exc:
            rec.outcome, rec.error = "raw", f"{type(exc).__name__}: {exc}"
            self.raw_error(rec, exc)
        except psycopg.OperationalError as exc:
            rec.outcome, rec.error = "unknown", f"{type(exc).__name__}: {exc}"
            if rec.kind in READS:
                # reads (Database.fetch) pass a lost connection on untyped
                self.report.notes[f"{rec.kind}: untyped {type(exc).__name__} from its read"] += 1
            else:
                self.raw_error(rec, exc)
        except psycopg.Error as exc:
            # The service promised typed errors: an untyped one is an unknown
            # outcome for the caller, and a finding for the report.
            rec.outcome, rec.error = "unknown", f"{type(exc).__name__}: {exc}"
            self.raw_error(rec, exc)
        except asyncio.CancelledError:
            rec.outcome = "dropped"
            raise
        else:
            rec.outcome = "ok"
            return result
        finally:
            self.latency(rec.kind, sent)
            self.report.ops[(rec.kind, rec.outcome)] += 1
        return None

    def raw_error(self, rec: Record, exc: Exception) -> None:
        name = f"{rec.kind}:{type(exc).__name__}"
        self.report.raw_errors[name] += 1
        if name not in self.report.raw_examples:
            detail = getattr(getattr(exc, "diag", None), "context", None) or ""
            self.report.raw_examples[name] = (f"{rec.kind} {rec.key or rec.params} at "
                                              f"{self.now():.1f} s: {exc} {detail}")

    def latency(self, kind: str, sent: float) -> None:
        key = (int(sent // self.report.window_s), kind)
        xs = self.report.latency.get(key)
        if xs is None:
            xs = self.report.latency[key] = array("d")
        xs.append(self.now() - sent)

    def violation(self, text: str) -> None:
        self.report.violations.append(text)

    def cart(self, rng: random.Random) -> list[tuple[str, str, int]]:
        n_lines = 1 if rng.random() >= FOLLOW["multi-line cart"] else rng.choice((2, 2, 3))
        picked: dict[tuple[str, str], int] = {}
        while len(picked) < n_lines:
            sku, loc, _ = rng.choice(HOT) if rng.random() < 0.6 else rng.choice(COLD)
            big = rng.random() < FOLLOW["line above the stock"]
            picked[(sku, loc)] = BASE[sku] + rng.randint(1, 10) if big else rng.randint(1, 3)
        return [(s, lo, q) for (s, lo), q in picked.items()]

    async def reserve(self, c: int, service: ReservationService, key: str,
                      cart: list[tuple[str, str, int]], ttl: float) -> Record:
        rec = Record(c, "reserve", key, (tuple(cart), ttl))
        out = await self.attempt(rec, partial(service.reserve, self.tenant, key, cart, ttl=ttl))
        if out is not None:
            rec.outcome = "held" if out.held else "rejected"
            rec.reservation_id = out.reservation.id if out.reservation else None
            self.report.ops[("reserve", "ok")] -= 1
            self.report.ops[("reserve", rec.outcome)] += 1
        return rec

    async def transition(self, c: int, service: ReservationService, kind: str, rid: str,
                         key: str | None, ttl: float = 30.0) -> Record:
        rec = Record(c, kind, key, (rid, ttl), reservation_id=rid)
        if kind == "extend":
            # (shortening allowed: the harness's model is "expiry = now + ttl")
            call = partial(service.extend, self.tenant, rid, ttl, request_key=key,
                           allow_shorten=True)
        elif kind == "claim":
            call = partial(service.claim, self.tenant, rid, request_key=key)
        else:
            call = partial(service.release, self.tenant, rid, request_key=key)
        out = await self.attempt(rec, call)
        if out is not None:
            rec.answer = (out.status.value, out.expires_at)
        return rec

    async def keyed_retry(self, c: int, service: ReservationService, first: Record) -> None:
        """The same keyed write again: it must get the first answer back."""
        rid, ttl = first.params
        again = await self.transition(c, service, first.kind, rid, first.key, ttl)
        if first.outcome == "ok" and again.outcome == "ok" and again.answer != first.answer:
            self.violation(f"keyed {first.kind} {first.key} answered {first.answer}, "
                           f"then {again.answer}")

    async def adjust(self, c: int, service: ReservationService, key: str, sku: str,
                     delta: int, force: bool) -> Record:
        rec = Record(c, "adjust", key, (sku, "w", delta, force))
        out = await self.attempt(rec, partial(
            service.adjust_stock, self.tenant, key, sku, "w", delta, reason="soak",
            force=force))
        if out is not None:
            rec.answer = out.replayed
        return rec

    async def recount(self, c: int, service: ReservationService, kind: str, sku: str, n: int,
                      force: bool, strategy: str | None) -> None:
        rec = Record(c, kind, None, (sku, "w", n, force, strategy))
        view = await self.attempt(rec, partial(
            service.set_stock, self.tenant, sku, "w", n, strategy=strategy, force=force))
        if view is not None and view.on_hand - view.shortfall != n:
            self.violation(f"set_stock({sku}, {n}) answered on_hand {view.on_hand} "
                           f"shortfall {view.shortfall}")

    async def client(self, c: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + c)
        service = self.services[c % len(self.services)]
        kinds, weights = list(MIX), list(MIX.values())
        for i in range(MAX_OPS_PER_CLIENT):
            if time.monotonic() > deadline or self.stop.is_set():
                return
            what = rng.choices(kinds, weights)[0]
            sku = rng.choice(HOT + COLD)[0] if rng.random() < 0.5 else rng.choice(HOT)[0]
            if what in ("receipt", "correction", "forced correction"):
                delta = rng.randint(1, 4) * (1 if what == "receipt" else -1)
                key = f"c{c}-adj-{i}"
                rec = await self.adjust(c, service, key, sku, delta, what != "correction")
                if rng.random() < FOLLOW["keyed retry of a claim/release/extend/adjustment"]:
                    again = await self.adjust(c, service, key, sku, delta, what != "correction")
                    if rec.outcome == "ok" and again.outcome == "ok" and not again.answer:
                        self.violation(f"adjustment {key} applied twice")
                continue
            if what in ("recount", "forced recount"):
                n = rng.randint(BASE[sku] // 2, BASE[sku] * 3 // 2)
                await self.recount(c, service, "recount", sku, n, what != "recount", None)
                continue
            if what == "strategy switch":
                with contextlib.suppress(PgReserveError, psycopg.Error):
                    view = await service.get_stock(self.tenant, sku, "w")
                    other = "row" if view.strategy.value == "pool" else "pool"
                    await self.recount(c, service, "switch", sku,
                                       max(0, view.on_hand - view.shortfall), False, other)
                continue
            if what == "sweep":
                rec = Record(c, "sweep", None, None)
                await self.attempt(rec, partial(service.expire_due, 200))
                continue
            if what == "refill":
                rec = Record(c, "refill", None, None)
                await self.attempt(rec, partial(self.refill_round, service))
                continue
            cart = self.cart(rng)
            ttl = 1.0 if rng.random() < FOLLOW["1 s TTL"] else 10.0
            key = f"c{c}-r{i}"
            rec = await self.reserve(c, service, key, cart, ttl)
            if rec.outcome in ("held", "rejected") and \
                    rng.random() < FOLLOW["keyed retry of a reserve"]:
                await self.reserve(c, service, key, cart, ttl)
            if rec.outcome != "held" or rec.reservation_id is None:
                continue
            rid = rec.reservation_id
            keyed = rng.random() < FOLLOW["keyed claim/release/extend"]
            retry = rng.random() < FOLLOW["keyed retry of a claim/release/extend/adjustment"]
            roll = rng.random()
            if roll < FOLLOW["extend"]:
                ext = await self.transition(c, service, "extend", rid,
                                            f"{key}-ext" if keyed else None,
                                            rng.choice((1.0, 30.0)))
                if keyed and retry:
                    await self.keyed_retry(c, service, ext)
                roll = rng.random()
            if roll < FOLLOW["claim"]:
                kind = "claim"
            elif roll < FOLLOW["claim"] + FOLLOW["release"]:
                kind = "release"
            else:
                continue  # left to expire (or to live on)
            act = await self.transition(c, service, kind, rid, f"{key}-{kind}" if keyed else None)
            if keyed and retry:
                await self.keyed_retry(c, service, act)
            elif not keyed and rng.random() < FOLLOW["unkeyed repeat of a claim/release"]:
                await self.transition(c, service, kind, rid, None)

    async def refill_round(self, service: ReservationService) -> int:
        added = 0
        for tenant, bucket in await service.refill_candidates(0.5, 20):
            added += await service.refill(tenant, bucket) or 0
        return added

    async def sweeper(self, deadline: float) -> None:
        for _ in range(MAX_OPS_PER_CLIENT):
            if time.monotonic() > deadline or self.stop.is_set():
                return
            await self.attempt(Record(-1, "sweep", None, None),
                               partial(self.service.expire_due, 200))
            await self.attempt(Record(-1, "refill", None, None),
                               partial(self.refill_round, self.services[2]))
            await asyncio.sleep(0.3)

    # -- faults --------------------------------------------------------------------

    async def admin(self) -> psycopg.AsyncConnection[Any]:
        return await until_up(lambda: psycopg.AsyncConnection.connect(
            self.fs.dsn, autocommit=True, application_name="pgreserve:injector"))

    async def pids(self, where: LiteralString, limit: int) -> list[int]:
        async with await self.admin() as conn:
            cur = await conn.execute(sql.SQL(
                "SELECT pid FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid() AND {}"
                " ORDER BY random() LIMIT %s").format(sql.SQL(where)), (APP, limit))
            return [int(pid) for (pid,) in await cur.fetchall()]

    async def terminate(self, where: LiteralString, limit: int) -> int:
        async with await self.admin() as conn:
            cur = await conn.execute(sql.SQL(
                "SELECT pg_terminate_backend(pid) FROM ("
                " SELECT pid FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid() AND {}"
                " ORDER BY random() LIMIT %s) s").format(sql.SQL(where)), (APP, limit))
            return sum(1 for (ok,) in await cur.fetchall() if ok)

    async def control(self, **values: float) -> None:
        async with await self.admin() as conn:
            sets = sql.SQL(", ").join(
                sql.SQL("{} = %s").format(sql.Identifier(k)) for k in values)
            await conn.execute(sql.SQL("UPDATE fault_control SET {} WHERE id = 1").format(sets),
                               tuple(values.values()))

    async def fault_terminate_mid(self, rng: random.Random) -> None:
        """Kill backends inside a reserve transaction (paused after its writes)."""
        await self.control(mid_ms=250, mid_p=0.3)
        killed = 0
        try:
            for _ in range(20):
                killed += await self.terminate(
                    "state = 'active' AND wait_event = 'PgSleep'", rng.randint(1, 3))
                if killed >= 3:
                    break
                await asyncio.sleep(0.05)
        finally:
            await self.control(mid_ms=0, mid_p=0)
        self.report.faults["terminate mid-transaction"] += killed

    async def fault_terminate_commit(self, rng: random.Random) -> None:
        """Kill backends whose COMMIT is written and flushed but not yet answered.

        The commit trigger sends a few transactions to wait for the absent
        standby; they are found by wait_event SyncRep, single requests and
        group-commit batches (bucket_batch_v1) apart. The ones left are let go
        with pg_cancel_backend, which answers their COMMIT with success."""
        await self.control(commit_p=0.2)
        single = batch = 0
        try:
            for _ in range(40):
                single += await self.terminate(
                    "wait_event = 'SyncRep' AND query NOT LIKE '%%bucket_batch_v1%%'",
                    rng.randint(1, 2))
                batch += await self.terminate(
                    "wait_event = 'SyncRep' AND query LIKE '%%bucket_batch_v1%%'", 1)
                if single >= 2 and batch >= 1:
                    break
                await asyncio.sleep(0.02)
        finally:
            await self.release_commit_waiters()
        self.report.faults["terminate during COMMIT (after the commit record)"] += single
        self.report.faults["terminate during a group-commit batch's COMMIT"] += batch

    async def release_commit_waiters(self) -> None:
        await self.control(commit_p=0)
        for _ in range(10):
            async with await self.admin() as conn:
                cur = await conn.execute(
                    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                    " WHERE wait_event = 'SyncRep'")
                if not await cur.fetchall():
                    return
            await asyncio.sleep(0.02)

    async def fault_terminate_any(self, rng: random.Random) -> None:
        """Kill random pool connections, idle or busy: the pool must notice and replace them."""
        self.report.faults["terminate any backend"] += await self.terminate(
            "true", rng.randint(2, 8))

    async def fault_crash(self, rng: random.Random) -> None:
        """pg_ctl stop -m immediate, a short outage, then start again (crash recovery)."""
        await self.sample_stats()
        await asyncio.to_thread(self.fs.crash)
        self.report.faults["server crash (stop -m immediate) and restart"] += 1
        await asyncio.sleep(rng.uniform(0.1, 0.8))
        await asyncio.to_thread(self.fs.start)
        self.stat_lost.update(self.stat_last)
        self.stat_last = Counter()

    async def fault_lock_hang(self, rng: random.Random) -> None:
        """A session holds hot bucket rows locked in an open transaction: lock_timeout fires."""
        async with await self.admin() as conn, conn.transaction():
            skus = rng.sample([h[0] for h in HOT], 2)
            await conn.execute(
                "SELECT 1 FROM stock_bucket WHERE tenant_id = %s AND sku = ANY(%s)"
                " ORDER BY sku, location FOR UPDATE", (self.tenant, skus))
            await asyncio.sleep(1.0)
        self.report.faults["bucket lock held past lock_timeout"] += 1

    async def fault_statement_hang(self, rng: random.Random) -> None:
        """Reserve transactions pause longer than statement_timeout: it fires, nothing commits."""
        await self.control(mid_ms=1300, mid_p=0.5)
        try:
            await asyncio.sleep(1.5)
        finally:
            await self.control(mid_ms=0, mid_p=0)
        self.report.faults["transaction paused past statement_timeout"] += 1

    async def fault_sigstop(self, rng: random.Random) -> None:
        """Freeze a busy backend with SIGSTOP for up to 1.5 s, then SIGCONT."""
        for _ in range(20):
            pids = await self.pids("state = 'active'", 1)
            if pids:
                break
            await asyncio.sleep(0.02)
        else:
            return
        try:
            os.kill(pids[0], signal.SIGSTOP)
        except ProcessLookupError:
            return  # the backend exited since it was chosen: nothing paused
        try:
            await asyncio.sleep(rng.uniform(0.3, 1.5))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGCONT)
        self.report.faults["backend paused (SIGSTOP, then SIGCONT)"] += 1

    async def fault_client_drop(self, rng: random.Random) -> None:
        """Clients give up on requests in flight (their tasks are cancelled): the request
        may or may not take effect, and is settled by its key afterwards."""
        tasks: list[asyncio.Task[Record]] = []
        for j in range(6):
            service = self.services[j % len(self.services)]
            key = f"drop-{self.drops}"
            self.drops += 1
            cart = self.cart(rng)
            tasks.append(asyncio.create_task(self.reserve(-2, service, key, cart, 30.0)))
        await asyncio.sleep(rng.uniform(0.0005, 0.01))
        cancelled = [task for task in tasks if not task.done()]
        for task in cancelled:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        dropped = sum(1 for task in cancelled if task.cancelled())
        self.report.notes["cancelled calls that completed anyway"] += len(cancelled) - dropped
        self.report.faults["client dropped mid-request"] += dropped

    async def injector(self, deadline: float) -> None:
        rng = random.Random(self.seed)
        kinds = {
            "terminate mid-transaction": self.fault_terminate_mid,
            "terminate during COMMIT (after the commit record)": self.fault_terminate_commit,
            "terminate during a group-commit batch's COMMIT": self.fault_terminate_commit,
            "terminate any backend": self.fault_terminate_any,
            "server crash (stop -m immediate) and restart": self.fault_crash,
            "bucket lock held past lock_timeout": self.fault_lock_hang,
            "transaction paused past statement_timeout": self.fault_statement_hang,
            "backend paused (SIGSTOP, then SIGCONT)": self.fault_sigstop,
            "client dropped mid-request": self.fault_client_drop,
        }
        await asyncio.sleep(0.5)
        for n in range(MAX_FAULTS):
            if time.monotonic() > deadline:
                return
            # every kind once in order, then kinds that have not fired yet, then at random
            silent = self.report.silent_kinds
            name = FAULT_KINDS[n] if n < len(FAULT_KINDS) else \
                silent[0] if silent and n % 2 else rng.choice(FAULT_KINDS)
            try:
                await kinds[name](rng)
            except Exception as exc:  # noqa: BLE001 - a harness bug fails the run, with its report
                self.violation(f"injector: {name} raised {exc!r}")
            if name.startswith("server crash") or time.monotonic() - self.last_audit > 10:
                await self.audit_now()
            if time.monotonic() - self.last_sample > 30:
                await self.sample_stats()
            await asyncio.sleep(rng.uniform(0.2, 0.6))

    # -- stats ---------------------------------------------------------------------

    async def table_stats(self) -> list[tuple[str, int, int, int, int]]:
        async with await self.admin() as conn:
            cur = await conn.execute(
                "SELECT regexp_replace(relname, '_p[0-9]+$', ''), sum(n_dead_tup)::bigint,"
                " sum(autovacuum_count)::bigint, sum(autoanalyze_count)::bigint,"
                " sum(pg_total_relation_size(relid))::bigint FROM pg_stat_user_tables"
                " WHERE regexp_replace(relname, '_p[0-9]+$', '') = ANY(%s) GROUP BY 1 ORDER BY 1",
                (list(HOT_TABLES),))
            return [(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]))
                    for r in await cur.fetchall()]

    async def sample_stats(self) -> None:
        self.last_sample = time.monotonic()
        with contextlib.suppress(psycopg.Error):
            for rel, dead, vac, ana, _ in await self.table_stats():
                self.stat_last[f"{rel}/vacuum"] = vac
                self.stat_last[f"{rel}/analyze"] = ana
                self.dead_max[rel] = max(self.dead_max[rel], dead)

    async def end_stats(self) -> None:
        rows = await self.table_stats()
        self.report.tables = [
            "hot tables at the end: rows, dead tuples now (pg_stat: counted since the last "
            "crash) and the most seen in a sample (every 30 s and before each crash), size "
            "with indexes, autovacuum and autoanalyze runs over the whole run (each crash's "
            "discarded counts added back):"]
        async with await self.admin() as conn:
            for rel, dead, vac, ana, size in rows:
                cur = await conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
                    sql.Identifier(rel)))
                live = (await cur.fetchone() or (0,))[0]
                self.report.tables.append(
                    f"  {rel}: rows {live}, dead {dead} (most seen "
                    f"{max(dead, self.dead_max[rel])}), {size / 2**20:.1f} MiB, autovacuum "
                    f"{vac + self.stat_lost[f'{rel}/vacuum']}, autoanalyze "
                    f"{ana + self.stat_lost[f'{rel}/analyze']}")
        async with await self.admin() as conn:
            row = await (await conn.execute(
                "SELECT age(d.datfrozenxid), txid_current(),"
                " (SELECT max(age(c.relfrozenxid)) FROM pg_class c"
                "   WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace)"
                " FROM pg_database d WHERE d.datname = current_database()")).fetchone()
        assert row is not None
        self.report.xid = (f"xid at the end: age(datfrozenxid) {row[0]}, oldest table "
                           f"age(relfrozenxid) {row[2]}, next xid {row[1]}")
        stats = [s.combiner.stats for s in self.services if s.combiner is not None]
        batches = sum(s.batches for s in stats)
        requests = sum(s.requests for s in stats)
        sizes: Counter[int] = Counter()
        for s in stats:
            sizes.update(s.sizes)
        biggest = max(sizes) if sizes else 0
        self.report.combiner = (f"{batches} batches carried {requests} requests "
                                f"(largest {biggest}), {sum(s.splits for s in stats)} split")

    # -- audits --------------------------------------------------------------------

    async def audit_now(self) -> None:
        """The checks that hold at any instant, in one snapshot, while load runs."""
        t0 = time.monotonic()
        found = await until_up(lambda: audit(self.fs.dsn))
        self.last_audit = time.monotonic()
        self.report.audit_max_s = max(self.report.audit_max_s, self.last_audit - t0)
        self.report.checks += 1
        self.report.violations += found

    async def settle(self, rec: Record) -> None:
        """One unknown (or busy, or dropped) outcome settled through its key or a re-read."""
        service = self.service
        if rec.kind == "reserve":
            cart, ttl = rec.params
            out = await service.reserve(self.tenant, rec.key or "", list(cart), ttl=ttl)
            rec.resolved = "held" if out.held else "rejected"
            rec.reservation_id = out.reservation.id if out.reservation else None
        elif rec.kind == "adjust":
            sku, loc, delta, force = rec.params
            try:
                await service.adjust_stock(self.tenant, rec.key or "", sku, loc, delta,
                                           reason="soak", force=force)
                rec.resolved = "ok"
            except WouldOversell:
                rec.resolved = "refused"
        elif rec.kind in ("recount", "switch"):
            sku, loc, n, force, strategy = rec.params
            try:
                await service.set_stock(self.tenant, sku, loc, n, strategy=strategy,
                                        force=force)
                rec.resolved = "ok"
            except WouldOversell:
                rec.resolved = "refused"
        elif rec.key is not None:  # a keyed claim, release or extend: re-sent
            rid, ttl = rec.params
            try:
                if rec.kind == "extend":
                    await service.extend(self.tenant, rid, ttl, request_key=rec.key,
                                         allow_shorten=True)
                elif rec.kind == "claim":
                    await service.claim(self.tenant, rid, request_key=rec.key)
                else:
                    await service.release(self.tenant, rid, request_key=rec.key)
                rec.resolved = "ok"
            except REFUSED:
                rec.resolved = "refused"
        else:
            res = await service.get_reservation(self.tenant, rec.params[0])
            rec.resolved = res.status.value

    async def resolve(self) -> None:
        """Settle every unknown, busy and dropped outcome, in rounds until none is left
        (RESOLVERS at a time: each settles its own records, in history order)."""
        pending = [r for r in self.records
                   if r.outcome in UNSETTLED and r.kind not in ("sweep", "refill")]
        rounds = 0
        while pending and rounds < 50:
            rounds += 1
            left: list[Record] = []

            async def worker(share: list[Record], left: list[Record] = left) -> None:
                for rec in share:
                    try:
                        await self.settle(rec)
                    except (psycopg.OperationalError, Busy, OutcomeUnknown):
                        left.append(rec)
                        continue
                    if rec.outcome == "busy":
                        self.report.busy_resolved += 1
                    else:
                        self.report.unknown_resolved[rec.kind] += 1

            # one key's records stay with one worker, in order
            shares: list[list[Record]] = [[] for _ in range(RESOLVERS)]
            for rec in pending:
                shares[hash(rec.key or rec.params) % RESOLVERS].append(rec)
            await asyncio.gather(*(worker(share) for share in shares))
            pending = left
            if pending:
                await asyncio.sleep(0.2)
        # sweeps and refills are settled by state: the next round does them
        while await until_up(partial(self.service.expire_due, 500)) == 500:
            pass

    async def final_audit(self) -> None:
        """The whole history against the database, after load and resolution, in one pass."""
        v = self.report.violations
        v += await until_up(lambda: audit(self.fs.dsn, full=True))
        async with await self.admin() as conn:
            if "phantom-unit" in self.defects:
                await conn.execute(
                    "UPDATE stock_bucket SET on_hand = on_hand + 1, free = free + 1"
                    " WHERE (tenant_id, bucket_id) = (SELECT tenant_id, bucket_id"
                    "  FROM stock_bucket WHERE tenant_id = %s AND shortfall = 0"
                    "  ORDER BY sku LIMIT 1)", (self.tenant,))
                v += await audit(self.fs.dsn)
            cur = conn.cursor()
            await cur.execute(
                "SELECT r.request_key, r.reservation_id::text, r.status,"
                "       array_agg(b.sku || '/' || b.location || '/' || l.quantity"
                "                 ORDER BY b.sku, b.location)"
                " FROM reservation r JOIN reservation_line l USING (tenant_id, reservation_id)"
                " JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id"
                " WHERE r.tenant_id = %s GROUP BY 1, 2, 3", (self.tenant,))
            by_key: dict[str, tuple[str, str, list[str]]] = {}
            by_rid: dict[str, str] = {}
            for key, rid, status, lines in await cur.fetchall():
                by_key[key] = (rid, status, sorted(lines))
                by_rid[rid] = status
            cur = await conn.execute(
                "SELECT request_key, count(*), sum(quantity) FROM stock_movement"
                " WHERE tenant_id = %s AND kind = 'adjust' GROUP BY 1", (self.tenant,))
            adjusted = {str(k): (int(n), int(q)) for k, n, q in await cur.fetchall()}
        if "drop-ack" in self.defects:
            first = next(r for r in self.records if r.kind == "reserve" and r.state == "held")
            self.records = [r for r in self.records if r.key != first.key]
        self.check_history(by_key, by_rid, adjusted)

    def check_history(self, by_key: dict[str, tuple[str, str, list[str]]],
                      by_rid: dict[str, str], adjusted: dict[str, tuple[int, int]]) -> None:
        v = self.report.violations
        answers: dict[str, Record] = {}  # the first definitive answer of each reserve key
        asked: set[str] = set()
        applied: dict[str, int] = {}  # adjustment key -> delta, when some answer says applied
        adjust_keys: set[str] = set()
        sent_to: dict[str, set[str]] = defaultdict(set)  # reservation id -> kinds sent
        for rec in self.records:
            state = rec.state
            if rec.kind == "reserve" and rec.key is not None:
                asked.add(rec.key)
                if state not in ("held", "rejected"):
                    continue
                first = answers.setdefault(rec.key, rec)
                if (first.state, first.reservation_id) != (state, rec.reservation_id):
                    v.append(f"key {rec.key} answered {first.state} {first.reservation_id}, "
                             f"then {state} {rec.reservation_id}")
            elif rec.kind == "adjust" and rec.key is not None:
                adjust_keys.add(rec.key)
                if state == "ok":
                    applied[rec.key] = rec.params[2]
            elif rec.kind in ("claim", "release", "extend") and rec.reservation_id:
                rid = rec.reservation_id
                sent_to[rid].add(rec.kind)
                status = by_rid.get(rid)
                if state == "ok" and rec.kind != "extend":
                    ok = ("claimed",) if rec.kind == "claim" else ("released", "expired")
                    if status not in ok:
                        v.append(f"acknowledged {rec.kind} of {rid}, now {status}")
                elif state == "refused" and rec.error in REFUSAL_STATUS \
                        and status != REFUSAL_STATUS[rec.error]:
                    v.append(f"{rec.kind} of {rid} refused as {rec.error}, now {status}")
        for key, rec in answers.items():
            got = by_key.get(key)
            if rec.state == "held":
                lines = sorted(f"{s}/{lo}/{q}" for s, lo, q in rec.params[0])
                if got is None or got[0] != rec.reservation_id or got[2] != lines:
                    v.append(f"acknowledged hold {key} {rec.reservation_id} {lines}:"
                             f" database has {got}")
            elif got is not None:
                v.append(f"rejected request {key} holds {got}")
        for key, (rid, status, _) in by_key.items():
            if key not in asked:
                v.append(f"reservation {key} ({rid}) that no client asked for")
            elif status == "claimed" and "claim" not in sent_to.get(rid, ()):
                v.append(f"reservation {key} ({rid}) claimed without a claim")
            elif status == "released" and "release" not in sent_to.get(rid, ()):
                v.append(f"reservation {key} ({rid}) released without a release")
        for key, delta in applied.items():
            if adjusted.get(key) != (1, delta):
                v.append(f"acknowledged adjustment {key} of {delta}: the ledger has "
                         f"{adjusted.get(key)} (movements, units)")
        for key, booked in adjusted.items():
            if key not in applied:
                what = "that no client sent" if key not in adjust_keys else "never acknowledged"
                v.append(f"adjustment {key} in the ledger {what}: {booked}")
        left = [r for r in self.records if r.outcome in UNSETTLED and not r.resolved
                and r.kind not in ("sweep", "refill")]
        v += [f"unresolved {r.kind} {r.key or r.params}" for r in left[:20]]
        if len(left) > 20:
            v.append(f"... and {len(left) - 20} more unresolved")
        v += [f"unexpected error from the service: {k} x{n}, first: "
              f"{self.report.raw_examples.get(k)}" for k, n in self.report.raw_errors.items()]

    # -- the run -------------------------------------------------------------------

    async def run(self) -> Report:
        with quiet_loggers():  # the pool logs every connection the faults break
            return await self._run()

    async def _run(self) -> Report:
        await self.seed_stock()
        self.started = time.monotonic()
        deadline = self.started + self.seconds
        try:
            await asyncio.wait_for(asyncio.gather(
                *(self.client(c, deadline) for c in range(CLIENTS)),
                self.sweeper(deadline), self.injector(deadline)),
                timeout=self.seconds + 4 * RECOVERY_S)
            self.report.seconds = self.report.load_s = self.now()
            await self.control(mid_ms=0, mid_p=0, commit_p=0)
            await self.release_commit_waiters()
            t0 = time.monotonic()
            await self.resolve()
            t1 = time.monotonic()
            self.report.resolve_s = t1 - t0
            await self.final_audit()
            self.report.audit_s = time.monotonic() - t1
            await self.end_stats()
        finally:
            await self.db.close()
            await self.raw_db.close()
        return self.report


# Per bucket, in one pass over each table: on_hand = free + pool + held, no
# negative figure, on_hand - shortfall = counted + adjusted + sold (the
# movement ledger, sales negative), and no more sellable than physical.
FIGURES = """
WITH pool AS (SELECT tenant_id, bucket_id, count(*) AS n FROM stock_unit GROUP BY 1, 2),
held AS (SELECT tenant_id, bucket_id, sum(quantity) AS n FROM reservation_line
         WHERE held GROUP BY 1, 2),
moves AS (SELECT tenant_id, bucket_id,
                 coalesce(sum(quantity) FILTER (WHERE kind = 'count'), 0) AS counted,
                 coalesce(sum(quantity) FILTER (WHERE kind = 'adjust'), 0) AS adjusted,
                 coalesce(sum(quantity) FILTER (WHERE kind = 'sale'), 0) AS sold
          FROM stock_movement GROUP BY 1, 2)
SELECT b.sku || format(': on_hand %s free %s pool %s held %s shortfall %s;'
                       ' counted %s adjusted %s sold %s', b.on_hand, b.free,
                       coalesce(p.n, 0), coalesce(h.n, 0), b.shortfall, coalesce(m.counted, 0),
                       coalesce(m.adjusted, 0), coalesce(m.sold, 0))
FROM stock_bucket b
LEFT JOIN pool p USING (tenant_id, bucket_id)
LEFT JOIN held h USING (tenant_id, bucket_id)
LEFT JOIN moves m USING (tenant_id, bucket_id)
WHERE b.on_hand <> b.free + coalesce(p.n, 0) + coalesce(h.n, 0)
   OR least(b.on_hand, b.free, b.shortfall) < 0
   OR b.on_hand - b.shortfall
      <> coalesce(m.counted, 0) + coalesce(m.adjusted, 0) + coalesce(m.sold, 0)
   OR b.free + coalesce(p.n, 0) > greatest(0, b.on_hand - b.shortfall)
"""

# Cheap enough to run under load (bucket figures, held lines)...
INSTANT: dict[str, LiteralString] = {
    "books": FIGURES,
    # held units are in exactly one place: a held line has no sale
    "held and sold": "SELECT l.reservation_id || '/' || l.line_no"
                     " FROM reservation_line l JOIN stock_movement m"
                     "  ON m.tenant_id = l.tenant_id"
                     " AND m.reservation_id = l.reservation_id"
                     " AND m.line_no = l.line_no AND m.kind = 'sale' WHERE l.held",
}
# ... and over the whole history, at the end.
HISTORY: dict[str, LiteralString] = {
    "invariant": "SELECT rule || ': ' || sku || ' ' || detail"
                 " FROM invariant_violations_v1(NULL, NULL)",
    "restored twice": "SELECT reservation_id || '/' || line_no FROM stock_movement"
                      " WHERE kind = 'restore' GROUP BY reservation_id, line_no"
                      " HAVING count(*) > 1",
    "sold twice": "SELECT reservation_id || '/' || line_no FROM stock_movement"
                  " WHERE kind = 'sale' GROUP BY reservation_id, line_no HAVING count(*) > 1",
    # a claimed reservation sold every line, nothing else did
    "sale mismatch": "SELECT r.reservation_id || ' ' || r.status FROM reservation r"
                     " JOIN reservation_line l USING (tenant_id, reservation_id)"
                     " LEFT JOIN stock_movement m ON m.tenant_id = l.tenant_id"
                     "  AND m.reservation_id = l.reservation_id"
                     "  AND m.line_no = l.line_no AND m.kind = 'sale'"
                     " WHERE (r.status = 'claimed') <> (m.movement_id IS NOT NULL)",
}


async def audit(dsn: str, *, full: bool = False) -> list[str]:
    """Every instant-true rule (and with `full` the history-wide ones), in one
    repeatable-read snapshot; one string per breach."""
    async with await psycopg.AsyncConnection.connect(
            dsn, application_name="pgreserve:auditor") as conn:
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        found: list[str] = []
        queries = INSTANT | HISTORY if full else INSTANT
        async with conn.transaction():
            for name, query in queries.items():
                cur = await conn.execute(query)
                found += [f"{name}: {row[0]}" for row in await cur.fetchall()]
        return found


__all__ = ["FaultRun", "FaultServer", "Report", "Status"]
