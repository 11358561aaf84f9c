-- Freezes of tenants and buckets (core/service.py, ops/controls.py, the CLI).

-- name: freeze_set
SELECT freeze_set_v1(%s, %s, %s, %s);

-- name: freeze_lift
SELECT freeze_lift_v1(%s, %s, %s, %s);

-- name: freeze_live_list
-- The live freezes, of one tenant or all (%s NULL), oldest first.
SELECT freeze_doc_v1(f.tenant_id, f.freeze_id) FROM stock_freeze f
WHERE f.lifted_at IS NULL AND (%s::bigint IS NULL OR f.tenant_id = %s::bigint)
ORDER BY f.frozen_at, f.tenant_id, f.freeze_id;
