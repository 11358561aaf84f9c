"""The API behind a real PgBouncer in transaction pooling mode."""

from __future__ import annotations

import asyncio
import time

import psycopg

from conftest import ApiTenant
from pgbouncer import PgBouncer


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
        assert resp.status_code == 200
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
