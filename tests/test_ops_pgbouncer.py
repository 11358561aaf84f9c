"""The API behind a real PgBouncer in transaction pooling mode."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from conftest import ApiTenant
from pgbouncer import PgBouncer
from pgreserve import Database, ReservationService, Tenant
from pgreserve.cli import main
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.http.ops_app import create_ops_app
from pgreserve.ops.pgbouncer import PgBouncerMonitor


def bouncer_stats(bouncer: PgBouncer, database: str) -> dict[str, int]:
    with psycopg.connect(bouncer.dsn("pgbouncer"), autocommit=True,
                         prepare_threshold=None) as conn:
        cur = conn.execute("SHOW STATS")
        cols = [c.name for c in cur.description or []]
        for row in cur.fetchall():
            doc = dict(zip(cols, row, strict=True))
            if doc["database"] == database:
                return {k: int(v) for k, v in doc.items() if k != "database"}
    return {}


async def test_api_transactions_go_through_pgbouncer(api: ApiTenant, dsn: str, via: str,
                                                     pgbouncer: PgBouncer) -> None:
    """With via=pgbouncer every API transaction is counted by PgBouncer (transaction
    pooling, prepared statements off); with via=direct none is."""
    name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    before = bouncer_stats(pgbouncer, name).get("total_xact_count", 0)
    for i in range(5):
        resp = await api.client.put(f"/v1/stock/wh/s{i}", json={"on_hand": 3})
        assert resp.status_code == 201  # the PUT created the line
        resp = await api.client.post("/v1/reservations", headers={"Idempotency-Key": f"k{i}"},
                                     json={"lines": [{"sku": f"s{i}", "location": "wh",
                                                      "quantity": 1}]})
        assert resp.status_code == 201, resp.text
    if via == "pgbouncer":
        deadline = time.monotonic() + 15  # PgBouncer folds its totals every stats_period (1 s)
        while bouncer_stats(pgbouncer, name).get("total_xact_count", 0) - before < 10:
            assert time.monotonic() < deadline, "PgBouncer never counted the transactions"
            await asyncio.sleep(0.2)
    else:
        assert bouncer_stats(pgbouncer, name).get("total_xact_count", 0) == before


async def test_role_pools_keep_their_application_name_through_pgbouncer(
        dsn: str, pgbouncer: PgBouncer) -> None:
    """Through PgBouncer a role pool's transactions run on server connections carrying
    its application_name (a startup parameter PgBouncer applies per client)."""
    from pgreserve import Database, ReservationService

    name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    async with Database(pgbouncer.dsn(name), role_pools=True, prepare_threshold=None) as db:
        svc = ReservationService(db)
        tenant = await svc.create_tenant("acme")
        await svc.set_stock(tenant.id, "s", "wh", 5)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE seen (app text)")
            conn.execute("CREATE FUNCTION note() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                         " INSERT INTO seen VALUES (current_setting('application_name'));"
                         " RETURN NEW; END $$")
            conn.execute("CREATE TRIGGER note AFTER INSERT ON reservation"
                         " FOR EACH ROW EXECUTE FUNCTION note()")
        assert (await svc.reserve(tenant.id, "k", [("s", "wh", 1)])).held
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT app FROM seen").fetchall() == [("pgreserve:reserve",)]


@pytest.fixture(scope="module")
def tight_bouncer(pg_server: EmbeddedServer) -> Iterator[PgBouncer]:
    """A second real PgBouncer whose pools have one server connection each."""
    if shutil.which("pgbouncer") is None and not Path("/usr/sbin/pgbouncer").exists():
        pytest.skip("pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)")
    bouncer = PgBouncer(pg_server, pool_size=1).start()
    yield bouncer
    bouncer.stop()


def doctor_findings(dsn: str, admin_url: str) -> tuple[int, dict[str, dict[str, str]]]:
    result = CliRunner().invoke(main, ["doctor", "--json", "--database-url", dsn,
                                       "--pgbouncer-admin-url", admin_url])
    doc = json.loads(result.output)
    return result.exit_code, {f["check"]: f for f in doc["findings"]}


async def test_a_client_waiting_in_pgbouncer_shows_in_doctor_and_metrics(
        dsn: str, db: Database, tight_bouncer: PgBouncer) -> None:
    """Pool size 1, one client holding a transaction and another waiting: SHOW POOLS has
    cl_waiting = 1, which the monitor's gauges, /metrics and doctor (a warning naming
    cl_waiting and maxwait) all show; once the holder commits they show none waiting."""
    from pgreserve.http import create_app

    name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    url, admin = tight_bouncer.dsn(name), tight_bouncer.dsn("pgbouncer")
    registry = CollectorRegistry()
    monitor = PgBouncerMonitor(admin, registry)
    labels = {"database": name, "user": "postgres"}
    with psycopg.connect(url, prepare_threshold=None) as holder:
        holder.execute("SELECT 1")  # a transaction open: the pool's one server connection
        waiter = await psycopg.AsyncConnection.connect(url, prepare_threshold=None,
                                                       autocommit=True)
        waiting = asyncio.create_task(waiter.execute("SELECT 1"))
        deadline = time.monotonic() + 15
        while registry.get_sample_value("pgreserve_pgbouncer_clients_waiting", labels) != 1:
            assert time.monotonic() < deadline, "PgBouncer never showed the waiting client"
            await monitor.refresh()
            await asyncio.sleep(0.05)
        assert registry.get_sample_value("pgreserve_pgbouncer_up") == 1
        assert registry.get_sample_value("pgreserve_pgbouncer_servers_active", labels) == 1
        assert registry.get_sample_value("pgreserve_pgbouncer_max_wait_seconds",
                                          labels) is not None
        assert not waiting.done()

        _, found = doctor_findings(dsn, admin)
        waiting_finding = found["pgbouncer clients waiting"]
        assert waiting_finding["status"] == "warn"
        assert f"{name}/postgres: cl_waiting=1, maxwait=" in waiting_finding["found"]
        assert found["pgbouncer pool_mode"]["status"] == "ok"

        # The ops listener's /metrics, beside the API (sharing its state) and
        # alone (serve --workers N: the parent reads PgBouncer itself).
        api = create_app(database=db, pgbouncer_admin_url=admin)
        beside = create_ops_app(state=api.state, monitor=False)
        alone = create_ops_app(dsn=dsn, monitor=False, pgbouncer_admin_url=admin)
        for ops in (beside, alone):
            async with ops.router.lifespan_context(ops):
                transport = httpx.ASGITransport(app=ops)
                async with httpx.AsyncClient(transport=transport,
                                             base_url="http://test") as client:
                    text = (await client.get("/metrics")).text
            assert (f'pgreserve_pgbouncer_clients_waiting{{database="{name}",user="postgres"}}'
                    ' 1.0' in text)
        await api.state.pgbouncer.close()
        holder.commit()
    await waiting
    await waiter.close()
    await monitor.refresh()
    assert registry.get_sample_value("pgreserve_pgbouncer_clients_waiting", labels) == 0
    _, found = doctor_findings(dsn, admin)
    assert found["pgbouncer clients waiting"]["status"] == "ok"
    await monitor.close()


async def test_an_unreachable_pgbouncer_console_fails_doctor_and_zeroes_up(dsn: str) -> None:
    """A PgBouncer admin URL nobody listens on: doctor fails that check (exit 1) and the
    monitor reports pgreserve_pgbouncer_up 0 with no pool figures."""
    from pgbouncer import free_port

    admin = f"postgresql://postgres@127.0.0.1:{free_port()}/pgbouncer"
    code, found = doctor_findings(dsn, admin)
    assert code == 1
    assert found["pgbouncer admin console"]["status"] == "fail"
    registry = CollectorRegistry()
    monitor = PgBouncerMonitor(admin, registry)
    report = await monitor.refresh()
    assert report.pools == ()
    assert registry.get_sample_value("pgreserve_pgbouncer_up") == 0


def _prepared_on_server(url: str) -> list[str]:
    """The prepared statements of the one server connection behind `url` (pool size 1)."""
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        return [str(r[0]) for r in conn.execute("SELECT name FROM pg_prepared_statements")]


async def test_the_tools_leave_no_prepared_statement_on_a_pgbouncer_server_connection(
        service: ReservationService, tenant: Tenant, dsn: str,
        tight_bouncer: PgBouncer, monkeypatch: pytest.MonkeyPatch) -> None:
    """PgBouncer 1.18 in transaction pooling hands a server connection to the next client
    with whatever the last one prepared on it. `reconcile --freeze` over 8 drifted
    buckets runs its freeze 8 times on one connection; psycopg's default prepares it at
    the 5th, so a second run through the bouncer failed halfway ("prepared statement
    "_pg3_0" already exists") with 5 buckets frozen and a traceback. Every tool
    connection now never prepares: both runs freeze all 8 and exit 1, and `migrate` (a
    fresh schema: a dozen migration records) and `doctor` leave nothing prepared."""
    t = tenant.id
    for i in range(8):
        await service.set_stock(t, f"s{i}", "wh", 10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE stock_bucket SET on_hand = on_hand + 1, free = free + 1")
    name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    url = tight_bouncer.dsn(name)
    for attempt in range(2):
        out = CliRunner().invoke(main, ["reconcile", "--freeze", "--database-url", url])
        assert out.exit_code == 1, (attempt, out.output, out.exception)
        assert out.output.count("FROZE tenant") == 8, (attempt, out.output)
        assert _prepared_on_server(url) == []
    monkeypatch.setenv("PGRESERVE_SCHEMA", "pgreserve")  # --schema makes it the process's
    out = CliRunner().invoke(main, ["migrate", "--schema", "elsewhere", "--database-url", url])
    monkeypatch.setenv("PGRESERVE_SCHEMA", "pgreserve")
    assert out.exit_code == 0, (out.output, out.exception)
    assert _prepared_on_server(url) == []
    out = CliRunner().invoke(main, ["doctor", "--json", "--database-url", url])
    assert json.loads(out.output)["findings"], out.output
    assert _prepared_on_server(url) == []
