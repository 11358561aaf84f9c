-- Transaction control: Database.call's wrapper (db/database.py) and reconcile's snapshot.

-- name: transaction_begin
-- The schema and the two limits are composed in Python (psycopg.sql): one simple
-- query per call. READ COMMITTED whatever the server's default: every function reads
-- what committed before each of its statements (a reserve that waited on a freeze
-- lock sees the freeze; a conditional UPDATE re-checks the row it waited for).
-- search_path is set per transaction, never per session (db/schema.py).
BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL search_path TO {}; SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {};

-- name: transaction_begin_read
-- A read's transaction (Database.fetch): the server's isolation and limits, as an
-- autocommit statement has; only the schema is set.
BEGIN; SET LOCAL search_path TO {};

-- name: transaction_begin_read_committed
-- A read whose function must see what committed before each of its statements
-- (Database.fetch(read_committed=True)), whatever the server's default isolation.
BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL search_path TO {};

-- name: transaction_isolation_get
-- The isolation of the caller's own transaction (Database.call_on).
SELECT current_setting('transaction_isolation');

-- name: transaction_search_path
-- A tool's own transaction (db/schema.py): pgreserve's schema, for this transaction only.
SET LOCAL search_path TO {};

-- name: transaction_commit
COMMIT;

-- name: transaction_rollback
ROLLBACK;

-- name: transaction_begin_snapshot
-- Every figure read in one snapshot, writing nothing.
BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;
