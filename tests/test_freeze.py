"""Freezes: no new holds of a frozen bucket or tenant, on every path that creates holds,
while claims, releases, extends, expiry, lookups and replays go on."""

from __future__ import annotations

import asyncio
import json
import time

import psycopg
import pytest
from click.testing import CliRunner

from conftest import ApiTenant
from pgreserve import Database, ReservationService, Tenant
from pgreserve.cli import main
from pgreserve.errors import FreezeNotFound, InvalidRequest, UnknownStock
from test_concurrency import deadlocks, reserve_sql, wait_until_blocked
from test_http_api import assert_problem, put_stock, reserve

BY = "test@ops"


def hold_count(dsn: str, tenant: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM reservation WHERE tenant_id = %s",
                           (tenant,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_frozen_bucket_refuses_new_holds_and_keeps_the_rest(
        db: Database, tenant: Tenant, strategy: str, batching: bool) -> None:
    """On a frozen bucket a new reserve is refused (bucket_frozen, stored under its key, no
    stock taken) while a claim, a release, an extend, a lookup and a replay of an earlier
    key succeed; a frozen bucket leaves the other buckets alone; unfreezing serves again."""
    svc = ReservationService(db, batching=batching)
    await svc.set_stock(tenant.id, "hot", "w", 10, strategy=strategy)
    await svc.set_stock(tenant.id, "cold", "w", 10, strategy=strategy)
    first = await svc.reserve(tenant.id, "before-1", [("hot", "w", 2)])
    second = await svc.reserve(tenant.id, "before-2", [("hot", "w", 3)])
    third = await svc.reserve(tenant.id, "before-3", [("hot", "w", 1)])
    assert first.held and second.held and third.held
    assert first.reservation and second.reservation and third.reservation

    frozen = await svc.freeze(tenant.id, "drift under investigation", BY, sku="hot",
                              location="w")
    assert frozen.scope == "bucket" and frozen.sku == "hot" and not frozen.already
    assert (await svc.freeze(tenant.id, "again", BY, sku="hot", location="w")).already

    refused = await svc.reserve(tenant.id, "during", [("hot", "w", 1)])
    assert not refused.held and refused.frozen and refused.reason == "bucket_frozen"
    assert [(f.sku, f.location) for f in refused.frozen_lines] == [("hot", "w")]
    assert (await svc.get_stock(tenant.id, "hot", "w")).available == 4  # nothing taken

    claimed = await svc.claim(tenant.id, first.reservation.id)
    released = await svc.release(tenant.id, second.reservation.id)
    extended = await svc.extend(tenant.id, third.reservation.id, 1800)
    assert claimed.status.value == "claimed" and released.status.value == "released"
    assert extended.status.value == "active"
    replay = await svc.reserve(tenant.id, "before-1", [("hot", "w", 2)])
    assert replay.replayed and replay.held and replay.reservation
    assert replay.reservation.id == first.reservation.id
    assert (await svc.get_reservation(tenant.id, third.reservation.id)).status.value == "active"
    assert (await svc.lookup_request(tenant.id, "during")).status == "rejected"
    assert (await svc.reserve(tenant.id, "cold-1", [("cold", "w", 1)])).held

    await svc.unfreeze(tenant.id, "checked, books fine", BY, sku="hot", location="w")
    again = await svc.reserve(tenant.id, "during", [("hot", "w", 1)])
    assert again.replayed and again.reason == "bucket_frozen"  # the stored answer stays
    assert (await svc.reserve(tenant.id, "after", [("hot", "w", 1)])).held
    assert await svc.invariant_violations(tenant.id) == []


async def test_a_cart_with_one_frozen_line_takes_nothing(service: ReservationService,
                                                          tenant: Tenant, strategy: str) -> None:
    """A cart of several lines, one of them on a frozen bucket, is refused whole
    (bucket_frozen naming that line) and no line takes stock."""
    for sku in ("a", "b", "c"):
        await service.set_stock(tenant.id, sku, "w", 5, strategy=strategy)
    await service.freeze(tenant.id, "recount", BY, sku="b", location="w")
    out = await service.reserve(tenant.id, "cart", [("a", "w", 1), ("b", "w", 1),
                                                     ("c", "w", 1)])
    assert not out.held and out.reason == "bucket_frozen"
    assert [(f.sku, f.location) for f in out.frozen_lines] == [("b", "w")]
    for sku in ("a", "b", "c"):
        assert (await service.get_stock(tenant.id, sku, "w")).available == 5


async def test_a_frozen_tenant_refuses_every_bucket(service: ReservationService,
                                                    tenant: Tenant) -> None:
    """A tenant freeze refuses new holds of all its buckets (tenant_frozen), not another
    tenant's; lifting it serves again, and the freeze stays on record with who lifted it."""
    other = await service.create_tenant("globex")
    for t in (tenant.id, other.id):
        await service.set_stock(t, "x", "w", 5)
        await service.set_stock(t, "y", "w", 5, strategy="pool")
    frozen = await service.freeze(tenant.id, "sale halted", BY)
    assert frozen.scope == "tenant" and frozen.sku is None
    for sku in ("x", "y"):
        out = await service.reserve(tenant.id, f"k-{sku}", [(sku, "w", 1)])
        assert not out.held and out.reason == "tenant_frozen"
    cart = await service.reserve(tenant.id, "cart", [("x", "w", 1), ("y", "w", 1)])
    assert cart.reason == "tenant_frozen"
    assert (await service.reserve(other.id, "k-x", [("x", "w", 1)])).held
    assert [f.tenant for f in await service.freezes()] == ["acme"]
    lifted = await service.unfreeze(tenant.id, "resumed", "ops@night")
    assert lifted.lifted_by == "ops@night" and lifted.lift_reason == "resumed"
    assert await service.freezes() == []
    assert (await service.reserve(tenant.id, "k-x2", [("x", "w", 1)])).held


async def test_freeze_input_is_checked(service: ReservationService, tenant: Tenant) -> None:
    """An unknown bucket, half a bucket, an empty reason and unfreezing what is not frozen
    are typed errors, and nothing is frozen."""
    await service.set_stock(tenant.id, "x", "w", 5)
    with pytest.raises(UnknownStock):
        await service.freeze(tenant.id, "r", BY, sku="nope", location="w")
    with pytest.raises(InvalidRequest):
        await service.freeze(tenant.id, "r", BY, sku="x")
    with pytest.raises(InvalidRequest):
        await service.freeze(tenant.id, "", BY, sku="x", location="w")
    with pytest.raises(FreezeNotFound):
        await service.unfreeze(tenant.id, "r", BY, sku="x", location="w")
    assert await service.freezes() == []


async def test_http_reserve_on_a_frozen_bucket_is_423_and_replayed(api: ApiTenant,
                                                                   service: ReservationService
                                                                   ) -> None:
    """Over HTTP a reserve of a frozen bucket is 423 bucket_frozen with the frozen lines;
    the same key again replays the same body (Idempotent-Replayed), also after unfreezing;
    a tenant freeze is 423 tenant_frozen."""
    await put_stock(api, "hot", 5)
    await service.freeze(api.tenant.id, "drift", BY, sku="hot", location="wh")
    first = await reserve(api, "k1", [("hot", "wh", 1)])
    doc = assert_problem(first, 423, "bucket_frozen")
    assert doc["frozen_lines"] == [{"sku": "hot", "location": "wh"}]
    await service.unfreeze(api.tenant.id, "fine", BY, sku="hot", location="wh")
    again = await reserve(api, "k1", [("hot", "wh", 1)])
    assert again.status_code == 423 and again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"
    await service.freeze(api.tenant.id, "halt", BY)
    assert_problem(await reserve(api, "k2", [("hot", "wh", 1)]), 423, "tenant_frozen")


async def test_a_freeze_waits_for_a_take_in_flight(dsn: str, service: ReservationService,
                                                   tenant: Tenant, strategy: str) -> None:
    """A reserve that has taken stock but not committed holds the freeze off: the freeze
    commits only after it, and the next reserve is refused."""
    await service.set_stock(tenant.id, "hot", "w", 5, strategy=strategy)
    sql, params = reserve_sql(tenant.id, "inflight", "hot", "w", 1)
    with psycopg.connect(dsn, application_name="pgreserve:core") as buyer:
        assert buyer.execute(sql, params).fetchone()[0]["status"] == "held"  # type: ignore[index]  # one row
        freezing = asyncio.create_task(
            service.freeze(tenant.id, "while a take is open", BY, sku="hot", location="w"))
        await wait_until_blocked(dsn)  # the freeze waits for the buyer's lock
        assert not freezing.done()
        buyer.commit()
    await freezing
    assert hold_count(dsn, tenant.id) == 1
    assert (await service.reserve(tenant.id, "next", [("hot", "w", 1)])).reason == \
        "bucket_frozen"


async def test_no_hold_is_created_after_the_freeze_committed(dsn: str, strategy: str) -> None:
    """Many buyers reserve one bucket (batched and unbatched) while it is frozen: once the
    freeze has taken its lock no hold commits any more, every answer to a reserve sent
    after the commit is bucket_frozen, and the books balance."""
    async with Database(dsn, min_size=8, max_size=24) as db:
        batched = ReservationService(db)
        unbatched = ReservationService(db, batching=False)
        tenant = await batched.create_tenant("sale")
        await batched.set_stock(tenant.id, "hot", "w", 100_000, strategy=strategy)
        committed_at: list[float] = []
        stop = asyncio.Event()
        answers: list[tuple[float, str | None, bool]] = []

        async def buyer(n: int) -> None:
            svc = batched if n % 2 else unbatched
            i = 0
            while not stop.is_set():
                sent = time.monotonic()
                out = await svc.reserve(tenant.id, f"b{n}-{i}", [("hot", "w", 1)])
                answers.append((sent, out.reason, out.held))
                i += 1

        buyers = [asyncio.create_task(buyer(n)) for n in range(16)]
        await asyncio.sleep(0.5)
        with psycopg.connect(dsn) as op:
            # the freeze's lock taken and its row written, not committed: every take that
            # did not see it has ended, and no new one can start
            op.execute("SELECT freeze_set_v1(%s, (SELECT bucket_id FROM stock_bucket"
                       " WHERE tenant_id = %s), 'sale stopped', 'test')",
                       (tenant.id, tenant.id))
            at_freeze = hold_count(dsn, tenant.id)
            await asyncio.sleep(0.2)  # buyers queue behind the lock meanwhile
            op.commit()
            committed_at.append(time.monotonic())
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*buyers)
        after_commit = [a for a in answers if a[0] > committed_at[0]]
        assert after_commit and all(r == "bucket_frozen" and not held
                                    for _, r, held in after_commit)
        assert any(held for _, _, held in answers)  # buyers did hold before the freeze
        assert hold_count(dsn, tenant.id) == at_freeze
        assert await batched.invariant_violations(tenant.id) == []


def test_cli_freeze_list_and_unfreeze(dsn: str) -> None:
    """`freeze bucket|tenant`, `freeze list` and `unfreeze` record the reason and who, and
    print what they did; an unknown bucket is an error."""
    runner = CliRunner()
    db = ["--database-url", dsn]
    assert runner.invoke(main, ["tenant", "create", "shop", *db]).exit_code == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT stock_set_v1((SELECT tenant_id FROM tenant), 'tee', 'eu', 5,"
                     " NULL, false, NULL, NULL)")
    done = runner.invoke(main, ["freeze", "bucket", "shop", "tee", "eu", "--reason", "recount",
                                "--by", "alice", *db])
    assert done.exit_code == 0 and "froze tee@eu of tenant 'shop'" in done.output, done.output
    assert runner.invoke(main, ["freeze", "tenant", "shop", "--reason", "halt", *db]
                         ).exit_code == 0
    listed = runner.invoke(main, ["freeze", "list", "--json", *db])
    docs = json.loads(listed.output)
    assert [(d["scope"], d["sku"], d["reason"]) for d in docs] == [
        ("bucket", "tee", "recount"), ("tenant", None, "halt")]
    assert docs[0]["frozen_by"] == "alice"
    lifted = runner.invoke(main, ["unfreeze", "tenant", "shop", "--reason", "over", "--json",
                                  *db])
    assert lifted.exit_code == 0 and json.loads(lifted.output)["lift_reason"] == "over"
    assert "tee@eu" in runner.invoke(main, ["freeze", "list", *db]).output
    bad = runner.invoke(main, ["freeze", "bucket", "shop", "nope", "eu", "--reason", "r", *db])
    assert bad.exit_code != 0 and "unknown stock" in bad.output


def test_reconcile_freeze_freezes_each_drifted_bucket(dsn: str) -> None:
    """`reconcile --freeze` freezes the bucket with a planted drift (and only it), prints
    it, keeps the evidence as it was, and a later reserve there is refused."""
    runner = CliRunner()
    db = ["--database-url", dsn]
    assert runner.invoke(main, ["tenant", "create", "shop", *db]).exit_code == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        for sku in ("good", "bad"):
            conn.execute("SELECT stock_set_v1((SELECT tenant_id FROM tenant), %s, 'eu', 5,"
                         " NULL, false, NULL, NULL)", (sku,))
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand + 3, free = free + 3"
                     " WHERE sku = 'bad'")  # units the movement ledger never saw
    result = runner.invoke(main, ["reconcile", "--freeze", *db])
    assert result.exit_code == 1, result.output
    assert "FROZE tenant 1 bad@eu" in result.output and "good@eu" not in \
        result.output.split("FROZE", 1)[1]
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT on_hand, free FROM stock_bucket WHERE sku = 'bad'"
                            ).fetchone() == (8, 8)
        rows = conn.execute("SELECT b.sku, f.frozen_by, f.reason FROM stock_freeze f"
                            " JOIN stock_bucket b USING (tenant_id, bucket_id)").fetchall()
        assert [r[0] for r in rows] == ["bad"] and "ledger_mismatch" in rows[0][2]
        out = conn.execute(*reserve_sql(1, "k", "bad", "eu", 1)).fetchone()
        assert out is not None and out[0]["reason"] == "bucket_frozen"
    again = runner.invoke(main, ["reconcile", "--freeze", "--json", *db])
    assert json.loads(again.output)["frozen"][0]["already"] is True


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_freeze_holds_under_a_repeatable_read_default(dsn: str, batching: bool) -> None:
    """With the database's default isolation set to repeatable read, a reserve that waited
    on the freeze lock still sees the freeze once it is let through, and holds nothing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]  # one row
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_isolation '
                     "= 'repeatable read'")
    async with Database(dsn, min_size=1, max_size=4) as db:
        service = ReservationService(db, batching=batching)
        tenant = await service.create_tenant("rr")
        await service.set_stock(tenant.id, "hot", "w", 5)
        bucket = (await db.fetch("SELECT bucket_id FROM stock_bucket WHERE tenant_id = %s",
                                 (tenant.id,)))[0][0]
        await service.reserve(tenant.id, "warm", [("hot", "w", 1)])  # the bucket id is known
        with psycopg.connect(dsn, application_name="pgreserve:ops") as freezer:
            freezer.execute("SELECT freeze_set_v1(%s, %s, %s, %s)",
                            (tenant.id, bucket, "while a reserve waits", BY))
            buying = asyncio.create_task(service.reserve(tenant.id, "late", [("hot", "w", 1)]))
            await wait_until_blocked(dsn)  # the reserve waits for the freeze's lock
            freezer.commit()
        out = await buying
        assert not out.held and out.reason == "bucket_frozen"
        assert hold_count(dsn, tenant.id) == 1  # the warm-up hold only


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_tenant_and_bucket_freezes_are_lifted_apart_and_expiry_goes_on(
        db: Database, tenant: Tenant, batching: bool) -> None:
    """With a bucket and its tenant both frozen, lifting either leaves the other in force;
    a hold that expires meanwhile is given back by the sweep; both lifted, reserves hold."""
    from datetime import UTC, datetime, timedelta

    now = [datetime.now(UTC)]
    svc = ReservationService(db, batching=batching, clock=lambda: now[0])
    await svc.set_stock(tenant.id, "hot", "w", 5)
    await svc.set_stock(tenant.id, "cold", "w", 5)
    held = await svc.reserve(tenant.id, "early", [("hot", "w", 2)], ttl=60)
    assert held.held
    await svc.freeze(tenant.id, "recount", BY, sku="hot", location="w")
    await svc.freeze(tenant.id, "halt", BY)
    assert (await svc.reserve(tenant.id, "k1", [("cold", "w", 1)])).reason == "tenant_frozen"

    now[0] += timedelta(seconds=120)  # the early hold is past its expiry
    assert await svc.expire_due() == 1
    assert (await svc.get_stock(tenant.id, "hot", "w")).available == 5

    await svc.unfreeze(tenant.id, "resume", BY)
    assert (await svc.reserve(tenant.id, "k2", [("hot", "w", 1)])).reason == "bucket_frozen"
    assert (await svc.reserve(tenant.id, "k3", [("cold", "w", 1)])).held
    await svc.freeze(tenant.id, "halt again", BY)
    await svc.unfreeze(tenant.id, "recounted", BY, sku="hot", location="w")
    assert (await svc.reserve(tenant.id, "k4", [("hot", "w", 1)])).reason == "tenant_frozen"
    await svc.unfreeze(tenant.id, "resume", BY)
    assert (await svc.reserve(tenant.id, "k5", [("hot", "w", 1)])).held
    assert (await svc.lookup_request(tenant.id, "k2")).outcome["reason"] == "bucket_frozen"
    assert await svc.invariant_violations(tenant.id) == []


async def test_freezes_toggled_under_a_mixed_sale_never_deadlock(dsn: str) -> None:
    """Bucket and tenant freezes set and lifted over and over while buyers reserve one-line
    (batched) and two-line carts and claim or release their holds: no deadlock, no error,
    and the books balance."""
    async with Database(dsn, min_size=8, max_size=20) as db:
        svc = ReservationService(db)
        tenant = await svc.create_tenant("mix")
        for sku in ("a", "b"):
            await svc.set_stock(tenant.id, sku, "w", 100_000)
        before = deadlocks(dsn)
        done = asyncio.Event()

        async def buyer(n: int) -> None:
            for i in range(40):
                cart = [("a", "w", 1)] if i % 2 else [("a", "w", 1), ("b", "w", 1)]
                out = await svc.reserve(tenant.id, f"b{n}-{i}", cart)
                if out.held and out.reservation is not None:
                    if i % 3:
                        await svc.claim(tenant.id, out.reservation.id)
                    else:
                        await svc.release(tenant.id, out.reservation.id)

        async def freezer() -> None:
            while not done.is_set():
                await svc.freeze(tenant.id, "toggle", BY, sku="a", location="w")
                await svc.freeze(tenant.id, "toggle", BY)
                await svc.unfreeze(tenant.id, "toggle", BY, sku="a", location="w")
                await svc.unfreeze(tenant.id, "toggle", BY)

        toggling = asyncio.create_task(freezer())
        await asyncio.gather(*(buyer(n) for n in range(16)))
        done.set()
        await toggling
        assert deadlocks(dsn) == before
        assert await svc.invariant_violations(tenant.id) == []


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_lift_during_a_reserve_never_stores_an_empty_answer(
        dsn: str, batching: bool) -> None:
    """A freeze lifted while reserves are deciding: each reserve is either refused with the
    freeze it saw or served, never left without an answer (the lift takes no lock, so it
    can commit between the probe for a freeze and the read of the refusal)."""
    async with Database(dsn, min_size=10, max_size=12) as db:
        svc = ReservationService(db, batching=batching)
        tenant = await svc.create_tenant("lift")
        await svc.set_stock(tenant.id, "a", "w", 1_000_000)
        done = asyncio.Event()
        answers: list[str] = []

        async def buyer(n: int) -> None:
            for i in range(150):
                out = await svc.reserve(tenant.id, f"b{n}-{i}", [("a", "w", 1)])
                if out.held:
                    answers.append("held")
                else:
                    assert out.reason == "bucket_frozen", out
                    assert [(f.sku, f.location) for f in out.frozen_lines] == [("a", "w")]
                    answers.append("frozen")

        async def toggler() -> None:
            while not done.is_set():
                await svc.freeze(tenant.id, "toggle", BY, sku="a", location="w")
                await svc.unfreeze(tenant.id, "toggle", BY, sku="a", location="w")

        toggling = asyncio.create_task(toggler())
        try:
            await asyncio.gather(*(buyer(n) for n in range(8)))
        finally:
            done.set()
            await toggling
        assert len(answers) == 8 * 150 and {"held", "frozen"} <= set(answers)
        with psycopg.connect(dsn, autocommit=True) as conn:
            stored = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'rejected'"
                " AND outcome->>'reason' = 'bucket_frozen'), count(*) FROM request_ledger"
                " WHERE tenant_id = %s AND operation = 'reserve'", (tenant.id,)).fetchone()
        assert stored == (answers.count("frozen"), len(answers))
        assert await svc.invariant_violations(tenant.id) == []
