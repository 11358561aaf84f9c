-- The answer of a write whose precondition (If-Match / If-None-Match) did not hold: the
-- line's current version (NULL: no such line). Nothing was written.
CREATE OR REPLACE FUNCTION stock_precondition_failed_v1(p_tenant bigint, p_sku text,
                                                        p_location text)
RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN jsonb_build_object('precondition_failed', true, 'version',
        (SELECT version FROM stock_bucket
         WHERE tenant_id = p_tenant AND sku = p_sku AND location = p_location));
END $$;

-- Set a bucket's count (physical units not yet sold), creating it if needed, and
-- optionally switch its strategy; every such write moves the line's version.
-- Preconditions, checked by the write itself: p_if_match (a list of versions; the
-- conditional UPDATE of the version finds the row only when one matches), p_exists
-- true (the line must exist: no insert) or false (create only: the INSERT must not
-- conflict). A failed precondition returns stock_precondition_failed_v1 and leaves
-- no write behind (the lock-and-drain runs in a block that is rolled back).
-- p_safety, p_backorder: the bucket's safety stock and backorder limit (policy.sql;
-- NULL keeps them, a new line starts at 0). They are written under the same
-- exclusive lock as the count, so the pool is drained and refilled without the
-- units a raised safety stock keeps back.
CREATE OR REPLACE FUNCTION stock_set_v3(p_tenant bigint, p_sku text, p_location text,
                                        p_on_hand bigint, p_strategy text, p_force boolean,
                                        p_pool_cap integer, p_if_match bigint[],
                                        p_exists boolean, p_safety bigint,
                                        p_backorder bigint, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_bucket bigint;
    v_created boolean := false;
    v_lock record;
    v_before bigint;
    v_view jsonb;
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    IF p_if_match IS NULL AND p_exists IS NOT TRUE THEN
        -- a new line carries its SKU's per-cart limit (sku.sql: created under the SKU's
        -- lock, so a limit being set is not missed)
        IF NOT EXISTS (SELECT 1 FROM stock_bucket
                       WHERE tenant_id = p_tenant AND sku = p_sku AND location = p_location) THEN
            PERFORM sku_lock_v1(p_tenant, p_sku);
        END IF;
        INSERT INTO stock_bucket (tenant_id, sku, location, on_hand, free, strategy, pool_cap,
                                  cart_limit, safety_stock, backorder_limit)
        VALUES (p_tenant, p_sku, p_location, p_on_hand, p_on_hand, coalesce(p_strategy, 'row'),
                coalesce(p_pool_cap, 1000),
                (SELECT s.cart_limit FROM sku_setting s
                 WHERE s.tenant_id = p_tenant AND s.sku = p_sku),
                coalesce(p_safety, 0), coalesce(p_backorder, 0))
        ON CONFLICT (tenant_id, sku, location) DO NOTHING
        RETURNING bucket_id INTO v_bucket;
        v_created := v_bucket IS NOT NULL;
        IF NOT v_created AND p_exists IS FALSE THEN
            RETURN stock_precondition_failed_v1(p_tenant, p_sku, p_location);
        END IF;
    END IF;
    IF v_created THEN
        v_before := 0;
        PERFORM pool_replenish_v1(p_tenant, v_bucket, 0, v_now);
    ELSE
        SELECT bucket_id INTO v_bucket FROM stock_bucket
        WHERE tenant_id = p_tenant AND sku = p_sku AND location = p_location;
        IF NOT FOUND THEN
            RETURN stock_precondition_failed_v1(p_tenant, p_sku, p_location);
        END IF;
        BEGIN
            v_lock := bucket_lock_exclusive_v1(p_tenant, v_bucket);
            -- after its waits (held lines, in-flight takes): holds past their expiry
            -- by now are given up, not counted against the new figure
            v_now := coalesce(p_now, clock_timestamp());
            UPDATE stock_bucket
            SET strategy = coalesce(p_strategy, strategy),
                pool_cap = coalesce(p_pool_cap, pool_cap),
                safety_stock = coalesce(p_safety, safety_stock),
                backorder_limit = coalesce(p_backorder, backorder_limit),
                version = version + 1
            WHERE tenant_id = p_tenant AND bucket_id = v_bucket
              AND (p_if_match IS NULL OR version = ANY (p_if_match));
            IF NOT FOUND THEN
                RAISE EXCEPTION 'stock line version does not match' USING ERRCODE = 'PR428';
            END IF;
        EXCEPTION WHEN SQLSTATE 'PR428' THEN
            RETURN stock_precondition_failed_v1(p_tenant, p_sku, p_location);
        END;
        v_before := (v_lock.o_bucket).on_hand - (v_lock.o_bucket).shortfall;
        PERFORM bucket_apply_on_hand_v1(p_tenant, v_bucket, v_lock.o_held, p_on_hand, p_force,
                                        v_now);
    END IF;
    IF p_on_hand <> v_before THEN
        INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reason)
        VALUES (p_tenant, v_bucket, 'count', p_on_hand - v_before, 'set');
    END IF;
    v_view := bucket_view_v1(p_tenant, v_bucket, v_now);
    INSERT INTO outbox_event (tenant_id, type, payload)
    VALUES (p_tenant, 'stock.changed', v_view || jsonb_build_object('change', 'set'));
    RETURN v_view || jsonb_build_object('created', v_created);
END $$;

-- (kept for processes of the previous release during an upgrade: no stock policy)
CREATE OR REPLACE FUNCTION stock_set_v2(p_tenant bigint, p_sku text, p_location text,
                                        p_on_hand bigint, p_strategy text, p_force boolean,
                                        p_pool_cap integer, p_if_match bigint[],
                                        p_exists boolean, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    RETURN stock_set_v3(p_tenant, p_sku, p_location, p_on_hand, p_strategy, p_force,
                        p_pool_cap, p_if_match, p_exists, NULL, NULL, p_now);
END $$;

-- The unconditional form (kept for callers of the first signature).
CREATE OR REPLACE FUNCTION stock_set_v1(p_tenant bigint, p_sku text, p_location text, p_on_hand bigint,
                             p_strategy text DEFAULT NULL, p_force boolean DEFAULT false,
                             p_pool_cap integer DEFAULT NULL,
                             p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE sql AS $$
    SELECT stock_set_v2(p_tenant, p_sku, p_location, p_on_hand, p_strategy, p_force,
                        p_pool_cap, NULL, NULL, p_now)
$$;

-- Receipt (delta > 0) or correction (delta < 0) of on_hand, idempotent by key; it
-- moves the line's version. p_if_match: a list of versions, one of which the line must
-- have, checked by the write of the version (a replay of the key is answered first, as
-- stored, whatever the version is now). A failed precondition stores nothing.
CREATE OR REPLACE FUNCTION stock_adjust_v2(p_tenant bigint, p_key text, p_digest text, p_sku text,
                                p_location text, p_delta bigint, p_reason text,
                                p_force boolean, p_if_match bigint[],
                                p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_replay jsonb;
    v_bucket bigint;
    v_lock record;
    v_view jsonb;
    v_outcome jsonb;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, p_tenant));
    v_replay := ledger_check_v1(p_tenant, p_key, 'adjust', p_digest);
    IF v_replay IS NOT NULL THEN
        RETURN v_replay;
    END IF;
    SELECT bucket_id INTO v_bucket FROM stock_bucket
    WHERE tenant_id = p_tenant AND sku = p_sku AND location = p_location;
    IF NOT FOUND THEN
        PERFORM tenant_require_v1(p_tenant);
        RAISE EXCEPTION 'unknown stock' USING ERRCODE = 'PR404',
            DETAIL = jsonb_build_array(jsonb_build_object('sku', p_sku,
                                                          'location', p_location))::text;
    END IF;
    IF p_delta >= 0 THEN
        -- A receipt pays back any shortfall first, then the backordered units
        -- claimed and owed (they leave with the buyers they were sold to), then
        -- becomes free stock.
        -- on_hand stays within the bound every input is checked against
        -- (2^53, exact in JSON numbers), so every sum stays representable.
        UPDATE stock_bucket
        SET on_hand = on_hand + p_delta - least(shortfall, p_delta)
                      - least(backorder_owed, p_delta - least(shortfall, p_delta)),
            free = free + p_delta - least(shortfall, p_delta)
                   - least(backorder_owed, p_delta - least(shortfall, p_delta)),
            backorder_owed = backorder_owed
                             - least(backorder_owed, p_delta - least(shortfall, p_delta)),
            shortfall = shortfall - least(shortfall, p_delta),
            version = version + 1,
            updated_at = v_now
        WHERE tenant_id = p_tenant AND bucket_id = v_bucket
          AND on_hand + p_delta - least(shortfall, p_delta) <= 9007199254740992
          AND (p_if_match IS NULL OR version = ANY (p_if_match));
        IF NOT FOUND THEN
            -- which condition failed (either way nothing was written)
            IF p_if_match IS NOT NULL AND NOT EXISTS (
                    SELECT 1 FROM stock_bucket
                    WHERE tenant_id = p_tenant AND bucket_id = v_bucket
                      AND version = ANY (p_if_match)) THEN
                RETURN stock_precondition_failed_v1(p_tenant, p_sku, p_location);
            END IF;
            RAISE EXCEPTION 'on_hand would exceed the maximum of 9007199254740992 units'
                USING ERRCODE = 'PR400';
        END IF;
    ELSE
        BEGIN
            v_lock := bucket_lock_exclusive_v1(p_tenant, v_bucket);
            -- after its waits (held lines, in-flight takes): holds past their expiry
            -- by now are given up, not counted against the new figure
            v_now := coalesce(p_now, clock_timestamp());
            UPDATE stock_bucket SET version = version + 1
            WHERE tenant_id = p_tenant AND bucket_id = v_bucket
              AND (p_if_match IS NULL OR version = ANY (p_if_match));
            IF NOT FOUND THEN
                RAISE EXCEPTION 'stock line version does not match' USING ERRCODE = 'PR428';
            END IF;
        EXCEPTION WHEN SQLSTATE 'PR428' THEN
            RETURN stock_precondition_failed_v1(p_tenant, p_sku, p_location);
        END;
        PERFORM bucket_apply_on_hand_v1(
            p_tenant, v_bucket, v_lock.o_held,
            (v_lock.o_bucket).on_hand - (v_lock.o_bucket).shortfall + p_delta, p_force, v_now);
    END IF;
    INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, request_key, reason)
    VALUES (p_tenant, v_bucket, 'adjust', p_delta, p_key, p_reason);
    v_view := bucket_view_v1(p_tenant, v_bucket, v_now);
    v_outcome := jsonb_build_object('status', 'applied', 'stock', v_view);
    PERFORM ledger_record_v1(p_tenant, p_key, 'adjust', p_digest, 'succeeded', v_outcome);
    INSERT INTO outbox_event (tenant_id, type, payload)
    VALUES (p_tenant, 'stock.changed',
            v_view || jsonb_build_object('change', 'adjust', 'delta', p_delta,
                                         'reason', p_reason));
    RETURN v_outcome;
END $$;

-- The unconditional form (kept for callers of the first signature).
CREATE OR REPLACE FUNCTION stock_adjust_v1(p_tenant bigint, p_key text, p_digest text, p_sku text,
                                p_location text, p_delta bigint, p_reason text,
                                p_force boolean DEFAULT false,
                                p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE sql AS $$
    SELECT stock_adjust_v2(p_tenant, p_key, p_digest, p_sku, p_location, p_delta, p_reason,
                           p_force, NULL, p_now)
$$;

-- Every accounting rule the design promises, per bucket; one row per breach.
CREATE OR REPLACE FUNCTION invariant_violations_v1(p_tenant bigint DEFAULT NULL,
                                        p_now timestamptz DEFAULT NULL)
RETURNS TABLE (tenant_id bigint, sku text, location text, rule text, detail text)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
BEGIN
    -- plpgsql, not sql: its body names columns of a later migration (0009), which a
    -- sql function would check when created, before that migration ran.
    RETURN QUERY
    WITH now_ AS (SELECT coalesce(p_now, clock_timestamp()) AS now),
    figures AS (
        SELECT b.tenant_id, b.bucket_id, b.sku, b.location, b.on_hand, b.free, b.strategy,
               b.shortfall, b.safety_stock, b.backorder_limit, b.backorder_held,
               b.backorder_owed,
               (SELECT coalesce(sum(backordered), 0) FROM reservation_line l
                 WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held)
                   AS held_backordered,
               -- physical units by the movement ledger: counts, adjustments, sales
               (SELECT coalesce(sum(m.quantity), 0) FROM stock_movement m
                 WHERE m.tenant_id = b.tenant_id AND m.bucket_id = b.bucket_id
                   AND m.kind IN ('count', 'adjust', 'sale')) AS booked,
               (SELECT count(*) FROM stock_unit u
                 WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) AS pool,
               (SELECT coalesce(sum(quantity), 0) FROM reservation_line l
                 WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held)
                   AS held,
               (SELECT coalesce(sum(quantity), 0) FROM reservation_line l, now_
                 WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held
                   AND l.expires_at > now_.now) AS reserved
        FROM stock_bucket b
        WHERE p_tenant IS NULL OR b.tenant_id = p_tenant
    )
    -- (0009: held units beyond on_hand are backordered, not on hand)
    SELECT tenant_id, sku, location, 'accounting'::text,
           format('on_hand %s <> free %s + pool %s + held %s - backorder_held %s',
                  on_hand, free, pool, held, backorder_held)
    FROM figures WHERE on_hand <> free + pool + held - backorder_held
    UNION ALL
    SELECT tenant_id, sku, location, 'negative',
           format('on_hand %s free %s reserved %s backorder_held %s available %s',
                  on_hand, free, reserved, backorder_held, on_hand + backorder_held - reserved)
    FROM figures WHERE on_hand < 0 OR free < 0 OR reserved < 0
                    OR on_hand + backorder_held - reserved < 0
    UNION ALL
    -- safety stock never enters the pool: a pool with units means free covers it
    SELECT tenant_id, sku, location, 'safety_in_pool',
           format('pool %s units while free %s < safety_stock %s', pool, free, safety_stock)
    FROM figures WHERE pool > 0 AND free < safety_stock
    UNION ALL
    -- the bucket's count of backordered held units is its held lines' own
    SELECT tenant_id, sku, location, 'backorder',
           format('backorder_held %s <> %s backordered in held lines',
                  backorder_held, held_backordered)
    FROM figures WHERE backorder_held <> held_backordered
    UNION ALL
    SELECT tenant_id, sku, location, 'pool_on_row_bucket', format('%s pool units', pool)
    FROM figures WHERE strategy = 'row' AND pool > 0
    UNION ALL
    -- on_hand less what a forced correction found missing is what the
    -- movements say is there; a path that creates or destroys a unit breaks it
    SELECT tenant_id, sku, location, 'ledger',
           format('on_hand %s - shortfall %s - backorder_owed %s <> %s by the movement ledger',
                  on_hand, shortfall, backorder_owed, booked)
    FROM figures WHERE on_hand - shortfall - backorder_owed <> booked
    UNION ALL
    -- a hold of a finished reservation must not be counted any more
    SELECT l.tenant_id, b.sku, b.location, 'finished_but_held',
           format('reservation %s is %s but line %s is held', r.reservation_id, r.status,
                  l.line_no)
    FROM reservation_line l
    JOIN reservation r USING (tenant_id, reservation_id)
    JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
    WHERE l.held AND r.status <> 'active' AND (p_tenant IS NULL OR l.tenant_id = p_tenant)
    UNION ALL
    -- a line given up without a claim must have exactly one restore record,
    -- a claimed line none
    SELECT l.tenant_id, b.sku, b.location, 'restore_count',
           format('reservation %s line %s (%s) restored %s times', r.reservation_id,
                  l.line_no, r.status, m.n)
    FROM reservation_line l
    JOIN reservation r USING (tenant_id, reservation_id)
    JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
    CROSS JOIN LATERAL (
        SELECT count(*) AS n FROM stock_movement m
        WHERE m.tenant_id = l.tenant_id AND m.reservation_id = l.reservation_id
          AND m.line_no = l.line_no AND m.kind = 'restore') m
    WHERE (p_tenant IS NULL OR l.tenant_id = p_tenant)
      AND CASE WHEN l.held THEN m.n <> 0
               -- claimed after its expiry had given the line up: one restore
               WHEN r.status = 'claimed' THEN m.n > 1
               ELSE m.n <> 1 END;
END $$;
