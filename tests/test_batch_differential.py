"""The per-bucket combiner (core/batching.py, sql/functions/batch.sql) against the
unbatched path, under hostile sequences and real concurrency.

Scenarios run twice: batched (queued behind a locked bucket row so they leave as one
batch in arrival order) and one by one without batching; answers, stock, ledger and
replays must be identical, and the invariants must hold.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgreserve import Database, ReservationService
from pgreserve.domain import Reservation, ReserveOutcome
from pgreserve.errors import (
    IdempotencyKeyReused,
    InvalidRequest,
    PgReserveError,
    ReservationClaimed,
    ReservationReleased,
    UnknownStock,
)
from test_batch_order import together_or_apart
from test_batching import bucket_id, bucket_locked
from test_concurrency import deadlocks, wait_until_blocked

Step = Callable[[ReservationService, int, dict[str, str]], Awaitable[Any]]
SKU, LOC = "s", "w"
NOW = datetime(2030, 1, 1, tzinfo=UTC)


def answer(result: Any) -> tuple[Any, ...]:
    if isinstance(result, PgReserveError):
        return ("error", result.code)
    if isinstance(result, BaseException):
        return ("exception", type(result).__name__, str(result))
    if isinstance(result, ReserveOutcome):
        if result.held:
            assert result.reservation is not None
            return ("held", result.replayed,
                    [(x.quantity, x.backordered) for x in result.reservation.lines])
        return ("rejected", result.replayed, result.reason,
                [(s.requested, s.available) for s in result.short_lines])
    if isinstance(result, Reservation):
        return ("reservation", result.status.value, result.replayed)
    if isinstance(result, int):
        return ("int", result)
    if result is None:
        return ("none",)
    raise AssertionError(f"unexpected answer {result!r}")


def ledger(dsn: str, tenant: int) -> list[tuple[Any, ...]]:
    """The request ledger, ids and times masked."""
    out = []
    with psycopg.connect(dsn) as conn:
        for key, op, status, outcome in conn.execute(
                "SELECT request_key, operation, status, outcome FROM request_ledger"
                " WHERE tenant_id = %s ORDER BY request_key", (tenant,)):
            out.append((key, op, status, _mask(outcome)))
    return out


def _mask(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: ("<t>" if k.endswith("_at") and v is not None else
                    "<id>" if k == "id" else _mask(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_mask(x) for x in doc]
    return doc


def books(dsn: str, tenant: int) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        b = conn.execute("SELECT on_hand, free, shortfall, (SELECT count(*) FROM stock_unit u"
                         " WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id)"
                         " FROM stock_bucket b WHERE tenant_id = %s ORDER BY sku",
                         (tenant,)).fetchall()
        r = conn.execute("SELECT status, count(*) FROM reservation WHERE tenant_id = %s"
                         " GROUP BY status ORDER BY status", (tenant,)).fetchall()
        m = conn.execute("SELECT kind, coalesce(reason, ''), sum(quantity), count(*)"
                         " FROM stock_movement WHERE tenant_id = %s GROUP BY 1, 2 ORDER BY 1, 2",
                         (tenant,)).fetchall()
        e = conn.execute("SELECT type, count(*) FROM outbox_event WHERE tenant_id = %s"
                         " GROUP BY 1 ORDER BY 1", (tenant,)).fetchall()
    # (on_hand, free+pool) only: where units sit (free or pool) differs by path
    return ([(x[0], x[1] + x[3], x[2]) for x in b], r, m, e)


class Scenario:
    def __init__(self, on_hand: int, setup: Step | None, steps: list[Step], **stock: Any):
        self.on_hand, self.setup, self.steps, self.stock = on_hand, setup, steps, stock


async def run(db: Database, dsn: str, scenario: Scenario, name: str, batched: bool,
              now: list[datetime]) -> dict[str, Any]:
    svc = ReservationService(db, clock=lambda: now[0], batching=batched)
    plain = ReservationService(db, clock=lambda: now[0], batching=False)
    tenant = (await plain.create_tenant(name)).id
    await plain.set_stock(tenant, SKU, LOC, scenario.on_hand, **scenario.stock)
    ids: dict[str, str] = {}
    if scenario.setup is not None:
        await scenario.setup(plain, tenant, ids)
    calls: list[Callable[[], Awaitable[Any]]] = [
        functools.partial(step, svc, tenant, ids) for step in scenario.steps]
    if batched:
        bucket = await bucket_id(db, tenant, SKU)
        for rid in ids.values():  # the service knows the buckets (as after its own reserve)
            svc._remember_bucket(tenant, uuid.UUID(rid), bucket)
    results = await together_or_apart(db, svc, plain, tenant, (SKU, LOC), calls, batched,
                                      catch=Exception)
    sizes = dict(svc.combiner.stats.sizes) if batched and svc.combiner is not None else {}
    violations = await plain.invariant_violations(tenant)
    state = books(dsn, tenant)
    stored = ledger(dsn, tenant)
    replays = []
    for call in calls:
        try:
            replays.append(answer(await call()))
        except Exception as exc:  # noqa: BLE001
            replays.append(answer(exc))
    return {"answers": [answer(r) for r in results], "books": state, "ledger": stored,
            "violations": violations, "replays": replays, "_sizes": sizes}


def compare(batched: dict[str, Any], plain: dict[str, Any]) -> None:
    assert batched["violations"] == [], batched["violations"]
    assert plain["violations"] == [], plain["violations"]
    for k in ("answers", "books", "ledger", "replays"):
        assert batched[k] == plain[k], (k, batched["_sizes"])


# -- steps ----------------------------------------------------------------------

def reserve(key: str, q: int, ttl: float = 600, name: str | None = None) -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        out = await svc.reserve(tenant, key, [(SKU, LOC, q)], ttl=ttl)
        if out.reservation is not None:
            ids.setdefault(name or key, out.reservation.id)
        return out
    return step


def claim(name: str, key: str | None = None) -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        return await svc.claim(tenant, ids[name], request_key=key)
    return step


def release(name: str, key: str | None = None) -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        return await svc.release(tenant, ids[name], request_key=key)
    return step


def sweep() -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        return await svc.expire_due()
    return step


def holds(*spec: tuple[str, int, float], advance: float = 0.0,
          now: list[datetime] | None = None) -> Step:
    """Setup: reservations (name, quantity, ttl), then the clock moves `advance` s."""
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        for name, q, ttl in spec:
            out = await svc.reserve(tenant, f"setup-{name}", [(SKU, LOC, q)], ttl=ttl)
            assert out.reservation is not None, out
            ids[name] = out.reservation.id
        if now is not None:
            now[0] += timedelta(seconds=advance)
    return step


def limit(n: int) -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        await svc.set_cart_limit(tenant, SKU, n)
    return step


def frozen() -> Step:
    async def step(svc: ReservationService, tenant: int, ids: dict[str, str]) -> Any:
        await svc.freeze(tenant, "audit", "me", sku=SKU, location=LOC)
    return step


def scenarios(now: list[datetime]) -> dict[str, Scenario]:
    return {
        # the release frees exactly what the reserve after it needs (sold out before)
        "release_then_reserve_at_sellout": Scenario(
            3, holds(("x", 2, 600)), [release("x"), reserve("a", 2)]),
        "reserve_release_reserve_at_sellout": Scenario(
            3, holds(("x", 2, 600)), [reserve("a", 2), release("x"), reserve("b", 2),
                                      reserve("a", 2)]),
        "keyed_release_then_reserve": Scenario(
            3, holds(("x", 2, 600)), [release("x", "r1"), reserve("a", 2), release("x", "r1")]),
        "claim_then_release": Scenario(
            5, holds(("x", 2, 600)), [claim("x"), release("x"), reserve("a", 3)]),
        "release_then_claim": Scenario(
            5, holds(("x", 2, 600)), [release("x"), claim("x"), reserve("a", 4)]),
        "keyed_claim_then_release": Scenario(
            5, holds(("x", 2, 600)), [claim("x", "c1"), release("x", "r1"), claim("x", "c1"),
                                      release("x", "c1")]),
        "keyed_release_then_claim": Scenario(
            5, holds(("x", 2, 600)), [release("x", "r1"), claim("x", "c1"),
                                      release("x", "r1"), claim("x", "r1")]),
        "claim_twice_release_twice": Scenario(
            6, holds(("x", 2, 600), ("y", 1, 600)),
            [claim("x"), claim("x"), release("y"), release("y"), reserve("a", 4)]),
        "same_key_twice_same_params": Scenario(
            5, None, [reserve("k", 2), reserve("k", 2), reserve("j", 3), reserve("j", 3)]),
        "same_key_twice_other_params": Scenario(
            5, None, [reserve("k", 2), reserve("k", 3), reserve("k", 2)]),
        "same_key_rejected_then_repeated": Scenario(
            2, None, [reserve("k", 5), reserve("j", 1), reserve("k", 5), reserve("k", 1)]),
        "key_reused_across_operations": Scenario(
            5, holds(("x", 1, 600)), [reserve("k", 1), claim("x", "k"), release("x", "k"),
                                      claim("x", "c"), reserve("c", 1)]),
        "expired_release_and_reserve": Scenario(
            4, holds(("x", 3, 60), advance=120, now=now),
            [release("x"), reserve("a", 3), claim("x")]),
        "expired_claim_then_reserve": Scenario(
            4, holds(("x", 3, 60), advance=120, now=now),
            [claim("x", "c"), reserve("a", 1), reserve("b", 3)]),
        "expired_reserve_then_claim": Scenario(
            4, holds(("x", 3, 60), advance=120, now=now),
            [reserve("a", 2), claim("x", "c"), reserve("b", 1)]),
        "sweep_release_reserve": Scenario(
            5, holds(("x", 2, 60), ("y", 2, 600), advance=120, now=now),
            [sweep(), release("x"), release("y"), reserve("a", 4), claim("x")]),
        "safety_release_reserve": Scenario(
            6, holds(("x", 2, 600), ("y", 1, 60), advance=120, now=now),
            [reserve("a", 3), release("x"), reserve("b", 2), claim("y"), reserve("c", 1)],
            safety_stock=2),
        "safety_expired_claims": Scenario(
            5, holds(("x", 2, 60), ("y", 1, 60), advance=120, now=now),
            [claim("y"), reserve("a", 2), claim("x", "cx"), release("y"), reserve("b", 1)],
            safety_stock=1),
        "cart_limit_in_batch": Scenario(
            10, limit(3), [reserve("a", 4), reserve("b", 3), reserve("a", 4), reserve("c", 9)]),
        "frozen_then_lifted": Scenario(
            10, frozen(), [reserve("a", 1), reserve("b", 20)]),
        "exact_sellout_chain": Scenario(
            4, holds(("x", 1, 600), ("y", 1, 600), ("z", 1, 600)),
            [reserve("a", 1), release("x"), reserve("b", 1), reserve("c", 1), release("y"),
             claim("z"), reserve("d", 1), reserve("e", 1)]),
    }


NAMES = sorted(scenarios([NOW]))


@pytest.mark.parametrize("strategy", ["row", "pool"])
@pytest.mark.parametrize("name", NAMES)
async def test_batched_answers_equal_unbatched(db: Database, dsn: str, name: str,
                                               strategy: str) -> None:
    b_now, p_now = [NOW], [NOW]
    stock: dict[str, Any] = {"strategy": strategy}
    sb = scenarios(b_now)[name]
    sp = scenarios(p_now)[name]
    sb.stock.update(stock)
    sp.stock.update(stock)
    batched = await run(db, dsn, sb, f"{name}-b", True, b_now)
    plain = await run(db, dsn, sp, f"{name}-p", False, p_now)
    compare(batched, plain)


# -- two processes (separate pools), real concurrency ---------------------------------



async def _violations(svc: ReservationService, tenant: int) -> list[Any]:
    return await svc.invariant_violations(tenant)


@pytest.mark.parametrize("strategy", ["row", "pool"])
@pytest.mark.parametrize("b_batched", [True, False])
async def test_same_key_from_two_processes(dsn: str, strategy: str, b_batched: bool) -> None:
    """Rounds of the same key sent at once by two processes, with the same and with
    other parameters, amid other buyers of the bucket; stock runs out on the way."""
    async with Database(dsn, max_size=6) as db_a, Database(dsn, max_size=6) as db_b:
        a = ReservationService(db_a)
        b = ReservationService(db_b, batching=b_batched)
        tenant = (await a.create_tenant("two")).id
        await a.set_stock(tenant, SKU, LOC, 60, strategy=strategy)
        await a.reserve(tenant, "warm-a", [(SKU, LOC, 1)])
        await b.reserve(tenant, "warm-b", [(SKU, LOC, 1)])
        rng = random.Random(7)
        for rnd in range(40):
            same = rng.random() < 0.5
            qa = rng.randint(1, 3)
            qb = qa if same else qa + 1
            noise = [x.reserve(tenant, f"n{rnd}-{i}", [(SKU, LOC, 1)])
                     for i, x in enumerate((a, b, a, b))]
            res = await asyncio.wait_for(asyncio.gather(
                a.reserve(tenant, f"k{rnd}", [(SKU, LOC, qa)]),
                b.reserve(tenant, f"k{rnd}", [(SKU, LOC, qb)]),
                *noise, return_exceptions=True), 60)
            ra, rb = res[0], res[1]
            for r in res:
                assert not isinstance(r, BaseException) or isinstance(
                    r, IdempotencyKeyReused), r
            if same:
                assert isinstance(ra, ReserveOutcome) and isinstance(rb, ReserveOutcome)
                assert sorted([ra.replayed, rb.replayed]) == [False, True], (rnd, ra, rb)
                assert ra.held == rb.held
                if ra.held:
                    assert ra.reservation and rb.reservation
                    assert ra.reservation.id == rb.reservation.id
                else:
                    assert ra.short_lines == rb.short_lines
            else:
                errs = [r for r in (ra, rb) if isinstance(r, IdempotencyKeyReused)]
                assert len(errs) == 1, (rnd, ra, rb)
            # the stored answer replays unchanged to both
            again = await asyncio.gather(a.reserve(tenant, f"k{rnd}", [(SKU, LOC, qa)]),
                                         b.reserve(tenant, f"k{rnd}", [(SKU, LOC, qa)]),
                                         return_exceptions=True)
            ok = [r for r in (ra, rb) if isinstance(r, ReserveOutcome)]
            first = [r for r in ok if not r.replayed]
            if (first and first[0] is ra) or same:
                assert all(isinstance(x, ReserveOutcome) and x.replayed for x in again), again
        assert await _violations(a, tenant) == []
        with psycopg.connect(dsn) as conn:
            keys = conn.execute("SELECT count(*) FROM request_ledger WHERE tenant_id = %s"
                                " AND request_key LIKE 'k%%'", (tenant,)).fetchone()
        assert keys is not None and keys[0] == 40


@pytest.mark.parametrize("strategy", ["row", "pool"])
async def test_same_transition_key_from_two_processes(dsn: str, strategy: str) -> None:
    """Claims and releases of one reservation with one key (and with two keys) sent at
    once by two batching processes: one transition, one stored answer, replayed."""
    async with Database(dsn, max_size=6) as db_a, Database(dsn, max_size=6) as db_b:
        a = ReservationService(db_a)
        b = ReservationService(db_b)
        tenant = (await a.create_tenant("two-t")).id
        await a.set_stock(tenant, SKU, LOC, 200, strategy=strategy)
        rng = random.Random(3)
        for rnd in range(40):
            held = await a.reserve(tenant, f"h{rnd}", [(SKU, LOC, 1)])
            assert held.reservation is not None
            rid = held.reservation.id
            await b.get_reservation(tenant, rid)
            kind = rng.choice(["same-claim", "same-release", "claim-vs-release-one-key",
                               "claim-vs-release-two-keys"])
            if kind == "same-claim":
                calls = [a.claim(tenant, rid, request_key=f"t{rnd}"),
                         b.claim(tenant, rid, request_key=f"t{rnd}")]
            elif kind == "same-release":
                calls = [a.release(tenant, rid, request_key=f"t{rnd}"),
                         b.release(tenant, rid, request_key=f"t{rnd}")]
            elif kind == "claim-vs-release-one-key":
                calls = [a.claim(tenant, rid, request_key=f"t{rnd}"),
                         b.release(tenant, rid, request_key=f"t{rnd}")]
            else:
                calls = [a.claim(tenant, rid, request_key=f"c{rnd}"),
                         b.release(tenant, rid, request_key=f"r{rnd}")]
            noise = [x.reserve(tenant, f"n{rnd}-{i}", [(SKU, LOC, 1)])
                     for i, x in enumerate((a, b))]
            res = await asyncio.wait_for(asyncio.gather(*calls, *noise,
                                                        return_exceptions=True), 60)
            r1, r2 = res[0], res[1]
            if kind.startswith("same"):
                assert isinstance(r1, Reservation) and isinstance(r2, Reservation), res
                assert sorted([r1.replayed, r2.replayed]) == [False, True]
                assert r1.status == r2.status
            elif kind == "claim-vs-release-one-key":
                errs = [r for r in (r1, r2) if isinstance(r, IdempotencyKeyReused)]
                assert len(errs) == 1, res
            else:
                okays = [r for r in (r1, r2) if isinstance(r, Reservation)]
                refused = [r for r in (r1, r2) if isinstance(r, (ReservationClaimed,
                                                                 ReservationReleased))]
                assert len(okays) == 1 and len(refused) == 1, res
        assert await _violations(a, tenant) == []


# -- carts across two buckets, batched singles, the sweeper and refills, together --------



@pytest.mark.parametrize("strategies", [("row", "row"), ("pool", "pool"), ("row", "pool")])
async def test_carts_batches_sweeper_and_refill_under_load(dsn: str,
                                                           strategies: tuple[str, str]) -> None:
    async with Database(dsn, max_size=8) as db_a, Database(dsn, max_size=8) as db_b:
        a = ReservationService(db_a)
        b = ReservationService(db_b)
        tenant = (await a.create_tenant("load")).id
        await a.set_stock(tenant, "p", LOC, 40, strategy=strategies[0], pool_cap=8)
        await a.set_stock(tenant, "q", LOC, 40, strategy=strategies[1], pool_cap=8)
        buckets = [await bucket_id(db_a, tenant, s) for s in ("p", "q")]
        dead_before = deadlocks(dsn)
        stop = time.monotonic() + 6
        errors: list[BaseException] = []
        counts = {"carts_held": 0, "singles_held": 0, "rejected": 0}
        seq = iter(range(10**9))

        async def finish(svc: ReservationService, rid: str, rng: random.Random) -> None:
            x = rng.random()
            try:
                if x < 0.35:
                    await svc.claim(tenant, rid, request_key=f"c-{rid}")
                    # the other process repeats it
                    other = b if svc is a else a
                    r = await other.claim(tenant, rid, request_key=f"c-{rid}")
                    assert r.replayed
                elif x < 0.7:
                    await svc.release(tenant, rid)
                # else: left to expire
            except PgReserveError as exc:
                if exc.code not in ("reservation_expired", "busy"):
                    raise

        async def cart_buyer(svc: ReservationService, seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                k = f"cart-{next(seq)}"
                try:
                    out = await svc.reserve(tenant, k, [("p", LOC, rng.randint(1, 2)),
                                                        ("q", LOC, rng.randint(1, 2))],
                                            ttl=rng.choice([1, 1, 600]))
                except PgReserveError as exc:
                    if exc.code != "busy":
                        errors.append(exc)
                    continue
                if out.held:
                    counts["carts_held"] += 1
                    assert out.reservation and len(out.reservation.lines) == 2
                    await finish(svc, out.reservation.id, rng)
                else:
                    counts["rejected"] += 1

        async def single_buyer(svc: ReservationService, seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                k = f"one-{next(seq)}"
                sku = rng.choice("pq")
                try:
                    q, ttl = rng.randint(1, 3), rng.choice([1, 1, 600])
                    out = await svc.reserve(tenant, k, [(sku, LOC, q)], ttl=ttl)
                    if rng.random() < 0.2:  # a retry of the same key from the other process
                        other = b if svc is a else a
                        again = await other.reserve(tenant, k, [(sku, LOC, q)], ttl=ttl)
                        assert again.replayed and again.held == out.held
                        if out.reservation is not None:
                            assert again.reservation is not None
                            assert again.reservation.id == out.reservation.id
                except PgReserveError as exc:
                    if exc.code != "busy":
                        errors.append(exc)
                    continue
                if out.held:
                    counts["singles_held"] += 1
                    assert out.reservation is not None
                    await finish(svc, out.reservation.id, rng)
                else:
                    counts["rejected"] += 1

        async def sweeper(svc: ReservationService) -> None:
            while time.monotonic() < stop:
                try:
                    await svc.expire_due()
                    for bk in buckets:
                        await svc.refill(tenant, bk)
                except PgReserveError as exc:
                    if exc.code != "busy":
                        errors.append(exc)
                await asyncio.sleep(0.05)

        async def restocker() -> None:
            rng = random.Random(99)
            n = 0
            while time.monotonic() < stop:
                await asyncio.sleep(0.7)
                n += 1
                try:
                    await a.adjust_stock(tenant, f"adj-{n}", rng.choice("pq"), LOC,
                                         rng.randint(3, 8))
                except PgReserveError as exc:
                    if exc.code != "busy":
                        errors.append(exc)

        workers = [cart_buyer(a, 1), cart_buyer(b, 2), cart_buyer(a, 3),
                   single_buyer(a, 4), single_buyer(b, 5), single_buyer(a, 6),
                   single_buyer(b, 7), single_buyer(a, 8), single_buyer(b, 9),
                   sweeper(a), sweeper(b), restocker()]
        results = await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True),
                                         120)
        assert [r for r in results if r is not None] == []
        assert errors == []
        # the load did what it is for: carts and batched singles both held
        assert counts["carts_held"] > 0 and counts["singles_held"] > 0, counts
        assert a.combiner is not None and a.combiner.stats.batches > 0
        assert await a.invariant_violations(tenant) == []
        with psycopg.connect(dsn) as conn:
            bad = conn.execute(
                "SELECT r.request_key, count(l.*) FROM reservation r"
                " LEFT JOIN reservation_line l USING (tenant_id, reservation_id)"
                " WHERE r.tenant_id = %s GROUP BY 1"
                " HAVING count(l.*) <> CASE WHEN r.request_key LIKE 'cart-%%' THEN 2 ELSE 1 END",
                (tenant,)).fetchall()
        assert bad == []
        assert deadlocks(dsn) - dead_before == 0


# -- invalid and hostile input next to valid requests in one batch --------------------


ODD = ['a"b\\c{d},NULL', "NULL", " sp ", "é😀\u2028", "x\\", '"', "{}", "k\nl"]


@pytest.mark.parametrize("batching", [True, False])
async def test_hostile_input_in_one_batch(db: Database, dsn: str, batching: bool) -> None:
    svc = ReservationService(db, batching=batching)
    tenant = (await svc.create_tenant(f"odd-{batching}")).id
    await svc.set_stock(tenant, SKU, LOC, 100)
    await svc.reserve(tenant, "warm", [(SKU, LOC, 1)])
    bucket = await bucket_id(db, tenant, SKU)
    calls: list[Callable[[], Awaitable[Any]]] = []
    for i, odd in enumerate(ODD):
        calls.append(functools.partial(svc.reserve, tenant, f"{odd}-{i}", [(SKU, LOC, 1)],
                                       reference=odd, metadata={odd: odd, "n": str(i)}))
    calls.append(functools.partial(svc.reserve, tenant, "bad-q", [(SKU, LOC, 0)]))
    calls.append(functools.partial(svc.reserve, tenant, "unknown", [("nope", LOC, 1)]))
    calls.append(functools.partial(svc.claim, tenant, "00000000-0000-0000-0000-000000000000"))
    calls.append(functools.partial(svc.reserve, tenant, "after", [(SKU, LOC, 2)]))
    if batching:
        assert svc.combiner is not None
        queue = svc.combiner._queues
        with bucket_locked(db.conninfo, bucket) as blocker:
            first = asyncio.ensure_future(svc.reserve(tenant, "first", [(SKU, LOC, 1)]))
            await wait_until_blocked(db.conninfo)
            tasks = [asyncio.ensure_future(c()) for c in calls]
            # the valid reserves queue for the bucket's next batch; the invalid ones are
            # refused before, the claim of an unknown id goes its own way
            deadline = time.monotonic() + 10
            while len(queue.get((tenant, bucket), ())) < len(ODD) + 1:
                assert time.monotonic() < deadline, "the requests never queued"
                await asyncio.sleep(0.005)
            blocker.rollback()
        await first
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert svc.combiner.stats.splits == 0
    else:
        await svc.reserve(tenant, "first", [(SKU, LOC, 1)])
        results = []
        for c in calls:
            try:
                results.append(await c())
            except Exception as exc:  # noqa: BLE001
                results.append(exc)
    n = len(ODD)
    for i, (odd, r) in enumerate(zip(ODD, results[:n], strict=True)):
        assert isinstance(r, ReserveOutcome) and r.held, r
        assert r.reservation is not None
        assert (r.reservation.reference, r.reservation.metadata) == (odd, {odd: odd, "n": str(i)})
        got = await svc.get_reservation(tenant, r.reservation.id)
        assert (got.reference, got.metadata) == (odd, {odd: odd, "n": str(i)})
        again = await svc.reserve(tenant, f"{odd}-{i}", [(SKU, LOC, 1)], reference=odd,
                                  metadata={odd: odd, "n": str(i)})
        assert again.replayed and again.reservation and again.reservation.id == r.reservation.id
    assert isinstance(results[n], InvalidRequest)
    assert isinstance(results[n + 1], UnknownStock)
    missing, after = results[n + 2], results[n + 3]
    assert isinstance(missing, PgReserveError) and missing.code == "reservation_not_found"
    assert isinstance(after, ReserveOutcome) and after.held
    assert await svc.invariant_violations(tenant) == []
