-- Stock counts, the stock listing and the accounting checks (core/service.py).

-- name: stock_set
-- tenant, sku, location, on_hand, strategy, force, pool_cap, if_match versions, exists,
-- safety stock, backorder limit, now
SELECT stock_set_v3(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s);

-- name: stock_adjust
-- tenant, key, digest, sku, location, delta, reason, force, if_match versions, now
SELECT stock_adjust_v2(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s);

-- name: stock_list
-- One page of a tenant's stock lines after the keyset (sku, location) in byte order
-- (stock_bucket_list_idx; the first page passes ('', '')): an SKU prefix, a list of
-- SKUs and a location narrow it, each NULL for "any".
SELECT bucket_view_v1(b.tenant_id, b.bucket_id, coalesce(%(now)s, clock_timestamp()))
 FROM stock_bucket b
 WHERE b.tenant_id = %(tenant)s
   AND (b.sku COLLATE "C", b.location COLLATE "C") > (%(after_sku)s, %(after_location)s)
   AND (%(prefix)s::text IS NULL OR starts_with(b.sku COLLATE "C", %(prefix)s))
   AND (%(skus)s::text[] IS NULL OR b.sku = ANY (%(skus)s::text[]))
   AND (%(location)s::text IS NULL OR b.location = %(location)s)
 ORDER BY b.sku COLLATE "C", b.location COLLATE "C"
 LIMIT %(limit)s;

-- name: invariant_violation_list
SELECT tenant_id, sku, location, rule, detail
 FROM invariant_violations_v1(%s, %s);
