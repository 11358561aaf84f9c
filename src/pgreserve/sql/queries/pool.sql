-- The background replenisher's refills of pool buckets (core/service.py).

-- name: pool_refill_candidate_list
SELECT tenant_id, bucket_id FROM pool_refill_candidates_v1(%s::real, %s::integer);

-- name: pool_refill
SELECT pool_refill_v1(%s, %s, %s);
