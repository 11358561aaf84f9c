-- `pgreserve reconcile` (ops/reconcile.py): every figure of the books, read in one
-- snapshot (transaction_begin_snapshot), and the one repair it may make.

-- name: bucket_book_list
SELECT b.tenant_id, b.bucket_id, b.sku, b.location, b.strategy, b.on_hand, b.free, b.shortfall,
       (SELECT count(*) FROM stock_unit u
         WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) AS pool,
       (SELECT coalesce(sum(l.quantity), 0) FROM reservation_line l
         WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held) AS held,
       (SELECT coalesce(sum(l.quantity), 0) FROM reservation_line l
         JOIN reservation r USING (tenant_id, reservation_id)
         WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held
           AND r.status = 'active' AND r.expires_at > clock_timestamp()) AS active_held,
       (SELECT coalesce(-sum(m.quantity), 0) FROM stock_movement m
         WHERE m.tenant_id = b.tenant_id AND m.bucket_id = b.bucket_id
           AND m.kind = 'sale') AS claimed,
       (SELECT coalesce(sum(m.quantity), 0) FROM stock_movement m
         WHERE m.tenant_id = b.tenant_id AND m.bucket_id = b.bucket_id
           AND m.kind = 'restore') AS restored,
       (SELECT coalesce(sum(m.quantity), 0) FROM stock_movement m
         WHERE m.tenant_id = b.tenant_id AND m.bucket_id = b.bucket_id
           AND m.kind IN ('count', 'adjust', 'sale')) AS ledger_on_hand,
       b.safety_stock, b.backorder_held, b.backorder_owed,
       (SELECT coalesce(sum(l.backordered), 0) FROM reservation_line l
         WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held)
         AS held_backordered,
       -- invariant_violations_v1's `reserved`: held lines not yet past their expiry
       (SELECT coalesce(sum(l.quantity), 0) FROM reservation_line l
         WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held
           AND l.expires_at > clock_timestamp()) AS reserved
FROM stock_bucket b
WHERE %(tenant)s::bigint IS NULL OR b.tenant_id = %(tenant)s::bigint
ORDER BY b.tenant_id, b.sku, b.location;

-- name: hold_orphan_list
-- Held lines whose reservation row is missing, or whose bucket is.
SELECT l.tenant_id, l.reservation_id::text, l.line_no, l.bucket_id, l.quantity,
       r.reservation_id IS NULL AS no_reservation, b.bucket_id IS NULL AS no_bucket
FROM reservation_line l
LEFT JOIN reservation r USING (tenant_id, reservation_id)
LEFT JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
WHERE l.held AND (r.reservation_id IS NULL OR b.bucket_id IS NULL)
  AND (%(tenant)s::bigint IS NULL OR l.tenant_id = %(tenant)s::bigint);

-- name: hold_finished_list
-- A finished reservation (released, claimed, expired) whose line still holds units.
SELECT l.tenant_id, l.reservation_id::text, l.line_no, l.bucket_id, l.quantity, r.status
FROM reservation_line l JOIN reservation r USING (tenant_id, reservation_id)
WHERE l.held AND r.status <> 'active'
  AND (%(tenant)s::bigint IS NULL OR l.tenant_id = %(tenant)s::bigint);

-- name: restore_count_list
-- Lines whose restore records break the rule of invariant_violations_v1 (restore_count):
-- a line given up without a claim has exactly one, a held line none, a claimed line at
-- most one (claimed after its expiry had given the line up).
SELECT l.tenant_id, l.reservation_id::text, l.line_no, l.bucket_id, r.status, l.held, m.n
FROM reservation_line l
JOIN reservation r USING (tenant_id, reservation_id)
JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
CROSS JOIN LATERAL (
    SELECT count(*) AS n FROM stock_movement m
    WHERE m.tenant_id = l.tenant_id AND m.reservation_id = l.reservation_id
      AND m.line_no = l.line_no AND m.kind = 'restore') m
WHERE (%(tenant)s::bigint IS NULL OR l.tenant_id = %(tenant)s::bigint)
  AND CASE WHEN l.held THEN m.n <> 0
           WHEN r.status = 'claimed' THEN m.n > 1
           ELSE m.n <> 1 END
ORDER BY l.tenant_id, l.bucket_id, l.reservation_id, l.line_no;

-- name: reconcile_overdue_cut
-- The check's instant less the grace: a hold that expired by then is overdue.
SELECT clock_timestamp() - %(grace)s * interval '1 second';

-- name: reservation_overdue_list
-- Active past expiry for longer than the grace (the sweeper runs every second).
SELECT tenant_id, reservation_id::text, expires_at
FROM reservation
WHERE status = 'active' AND expires_at <= %(cut)s
  AND (%(tenant)s::bigint IS NULL OR tenant_id = %(tenant)s::bigint)
ORDER BY expires_at;

-- name: reservation_expire_overdue
-- The repair: the sweeper's own function, one batch of 500, on the database clock, of
-- the reservations the check listed (one tenant's, or all; overdue at the check's
-- cut, so none that became overdue since) only.
SELECT expire_due_v2(500, NULL, %(tenant)s::bigint, %(cut)s);
