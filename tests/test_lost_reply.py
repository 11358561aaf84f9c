"""A write whose reply is lost after its commit, for the operations that a second run would
answer differently: the caller is told the outcome is unknown, never a refusal that the
first run's own commit caused. Those that a second run answers the same are retried as
before, and a connection the server ended while it sat idle in the pool is never taken
for one that lost a reply."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql

from conftest import ApiTenant
from pgreserve import Database, ReservationService
from pgreserve.db.embedded import EmbeddedServer
from pgreserve.errors import OutcomeUnknown
from pgreserve.rollout.modes import Mode, set_mode
from test_http_api import assert_problem, put_stock


@contextmanager
def reply_lost_after_commit(server: EmbeddedServer, dsn: str, table: str,
                            also: str = "") -> Iterator[None]:
    """The next transaction that writes `table` commits (its commit record flushed
    locally) and loses its connection before the reply: its COMMIT waits for a
    synchronous standby that never comes, and the backend is terminated there, as the
    fault suite does. Only the first such transaction; the server is set back after.
    `also`: PL/pgSQL statements run in that same transaction (what another
    transaction would commit right after it: a key revoked, the database made
    read-only)."""
    admin = server.dsn("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        # (the server's own values, set back after: the test server's come from ALTER
        # SYSTEM too, and a RESET would make every later test's commit durable)
        before = {name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                  for name in ("synchronous_standby_names", "synchronous_commit")}
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'pgreserve_nobody'")
        conn.execute("ALTER SYSTEM SET synchronous_commit = 'local'")
        conn.execute("SELECT pg_reload_conf()")
    stop = threading.Event()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE pgreserve.lost_reply_armed (n int)")
            conn.execute("INSERT INTO pgreserve.lost_reply_armed VALUES (1)")
            conn.execute(sql.SQL("""CREATE FUNCTION pgreserve.lost_reply_arm() RETURNS trigger
                LANGUAGE plpgsql AS $$ BEGIN
                  IF EXISTS (SELECT 1 FROM pgreserve.lost_reply_armed) THEN
                    DELETE FROM pgreserve.lost_reply_armed;
                    PERFORM set_config('synchronous_commit', 'on', true);
                    {also}
                  END IF;
                  RETURN NULL;
                END $$""").format(also=sql.SQL(also)))  # (the test's own statements)
            conn.execute(f"CREATE TRIGGER lost_reply_arm AFTER INSERT OR UPDATE OR DELETE"
                         f" ON pgreserve.{table} FOR EACH STATEMENT"
                         f" EXECUTE FUNCTION pgreserve.lost_reply_arm()")
        killed: list[int] = []

        def killer() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while not stop.is_set():
                    killed.extend(r[0] for r in conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event = 'SyncRep'"))
                    if killed:
                        return
                    time.sleep(0.005)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        yield
        stop.set()
        thread.join(10)
        assert killed, "no commit waited for the standby: the reply was never lost"
    finally:
        stop.set()
        with psycopg.connect(admin, autocommit=True) as conn:
            for name, value in before.items():
                conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(
                    sql.Identifier(name), sql.Literal(value)))
            conn.execute("SELECT pg_reload_conf()")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TRIGGER IF EXISTS lost_reply_arm ON pgreserve." + table)
            conn.execute("DROP TABLE IF EXISTS pgreserve.lost_reply_armed")
            conn.execute("DROP FUNCTION IF EXISTS pgreserve.lost_reply_arm()")


async def test_conditional_counts_whose_reply_was_lost_are_unknown_not_412(
        api: ApiTenant, pg_server: EmbeddedServer, dsn: str) -> None:
    """PUT /v1/stock with If-Match, and one with If-None-Match: *, each commit and lose
    the reply. Run again, each would find its own write (the version moved, the line
    exists) and answer 412 "nothing written". They are answered 503 outcome_unknown
    instead, and the count was written once."""
    assert (await put_stock(api, "tee", 5)).status_code == 201  # version 1
    with reply_lost_after_commit(pg_server, dsn, "stock_bucket"):
        lost = await api.client.put("/v1/stock/wh/tee", json={"on_hand": 20},
                                    headers={"If-Match": 'W/"1"'})
    assert_problem(lost, 503, "outcome_unknown")
    now = (await api.client.get("/v1/stock/wh/tee")).json()
    assert (now["on_hand"], now["version"]) == (20, 2)

    with reply_lost_after_commit(pg_server, dsn, "stock_bucket"):
        created = await api.client.put("/v1/stock/wh/new", json={"on_hand": 7},
                                       headers={"If-None-Match": "*"})
    assert_problem(created, 503, "outcome_unknown")
    now = (await api.client.get("/v1/stock/wh/new")).json()
    assert (now["on_hand"], now["version"]) == (7, 1)


async def test_a_plain_count_whose_reply_was_lost_is_unknown_and_done_once(
        api: ApiTenant, pg_server: EmbeddedServer, dsn: str) -> None:
    """A count without a condition that creates its line, and one that changes it, commit
    and lose the reply. Run again, the first would answer 200 "created": false for the
    line it created, and each would write a second stock.changed event: 503
    outcome_unknown instead, each done once."""
    with reply_lost_after_commit(pg_server, dsn, "stock_bucket"):
        created = await api.client.put("/v1/stock/wh/tee", json={"on_hand": 5})
    assert_problem(created, 503, "outcome_unknown")
    with reply_lost_after_commit(pg_server, dsn, "stock_bucket"):
        counted = await api.client.put("/v1/stock/wh/tee", json={"on_hand": 20})
    assert_problem(counted, 503, "outcome_unknown")
    now = (await api.client.get("/v1/stock/wh/tee")).json()
    assert (now["on_hand"], now["version"]) == (20, 2)
    with psycopg.connect(dsn) as conn:
        changes = conn.execute("SELECT count(*) FROM outbox_event"
                               " WHERE type = 'stock.changed'").fetchone()
    assert changes == (2,)


async def test_admin_writes_whose_reply_was_lost_are_unknown(
        db: Database, pg_server: EmbeddedServer, dsn: str) -> None:
    """An unfreeze, a webhook registration and a tenant's creation commit and lose their
    reply. Run again they would say "not frozen", register a second endpoint (whose
    secret the caller would get, not the first's), or "name taken": OutcomeUnknown
    instead, with each done once."""
    svc = ReservationService(db, batching=False, allow_private_webhooks=True)
    tenant = await svc.create_tenant("acme")
    await svc.set_stock(tenant.id, "tee", "wh", 5)
    await svc.freeze(tenant.id, "audit", "ops", sku="tee", location="wh")
    with reply_lost_after_commit(pg_server, dsn, "stock_freeze"), \
            pytest.raises(OutcomeUnknown):
        await svc.unfreeze(tenant.id, "done", "ops", sku="tee", location="wh")
    assert await svc.freezes(tenant.id) == []

    with reply_lost_after_commit(pg_server, dsn, "webhook_endpoint"), \
            pytest.raises(OutcomeUnknown):
        await svc.add_webhook(tenant.id, "http://127.0.0.1:9/hook")
    assert len(await svc.webhooks(tenant.id)) == 1

    with reply_lost_after_commit(pg_server, dsn, "tenant"), pytest.raises(OutcomeUnknown):
        await svc.create_tenant("globex")
    assert [t.name for t, _ in await svc.tenants()].count("globex") == 1

    with reply_lost_after_commit(pg_server, dsn, "stock_freeze"), \
            pytest.raises(OutcomeUnknown):
        await svc.freeze(tenant.id, "recount", "ops", sku="tee", location="wh")
    assert len(await svc.freezes(tenant.id)) == 1

    with reply_lost_after_commit(pg_server, dsn, "rollout_mode"), \
            pytest.raises(OutcomeUnknown):
        await set_mode(db, tenant.id, Mode.PRIMARY, "ops")
    with psycopg.connect(dsn) as conn:
        switches = conn.execute("SELECT from_mode, to_mode FROM rollout_mode_change"
                                " WHERE tenant_id = %s", (tenant.id,)).fetchall()
    assert switches == [("pgreserve", "primary")]


async def test_a_connection_ended_while_idle_is_retried_not_unknown(
        db: Database, dsn: str) -> None:
    """The server ends the pool's idle connections (a terminated backend, a restart):
    a create that must not run twice reads the connection's goodbye before it sends,
    and is run on a new connection, not answered OutcomeUnknown."""
    svc = ReservationService(db, batching=False)
    await svc.create_tenant("acme")
    with psycopg.connect(dsn, autocommit=True) as conn:
        ended = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'").fetchone()
    assert ended is not None and ended[0] >= 1
    await asyncio.sleep(0.2)  # (the goodbyes reach the pool's sockets)
    retried = db.stats.connection_retried
    for name in ("globex", "initech"):
        assert (await svc.create_tenant(name)).name == name
    assert db.stats.connection_retried > retried


async def test_a_call_on_a_closed_pool_was_never_sent(dsn: str) -> None:
    """A write that must not run twice, on a database whose pool is closed, reached no
    server: Busy, never OutcomeUnknown ("it may have committed")."""
    from pgreserve.errors import Busy

    db = Database(dsn, max_size=2)
    await db.open()
    await db.close()
    with pytest.raises(Busy):
        await ReservationService(db, batching=False).create_tenant("acme")
