-- `pgreserve doctor` (ops/doctor.py): what it reads, and the fixes it prints.
-- The `*_fix` blocks are shown to the operator, never run by pgreserve; the
-- reason after each is added in Python as a `--` comment.

-- name: setting_get
SELECT setting, unit FROM pg_settings WHERE name = %s;

-- name: role_current
SELECT current_user;

-- name: pool_partition_option_list
-- The partitions of stock_unit in schema %s.
SELECT c.relname, coalesce(array_to_string(c.reloptions, ','), '')
 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = to_regclass(quote_ident(%s) || '.stock_unit') ORDER BY c.relname;

-- name: pg_stat_statements_exists
SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements';

-- name: idle_in_transaction_timeout_fix
ALTER SYSTEM SET idle_in_transaction_session_timeout = '15s'; SELECT pg_reload_conf();

-- name: role_setting_fix
-- Role, setting name and value are composed in Python (psycopg.sql).
ALTER ROLE {} SET {} = {};

-- name: autovacuum_naptime_fix
ALTER SYSTEM SET autovacuum_naptime = '1s'; SELECT pg_reload_conf();

-- name: autovacuum_max_workers_fix
ALTER SYSTEM SET autovacuum_max_workers = 6;

-- name: fsync_fix
ALTER SYSTEM SET fsync = on; SELECT pg_reload_conf();

-- name: full_page_writes_fix
ALTER SYSTEM SET full_page_writes = on; SELECT pg_reload_conf();

-- name: autovacuum_fix
ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf();

-- name: pool_partition_autovacuum_fix
-- The operator names the partition.
ALTER TABLE <partition> SET (autovacuum_enabled = on, autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0)

-- name: pg_stat_statements_preload_fix
ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'; ALTER SYSTEM SET pg_stat_statements.track = 'all';

-- name: pg_stat_statements_create_fix
CREATE EXTENSION pg_stat_statements;

-- name: log_lock_waits_fix
ALTER SYSTEM SET log_lock_waits = on; SELECT pg_reload_conf();

-- name: log_min_duration_statement_fix
ALTER SYSTEM SET log_min_duration_statement = '200ms'; SELECT pg_reload_conf();

-- name: track_functions_fix
ALTER SYSTEM SET track_functions = 'pl'; SELECT pg_reload_conf();

-- name: max_connections_fix
-- The value is composed in Python (psycopg.sql.Literal).
ALTER SYSTEM SET max_connections = {};

-- name: database_freeze_fix
-- Followed in Python by which tables, and what to look for.
VACUUM (FREEZE);
