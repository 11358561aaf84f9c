"""API keys from the CLI: create more per tenant, list them by prefix only, revoke one; a
revoked key is refused from its next request on."""

from __future__ import annotations

import asyncio
import json

import httpx
import psycopg
import pytest
from click.testing import CliRunner

from pgreserve import Database, ReservationService
from pgreserve.cli import main
from pgreserve.errors import ApiKeyNotFound
from pgreserve.http import create_app


def cli(dsn: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "--database-url", dsn])
    return result.exit_code, result.output


async def test_a_revoked_key_is_refused_at_once(db: Database, dsn: str) -> None:
    """A key revoked with `tenant key revoke` gets 401 on the very next request of a
    server that accepted it a moment before (default settings); the tenant's other key
    keeps working."""
    service = ReservationService(db)
    _, first = await service.create_tenant_with_key("shop")
    code, second = await asyncio.to_thread(cli, dsn, "tenant", "key", "create", "shop")
    assert code == 0
    second = second.strip()
    app = create_app(database=db)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        def auth(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        for key in (first, second):
            assert (await client.get("/v1/events", headers=auth(key))).status_code == 200
        code, out = await asyncio.to_thread(cli, dsn, "tenant", "key", "revoke", "shop",
                                            first[:12])
        assert code == 0 and out.strip() == f"revoked {first[:12]}"
        refused = await client.get("/v1/events", headers=auth(first))
        assert refused.status_code == 401 and refused.json()["code"] == "unauthorized"
        assert (await client.get("/v1/events", headers=auth(second))).status_code == 200


async def test_list_shows_prefixes_and_times_only(db: Database, dsn: str) -> None:
    """`tenant key list` shows each key's prefix with its created and revoked times, never
    the key or its hash; `tenant key NAME` (the old form) still issues a key."""
    service = ReservationService(db)
    _, first = await service.create_tenant_with_key("shop")
    code, old_form = await asyncio.to_thread(cli, dsn, "tenant", "key", "shop", "--json")
    assert code == 0
    second = json.loads(old_form)["api_key"]
    await service.revoke_api_key((await service.tenant_by_name("shop")).id,  # type: ignore[union-attr]  # created above
                                 second[:12])
    code, out = await asyncio.to_thread(cli, dsn, "tenant", "key", "list", "shop", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["prefix"] for r in rows] == [second[:12], first[:12]]
    assert rows[0]["revoked_at"] is not None and rows[1]["revoked_at"] is None
    assert all(r["created_at"] for r in rows)
    assert first not in out and second not in out
    code, text = await asyncio.to_thread(cli, dsn, "tenant", "key", "list", "shop")
    assert code == 0 and "revoked" in text and "active" in text


async def test_revoke_errors_are_typed(db: Database, dsn: str) -> None:
    """Revoking an unknown prefix, an already revoked key or another tenant's key fails
    and changes nothing; a key issued before prefixes were kept is listed and revoked by
    its hash prefix."""
    service = ReservationService(db)
    shop, key = await service.create_tenant_with_key("shop")
    other, other_key = await service.create_tenant_with_key("other")
    for prefix in ("pgr_nothing1", other_key[:12]):
        with pytest.raises(ApiKeyNotFound):
            await service.revoke_api_key(shop.id, prefix)
    await service.revoke_api_key(shop.id, key[:12])
    with pytest.raises(ApiKeyNotFound):
        await service.revoke_api_key(shop.id, key[:12])
    assert await service.tenant_for_api_key(other_key) == other.id
    code, out = await asyncio.to_thread(cli, dsn, "tenant", "key", "revoke", "nobody", "x")
    assert code != 0 and "no tenant" in out
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE api_key SET key_prefix = NULL WHERE tenant_id = %s", (other.id,))
    listed = await service.api_keys(other.id)
    assert len(listed) == 1 and listed[0].prefix.startswith("sha256:")
    await service.revoke_api_key(other.id, listed[0].prefix)
    assert await service.tenant_for_api_key(other_key) is None
