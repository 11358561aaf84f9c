-- The request ledger (core/service.py).

-- name: request_key_purge
SELECT request_keys_purge_v1(%s, %s, %s);
