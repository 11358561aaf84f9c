-- The stock view of one bucket at p_now. Holds past expires_at do not count
-- as reserved, whether or not the sweeper has run; of their units, those a
-- forced correction recorded as missing (shortfall) are not available.
CREATE OR REPLACE FUNCTION bucket_view_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz)
RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
BEGIN
    -- plpgsql, not sql: its body names columns of later migrations (version), which a
    -- sql function would check when created, before those migrations ran.
    -- Reading it touches only the expired part of the held-lines index.
    RETURN (SELECT jsonb_build_object(
        'sku', b.sku, 'location', b.location, 'on_hand', b.on_hand,
        'reserved', b.on_hand + b.backorder_held - (b.free + p.pool + e.expired),
        -- safety stock is never promised, the backorder allowance left may be (policy.sql)
        'available', p.pool + greatest(0, b.free + greatest(0, e.expired - e.backordered
                                                               - b.shortfall)
                                          - b.safety_stock)
                     + greatest(0, b.backorder_limit - (b.backorder_held - e.backordered)
                                   - b.backorder_owed),
        'strategy', b.strategy, 'pool', p.pool, 'pool_cap', b.pool_cap,
        'shortfall', b.shortfall, 'version', b.version,
        'safety_stock', b.safety_stock, 'backorder_limit', b.backorder_limit,
        'backorder_held', b.backorder_held, 'backorder_owed', b.backorder_owed)
    FROM stock_bucket b,
    LATERAL (SELECT coalesce(sum(l.quantity), 0)::bigint AS expired,
                    coalesce(sum(l.backordered), 0)::bigint AS backordered
             FROM reservation_line l
             WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held
               AND l.expires_at <= p_now) e,
    LATERAL (SELECT count(*)::bigint AS pool FROM stock_unit u
             WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) p
    WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket);
END $$;

-- Give up expired holds of a bucket whose row lock the caller holds, in
-- batches of 500 lines, until p_enough units are usable or none is left
-- (lines another transaction holds are skipped). Their units pay back the
-- bucket's shortfall first (written off with it), the rest become free.
-- Reservations in p_skip are left alone (a batch that is claiming or
-- releasing them, see batch.sql). Returns the units made free.
CREATE OR REPLACE FUNCTION bucket_reclaim_expired_v1(p_tenant bigint, p_bucket bigint,
                                                     p_now timestamptz, p_enough bigint,
                                                     p_skip uuid[] DEFAULT NULL)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_shortfall bigint;
    v_units bigint := 0;
    v_written_off bigint;
    v_batch_units bigint;
    v_batch_lines integer;
    v_backordered bigint := 0;  -- of the lines given up: allowance back, not units
    v_batch_backordered bigint;
BEGIN
    SELECT shortfall INTO v_shortfall FROM stock_bucket
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    LOOP
        WITH due AS (
            SELECT l.tenant_id, l.reservation_id, l.line_no
            FROM reservation_line l
            WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
              AND l.held AND l.expires_at <= p_now
              AND (p_skip IS NULL OR l.reservation_id <> ALL (p_skip))
            LIMIT 500
            FOR UPDATE SKIP LOCKED
        ), given_up AS (
            UPDATE reservation_line l SET held = false
            FROM due
            WHERE (l.tenant_id, l.reservation_id, l.line_no)
                = (due.tenant_id, due.reservation_id, due.line_no)
            RETURNING l.reservation_id, l.line_no, l.quantity, l.backordered
        ), logged AS (
            INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id,
                                        line_no, reason)
            SELECT p_tenant, p_bucket, 'restore', quantity, reservation_id, line_no, 'expired'
            FROM given_up
            RETURNING quantity
        )
        SELECT (SELECT count(*) FROM logged),
               (SELECT coalesce(sum(quantity - backordered), 0) FROM given_up),
               (SELECT coalesce(sum(backordered), 0) FROM given_up)
        INTO v_batch_lines, v_batch_units, v_batch_backordered;
        v_units := v_units + v_batch_units;
        v_backordered := v_backordered + v_batch_backordered;
        EXIT WHEN v_batch_lines < 500 OR v_units - least(v_shortfall, v_units) >= p_enough;
    END LOOP;
    PERFORM bucket_backorder_give_back_v1(p_tenant, p_bucket, v_backordered);
    IF v_units = 0 THEN
        RETURN 0;
    END IF;
    v_written_off := least(v_shortfall, v_units);
    UPDATE stock_bucket
    SET on_hand = on_hand - v_written_off,
        free = free + v_units - v_written_off,
        shortfall = shortfall - v_written_off,
        updated_at = p_now
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    RETURN v_units - v_written_off;
END $$;

-- Take p_qty units of one bucket for this transaction, all or none.
--
-- ok: taken. Otherwise seen_available is what the bucket could serve in the
-- snapshot that decided the answer: a short answer is only given when, at
-- that instant, free + pool + usable expired holds < p_qty. Units other
-- buyers hold are waited for first (they are sold, or stay when that buyer
-- was short); a case that cannot be decided without waiting while holding
-- this bucket's units raises 40001 and the request is retried whole.
-- taken_as: the strategy the units came by; from_free: units taken out of
-- free (to give back if the cart fails); units: with p_keep, the pool units
-- locked for the caller to delete once the cart is held. p_now NULL: expiry is
-- judged by the database's clock at each deciding statement.
CREATE OR REPLACE FUNCTION bucket_take_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                               p_now timestamptz, p_strategy text DEFAULT NULL,
                               p_lo bigint DEFAULT NULL, p_hi bigint DEFAULT NULL,
                               p_keep boolean DEFAULT false,
                               OUT ok boolean, OUT seen_available bigint,
                               OUT taken_as text, OUT from_free integer, OUT units bigint[])
LANGUAGE plpgsql AS $$
DECLARE
    v_strategy text := p_strategy;
    v_lo bigint := p_lo;
    v_hi bigint := p_hi;
    v_free bigint;
    v_pool bigint;
    v_expired bigint;
    v_shortfall bigint;
    v_any_expired boolean;
    v_usable bigint;
    v_take record;
    v_direct integer;
    v_held integer;
    v_round integer;
    v_look integer;
    v_mine record;
    v_top bigint;
    v_start bigint;
    v_wait text;
    -- expiry is judged at each deciding statement (p_now NULL: the database's clock then)
    v_cut timestamptz;
BEGIN
    ok := false;
    from_free := 0;
    IF v_strategy IS NULL THEN
        SELECT strategy, pool_lo, pool_hi INTO v_strategy, v_lo, v_hi
        FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    END IF;
    -- The strategy may be stale (a switch can commit after it was read): each
    -- deciding snapshot reads it again, and a changed one starts over.
    FOR v_round IN 1 .. 4 LOOP
        IF v_strategy = 'row' THEN
            taken_as := 'row';
            -- safety stock stays in free: the write itself keeps it (policy.sql)
            UPDATE stock_bucket SET free = free - p_qty
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND strategy = 'row'
              AND free - p_qty >= safety_stock;
            IF FOUND THEN
                ok := true;
                from_free := p_qty;
                RETURN;
            END IF;
            v_cut := coalesce(p_now, clock_timestamp());
            SELECT b.strategy, b.pool_lo, b.pool_hi, b.free - b.safety_stock,
                   EXISTS (SELECT 1 FROM reservation_line l
                           WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                             AND l.held AND l.expires_at <= v_cut)
            INTO v_strategy, v_lo, v_hi, v_free, v_any_expired
            FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
            -- switched to pool, or freed since the update: take again
            CONTINUE WHEN v_strategy <> 'row' OR v_free >= p_qty;
            IF NOT v_any_expired THEN
                -- a row bucket has no pool: what is free beyond safety stock is what
                -- it can serve
                seen_available := greatest(0, v_free);
                RETURN;
            END IF;
            -- Give up the expired holds under the bucket lock, then take. A
            -- switch may have committed since the strategy was read (a count
            -- holding the bucket is waited for here): under the lock it is read
            -- again, and a pool bucket starts over as its refiller.
            SELECT strategy, pool_lo, pool_hi INTO v_strategy, v_lo, v_hi
            FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
            FOR NO KEY UPDATE;
            CONTINUE WHEN v_strategy <> 'row';
            v_cut := coalesce(p_now, clock_timestamp());
            -- (enough to bring free back up to safety stock too)
            PERFORM bucket_reclaim_expired_v1(p_tenant, p_bucket, v_cut,
                                              p_qty + greatest(0, -v_free));
            UPDATE stock_bucket SET free = free - p_qty
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND strategy = 'row'
              AND free - p_qty >= safety_stock
            RETURNING free INTO v_free;
            IF FOUND THEN
                ok := true;
                from_free := p_qty;
                RETURN;
            END IF;
            -- The lock keeps free and the strategy as they are; an expired
            -- hold still held is being given up by another transaction.
            SELECT b.free - b.safety_stock,
                   EXISTS (SELECT 1 FROM reservation_line l
                           WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                             AND l.held AND l.expires_at <= v_cut)
            INTO v_free, v_any_expired
            FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
            IF v_any_expired THEN
                RAISE EXCEPTION 'expired holds of bucket % are being given up: retry', p_bucket
                    USING ERRCODE = 'serialization_failure';
            END IF;
            seen_available := greatest(0, v_free);
            RETURN;
        END IF;

        taken_as := 'pool';
        v_start := CASE WHEN v_hi > v_lo
                        THEN v_lo + floor(random() * (v_hi - v_lo + 1))::bigint ELSE 0 END;
        v_wait := current_setting('pgreserve.wait_for_units', true);
        IF v_wait = 'on' OR p_bucket::text = ANY (string_to_array(v_wait, ',')) THEN
            -- A retry of a take that held some units and needed lower ones other
            -- buyers held (below, the hint): it takes without waiting if the
            -- units are there; a short take gives back what it locked (the
            -- block is a subtransaction, entered only on such a retry) and goes
            -- on holding none of them, so the look below waits for the lowest
            -- units in unit order when only units others hold can serve it.
            -- (Units of the bucket this transaction locked or deleted before,
            -- in an allocation's earlier try or an earlier operation of a
            -- caller's transaction, are not given back: there deadlock
            -- detection stays the backstop.)
            BEGIN
                v_take := pool_take_units_v1(p_tenant, p_bucket, p_qty, v_start, p_keep);
                IF v_take.locked < p_qty THEN
                    RAISE EXCEPTION 'short' USING ERRCODE = 'PRW01';
                END IF;
            EXCEPTION WHEN SQLSTATE 'PRW01' THEN
                SELECT 0 AS locked, NULL::bigint[] AS units INTO v_take;
            END;
        ELSE
            v_take := pool_take_units_v1(p_tenant, p_bucket, p_qty, v_start, p_keep);
        END IF;
        IF v_take.locked = p_qty THEN
            ok := true;
            units := v_take.units;
            RETURN;
        END IF;
        v_held := v_take.locked;  -- this bucket's units locked here (not deleted)
        -- One snapshot decides: the strategy, free, the pool (up to p_qty),
        -- and expired holds (less what is owed to the shortfall), expiry
        -- judged at this instant, not when the request started (it may have
        -- waited). Units other buyers hold count: they may stay.
        FOR v_look IN 1 .. 2 LOOP
            v_cut := coalesce(p_now, clock_timestamp());
            -- (free counts only beyond safety stock, which never enters the pool)
            SELECT b.strategy, b.pool_lo, b.pool_hi, b.free - b.safety_stock, b.shortfall,
                   (SELECT count(*) FROM (SELECT 1 FROM stock_unit u
                                          WHERE u.tenant_id = p_tenant
                                            AND u.bucket_id = p_bucket
                                          LIMIT p_qty) s),
                   (SELECT coalesce(sum(l.quantity), 0) FROM reservation_line l
                    WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                      AND l.held AND l.expires_at <= v_cut)
            INTO v_strategy, v_lo, v_hi, v_free, v_shortfall, v_pool, v_expired
            FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
            EXIT WHEN v_strategy <> 'pool';
            v_usable := v_pool + greatest(0, v_free + greatest(0, v_expired - v_shortfall));
            IF v_usable < p_qty THEN
                seen_available := v_usable;
                RETURN;
            END IF;
            -- free units or expired holds: a refill brings them in (below)
            EXIT WHEN v_free + greatest(0, v_expired - v_shortfall) > 0 OR v_look = 2;
            -- Only units other buyers hold can serve it: wait for them, in unit
            -- order; each is sold when its buyer commits, or stays if that
            -- buyer was short. A buyer already holding some of this bucket's
            -- units (the take above) waits only for units above the highest it
            -- holds: such a wait points to a buyer holding a higher unit, so
            -- two buyers that each hold part of what they need do not wait for
            -- each other (they deadlocked before). One that still needs lower
            -- units is retried whole (below, hinted 'pgreserve: wait for
            -- units'), which frees its units for the others, and its retry
            -- waits for them (above). The relock lists the units held here
            -- (and any that came free since) without waiting; units this
            -- transaction deleted in an earlier take are not among them.
            v_top := NULL;
            v_held := 0;
            IF v_take.locked > 0 THEN
                v_mine := pool_take_units_v1(p_tenant, p_bucket, p_qty, 0, true);
                v_held := v_mine.locked;
                SELECT max(u) INTO v_top FROM unnest(v_mine.units) u;
            END IF;
            IF v_held < p_qty THEN
                SELECT v_held + count(*) INTO v_held FROM (
                    SELECT 1 FROM stock_unit
                    WHERE tenant_id = p_tenant AND bucket_id = p_bucket
                      AND unit_id > coalesce(v_top, 0)  -- ids start at 1
                    ORDER BY unit_id LIMIT p_qty - v_held
                    FOR UPDATE) s;
            END IF;
            IF v_held >= p_qty THEN
                v_take := pool_take_units_v1(p_tenant, p_bucket, p_qty, 0, p_keep);
                IF v_take.locked = p_qty THEN
                    ok := true;
                    units := v_take.units;
                    RETURN;
                END IF;
            END IF;
        END LOOP;
        CONTINUE WHEN v_strategy <> 'pool';

        -- Enough is there: units other buyers hold, or free units and expired
        -- holds that a refill brings into reach. One refiller per bucket: the
        -- transaction that gets the row lock without waiting. The others wait
        -- for it with a share lock (all granted together when it commits) and
        -- take from what it added; a share lock is never upgraded, so a
        -- waiter still short retries whole. Never wait for the bucket while
        -- holding its units: a stock change holding the bucket waits for them.
        PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            IF v_held = 0 THEN
                PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
                FOR SHARE;
                v_take := pool_take_units_v1(p_tenant, p_bucket, p_qty, 0, p_keep);
                IF v_take.locked = p_qty THEN
                    ok := true;
                    units := v_take.units;
                    RETURN;
                END IF;
            END IF;
            RAISE EXCEPTION 'bucket % is short of units being taken or refilled: retry', p_bucket
                USING ERRCODE = 'serialization_failure';
        END IF;
        -- The refiller: nothing else refills, switches or changes the bucket
        -- until this transaction ends.
        SELECT strategy INTO v_strategy FROM stock_bucket
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        CONTINUE WHEN v_strategy <> 'pool';
        -- the units this transaction has locked count; the rest come
        -- straight out of free (direct), then the pool is topped up
        v_cut := coalesce(p_now, clock_timestamp());
        v_direct := (pool_replenish_v1(p_tenant, p_bucket, p_qty - v_held, v_cut)).direct;
        v_take := pool_take_units_v1(p_tenant, p_bucket, p_qty - v_direct, 0, p_keep);
        IF v_take.locked = p_qty - v_direct THEN
            ok := true;
            from_free := v_direct;
            units := v_take.units;
            RETURN;
        END IF;
        UPDATE stock_bucket SET free = free + v_direct
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        -- Under the lock free is exact and the pool only shrinks; what the
        -- refill could not reach is held by concurrent buyers or givers-up.
        SELECT greatest(0, b.free + greatest(0, e.expired - b.shortfall) - b.safety_stock)
               + (SELECT count(*) FROM (SELECT 1 FROM stock_unit u
                                        WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket
                                        LIMIT p_qty) s)
        INTO v_usable
        FROM stock_bucket b,
        LATERAL (SELECT coalesce(sum(l.quantity), 0) AS expired FROM reservation_line l
                 WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                   AND l.held AND l.expires_at <= v_cut) e
        WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
        IF v_usable < p_qty THEN
            seen_available := v_usable;
            RETURN;
        END IF;
        -- Holding units, it may not have waited for lower ones (above): the
        -- hint has its retry wait for them first (Database.call), DETAIL says
        -- for which bucket.
        IF v_held > 0 OR v_take.locked > 0 THEN
            RAISE EXCEPTION 'bucket % is short of units other buyers hold: retry', p_bucket
                USING ERRCODE = 'serialization_failure', HINT = 'pgreserve: wait for units',
                      DETAIL = p_bucket::text;
        END IF;
        RAISE EXCEPTION 'bucket % is short of units other buyers hold: retry', p_bucket
            USING ERRCODE = 'serialization_failure';
    END LOOP;
    RAISE EXCEPTION 'the strategy of bucket % kept changing: retry', p_bucket
        USING ERRCODE = 'serialization_failure';
END $$;

-- Give back p_qty units of a line that is no longer held (release, expiry).
CREATE OR REPLACE FUNCTION bucket_give_back_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                                    p_now timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_strategy text;
    v_shortfall bigint;
    v_below boolean;
    v_to_free bigint;
    v_to_pool bigint;
BEGIN
    -- FOR KEY SHARE keeps the strategy read here true until this transaction
    -- ends (a switch takes FOR UPDATE) without queueing behind ordinary
    -- updates of the bucket.
    SELECT strategy, shortfall, free < safety_stock INTO v_strategy, v_shortfall, v_below
    FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR KEY SHARE;
    IF v_strategy = 'pool' AND v_shortfall = 0 AND v_below THEN
        -- Safety stock never enters the pool: free is topped up to it first (the
        -- deficit can only shrink meanwhile: takes keep free >= safety_stock, and
        -- what lowers free below it waits for this line's lock).
        SELECT least(p_qty, greatest(0, safety_stock - free)) INTO v_to_free
        FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        FOR NO KEY UPDATE;
        UPDATE stock_bucket SET free = free + v_to_free, updated_at = p_now
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        v_to_pool := p_qty - v_to_free;
        IF v_to_pool > 0 THEN
            INSERT INTO stock_unit (tenant_id, bucket_id)
            SELECT p_tenant, p_bucket FROM generate_series(1, v_to_pool);
        END IF;
    ELSIF v_strategy = 'pool' AND v_shortfall = 0 THEN
        INSERT INTO stock_unit (tenant_id, bucket_id)
        SELECT p_tenant, p_bucket FROM generate_series(1, p_qty);
    ELSE
        -- Units that were held but are missing (forced correction) are
        -- written off rather than made available again.
        UPDATE stock_bucket
        SET on_hand = on_hand - least(shortfall, p_qty),
            free = free + p_qty - least(shortfall, p_qty),
            shortfall = shortfall - least(shortfall, p_qty),
            updated_at = p_now
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    END IF;
END $$;

-- Take exclusive hold of a bucket for a stock change: lock its held lines
-- (so no release or expiry is putting units back), then the bucket row, then
-- drain the pool into free (waiting for in-flight takes to finish).
-- Returns the bucket row and the units currently held on hand (backordered ones
-- are held but not on hand).
CREATE OR REPLACE FUNCTION bucket_lock_exclusive_v1(p_tenant bigint, p_bucket bigint,
                                         OUT o_bucket stock_bucket, OUT o_held bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_drained bigint;
    v_batch bigint;
    v_round integer;
BEGIN
    PERFORM 1 FROM reservation_line
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND held
    ORDER BY reservation_id, line_no
    FOR UPDATE;
    PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR UPDATE;
    -- Drain until a DELETE finds nothing. A DELETE waits for buyers holding
    -- units it saw: a buyer that took them deletes them, a short one leaves
    -- them (takes are all or nothing and never put units back as new rows).
    -- Nothing can add units now: refills and stock changes need the bucket
    -- row, releases and expiry a held line. The loop is a guard: a pool that
    -- keeps refilling is answered Busy.
    v_drained := 0;
    FOR v_round IN 1 .. 50 LOOP
        -- in unit order: a buyer waits only for units above the highest it
        -- holds, so an unordered drain could delete a higher unit and then wait
        -- for that buyer's lower one
        WITH locked AS MATERIALIZED (
            SELECT unit_id FROM stock_unit
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket
            ORDER BY unit_id
            FOR UPDATE
        ), drained AS (
            DELETE FROM stock_unit u USING locked l
            WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket AND u.unit_id = l.unit_id
            RETURNING 1
        )
        SELECT count(*) INTO v_batch FROM drained;
        v_drained := v_drained + v_batch;
        EXIT WHEN v_batch = 0;
        IF v_round = 50 THEN
            RAISE EXCEPTION 'the pool of bucket % kept refilling while it was drained', p_bucket
                USING ERRCODE = 'lock_not_available';
        END IF;
    END LOOP;
    UPDATE stock_bucket SET free = free + v_drained
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    RETURNING * INTO o_bucket;
    -- units held on hand: a line's backordered units are not (0009)
    SELECT coalesce(sum(quantity - backordered), 0) INTO o_held FROM reservation_line
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND held;
END $$;

-- Write a new on_hand for an exclusively locked bucket (pool drained), given
-- the units held. Below the held units, the holds past their expiry are given
-- up first (they no longer count against stock, as for a short reserve); still
-- below: PR412 unless forced, in which case the missing held units are
-- recorded as shortfall. Refills the pool.
CREATE OR REPLACE FUNCTION bucket_apply_on_hand_v1(p_tenant bigint, p_bucket bigint, p_held bigint,
                                        p_physical bigint, p_force boolean,
                                        p_now timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_held bigint := p_held;
    v_short bigint;
BEGIN
    IF v_held > p_physical THEN
        -- The lines are locked (bucket_lock_exclusive_v1). A give-up writes off
        -- shortfall first, which leaves on_hand - shortfall, the callers'
        -- physical count before the change, as it was.
        PERFORM bucket_reclaim_expired_v1(p_tenant, p_bucket, p_now, 9223372036854775807);
        SELECT coalesce(sum(quantity - backordered), 0) INTO v_held FROM reservation_line
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND held;
    END IF;
    v_short := greatest(0, v_held - p_physical);
    IF v_short > 0 AND NOT p_force THEN
        RAISE EXCEPTION 'stock would fall below the % units held', v_held
            USING ERRCODE = 'PR412', DETAIL = v_held::text;
    END IF;
    UPDATE stock_bucket
    SET on_hand = greatest(p_physical, v_held),
        free = greatest(p_physical, v_held) - v_held,
        shortfall = v_short,
        updated_at = p_now
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    PERFORM pool_replenish_v1(p_tenant, p_bucket, 0, p_now);
END $$;
