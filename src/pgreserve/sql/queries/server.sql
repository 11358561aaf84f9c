-- The embedded server's set-up (db/embedded.py). `{}` slots are filled in Python
-- with psycopg.sql.Identifier / Literal.

-- name: database_exists
SELECT 1 FROM pg_database WHERE datname = %s;

-- name: database_create
CREATE DATABASE {};

-- name: server_setting_set
ALTER SYSTEM SET {} = {};

-- name: role_setting_set
-- Defaults for the role the service connects as: a safety net under the per-transaction limits.
ALTER ROLE CURRENT_USER SET {} = {};

-- name: server_config_reload
SELECT pg_reload_conf();
