-- Stock counts and the accounting checks (core/service.py).

-- name: stock_set
SELECT stock_set_v1(%s, %s, %s, %s, %s, %s, %s, %s);

-- name: stock_adjust
SELECT stock_adjust_v1(%s, %s, %s, %s, %s, %s, %s, %s, %s);

-- name: invariant_violation_list
SELECT tenant_id, sku, location, rule, detail
 FROM invariant_violations_v1(%s, %s);
