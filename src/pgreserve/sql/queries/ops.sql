-- The figures behind /metrics and /ops (ops/figures.py), the hold-time sampler
-- (ops/sampler.py) and the bloat monitor (ops/bloat.py).

-- name: bucket_hot_list
-- The buckets with the most units held, with their pool and hold counts.
SELECT b.tenant_id, t.name, b.sku, b.location, b.strategy, b.on_hand, b.free, b.pool_cap,
       (SELECT count(*) FROM stock_unit u
         WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) AS pool,
       h.held, h.lines
FROM stock_bucket b
JOIN tenant t ON t.tenant_id = b.tenant_id
CROSS JOIN LATERAL (
    SELECT coalesce(sum(l.quantity), 0)::bigint AS held, count(*) AS lines
    FROM reservation_line l
    WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held) h
ORDER BY h.held DESC, b.updated_at DESC
LIMIT %s;

-- name: hold_count_by_state
-- `overdue`: active past expires_at, waiting for the sweeper (or a buyer) to give it back.
SELECT CASE WHEN status = 'active' AND expires_at <= clock_timestamp() THEN 'overdue'
            ELSE status END, count(*)
FROM reservation GROUP BY 1 ORDER BY 1;

-- name: refill_count
-- pool_replenish_v1 counts every refill, pool_refill_v1 the background ones (track_functions).
SELECT coalesce(sum(calls) FILTER (WHERE funcname = 'pool_replenish_v1'), 0)::bigint,
       coalesce(sum(calls) FILTER (WHERE funcname = 'pool_refill_v1'), 0)::bigint,
       current_setting('track_functions')
FROM pg_stat_user_functions
WHERE schemaname = current_schema() AND funcname IN ('pool_replenish_v1', 'pool_refill_v1');

-- name: activity_sample
-- Every other client backend (of this database unless %(all)s), with its transaction's age.
SELECT pid, coalesce(nullif(application_name, ''), '(none)'), coalesce(state, 'unknown'),
       extract(epoch FROM clock_timestamp() - xact_start)::float8,
       extract(epoch FROM clock_timestamp() - state_change)::float8,
       wait_event_type
FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
  AND (%(all)s OR datname = current_database());

-- name: pool_partition_stat_list
-- Live and dead tuples and the vacuum history of each stock_unit partition (schema %s).
SELECT c.relname, coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
       s.last_autovacuum, s.last_vacuum, coalesce(s.autovacuum_count, 0),
       coalesce(s.vacuum_count, 0), c.oid::bigint
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
WHERE i.inhparent = to_regclass(quote_ident(%s) || '.stock_unit')
ORDER BY length(c.relname), c.relname;

-- name: database_xid_age
SELECT age(datfrozenxid)::bigint FROM pg_database WHERE datname = current_database();

-- name: pgstattuple_create
CREATE EXTENSION IF NOT EXISTS pgstattuple;

-- name: pool_partition_tuple_approx
SELECT dead_tuple_percent, approx_free_percent FROM pgstattuple_approx(%s::oid);
