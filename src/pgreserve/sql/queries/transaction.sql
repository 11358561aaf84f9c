-- Transaction control: Database.call's wrapper (db/database.py) and reconcile's snapshot.

-- name: transaction_begin
-- The two limits are literals composed in Python (psycopg.sql): one simple query per call.
BEGIN; SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {};

-- name: transaction_commit
COMMIT;

-- name: transaction_rollback
ROLLBACK;

-- name: transaction_begin_snapshot
-- Every figure read in one snapshot, writing nothing.
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
