-- Group commit: one bucket's queued requests in one call (core/batching.py).

-- name: bucket_batch
SELECT bucket_batch_v1(%s, %s, %s::text[], %s::text[], %s::text[], %s::integer[],
                       %s::interval[], %s::uuid[], %s, %s::text[], %s::jsonb[]);

-- name: bucket_batch_keyed
-- The same with each request's API key hash (NULL: checked before), checked in the batch.
SELECT bucket_batch_keyed_v1(%s::bytea[], %s, %s, %s::text[], %s::text[], %s::text[],
                             %s::integer[], %s::interval[], %s::uuid[], %s, %s::text[],
                             %s::jsonb[]);

-- name: bucket_id_find
SELECT bucket_id FROM stock_bucket WHERE tenant_id = %s AND sku = %s AND location = %s;

-- name: reservation_line_buckets
SELECT bucket_id FROM reservation_line WHERE tenant_id = %s AND reservation_id = %s;
