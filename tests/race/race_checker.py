"""The randomized race checker: many real connections at once, then every promise checked.

One run drives a fresh database on a server of its own (synchronous_commit on,
so an acknowledged commit survives a crash) with about forty asyncio tasks
over `ReservationService` and raw psycopg connections that pause transactions
at the dangerous points (a pool or row take the way reserve_v1 runs it, and a
whole reserve_v1, each sleeping before COMMIT or ROLLBACK), while recounts,
adjustments with and without force, live strategy switches, the Sweeper
worker, the pool refill and buyers of 1- and 2-line carts (some larger than
the stock, some with a 1 s TTL, some retried with their key) run. Every task
writes down what it sent, when it sent it and when the answer came back.

Checks (each failure names its check):

- accounting, negative, conservation, sellable: in one snapshot, while the
  load runs and at the end: `invariant_violations_v1` is empty, per bucket
  on_hand = free + pool + held, no figure is negative, on_hand - shortfall =
  counted + adjusted + sold (the movement ledger), and free + pool never
  exceeds the physical units greatest(0, on_hand - shortfall).
- ledger, history, own_books: at the end, the ledger's adjustments and sales
  per bucket equal the ones the checker was told applied; every acknowledged
  hold exists with its id and lines, no reservation exists that nobody asked
  for, a rejected key holds nothing, an acknowledged claim is claimed and an
  acknowledged release released or expired; on_hand - shortfall lies within
  the checker's own bounds of received - sold.
- false_rejection: a stored rejection is false when, for every line of the
  cart, the bucket surely had at least the quantity available at every instant
  of [request sent, answer received]. "Surely available" at t is a lower bound
  of P(t) - H(t) (timeline.py): P, the unsold physical units, takes every
  recount that may have committed by t as the base that gives the least, every
  negative adjustment and claim that may have committed by t, and only the
  receipts that surely committed by t; H, the units held by unexpired holds,
  counts every hold that may have committed by t and may not yet have been
  released, claimed or expired (its expiry read back from the answer, pushed
  out by every extend attempt, plus 5 ms of slack). Every commit time is taken
  the way that lowers the bound, so a true rejection is never flagged. For a
  bucket with a safety stock (SAFETY) the bound is less those units, which are
  never promised.
- phantom_hold: the mirror image, for oversell: a hold is false when one of
  its buckets surely had fewer units available than the line's quantity at
  every instant of its request (upper bound of P, lower bound of H; less the
  safety stock).
- untyped_error: the service raised something other than its typed errors.
- replay: a keyed retry during the load got another answer than the first.
- crash_replay: after rejections are answered under load, the server is
  stopped with `pg_ctl stop -m immediate` and started again, every bucket gets
  a receipt, and every acknowledged keyed request (reserve, adjustment, keyed
  claim, release, extend) is sent again with its key and parameters: a hold
  must come back held with the same id, a rejection rejected, a keyed write
  replayed.
- sweeper_deadlock: no deadlock involves the sweeper (the server log's
  deadlock reports name `expire_due_v1`, or the sweeper's own retry counters).

PGRESERVE_RACE_SECONDS sets the load per strategy, PGRESERVE_RACE_SEED the
seed (printed, so a failure can be replayed with the same random choices; the
interleaving itself is the machine's). PGRESERVE_RACE_DUMP=dir writes, for every
flagged false_rejection, the checker's bounds and hold spans and the database's
history of each bucket of the cart around the request (movements, stock.changed
events, the lines and their expiry and give-up times) to a file in dir.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from conftest import in_schema
from pgreserve import Database, ReservationService, Status, TxSettings
from pgreserve.core.service import digest
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.domain import ReserveOutcome
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
from pgreserve.workers.sweeper import Sweeper
from quiet import quiet_loggers
from timeline import INF, AdminChange, HoldSpan, Sale, Timeline

# fsync may stay off (an immediate stop keeps the OS page cache), but
# synchronous_commit must be on: the promise is that an acknowledged answer
# survives a crash.
SETTINGS = {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "on"}
LOC = "w"
# Buckets with a safety stock (units never promised): a verdict judges what could be
# promised, the bound on what the bucket could serve less these units.
SAFETY = {"mix-1": 3, "cart-3": 40}
SLACK_S = 0.005
T = TypeVar("T")

REFUSED = (ReservationClaimed, ReservationReleased, ReservationExpired, ReservationNotActive,
           WouldOversell)


@dataclass
class Attempt:
    """One request a task sent, when, and what came back."""

    kind: str  # reserve | claim | release | extend | set | adjust
    start: float = 0.0
    end: float = INF
    outcome: str = "pending"  # held rejected ok refused busy unknown error
    key: str | None = None
    cart: tuple[tuple[str, int], ...] = ()
    ttl: float = 0.0
    rid: str | None = None
    replayed: bool = False
    expires: float | None = None
    status: str | None = None
    sku: str | None = None
    value: int = 0
    force: bool = False
    strategy: str | None = None
    raw: bool = False
    answer: str = ""


@dataclass
class Report:
    seed: int
    strategy: str
    seconds: float = 0.0
    attempts: Counter[str] = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    audits: int = 0
    rejections_judged: int = 0
    holds_judged: int = 0
    deadlocks_server: int = 0
    deadlocks_logged: int = 0
    deadlocks_with_sweeper: int = 0
    sweeper_retries: int = 0
    sweeper_busy: int = 0
    buyer_deadlock_retries: int = 0
    raw_pauses: Counter[str] = field(default_factory=Counter)
    replayed_after_crash: int = 0
    burst_rejections: int = 0
    analysis_s: float = 0.0
    replay_s: float = 0.0

    def flag(self, check: str, text: str) -> None:
        self.violations[check].append(text)

    def lines(self) -> list[str]:
        out = [
            f"race checker: strategy {self.strategy}, seed {self.seed}, "
            f"{self.seconds:.1f} s of load",
            "attempts: " + ", ".join(f"{k} {v}" for k, v in sorted(self.attempts.items())),
            "paused raw transactions: " + ", ".join(
                f"{k} {v}" for k, v in sorted(self.raw_pauses.items())),
            f"audits under load: {self.audits}; rejections judged: {self.rejections_judged}; "
            f"holds judged: {self.holds_judged} (analysis {self.analysis_s:.1f} s)",
            f"deadlocks: server {self.deadlocks_server}, in the log {self.deadlocks_logged}, "
            f"involving the sweeper "
            f"{self.deadlocks_with_sweeper}, sweeper retried {self.sweeper_retries}, "
            f"sweeper busy {self.sweeper_busy}, buyers retried {self.buyer_deadlock_retries}",
            f"crash: {self.burst_rejections} rejections answered in the last burst, "
            f"{self.replayed_after_crash} acknowledged requests replayed ({self.replay_s:.1f} s)",
        ]
        for check, found in sorted(self.violations.items()):
            out.append(f"FAILED {check}: {len(found)}")
            out += [f"  {v}" for v in found[:8]]
        if not self.violations:
            out.append("all checks passed")
        return out


class RaceServer:
    """An embedded server in its own temporary data directory, safe to crash."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pgreserve-race-"))
        self.server = EmbeddedServer(self.root / "data", extra_settings=SETTINGS)
        self.template = "race_template"

    def start(self) -> None:
        first = not self.log.exists()
        self.server.start()
        if first:
            # the first start restarts the server to apply its settings, without a log
            # file; start it once more so its deadlock reports land in data/log
            self.server.stop_now("fast")
            self.server.start()

    def install(self) -> None:
        with psycopg.connect(self.server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.template}")
        migrations.migrate(self.server.dsn(self.template))

    def new_database(self, name: str) -> str:
        with psycopg.connect(self.server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE {self.template}")
        return in_schema(self.server.dsn(name))

    @property
    def log(self) -> Path:
        return self.server.data_dir / "log"

    def crash(self) -> None:
        self.server.stop_now("immediate")

    def close(self) -> None:
        try:
            self.server.stop()
        except Exception:  # noqa: BLE001 - not stoppable the gentle way: stop it now
            self.server.stop_now("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def sweeper_deadlocks(log_text: str) -> tuple[int, int]:
    """Deadlock reports in a server log excerpt: (all, those naming expire_due_v1).

    A report is the ERROR line and the DETAIL, HINT, CONTEXT and STATEMENT lines
    the same backend logs after it; the DETAIL names every query of the cycle."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", log_text)
    total = with_sweeper = 0
    for i, record in enumerate(records):
        if "ERROR:  deadlock detected" not in record:
            continue
        pid = re.search(r"\[(\d+)\]", record)
        report = [record]
        for later in records[i + 1:]:
            if pid is None or f"[{pid.group(1)}]" not in later or not re.search(
                    r"\] (DETAIL|HINT|CONTEXT|STATEMENT): ", later):
                break
            report.append(later)
        total += 1
        with_sweeper += any("expire_due_v1" in r for r in report)
    return total, with_sweeper


class RaceRun:
    """One strategy's run: the load, the audits, the crash and the verdicts."""

    def __init__(self, rs: RaceServer, dsn: str, strategy: str, seconds: float,
                 seed: int) -> None:
        self.rs = rs
        self.dsn = dsn
        self.strategy = strategy
        self.other = "row" if strategy == "pool" else "pool"
        self.seconds = seconds
        self.seed = seed
        self.report = Report(seed, strategy)
        self.attempts: list[Attempt] = []
        self.tenant = 0
        self.bucket_ids: dict[str, int] = {}
        self.buckets: dict[str, int] = {}  # sku -> initial count
        self.db = self._database(48, "pgreserve:race")
        self.service = ReservationService(self.db)
        self.sweeper_db = self._database(2, "pgreserve:race-sweeper")
        self.sweeper_service = ReservationService(self.sweeper_db)
        self.stop = asyncio.Event()
        self.load_end = INF
        self.seen_violations: set[str] = set()

    def _database(self, size: int, name: str, attempts: int = 6) -> Database:
        return Database(self.dsn, min_size=2, max_size=size, application_name=name,
                        settings=TxSettings(lock_timeout_ms=2000, statement_timeout_ms=10000,
                                            max_attempts=attempts))

    # -- calling and recording ----------------------------------------------------

    async def send(self, rec: Attempt, call: Callable[[], Awaitable[T]]) -> T | None:
        """Send one request; write down its interval and the class of its outcome."""
        self.attempts.append(rec)
        rec.start = time.time()
        try:
            result = await call()
        except OutcomeUnknown:
            rec.outcome = "unknown"
        except Busy:
            rec.outcome = "busy"
        except REFUSED as exc:
            rec.outcome, rec.answer = "refused", type(exc).__name__
        except PgReserveError as exc:
            rec.outcome, rec.answer = "error", f"{type(exc).__name__}: {exc}"
            self.violation("untyped_error", f"{rec.kind} {rec.key or rec.rid}: unexpected "
                           f"{rec.answer}")
        except (psycopg.Error, ValueError, OverflowError, UnicodeError) as exc:
            rec.outcome, rec.answer = "error", f"{type(exc).__name__}: {exc}"
            self.violation("untyped_error", f"{rec.kind} {rec.key or rec.rid or rec.value} on "
                           f"{rec.sku or rec.cart}: {rec.answer.splitlines()[0]}")
        else:
            rec.end = time.time()
            return result
        finally:
            if rec.end == INF and rec.outcome not in ("unknown", "pending"):
                rec.end = time.time()
        return None

    def violation(self, check: str, text: str) -> None:
        if text not in self.seen_violations:
            self.seen_violations.add(text)
            self.report.flag(check, text)

    def note_reserve(self, rec: Attempt, out: ReserveOutcome) -> None:
        rec.replayed = out.replayed
        if out.held:
            assert out.reservation is not None
            rec.outcome, rec.rid = "held", out.reservation.id
            rec.expires = out.reservation.expires_at.timestamp()
        else:
            rec.outcome = "rejected"
            rec.answer = ";".join(f"{s.sku} requested {s.requested} available {s.available}"
                                  for s in out.short_lines)

    async def reserve(self, key: str, cart: list[tuple[str, int]], ttl: float,
                      retry: bool = False) -> Attempt:
        rec = Attempt("reserve", key=key, cart=tuple(sorted(cart)), ttl=ttl)
        lines = [(sku, LOC, q) for sku, q in cart]
        out = await self.send(rec, lambda: self.service.reserve(self.tenant, key, lines, ttl=ttl))
        if out is not None:
            self.note_reserve(rec, out)
            if retry:
                again = Attempt("reserve", key=key, cart=rec.cart, ttl=ttl)
                dup = await self.send(again, lambda: self.service.reserve(
                    self.tenant, key, lines, ttl=ttl))
                if dup is not None:
                    self.note_reserve(again, dup)
                    if (again.outcome, again.rid) != (rec.outcome, rec.rid):
                        self.violation("replay", f"key {key}: first {rec.outcome} {rec.rid}, "
                                       f"retry {again.outcome} {again.rid}")
        return rec

    async def transition(self, kind: str, rid: str, key: str | None = None,
                         ttl: float = 0.0) -> Attempt:
        rec = Attempt(kind, key=key, rid=rid, ttl=ttl)
        call: Callable[[], Awaitable[Any]]
        if kind == "claim":
            call = lambda: self.service.claim(self.tenant, rid, request_key=key)  # noqa: E731
        elif kind == "release":
            call = lambda: self.service.release(self.tenant, rid, request_key=key)  # noqa: E731
        else:
            # (shortening allowed: the checker's model is "expiry = now + ttl")
            call = lambda: self.service.extend(self.tenant, rid, ttl, request_key=key,  # noqa: E731
                                               allow_shorten=True)
        res = await self.send(rec, call)
        if res is not None:
            rec.outcome, rec.status, rec.replayed = "ok", res.status.value, res.replayed
            rec.expires = res.expires_at.timestamp()
        return rec

    async def set_stock(self, sku: str, n: int, *, force: bool = False,
                        strategy: str | None = None) -> Attempt:
        rec = Attempt("set", sku=sku, value=n, force=force, strategy=strategy)
        view = await self.send(rec, lambda: self.service.set_stock(
            self.tenant, sku, LOC, n, strategy=strategy, force=force))
        if view is not None:
            rec.outcome = "ok"
            if view.on_hand - view.shortfall != n:
                self.violation("own_books", f"set_stock({sku}, {n}) answered on_hand "
                               f"{view.on_hand} shortfall {view.shortfall}")
        return rec

    async def adjust(self, sku: str, key: str, delta: int, *, force: bool = False,
                     retry: bool = False) -> Attempt:
        rec = Attempt("adjust", sku=sku, key=key, value=delta, force=force)
        call = lambda: self.service.adjust_stock(  # noqa: E731
            self.tenant, key, sku, LOC, delta, reason="race", force=force)
        if await self.send(rec, call) is not None:
            rec.outcome = "ok"
            if retry:
                again = Attempt("adjust", sku=sku, key=key, value=delta, force=force)
                view = await self.send(again, call)
                if view is not None:
                    again.outcome, again.replayed = "ok", view.replayed
                    if not view.replayed:
                        self.violation("replay", f"adjust key {key} applied twice")
        return rec

    async def pause(self, rng: random.Random, lo: float, hi: float) -> None:
        await asyncio.sleep(rng.uniform(lo, hi))

    # -- setup ---------------------------------------------------------------------

    async def setup(self) -> None:
        await self.db.open()
        await self.sweeper_db.open()
        self.tenant = (await self.service.create_tenant(f"race-{self.strategy}")).id
        plan = {"sell": (3, 3), "switch": (100, 20), "exp-0": (10, 20), "exp-1": (10, 20),
                "soldout": (0, 10)}
        plan |= {f"cart-{i}": (300, 50) for i in range(4)}
        plan |= {f"mix-{i}": (12, 6) for i in range(2)}
        for sku, (n, cap) in plan.items():
            rec = Attempt("set", sku=sku, value=n, strategy=self.strategy)
            rec.start = 0.0
            # (later counts keep the safety stock: they do not name it)
            await self.service.set_stock(self.tenant, sku, LOC, n, strategy=self.strategy,
                                         pool_cap=cap, safety_stock=SAFETY.get(sku))
            rec.end, rec.outcome = time.time(), "ok"
            self.attempts.append(rec)
            self.buckets[sku] = n
        with psycopg.connect(self.dsn) as conn:
            for sku, bid in conn.execute(
                    "SELECT sku, bucket_id FROM stock_bucket WHERE tenant_id = %s",
                    (self.tenant,)).fetchall():
                self.bucket_ids[sku] = int(bid)

    # -- the load ------------------------------------------------------------------

    def running(self) -> bool:
        return not self.stop.is_set()

    async def big_buyer(self, n: int) -> None:
        """Buyers of more than a small pool bucket has: every answer must be a true no."""
        rng = random.Random(f"{self.seed}-big-{n}")
        for i in range(10**9):
            if not self.running():
                return
            rec = await self.reserve(f"big{n}-{i}", [("sell", 5)], 30, retry=rng.random() < 0.1)
            if rec.outcome == "held" and rec.rid:
                await self.transition("release", rec.rid)
            await self.pause(rng, 0.0, 0.01)

    async def small_buyer(self, sku: str, n: int, ttl: float = 30) -> None:
        """Buyers of one unit that hold and give it back: they must never be told no."""
        rng = random.Random(f"{self.seed}-small-{sku}-{n}")
        for i in range(10**9):
            if not self.running():
                return
            rec = await self.reserve(f"{sku}-s{n}-{i}", [(sku, 1)], ttl, retry=rng.random() < 0.05)
            if rec.outcome == "held" and rec.rid:
                await self.pause(rng, 0.0, 0.02)
                key = f"{sku}-s{n}-{i}-rel" if rng.random() < 0.3 else None
                await self.transition("release", rec.rid, key)
            await self.pause(rng, 0.0, 0.01)

    async def sell_admin(self) -> None:
        """Recounts to the same value and small corrections of the small pool bucket."""
        rng = random.Random(f"{self.seed}-sell-admin")
        for i in range(10**9):
            if not self.running():
                return
            roll = rng.random()
            if roll < 0.7:
                await self.set_stock("sell", 3)
            else:
                if (await self.adjust("sell", f"sell-c{i}", -1)).outcome == "ok":
                    await self.pause(rng, 0.0, 0.03)
                    await self.adjust("sell", f"sell-r{i}", 1, retry=rng.random() < 0.2)
            await self.pause(rng, 0.01, 0.05)

    async def raw_taker(self, sku: str, qty: int, n: int) -> None:
        """A transaction that runs the bucket take the way reserve_v1 does and sleeps before
        its end: a short take (which gave its units back) commits, a full one rolls back."""
        rng = random.Random(f"{self.seed}-raw-{sku}-{n}")
        bucket = self.bucket_ids[sku]
        async with await psycopg.AsyncConnection.connect(
                self.dsn, application_name="pgreserve:race-raw") as conn:
            while self.running():
                try:
                    cur = await conn.execute(
                        "SELECT strategy, pool_lo, pool_hi FROM stock_bucket"
                        " WHERE tenant_id = %s AND bucket_id = %s", (self.tenant, bucket))
                    strategy, lo, hi = await cur.fetchone()  # type: ignore[misc]  # the query always returns one row
                    cur = await conn.execute(
                        "SELECT ok FROM bucket_take_v1(%s, %s, %s, clock_timestamp(), %s, %s, %s)",
                        (self.tenant, bucket, qty, strategy, lo, hi))
                    ok = (await cur.fetchone())[0]  # type: ignore[index]  # the query always returns one row
                    await self.pause(rng, 0.02, 0.15)
                    if ok:
                        await conn.rollback()
                        self.report.raw_pauses["full take rolled back"] += 1
                    else:
                        await conn.commit()
                        self.report.raw_pauses["short take committed"] += 1
                except psycopg.errors.DeadlockDetected:
                    await conn.rollback()
                    self.report.raw_pauses["take deadlocked"] += 1
                except psycopg.Error as exc:
                    await conn.rollback()
                    self.report.raw_pauses[f"take failed {type(exc).__name__}"] += 1
                await self.pause(rng, 0.0, 0.03)

    async def raw_reserver(self, skus: list[str], n: int) -> None:
        """reserve_v1 itself in a transaction that sleeps before COMMIT (or ROLLBACK)."""
        rng = random.Random(f"{self.seed}-rawres-{n}")
        async with await psycopg.AsyncConnection.connect(
                self.dsn, application_name="pgreserve:race-raw") as conn:
            for i in range(10**9):
                if not self.running():
                    return
                sku, q, ttl = rng.choice(skus), rng.randint(1, 3), rng.choice([1.0, 30.0])
                key = f"raw{n}-{i}"
                fp = digest("reserve", {"lines": [[sku, LOC, q]], "ttl_ms": int(ttl * 1000)})
                rec = Attempt("reserve", key=key, cart=((sku, q),), ttl=ttl, raw=True)
                rec.start = time.time()
                try:
                    cur = await conn.execute(
                        "SELECT reserve_v1(%s, %s, %s, %s, %s, %s, %s)",
                        (self.tenant, key, fp, [sku], [LOC], [q], timedelta(seconds=ttl)))
                    doc = (await cur.fetchone())[0]  # type: ignore[index]  # the query always returns one row
                    await self.pause(rng, 0.02, 0.15)
                    if rng.random() < 0.3:
                        await conn.rollback()
                        self.report.raw_pauses["reserve rolled back"] += 1
                        continue
                    await conn.commit()
                except psycopg.Error as exc:
                    await conn.rollback()
                    self.report.raw_pauses[f"reserve failed {type(exc).__name__}"] += 1
                    continue
                rec.end = time.time()
                self.attempts.append(rec)
                self.note_reserve(rec, ReserveOutcome.from_json(doc))
                self.report.raw_pauses["reserve committed"] += 1
                if rec.outcome == "held" and rec.rid and rng.random() < 0.7:
                    await self.transition(rng.choice(["release", "claim"]), rec.rid)

    async def switcher(self) -> None:
        """Live strategy switches row <-> pool every few milliseconds, at the same count."""
        rng = random.Random(f"{self.seed}-switch")
        current = self.strategy
        while self.running():
            current = "row" if current == "pool" else "pool"
            await self.set_stock("switch", 100, strategy=current)
            await self.pause(rng, 0.003, 0.02)

    async def expiry_cycle(self, sku: str) -> None:
        """Holds with a 1 s TTL, forced corrections below them, buyers after the expiry."""
        rng = random.Random(f"{self.seed}-exp-{sku}")
        for i in range(10**9):
            if not self.running():
                return
            await self.set_stock(sku, 10, force=True)
            if i % 2 == 0:
                hold = await self.reserve(f"{sku}-h{i}", [(sku, 10)], 1.0)
                if rng.random() < 0.5:
                    await self.set_stock(sku, 4, force=True)
                else:
                    await self.adjust(sku, f"{sku}-f{i}", -6, force=True)
                if hold.expires is not None:
                    await asyncio.sleep(max(0.0, hold.expires - time.time()) + 0.03)
                late = await self.reserve(f"{sku}-l{i}", [(sku, 10)], 30)
                if late.outcome == "held" and late.rid:
                    await self.transition("claim", late.rid)
            else:
                a = await self.reserve(f"{sku}-a{i}", [(sku, 5)], 30)
                b = await self.reserve(f"{sku}-b{i}", [(sku, 5)], 30)
                await self.set_stock(sku, 4, force=True)
                for rec in (a, b):
                    if rec.outcome == "held" and rec.rid:
                        await self.transition("claim", rec.rid, f"{rec.key}-claim")
                await self.adjust(sku, f"{sku}-g{i}", 6)
                late = await self.reserve(f"{sku}-l{i}", [(sku, 6)], 30)
                if late.outcome == "held" and late.rid:
                    await self.transition("claim", late.rid)

    async def cart_buyer(self, n: int, pool: list[str], big: int) -> None:
        """1- and 2-line carts over shared buckets; short TTLs left to the sweeper."""
        rng = random.Random(f"{self.seed}-cart-{n}-{pool[0]}")
        for i in range(10**9):
            if not self.running():
                return
            lines = rng.sample(pool, 2 if rng.random() < 0.7 else 1)
            cart = [(sku, big if rng.random() < 0.05 else rng.randint(1, 3)) for sku in lines]
            ttl = 1.0 if rng.random() < 0.8 else 30.0
            key = f"{pool[0]}-{n}-{i}"
            rec = await self.reserve(key, cart, ttl, retry=rng.random() < 0.05)
            if rec.outcome == "held" and rec.rid:
                roll = rng.random()
                keyed = rng.random() < 0.3
                if roll < 0.1:
                    await self.transition("extend", rec.rid, f"{key}-ext" if keyed else None,
                                          ttl=rng.choice([1.0, 5.0]))
                    roll = rng.random()
                if roll < 0.25:
                    await self.transition("claim", rec.rid, f"{key}-claim" if keyed else None)
                elif roll < 0.45:
                    await self.transition("release", rec.rid, f"{key}-rel" if keyed else None)
            await self.pause(rng, 0.0, 0.005)

    async def cart_admin(self, skus: list[str], low: int, refill: int, name: str) -> None:
        """Receipts, corrections with and without force, recounts and strategy switches."""
        rng = random.Random(f"{self.seed}-admin-{name}")
        for i in range(10**9):
            if not self.running():
                return
            sku = rng.choice(skus)
            roll = rng.random()
            if roll < 0.4:
                view = await self.service.get_stock(self.tenant, sku, LOC)
                if view.on_hand - view.shortfall < low:
                    await self.adjust(sku, f"{name}-rcpt-{i}", refill, retry=rng.random() < 0.2)
            elif roll < 0.6:
                await self.adjust(sku, f"{name}-corr-{i}", -rng.randint(1, 3),
                                  force=rng.random() < 0.3)
            elif roll < 0.8:
                n = rng.randint(low, low + refill)
                await self.set_stock(sku, n, force=rng.random() < 0.3)
            else:
                n = rng.randint(low, low + refill)
                await self.set_stock(sku, n, strategy=rng.choice(["row", "pool"]))
            await self.pause(rng, 0.05, 0.25)

    async def sweeper(self) -> None:
        """The Sweeper worker (default batch of 500) on a pool of its own."""
        worker = Sweeper(self.sweeper_service)
        rng = random.Random(f"{self.seed}-sweeper")
        while self.running():
            try:
                await worker.run_once()
            except Busy:
                pass  # counted from the database's stats
            except (PgReserveError, psycopg.Error) as exc:
                self.violation("untyped_error", f"sweeper: {type(exc).__name__}: {exc}")
            await self.pause(rng, 0.05, 0.3)

    async def replenisher(self) -> None:
        rng = random.Random(f"{self.seed}-refill")
        while self.running():
            try:
                for tenant, bucket in await self.service.refill_candidates(0.3, 20):
                    await self.service.refill(tenant, bucket)
            except Busy:
                pass
            except (PgReserveError, psycopg.Error) as exc:
                self.violation("untyped_error", f"refill: {type(exc).__name__}: {exc}")
            await self.pause(rng, 0.1, 0.3)

    async def auditor(self) -> None:
        while self.running():
            await asyncio.sleep(0.4)
            await self.audit()

    async def audit(self) -> None:
        """The rules true at every instant, in one repeatable-read snapshot."""
        async with await psycopg.AsyncConnection.connect(
                self.dsn, application_name="pgreserve:race-audit") as conn:
            await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
            async with conn.transaction():
                cur = await conn.execute(
                    "SELECT rule, sku, detail FROM invariant_violations_v1(%s, NULL)",
                    (self.tenant,))
                for rule, sku, detail in await cur.fetchall():
                    check = "accounting" if rule == "accounting" else \
                        "negative" if rule == "negative" else f"invariant_{rule}"
                    self.violation(check, f"{sku}: {detail} (invariant_violations_v1)")
                cur = await conn.execute(FIGURES, (self.tenant,))
                for row in await cur.fetchall():
                    sku, on_hand, free, pool, held, shortfall, counted, adjusted, sold = row
                    figures = (f"{sku}: on_hand {on_hand} free {free} pool {pool} held {held} "
                               f"shortfall {shortfall}")
                    if on_hand != free + pool + held:
                        self.violation("accounting", f"{figures}: on_hand <> free + pool + held")
                    if min(on_hand, free, pool, held, shortfall) < 0:
                        self.violation("negative", figures)
                    if on_hand - shortfall != counted + adjusted + sold:
                        self.violation("conservation", f"{figures}: on_hand - shortfall <> "
                                       f"counted {counted} + adjusted {adjusted} + sold {sold}")
                    if free + pool > max(0, on_hand - shortfall):
                        self.violation("sellable", f"{figures}: more sellable than physical")
        self.report.audits += 1

    async def load(self) -> None:
        started = time.time()
        deadline = started + self.seconds
        carts = [f"cart-{i}" for i in range(4)]
        mixes = ["mix-0", "mix-1"]
        tasks = [
            *(self.big_buyer(n) for n in range(6)),
            *(self.small_buyer("sell", n) for n in range(2)),
            self.raw_taker("sell", 5, 0), self.sell_admin(),
            *(self.small_buyer("switch", n) for n in range(8)), self.switcher(),
            self.expiry_cycle("exp-0"), self.expiry_cycle("exp-1"),
            *(self.cart_buyer(n, carts, 400) for n in range(10)),
            self.cart_admin(carts, 150, 150, "carts"),
            *(self.cart_buyer(n, mixes, 15) for n in range(4)),
            self.cart_admin(mixes, 6, 8, "mixes"),
            self.raw_reserver(mixes, 0), self.raw_taker("mix-0", 2, 1),
            self.sweeper(), self.replenisher(), self.auditor(),
        ]

        async def timer() -> None:
            await asyncio.sleep(max(0.0, deadline - time.time()))
            self.stop.set()

        await asyncio.gather(timer(), *tasks)
        self.load_end = time.time()
        self.report.seconds = self.load_end - started

    # -- verdicts ------------------------------------------------------------------

    def timelines(self) -> dict[str, Timeline]:
        lines: dict[str, Timeline] = {sku: Timeline() for sku in self.buckets}
        first_ok: dict[str, Attempt] = {}
        for rec in self.attempts:
            if rec.outcome == "unknown":
                for sku in {rec.sku, *(s for s, _ in rec.cart)} - {None}:
                    assert sku is not None
                    lines[sku].uncertain_from = min(lines[sku].uncertain_from, rec.start)
            if rec.kind in ("set", "adjust") and rec.outcome == "ok" and rec.sku:
                if rec.kind == "adjust":
                    assert rec.key is not None
                    if rec.key in first_ok:
                        continue  # a replay: the first one applied it
                    first_ok[rec.key] = rec
                lines[rec.sku].admin.append(
                    AdminChange(rec.start, rec.end, rec.kind == "set", rec.value))
        holds = self.holds()
        for hold in holds.values():
            for sku, q in hold.cart:
                lines[sku].holds.append(HoldSpan(hold.rid, hold.start, hold.end,
                                                 hold.sure_until, hold.may_until, q))
                if hold.sold is not None:
                    lines[sku].sales.append(Sale(hold.sold[0], hold.sold[1], q))
        for t in lines.values():
            t.build()
        return lines

    def holds(self) -> dict[str, HoldFacts]:
        facts: dict[str, HoldFacts] = {}
        for rec in self.attempts:
            if rec.kind == "reserve" and rec.outcome == "held" and rec.rid:
                assert rec.expires is not None
                f = facts.setdefault(rec.rid, HoldFacts(rec.rid, rec.cart, rec.start, rec.end,
                                                        rec.expires))
                f.start, f.end = min(f.start, rec.start), min(f.end, rec.end)
        for rec in self.attempts:
            if rec.kind not in ("claim", "release", "extend") or rec.rid not in facts:
                continue
            f = facts[rec.rid]
            if rec.kind == "extend":
                f.expiry_low = min(f.expiry_low, rec.start + rec.ttl)
                if rec.outcome != "refused":
                    f.expiry_high = max(f.expiry_high, (rec.end if rec.end < INF else INF)
                                        + rec.ttl)
                continue
            f.first_attempt = min(f.first_attempt, rec.start)
            if rec.outcome in ("ok", "unknown"):
                f.acked = min(f.acked, rec.end)
            if rec.kind == "claim" and rec.outcome in ("ok", "unknown"):
                lo, hi = f.sold or (INF, INF)
                f.sold = (min(lo, rec.start), min(hi, rec.end))
        return facts

    def judge(self) -> None:
        """false_rejection and phantom_hold over every answer of the load."""
        started = time.time()
        lines = self.timelines()
        holds = self.holds()
        for rec in self.attempts:
            if rec.kind != "reserve" or rec.replayed or rec.end == INF:
                continue
            if any(rec.end >= lines[sku].uncertain_from for sku, _ in rec.cart):
                continue
            if rec.outcome == "rejected":
                self.report.rejections_judged += 1
                # what can be promised: what the bucket could serve, less its safety stock
                least = [lines[sku].surely_available_throughout(rec.start, rec.end, q)
                         - SAFETY.get(sku, 0) for sku, q in rec.cart]
                if all(lo >= q for lo, (_, q) in zip(least, rec.cart, strict=True)):
                    if os.environ.get("PGRESERVE_RACE_DUMP"):
                        self.dump_rejection(rec, lines)
                    self.violation("false_rejection", (
                        f"{rec.key}{' (raw)' if rec.raw else ''} {list(rec.cart)} rejected "
                        f"({rec.answer}) in {rec.end - rec.start:.3f} s, yet surely available "
                        f"throughout: {least}"))
            elif rec.outcome == "held" and rec.rid:
                self.report.holds_judged += 1
                hold = holds[rec.rid]
                for sku, q in rec.cart:
                    own = HoldSpan(rec.rid, hold.start, hold.end, hold.sure_until,
                                   hold.may_until, q)
                    # (the bound may stop early only once it covers the safety stock too)
                    safety = SAFETY.get(sku, 0)
                    most = (lines[sku].possibly_available_at_best(rec.start, rec.end, own,
                                                                  q + safety)
                            - safety)
                    if most < q:
                        self.violation("phantom_hold", (
                            f"{rec.key} held {q} of {sku} ({rec.rid}), yet at most {most} "
                            f"were available at any instant of its request"))
        self.report.analysis_s = time.time() - started

    def dump_rejection(self, rec: Attempt, lines: dict[str, Timeline]) -> None:
        """Opt-in (PGRESERVE_RACE_DUMP=dir): the database's and the checker's history of
        every bucket of a flagged rejection around its request, to reconstruct by hand."""
        out = Path(os.environ["PGRESERVE_RACE_DUMP"])
        out.mkdir(parents=True, exist_ok=True)
        lo, hi = rec.start - 2.5, rec.end + 0.5
        w: list[str] = [f"flagged {rec.key} cart {list(rec.cart)} ttl {rec.ttl} raw {rec.raw}",
                        f"  sent {rec.start:.6f} answered {rec.end:.6f} "
                        f"({rec.end - rec.start:.4f} s): {rec.answer}"]
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM created_at), outcome FROM request_ledger"
                " WHERE tenant_id = %s AND request_key = %s", (self.tenant, rec.key)).fetchone()
            w.append(f"  ledger row: created_at (its transaction's now()) {row and row[0]}"
                     f" outcome {row and row[1]}")
            for sku, q in rec.cart:
                bid = self.bucket_ids[sku]
                t = lines[sku]
                w.append(f"\n== {sku} (bucket {bid}), requested {q}")
                w.append("-- checker: admin changes (start end absolute value)")
                for a in t.admin:
                    if a.end >= lo - 30 and a.start <= hi:
                        w.append(f"   {a.start:.6f} {a.end:.6f} {a.absolute} {a.value}")
                w.append("-- checker: bounds (t, physical lo/hi, held at most/least, lo-held)")
                for x in t.instants(rec.start, rec.end):
                    plo, phi = t.physical(x)
                    w.append(f"   {x:.6f} P[{plo},{phi}] H<={t.held_at_most(x)} "
                             f"H>={t.held_at_least(x)} avail>={plo - t.held_at_most(x)}")
                w.append("-- checker: hold spans counting at the request (rid start end "
                         "sure_until may_until qty)")
                for h in sorted(t.holds, key=lambda h: h.start):
                    if h.start <= rec.end and h.may_until >= rec.start:
                        w.append(f"   {h.rid} {h.start:.6f} {h.end:.6f} {h.sure_until:.6f} "
                                 f"{h.may_until:.6f} {h.quantity}")
                w.append("-- db: stock_movement (created_at = its transaction's now())")
                for m in conn.execute(
                        "SELECT extract(epoch FROM created_at), movement_id, kind, quantity,"
                        " reservation_id, line_no, reason, request_key FROM stock_movement"
                        " WHERE tenant_id = %s AND bucket_id = %s"
                        "   AND created_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)"
                        " ORDER BY movement_id", (self.tenant, bid, lo - 30, hi)).fetchall():
                    w.append("   " + " ".join(str(v) for v in m))
                w.append("-- db: stock.changed events")
                for e in conn.execute(
                        "SELECT extract(epoch FROM created_at), event_id, payload FROM outbox_event"
                        " WHERE tenant_id = %s AND type = 'stock.changed'"
                        "   AND payload->>'sku' = %s"
                        "   AND created_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)"
                        " ORDER BY event_id", (self.tenant, sku, lo - 30, hi)).fetchall():
                    w.append("   " + " ".join(str(v) for v in e))
                w.append("-- db: lines of the bucket overlapping the request (created expires "
                         "status claimed released expired | restore movements)")
                for r in conn.execute(
                        "SELECT r.reservation_id, r.request_key, l.quantity,"
                        " extract(epoch FROM r.created_at), extract(epoch FROM l.expires_at),"
                        " r.status, extract(epoch FROM r.claimed_at),"
                        " extract(epoch FROM r.released_at), extract(epoch FROM r.expired_at),"
                        " (SELECT array_agg(extract(epoch FROM m.created_at)::text || ':'"
                        "         || m.reason) FROM stock_movement m"
                        "   WHERE m.tenant_id = l.tenant_id AND m.reservation_id = l.reservation_id"
                        "     AND m.line_no = l.line_no AND m.kind = 'restore')"
                        " FROM reservation_line l"
                        " JOIN reservation r USING (tenant_id, reservation_id)"
                        " WHERE l.tenant_id = %s AND l.bucket_id = %s"
                        "   AND r.created_at <= to_timestamp(%s)"
                        "   AND coalesce(r.claimed_at, r.released_at, r.expired_at, 'infinity')"
                        "       >= to_timestamp(%s)"
                        " ORDER BY r.created_at", (self.tenant, bid, hi, lo)).fetchall():
                    w.append("   " + " ".join(str(v) for v in r))
                row = conn.execute(
                    "SELECT coalesce(sum(l.quantity), 0), count(*) FROM reservation_line l"
                    " JOIN reservation r USING (tenant_id, reservation_id)"
                    " WHERE l.tenant_id = %s AND l.bucket_id = %s"
                    "   AND l.expires_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)"
                    "   AND r.created_at < to_timestamp(%s)",
                    (self.tenant, bid, rec.start, rec.end, rec.start)).fetchone()
                w.append(f"-- lines made before the request that passed expires_at during it: "
                         f"{row and row[0]} units in {row and row[1]} lines")
        name = f"{self.strategy}-{self.seed}-{rec.key}.txt"
        (out / name).write_text("\n".join(w) + "\n")

    async def final_audit(self) -> None:
        """The whole history against the database, after the load."""
        await self.audit()
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(
                "SELECT r.request_key, r.reservation_id::text, r.status,"
                "       array_agg(b.sku || '/' || l.quantity ORDER BY b.sku)"
                " FROM reservation r JOIN reservation_line l USING (tenant_id, reservation_id)"
                " JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id"
                " WHERE r.tenant_id = %s GROUP BY 1, 2, 3", (self.tenant,)).fetchall()
            moves = conn.execute(
                "SELECT b.sku, m.kind, sum(m.quantity) FROM stock_movement m"
                " JOIN stock_bucket b USING (tenant_id, bucket_id)"
                " WHERE m.tenant_id = %s GROUP BY 1, 2", (self.tenant,)).fetchall()
            books = conn.execute(
                "SELECT sku, on_hand - shortfall FROM stock_bucket WHERE tenant_id = %s",
                (self.tenant,)).fetchall()
        in_db = {key: (rid, status, sorted(lines)) for key, rid, status, lines in rows}
        ledger = {(sku, kind): int(total) for sku, kind, total in moves}
        adjusted: Counter[str] = Counter()
        sold: Counter[str] = Counter()
        seen_adjust: set[str] = set()
        first: dict[str, Attempt] = {}
        for rec in self.attempts:
            if rec.kind == "adjust" and rec.outcome == "ok" and rec.key not in seen_adjust:
                assert rec.key is not None and rec.sku is not None
                seen_adjust.add(rec.key)
                adjusted[rec.sku] += rec.value
            if rec.kind == "reserve" and rec.key and rec.outcome in ("held", "rejected"):
                first.setdefault(rec.key, rec)
        claimed = {rec.rid for rec in self.attempts if rec.kind == "claim" and rec.outcome == "ok"}
        released = {rec.rid for rec in self.attempts
                    if rec.kind == "release" and rec.outcome == "ok"}
        for key, rec in first.items():
            got = in_db.get(key)
            if rec.outcome == "held":
                lines = sorted(f"{sku}/{q}" for sku, q in rec.cart)
                if got is None or got[0] != rec.rid or got[2] != lines:
                    self.violation("history", f"acknowledged hold {key} {rec.rid} {lines}: "
                                   f"database has {got}")
                elif rec.rid in claimed and got[1] != "claimed":
                    self.violation("history", f"acknowledged claim of {rec.rid}, now {got[1]}")
                elif rec.rid in released and got[1] not in ("released", "expired"):
                    self.violation("history", f"acknowledged release of {rec.rid}, now {got[1]}")
                if rec.rid in claimed:
                    for sku, q in rec.cart:
                        sold[sku] += q
            elif got is not None:
                self.violation("history", f"rejected key {key} holds {got}")
        asked = {rec.key for rec in self.attempts if rec.kind == "reserve"}
        for key in in_db.keys() - asked:
            self.violation("history", f"reservation {key} that nobody asked for")
        for sku in self.buckets:
            if ledger.get((sku, "adjust"), 0) != adjusted[sku]:
                self.violation("ledger", f"{sku}: adjustments in the ledger "
                               f"{ledger.get((sku, 'adjust'), 0)}, acknowledged {adjusted[sku]}")
            if -ledger.get((sku, "sale"), 0) != sold[sku]:
                self.violation("ledger", f"{sku}: sales in the ledger "
                               f"{-ledger.get((sku, 'sale'), 0)}, acknowledged claims {sold[sku]}")
        timelines = self.timelines()
        for sku, physical in books:
            t = timelines[sku]
            if self.load_end >= t.uncertain_from:
                continue
            lo, hi = t.physical(self.load_end + 1.0)
            if not lo <= physical <= hi:
                self.violation("own_books", f"{sku}: on_hand - shortfall {physical}, the "
                               f"checker's received - sold lies in [{lo}, {hi}]")

    async def deadlock_figures(self, log_from: int) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self.report.deadlocks_server = int(conn.execute(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()[0])  # type: ignore[index]  # the query always returns one row
        text = self.rs.log.read_text(errors="replace")[log_from:] if self.rs.log.exists() else ""
        self.report.deadlocks_logged, with_sweeper = sweeper_deadlocks(text)
        self.report.deadlocks_with_sweeper = with_sweeper
        self.report.sweeper_retries = self.sweeper_db.stats.deadlocks_retried
        self.report.sweeper_busy = self.sweeper_db.stats.busy
        self.report.buyer_deadlock_retries = self.db.stats.deadlocks_retried
        if with_sweeper or self.report.sweeper_retries or self.report.sweeper_busy:
            self.violation("sweeper_deadlock", (
                f"{with_sweeper} deadlocks named expire_due_v1 in the server log; the sweeper "
                f"retried {self.report.sweeper_retries} deadlocks and gave up "
                f"{self.report.sweeper_busy} rounds as Busy"))

    # -- the crash -------------------------------------------------------------------

    async def crash_and_replay(self) -> None:
        """Answer rejections under load, crash the server, restart, replay every acknowledged key."""
        burst_db = self._database(16, "pgreserve:race-burst", attempts=1)
        await burst_db.open()
        burst = ReservationService(burst_db)
        acked: list[Attempt] = []

        async def buyer(c: int) -> None:
            for i in range(10**9):
                key = f"burst{c}-{i}"
                for _ in range(2):  # asked twice, told no twice (the steps)
                    rec = Attempt("reserve", key=key, cart=(("soldout", 2),), ttl=30)
                    out = await self.send(rec, lambda: burst.reserve(
                        self.tenant, key, [("soldout", LOC, 2)], ttl=30))  # noqa: B023 - awaited here
                    if out is None:
                        return
                    self.note_reserve(rec, out)
                    acked.append(rec)

        tasks = [asyncio.create_task(buyer(c)) for c in range(12)]
        await asyncio.sleep(0.4)
        await asyncio.to_thread(self.rs.crash)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.report.burst_rejections = sum(r.outcome == "rejected" for r in acked)
        for database in (burst_db, self.db, self.sweeper_db):
            await database.close()
        await asyncio.to_thread(self.rs.start)
        async with self._database(32, "pgreserve:race-replay") as db:
            service = ReservationService(db)
            for sku in self.buckets:
                await service.adjust_stock(self.tenant, f"after-crash-{sku}", sku, LOC, 1000)
            await self.replay(service)

    async def replay(self, service: ReservationService) -> None:
        started = time.time()
        todo: list[Attempt] = []
        seen: set[str] = set()
        for rec in self.attempts:
            if rec.key is None or rec.key in seen or rec.replayed:
                continue
            if rec.outcome in ("held", "rejected") or (rec.outcome == "ok" and rec.kind in (
                    "adjust", "claim", "release", "extend")):
                seen.add(rec.key)
                todo.append(rec)
        queue: asyncio.Queue[Attempt] = asyncio.Queue()
        for rec in todo:
            queue.put_nowait(rec)

        async def worker() -> None:
            while not queue.empty():
                rec = queue.get_nowait()
                try:
                    await self.replay_one(service, rec)
                except (PgReserveError, psycopg.Error) as exc:
                    self.violation("crash_replay", f"{rec.kind} {rec.key}: replay raised "
                                   f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(worker() for _ in range(24)))
        self.report.replayed_after_crash = len(todo)
        self.report.replay_s = time.time() - started

    async def replay_one(self, service: ReservationService, rec: Attempt) -> None:
        assert rec.key is not None
        if rec.kind == "reserve":
            out = await service.reserve(self.tenant, rec.key,
                                        [(sku, LOC, q) for sku, q in rec.cart], ttl=rec.ttl)
            rid = out.reservation.id if out.reservation else None
            if out.held != (rec.outcome == "held") or rid != rec.rid or not out.replayed:
                self.violation("crash_replay", (
                    f"{rec.key}: acknowledged {rec.outcome} {rec.rid or rec.answer}, after the "
                    f"crash {'held ' + str(rid) if out.held else 'rejected'}"
                    f"{'' if out.replayed else ' (ran afresh: its stored answer was lost)'}"))
        elif rec.kind == "adjust":
            assert rec.sku is not None
            view = await service.adjust_stock(self.tenant, rec.key, rec.sku, LOC, rec.value,
                                              reason="race", force=rec.force)
            if not view.replayed:
                self.violation("crash_replay", f"adjust {rec.key} applied again after the crash")
        else:
            assert rec.rid is not None
            if rec.kind == "claim":
                res = await service.claim(self.tenant, rec.rid, request_key=rec.key)
            elif rec.kind == "release":
                res = await service.release(self.tenant, rec.rid, request_key=rec.key)
            else:
                res = await service.extend(self.tenant, rec.rid, rec.ttl, request_key=rec.key,
                                           allow_shorten=True)
            if not res.replayed or res.status.value != rec.status:
                self.violation("crash_replay", f"{rec.kind} {rec.key}: acknowledged "
                               f"{rec.status}, after the crash {res.status.value} "
                               f"(replayed {res.replayed})")

    # -- the run ---------------------------------------------------------------------

    async def run(self) -> Report:
        with quiet_loggers("psycopg"):  # the crash and the paused takes break connections
            return await self._run()

    async def _run(self) -> Report:
        log_from = len(self.rs.log.read_text(errors="replace")) if self.rs.log.exists() else 0
        try:
            await self.setup()
            await self.load()
            await self.final_audit()
            await self.deadlock_figures(log_from)
            self.judge()
            self.report.attempts = Counter(f"{r.kind}:{r.outcome}" for r in self.attempts)
            await self.crash_and_replay()
        finally:
            for database in (self.db, self.sweeper_db):
                await database.close()
        return self.report


@dataclass
class HoldFacts:
    """What the checker knows of one hold: when it committed, expired, ended, was sold."""

    rid: str
    cart: tuple[tuple[str, int], ...]
    start: float
    end: float
    expires: float
    expiry_low: float = INF
    expiry_high: float = -INF
    first_attempt: float = INF  # the first claim or release sent
    acked: float = INF  # the first claim or release answered
    sold: tuple[float, float] | None = None

    @property
    def sure_until(self) -> float:
        return min(min(self.expires, self.expiry_low) - SLACK_S, self.first_attempt)

    @property
    def may_until(self) -> float:
        return min(max(self.expires, self.expiry_high) + SLACK_S, self.acked)


FIGURES = """
SELECT b.sku, b.on_hand, b.free, p.n, h.n, b.shortfall, s.counted, s.adjusted, s.sold
FROM stock_bucket b
CROSS JOIN LATERAL (SELECT count(*) AS n FROM stock_unit u
                    WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) p
CROSS JOIN LATERAL (SELECT coalesce(sum(quantity), 0) AS n FROM reservation_line l
                    WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held) h
CROSS JOIN LATERAL (
    SELECT coalesce(sum(quantity) FILTER (WHERE kind = 'count'), 0) AS counted,
           coalesce(sum(quantity) FILTER (WHERE kind = 'adjust'), 0) AS adjusted,
           coalesce(sum(quantity) FILTER (WHERE kind = 'sale'), 0) AS sold
    FROM stock_movement m WHERE m.tenant_id = b.tenant_id AND m.bucket_id = b.bucket_id) s
WHERE b.tenant_id = %s
ORDER BY b.sku
"""

__all__ = ["RaceRun", "RaceServer", "Report", "Status"]
