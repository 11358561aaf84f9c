-- Stock policy per bucket: safety stock and backorders (migration 0009).
--
-- Safety stock is enforced where free is taken (bucket.sql, pool.sql, batch.sql,
-- reservation.sql): every take from free is the conditional write
-- "free - n >= safety_stock" and a refill places only what lies beyond it.
--
-- Backorders: a line whose bucket cannot promise all of it (bucket_take_v1 said
-- short) may take the rest from the bucket's backorder allowance, here.

-- Take p_qty units of one bucket with its backorder allowance, after bucket_take_v1
-- found it short: the pool units this transaction can lock (its own included),
-- free beyond the safety stock (expired holds given up first), and the rest from
-- the allowance while backorder_held + backorder_owed + rest <= backorder_limit,
-- decided under the bucket row's lock. A pool bucket's row is taken with SKIP
-- LOCKED (never wait for the bucket while holding its units): when another
-- transaction has it, 40001 and the request is retried whole.
-- ok: taken; backordered: the units from the allowance; from_free: units taken out
-- of free (to give back if the cart fails, with the allowance); units: with p_keep,
-- the pool units locked for the caller to delete once the cart is held (without
-- p_keep they are deleted here). Otherwise seen_available is what the bucket could
-- serve at that instant: promisable units plus the allowance left. A bucket without
-- an allowance answers at once (ok false, seen_available NULL: the caller keeps
-- bucket_take_v1's figure).
CREATE OR REPLACE FUNCTION bucket_backorder_take_v1(p_tenant bigint, p_bucket bigint,
                                                    p_qty integer, p_now timestamptz,
                                                    p_keep boolean DEFAULT false,
                                                    OUT ok boolean, OUT backordered integer,
                                                    OUT from_free integer, OUT units bigint[],
                                                    OUT seen_available bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_limit bigint;
    v_strategy text;
    v_take record;
    v_locked integer := 0;
    b stock_bucket;
    v_pool bigint;
    v_cut timestamptz;
BEGIN
    ok := false;
    backordered := 0;
    from_free := 0;
    SELECT backorder_limit, strategy INTO v_limit, v_strategy
    FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    IF NOT FOUND OR v_limit = 0 THEN
        RETURN;
    END IF;
    IF v_strategy = 'pool' THEN
        -- lock (not delete) what the pool lets this transaction have
        v_take := pool_take_units_v1(p_tenant, p_bucket, p_qty, 0, true);
        v_locked := v_take.locked;
        SELECT * INTO b FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'bucket % is being refilled or changed: retry', p_bucket
                USING ERRCODE = 'serialization_failure';
        END IF;
    ELSE
        SELECT * INTO b FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        FOR NO KEY UPDATE;
    END IF;
    IF b.strategy <> v_strategy THEN
        RAISE EXCEPTION 'the strategy of bucket % changed: retry', p_bucket
            USING ERRCODE = 'serialization_failure';
    END IF;
    -- expired holds count as promisable: give them up first (enough to refill the
    -- safety stock too), then read the line again: a give-up that returned no unit
    -- on hand (a hold all backordered) still gave its allowance back
    v_cut := coalesce(p_now, clock_timestamp());
    PERFORM bucket_reclaim_expired_v1(p_tenant, p_bucket, v_cut,
                                      p_qty::bigint + b.safety_stock);
    SELECT * INTO b FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    from_free := least(p_qty - v_locked, greatest(0, b.free - b.safety_stock));
    backordered := p_qty - v_locked - from_free;
    -- (stock that came in since bucket_take_v1 looked may cover it all: then no
    -- allowance is needed, even where a lowered limit leaves none)
    IF backordered = 0
       OR b.backorder_held + b.backorder_owed + backordered <= b.backorder_limit THEN
        UPDATE stock_bucket
        SET free = free - from_free, backorder_held = backorder_held + backordered
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        IF v_locked > 0 THEN
            IF p_keep THEN
                units := v_take.units;
            ELSE
                DELETE FROM stock_unit
                WHERE tenant_id = p_tenant AND bucket_id = p_bucket
                  AND unit_id = ANY (v_take.units);
            END IF;
        END IF;
        ok := true;
        RETURN;
    END IF;
    -- Short even with the allowance. Units other transactions hold in the pool
    -- may still come back: then this is not decided here.
    SELECT count(*) INTO v_pool FROM (SELECT 1 FROM stock_unit
                                      WHERE tenant_id = p_tenant AND bucket_id = p_bucket
                                      LIMIT p_qty) s;
    IF v_pool > v_locked THEN
        RAISE EXCEPTION 'bucket % is short of units other buyers hold: retry', p_bucket
            USING ERRCODE = 'serialization_failure';
    END IF;
    -- Nor while expired holds are still held: the reclaim skipped them, locked by
    -- the transaction giving them up (a release, the sweeper), whose units (or
    -- allowance) come back when it commits.
    IF EXISTS (SELECT 1 FROM reservation_line l
               WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                 AND l.held AND l.expires_at <= v_cut) THEN
        RAISE EXCEPTION 'expired holds of bucket % are being given up: retry', p_bucket
            USING ERRCODE = 'serialization_failure';
    END IF;
    from_free := 0;
    backordered := 0;
    seen_available := v_locked + greatest(0, b.free - b.safety_stock)
                      + greatest(0, b.backorder_limit - b.backorder_held - b.backorder_owed);
END $$;

-- Give back the allowance of backordered units of lines no longer held (release,
-- expiry), once per line: the callers do it when the line's held flag goes false.
CREATE OR REPLACE FUNCTION bucket_backorder_give_back_v1(p_tenant bigint, p_bucket bigint,
                                                         p_qty bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_qty > 0 THEN
        UPDATE stock_bucket SET backorder_held = backorder_held - p_qty
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    END IF;
END $$;
