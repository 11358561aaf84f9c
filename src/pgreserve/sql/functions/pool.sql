-- Take exactly p_qty pool units of one bucket, or none. Units are locked with
-- SKIP LOCKED from p_start, wrapping around, and deleted only when all p_qty
-- are locked. A short take deletes nothing: what it locked stays in the pool,
-- locked until this transaction ends, so a buyer waiting for those units gets
-- them when it does (a take that deleted and re-inserted them would hand the
-- waiter rows it cannot see). With p_keep the units are locked but not
-- deleted even when all are there; their ids come back in `units` for the
-- caller to delete once the whole cart is held. Returns the units locked
-- (without p_keep, `units` is NULL).
CREATE OR REPLACE FUNCTION pool_take_units_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                                   p_start bigint, p_keep boolean DEFAULT false,
                                   OUT locked integer, OUT units bigint[])
LANGUAGE plpgsql AS $$
DECLARE
    v_picked integer;
    v_more integer;
    v_ids bigint[];
BEGIN
    IF NOT p_keep THEN
        -- the usual case in one statement: lock, and delete when all are there
        WITH picked AS MATERIALIZED (
            SELECT unit_id FROM stock_unit
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND unit_id >= p_start
            ORDER BY unit_id
            LIMIT p_qty
            FOR UPDATE SKIP LOCKED
        ), taken AS (
            DELETE FROM stock_unit u USING picked
            WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket
              AND u.unit_id = picked.unit_id AND (SELECT count(*) FROM picked) = p_qty
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM picked), (SELECT count(*) FROM taken)
        INTO v_picked, locked;
        IF locked = p_qty OR v_picked = p_qty OR p_start = 0 THEN
            locked := v_picked;
            RETURN;
        END IF;
        -- wrap around: lock the rest below p_start; with all p_qty locked,
        -- take p_qty of the units this transaction may lock (its own included)
        SELECT count(*) INTO v_more FROM (
            SELECT 1 FROM stock_unit
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND unit_id < p_start
            ORDER BY unit_id
            LIMIT p_qty - v_picked
            FOR UPDATE SKIP LOCKED) s;
        locked := v_picked + v_more;
        IF locked = p_qty THEN
            locked := pool_units_delete_v1(p_tenant, p_bucket, p_qty);
        END IF;
        RETURN;
    END IF;
    -- p_keep: lock only, and say which units
    SELECT coalesce(array_agg(unit_id), '{}') INTO units FROM (
        SELECT unit_id FROM stock_unit
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND unit_id >= p_start
        ORDER BY unit_id
        LIMIT p_qty
        FOR UPDATE SKIP LOCKED) s;
    IF cardinality(units) < p_qty AND p_start > 0 THEN
        SELECT coalesce(array_agg(unit_id), '{}') INTO v_ids FROM (
            SELECT unit_id FROM stock_unit
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND unit_id < p_start
            ORDER BY unit_id
            LIMIT p_qty - cardinality(units)
            FOR UPDATE SKIP LOCKED) s;
        units := units || v_ids;
    END IF;
    locked := cardinality(units);
END $$;

-- Delete up to p_max of a bucket's pool units that this transaction can lock
-- (its own locks included; others' skipped), lowest ids first. Returns how many.
CREATE OR REPLACE FUNCTION pool_units_delete_v1(p_tenant bigint, p_bucket bigint,
                                                p_max bigint)
RETURNS integer LANGUAGE plpgsql AS $$
-- PL/pgSQL, not SQL: its plan is kept for the session (a SQL function's body
-- was planned again at every call, half a millisecond on the hot path).
DECLARE
    v_n integer;
BEGIN
    WITH picked AS (
        SELECT unit_id FROM stock_unit
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        ORDER BY unit_id
        LIMIT p_max
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM stock_unit u USING picked
        WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket
          AND u.unit_id = picked.unit_id
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_n FROM taken;
    RETURN v_n;
END $$;

CREATE OR REPLACE FUNCTION pool_replenish_v1(p_tenant bigint, p_bucket bigint, p_need integer,
                                  p_now timestamptz,
                                  OUT added integer, OUT direct integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_free bigint;
    v_cap integer;
    v_strategy text;
    v_pool bigint;
    v_reclaimed bigint;
    v_safety bigint;
BEGIN
    added := 0;
    direct := 0;
    SELECT free, pool_cap, strategy, safety_stock INTO v_free, v_cap, v_strategy, v_safety
    FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR NO KEY UPDATE;
    IF NOT FOUND OR v_strategy <> 'pool' THEN
        RETURN;
    END IF;
    -- enough for what this refill can place: the direct units and a full pool
    v_reclaimed := bucket_reclaim_expired_v1(p_tenant, p_bucket, p_now,
                                             p_need::bigint + v_cap + greatest(0, v_safety - v_free));
    v_free := v_free + v_reclaimed;
    -- safety stock stays in free: neither taken directly nor put in the pool
    direct := greatest(0, least(v_free - v_safety, p_need));
    SELECT count(*) INTO v_pool FROM stock_unit
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    added := greatest(0, least(v_free - v_safety - direct, v_cap - v_pool));
    IF added > 0 THEN
        INSERT INTO stock_unit (tenant_id, bucket_id)
        SELECT p_tenant, p_bucket FROM generate_series(1, added);
    END IF;
    IF v_reclaimed <> 0 OR added <> 0 OR direct <> 0 THEN
        UPDATE stock_bucket
        SET free = v_free - added - direct, updated_at = p_now,
            pool_lo = coalesce((SELECT min(unit_id) FROM stock_unit
                                WHERE tenant_id = p_tenant AND bucket_id = p_bucket), 0),
            pool_hi = coalesce((SELECT max(unit_id) FROM stock_unit
                                WHERE tenant_id = p_tenant AND bucket_id = p_bucket), 0)
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    END IF;
END $$;

-- Pool buckets below their low-water mark (a share of pool_cap) that have free
-- stock to refill from, most depleted first. For the background replenisher.
CREATE OR REPLACE FUNCTION pool_refill_candidates_v1(p_low_water real, p_limit integer)
RETURNS TABLE (tenant_id bigint, bucket_id bigint, pool bigint, pool_cap integer)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    -- plpgsql, not sql: its body names a column of a later migration (safety_stock).
    -- Free stock beyond safety stock is what a refill may place.
    RETURN QUERY
    SELECT b.tenant_id, b.bucket_id, p.pool, b.pool_cap
    FROM stock_bucket b,
    LATERAL (SELECT count(*) AS pool FROM (
                 SELECT 1 FROM stock_unit u
                 WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id
                 LIMIT b.pool_cap) s) p
    WHERE b.strategy = 'pool' AND b.free > b.safety_stock
      AND p.pool < b.pool_cap * p_low_water
    ORDER BY p.pool::real / b.pool_cap
    LIMIT p_limit;
END $$;

-- Background refill of one bucket; skips it when another transaction holds
-- the bucket (that one is refilling or changing it). Returns units added, or
-- NULL when skipped.
CREATE OR REPLACE FUNCTION pool_refill_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN (pool_replenish_v1(p_tenant, p_bucket, 0, coalesce(p_now, clock_timestamp()))).added;
END $$;
