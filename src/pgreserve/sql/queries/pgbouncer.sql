-- PgBouncer's admin console (ops/pgbouncer.py): simple query protocol only, no parameters.

-- name: pgbouncer_pool_list
-- One row per (database, user) pool: cl_waiting, maxwait, sv_active, ...
SHOW POOLS;

-- name: pgbouncer_stat_list
-- One row per database: averages over stats_period.
SHOW STATS;
