-- The request ledger (core/service.py).

-- name: request_key_purge
SELECT request_keys_purge_v1(%s, %s, %s);

-- name: request_view
-- GET /v1/requests/{key}: the stored answer under a key and, when it names a
-- reservation, that reservation as it is now (ledger.sql: request_view_v1; a read
-- committed transaction, Database.fetch(read_committed=True)).
SELECT operation, status, outcome, created_at, reservation, in_progress
FROM request_view_v1(%s, %s, %s);
