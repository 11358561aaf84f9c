-- `pgreserve doctor` (ops/doctor.py): what it reads, and the fixes it prints.
-- The `*_fix` blocks are shown to the operator, never run by pgreserve; the
-- reason after each is added in Python as a `--` comment.

-- name: setting_get
SELECT setting, unit FROM pg_settings WHERE name = %s;

-- name: role_current
SELECT current_user;

-- name: setting_source
-- Where this session's value comes from: 'database user', 'user', 'database' and
-- 'global' are pg_db_role_setting's (ALTER ROLE / ALTER DATABASE ... SET), 'client'
-- the connection's options, 'configuration file' ALTER SYSTEM or postgresql.conf.
SELECT source FROM pg_settings WHERE name = %s;

-- name: setting_override_list
-- The per-database and per-role values of setting %(name)s that a new session of the
-- current role on the current database gets (pg_db_role_setting), the winning one first:
-- role in this database, role, database, every role (ALTER ROLE ALL).
SELECT CASE WHEN s.setdatabase <> 0 AND s.setrole <> 0 THEN 'database user'
            WHEN s.setrole <> 0 THEN 'user'
            WHEN s.setdatabase <> 0 THEN 'database'
            ELSE 'global' END AS level,
       d.datname, r.rolname
FROM pg_db_role_setting s
LEFT JOIN pg_database d ON d.oid = s.setdatabase
LEFT JOIN pg_roles r ON r.oid = s.setrole
WHERE (s.setdatabase = 0 OR d.datname = current_database())
  AND (s.setrole = 0 OR r.rolname = current_user)
  AND EXISTS (SELECT 1 FROM unnest(s.setconfig) c
              WHERE lower(split_part(c, '=', 1)) = lower(%(name)s))
ORDER BY (s.setdatabase <> 0 AND s.setrole <> 0) DESC, (s.setrole <> 0) DESC,
         (s.setdatabase <> 0) DESC;

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

-- name: database_role_setting_reset_fix
-- Role, database and setting name are composed in Python (psycopg.sql).
ALTER ROLE {} IN DATABASE {} RESET {};

-- name: role_setting_reset_fix
ALTER ROLE {} RESET {};

-- name: database_setting_reset_fix
ALTER DATABASE {} RESET {};

-- name: every_role_setting_reset_fix
ALTER ROLE ALL RESET {};

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
