"""pgreserve's objects in a schema of their own: the upgrade from public, two installations
in one database, a shop's own tables, and every command with --schema."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import httpx
import psycopg
import pytest

from conftest import in_schema
from pgreserve import Database, Line, ReservationService
from pgreserve.db import migrate as migrations
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import InvalidRequest
from procs import running
from test_cli import clean_env, pgr
from test_cli_up import BIN, free_port
from test_migrations import _catalog, _new_database

if TYPE_CHECKING:
    from pgbouncer import PgBouncer


def _routines(dsn: str, schema: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {str(r[0]) for r in conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = %s", (schema,)).fetchall()}


def _relations(dsn: str, schema: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {str(r[0]) for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'p')", (schema,)).fetchall()}


async def test_an_installation_in_public_upgrades_into_its_schema_with_its_data(
        pg_server: EmbeddedServer) -> None:
    """A database migrated before pgreserve had a schema of its own (everything in public)
    is moved into `pgreserve` by the next migrate: tenants, stock, holds and claims are
    kept and keep working, the shop's own table in public stays, and the result has the
    catalog of a fresh installation."""
    dsn = _new_database(pg_server, "schema_from_public")
    # every migration and function file in public (the function files this code ships
    # need every table and column they name)
    migrations.migrate(dsn, schema="public")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.shop_order (id int PRIMARY KEY)")
        conn.execute("INSERT INTO public.shop_order VALUES (1)")
    async with Database(dsn, schema="public") as old:
        svc = ReservationService(old, batching=False)
        tenant = await svc.create_tenant("acme")
        await svc.set_stock(tenant.id, "sku-1", "wh", 10)
        held = await svc.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 3)])
        assert held.reservation is not None
        await svc.claim(tenant.id, held.reservation.id)
        kept = await svc.reserve(tenant.id, "order-2", [Line("sku-1", "wh", 2)])
        assert kept.reservation is not None

    migrations.migrate(dsn)

    assert "shop_order" in _relations(dsn, "public")
    assert _relations(dsn, "public") == {"shop_order"}
    assert _routines(dsn, "public") == set()  # the adoption's list names every function
    fresh = _new_database(pg_server, "schema_fresh_for_public")
    migrations.migrate(fresh)
    moved, new = _catalog(dsn), _catalog(fresh)
    for part in new:
        assert moved[part] == new[part], part
    async with Database(dsn) as db:
        svc = ReservationService(db, batching=False)
        stock = await svc.get_stock(tenant.id, "sku-1", "wh")
        assert (stock.on_hand, stock.available) == (7, 5)
        assert (await svc.get_reservation(tenant.id, held.reservation.id)).status == "claimed"
        replay = await svc.reserve(tenant.id, "order-2", [Line("sku-1", "wh", 2)])
        assert replay.replayed and replay.reservation is not None
        assert replay.reservation.id == kept.reservation.id
        await svc.release(tenant.id, kept.reservation.id)
        assert (await svc.get_stock(tenant.id, "sku-1", "wh")).available == 7
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT id FROM public.shop_order").fetchall() == [(1,)]
        assert conn.execute("SELECT count(*) FROM pgreserve.pgreserve_migration"
                            ).fetchone() == (len(migrations.available()),)


async def test_two_installations_in_one_database_are_independent(
        pg_server: EmbeddedServer) -> None:
    """Two schemas of one database hold two installations: the same tenant id, SKU and
    request key in each are different records, and stock taken in one is not taken in
    the other."""
    dsn = _new_database(pg_server, "schema_two_installations")
    migrations.migrate(dsn, schema="shop_a")
    migrations.migrate(dsn, schema="shop_b")
    async with Database(dsn, schema="shop_a") as a_db, Database(dsn, schema="shop_b") as b_db:
        a, b = ReservationService(a_db), ReservationService(b_db)
        ta, tb = await a.create_tenant("acme"), await b.create_tenant("acme")
        assert ta.id == tb.id
        await a.set_stock(ta.id, "sku-1", "wh", 5)
        await b.set_stock(tb.id, "sku-1", "wh", 1)
        got_a = await a.reserve(ta.id, "order-1", [Line("sku-1", "wh", 4)])
        got_b = await b.reserve(tb.id, "order-1", [Line("sku-1", "wh", 1)])
        assert got_a.reservation is not None and got_b.reservation is not None
        assert not got_b.replayed and got_a.reservation.id != got_b.reservation.id
        assert (await a.get_stock(ta.id, "sku-1", "wh")).available == 1
        assert (await b.get_stock(tb.id, "sku-1", "wh")).available == 0
        await b.release(tb.id, got_b.reservation.id)
        assert (await a.get_stock(ta.id, "sku-1", "wh")).available == 1
        assert (await b.get_stock(tb.id, "sku-1", "wh")).available == 1
    assert migrations.applied_versions(dsn, schema="shop_a") == \
        migrations.applied_versions(dsn, schema="shop_b")
    assert migrations.migrate(dsn, schema="shop_a") == []


async def test_a_shops_own_public_tables_do_not_collide(pg_server: EmbeddedServer) -> None:
    """A shop's own public.reservation and public.tenant (other columns), there before
    pgreserve is installed, are left alone, and the service works on connections whose
    session search_path is public."""
    dsn = _new_database(pg_server, "schema_shop_tables")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.reservation (table_no int, guest text)")
        conn.execute("CREATE TABLE public.tenant (flat text)")
        conn.execute("INSERT INTO public.reservation VALUES (4, 'Ada')")
    migrations.migrate(dsn)
    async with Database(in_schema(dsn, "public")) as db:
        svc = ReservationService(db)
        tenant = await svc.create_tenant("acme")
        await svc.set_stock(tenant.id, "sku-1", "wh", 2)
        held = await svc.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 2)])
        assert held.reservation is not None
        await svc.claim(tenant.id, held.reservation.id)
        assert (await svc.get_reservation(tenant.id, held.reservation.id)).status == "claimed"
    with psycopg.connect(in_schema(dsn, "public")) as conn:
        assert conn.execute("SELECT * FROM reservation").fetchall() == [(4, "Ada")]
        assert conn.execute("SELECT count(*) FROM tenant").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM pgreserve.reservation").fetchone() == (1,)


async def test_a_non_default_schema_works_through_pgbouncer(
        pg_server: EmbeddedServer, pgbouncer: PgBouncer) -> None:
    """Through PgBouncer in transaction pooling, an installation in schema `other` serves
    reserve, claim and reads, and no server connection is left with its search_path."""
    dsn = _new_database(pg_server, "schema_bouncer")
    migrations.migrate(dsn, schema="other")
    async with Database(pgbouncer.dsn("schema_bouncer"), prepare_threshold=None,
                        schema="other", max_size=4) as db:
        svc = ReservationService(db)
        tenant = await svc.create_tenant("acme")
        await svc.set_stock(tenant.id, "sku-1", "wh", 3)
        for n in range(3):
            held = await svc.reserve(tenant.id, f"order-{n}", [Line("sku-1", "wh", 1)])
            assert held.reservation is not None
            await svc.claim(tenant.id, held.reservation.id)
        stock = await svc.get_stock(tenant.id, "sku-1", "wh")
        assert (stock.on_hand, stock.available) == (0, 0)
    with psycopg.connect(pgbouncer.dsn("schema_bouncer"), prepare_threshold=None,
                         autocommit=True) as conn:
        for _ in range(4):
            assert conn.execute("SHOW search_path").fetchone() == ('"$user", public',)


def test_a_bad_schema_name_is_refused() -> None:
    """A schema name that is not a plain lower-case identifier is a typed error, and
    `--schema` with it is a usage error (exit 2) before anything starts."""
    for bad in ("", "Shop", "a-b", "1st", "pg_shop", "a" * 64, 'x"; DROP'):
        with pytest.raises(InvalidRequest, match="schema name"):
            Database("postgresql:///x", schema=bad)
    result = pgr("doctor", "--schema", "Bad-Name", "--database-url", "postgresql:///x")
    assert result.returncode == 2 and "--schema" in result.stderr
    assert "Traceback" not in result.stderr


@contextmanager
def _running(*args: str, ready: str | None) -> Iterator[list[str]]:
    """`pgreserve ARGS` in a subprocess (until `ready` is printed, if given); SIGTERM at
    the end, which must exit 0."""
    with running([str(BIN), *args], env=clean_env(), ready=ready) as proc:
        yield proc.lines


def test_serve_worker_and_doctor_with_another_schema(pg_server: EmbeddedServer) -> None:
    """With --schema other: migrate, tenant create, serve (reserve, claim; its banner's
    tenant-create hint names the schema), worker (the sweeper expires a hold) and doctor
    all use schema `other` of a plain DSN, and nothing is created in `pgreserve`."""
    dsn = _new_database(pg_server, "schema_cli_other")
    db = ("--database-url", dsn, "--schema", "other")
    migrated = pgr("migrate", *db)
    assert migrated.returncode == 0, migrated.stderr
    created = pgr("tenant", "create", "shop", "--json", *db)
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)["api_key"]
    port = free_port()
    with _running("serve", *db, "--port", str(port), "--ops-port", str(free_port()),
                  ready="Press Ctrl-C") as served, _running("worker", *db, ready=None), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                         headers={"Authorization": f"Bearer {key}"}) as client:
        assert any("tenant create NAME" in x and "--schema other" in x
                   for x in served), served
        assert client.put("/v1/stock/wh/sku-1", json={"on_hand": 5}).status_code == 201
        sold = client.post("/v1/reservations", headers={"Idempotency-Key": "order-1"},
                           json={"lines": [{"sku": "sku-1", "location": "wh", "quantity": 2}]})
        assert sold.status_code == 201, sold.text
        claimed = client.post(f"/v1/reservations/{sold.json()['id']}/claim")
        assert claimed.status_code == 200 and claimed.json()["status"] == "claimed"
        left = client.post("/v1/reservations", headers={"Idempotency-Key": "order-2"},
                           json={"lines": [{"sku": "sku-1", "location": "wh", "quantity": 1}],
                                 "ttl_seconds": 1})
        assert left.status_code == 201, left.text
        # the row itself changes only when the worker's sweeper expires the hold
        status = "active"
        until = time.monotonic() + 120
        with psycopg.connect(dsn, autocommit=True) as conn:
            while status == "active" and time.monotonic() < until:
                time.sleep(0.5)
                row = conn.execute("SELECT status FROM other.reservation"
                                   " WHERE reservation_id = %s", (left.json()["id"],)).fetchone()
                assert row is not None
                status = str(row[0])
        assert status == "expired"
        assert client.get(f"/v1/reservations/{left.json()['id']}").json()["status"] == "expired"
        stock = client.get("/v1/stock/wh/sku-1").json()
        assert (stock["on_hand"], stock["available"]) == (3, 3)
    doctor = pgr("doctor", "--json", *db)
    checks = {f["check"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert "stock_unit partitions" not in checks, checks
    assert checks["stock_unit partition autovacuum settings"]["status"] == "ok"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regnamespace('pgreserve')").fetchone() == (None,)
        assert conn.execute("SELECT status FROM other.reservation ORDER BY created_at"
                            ).fetchall() == [("claimed",), ("expired",)]


def test_a_schema_with_no_installation_is_refused_not_created(pg_server: EmbeddedServer) -> None:
    """A mistyped --schema (here `othr` beside an installation in `other`) is refused by
    the commands that migrate on their way (tenant create, serve, rollout) and those
    that only read (ops bloat, reconcile, doctor), naming the command that creates it,
    and nothing is created; `migrate --schema othr` creates
    it. The default schema is still created on first use."""
    dsn = _new_database(pg_server, "schema_cli_typo")
    assert pgr("migrate", "--database-url", dsn, "--schema", "other").returncode == 0
    typo = ("--database-url", dsn, "--schema", "othr")
    for command in (("tenant", "create", "shop"), ("webhook", "list", "shop"),
                    ("serve", "--port", str(free_port()), "--ops-port", str(free_port())),
                    ("rollout", "status")):
        result = pgr(*command, *typo)
        assert result.returncode == 1, (command, result)
        assert "schema 'othr' holds no pgreserve installation" in result.stderr, result.stderr
        assert "pgreserve migrate --database-url" in result.stderr
        assert "--schema othr" in result.stderr and "Traceback" not in result.stderr
    # the commands that only read refuse it too (ops bloat listed no partitions, exit 0)
    reading: tuple[str, ...]
    for reading in (("ops", "bloat"), ("reconcile",), ("doctor",)):
        result = pgr(*reading, *typo)
        assert result.returncode == 1, (reading, result)
        said = result.stdout + result.stderr  # doctor: a failed finding, on stdout
        assert "--schema othr" in said and "Traceback" not in said, (reading, said)
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regnamespace('othr')").fetchone() == (None,)
        assert conn.execute("SELECT to_regnamespace('pgreserve')").fetchone() == (None,)
    assert pgr("migrate", *typo).returncode == 0
    assert pgr("tenant", "create", "shop", *typo).returncode == 0
    assert pgr("tenant", "create", "shop", "--database-url", dsn).returncode == 0
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM othr.tenant").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM pgreserve.tenant").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM other.tenant").fetchone() == (0,)


async def test_reconcile_and_the_bloat_monitor_read_another_schema(
        pg_server: EmbeddedServer) -> None:
    """reconcile (with repair) and the bloat monitor, on a plain DSN, read the installation
    in schema `other`: its bucket's books, its overdue hold expired, its 16 partitions."""
    from pgreserve.ops.bloat import BloatMonitor
    from pgreserve.ops.reconcile import reconcile

    dsn = _new_database(pg_server, "schema_ops_other")
    migrations.migrate(dsn, schema="other")
    async with Database(dsn, schema="other") as db:
        svc = ReservationService(db, batching=False)
        tenant = await svc.create_tenant("acme")
        await svc.set_stock(tenant.id, "sku-1", "wh", 4)
        held = await svc.reserve(tenant.id, "order-1", [Line("sku-1", "wh", 1)], ttl=1)
        assert held.reservation is not None
    await asyncio.sleep(1.5)
    found = reconcile(dsn, schema="other", grace_s=0.0, repair=True)
    assert [(b.sku, b.on_hand) for b in found.books] == [("sku-1", 4)]
    assert found.drifts == [] and len(found.repaired) == 1, found.as_json()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT status FROM other.reservation").fetchone() == ("expired",)
    monitor = BloatMonitor(dsn, schema="other")
    try:
        report = await monitor.check()
    finally:
        await monitor.close()
    assert len(report.partitions) == 16


# The tables looked up before the tenant is known: the tenant itself (by id or name) and
# the API keys (by the key's hash). Distributed by tenant, they would be reference tables.
GLOBAL_TABLES = {"tenant", "api_key"}


def test_every_key_of_a_tenant_table_leads_with_the_tenant(dsn: str) -> None:
    """docs/design.md: every primary key, unique constraint and unique index of a table
    other than the global ones (and the migration runner's own, pgreserve_*) starts
    with tenant_id, and every foreign key carries it
    first on both sides, so the schema can be distributed by tenant; the global tables
    are the two the docs name."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            """
            SELECT c.relname, i.indexrelid::regclass::text,
                   (SELECT a.attname FROM pg_attribute a
                    WHERE a.attrelid = i.indrelid AND a.attnum = i.indkey[0])
            FROM pg_index i
            JOIN pg_class c ON c.oid = i.indrelid
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = 'pgreserve' AND i.indisunique AND c.relkind IN ('r', 'p')
              AND NOT c.relispartition AND left(c.relname, 10) <> 'pgreserve_'
            """).fetchall()
        foreign = conn.execute(
            """
            SELECT c.conrelid::regclass::text, c.conname,
                   (SELECT a.attname FROM pg_attribute a
                    WHERE a.attrelid = c.conrelid AND a.attnum = c.conkey[1]),
                   (SELECT a.attname FROM pg_attribute a
                    WHERE a.attrelid = c.confrelid AND a.attnum = c.confkey[1]),
                   c.confrelid::regclass::text
            FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
            WHERE n.nspname = 'pgreserve' AND c.contype = 'f'
            """).fetchall()
    assert rows and {table for table, _, _ in rows} >= {"stock_bucket", "reservation"}
    bad = [(table, index, first) for table, index, first in rows
           if table not in GLOBAL_TABLES and first != "tenant_id"]
    assert bad == []
    assert {table for table, _, first in rows if first != "tenant_id"} == GLOBAL_TABLES
    bad_fk = [(table, name) for table, name, mine, theirs, target in foreign
              if target.split(".")[-1] not in GLOBAL_TABLES
              and (mine, theirs) != ("tenant_id", "tenant_id")]
    assert bad_fk == []
