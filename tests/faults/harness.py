"""Fault injection under load: clients, an injector, an auditor and the final report.

A dedicated embedded PostgreSQL (its own temporary data directory) takes 32
clients reserving, claiming, releasing, extending, restocking and letting
holds expire over a few hot and many cold buckets of both strategies, while
the injector terminates backends (mid-transaction and during COMMIT), crashes
the server with ``pg_ctl stop -m immediate`` and starts it again, holds bucket
locks so lock_timeout fires, and pauses transactions past statement_timeout.

Every client writes down what it sent and what came back. Afterwards each
unknown outcome is resolved (reserve and restock: re-sent with the same request
key; claim and release: re-read), and the whole history is checked against
the database (see ``final_audit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg import sql

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
)

APP = "pgreserve:faults"
# fsync off is safe here (the OS survives an immediate stop: written WAL is in
# its page cache), synchronous_commit off is not: a commit acknowledged before
# its WAL left shared memory is lost by a crash. The first run of this suite
# with the session server's settings lost acknowledged holds exactly that way.
TEST_SETTINGS = {"fsync": "off", "full_page_writes": "off", "synchronous_commit": "on"}
HOT = [("hot-0", "w", "row"), ("hot-1", "w", "pool"), ("hot-2", "w", "row"),
       ("hot-3", "w", "pool")]
COLD = [(f"cold-{i:02d}", "w", "row" if i % 2 else "pool") for i in range(40)]
HOT_STOCK, COLD_STOCK = 60, 8
CLIENTS = 32
MAX_OPS_PER_CLIENT = 100_000
MAX_FAULTS = 100_000
RECOVERY_S = 90.0

# Test scaffolding, installed only in the fault server's database: a pause
# inside the reserve transaction (after the reservation row is written) and a
# pause at COMMIT (a deferred constraint trigger), each with a probability the
# injector sets in fault_control.
FAULT_SQL = """
CREATE TABLE fault_control (
    id integer PRIMARY KEY CHECK (id = 1),
    mid_ms integer NOT NULL DEFAULT 0, mid_p float8 NOT NULL DEFAULT 0,
    commit_ms integer NOT NULL DEFAULT 0, commit_p float8 NOT NULL DEFAULT 0);
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
CREATE FUNCTION fault_pause_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE c fault_control;
BEGIN
    SELECT * INTO c FROM fault_control WHERE id = 1;
    IF c.commit_ms > 0 AND random() < c.commit_p THEN
        PERFORM pg_sleep(c.commit_ms / 1000.0);
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fault_pause_commit AFTER INSERT ON outbox_event
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fault_pause_commit();
"""

T = TypeVar("T")

# The pool logs every connection the faults break; the report says what matters.
logging.getLogger("psycopg").setLevel(logging.CRITICAL)


@dataclass
class Record:
    """One request a client sent and what it learnt."""

    client: int
    kind: str  # reserve | claim | release | extend | restock
    key: str
    params: Any
    outcome: str = "pending"  # held | rejected | ok | refused | busy | unknown | raw
    reservation_id: str | None = None
    resolved: str | None = None
    error: str | None = None


@dataclass
class Report:
    """What the run did, printed at the end."""

    seconds: float = 0.0
    operations: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    unknown_resolved: int = 0
    busy_resolved: int = 0
    violations: list[str] = field(default_factory=list)
    checks: int = 0
    raw_errors: Counter[str] = field(default_factory=Counter)

    def lines(self) -> list[str]:
        out = [
            f"fault run: {self.seconds:.1f} s of load, {CLIENTS} clients, "
            f"{len(HOT)} hot + {len(COLD)} cold buckets (row and pool)",
            "faults: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
            f"audits after faults: {self.checks}",
            f"busy outcomes re-checked: {self.busy_resolved}",
        ]
        if self.raw_errors:
            out.append("unexpected errors: " + ", ".join(
                f"{k} {v}" for k, v in sorted(self.raw_errors.items())))
        out += [f"violation: {v}" for v in self.violations[:50]]
        out.append(f"soak: {self.operations} operations, {sum(self.faults.values())} faults "
                   f"injected, {self.unknown_resolved} unknown outcomes resolved, "
                   f"{len(self.violations)} invariant violations")
        return out


class FaultServer:
    """An embedded server in its own temporary data directory, safe to crash."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pgreserve-faults-"))
        self.server = EmbeddedServer(self.root / "data", extra_settings=TEST_SETTINGS)
        self.dsn = ""

    def start(self) -> str:
        self.dsn = self.server.start()
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


class FaultRun:
    """The load, the faults and the audit of one run."""

    def __init__(self, fs: FaultServer, seconds: float, seed: int) -> None:
        self.fs = fs
        self.seconds = seconds
        self.seed = seed
        self.report = Report()
        self.records: list[Record] = []
        self.tenant = 0
        self.db = Database(fs.dsn, min_size=4, max_size=24, application_name=APP,
                           settings=TxSettings(lock_timeout_ms=300, statement_timeout_ms=1000,
                                               max_attempts=6))
        self.service = ReservationService(self.db)
        # Half the clients go through a Database that does not retry a lost
        # connection itself: their lost commits surface as OutcomeUnknown and
        # are settled afterwards through the request key, as a caller would.
        self.raw_db = Database(fs.dsn, min_size=2, max_size=12, application_name=APP,
                               settings=TxSettings(lock_timeout_ms=300,
                                                   statement_timeout_ms=1000, max_attempts=1))
        self.raw_service = ReservationService(self.raw_db)
        self.stop = asyncio.Event()

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

    async def attempt(self, rec: Record, call: Callable[[], Awaitable[Any]]) -> Any:
        """Send one request and write down the outcome class."""
        self.records.append(rec)
        self.report.operations += 1
        try:
            result = await call()
        except OutcomeUnknown as exc:
            rec.outcome, rec.error = "unknown", str(exc)
        except Busy as exc:
            rec.outcome, rec.error = "busy", str(exc)
        except (ReservationClaimed, ReservationReleased, ReservationExpired,
                ReservationNotActive) as exc:
            rec.outcome, rec.error = "refused", type(exc).__name__
        except PgReserveError as exc:
            rec.outcome, rec.error = "raw", f"{type(exc).__name__}: {exc}"
            self.report.raw_errors[f"{rec.kind}:{type(exc).__name__}"] += 1
        except psycopg.Error as exc:
            # The service promised typed errors: an untyped one is an unknown
            # outcome for the caller, and a finding for the report.
            rec.outcome, rec.error = "unknown", f"{type(exc).__name__}: {exc}"
            self.report.raw_errors[f"{rec.kind}:{type(exc).__name__}"] += 1
        else:
            return result
        return None

    async def client(self, c: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + c)
        service = self.raw_service if c % 2 else self.service
        for i in range(MAX_OPS_PER_CLIENT):
            if time.monotonic() > deadline or self.stop.is_set():
                return
            if rng.random() < 0.05:
                sku, loc, _ = rng.choice(HOT + COLD)
                delta = rng.randint(1, 6)
                key = f"c{c}-restock-{i}"
                rec = Record(c, "restock", key, (sku, loc, delta))
                if await self.attempt(rec, partial(
                        service.adjust_stock, self.tenant, key, sku, loc, delta,
                        reason="restock")) is not None:
                    rec.outcome = "ok"
                continue
            n_lines = 1 if rng.random() < 0.8 else 2
            picked: dict[tuple[str, str], int] = {}
            while len(picked) < n_lines:
                sku, loc, _ = rng.choice(HOT) if rng.random() < 0.6 else rng.choice(COLD)
                picked[(sku, loc)] = rng.randint(1, 3)
            cart = [(s, lo, q) for (s, lo), q in picked.items()]
            ttl = 1.0 if rng.random() < 0.3 else 30.0
            key = f"c{c}-r{i}"
            rec = Record(c, "reserve", key, (tuple(cart), ttl))
            out = await self.attempt(
                rec, partial(service.reserve, self.tenant, key, cart, ttl=ttl))
            if out is None:
                continue
            rec.outcome = "held" if out.held else "rejected"
            if not out.held:
                continue
            rid = out.reservation.id
            rec.reservation_id = rid
            if rng.random() < 0.05:  # a client retry of the same request
                again = Record(c, "reserve", key, (tuple(cart), ttl))
                dup = await self.attempt(
                    again, partial(service.reserve, self.tenant, key, cart, ttl=ttl))
                if dup is not None:
                    again.outcome = "held" if dup.held else "rejected"
                    again.reservation_id = dup.reservation.id if dup.reservation else None
            roll = rng.random()
            if roll < 0.1:
                ext = Record(c, "extend", key, rid)
                if await self.attempt(ext, partial(
                        service.extend, self.tenant, rid, 30)) is not None:
                    ext.outcome = "ok"
                roll = rng.random()
            if roll < 0.45:
                kind = "claim"
            elif roll < 0.75:
                kind = "release"
            else:
                continue  # left to expire (or to live on)
            act = Record(c, kind, key, rid, reservation_id=rid)
            fn = service.claim if kind == "claim" else service.release
            if await self.attempt(act, partial(fn, self.tenant, rid)) is not None:
                act.outcome = "ok"

    async def sweeper(self, deadline: float) -> None:
        for _ in range(MAX_OPS_PER_CLIENT):
            if time.monotonic() > deadline or self.stop.is_set():
                return
            # idempotent by state; the next round does it
            with contextlib.suppress(PgReserveError, psycopg.Error):
                await self.service.expire_due(100)
            await asyncio.sleep(0.3)

    # -- faults --------------------------------------------------------------------

    async def admin(self) -> psycopg.AsyncConnection[Any]:
        return await until_up(lambda: psycopg.AsyncConnection.connect(
            self.fs.dsn, autocommit=True, application_name="pgreserve:injector"))

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
        for _ in range(20):
            killed += await self.terminate(
                "state = 'active' AND query NOT ILIKE 'COMMIT%%'", rng.randint(1, 3))
            if killed >= 3:
                break
            await asyncio.sleep(0.05)
        await self.control(mid_ms=0, mid_p=0)
        self.report.faults["terminate mid-transaction"] += killed

    async def fault_terminate_commit(self, rng: random.Random) -> None:
        """Kill backends while they run COMMIT (a deferred trigger keeps them there)."""
        await self.control(commit_ms=200, commit_p=0.5)
        killed = 0
        for _ in range(40):
            killed += await self.terminate("state = 'active' AND query ILIKE 'COMMIT%%'",
                                           rng.randint(1, 2))
            if killed >= 3:
                break
            await asyncio.sleep(0.05)
        await self.control(commit_ms=0, commit_p=0)
        self.report.faults["terminate during COMMIT"] += killed

    async def fault_terminate_any(self, rng: random.Random) -> None:
        """Kill random pool connections, idle or busy: the pool must notice and replace them."""
        self.report.faults["terminate any backend"] += await self.terminate(
            "true", rng.randint(2, 8))

    async def fault_crash(self, rng: random.Random) -> None:
        """pg_ctl stop -m immediate, a short outage, then start again (crash recovery)."""
        await asyncio.to_thread(self.fs.crash)
        self.report.faults["server crash (stop -m immediate) and restart"] += 1
        await asyncio.sleep(rng.uniform(0.1, 0.8))
        await asyncio.to_thread(self.fs.start)

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
        await asyncio.sleep(1.5)
        await self.control(mid_ms=0, mid_p=0)
        self.report.faults["transaction paused past statement_timeout"] += 1

    async def injector(self, deadline: float) -> None:
        rng = random.Random(self.seed)
        kinds = [self.fault_terminate_mid, self.fault_terminate_commit, self.fault_terminate_any,
                 self.fault_crash, self.fault_lock_hang, self.fault_statement_hang]
        await asyncio.sleep(0.5)
        for n in range(MAX_FAULTS):
            if time.monotonic() > deadline:
                return
            fault = kinds[n % len(kinds)] if n < len(kinds) else rng.choice(kinds)
            await fault(rng)
            await self.audit_now()
            await asyncio.sleep(rng.uniform(0.2, 0.6))

    # -- audits --------------------------------------------------------------------

    async def audit_now(self) -> None:
        """The checks that hold at any instant, in one snapshot, while load runs."""
        found = await until_up(lambda: audit(self.fs.dsn))
        self.report.checks += 1
        self.report.violations += found

    async def resolve(self) -> None:
        """Settle every unknown (and busy) outcome through its request key or by re-reading."""
        for rec in list(self.records):
            if rec.outcome not in ("unknown", "busy"):
                continue
            if rec.kind == "reserve":
                cart, ttl = rec.params
                out = await until_up(partial(
                    self.service.reserve, self.tenant, rec.key, list(cart), ttl=ttl))
                rec.resolved = "held" if out.held else "rejected"
                rec.reservation_id = out.reservation.id if out.reservation else None
            elif rec.kind == "restock":
                sku, loc, delta = rec.params
                await until_up(partial(
                    self.service.adjust_stock, self.tenant, rec.key, sku, loc, delta,
                    reason="restock"))
                rec.resolved = "ok"
            else:
                res = await until_up(partial(
                    self.service.get_reservation, self.tenant, rec.params))
                rec.resolved = res.status.value
            if rec.outcome == "unknown":
                self.report.unknown_resolved += 1
            else:
                self.report.busy_resolved += 1

    async def final_audit(self) -> None:
        """The whole history against the database, after load and resolution."""
        v = self.report.violations
        v += await until_up(lambda: audit(self.fs.dsn))
        async with await self.admin() as conn:
            rows = await (await conn.execute(
                "SELECT r.request_key, r.reservation_id::text, r.status,"
                "       array_agg(b.sku || '/' || b.location || '/' || l.quantity"
                "                 ORDER BY b.sku, b.location)"
                " FROM reservation r JOIN reservation_line l USING (tenant_id, reservation_id)"
                " JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id"
                " GROUP BY 1, 2, 3")).fetchall()
            restocked = await (await conn.execute(
                "SELECT b.sku, coalesce(sum(m.quantity), 0) FROM stock_bucket b"
                " LEFT JOIN stock_movement m ON m.tenant_id = b.tenant_id"
                "  AND m.bucket_id = b.bucket_id AND m.kind = 'adjust' GROUP BY b.sku")).fetchall()
        in_db = {key: (rid, status, sorted(lines)) for key, rid, status, lines in rows}
        sent: dict[str, Record] = {}
        acked_restock: Counter[str] = Counter()
        for rec in self.records:
            state = rec.resolved or rec.outcome
            if rec.kind == "restock" and state == "ok":
                acked_restock[rec.params[0]] += rec.params[2]
            if rec.kind != "reserve":
                continue
            if rec.key in sent and state == "held":
                first = sent[rec.key]
                if first.reservation_id not in (None, rec.reservation_id):
                    v.append(f"key {rec.key} answered with two reservations")
            if state == "held":
                sent[rec.key] = rec
                lines = sorted(f"{s}/{lo}/{q}" for s, lo, q in rec.params[0])
                got = in_db.get(rec.key)
                if got is None or got[0] != rec.reservation_id or got[2] != lines:
                    v.append(f"acknowledged hold {rec.key} {rec.reservation_id} {lines}:"
                             f" database has {got}")
            else:
                sent.setdefault(rec.key, rec)
        known = {r.key for r in self.records if r.kind == "reserve"}
        for key in in_db:
            if key not in known:
                v.append(f"reservation {key} that no client asked for")
        for key, rec in sent.items():
            state = rec.resolved or rec.outcome
            if state == "rejected" and key in in_db:
                v.append(f"rejected request {key} holds {in_db[key]}")
        for rec in self.records:
            state = rec.resolved or rec.outcome
            if rec.kind in ("claim", "release") and state == "ok":
                status = next((s for r, s, _ in in_db.values() if r == rec.reservation_id), None)
                ok = ("claimed",) if rec.kind == "claim" else ("released", "expired")
                if status not in ok:
                    v.append(f"acknowledged {rec.kind} of {rec.reservation_id}, now {status}")
        for sku, total in restocked:
            if int(total) != acked_restock[sku]:
                v.append(f"{sku}: restocks in the ledger {total}, acknowledged "
                         f"{acked_restock[sku]}")
        left = [r for r in self.records if r.outcome in ("unknown", "busy") and not r.resolved]
        v += [f"unresolved {r.kind} {r.key}" for r in left]
        v += [f"unexpected error from the service: {k} x{n}"
              for k, n in self.report.raw_errors.items()]

    # -- the run -------------------------------------------------------------------

    async def run(self) -> Report:
        await self.seed_stock()
        started = time.monotonic()
        deadline = started + self.seconds
        try:
            await asyncio.wait_for(asyncio.gather(
                *(self.client(c, deadline) for c in range(CLIENTS)),
                self.sweeper(deadline), self.injector(deadline)),
                timeout=self.seconds + 4 * RECOVERY_S)
            self.report.seconds = time.monotonic() - started
            await self.control(mid_ms=0, mid_p=0, commit_ms=0, commit_p=0)
            await self.resolve()
            await self.final_audit()
            self.report.outcomes = Counter(r.outcome for r in self.records)
        finally:
            await self.db.close()
            await self.raw_db.close()
        return self.report


async def audit(dsn: str) -> list[str]:
    """Every instant-true rule, in one repeatable-read snapshot; one string per breach."""
    async with await psycopg.AsyncConnection.connect(
            dsn, application_name="pgreserve:auditor") as conn:
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        found: list[str] = []
        queries = {
            "invariant": "SELECT rule || ': ' || sku || ' ' || detail"
                         " FROM invariant_violations_v1(NULL, NULL)",
            "restored twice": "SELECT reservation_id || '/' || line_no FROM stock_movement"
                              " WHERE kind = 'restore' GROUP BY reservation_id, line_no"
                              " HAVING count(*) > 1",
            "sold twice": "SELECT reservation_id || '/' || line_no FROM stock_movement"
                          " WHERE kind = 'sale' GROUP BY reservation_id, line_no"
                          " HAVING count(*) > 1",
            # held units are in exactly one place: a held line has no sale and
            # no restore; a claimed reservation sold every line, nothing else did
            "held and sold": "SELECT l.reservation_id || '/' || l.line_no"
                             " FROM reservation_line l JOIN stock_movement m"
                             "  ON m.tenant_id = l.tenant_id"
                             " AND m.reservation_id = l.reservation_id"
                             " AND m.line_no = l.line_no AND m.kind = 'sale' WHERE l.held",
            "sale mismatch": "SELECT r.reservation_id || ' ' || r.status FROM reservation r"
                             " JOIN reservation_line l USING (tenant_id, reservation_id)"
                             " LEFT JOIN stock_movement m ON m.tenant_id = l.tenant_id"
                             "  AND m.reservation_id = l.reservation_id"
                             "  AND m.line_no = l.line_no AND m.kind = 'sale'"
                             " WHERE (r.status = 'claimed') <> (m.movement_id IS NOT NULL)",
            # stock + holds + sales = seeded + restocks
            "conservation": "SELECT b.sku || format(': free %s + pool %s + held %s + sold %s"
                            " <> counted %s + restocked %s', b.free, p.n, h.n, -s.sold,"
                            " s.counted, s.adjusted)"
                            " FROM stock_bucket b"
                            " CROSS JOIN LATERAL (SELECT count(*) AS n FROM stock_unit u"
                            "   WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) p"
                            " CROSS JOIN LATERAL (SELECT coalesce(sum(quantity), 0) AS n"
                            "   FROM reservation_line l WHERE l.tenant_id = b.tenant_id"
                            "   AND l.bucket_id = b.bucket_id AND l.held) h"
                            " CROSS JOIN LATERAL (SELECT"
                            "   coalesce(sum(quantity) FILTER (WHERE kind = 'sale'), 0) AS sold,"
                            "   coalesce(sum(quantity) FILTER (WHERE kind = 'count'), 0) AS counted,"
                            "   coalesce(sum(quantity) FILTER (WHERE kind = 'adjust'), 0)"
                            "     AS adjusted"
                            "   FROM stock_movement m WHERE m.tenant_id = b.tenant_id"
                            "   AND m.bucket_id = b.bucket_id) s"
                            " WHERE b.free + p.n + h.n - s.sold <> s.counted + s.adjusted"
                            "    OR b.on_hand <> s.counted + s.adjusted + s.sold",
        }
        async with conn.transaction():
            for name, sql in queries.items():
                cur = await conn.execute(sql)
                found += [f"{name}: {row[0]}" for row in await cur.fetchall()]
        return found


__all__ = ["FaultRun", "FaultServer", "Report", "Status"]
