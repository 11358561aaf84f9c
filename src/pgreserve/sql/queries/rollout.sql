-- The rollout beside a legacy Redis hold store (rollout/).

-- name: rollout_mode_get
-- A tenant's mode and until when holds taken while Redis was written may be alive.
SELECT mode, redis_until FROM rollout_mode WHERE tenant_id = %s;

-- name: rollout_mode_set
-- Switch a tenant's mode; record who and when. Leaving the Redis-writing modes
-- for 'pgreserve' keeps redis_until a maximum hold life (24 h) ahead. `prior` reads
-- the mode as the statement's snapshot has it, before the upsert (a locking read
-- there would skip the row the upsert updates in the same statement, and report
-- every switch of an existing tenant as from 'pgreserve').
WITH prior AS (
    SELECT mode FROM rollout_mode WHERE tenant_id = %(tenant)s
), upsert AS (
    INSERT INTO rollout_mode AS m (tenant_id, mode, redis_until, changed_at, changed_by)
    VALUES (%(tenant)s, %(mode)s,
            CASE WHEN %(mode)s = 'pgreserve' THEN now() + interval '24 hours' END,
            now(), %(by)s)
    ON CONFLICT (tenant_id) DO UPDATE
       SET mode = EXCLUDED.mode,
           redis_until = CASE WHEN EXCLUDED.mode <> 'pgreserve' THEN NULL
                              WHEN m.mode = 'pgreserve' THEN m.redis_until
                              ELSE now() + interval '24 hours' END,
           -- set again to the mode it has, a tenant keeps the instant it entered it
           -- (what the writes Redis missed in primary are counted from)
           changed_at = CASE WHEN m.mode = EXCLUDED.mode THEN m.changed_at ELSE now() END,
           changed_by = CASE WHEN m.mode = EXCLUDED.mode THEN m.changed_by
                             ELSE EXCLUDED.changed_by END
    RETURNING mode, changed_at
), change AS (
    INSERT INTO rollout_mode_change (tenant_id, from_mode, to_mode, changed_by)
    SELECT %(tenant)s, coalesce((SELECT mode FROM prior), 'pgreserve'), %(mode)s, %(by)s
)
SELECT coalesce((SELECT mode FROM prior), 'pgreserve') FROM upsert;

-- name: rollout_redis_miss_list
-- Writes Redis missed (it did not answer, or had no record of the hold: lost with its
-- data) since the tenant last entered 'primary', as
-- the comparison recorded them: how many, the first one's time and request key.
SELECT count(*), min(c.at), (array_agg(c.request_key ORDER BY c.at))[1]
FROM rollout_mode m
JOIN rollout_comparison c ON c.tenant_id = m.tenant_id AND c.mode = 'primary'
                         AND c.at >= m.changed_at
WHERE m.tenant_id = %s AND m.mode = 'primary'
  AND c.legacy_outcome ->> 'error' IN ('outcome_unknown', 'missing_in_redis');

-- name: rollout_pgreserve_since_redis
-- When the tenant last entered 'pgreserve' from another mode after its last switch to
-- a mode where Redis answers (NULL: not since): Redis missed every write from then on.
SELECT max(c.changed_at)
FROM rollout_mode_change c
WHERE c.tenant_id = %(tenant)s AND c.to_mode = 'pgreserve' AND c.from_mode <> 'pgreserve'
  AND c.change_id > coalesce((SELECT max(r.change_id) FROM rollout_mode_change r
                              WHERE r.tenant_id = %(tenant)s
                                AND r.to_mode IN ('legacy', 'shadow')), 0);

-- name: rollout_status_list
-- Every tenant with its mode (a tenant without a row is in 'pgreserve').
SELECT t.tenant_id, t.name, coalesce(m.mode, 'pgreserve'), m.changed_at, m.changed_by
FROM tenant t LEFT JOIN rollout_mode m USING (tenant_id)
ORDER BY t.tenant_id;

-- name: rollout_redis_tenant_list
-- The tenants whose legacy holds may still be alive (the legacy expiry sweep).
SELECT tenant_id FROM rollout_mode
WHERE mode <> 'pgreserve' OR redis_until > now()
ORDER BY tenant_id;

-- name: rollout_comparison_record
-- A batch of comparisons (arrays of equal length) and their requests per day.
WITH rows AS (
    SELECT * FROM unnest(%s::bigint[], %s::timestamptz[], %s::text[], %s::text[], %s::text[],
                         %s::boolean[], %s::text[], %s::text[], %s::float8[], %s::float8[])
           AS r(tenant_id, at, mode, operation, request_key, agree, legacy_outcome,
                pgreserve_outcome, legacy_ms, pgreserve_ms)
), saved AS (
    INSERT INTO rollout_comparison (tenant_id, at, mode, operation, request_key, agree,
                                    legacy_outcome, pgreserve_outcome, legacy_ms, pgreserve_ms)
    SELECT tenant_id, at, mode, operation, request_key, agree, legacy_outcome::jsonb,
           pgreserve_outcome::jsonb, legacy_ms, pgreserve_ms FROM rows
    RETURNING 1
)
SELECT count(*) FROM saved;

-- name: rollout_traffic_add
-- Requests seen per tenant today (arrays of equal length, tenants sorted).
WITH saved AS (
    INSERT INTO rollout_traffic AS t (tenant_id, day, requests)
    SELECT tenant_id, current_date, n FROM unnest(%s::bigint[], %s::bigint[]) AS r(tenant_id, n)
    ON CONFLICT (tenant_id, day) DO UPDATE SET requests = t.requests + EXCLUDED.requests
    RETURNING 1
)
SELECT count(*) FROM saved;

-- name: rollout_report_summary
-- Per tenant (or one): comparisons, agreements, latency p50 / p99 per side (ms).
SELECT c.tenant_id, t.name, count(*), count(*) FILTER (WHERE c.agree),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY c.legacy_ms),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY c.legacy_ms),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY c.pgreserve_ms),
       percentile_cont(0.99) WITHIN GROUP (ORDER BY c.pgreserve_ms),
       count(*) FILTER (WHERE c.legacy_outcome ? 'error' OR c.pgreserve_outcome ? 'error')
FROM rollout_comparison c JOIN tenant t USING (tenant_id)
WHERE (%(tenant)s::bigint IS NULL OR c.tenant_id = %(tenant)s)
GROUP BY c.tenant_id, t.name
ORDER BY c.tenant_id;

-- name: rollout_report_disagreements
-- The latest disagreements, newest first.
SELECT c.tenant_id, t.name, c.at, c.mode, c.operation, c.request_key, c.legacy_outcome,
       c.pgreserve_outcome, c.legacy_ms, c.pgreserve_ms
FROM rollout_comparison c JOIN tenant t USING (tenant_id)
WHERE NOT c.agree AND (%(tenant)s::bigint IS NULL OR c.tenant_id = %(tenant)s)
ORDER BY c.at DESC, c.comparison_id DESC
LIMIT %(limit)s;

-- name: rollout_plan_list
-- Tenants from the smallest traffic (the last 7 days) to the largest, with mode
-- and agreement ratio.
SELECT t.tenant_id, t.name, coalesce(m.mode, 'pgreserve'),
       greatest(coalesce(tr.requests, 0), coalesce(r.reservations, 0)) AS traffic,
       c.compared, c.agreed
FROM tenant t
LEFT JOIN rollout_mode m USING (tenant_id)
LEFT JOIN LATERAL (SELECT sum(requests)::bigint AS requests FROM rollout_traffic x
                   WHERE x.tenant_id = t.tenant_id AND x.day > current_date - 7) tr ON true
LEFT JOIN LATERAL (SELECT count(*) AS reservations FROM reservation x
                   WHERE x.tenant_id = t.tenant_id
                     AND x.created_at > now() - interval '7 days') r ON true
LEFT JOIN LATERAL (SELECT count(*) AS compared, count(*) FILTER (WHERE agree) AS agreed
                   FROM rollout_comparison x WHERE x.tenant_id = t.tenant_id) c ON true
ORDER BY traffic, t.tenant_id;

-- name: rollout_legacy_sale_record
-- The legacy design's ledger write of a claimed hold's lines (arrays of equal length),
-- and, for a sale of units pgreserve did not sell itself (`uncounted`: a hold it has
-- no twin of, or a shadow hold whose twin it could not claim), the units leaving
-- pgreserve's count of each line it has: a forced correction (units pgreserve
-- promised meanwhile become shortfall), once per sale line (`counted`), under a key
-- made of the sale's id and the line (length-prefixed, so no two lines share one).
WITH lines AS (
    SELECT sku, location, quantity
    FROM unnest(%(skus)s::text[], %(locations)s::text[], %(quantities)s::int[])
         AS r(sku, location, quantity)
), saved AS (
    INSERT INTO rollout_legacy_sale (tenant_id, reservation_id, sku, location, quantity,
                                     counted)
    SELECT %(tenant)s, %(reservation)s, sku, location, quantity, %(uncounted)s FROM lines
    ON CONFLICT DO NOTHING
    RETURNING sku, location, quantity, counted
), marked AS (
    -- a sale recorded before, not counted yet (its twin's claim failed since)
    UPDATE rollout_legacy_sale s SET counted = true
    FROM lines l
    WHERE %(uncounted)s AND s.tenant_id = %(tenant)s AND s.reservation_id = %(reservation)s
      AND s.sku = l.sku AND s.location = l.location AND NOT s.counted
    RETURNING s.sku, s.location, s.quantity
), sold AS (
    SELECT sku, location, quantity FROM saved WHERE counted
    UNION ALL
    SELECT sku, location, quantity FROM marked
), counted AS (
    SELECT stock_adjust_v2(%(tenant)s,
                           'legacy-sale:' || %(reservation)s::text || ':'
                               || md5(length(s.sku)::text || ':' || s.sku || s.location),
                           'legacy-sale', s.sku, s.location, -s.quantity, 'legacy sale',
                           true, NULL, NULL)
    FROM sold s
    JOIN stock_bucket b ON b.tenant_id = %(tenant)s AND b.sku = s.sku
                       AND b.location = s.location
    ORDER BY s.sku COLLATE "C", s.location COLLATE "C"
)
SELECT (SELECT count(*) FROM saved), (SELECT count(*) FROM counted);

-- name: rollout_refusal_record
-- Primary mode: the legacy store's refusal of a cart pgreserve held is the key's
-- answer (ledger.sql: the hold goes back, the refusal is stored under the key).
SELECT ledger_refusal_record_v1(%s, %s, %s, %s::jsonb);

-- name: rollout_hold_told
-- Primary mode: the hold told while the legacy store did not answer stays the key's
-- answer (ledger.sql).
SELECT ledger_hold_told_v1(%s, %s, %s);

-- name: rollout_mode_at_request
-- The tenant's mode when the answer under a request key was stored: its latest
-- switch at or before then ('pgreserve' when none, as for a tenant never set); no
-- row when pgreserve keeps no answer under the key.
SELECT coalesce((SELECT c.to_mode FROM rollout_mode_change c
                 WHERE c.tenant_id = l.tenant_id AND c.changed_at <= l.created_at
                 ORDER BY c.changed_at DESC, c.change_id DESC LIMIT 1), 'pgreserve')
FROM request_ledger l
WHERE l.tenant_id = %s AND l.request_key = %s;
