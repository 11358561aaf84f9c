"""Attribution, the hold-time sampler, the bloat monitor and the metrics they export."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg
import pytest

from pgreserve import Database, ReservationService, Tenant
from pgreserve.ops.bloat import BloatConfig, BloatMonitor
from pgreserve.ops.metrics import OpsMetrics
from pgreserve.ops.sampler import HoldTimeSampler
from pgreserve.workers.base import LoopConfig

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T | None]], what: str,
                     deadline_s: float = 20.0, step_s: float = 0.1) -> T:
    """Poll `probe` until it returns something truthy, or fail after the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = await probe()
        if got:
            return got
        await asyncio.sleep(step_s)
    raise AssertionError(f"never happened: {what}")


async def test_statements_carry_their_tag_into_pg_stat_statements(dsn: str) -> None:
    """A reserve runs on a pgreserve:reserve connection and its statement text in
    pg_stat_statements ends with the static sqlcommenter tag, unbatched and batched."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        # The statistics are the server's, of every test database so far: emptied, so
        # entries used once are not evicted to make room (pg_stat_statements.max).
        conn.execute("SELECT pg_stat_statements_reset()")
    async with Database(dsn, role_pools=True, application_name="pgreserve:test") as db:
        svc = ReservationService(db, batching=False)
        tenant = await svc.create_tenant("acme")
        await svc.set_stock(tenant.id, "s", "wh", 5)
        await svc.reserve(tenant.id, "k1", [("s", "wh", 1)])
        await ReservationService(db).reserve(tenant.id, "k2", [("s", "wh", 1)])
        assert "pgreserve:reserve" in db.pools
        with psycopg.connect(dsn, autocommit=True) as conn:
            apps = {r[0] for r in conn.execute(
                "SELECT application_name FROM pg_stat_activity"
                " WHERE datname = current_database()").fetchall()}
            assert {"pgreserve:reserve", "pgreserve:stock"} <= apps
            rows = conn.execute(
                "SELECT query FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
                " WHERE datname = current_database()) AND query LIKE 'SELECT reserve_v1(%'"
            ).fetchall()
            batched = conn.execute(
                "SELECT query FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
                " WHERE datname = current_database()) AND query LIKE 'SELECT bucket_batch_v1(%'"
            ).fetchall()
    assert rows, "reserve_v1 is in pg_stat_statements"
    assert rows[0][0].endswith(
        "/* app=pgreserve,route=POST /v1/reservations,action=reserve */")
    assert batched, "bucket_batch_v1 is in pg_stat_statements"
    assert batched[0][0].endswith("/* app=pgreserve,route=batch/bucket,action=bucket_batch */")


async def test_sampler_attributes_idle_in_transaction_to_its_caller(dsn: str) -> None:
    """A connection left idle in transaction under application_name X shows up as X:
    in the idle-in-transaction list, as the oldest transaction, in connection-seconds
    and in the exported gauges."""
    metrics = OpsMetrics()
    sampler = HoldTimeSampler(dsn, metrics=metrics)
    with psycopg.connect(dsn, application_name="pgreserve:leaky-checkout") as leaky:
        leaky.execute("SELECT 1")  # opens a transaction and leaves it open
        try:
            async def seen() -> bool:
                await sampler.sample()
                return any(s.application_name == "pgreserve:leaky-checkout"
                           for s in sampler.report.idle_in_transaction)
            await eventually(seen, "the idle-in-transaction session is sampled")
            await sampler.sample()
            rep = sampler.report
            assert rep.oldest_xact_application == "pgreserve:leaky-checkout"
            assert rep.connection_seconds[("pgreserve:leaky-checkout",
                                           "idle in transaction")] > 0
            assert rep.by_caller()["pgreserve:leaky-checkout"] > 0
            value = metrics.registry.get_sample_value(
                "pgreserve_idle_in_transaction_sessions",
                {"application_name": "pgreserve:leaky-checkout"})
            assert value == 1.0
            assert (metrics.registry.get_sample_value("pgreserve_oldest_transaction_seconds")
                    or 0) > 0
        finally:
            await sampler.close()


async def test_bloat_monitor_warns_after_churn_and_clears_after_vacuum(dsn: str) -> None:
    """Dead pool tuples after churn are reported per partition, turn into a warning once
    % dead stays above the threshold for the window, and clear after VACUUM."""
    metrics = OpsMetrics()
    monitor = BloatMonitor(dsn, BloatConfig(window_s=0.3, loop=LoopConfig(0.1)),
                           metrics=metrics)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # 500 rows (under the partitions' autovacuum threshold of 1000): churned away.
        conn.execute("INSERT INTO stock_unit (tenant_id, bucket_id)"
                     " SELECT 1, 1 FROM generate_series(1, 500)")
        conn.execute("DELETE FROM stock_unit WHERE tenant_id = 1 AND bucket_id = 1")
        conn.execute("SELECT pg_stat_force_next_flush()")
    try:
        async def dead() -> str | None:
            rep = await monitor.check()
            hit = [p for p in rep.partitions if p.dead >= 500]
            return hit[0].name if hit else None
        part = await eventually(dead, "dead tuples are reported")
        assert len(monitor.report.partitions) == 16

        async def warned() -> bool:
            rep = await monitor.check()
            return part in [p.name for p in rep.warnings]
        await eventually(warned, "the warning state after the window")
        assert metrics.registry.get_sample_value(
            "pgreserve_partition_bloat_warning", {"partition": part}) == 1.0
        assert (metrics.registry.get_sample_value(
            "pgreserve_partition_dead_tuples", {"partition": part}) or 0) >= 500
        assert monitor.report.xid_age > 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"VACUUM {part}")

        async def cleared() -> bool:
            rep = await monitor.check()
            p = next(p for p in rep.partitions if p.name == part)
            return p.dead == 0 and p.state == "ok" and p.last_vacuum is not None
        await eventually(cleared, "VACUUM clears the dead tuples and the warning")
        assert metrics.registry.get_sample_value(
            "pgreserve_partition_bloat_warning", {"partition": part}) == 0.0
    finally:
        await monitor.close()


def sample(m: OpsMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


async def test_each_metric_moves_with_its_event(db: Database, tenant: Tenant) -> None:
    """Reserve outcomes, claims, releases, expiries, background and inline refills,
    latency, hot-bucket pool sizes, reservation states and client pool stats each move
    when their event happens."""
    from datetime import timedelta

    from pgreserve.errors import IdempotencyKeyReused
    from pgreserve.ops.figures import read_figures
    from pgreserve.workers.replenisher import Replenisher
    from pgreserve.workers.sweeper import Sweeper

    m = OpsMetrics()
    db.observer = m.db_event
    svc = ReservationService(db, observer=m)
    t = tenant.id
    await svc.set_stock(t, "hot", "wh", 20, strategy="pool", pool_cap=4)
    r1 = await svc.reserve(t, "k1", [("hot", "wh", 6)])  # more than the pool: inline refill
    assert r1.held and sample(m, "pgreserve_reservations_total", outcome="held") == 1
    await svc.reserve(t, "k1", [("hot", "wh", 6)])
    assert sample(m, "pgreserve_reservations_total", outcome="idempotent_replay") == 1
    with pytest.raises(IdempotencyKeyReused):
        await svc.reserve(t, "k1", [("hot", "wh", 7)])
    assert sample(m, "pgreserve_reservations_total", outcome="idempotency_key_reused") == 1
    assert not (await svc.reserve(t, "k2", [("hot", "wh", 100)])).held
    assert sample(m, "pgreserve_reservations_total", outcome="sold_out") == 1
    assert sample(m, "pgreserve_operation_seconds_count", operation="reserve") == 4

    assert r1.reservation is not None
    await svc.claim(t, r1.reservation.id)
    assert sample(m, "pgreserve_claims_total") == 1
    r3 = await svc.reserve(t, "k3", [("hot", "wh", 1)])
    assert r3.reservation is not None
    await svc.release(t, r3.reservation.id)
    assert sample(m, "pgreserve_releases_total") == 1
    await svc.reserve(t, "k4", [("hot", "wh", 1)], ttl=timedelta(seconds=1))
    with psycopg.connect(db.conninfo, autocommit=True) as conn:  # make it due now
        conn.execute("UPDATE reservation SET expires_at = created_at + interval '1 ms',"
                     " created_at = created_at - interval '1 s' WHERE request_key = 'k4'")
        conn.execute("UPDATE reservation_line l SET expires_at = r.expires_at"
                     " FROM reservation r WHERE r.request_key = 'k4'"
                     " AND l.reservation_id = r.reservation_id")
    assert await Sweeper(svc).run_once() == 1
    assert sample(m, "pgreserve_expiries_total") == 1

    with psycopg.connect(db.conninfo, autocommit=True) as conn:  # drain the pool
        conn.execute("DELETE FROM stock_unit")
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand - 3 WHERE sku = 'hot'")
    # (the drain above is a drift on purpose; only the refill counter matters here)
    assert await Replenisher(svc).run_once() > 0
    assert sample(m, "pgreserve_pool_refills_total", mode="background") == 1

    async def refill_stats() -> bool:
        fig = await read_figures(db)
        m.figures(fig)
        return fig.refills_inline >= 1 and fig.refills_background >= 1
    await eventually(refill_stats, "pg_stat_user_functions counts both refill kinds")
    assert sample(m, "pgreserve_db_pool_refills_total", mode="inline") >= 1
    assert sample(m, "pgreserve_pool_units", tenant="acme", sku="hot", location="wh") == 4
    assert sample(m, "pgreserve_reservations_by_state", state="claimed") == 1
    assert sample(m, "pgreserve_reservations_by_state", state="expired") == 1
    m.pool_stats(db.pool_stats())
    assert sample(m, "pgreserve_client_pool_requests_total", pool="pgreserve:core") > 0


@pytest.mark.parametrize("batching", [False, True], ids=["unbatched", "batched"])
async def test_busy_reserve_is_counted(dsn: str, batching: bool) -> None:
    """A reserve that hits lock_timeout (a bucket row locked elsewhere) counts as a
    `busy` reserve outcome and as a busy database event of its call: action reserve, or
    bucket_batch for a batched one."""
    from pgreserve import TxSettings
    from pgreserve.errors import Busy

    m = OpsMetrics()
    async with Database(dsn, observer=m.db_event,
                        settings=TxSettings(lock_timeout_ms=100)) as db:
        svc = ReservationService(db, observer=m, batching=batching)
        t = (await svc.create_tenant("acme")).id
        await svc.set_stock(t, "s", "wh", 5)
        with psycopg.connect(dsn) as blocker:
            blocker.execute("SELECT 1 FROM stock_bucket FOR UPDATE")
            with pytest.raises(Busy):
                await svc.reserve(t, "k", [("s", "wh", 1)])
    assert sample(m, "pgreserve_reservations_total", outcome="busy") == 1
    action = "bucket_batch" if batching else "reserve"
    assert sample(m, "pgreserve_db_events_total", action=action, event="busy") == 1
    assert m.recent_errors and "busy" in m.recent_errors[0]["error"]


def test_retry_events_are_reserve_outcomes() -> None:
    """The retry loop's deadlock and resolved-unknown-outcome events of a reserve are
    counted as reserve outcomes (the events themselves are fed by Database._emit)."""
    m = OpsMetrics()
    m.db_event("reserve", "deadlock_retried")
    m.db_event("reserve", "unknown_outcome_resolved")
    m.db_event("claim", "deadlock_retried")
    assert sample(m, "pgreserve_reservations_total", outcome="deadlock_retried") == 1
    assert sample(m, "pgreserve_reservations_total", outcome="unknown_outcome_resolved") == 1
    assert sample(m, "pgreserve_db_events_total", action="claim",
                  event="deadlock_retried") == 1


async def test_real_deadlock_and_killed_backend_move_their_metrics(dsn: str) -> None:
    """A real deadlock (retried) and a backend killed mid-call (retried, then answered)
    move deadlock_retried and unknown_outcome_resolved through Database's retry loop."""
    from pgreserve.db.database import Op

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE dl (id int PRIMARY KEY)")
        conn.execute("INSERT INTO dl VALUES (1), (2)")
        conn.execute("""CREATE FUNCTION dl_lock(a int, b int) RETURNS int LANGUAGE plpgsql AS $$
                        BEGIN
                            PERFORM 1 FROM dl WHERE id = a FOR UPDATE;
                            PERFORM pg_sleep(0.5);
                            PERFORM 1 FROM dl WHERE id = b FOR UPDATE;
                            RETURN a;
                        END $$""")
    op = Op("reserve", "reserve", "test/retries")
    m = OpsMetrics()
    async with Database(dsn, max_size=3, observer=m.db_event) as db:
        # two transactions locking the same rows in opposite orders: the server
        # aborts one (40P01), the retry loop runs it again, both answer
        assert sorted(await asyncio.gather(db.call("SELECT dl_lock(1, 2)", op=op),
                                           db.call("SELECT dl_lock(2, 1)", op=op))) == [1, 2]
        assert db.stats.deadlocks_retried >= 1

        async def kill_the_sleeper() -> None:
            async def victim() -> int | None:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT pid FROM pg_stat_activity WHERE state = 'active'"
                        " AND query LIKE '%pg_sleep(1.5)%' AND pid <> pg_backend_pid()"
                    ).fetchone()
                    if row:
                        conn.execute("SELECT pg_terminate_backend(%s)", (row[0],))
                    return None if row is None else int(row[0])
            await eventually(victim, "the sleeping backend to be killed")

        # the first attempt's backend is terminated mid-call; the retry answers
        answer, _ = await asyncio.gather(db.call("SELECT 7 FROM pg_sleep(1.5)", op=op),
                                         kill_the_sleeper())
        assert answer == 7
    assert sample(m, "pgreserve_db_events_total", action="reserve",
                  event="deadlock_retried") >= 1
    assert sample(m, "pgreserve_reservations_total", outcome="deadlock_retried") >= 1
    assert sample(m, "pgreserve_db_events_total", action="reserve",
                  event="unknown_outcome_resolved") == 1
    assert sample(m, "pgreserve_reservations_total", outcome="unknown_outcome_resolved") == 1
