-- Only active -> claimed | released | expired, plus expired -> claimed (a late
-- claim that could take every line again); nothing else ever changes state.
CREATE OR REPLACE FUNCTION reservation_transition_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IS DISTINCT FROM OLD.status AND OLD.status <> 'active'
       AND NOT (OLD.status = 'expired' AND NEW.status = 'claimed') THEN
        RAISE EXCEPTION 'reservation % cannot move from % to %',
            OLD.reservation_id, OLD.status, NEW.status
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.status <> 'active' AND NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN
        RAISE EXCEPTION 'reservation % is % and cannot be extended',
            OLD.reservation_id, OLD.status USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER reservation_transition_guard BEFORE UPDATE ON reservation
    FOR EACH ROW EXECUTE FUNCTION reservation_transition_guard();

CREATE OR REPLACE FUNCTION reservation_line_held_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.held AND NOT OLD.held THEN
        RAISE EXCEPTION 'line % of reservation % was already given up',
            OLD.line_no, OLD.reservation_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER reservation_line_held_guard BEFORE UPDATE ON reservation_line
    FOR EACH ROW EXECUTE FUNCTION reservation_line_held_guard();

-- (PL/pgSQL: its body is checked when it runs, so the function files apply to a
-- schema of any migration)
CREATE OR REPLACE FUNCTION reservation_view_v1(p_tenant bigint, p_id uuid, p_now timestamptz)
RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
BEGIN
    -- A line shows its backordered units only when it has some.
    RETURN (SELECT jsonb_build_object(
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
                      || CASE WHEN l.backordered > 0
                              THEN jsonb_build_object('backordered', l.backordered)
                              ELSE '{}'::jsonb END
                      -- the order a cart is held in (a changed cart renumbers lines)
                      ORDER BY b.sku COLLATE "C", b.location COLLATE "C")
                  FROM reservation_line l
                  JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
                  WHERE l.tenant_id = r.tenant_id AND l.reservation_id = r.reservation_id),
        'reference', r.reference, 'metadata', r.metadata)
    FROM reservation r
    WHERE r.tenant_id = p_tenant AND r.reservation_id = p_id);
END $$;

-- reserve_v1, claim_v1, release_v1 and transition_keyed_v1 may run in a caller's own
-- transaction (ReservationService(..., conn=)), whatever its search_path:
-- `SET search_path FROM CURRENT` records pgreserve's schema, as the runner sets it.
-- p_reference and p_metadata (the reservation's, NULL: none) came later, with
-- defaults, so a call without them still resolves to this one function
-- (migration 0007 dropped the signature without them).
CREATE OR REPLACE FUNCTION reserve_v1(p_tenant bigint, p_key text, p_digest text,
                           p_skus text[], p_locations text[], p_quantities integer[],
                           p_ttl interval, p_now timestamptz DEFAULT NULL,
                           p_reference text DEFAULT NULL, p_metadata jsonb DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_cut timestamptz;
    v_void text;
    v_prior request_ledger;
    v_buckets bigint[];
    v_strategies text[];
    v_los bigint[];
    v_his bigint[];
    v_missing jsonb;
    v_bucket bigint;
    v_strategy text;
    v_lo bigint;
    v_hi bigint;
    v_free bigint;
    v_limit integer;
    v_limits integer[];
    v_sold_out boolean := false;
    v_short integer[] := '{}';
    v_seen bigint[] := '{}';
    v_take record;
    v_from_free integer[] := '{}';
    v_backordered integer[] := '{}';  -- of each line, from the backorder allowance
    v_bo record;
    v_unit_buckets bigint[] := '{}';
    v_unit_ids bigint[] := '{}';
    v_id uuid;
    v_outcome jsonb;
    v_view jsonb;
    v_lines jsonb;
    v_status text;
    i integer;
BEGIN
    -- Requests with one key run one after another: the second sees the first's
    -- committed outcome instead of competing with it for stock (a pool buyer
    -- would otherwise find its sibling's units locked and store a rejection).
    -- Transaction-scoped, so it needs no session state; a hash collision only
    -- serialises two unrelated requests, and the ledger's unique key stays the
    -- guarantee.
    -- (an assignment, not PERFORM: PL/pgSQL evaluates a simple expression
    -- without starting the executor; the void result is cast to text)
    v_void := pg_advisory_xact_lock(hashtextextended(p_key, p_tenant))::text;
    -- The tenant's freeze lock, shared (freeze.sql): a freeze commits only
    -- when no take that did not see it is still open.
    v_void := pg_advisory_xact_lock_shared(1885827686, freeze_lock_key_v1(p_tenant))::text;
    -- (ledger_check_v1, inline: this is the hottest path)
    SELECT * INTO v_prior FROM request_ledger WHERE tenant_id = p_tenant AND request_key = p_key;
    IF FOUND THEN
        IF v_prior.operation <> 'reserve' OR v_prior.digest <> p_digest THEN
            RAISE EXCEPTION 'request key % was already used with different parameters', p_key
                USING ERRCODE = 'PR422', DETAIL = v_prior.operation;
        END IF;
        RETURN v_prior.outcome || jsonb_build_object('replayed', true);
    END IF;

    IF cardinality(p_skus) = 1 THEN
        -- One line, the usual cart. Find the bucket; if less is free than
        -- asked, one statement tells whether the bucket is plainly sold out in
        -- its snapshot: less free than asked, no unit in the pool (a unit
        -- another buyer is taking still counts: its delete has not committed)
        -- and no hold past its expiry. Then the answer is no at once: no take,
        -- no refill lock, no scan. The probes name the bucket by a parameter,
        -- so the executor opens one pool partition, not all of them.
        -- (free beyond the safety stock, which is never promised)
        SELECT b.bucket_id, b.strategy, b.pool_lo, b.pool_hi, b.free - b.safety_stock,
               b.cart_limit
        INTO v_bucket, v_strategy, v_lo, v_hi, v_free, v_limit
        FROM stock_bucket b
        WHERE b.tenant_id = p_tenant AND b.sku = p_skus[1] AND b.location = p_locations[1];
        IF FOUND THEN
            IF v_free < p_quantities[1] THEN
                v_cut := coalesce(p_now, clock_timestamp());  -- after the key's lock wait
                SELECT greatest(0, b.free - b.safety_stock)
                       + greatest(0, b.backorder_limit - b.backorder_held - b.backorder_owed),
                       greatest(0, b.free - b.safety_stock)
                       + greatest(0, b.backorder_limit - b.backorder_held - b.backorder_owed)
                       < p_quantities[1]
                       AND NOT EXISTS (SELECT 1 FROM stock_unit u
                                       WHERE u.tenant_id = p_tenant AND u.bucket_id = v_bucket)
                       AND NOT EXISTS (SELECT 1 FROM reservation_line l
                                       WHERE l.tenant_id = p_tenant AND l.bucket_id = v_bucket
                                         AND l.held AND l.expires_at <= v_cut)
                INTO v_free, v_sold_out
                FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.bucket_id = v_bucket;
            END IF;
            v_buckets := ARRAY[v_bucket];
            v_strategies := ARRAY[v_strategy];
            v_los := ARRAY[v_lo];
            v_his := ARRAY[v_hi];
        ELSE
            v_missing := jsonb_build_array(jsonb_build_object(
                'sku', p_skus[1], 'location', p_locations[1]));
        END IF;
    ELSE
        SELECT array_agg(b.bucket_id ORDER BY u.ord), array_agg(b.strategy ORDER BY u.ord),
               array_agg(b.pool_lo ORDER BY u.ord), array_agg(b.pool_hi ORDER BY u.ord),
               array_agg(b.cart_limit ORDER BY u.ord),
               jsonb_agg(jsonb_build_object('sku', u.sku, 'location', u.loc) ORDER BY u.ord)
                   FILTER (WHERE b.bucket_id IS NULL)
        INTO v_buckets, v_strategies, v_los, v_his, v_limits, v_missing
        FROM unnest(p_skus, p_locations) WITH ORDINALITY AS u(sku, loc, ord)
        LEFT JOIN stock_bucket b
          ON b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc;
    END IF;
    IF v_missing IS NOT NULL THEN
        PERFORM tenant_require_v1(p_tenant);
        RAISE EXCEPTION 'unknown stock' USING ERRCODE = 'PR404', DETAIL = v_missing::text;
    END IF;

    -- A cart over a SKU's per-cart limit (each bucket row carries its SKU's
    -- limit, read above with the bucket), then a frozen tenant or bucket: the
    -- refusal is stored under the key like any answer. The freeze is read
    -- after the freeze lock, so a committed freeze is seen. Its EXISTS probe
    -- only spares the common case a function call; the answer is the
    -- refusal's own read, since a lift (which takes no lock) may commit
    -- between two statements, and each sees the newest commits.
    IF v_limit IS NOT NULL AND p_quantities[1] > v_limit THEN
        v_outcome := cart_limit_refusal_v1(p_skus, p_quantities, ARRAY[v_limit]);
    ELSIF v_limits IS NOT NULL AND array_remove(v_limits, NULL) <> '{}' THEN
        v_outcome := cart_limit_refusal_v1(p_skus, p_quantities, v_limits);
    END IF;
    IF v_outcome IS NULL AND EXISTS (SELECT 1 FROM stock_freeze f
               WHERE f.tenant_id = p_tenant AND f.lifted_at IS NULL
                 AND f.bucket_id = ANY (v_buckets || 0::bigint)) THEN
        v_outcome := freeze_refusal_v1(p_tenant, v_buckets);
    END IF;
    IF v_outcome IS NOT NULL THEN
        INSERT INTO request_ledger (tenant_id, request_key, operation, digest, status, outcome)
        VALUES (p_tenant, p_key, 'reserve', p_digest, 'rejected', v_outcome)
        ON CONFLICT (tenant_id, request_key) DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'request key % was committed by a concurrent request', p_key
                USING ERRCODE = 'PR409';
        END IF;
        RETURN v_outcome;
    END IF;

    IF v_sold_out THEN
        v_seen := ARRAY[greatest(0, v_free)];
        v_short := ARRAY[1];
    ELSE
        -- A cart of several lines keeps its pool units locked and deletes
        -- them only once every line is held: a short line then leaves the
        -- pool as it was, instead of putting units back as new rows that a
        -- waiting buyer cannot see.
        FOR i IN 1 .. cardinality(v_buckets) LOOP
            -- p_now, not v_now: a take that waited judges expiry when it decides
            v_take := bucket_take_v1(p_tenant, v_buckets[i], p_quantities[i], p_now,
                                     v_strategies[i], v_los[i], v_his[i],
                                     cardinality(v_buckets) > 1);
            IF v_take.ok THEN
                v_from_free := v_from_free || v_take.from_free;
                v_backordered := v_backordered || 0;
                IF v_take.units IS NOT NULL THEN
                    v_unit_buckets := v_unit_buckets
                                      || array_fill(v_buckets[i], ARRAY[cardinality(v_take.units)]);
                    v_unit_ids := v_unit_ids || v_take.units;
                END IF;
                CONTINUE;
            END IF;
            -- short: the rest from the bucket's backorder allowance, if it has one
            -- (policy.sql; a short take took nothing)
            v_bo := bucket_backorder_take_v1(p_tenant, v_buckets[i], p_quantities[i], p_now,
                                             cardinality(v_buckets) > 1);
            IF v_bo.ok THEN
                v_from_free := v_from_free || v_bo.from_free;
                v_backordered := v_backordered || v_bo.backordered;
                IF v_bo.units IS NOT NULL THEN
                    v_unit_buckets := v_unit_buckets
                                      || array_fill(v_buckets[i], ARRAY[cardinality(v_bo.units)]);
                    v_unit_ids := v_unit_ids || v_bo.units;
                END IF;
            ELSE
                v_from_free := v_from_free || 0;
                v_backordered := v_backordered || 0;
                v_short := v_short || i;
                v_seen := v_seen || coalesce(v_bo.seen_available, v_take.seen_available);
            END IF;
        END LOOP;
        -- the decision's instant, after any wait of the takes: a hold's life starts
        -- now (begun at the call's start, it could end before the caller is told)
        v_now := coalesce(p_now, clock_timestamp());
    END IF;

    IF v_short <> '{}' THEN
        -- Give back what the held lines took out of free (each such bucket's
        -- row lock is this transaction's); kept pool units are unlocked at
        -- commit.
        FOR i IN 1 .. cardinality(v_from_free) LOOP
            IF v_from_free[i] > 0 OR v_backordered[i] > 0 THEN
                -- (and the backorder allowance they took)
                UPDATE stock_bucket SET free = free + v_from_free[i],
                                        backorder_held = backorder_held - v_backordered[i]
                WHERE tenant_id = p_tenant AND bucket_id = v_buckets[i];
            END IF;
        END LOOP;
        IF cardinality(v_short) = 1 AND v_seen[1] IS NOT NULL THEN
            -- the usual case, built without a query
            v_outcome := jsonb_build_array(jsonb_build_object(
                'sku', p_skus[v_short[1]], 'location', p_locations[v_short[1]],
                'requested', p_quantities[v_short[1]], 'available', v_seen[1]));
        ELSE
            SELECT jsonb_agg(jsonb_build_object(
                       'sku', p_skus[k], 'location', p_locations[k],
                       'requested', p_quantities[k],
                       'available',
                       coalesce(seen, (bucket_view_v1(p_tenant, v_buckets[k], v_now)
                                       ->> 'available')::bigint))
                       ORDER BY n)
            INTO v_outcome FROM unnest(v_short, v_seen) WITH ORDINALITY AS u(k, seen, n);
        END IF;
        v_status := 'rejected';
        v_outcome := jsonb_build_object('status', 'rejected', 'reason', 'insufficient_stock',
                                        'short_lines', v_outcome);
        -- A stored rejection commits durably like a hold: once the client has
        -- seen it, a crash must not let the same key hold later.
        -- (ledger_record_v1, inline)
        INSERT INTO request_ledger (tenant_id, request_key, operation, digest, status, outcome)
        VALUES (p_tenant, p_key, 'reserve', p_digest, v_status, v_outcome)
        ON CONFLICT (tenant_id, request_key) DO NOTHING;
    ELSE
        IF v_unit_ids <> '{}' THEN
            DELETE FROM stock_unit u
            USING unnest(v_unit_buckets, v_unit_ids) AS k(bucket, unit)
            WHERE u.tenant_id = p_tenant AND u.bucket_id = k.bucket AND u.unit_id = k.unit
              -- (as index conditions too: a join alone read the tenant's whole pool)
              AND u.bucket_id = ANY (v_unit_buckets) AND u.unit_id = ANY (v_unit_ids);
        END IF;
        v_id := gen_random_uuid();
        -- The same document reservation_view_v1 would read back, built from
        -- what is known here.
        -- (a line shows its backordered units only when it has some)
        IF cardinality(p_skus) = 1 AND v_backordered[1] = 0 THEN
            v_lines := jsonb_build_array(jsonb_build_object(
                'sku', p_skus[1], 'location', p_locations[1], 'quantity', p_quantities[1]));
        ELSE
            SELECT jsonb_agg(jsonb_build_object('sku', sku, 'location', loc, 'quantity', qty)
                             || CASE WHEN bo > 0 THEN jsonb_build_object('backordered', bo)
                                     ELSE '{}'::jsonb END
                             ORDER BY ord)
            INTO v_lines
            FROM unnest(p_skus, p_locations, p_quantities, v_backordered)
                 WITH ORDINALITY AS u(sku, loc, qty, bo, ord);
        END IF;
        v_view := jsonb_build_object(
            'id', v_id, 'status', 'active', 'created_at', v_now,
            'expires_at', v_now + p_ttl, 'claimed_at', NULL, 'released_at', NULL,
            'expired_at', NULL, 'lines', v_lines, 'reference', p_reference,
            'metadata', coalesce(p_metadata, '{}'));
        v_status := 'succeeded';
        v_outcome := jsonb_build_object('status', 'held', 'reservation', v_view);
        -- The hold, its lines, its event and its ledger row in one statement
        -- (one executor run instead of four; the lines' foreign key is
        -- checked at its end, when the reservation row is there).
        WITH held AS (
            INSERT INTO reservation (tenant_id, reservation_id, request_key, created_at,
                                     expires_at, reference, metadata)
            VALUES (p_tenant, v_id, p_key, v_now, v_now + p_ttl, p_reference,
                    coalesce(p_metadata, '{}'))
        ), held_lines AS (
            INSERT INTO reservation_line (tenant_id, reservation_id, line_no, bucket_id,
                                          quantity, expires_at, backordered)
            SELECT p_tenant, v_id, ord, bucket, qty, v_now + p_ttl, bo
            FROM unnest(v_buckets, p_quantities, v_backordered)
                 WITH ORDINALITY AS u(bucket, qty, bo, ord)
        ), event AS (
            INSERT INTO outbox_event (tenant_id, type, payload)
            VALUES (p_tenant, 'reservation.created', v_view)
        )
        INSERT INTO request_ledger (tenant_id, request_key, operation, digest, status, outcome)
        VALUES (p_tenant, p_key, 'reserve', p_digest, v_status, v_outcome)
        ON CONFLICT (tenant_id, request_key) DO NOTHING;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'request key % was committed by a concurrent request', p_key
            USING ERRCODE = 'PR409';
    END IF;
    RETURN v_outcome;
END $$;

-- Lock a reservation for a transition; raises PR410 (or PR401) when the
-- tenant has no such reservation.
CREATE OR REPLACE FUNCTION reservation_lock_v1(p_tenant bigint, p_id uuid) RETURNS reservation
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

-- Lock a reservation's lines (after its header: reservation_lock_v1) in line
-- order; true when every one is held. An active reservation before its expiry
-- holds every line; one that does not had its lines given up by a reserve after
-- it expired (bucket_reclaim_expired_v1 locks the lines, not the header), and
-- is expired whatever its header says.
CREATE OR REPLACE FUNCTION reservation_lines_held_v1(p_tenant bigint, p_id uuid)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM reservation_line
    WHERE tenant_id = p_tenant AND reservation_id = p_id
    ORDER BY line_no
    FOR UPDATE;
    RETURN NOT EXISTS (SELECT 1 FROM reservation_line
                       WHERE tenant_id = p_tenant AND reservation_id = p_id AND NOT held);
END $$;

-- Payment succeeded: deduct on_hand for every line, in one transaction with
-- the state change. A reservation past its expiry is claimed only if every
-- line that was given up can be taken again now.
CREATE OR REPLACE FUNCTION claim_v1(p_tenant bigint, p_id uuid, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET search_path FROM CURRENT
AS $$
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
        SELECT l.line_no, l.bucket_id, l.quantity, l.held,
               CASE WHEN l.held THEN l.backordered ELSE 0 END AS backordered,
               l.backordered AS line_backordered
        FROM reservation_line l
        JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
        WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id
        ORDER BY b.sku COLLATE "C", b.location COLLATE "C"
        FOR UPDATE OF l
    LOOP
        IF v_line.held THEN
            UPDATE reservation_line SET held = false
            WHERE tenant_id = p_tenant AND reservation_id = p_id AND line_no = v_line.line_no;
        ELSE
            -- Given up at expiry: take the units again, or fail the claim. The
            -- bucket row first (lock order: the bucket, then its units): a take
            -- holding pool units must not then wait for a stock change that holds
            -- the bucket and drains the pool (it waits for those units: deadlock).
            PERFORM 1 FROM stock_bucket
            WHERE tenant_id = p_tenant AND bucket_id = v_line.bucket_id
            FOR NO KEY UPDATE;
            IF NOT (bucket_take_v1(p_tenant, v_line.bucket_id, v_line.quantity, p_now)).ok THEN
                RAISE EXCEPTION 'reservation % expired and its stock is gone', p_id
                    USING ERRCODE = 'PR425';
            END IF;
            IF v_line.line_backordered <> 0 THEN
                -- all its units came from stock: none of the sale is owed, and the
                -- line (its reads, the claimed event) says so
                UPDATE reservation_line SET backordered = 0
                WHERE tenant_id = p_tenant AND reservation_id = p_id
                  AND line_no = v_line.line_no;
            END IF;
        END IF;
        -- A shortfall stays until receipts pay it back: claiming a hold whose
        -- units a forced correction found missing sells units still owed.
        -- Backordered units of a held line are sold too, but they are not on hand:
        -- they become owed until receipts cover them (a line given up at expiry
        -- and taken again above took all its units from stock).
        UPDATE stock_bucket
        SET on_hand = on_hand - (v_line.quantity - v_line.backordered),
            backorder_held = backorder_held - v_line.backordered,
            backorder_owed = backorder_owed + v_line.backordered,
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
CREATE OR REPLACE FUNCTION reservation_give_back_v1(p_tenant bigint, p_id uuid, p_reason text,
                                         p_now timestamptz)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_line record;
    v_units bigint := 0;
BEGIN
    FOR v_line IN
        SELECT l.line_no, l.bucket_id, l.quantity, l.backordered
        FROM reservation_line l
        JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
        WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id AND l.held
        ORDER BY b.sku COLLATE "C", b.location COLLATE "C"
        FOR UPDATE OF l
    LOOP
        UPDATE reservation_line SET held = false
        WHERE tenant_id = p_tenant AND reservation_id = p_id AND line_no = v_line.line_no;
        INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id,
                                    line_no, reason)
        VALUES (p_tenant, v_line.bucket_id, 'restore', v_line.quantity, p_id,
                v_line.line_no, p_reason);
        -- units on hand go back to stock, backordered ones to the allowance
        IF v_line.quantity > v_line.backordered THEN
            PERFORM bucket_give_back_v1(p_tenant, v_line.bucket_id,
                                        v_line.quantity - v_line.backordered, p_now);
        END IF;
        PERFORM bucket_backorder_give_back_v1(p_tenant, v_line.bucket_id, v_line.backordered);
        v_units := v_units + v_line.quantity;
    END LOOP;
    RETURN v_units;
END $$;

-- Payment failed or the checkout was cancelled.
CREATE OR REPLACE FUNCTION release_v1(p_tenant bigint, p_id uuid, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET search_path FROM CURRENT
AS $$
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

-- A new time to live for an active reservation, counted from now. An extend
-- that would end the hold sooner than it ends now is refused (PR427) unless
-- p_shorten asks for exactly that.
CREATE OR REPLACE FUNCTION extend_v2(p_tenant bigint, p_id uuid, p_ttl interval,
                          p_shorten boolean, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now timestamptz;
    v_res reservation;
    v_held boolean;
BEGIN
    v_res := reservation_lock_v1(p_tenant, p_id);
    -- Judged after the lock waits, the lines' too, and on the lines: a reserve may
    -- have given up this reservation's lines once it expired while this extend waited.
    v_held := reservation_lines_held_v1(p_tenant, p_id);
    v_now := coalesce(p_now, clock_timestamp());
    IF v_res.status <> 'active' OR v_res.expires_at <= v_now OR NOT v_held THEN
        RAISE EXCEPTION 'reservation % is not active', p_id USING ERRCODE = 'PR426',
            DETAIL = CASE WHEN v_res.status = 'active' THEN 'expired' ELSE v_res.status END;
    END IF;
    IF NOT p_shorten AND v_now + p_ttl < v_res.expires_at THEN
        RAISE EXCEPTION 'reservation % expires at %, later than % from now; '
                        'set allow_shorten to end it sooner', p_id, v_res.expires_at, p_ttl
            USING ERRCODE = 'PR427', DETAIL = v_res.expires_at::text;
    END IF;
    -- Lines carry expires_at too (the reserve path reclaims by line); the
    -- header and line locks are held, so nothing interleaves. Every line is held.
    UPDATE reservation_line SET expires_at = v_now + p_ttl
    WHERE tenant_id = p_tenant AND reservation_id = p_id;
    UPDATE reservation SET expires_at = v_now + p_ttl
    WHERE tenant_id = p_tenant AND reservation_id = p_id;
    RETURN reservation_view_v1(p_tenant, p_id, v_now);
END $$;

-- (kept for processes of the previous release during an upgrade: an extend
-- that may shorten, as extends were then)
CREATE OR REPLACE FUNCTION extend_v1(p_tenant bigint, p_id uuid, p_ttl interval,
                          p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE sql AS $$ SELECT extend_v2(p_tenant, p_id, p_ttl, true, p_now) $$;

-- The sweeper: expire up to p_batch due reservations in one transaction.
-- Headers are taken with SKIP LOCKED (several sweepers run at once; the
-- locking read re-checks status and expiry on the latest row version). Their
-- held lines are then locked and their buckets written in one order for the
-- whole batch, (tenant, sku, location), the order carts take buckets in: a
-- batch of many reservations never holds one bucket while waiting for an
-- earlier one. `p_tenant` (NULL: every tenant) and `p_before` (NULL: now) narrow the
-- reservations expired to one tenant's, due before that instant (reconcile's repair).
CREATE OR REPLACE FUNCTION expire_due_v2(p_batch integer, p_now timestamptz DEFAULT NULL,
                                         p_tenant bigint DEFAULT NULL,
                                         p_before timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_tenants bigint[];
    v_ids uuid[];
    v_bucket record;
BEGIN
    SELECT array_agg(tenant_id), array_agg(reservation_id) INTO v_tenants, v_ids
    FROM (SELECT tenant_id, reservation_id FROM reservation
          WHERE status = 'active' AND expires_at <= least(v_now, coalesce(p_before, v_now))
            AND (p_tenant IS NULL OR tenant_id = p_tenant)
          ORDER BY expires_at
          LIMIT p_batch
          FOR UPDATE SKIP LOCKED) due;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_bucket IN
        WITH due AS (
            SELECT l.tenant_id, l.reservation_id, l.line_no, l.bucket_id, l.quantity,
                   l.backordered, b.sku, b.location
            FROM unnest(v_tenants, v_ids) AS r(tenant_id, reservation_id)
            JOIN reservation_line l
              ON l.tenant_id = r.tenant_id AND l.reservation_id = r.reservation_id
            JOIN stock_bucket b ON b.tenant_id = l.tenant_id AND b.bucket_id = l.bucket_id
            -- (the arrays again as index conditions: a young plan hashed every held line)
            WHERE l.held AND l.tenant_id = ANY (v_tenants) AND l.reservation_id = ANY (v_ids)
            ORDER BY l.tenant_id, b.sku COLLATE "C", b.location COLLATE "C", l.reservation_id,
                     l.line_no
            FOR UPDATE OF l
        ), given_up AS (
            UPDATE reservation_line l SET held = false
            FROM due
            WHERE (l.tenant_id, l.reservation_id, l.line_no)
                = (due.tenant_id, due.reservation_id, due.line_no)
        ), logged AS (
            INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id,
                                        line_no, reason)
            SELECT tenant_id, bucket_id, 'restore', quantity, reservation_id, line_no,
                   'expired'
            FROM due
        )
        SELECT tenant_id, bucket_id, sum(quantity - backordered)::integer AS quantity,
               sum(backordered) AS backordered
        FROM due
        GROUP BY tenant_id, bucket_id, sku, location
        ORDER BY tenant_id, sku COLLATE "C", location COLLATE "C"
    LOOP
        -- units on hand go back to stock, backordered ones to the allowance
        IF v_bucket.quantity > 0 THEN
            PERFORM bucket_give_back_v1(v_bucket.tenant_id, v_bucket.bucket_id,
                                        v_bucket.quantity, v_now);
        END IF;
        PERFORM bucket_backorder_give_back_v1(v_bucket.tenant_id, v_bucket.bucket_id,
                                              v_bucket.backordered);
    END LOOP;
    UPDATE reservation r SET status = 'expired', expired_at = v_now
    FROM unnest(v_tenants, v_ids) AS d(tenant_id, reservation_id)
    WHERE r.tenant_id = d.tenant_id AND r.reservation_id = d.reservation_id
      AND r.tenant_id = ANY (v_tenants) AND r.reservation_id = ANY (v_ids);
    INSERT INTO outbox_event (tenant_id, type, payload)
    SELECT d.tenant_id, 'reservation.expired',
           reservation_view_v1(d.tenant_id, d.reservation_id, v_now)
    FROM unnest(v_tenants, v_ids) WITH ORDINALITY AS d(tenant_id, reservation_id, n)
    ORDER BY d.n;
    RETURN cardinality(v_ids);
END $$;

-- The sweeper's call (every tenant, whatever is due now)
CREATE OR REPLACE FUNCTION expire_due_v1(p_batch integer, p_now timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE sql AS $$ SELECT expire_due_v2(p_batch, p_now) $$;

-- Claim, release or extend under a request key (the HTTP Idempotency-Key).
-- The transition and its stored outcome commit together, so a repeat with the
-- same key replays the first answer (even for extend, which is not idempotent
-- by state), and the same key with other parameters raises PR422. A failed
-- transition (PR4xx) rolls back and stores nothing.
CREATE OR REPLACE FUNCTION transition_keyed_v2(p_tenant bigint, p_key text, p_operation text,
                                    p_digest text, p_id uuid, p_ttl interval,
                                    p_shorten boolean, p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET search_path FROM CURRENT
AS $$
DECLARE
    v_replay jsonb;
    v_view jsonb;
    v_outcome jsonb;
BEGIN
    -- one key's requests one after another, first in the lock order, as a reserve's
    -- and a batch's: a request sent with the key while another runs is answered
    -- from what that one stores (its replay, or the key reused), never from the
    -- state it left the reservation in
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, p_tenant));
    v_replay := ledger_check_v1(p_tenant, p_key, p_operation, p_digest);
    IF v_replay IS NOT NULL THEN
        RETURN v_replay;
    END IF;
    v_view := CASE p_operation
        WHEN 'claim' THEN claim_v1(p_tenant, p_id, p_now)
        WHEN 'release' THEN release_v1(p_tenant, p_id, p_now)
        WHEN 'extend' THEN extend_v2(p_tenant, p_id, p_ttl, p_shorten, p_now)
    END;
    IF v_view IS NULL THEN
        RAISE EXCEPTION 'unknown operation %', p_operation USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_outcome := jsonb_build_object('status', 'applied', 'reservation', v_view);
    PERFORM ledger_record_v1(p_tenant, p_key, p_operation, p_digest, 'succeeded', v_outcome);
    RETURN v_outcome;
END $$;

-- (kept for processes of the previous release during an upgrade)
CREATE OR REPLACE FUNCTION transition_keyed_v1(p_tenant bigint, p_key text, p_operation text,
                                    p_digest text, p_id uuid, p_ttl interval,
                                    p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE sql AS $$
    SELECT transition_keyed_v2(p_tenant, p_key, p_operation, p_digest, p_id, p_ttl, true, p_now)
$$;
