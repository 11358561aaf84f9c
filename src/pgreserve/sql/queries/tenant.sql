-- Tenants and their API keys (core/service.py).

-- name: tenant_create
INSERT INTO tenant (name) VALUES (%s) RETURNING tenant_id;

-- name: tenant_create_with_key
-- The tenant and its first API key's hash in one transaction.
SELECT tenant_create_v1(%s, %s);

-- name: tenant_find_by_name
SELECT tenant_id FROM tenant WHERE name = %s;

-- name: tenant_list
-- Every tenant (the admin's `pgreserve tenant list`), oldest first.
SELECT tenant_id, name, created_at FROM tenant ORDER BY tenant_id;

-- name: tenant_exists
SELECT 1 FROM tenant WHERE tenant_id = %s;

-- name: api_key_create
INSERT INTO api_key (tenant_id, key_hash) VALUES (%s, %s);

-- name: api_key_authenticate
-- The tenant of an unrevoked key, found by the key's hash.
SELECT tenant_id FROM api_key WHERE key_hash = %s AND revoked_at IS NULL;
