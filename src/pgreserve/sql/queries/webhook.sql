-- Webhook endpoints (core/service.py) and their deliverer (workers/webhooks.py).

-- name: webhook_register
SELECT webhook_register_v1(%s, %s, %s);

-- name: webhook_list
SELECT e.endpoint_id, e.url, e.created_at, d.delivered, d.attempts, d.last_error,
       d.last_attempt_at, d.last_success_at, d.next_attempt_at
  FROM webhook_endpoint e JOIN webhook_delivery d USING (tenant_id, endpoint_id)
 WHERE e.tenant_id = %s ORDER BY e.endpoint_id;

-- name: webhook_delete
WITH d AS (DELETE FROM webhook_endpoint WHERE tenant_id = %s AND endpoint_id = %s
 RETURNING 1) SELECT count(*) FROM d;

-- name: webhook_lease
-- Due endpoints, claimed with SKIP LOCKED and leased for the given interval, at most
-- a share of the worker's slots per tenant (webhook.sql).
SELECT webhook_claim_v2(%s, %s, %s, %s::bigint[], %s::integer[]);

-- name: webhook_release
SELECT webhook_release_v1(%s, %s, %s, %s);

-- name: webhook_fail
SELECT webhook_fail_v1(%s, %s, %s, %s, %s, %s);

-- name: webhook_advance
-- The endpoint's cursor moves past one acknowledged event; false when the lease is lost.
SELECT webhook_advance_v1(%s, %s, %s, %s, %s, %s);
