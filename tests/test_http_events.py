"""The event feed: this tenant's outbox in commit order, resumable by cursor."""

from __future__ import annotations

import psycopg

from conftest import ApiTenant
from test_http_api import put_stock, reserve


async def test_events_in_order_with_cursor(api: ApiTenant, other: ApiTenant) -> None:
    """Events come in commit order, page by limit, and resume after the cursor; tenants apart."""
    await put_stock(api, "s", 5)
    rid = (await reserve(api, "k1", [("s", "wh", 1)])).json()["id"]
    await api.client.post(f"/v1/reservations/{rid}/claim")
    await put_stock(other, "s", 9)
    first = (await api.client.get("/v1/events?limit=2")).json()
    assert [e["type"] for e in first["events"]] == ["stock.changed", "reservation.created"]
    assert first["events"][1]["data"]["id"] == rid
    rest = (await api.client.get(f"/v1/events?after={first['next_cursor']}")).json()
    assert [e["type"] for e in rest["events"]] == ["reservation.claimed"]
    empty = (await api.client.get(f"/v1/events?after={rest['next_cursor']}")).json()
    assert empty == {"events": [], "next_cursor": rest["next_cursor"]}
    theirs = (await other.client.get("/v1/events")).json()
    assert [e["data"]["on_hand"] for e in theirs["events"]] == [9]


async def test_uncommitted_transaction_holds_the_feed_back(api: ApiTenant, dsn: str) -> None:
    """While an older transaction is open, newer events wait, so none is skipped when it commits."""
    await put_stock(api, "s", 5)
    seen = (await api.client.get("/v1/events")).json()
    with psycopg.connect(dsn) as slow:
        slow.execute("SELECT pg_current_xact_id()")  # takes an xid older than what follows
        await reserve(api, "k1", [("s", "wh", 1)])  # commits with a newer xid
        held = (await api.client.get(f"/v1/events?after={seen['next_cursor']}")).json()
        assert held["events"] == []
        slow.execute("INSERT INTO outbox_event (tenant_id, type, payload)"
                     " VALUES (%s, 'stock.changed', '{\"slow\": true}')", (api.tenant.id,))
        slow.commit()
    after = (await api.client.get(f"/v1/events?after={seen['next_cursor']}")).json()
    assert [e["type"] for e in after["events"]] == ["stock.changed", "reservation.created"]
    assert after["events"][0]["data"] == {"slow": True}


async def test_a_repeated_single_value_parameter_is_422(api: ApiTenant) -> None:
    """`limit` and `after` take one value each: a repeat is refused (422, naming it) as on
    the other list routes, not quietly resolved to one of the values."""
    from test_http_api import assert_problem

    for query in ("limit=1&limit=2", "after=0-0&after=0-1"):
        doc = assert_problem(await api.client.get(f"/v1/events?{query}"), 422,
                             "invalid_request")
        assert "at most once" in doc["detail"]
    assert (await api.client.get("/v1/events?limit=1")).status_code == 200
    for route in ("/v1/stock", "/v1/reservations"):
        resp = await api.client.get(f"{route}?limit=1&limit=2")
        assert assert_problem(resp, 422, "invalid_request")["detail"].startswith("limit ")
