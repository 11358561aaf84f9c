-- The benchmark's reads around a run (bench/runner.py, bench/server.py) and the
-- script `bench server` hands to pgbench.

-- name: stats_flush
-- This session's statistics, visible to the next snapshot at once.
SELECT pg_stat_force_next_flush();

-- name: bucket_count
SELECT count(*) FROM stock_bucket WHERE tenant_id = %s;

-- name: backend_count
SELECT count(*) FROM pg_stat_activity WHERE application_name = %s
 AND datname = current_database();

-- name: pool_partition_tuple_totals
-- The pool partitions of the installation in schema %s.
SELECT coalesce(sum(n_dead_tup), 0), coalesce(sum(n_live_tup), 0),
 coalesce(sum(n_tup_del), 0),
 coalesce(sum(vacuum_count + autovacuum_count), 0)
 FROM pg_stat_user_tables WHERE schemaname = %s AND relname LIKE 'stock\_unit\_p%%';

-- name: pool_partition_dead_tuples
SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables
 WHERE schemaname = %s AND relname LIKE 'stock\_unit\_p%%';

-- name: database_transaction_stats
SELECT deadlocks, xact_commit, xact_rollback FROM pg_stat_database
 WHERE datname = current_database();

-- name: tenant_books_read
-- The tenant's books in one statement: on_hand, free, pool units, held, restored,
-- reservations, shortfall.
SELECT
     (SELECT coalesce(sum(on_hand), 0) FROM stock_bucket WHERE tenant_id = %(t)s),
     (SELECT coalesce(sum(free), 0) FROM stock_bucket WHERE tenant_id = %(t)s),
     (SELECT count(*) FROM stock_unit WHERE tenant_id = %(t)s),
     (SELECT coalesce(sum(quantity), 0) FROM reservation_line
       WHERE tenant_id = %(t)s AND held),
     (SELECT coalesce(sum(quantity), 0) FROM stock_movement
       WHERE tenant_id = %(t)s AND kind = 'restore'),
     (SELECT count(*) FROM reservation WHERE tenant_id = %(t)s),
     (SELECT coalesce(sum(shortfall), 0) FROM stock_bucket WHERE tenant_id = %(t)s);

-- name: request_outcome_count
-- Held and rejected requests among the keys with the given prefix pattern.
SELECT count(*) FILTER (WHERE status = 'succeeded'),
 count(*) FILTER (WHERE status = 'rejected')
 FROM request_ledger WHERE tenant_id = %s AND request_key LIKE %s;

-- name: pgbench_reserve_script
-- One reserve of one unit of the hot SKU under a random key (2^63 values: never
-- reused). `\set` and `:name` are pgbench's; `{name}` slots are psycopg.sql
-- literals filled in bench/server.py ({schema}: reserve_v1 carries its search_path).
\set r random(1, 9000000000000000000)
SELECT {schema}.reserve_v1({tenant}, {key_prefix} || :client_id || '-' || :r, 'pgbench', {skus}::text[], {locations}::text[], {quantities}::integer[], '15 minutes'::interval);

-- name: server_usage_read
-- This session's backend pid (its parent is the postmaster), the WAL position in
-- bytes (live), and pg_stat_wal's wal_bytes (flushed by each session at most once
-- a second, and when it exits).
SELECT pg_backend_pid(), pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
 (SELECT wal_bytes FROM pg_stat_wal)::bigint;

-- name: statement_time_read
-- Milliseconds spent executing statements in this database (the fallback when the
-- server's processes are not visible in /proc): top-level statements only, since
-- with track = all a function's own statements are counted again inside its call.
SELECT coalesce(sum(total_exec_time), 0)::float8 FROM pg_stat_statements
WHERE toplevel AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database());

-- name: durability_settings_read
-- What a commit of this session waits for, and whether it reaches the disk at all
-- (bench/durability.py).
SELECT current_setting('fsync'), current_setting('synchronous_commit'),
 current_setting('full_page_writes');
