-- The stock view of one bucket at p_now. Holds past expires_at do not count
-- as reserved, whether or not the sweeper has run.
CREATE OR REPLACE FUNCTION bucket_view_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    -- available = free + pool + holds already past expiry; reading it touches
    -- only the expired part of the held-lines index, never every hold.
    SELECT jsonb_build_object(
        'sku', b.sku, 'location', b.location, 'on_hand', b.on_hand,
        'reserved', b.on_hand - (b.free + p.pool + e.expired),
        'available', b.free + p.pool + e.expired,
        'strategy', b.strategy, 'pool', p.pool, 'pool_cap', b.pool_cap,
        'shortfall', b.shortfall)
    FROM stock_bucket b,
    LATERAL (SELECT coalesce(sum(l.quantity), 0)::bigint AS expired
             FROM reservation_line l
             WHERE l.tenant_id = b.tenant_id AND l.bucket_id = b.bucket_id AND l.held
               AND l.expires_at <= p_now) e,
    LATERAL (SELECT count(*)::bigint AS pool FROM stock_unit u
             WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id) p
    WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket
$$;

CREATE OR REPLACE FUNCTION bucket_reclaim_expired_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz,
                                          p_enough bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_units bigint := 0;
    v_batch_units bigint;
    v_batch_lines integer;
BEGIN
    LOOP
        WITH due AS (
            SELECT l.tenant_id, l.reservation_id, l.line_no
            FROM reservation_line l
            WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
              AND l.held AND l.expires_at <= p_now
            LIMIT 500
            FOR UPDATE SKIP LOCKED
        ), given_up AS (
            UPDATE reservation_line l SET held = false
            FROM due
            WHERE (l.tenant_id, l.reservation_id, l.line_no)
                = (due.tenant_id, due.reservation_id, due.line_no)
            RETURNING l.reservation_id, l.line_no, l.quantity
        ), logged AS (
            INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id,
                                        line_no, reason)
            SELECT p_tenant, p_bucket, 'restore', quantity, reservation_id, line_no, 'expired'
            FROM given_up
            RETURNING quantity
        )
        SELECT count(*), coalesce(sum(quantity), 0) INTO v_batch_lines, v_batch_units
        FROM logged;
        v_units := v_units + v_batch_units;
        EXIT WHEN v_batch_lines < 500 OR v_units >= p_enough;
    END LOOP;
    RETURN v_units;
END $$;

CREATE OR REPLACE FUNCTION bucket_take_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                               p_now timestamptz, p_strategy text DEFAULT NULL,
                               p_lo bigint DEFAULT NULL, p_hi bigint DEFAULT NULL,
                               OUT ok boolean, OUT seen_available bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_strategy text := p_strategy;
    v_lo bigint := p_lo;
    v_hi bigint := p_hi;
    v_free bigint;
    v_got integer;
    v_rep record;
    v_reclaimed bigint;
    v_expired boolean;
    v_refiller boolean;
BEGIN
    ok := false;
    IF v_strategy IS NULL THEN
        SELECT strategy, pool_lo, pool_hi INTO v_strategy, v_lo, v_hi
        FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    END IF;

    IF v_strategy = 'row' THEN
        UPDATE stock_bucket SET free = free - p_qty
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND strategy = 'row'
          AND free >= p_qty;
        IF FOUND THEN
            ok := true;
            RETURN;
        END IF;
        -- One statement reads what a short answer needs: the strategy (a
        -- switch may have happened), what is free, and whether any hold has
        -- expired.
        SELECT b.strategy, b.pool_lo, b.pool_hi, b.free,
               EXISTS (SELECT 1 FROM reservation_line l
                       WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                         AND l.held AND l.expires_at <= p_now)
        INTO v_strategy, v_lo, v_hi, v_free, v_expired
        FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
        IF v_strategy = 'row' THEN
            -- Short, unless expired holds can be given up first. A row bucket
            -- has no pool, so what is free is what is available.
            IF NOT v_expired THEN
                seen_available := v_free;
                RETURN;
            END IF;
            PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
            FOR NO KEY UPDATE;
            v_reclaimed := bucket_reclaim_expired_v1(p_tenant, p_bucket, p_now, p_qty);
            UPDATE stock_bucket SET free = free + v_reclaimed
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
            UPDATE stock_bucket SET free = free - p_qty
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND strategy = 'row'
              AND free >= p_qty;
            ok := FOUND;
            RETURN;
        END IF;
        -- switched to pool meanwhile: take from the pool below
    END IF;

    v_got := pool_take_units_v1(
        p_tenant, p_bucket, p_qty,
        CASE WHEN v_hi > v_lo THEN v_lo + floor(random() * (v_hi - v_lo + 1))::bigint
             ELSE 0 END);
    IF v_got = p_qty THEN
        ok := true;
        RETURN;
    END IF;

    -- Sold out is cheap: nothing free and nothing expired means no refill can
    -- help, so answer now without queueing on the bucket lock.
    SELECT b.free,
           EXISTS (SELECT 1 FROM reservation_line l
                   WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                     AND l.held AND l.expires_at <= p_now)
    INTO v_free, v_expired
    FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
    IF v_free < p_qty - v_got AND NOT v_expired THEN
        -- One more look, in a new snapshot, and without SKIP LOCKED: it sees a
        -- refill that committed after the take's snapshot, and it waits for
        -- units other buyers have locked (they are not sold until those
        -- commit; a stored rejection is final for its key, so a rollback must
        -- not leave this buyer turned away). An empty pool has nothing to wait
        -- for, so sold out stays cheap.
        PERFORM 1 FROM stock_unit
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        ORDER BY unit_id LIMIT p_qty - v_got
        FOR UPDATE;
        IF FOUND THEN
            v_got := v_got + pool_take_units_v1(p_tenant, p_bucket, p_qty - v_got, 0);
            IF v_got = p_qty THEN
                ok := true;
                RETURN;
            END IF;
        ELSE
            -- nothing in the pool, nothing expired: what is free is all there is
            seen_available := v_free + v_got;
        END IF;
        IF v_got > 0 THEN
            PERFORM bucket_untake_v1(p_tenant, p_bucket, v_got, 'pool');
        END IF;
        RETURN;
    END IF;

    -- Refill inline, one refiller per bucket: the transaction that gets the
    -- bucket row lock. A buyer that finds it held waits for that transaction
    -- with a share lock instead: when it commits, every waiter is granted at
    -- once and takes from what it added. (Queueing for the row lock itself
    -- would let the waiters through one at a time, each holding the lock
    -- until it commits: a convoy as slow as the row strategy.) A share lock is
    -- never upgraded (two waiters doing so would deadlock): a waiter still
    -- short starts its request again, and the retry either takes, refills, or
    -- finds the bucket sold out.
    PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR NO KEY UPDATE SKIP LOCKED;
    v_refiller := FOUND;
    IF NOT v_refiller THEN
        PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        FOR SHARE;
    END IF;
    -- Either way, units a refill added just before are visible now: take
    -- first; only the refiller refills if still short.
    v_got := v_got + pool_take_units_v1(p_tenant, p_bucket, p_qty - v_got, 0);
    IF v_got = p_qty THEN
        ok := true;
        RETURN;
    END IF;
    IF NOT v_refiller THEN
        RAISE EXCEPTION 'bucket % was being refilled and is still short: retry', p_bucket
            USING ERRCODE = 'serialization_failure';
    END IF;
    v_rep := pool_replenish_v1(p_tenant, p_bucket, p_qty - v_got, p_now);
    v_got := v_got + v_rep.direct;
    IF v_got < p_qty THEN
        -- Direct units came out of free under the bucket lock this
        -- transaction holds: put them back there; the rest into the pool.
        UPDATE stock_bucket SET free = free + v_rep.direct
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        PERFORM bucket_untake_v1(p_tenant, p_bucket, v_got - v_rep.direct, 'pool');
        RETURN;
    END IF;
    ok := true;
END $$;

-- Undo a take of this transaction: row units back to free (the caller holds
-- the row lock), pool units back into the pool (no bucket lock needed).
CREATE OR REPLACE FUNCTION bucket_untake_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                                 p_strategy text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_qty <= 0 THEN
        RETURN;
    ELSIF p_strategy = 'row' THEN
        UPDATE stock_bucket SET free = free + p_qty
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    ELSE
        INSERT INTO stock_unit (tenant_id, bucket_id)
        SELECT p_tenant, p_bucket FROM generate_series(1, p_qty);
    END IF;
END $$;

-- Give back p_qty units of a line that is no longer held (release, expiry).
CREATE OR REPLACE FUNCTION bucket_give_back_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                                    p_now timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_strategy text;
    v_shortfall bigint;
BEGIN
    -- FOR KEY SHARE keeps the strategy read here true until this transaction
    -- ends (a switch takes FOR UPDATE) without queueing behind ordinary
    -- updates of the bucket.
    SELECT strategy, shortfall INTO v_strategy, v_shortfall
    FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR KEY SHARE;
    IF v_strategy = 'pool' AND v_shortfall = 0 THEN
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
-- Returns the bucket row and the units currently held.
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
    -- units it saw, but a buyer whose take came up short gives its units back
    -- as new rows, which that DELETE cannot see; the next statement can.
    -- Nothing else can add units now: refills need the bucket row, releases
    -- need a held line. A buyer that keeps racing the drain is answered Busy.
    v_drained := 0;
    FOR v_round IN 1 .. 50 LOOP
        WITH drained AS (
            DELETE FROM stock_unit WHERE tenant_id = p_tenant AND bucket_id = p_bucket
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
    SELECT coalesce(sum(quantity), 0) INTO o_held FROM reservation_line
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND held;
END $$;

-- Write a new on_hand for an exclusively locked bucket (pool drained), given
-- the units held. Below the held units: PR412 unless forced, in which case
-- the missing held units are recorded as shortfall. Refills the pool.
CREATE OR REPLACE FUNCTION bucket_apply_on_hand_v1(p_tenant bigint, p_bucket bigint, p_held bigint,
                                        p_physical bigint, p_force boolean,
                                        p_now timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_short bigint := greatest(0, p_held - p_physical);
BEGIN
    IF v_short > 0 AND NOT p_force THEN
        RAISE EXCEPTION 'stock would fall below the % units held', p_held
            USING ERRCODE = 'PR412', DETAIL = p_held::text;
    END IF;
    UPDATE stock_bucket
    SET on_hand = greatest(p_physical, p_held),
        free = greatest(p_physical, p_held) - p_held,
        shortfall = v_short,
        updated_at = p_now
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    PERFORM pool_replenish_v1(p_tenant, p_bucket, 0, p_now);
END $$;
