-- Tenants and their API keys (core/service.py).

-- name: tenant_create
INSERT INTO tenant (name) VALUES (%s) RETURNING tenant_id;

-- name: tenant_create_with_key
-- The tenant and its first API key's hash and shown prefix in one transaction.
SELECT tenant_create_v2(%s, %s, %s);

-- name: tenant_find_by_name
SELECT tenant_id FROM tenant WHERE name = %s;

-- name: tenant_list
-- Every tenant (the admin's `pgreserve tenant list`), oldest first.
SELECT tenant_id, name, created_at FROM tenant ORDER BY tenant_id;

-- name: tenant_exists
SELECT 1 FROM tenant WHERE tenant_id = %s;

-- name: api_key_authenticate_many
-- The tenants of the unrevoked keys among these hashes (one lookup for the requests
-- that arrived together), by hash.
SELECT key_hash, tenant_id FROM api_key WHERE key_hash = ANY(%s) AND revoked_at IS NULL;

-- name: api_key_create_with_prefix
INSERT INTO api_key (tenant_id, key_hash, key_prefix) VALUES (%s, %s, %s);

-- name: api_key_list
-- A tenant's keys, newest first: the shown prefix (or, for a key issued before
-- prefixes were kept, "sha256:" and the first hex digits of its hash).
SELECT coalesce(key_prefix, 'sha256:' || left(encode(key_hash, 'hex'), 12)), created_at,
       revoked_at
FROM api_key WHERE tenant_id = %s ORDER BY created_at DESC, key_hash;

-- name: api_key_revoke
-- Revoke the tenant's unrevoked key shown with this prefix; returns the prefix.
UPDATE api_key SET revoked_at = clock_timestamp()
WHERE tenant_id = %s AND revoked_at IS NULL
  AND coalesce(key_prefix, 'sha256:' || left(encode(key_hash, 'hex'), 12)) = %s
RETURNING coalesce(key_prefix, 'sha256:' || left(encode(key_hash, 'hex'), 12));
