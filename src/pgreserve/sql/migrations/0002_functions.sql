-- pgreserve server-side operations, version 1.
--
-- Each public operation is one function call, so one round trip and one
-- transaction. Typed failures are raised with SQLSTATEs of class PR; every one
-- of them rolls the whole transaction back, so a failed call writes nothing.
--   PR401 unknown tenant            PR404 unknown stock bucket
--   PR409 same key committed first  PR410 unknown reservation
--   PR412 would oversell            PR422 idempotency key reused
--   PR423 reservation released      PR424 reservation claimed
--   PR425 reservation expired       PR426 reservation not active
-- The clock is injectable: every function takes p_now (NULL = clock_timestamp()).

CREATE FUNCTION tenant_require_v1(p_tenant bigint) RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM 1 FROM tenant WHERE tenant_id = p_tenant;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown tenant %', p_tenant USING ERRCODE = 'PR401';
    END IF;
END $$;

-- The stock view of one bucket at p_now. Holds past expires_at do not count
-- as reserved, whether or not the sweeper has run.
CREATE FUNCTION bucket_view_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz)
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

CREATE FUNCTION reservation_view_v1(p_tenant bigint, p_id uuid, p_now timestamptz)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'id', r.reservation_id,
        'status', CASE WHEN r.status = 'active' AND r.expires_at <= p_now
                       THEN 'expired' ELSE r.status END,
        'created_at', r.created_at, 'expires_at', r.expires_at,
        'claimed_at', r.claimed_at, 'released_at', r.released_at,
        'expired_at', coalesce(r.expired_at,
                               CASE WHEN r.status = 'active' AND r.expires_at <= p_now
                                    THEN r.expires_at END),
        'lines', (SELECT jsonb_agg(jsonb_build_object(
                      'sku', b.sku, 'location', b.location, 'quantity', l.quantity)
                      ORDER BY l.line_no)
                  FROM reservation_line l
                  JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
                  WHERE l.tenant_id = r.tenant_id AND l.reservation_id = r.reservation_id))
    FROM reservation r
    WHERE r.tenant_id = p_tenant AND r.reservation_id = p_id
$$;

-- Give up expired holds on one bucket without waiting on any line another
-- transaction has locked (that transaction is claiming, releasing or expiring
-- it). Marks the lines not held and records the restores; returns the units.
-- The caller owns the bucket row lock and puts the units back into free.
CREATE FUNCTION bucket_reclaim_expired_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_units bigint;
BEGIN
    WITH due AS (
        SELECT l.tenant_id, l.reservation_id, l.line_no
        FROM reservation_line l
        WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
          AND l.held AND l.expires_at <= p_now
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
    SELECT coalesce(sum(quantity), 0) INTO v_units FROM logged;
    RETURN v_units;
END $$;

-- Refill a pool bucket from free stock, up to its cap (plus p_need units the
-- caller takes directly). Serialised per bucket by the bucket row lock: one
-- transaction refills while the others wait on the row, then find units.
-- Returns (added to the pool, taken directly for the caller).
CREATE FUNCTION pool_replenish_v1(p_tenant bigint, p_bucket bigint, p_need integer,
                                  p_now timestamptz,
                                  OUT added integer, OUT direct integer)
LANGUAGE plpgsql AS $$
DECLARE
    v_free bigint;
    v_cap integer;
    v_strategy text;
    v_pool bigint;
    v_reclaimed bigint;
BEGIN
    added := 0;
    direct := 0;
    SELECT free, pool_cap, strategy INTO v_free, v_cap, v_strategy
    FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR NO KEY UPDATE;
    IF NOT FOUND OR v_strategy <> 'pool' THEN
        RETURN;
    END IF;
    v_reclaimed := bucket_reclaim_expired_v1(p_tenant, p_bucket, p_now);
    v_free := v_free + v_reclaimed;
    direct := least(v_free, p_need);
    SELECT count(*) INTO v_pool FROM stock_unit
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    added := greatest(0, least(v_free - direct, v_cap - v_pool));
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
CREATE FUNCTION pool_refill_candidates_v1(p_low_water real, p_limit integer)
RETURNS TABLE (tenant_id bigint, bucket_id bigint, pool bigint, pool_cap integer)
LANGUAGE sql STABLE AS $$
    SELECT b.tenant_id, b.bucket_id, p.pool, b.pool_cap
    FROM stock_bucket b,
    LATERAL (SELECT count(*) AS pool FROM (
                 SELECT 1 FROM stock_unit u
                 WHERE u.tenant_id = b.tenant_id AND u.bucket_id = b.bucket_id
                 LIMIT b.pool_cap) s) p
    WHERE b.strategy = 'pool' AND b.free > 0 AND p.pool < b.pool_cap * p_low_water
    ORDER BY p.pool::real / b.pool_cap
    LIMIT p_limit
$$;

-- Background refill of one bucket; skips it when another transaction holds
-- the bucket (that one is refilling or changing it). Returns units added, or
-- NULL when skipped.
CREATE FUNCTION pool_refill_v1(p_tenant bigint, p_bucket bigint, p_now timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN (pool_replenish_v1(p_tenant, p_bucket, 0, coalesce(p_now, clock_timestamp()))).added;
END $$;

-- Take up to p_qty pool units of one bucket, starting at p_start and wrapping
-- around: lock with SKIP LOCKED and delete in one statement. Returns how many.
CREATE FUNCTION pool_take_units_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
                                   p_start bigint)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_n integer;
    v_more integer;
BEGIN
    WITH picked AS (
        SELECT unit_id FROM stock_unit
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND unit_id >= p_start
        ORDER BY unit_id
        LIMIT p_qty
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        DELETE FROM stock_unit u USING picked
        WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket AND u.unit_id = picked.unit_id
        RETURNING 1
    )
    SELECT count(*) INTO v_n FROM taken;
    IF v_n < p_qty AND p_start > 0 THEN
        WITH picked AS (
            SELECT unit_id FROM stock_unit
            WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND unit_id < p_start
            ORDER BY unit_id
            LIMIT p_qty - v_n
            FOR UPDATE SKIP LOCKED
        ), taken AS (
            DELETE FROM stock_unit u USING picked
            WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket
              AND u.unit_id = picked.unit_id
            RETURNING 1
        )
        SELECT count(*) INTO v_more FROM taken;
        v_n := v_n + v_more;
    END IF;
    RETURN v_n;
END $$;

-- Take p_qty units of one bucket for the caller's transaction, all or none.
-- row:  a conditional decrement of free; the decrement is the check.
-- pool: units taken with SKIP LOCKED; refilled inline when short, unless the
--       bucket is plainly sold out, which is answered without any lock.
-- Either way, when the bucket is short, holds past their expiry are given up
-- first. Returns false (with nothing taken) when p_qty cannot be had now.
-- p_strategy, p_lo and p_hi are the caller's snapshot of the bucket (NULL:
-- read it here).
CREATE FUNCTION bucket_take_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
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
        SELECT strategy, pool_lo, pool_hi INTO v_strategy, v_lo, v_hi
        FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        IF v_strategy = 'row' THEN
            -- Short, unless expired holds can be given up first.
            IF NOT EXISTS (SELECT 1 FROM reservation_line
                           WHERE tenant_id = p_tenant AND bucket_id = p_bucket
                             AND held AND expires_at <= p_now) THEN
                RETURN;
            END IF;
            PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
            FOR NO KEY UPDATE;
            v_reclaimed := bucket_reclaim_expired_v1(p_tenant, p_bucket, p_now);
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
    SELECT free INTO v_free FROM stock_bucket
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    IF v_free < p_qty - v_got
       AND NOT EXISTS (SELECT 1 FROM reservation_line
                       WHERE tenant_id = p_tenant AND bucket_id = p_bucket
                         AND held AND expires_at <= p_now) THEN
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
        PERFORM bucket_untake_v1(p_tenant, p_bucket, v_got, 'pool');
        RETURN;
    END IF;

    -- Refill inline. Waiting for the bucket row lock is waiting for a refill
    -- in flight; once it is ours, units that refill added are visible, so take
    -- first and refill only if still short.
    PERFORM 1 FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
    FOR NO KEY UPDATE;
    v_got := v_got + pool_take_units_v1(p_tenant, p_bucket, p_qty - v_got, 0);
    IF v_got = p_qty THEN
        ok := true;
        RETURN;
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
CREATE FUNCTION bucket_untake_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
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
CREATE FUNCTION bucket_give_back_v1(p_tenant bigint, p_bucket bigint, p_qty integer,
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

CREATE FUNCTION ledger_check_v1(p_tenant bigint, p_key text, p_operation text, p_digest text)
RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_row request_ledger;
BEGIN
    SELECT * INTO v_row FROM request_ledger WHERE tenant_id = p_tenant AND request_key = p_key;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF v_row.operation <> p_operation OR v_row.digest <> p_digest THEN
        RAISE EXCEPTION 'request key % was already used with different parameters', p_key
            USING ERRCODE = 'PR422', DETAIL = v_row.operation;
    END IF;
    RETURN v_row.outcome || jsonb_build_object('replayed', true);
END $$;

CREATE FUNCTION ledger_record_v1(p_tenant bigint, p_key text, p_operation text,
                                 p_digest text, p_status text, p_outcome jsonb)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO request_ledger (tenant_id, request_key, operation, digest, status, outcome)
    VALUES (p_tenant, p_key, p_operation, p_digest, p_status, p_outcome)
    ON CONFLICT (tenant_id, request_key) DO NOTHING;
    IF NOT FOUND THEN
        -- The same key committed first while this one ran: undo this attempt;
        -- the caller retries and gets the stored outcome.
        RAISE EXCEPTION 'request key % was committed by a concurrent request', p_key
            USING ERRCODE = 'PR409';
    END IF;
END $$;

-- Reserve a cart, all or nothing. The arrays are one entry per line, already
-- sorted by (sku, location) by the caller: that is the order locks are taken in.
CREATE FUNCTION reserve_v1(p_tenant bigint, p_key text, p_digest text,
                           p_skus text[], p_locations text[], p_quantities integer[],
                           p_ttl interval, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_replay jsonb;
    v_buckets bigint[];
    v_strategies text[];
    v_los bigint[];
    v_his bigint[];
    v_missing jsonb;
    v_taken integer := 0;
    v_short integer[] := '{}';
    v_seen bigint[] := '{}';
    v_take record;
    v_id uuid;
    v_outcome jsonb;
    v_view jsonb;
    v_status text;
    i integer;
BEGIN
    -- Requests with one key run one after another: the second sees the first's
    -- committed outcome instead of competing with it for stock (a pool buyer
    -- would otherwise find its sibling's units locked and store a rejection).
    -- Transaction-scoped, so it needs no session state; a hash collision only
    -- serialises two unrelated requests, and the ledger's unique key stays the
    -- guarantee.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, p_tenant));
    v_replay := ledger_check_v1(p_tenant, p_key, 'reserve', p_digest);
    IF v_replay IS NOT NULL THEN
        RETURN v_replay;
    END IF;

    SELECT array_agg(b.bucket_id ORDER BY u.ord), array_agg(b.strategy ORDER BY u.ord),
           array_agg(b.pool_lo ORDER BY u.ord), array_agg(b.pool_hi ORDER BY u.ord),
           jsonb_agg(jsonb_build_object('sku', u.sku, 'location', u.loc) ORDER BY u.ord)
               FILTER (WHERE b.bucket_id IS NULL)
    INTO v_buckets, v_strategies, v_los, v_his, v_missing
    FROM unnest(p_skus, p_locations) WITH ORDINALITY AS u(sku, loc, ord)
    LEFT JOIN stock_bucket b
      ON b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc;
    IF v_missing IS NOT NULL THEN
        PERFORM tenant_require_v1(p_tenant);
        RAISE EXCEPTION 'unknown stock' USING ERRCODE = 'PR404', DETAIL = v_missing::text;
    END IF;

    FOR i IN 1 .. cardinality(v_buckets) LOOP
        v_take := bucket_take_v1(p_tenant, v_buckets[i], p_quantities[i], v_now,
                                 v_strategies[i], v_los[i], v_his[i]);
        IF v_take.ok THEN
            IF v_short = '{}' THEN
                v_taken := i;
            ELSE
                PERFORM bucket_untake_v1(p_tenant, v_buckets[i], p_quantities[i],
                                         v_strategies[i]);
            END IF;
        ELSE
            v_short := v_short || i;
            v_seen := v_seen || v_take.seen_available;
        END IF;
    END LOOP;

    IF v_short <> '{}' THEN
        -- Give back what the lines before the first short one took. (A take
        -- that came back true also tells the bucket's current strategy: a
        -- switch waits for this transaction once it has taken anything.)
        FOR i IN 1 .. v_taken LOOP
            PERFORM bucket_untake_v1(
                p_tenant, v_buckets[i], p_quantities[i],
                (SELECT strategy FROM stock_bucket
                 WHERE tenant_id = p_tenant AND bucket_id = v_buckets[i]));
        END LOOP;
        SELECT jsonb_agg(jsonb_build_object(
                   'sku', p_skus[k], 'location', p_locations[k], 'requested', p_quantities[k],
                   'available',
                   coalesce(seen, (bucket_view_v1(p_tenant, v_buckets[k], v_now)
                                   ->> 'available')::bigint))
                   ORDER BY n)
        INTO v_outcome FROM unnest(v_short, v_seen) WITH ORDINALITY AS u(k, seen, n);
        v_status := 'rejected';
        v_outcome := jsonb_build_object('status', 'rejected', 'reason', 'insufficient_stock',
                                        'short_lines', v_outcome);
        -- This transaction took nothing: it only records the rejection. It
        -- need not wait for its WAL to reach disk (sold out must be cheap). A
        -- crash in the next few hundred milliseconds can lose the record;
        -- nothing else is lost, and a retry of the key then runs afresh.
        PERFORM set_config('synchronous_commit', 'off', true);
    ELSE
        v_id := gen_random_uuid();
        INSERT INTO reservation (tenant_id, reservation_id, request_key, created_at, expires_at)
        VALUES (p_tenant, v_id, p_key, v_now, v_now + p_ttl);
        INSERT INTO reservation_line (tenant_id, reservation_id, line_no, bucket_id, quantity,
                                      expires_at)
        SELECT p_tenant, v_id, ord, bucket, qty, v_now + p_ttl
        FROM unnest(v_buckets, p_quantities) WITH ORDINALITY AS u(bucket, qty, ord);
        -- The same document reservation_view_v1 would read back, built from
        -- what is known here.
        v_view := jsonb_build_object(
            'id', v_id, 'status', 'active', 'created_at', v_now,
            'expires_at', v_now + p_ttl, 'claimed_at', NULL, 'released_at', NULL,
            'expired_at', NULL,
            'lines', (SELECT jsonb_agg(jsonb_build_object('sku', sku, 'location', loc,
                                                          'quantity', qty) ORDER BY ord)
                      FROM unnest(p_skus, p_locations, p_quantities)
                           WITH ORDINALITY AS u(sku, loc, qty, ord)));
        v_status := 'succeeded';
        v_outcome := jsonb_build_object('status', 'held', 'reservation', v_view);
        INSERT INTO outbox_event (tenant_id, type, payload)
        VALUES (p_tenant, 'reservation.created', v_view);
    END IF;

    PERFORM ledger_record_v1(p_tenant, p_key, 'reserve', p_digest, v_status, v_outcome);
    RETURN v_outcome;
END $$;

-- Lock a reservation for a transition; raises PR410 (or PR401) when the
-- tenant has no such reservation.
CREATE FUNCTION reservation_lock_v1(p_tenant bigint, p_id uuid) RETURNS reservation
LANGUAGE plpgsql AS $$
DECLARE
    v_row reservation;
BEGIN
    SELECT * INTO v_row FROM reservation
    WHERE tenant_id = p_tenant AND reservation_id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM tenant_require_v1(p_tenant);
        RAISE EXCEPTION 'unknown reservation %', p_id USING ERRCODE = 'PR410';
    END IF;
    RETURN v_row;
END $$;

-- Payment succeeded: deduct on_hand for every line, in one transaction with
-- the state change. A reservation past its expiry is claimed only if every
-- line that was given up can be taken again now.
CREATE FUNCTION claim_v1(p_tenant bigint, p_id uuid, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_res reservation;
    v_line record;
    v_view jsonb;
BEGIN
    v_res := reservation_lock_v1(p_tenant, p_id);
    IF v_res.status = 'claimed' THEN
        RETURN reservation_view_v1(p_tenant, p_id, v_now);
    ELSIF v_res.status = 'released' THEN
        RAISE EXCEPTION 'reservation % was released', p_id USING ERRCODE = 'PR423';
    END IF;

    FOR v_line IN
        SELECT l.line_no, l.bucket_id, l.quantity, l.held
        FROM reservation_line l
        JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
        WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id
        ORDER BY b.sku, b.location
        FOR UPDATE OF l
    LOOP
        IF v_line.held THEN
            UPDATE reservation_line SET held = false
            WHERE tenant_id = p_tenant AND reservation_id = p_id AND line_no = v_line.line_no;
        ELSE
            -- Given up at expiry: take the units again, or fail the claim.
            IF NOT (bucket_take_v1(p_tenant, v_line.bucket_id, v_line.quantity, v_now)).ok THEN
                RAISE EXCEPTION 'reservation % expired and its stock is gone', p_id
                    USING ERRCODE = 'PR425';
            END IF;
        END IF;
        UPDATE stock_bucket
        SET on_hand = on_hand - v_line.quantity,
            shortfall = least(shortfall, on_hand - v_line.quantity),
            updated_at = v_now
        WHERE tenant_id = p_tenant AND bucket_id = v_line.bucket_id;
        INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id, line_no)
        VALUES (p_tenant, v_line.bucket_id, 'sale', -v_line.quantity, p_id, v_line.line_no);
    END LOOP;

    UPDATE reservation
    SET status = 'claimed', claimed_at = v_now
    WHERE tenant_id = p_tenant AND reservation_id = p_id;
    v_view := reservation_view_v1(p_tenant, p_id, v_now);
    INSERT INTO outbox_event (tenant_id, type, payload)
    VALUES (p_tenant, 'reservation.claimed', v_view);
    RETURN v_view;
END $$;

-- Give back every line still held, in (sku, location) order, and record each
-- restore once. Returns the number of units given back.
CREATE FUNCTION reservation_give_back_v1(p_tenant bigint, p_id uuid, p_reason text,
                                         p_now timestamptz)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_line record;
    v_units bigint := 0;
BEGIN
    FOR v_line IN
        SELECT l.line_no, l.bucket_id, l.quantity
        FROM reservation_line l
        JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
        WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id AND l.held
        ORDER BY b.sku, b.location
        FOR UPDATE OF l
    LOOP
        UPDATE reservation_line SET held = false
        WHERE tenant_id = p_tenant AND reservation_id = p_id AND line_no = v_line.line_no;
        INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id,
                                    line_no, reason)
        VALUES (p_tenant, v_line.bucket_id, 'restore', v_line.quantity, p_id,
                v_line.line_no, p_reason);
        PERFORM bucket_give_back_v1(p_tenant, v_line.bucket_id, v_line.quantity, p_now);
        v_units := v_units + v_line.quantity;
    END LOOP;
    RETURN v_units;
END $$;

-- Payment failed or the checkout was cancelled.
CREATE FUNCTION release_v1(p_tenant bigint, p_id uuid, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_res reservation;
    v_view jsonb;
BEGIN
    v_res := reservation_lock_v1(p_tenant, p_id);
    IF v_res.status = 'claimed' THEN
        RAISE EXCEPTION 'reservation % was claimed', p_id USING ERRCODE = 'PR424';
    ELSIF v_res.status IN ('released', 'expired') THEN
        RETURN reservation_view_v1(p_tenant, p_id, v_now);
    END IF;
    PERFORM reservation_give_back_v1(p_tenant, p_id, 'released', v_now);
    UPDATE reservation SET status = 'released', released_at = v_now
    WHERE tenant_id = p_tenant AND reservation_id = p_id;
    v_view := reservation_view_v1(p_tenant, p_id, v_now);
    INSERT INTO outbox_event (tenant_id, type, payload)
    VALUES (p_tenant, 'reservation.released', v_view);
    RETURN v_view;
END $$;

CREATE FUNCTION extend_v1(p_tenant bigint, p_id uuid, p_ttl interval,
                          p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_res reservation;
BEGIN
    v_res := reservation_lock_v1(p_tenant, p_id);
    IF v_res.status <> 'active' OR v_res.expires_at <= v_now THEN
        RAISE EXCEPTION 'reservation % is not active', p_id USING ERRCODE = 'PR426',
            DETAIL = CASE WHEN v_res.status = 'active' THEN 'expired' ELSE v_res.status END;
    END IF;
    -- Lines carry expires_at too (the reserve path reclaims by line); the
    -- header lock is held, so no claim or release interleaves.
    UPDATE reservation_line SET expires_at = v_now + p_ttl
    WHERE tenant_id = p_tenant AND reservation_id = p_id AND held;
    UPDATE reservation SET expires_at = v_now + p_ttl
    WHERE tenant_id = p_tenant AND reservation_id = p_id;
    RETURN reservation_view_v1(p_tenant, p_id, v_now);
END $$;

-- The sweeper: expire up to p_batch due reservations in one transaction.
-- SKIP LOCKED lets several sweepers run at once; the locking read re-checks
-- status and expiry on the latest row version.
CREATE FUNCTION expire_due_v1(p_batch integer, p_now timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_res record;
    v_count integer := 0;
BEGIN
    FOR v_res IN
        SELECT tenant_id, reservation_id FROM reservation
        WHERE status = 'active' AND expires_at <= v_now
        ORDER BY expires_at
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    LOOP
        PERFORM reservation_give_back_v1(v_res.tenant_id, v_res.reservation_id, 'expired',
                                         v_now);
        UPDATE reservation SET status = 'expired', expired_at = v_now
        WHERE tenant_id = v_res.tenant_id AND reservation_id = v_res.reservation_id;
        INSERT INTO outbox_event (tenant_id, type, payload)
        VALUES (v_res.tenant_id, 'reservation.expired',
                reservation_view_v1(v_res.tenant_id, v_res.reservation_id, v_now));
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END $$;

-- Take exclusive hold of a bucket for a stock change: lock its held lines
-- (so no release or expiry is putting units back), then the bucket row, then
-- drain the pool into free (waiting for in-flight takes to finish).
-- Returns the bucket row and the units currently held.
CREATE FUNCTION bucket_lock_exclusive_v1(p_tenant bigint, p_bucket bigint,
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
CREATE FUNCTION bucket_apply_on_hand_v1(p_tenant bigint, p_bucket bigint, p_held bigint,
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

-- Set a bucket's count (physical units not yet sold), creating it if needed,
-- and optionally switch its strategy. Idempotent by nature.
CREATE FUNCTION stock_set_v1(p_tenant bigint, p_sku text, p_location text, p_on_hand bigint,
                             p_strategy text DEFAULT NULL, p_force boolean DEFAULT false,
                             p_pool_cap integer DEFAULT NULL,
                             p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_bucket bigint;
    v_lock record;
    v_before bigint;
    v_view jsonb;
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    INSERT INTO stock_bucket (tenant_id, sku, location, on_hand, free, strategy, pool_cap)
    VALUES (p_tenant, p_sku, p_location, p_on_hand, p_on_hand, coalesce(p_strategy, 'row'),
            coalesce(p_pool_cap, 1000))
    ON CONFLICT (tenant_id, sku, location) DO NOTHING
    RETURNING bucket_id INTO v_bucket;
    IF v_bucket IS NOT NULL THEN
        v_before := 0;
        PERFORM pool_replenish_v1(p_tenant, v_bucket, 0, v_now);
    ELSE
        SELECT bucket_id INTO v_bucket FROM stock_bucket
        WHERE tenant_id = p_tenant AND sku = p_sku AND location = p_location;
        v_lock := bucket_lock_exclusive_v1(p_tenant, v_bucket);
        v_before := (v_lock.o_bucket).on_hand - (v_lock.o_bucket).shortfall;
        UPDATE stock_bucket
        SET strategy = coalesce(p_strategy, strategy), pool_cap = coalesce(p_pool_cap, pool_cap)
        WHERE tenant_id = p_tenant AND bucket_id = v_bucket;
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
    RETURN v_view;
END $$;

-- Receipt (delta > 0) or correction (delta < 0) of on_hand, idempotent by key.
CREATE FUNCTION stock_adjust_v1(p_tenant bigint, p_key text, p_digest text, p_sku text,
                                p_location text, p_delta bigint, p_reason text,
                                p_force boolean DEFAULT false,
                                p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
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
        -- A receipt pays back any shortfall first, then becomes free stock.
        UPDATE stock_bucket
        SET on_hand = on_hand + p_delta - least(shortfall, p_delta),
            free = free + p_delta - least(shortfall, p_delta),
            shortfall = shortfall - least(shortfall, p_delta),
            updated_at = v_now
        WHERE tenant_id = p_tenant AND bucket_id = v_bucket;
    ELSE
        v_lock := bucket_lock_exclusive_v1(p_tenant, v_bucket);
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

-- Every accounting rule the design promises, per bucket; one row per breach.
CREATE FUNCTION invariant_violations_v1(p_tenant bigint DEFAULT NULL,
                                        p_now timestamptz DEFAULT NULL)
RETURNS TABLE (tenant_id bigint, sku text, location text, rule text, detail text)
LANGUAGE sql STABLE AS $$
    WITH now_ AS (SELECT coalesce(p_now, clock_timestamp()) AS now),
    figures AS (
        SELECT b.tenant_id, b.bucket_id, b.sku, b.location, b.on_hand, b.free, b.strategy,
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
    SELECT tenant_id, sku, location, 'accounting',
           format('on_hand %s <> free %s + pool %s + held %s', on_hand, free, pool, held)
    FROM figures WHERE on_hand <> free + pool + held
    UNION ALL
    SELECT tenant_id, sku, location, 'negative',
           format('on_hand %s free %s reserved %s available %s',
                  on_hand, free, reserved, on_hand - reserved)
    FROM figures WHERE on_hand < 0 OR free < 0 OR reserved < 0 OR on_hand - reserved < 0
    UNION ALL
    SELECT tenant_id, sku, location, 'pool_on_row_bucket', format('%s pool units', pool)
    FROM figures WHERE strategy = 'row' AND pool > 0
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
               ELSE m.n <> 1 END
$$;

-- Generic plans for everything these operations run. Statements on the
-- partitioned pool table would otherwise be planned afresh on every call: the
-- plan cache compares the generic plan (all 16 partitions, pruned at run time)
-- with a custom plan (pruned while planning), finds the custom one cheaper,
-- and so keeps planning. Measured: a reserve spent half its server time
-- planning. The setting holds while the entry point runs, nested calls
-- included, and is restored when it returns.
ALTER FUNCTION reserve_v1(bigint, text, text, text[], text[], integer[], interval, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION claim_v1(bigint, uuid, timestamptz) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION release_v1(bigint, uuid, timestamptz) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION extend_v1(bigint, uuid, interval, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION expire_due_v1(integer, timestamptz) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION pool_refill_v1(bigint, bigint, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION stock_set_v1(bigint, text, text, bigint, text, boolean, integer, timestamptz)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION stock_adjust_v1(bigint, text, text, text, text, bigint, text, boolean, timestamptz)
    SET plan_cache_mode = force_generic_plan;
