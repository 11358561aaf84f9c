-- Transaction control: Database.call's wrapper (db/database.py) and reconcile's snapshot.

-- name: transaction_begin
-- The two limits are literals composed in Python (psycopg.sql): one simple query per call.
-- READ COMMITTED whatever the server's default: every function reads what committed
-- before each of its statements (a reserve that waited on a freeze lock sees the
-- freeze; a conditional UPDATE re-checks the row it waited for).
BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {};

-- name: transaction_commit
COMMIT;

-- name: transaction_rollback
ROLLBACK;

-- name: transaction_begin_snapshot
-- Every figure read in one snapshot, writing nothing.
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
