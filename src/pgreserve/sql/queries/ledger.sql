-- The request ledger (core/service.py).

-- name: request_key_purge
SELECT request_keys_purge_v1(%s, %s, %s);

-- name: request_view
-- GET /v1/requests/{key}: the stored answer under a key and, when it names a
-- reservation, that reservation as it is now.
SELECT l.operation, l.status, l.outcome, l.created_at,
       CASE WHEN l.outcome -> 'reservation' ->> 'id' IS NOT NULL
            THEN reservation_view_v1(l.tenant_id, (l.outcome -> 'reservation' ->> 'id')::uuid,
                                     coalesce(%s, clock_timestamp())) END
FROM request_ledger l
WHERE l.tenant_id = %s AND l.request_key = %s;
