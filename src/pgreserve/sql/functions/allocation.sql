-- Allocation across locations: the location priorities (tables of migration
-- 0010) and reserve_allocated_v1, the reserve of a cart with lines that name a
-- SKU and no location. Carts whose every line names its location never come
-- here (reserve_v1, bucket_batch_v1). (PL/pgSQL wherever a table of 0010 is
-- read: the function files are applied after every migration step, also before
-- 0010.)

-- The location order a SKU allocates in: its own list, else the tenant's, else
-- none (every location in name order).
CREATE OR REPLACE FUNCTION location_priority_of_v1(p_tenant bigint, p_sku text)
RETURNS text[] LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN coalesce(
        (SELECT locations FROM sku_location_priority WHERE tenant_id = p_tenant AND sku = p_sku),
        (SELECT locations FROM location_priority WHERE tenant_id = p_tenant),
        '{}'::text[]);
END $$;

-- The tenant's order ({"locations": [...]}; empty when never set).
CREATE OR REPLACE FUNCTION location_priority_get_v1(p_tenant bigint) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    RETURN jsonb_build_object('locations', to_jsonb(coalesce(
        (SELECT locations FROM location_priority WHERE tenant_id = p_tenant), '{}'::text[])));
END $$;

-- Set the tenant's order (an empty list: name order for every SKU without its own).
CREATE OR REPLACE FUNCTION location_priority_set_v1(p_tenant bigint, p_locations text[])
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    INSERT INTO location_priority (tenant_id, locations, updated_at)
    VALUES (p_tenant, p_locations, clock_timestamp())
    ON CONFLICT (tenant_id) DO UPDATE
        SET locations = excluded.locations, updated_at = excluded.updated_at;
    RETURN location_priority_get_v1(p_tenant);
END $$;

-- PUT /v1/skus/{sku}: the settings given (p_set_*), in one transaction. A NULL
-- priority removes the SKU's own order (the tenant's applies again). Returns the
-- SKU's settings.
CREATE OR REPLACE FUNCTION sku_update_v1(p_tenant bigint, p_sku text,
                                         p_set_limit boolean, p_limit integer,
                                         p_set_priority boolean, p_priority text[])
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    IF p_set_limit THEN
        PERFORM sku_limit_set_v1(p_tenant, p_sku, p_limit);
    END IF;
    IF p_set_priority AND p_priority IS NULL THEN
        DELETE FROM sku_location_priority WHERE tenant_id = p_tenant AND sku = p_sku;
    ELSIF p_set_priority THEN
        INSERT INTO sku_location_priority (tenant_id, sku, locations, updated_at)
        VALUES (p_tenant, p_sku, p_priority, clock_timestamp())
        ON CONFLICT (tenant_id, sku) DO UPDATE
            SET locations = excluded.locations, updated_at = excluded.updated_at;
    END IF;
    RETURN sku_settings_v1(p_tenant, p_sku);
END $$;

-- Hold a cart of explicit lines (p_skus/p_locations/p_quantities: a bucket
-- each, as reserve_v1 takes them) and allocated lines (p_alloc_*: a SKU each,
-- at most one line per SKU), all or nothing, under the request key.
--
-- An allocated line's candidates are the SKU's unfrozen buckets in priority
-- order. Unsplit, the whole line comes from the first candidate that can serve
-- it; split, as much as each candidate can serve, in that order. Where an
-- explicit line of the same SKU holds a candidate, the allocated units join its
-- line (one line per bucket): the bucket is taken once, for both.
--
-- Locks: every bucket of the cart (the explicit ones and all of each allocated
-- SKU's) is locked first, in (sku, location) order, the order every cart takes
-- buckets in; the takes then follow the priority order without waiting for a
-- bucket row, so carts allocated differently never wait for each other in a
-- cycle. (Units of a pool bucket other buyers hold are still waited for inside
-- bucket_take_v1, as in reserve_v1; PostgreSQL breaks such a cycle and the
-- victim is retried whole.) bucket_take_v1 does every take, so the row and
-- pool rules are those of every reserve; each bucket is taken at most once, as
-- a pool take does not skip the units this transaction already locked.
--
-- A short allocated line is refused only when one snapshot, taken after its
-- attempts, shows that no allowed allocation could serve it; otherwise the
-- stock moved meanwhile and the request is retried whole (40001).
--
-- Stock policy (policy.sql): the takes keep each bucket's safety stock. An
-- allocated line promises only units on hand; a bucket's backorder allowance
-- serves the explicit lines, as in reserve_v1, also where an allocated line takes
-- the same bucket with one (the units on hand go to both first, the allocated
-- part never waits on the allowance).
CREATE OR REPLACE FUNCTION reserve_allocated_v1(p_tenant bigint, p_key text, p_digest text,
                                     p_skus text[], p_locations text[],
                                     p_quantities integer[], p_alloc_skus text[],
                                     p_alloc_quantities integer[], p_splits boolean[],
                                     p_ttl interval, p_now timestamptz DEFAULT NULL,
                                     p_reference text DEFAULT NULL,
                                     p_metadata jsonb DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET enable_seqscan = off
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_cut timestamptz;
    v_replay jsonb;
    v_missing jsonb;
    v_missing_alloc jsonb;
    v_ex_buckets bigint[];
    v_ex_limits integer[];
    v_al_limits integer[];
    v_all bigint[];
    v_tenant_frozen boolean;
    v_frozen bigint[];
    v_refuse jsonb;
    v_outcome jsonb;
    v_prio text[];
    v_cands bigint[];
    v_c bigint;
    v_base integer;
    v_left integer;
    v_want integer;
    v_done boolean;
    v_take record;
    v_best bigint;
    v_total bigint;
    -- the takes, one per bucket: bucket, units, units out of free
    v_t_bucket bigint[] := '{}';
    v_t_qty integer[] := '{}';
    v_t_free integer[] := '{}';
    v_t_bo integer[] := '{}';
    v_bo record;
    v_bo_ok boolean;       -- an allocated line's take used the explicit line's allowance
    v_most integer;        -- the most an allocated part can have of a bucket, when known
    v_units bigint[];
    v_unit_buckets bigint[] := '{}';
    v_unit_ids bigint[] := '{}';
    v_short_ex jsonb := '[]';
    v_short_al jsonb := '[]';
    v_h_buckets bigint[];
    v_h_qty integer[];
    v_h_bo integer[];
    v_lines jsonb;
    v_view jsonb;
    v_id uuid;
    i integer;
BEGIN
    -- one key's requests one after another, the freeze lock shared (ledger.sql)
    v_replay := request_begin_v1(p_tenant, p_key, 'reserve', p_digest);
    IF v_replay IS NOT NULL THEN
        RETURN v_replay;
    END IF;

    SELECT coalesce(array_agg(b.bucket_id ORDER BY u.ord), '{}'),
           coalesce(array_agg(b.cart_limit ORDER BY u.ord), '{}'),
           jsonb_agg(jsonb_build_object('sku', u.sku, 'location', u.loc) ORDER BY u.ord)
               FILTER (WHERE b.bucket_id IS NULL)
    INTO v_ex_buckets, v_ex_limits, v_missing
    FROM unnest(p_skus, p_locations) WITH ORDINALITY AS u(sku, loc, ord)
    LEFT JOIN stock_bucket b
      ON b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc;
    SELECT jsonb_agg(jsonb_build_object('sku', u.sku, 'location', NULL) ORDER BY u.ord)
               FILTER (WHERE NOT l.known),
           array_agg(l.lim ORDER BY u.ord)
    INTO v_missing_alloc, v_al_limits
    FROM unnest(p_alloc_skus) WITH ORDINALITY AS u(sku, ord),
    LATERAL (SELECT min(b.cart_limit) AS lim, count(*) > 0 AS known FROM stock_bucket b
             WHERE b.tenant_id = p_tenant AND b.sku = u.sku) l;
    IF v_missing IS NOT NULL OR v_missing_alloc IS NOT NULL THEN
        PERFORM tenant_require_v1(p_tenant);
        RAISE EXCEPTION 'unknown stock' USING ERRCODE = 'PR404',
            DETAIL = (coalesce(v_missing, '[]') || coalesce(v_missing_alloc, '[]'))::text;
    END IF;
    SELECT v_ex_buckets || coalesce(array_agg(b.bucket_id), '{}') INTO v_all
    FROM stock_bucket b WHERE b.tenant_id = p_tenant AND b.sku = ANY (p_alloc_skus);

    -- Refusals by rule, stored under the key like any answer: a SKU over its
    -- per-cart limit (explicit and allocated units together), then a frozen
    -- tenant, an explicit line's frozen bucket, or an allocated line whose every
    -- location is frozen. Frozen buckets are no candidates of an allocation.
    v_outcome := cart_limit_refusal_v1(p_skus || p_alloc_skus, p_quantities || p_alloc_quantities,
                                       v_ex_limits || v_al_limits);
    SELECT coalesce(bool_or(f.bucket_id = 0), false),
           coalesce(array_agg(f.bucket_id) FILTER (WHERE f.bucket_id <> 0), '{}')
    INTO v_tenant_frozen, v_frozen
    FROM stock_freeze f
    WHERE f.tenant_id = p_tenant AND f.lifted_at IS NULL AND f.bucket_id = ANY (v_all || 0::bigint);
    IF v_outcome IS NULL AND v_tenant_frozen THEN
        v_outcome := jsonb_build_object('status', 'rejected', 'reason', 'tenant_frozen',
                                        'frozen_lines', '[]'::jsonb);
    ELSIF v_outcome IS NULL AND v_frozen <> '{}' THEN
        SELECT jsonb_agg(jsonb_build_object('sku', b.sku, 'location', b.location)
                         ORDER BY b.sku COLLATE "C", b.location COLLATE "C")
        INTO v_refuse
        FROM stock_bucket b
        WHERE b.tenant_id = p_tenant AND b.bucket_id = ANY (v_frozen)
          AND (b.bucket_id = ANY (v_ex_buckets)
               OR (b.sku = ANY (p_alloc_skus)
                   AND NOT EXISTS (SELECT 1 FROM stock_bucket o
                                   WHERE o.tenant_id = p_tenant AND o.sku = b.sku
                                     AND o.bucket_id <> ALL (v_frozen))));
        IF v_refuse IS NOT NULL THEN
            v_outcome := jsonb_build_object('status', 'rejected', 'reason', 'bucket_frozen',
                                            'frozen_lines', v_refuse);
        END IF;
    END IF;
    IF v_outcome IS NOT NULL THEN
        PERFORM ledger_record_v1(p_tenant, p_key, 'reserve', p_digest, 'rejected', v_outcome);
        RETURN v_outcome;
    END IF;

    PERFORM 1 FROM stock_bucket b
    WHERE b.tenant_id = p_tenant AND b.bucket_id = ANY (v_all) AND b.bucket_id <> ALL (v_frozen)
    ORDER BY b.sku COLLATE "C", b.location COLLATE "C"
    FOR NO KEY UPDATE;

    FOR i IN 1 .. coalesce(cardinality(p_alloc_skus), 0) LOOP
        v_prio := location_priority_of_v1(p_tenant, p_alloc_skus[i]);
        SELECT array_agg(b.bucket_id ORDER BY array_position(v_prio, b.location COLLATE "C"),
                         b.location COLLATE "C")
        INTO v_cands
        FROM stock_bucket b
        WHERE b.tenant_id = p_tenant AND b.sku = p_alloc_skus[i]
          AND b.bucket_id <> ALL (v_frozen);
        v_left := p_alloc_quantities[i];
        FOREACH v_c IN ARRAY coalesce(v_cands, '{}') LOOP
            -- units an explicit line of the SKU asks of this bucket
            v_base := coalesce(p_quantities[array_position(v_ex_buckets, v_c)], 0);
            v_want := v_left;
            LOOP
                -- p_now, not v_now: a take that waited judges expiry when it decides
                v_take := bucket_take_v1(p_tenant, v_c, v_base + v_want, p_now,
                                         NULL, NULL, NULL, true);
                v_bo_ok := false;
                v_most := NULL;
                IF NOT v_take.ok AND v_base > 0 THEN
                    -- The explicit line's part may come from the bucket's backorder
                    -- allowance (units on hand first), the allocated part may not.
                    v_bo := bucket_backorder_take_v1(p_tenant, v_c, v_base + v_want, p_now,
                                                     true);
                    IF v_bo.ok AND v_bo.backordered > v_base THEN
                        -- it would backorder allocated units: give the take back (its
                        -- pool units stay locked by us, not taken). What it found on
                        -- hand is the most the allocated part can have here.
                        UPDATE stock_bucket SET free = free + v_bo.from_free,
                                                backorder_held = backorder_held - v_bo.backordered
                        WHERE tenant_id = p_tenant AND bucket_id = v_c;
                        v_most := v_bo.from_free + coalesce(cardinality(v_bo.units), 0);
                    ELSIF v_bo.ok THEN
                        v_bo_ok := true;
                    ELSE
                        -- on hand S, on hand and allowance S + A: the allocated part
                        -- can have S less the explicit part the allowance cannot cover
                        -- (no allowance: the backorder take saw nothing, and S + A
                        -- is S)
                        v_most := least(coalesce(v_take.seen_available, 0),
                                        coalesce(v_bo.seen_available, v_take.seen_available, 0)
                                        - v_base);
                    END IF;
                END IF;
                IF v_take.ok OR v_bo_ok THEN
                    v_t_bucket := v_t_bucket || v_c;
                    v_t_qty := v_t_qty || (v_base + v_want);
                    IF v_take.ok THEN
                        v_t_free := v_t_free || v_take.from_free;
                        v_t_bo := v_t_bo || 0;
                        v_units := v_take.units;
                    ELSE
                        v_t_free := v_t_free || v_bo.from_free;
                        v_t_bo := v_t_bo || v_bo.backordered;
                        v_units := v_bo.units;
                    END IF;
                    IF v_units IS NOT NULL THEN
                        v_unit_buckets := v_unit_buckets
                                          || array_fill(v_c, ARRAY[cardinality(v_units)]);
                        v_unit_ids := v_unit_ids || v_units;
                    END IF;
                    v_left := v_left - v_want;
                    EXIT;
                END IF;
                EXIT WHEN NOT p_splits[i];
                -- split: what this bucket could serve, less each time (so it ends)
                v_want := least(v_want - 1,
                                coalesce(v_most, coalesce(v_take.seen_available, 0) - v_base));
                EXIT WHEN v_want <= 0;
            END LOOP;
            EXIT WHEN v_left = 0;
        END LOOP;
        CONTINUE WHEN v_left = 0;

        -- Short. One snapshot judges it: what each candidate has for this cart
        -- (its own takes there given back in thought), less what the cart's
        -- explicit line asks of it there.
        v_cut := coalesce(p_now, clock_timestamp());
        SELECT coalesce(max(a.spare), 0), coalesce(sum(a.spare), 0) INTO v_best, v_total
        -- (units on hand beyond the safety stock, as bucket_view_v1 counts them)
        FROM (SELECT greatest(0, p.pool
                                 + greatest(0, b.free
                                    + coalesce(v_t_free[array_position(v_t_bucket, b.bucket_id)], 0)
                                    + greatest(0, e.expired - e.backordered - b.shortfall)
                                    - b.safety_stock)
                                 -- less the cart's explicit line there, as far as
                                 -- the bucket's backorder allowance (this cart's own
                                 -- use of it given back in thought) cannot serve it
                                 - greatest(0, coalesce(p_quantities[array_position(
                                                   v_ex_buckets, b.bucket_id)], 0)
                                      - greatest(0, b.backorder_limit - b.backorder_held
                                                    - b.backorder_owed
                                                    + coalesce(v_t_bo[array_position(
                                                          v_t_bucket, b.bucket_id)], 0))))
                     AS spare
              FROM stock_bucket b,
              LATERAL (SELECT coalesce(sum(l.quantity), 0) AS expired,
                              coalesce(sum(l.backordered), 0) AS backordered
                       FROM reservation_line l
                       WHERE l.tenant_id = p_tenant AND l.bucket_id = b.bucket_id
                         AND l.held AND l.expires_at <= v_cut) e,
              LATERAL (SELECT count(*) AS pool FROM stock_unit u
                       WHERE u.tenant_id = p_tenant AND u.bucket_id = b.bucket_id) p
              WHERE b.tenant_id = p_tenant AND b.bucket_id = ANY (v_cands)) a;
        IF (p_splits[i] AND v_total >= p_alloc_quantities[i])
           OR (NOT p_splits[i] AND v_best >= p_alloc_quantities[i]) THEN
            RAISE EXCEPTION 'the stock of SKU % moved while it was allocated: retry',
                p_alloc_skus[i] USING ERRCODE = 'serialization_failure';
        END IF;
        v_short_al := v_short_al || jsonb_build_array(jsonb_build_object(
            'sku', p_alloc_skus[i], 'location', NULL, 'requested', p_alloc_quantities[i],
            'available', CASE WHEN p_splits[i] THEN v_total ELSE v_best END));
    END LOOP;

    -- explicit lines whose bucket no allocated line took with them
    FOR i IN 1 .. coalesce(cardinality(v_ex_buckets), 0) LOOP
        CONTINUE WHEN v_ex_buckets[i] = ANY (v_t_bucket);
        v_take := bucket_take_v1(p_tenant, v_ex_buckets[i], p_quantities[i], p_now,
                                 NULL, NULL, NULL, true);
        IF v_take.ok THEN
            v_t_bucket := v_t_bucket || v_ex_buckets[i];
            v_t_qty := v_t_qty || p_quantities[i];
            v_t_free := v_t_free || v_take.from_free;
            v_t_bo := v_t_bo || 0;
            IF v_take.units IS NOT NULL THEN
                v_unit_buckets := v_unit_buckets
                                  || array_fill(v_ex_buckets[i], ARRAY[cardinality(v_take.units)]);
                v_unit_ids := v_unit_ids || v_take.units;
            END IF;
            CONTINUE;
        END IF;
        -- short: the rest from the bucket's backorder allowance, as reserve_v1 does
        v_bo := bucket_backorder_take_v1(p_tenant, v_ex_buckets[i], p_quantities[i], p_now,
                                         true);
        IF v_bo.ok THEN
            v_t_bucket := v_t_bucket || v_ex_buckets[i];
            v_t_qty := v_t_qty || p_quantities[i];
            v_t_free := v_t_free || v_bo.from_free;
            v_t_bo := v_t_bo || v_bo.backordered;
            IF v_bo.units IS NOT NULL THEN
                v_unit_buckets := v_unit_buckets
                                  || array_fill(v_ex_buckets[i], ARRAY[cardinality(v_bo.units)]);
                v_unit_ids := v_unit_ids || v_bo.units;
            END IF;
        ELSE
            v_short_ex := v_short_ex || jsonb_build_array(jsonb_build_object(
                'sku', p_skus[i], 'location', p_locations[i], 'requested', p_quantities[i],
                'available', coalesce(v_bo.seen_available, v_take.seen_available)));
        END IF;
    END LOOP;

    IF v_short_ex <> '[]' OR v_short_al <> '[]' THEN
        -- give back what the takes took out of free (the bucket locks are ours);
        -- kept pool units are unlocked at commit
        FOR i IN 1 .. cardinality(v_t_bucket) LOOP
            IF v_t_free[i] > 0 OR v_t_bo[i] > 0 THEN
                UPDATE stock_bucket SET free = free + v_t_free[i],
                                        backorder_held = backorder_held - v_t_bo[i]
                WHERE tenant_id = p_tenant AND bucket_id = v_t_bucket[i];
            END IF;
        END LOOP;
        v_outcome := jsonb_build_object('status', 'rejected', 'reason', 'insufficient_stock',
                                        'short_lines', v_short_ex || v_short_al);
        PERFORM ledger_record_v1(p_tenant, p_key, 'reserve', p_digest, 'rejected', v_outcome);
        RETURN v_outcome;
    END IF;

    IF cardinality(v_t_bucket) > 100 THEN
        RAISE EXCEPTION 'the allocation needs % locations; a reservation holds at most 100 lines',
            cardinality(v_t_bucket) USING ERRCODE = 'PR400';
    END IF;
    IF v_unit_ids <> '{}' THEN
        DELETE FROM stock_unit u
        USING unnest(v_unit_buckets, v_unit_ids) AS k(bucket, unit)
        WHERE u.tenant_id = p_tenant AND u.bucket_id = k.bucket AND u.unit_id = k.unit
          -- (as index conditions too: a join alone read the tenant's whole pool)
          AND u.bucket_id = ANY (v_unit_buckets) AND u.unit_id = ANY (v_unit_ids);
    END IF;
    -- the hold's life starts now, after any wait for units or locks above (begun
    -- at the call's start, it could end before the caller is told it is held)
    v_now := coalesce(p_now, clock_timestamp());
    -- one line per bucket, in (sku, location) order
    -- (a line shows its backordered units only when it has some)
    SELECT jsonb_agg(jsonb_build_object('sku', b.sku, 'location', b.location, 'quantity', t.qty)
                     || CASE WHEN t.bo > 0 THEN jsonb_build_object('backordered', t.bo)
                             ELSE '{}'::jsonb END
                     ORDER BY b.sku COLLATE "C", b.location COLLATE "C"),
           array_agg(t.bucket ORDER BY b.sku COLLATE "C", b.location COLLATE "C"),
           array_agg(t.qty ORDER BY b.sku COLLATE "C", b.location COLLATE "C"),
           array_agg(t.bo ORDER BY b.sku COLLATE "C", b.location COLLATE "C")
    INTO v_lines, v_h_buckets, v_h_qty, v_h_bo
    FROM unnest(v_t_bucket, v_t_qty, v_t_bo) AS t(bucket, qty, bo)
    JOIN stock_bucket b ON b.tenant_id = p_tenant AND b.bucket_id = t.bucket;
    v_id := gen_random_uuid();
    v_view := jsonb_build_object(
        'id', v_id, 'status', 'active', 'created_at', v_now,
        'expires_at', v_now + p_ttl, 'claimed_at', NULL, 'released_at', NULL,
        'expired_at', NULL, 'lines', v_lines, 'reference', p_reference,
        'metadata', coalesce(p_metadata, '{}'));
    v_outcome := jsonb_build_object('status', 'held', 'reservation', v_view);
    INSERT INTO reservation (tenant_id, reservation_id, request_key, created_at, expires_at,
                             reference, metadata)
    VALUES (p_tenant, v_id, p_key, v_now, v_now + p_ttl, p_reference,
            coalesce(p_metadata, '{}'));
    INSERT INTO reservation_line (tenant_id, reservation_id, line_no, bucket_id, quantity,
                                  expires_at, backordered)
    SELECT p_tenant, v_id, ord, bucket, qty, v_now + p_ttl, bo
    FROM unnest(v_h_buckets, v_h_qty, v_h_bo) WITH ORDINALITY AS u(bucket, qty, bo, ord);
    INSERT INTO outbox_event (tenant_id, type, payload)
    VALUES (p_tenant, 'reservation.created', v_view);
    PERFORM ledger_record_v1(p_tenant, p_key, 'reserve', p_digest, 'succeeded', v_outcome);
    RETURN v_outcome;
END $$;
