"""The webhook endpoints of the HTTP API and the `pgreserve webhook` commands."""

from __future__ import annotations

import json

from click.testing import CliRunner

from conftest import ApiTenant
from pgreserve.cli import main
from test_http_api import assert_problem


async def test_register_list_delete(api: ApiTenant) -> None:
    """POST gives 201 with id and secret (shown once), GET lists without it, DELETE gives 204."""
    created = await api.client.post("/v1/webhooks", json={"url": "https://shop.example/hooks"})
    assert created.status_code == 201, created.text
    doc = created.json()
    assert doc["url"] == "https://shop.example/hooks" and doc["secret"].startswith("whsec_")
    assert doc["delivered"] == 0 and doc["attempts"] == 0 and doc["last_error"] is None
    listed = (await api.client.get("/v1/webhooks")).json()["webhooks"]
    assert [w["id"] for w in listed] == [doc["id"]]
    assert "secret" not in listed[0]
    # the 201 shows the delivery state the list shows (due at once), secret aside
    assert doc["next_attempt_at"] is not None
    assert {k: v for k, v in doc.items() if k != "secret"} == listed[0]
    assert (await api.client.delete(f"/v1/webhooks/{doc['id']}")).status_code == 204
    assert (await api.client.get("/v1/webhooks")).json() == {"webhooks": []}
    assert_problem(await api.client.delete(f"/v1/webhooks/{doc['id']}"), 404,
                   "webhook_not_found")


async def test_other_tenants_webhooks_are_invisible(api: ApiTenant, other: ApiTenant) -> None:
    """Another tenant neither sees nor deletes an endpoint: it is answered as unknown (404)."""
    wid = (await api.client.post("/v1/webhooks", json={"url": "https://hooks.example/x"})).json()["id"]
    assert (await other.client.get("/v1/webhooks")).json() == {"webhooks": []}
    assert_problem(await other.client.delete(f"/v1/webhooks/{wid}"), 404, "webhook_not_found")
    assert_problem(await other.client.delete("/v1/webhooks/99999999999999999999"), 404,
                   "webhook_not_found")
    assert len((await api.client.get("/v1/webhooks")).json()["webhooks"]) == 1


async def test_bad_webhook_urls_are_422(api: ApiTenant) -> None:
    """Only absolute http(s) URLs with a host, up to 2000 characters, are accepted."""
    for url in ["ftp://example.com/x", "javascript:alert(1)", "file:///etc/passwd",
                "example.com/hook", "http://", "https://exa mple.com/", "http://h:99999/",
                "https://example.com/" + "a" * 2000, "", "http://a\u0000b/",
                # host names no resolver or client takes: an empty label, a label over
                # 63 characters
                "https://shop..example.com/hook", "https://.example.com/",
                "https://example..com:8080/", f"https://{'a' * 64}.example.com/"]:
        resp = await api.client.post("/v1/webhooks", json={"url": url})
        assert_problem(resp, 422, "invalid_request")
    for body in [{}, {"url": 5}, {"url": "https://x.example", "extra": 1}]:
        assert_problem(await api.client.post("/v1/webhooks", json=body), 422, "invalid_request")
    assert (await api.client.get("/v1/webhooks")).json() == {"webhooks": []}


def test_cli_webhook_add_and_list(dsn: str) -> None:
    """`webhook add` prints the id and secret once; `webhook list` shows the delivery state."""
    runner = CliRunner()
    made = runner.invoke(main, ["tenant", "create", "shop", "--database-url", dsn])
    assert made.exit_code == 0, made.output
    added = runner.invoke(main, ["webhook", "add", "shop", "https://shop.example/h", "--json",
                                 "--database-url", dsn])
    assert added.exit_code == 0, added.output
    doc = json.loads(added.output)
    assert doc["url"] == "https://shop.example/h" and doc["secret"].startswith("whsec_")
    listed = runner.invoke(main, ["webhook", "list", "shop", "--json", "--database-url", dsn])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert [r["id"] for r in rows] == [doc["id"]] and "secret" not in rows[0]
    bad = runner.invoke(main, ["webhook", "add", "shop", "ftp://x", "--database-url", dsn])
    assert bad.exit_code != 0 and "http" in bad.output
    nobody = runner.invoke(main, ["webhook", "list", "nobody", "--database-url", dsn])
    assert nobody.exit_code != 0 and "no tenant" in nobody.output
