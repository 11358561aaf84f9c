-- Group commit for one bucket: many requests, one transaction, one write of
-- the bucket row. The service's combiner (core/batching.py) sends the
-- requests of one bucket that queued while its previous batch was in flight.
--
-- Requests are one-line reserves of this bucket; claims, releases and the
-- sweeper's expiries of reservations whose only line is on it; and refills of
-- its pool (p_kinds 'reserve' | 'claim' | 'release' | 'expire' | 'refill'),
-- decided one by one in arrival order, in memory, with no exception per
-- request (a PL/pgSQL EXCEPTION block is a subtransaction). A refill runs
-- once, after every other request of the batch is written.
-- Element i of the result is request i's own answer:
--   {"ok": doc}        the document reserve_v1 / claim_v1 / release_v1 (or,
--                      under a request key, transition_keyed_v2) returns
--   {"error": code, "message": text, "detail": ...}   a typed failure (PR4xx),
--                      nothing written for that request
--   {"retry": true}    not decidable here (a reservation of several lines, a
--                      shortage that units other transactions hold might
--                      cover, a request key or reservation another transaction
--                      holds): the caller sends it alone, unbatched
--   {"deferred": true} not decided: it came after a request answered retry.
--                      Deciding it here would put it before that request,
--                      which would break arrival order (a later request taking
--                      the stock an earlier short one could have had, a key
--                      repeated after it bound to the repeat). The combiner
--                      sends it in a later batch, once the retried request
--                      has been answered alone. Nothing is written for it.
--   {"skipped": true}  an expiry of a reservation no longer due (claimed,
--                      released, expired or extended meanwhile)
--   {"ok": {"added": n}}  a refill: n units put into the pool
--
-- Lock order, as everywhere: request keys (advisory), the reservations to claim
-- or release (by id), their lines, the bucket row, then units and the
-- insert-only tables. The keys and the reservations are taken without waiting:
-- a request whose key or reservation another transaction holds is answered
-- retry (sent alone, where it waits for its own lock), so one request's lock
-- wait never holds its batch mates.
-- p_references and p_metadata (each reserve's reference and metadata; NULL: none)
-- came later, with defaults, so a call without them still resolves to this one
-- function (migration 0007 dropped the signature without them).
CREATE OR REPLACE FUNCTION bucket_batch_v1(p_tenant bigint, p_bucket bigint, p_kinds text[],
                                           p_keys text[], p_digests text[],
                                           p_quantities integer[], p_ttls interval[],
                                           p_ids uuid[], p_now timestamptz DEFAULT NULL,
                                           p_references text[] DEFAULT NULL,
                                           p_metadata jsonb[] DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_now timestamptz;
    v_n integer := cardinality(p_kinds);
    v_out jsonb[] := array_fill(NULL::jsonb, ARRAY[cardinality(p_kinds)]);
    v_void text;
    b stock_bucket;
    -- the reservations to claim or release, locked, in id order
    r_ids uuid[];
    r_status text[];
    r_created timestamptz[];
    r_expires timestamptz[];
    r_claimed timestamptz[];
    r_released timestamptz[];
    r_expired timestamptz[];
    r_reference text[];
    r_metadata jsonb[];
    r_lines integer[];
    r_bucket bigint[];
    r_qty integer[];
    r_held boolean[];
    r_line integer[];
    r_backordered integer[];
    r_locked integer[];       -- how many of its lines this batch locked
    v_line_ids uuid[];        -- the lines locked, by their reservation's id
    -- stored outcomes by key (grows as the batch decides: a repeat replays)
    k_keys text[];
    k_ops text[];
    k_digests text[];
    k_outcomes jsonb[];
    -- the bucket as the batch changes it
    v_free bigint;
    v_units bigint := 0;      -- pool units this batch deleted and has not used yet
    v_shortfall bigint;
    v_safety bigint;          -- units of free never promised (policy.sql)
    v_dfree bigint := 0;
    v_don_hand bigint := 0;
    v_dshortfall bigint := 0;
    v_looked boolean := false;
    v_frozen jsonb;           -- the refusal of every reserve, when frozen
    v_limited jsonb;          -- this reserve's refusal, when over the per-cart limit
    v_others boolean := false;
    v_refill boolean := false;
    v_stop boolean := false;  -- a request was answered retry: the rest are deferred
    v_wait_at integer;        -- the first request whose key another transaction holds
    v_busy_ids uuid[];        -- reservations to claim or release locked elsewhere
    -- what the batch writes, set-based at the end
    h_ids uuid[] := '{}';
    h_keys text[] := '{}';
    h_qty integer[] := '{}';
    h_expires timestamptz[] := '{}';
    h_views jsonb[] := '{}';
    h_references text[] := '{}';
    h_metadata jsonb[] := '{}';
    l_keys text[] := '{}';
    l_ops text[] := '{}';
    l_digests text[] := '{}';
    l_status text[] := '{}';
    l_outcomes jsonb[] := '{}';
    t_ids uuid[] := '{}';
    t_kinds text[] := '{}';
    t_qty integer[] := '{}';
    t_views jsonb[] := '{}';
    t_given_up boolean[] := '{}';
    v_lines jsonb;
    v_view jsonb;
    v_doc jsonb;
    v_id uuid;
    v_q integer;
    v_w bigint;
    i integer;
    j integer;
BEGIN
    -- A batch waits for no request's own lock: a request key another transaction
    -- holds (the same key in flight elsewhere, a caller's open transaction) makes
    -- that request the batch's stop (retry: its caller waits for the key alone,
    -- unbatched) instead of holding every request of the batch until lock_timeout.
    SELECT min(n) INTO v_wait_at
    FROM unnest(p_keys) WITH ORDINALITY AS u(k, n)
    WHERE k IS NOT NULL AND NOT pg_try_advisory_xact_lock(hashtextextended(k, p_tenant));
    -- A batch that may create holds takes the tenant's freeze lock shared
    -- (freeze.sql) and reads the live freezes under it, below.
    IF 'reserve' = ANY (p_kinds) THEN
        v_void := pg_advisory_xact_lock_shared(1885827686, freeze_lock_key_v1(p_tenant))::text;
    END IF;

    -- (reserves and refills name no reservation: a batch of them looks none up)
    IF NOT p_kinds <@ ARRAY['reserve', 'refill'] THEN
        SELECT array_agg(reservation_id), array_agg(status), array_agg(created_at),
               array_agg(expires_at), array_agg(claimed_at), array_agg(released_at),
               array_agg(expired_at), array_agg(reference), array_agg(metadata)
        INTO r_ids, r_status, r_created, r_expires, r_claimed, r_released, r_expired,
             r_reference, r_metadata
        FROM (SELECT * FROM reservation
              WHERE tenant_id = p_tenant
                AND reservation_id = ANY (ARRAY(
                        SELECT x FROM unnest(p_ids, p_kinds) AS u(x, k)
                        WHERE x IS NOT NULL AND k <> 'expire'))
              ORDER BY reservation_id
              FOR UPDATE SKIP LOCKED) r;
        -- ... nor for a reservation another transaction has locked (a change in
        -- flight, a caller's open transaction): its claim or release is the stop
        IF coalesce(cardinality(r_ids), 0) < (SELECT count(DISTINCT x)
                                              FROM unnest(p_ids, p_kinds) AS u(x, k)
                                              WHERE x IS NOT NULL AND k <> 'expire') THEN
            SELECT array_agg(reservation_id) INTO v_busy_ids
            FROM reservation
            WHERE tenant_id = p_tenant
              AND reservation_id = ANY (ARRAY(
                      SELECT x FROM unnest(p_ids, p_kinds) AS u(x, k)
                      WHERE x IS NOT NULL AND k <> 'expire'))
              AND reservation_id <> ALL (coalesce(r_ids, '{}'));
        END IF;
        -- The sweeper's expiries wait for no one either (as expire_due_v1's SKIP
        -- LOCKED): one locked elsewhere is skipped and found due again by the
        -- next sweep.
        SELECT r_ids || array_agg(reservation_id), r_status || array_agg(status),
               r_created || array_agg(created_at), r_expires || array_agg(expires_at),
               r_claimed || array_agg(claimed_at), r_released || array_agg(released_at),
               r_expired || array_agg(expired_at), r_reference || array_agg(reference),
               r_metadata || array_agg(metadata)
        INTO r_ids, r_status, r_created, r_expires, r_claimed, r_released, r_expired,
             r_reference, r_metadata
        FROM (SELECT * FROM reservation
              WHERE tenant_id = p_tenant
                AND reservation_id = ANY (ARRAY(
                        SELECT x FROM unnest(p_ids, p_kinds) AS u(x, k) WHERE k = 'expire'))
                AND reservation_id <> ALL (coalesce(r_ids, '{}'))
              ORDER BY reservation_id
              FOR UPDATE SKIP LOCKED) r;  -- none: array_agg is NULL, || keeps r_*
    END IF;
    IF r_ids IS NOT NULL THEN
        -- Their lines, without waiting either: a line another transaction holds
        -- (a take giving an expired hold up, a caller's open transaction, on this
        -- bucket or on the one a changed cart moved to) makes its reservation's
        -- claim or release the batch's stop and its expiry skipped, below; waited
        -- for here, the lock would hold every request of the batch.
        SELECT array_agg(reservation_id) INTO v_line_ids
        FROM (SELECT reservation_id FROM reservation_line
              WHERE tenant_id = p_tenant AND reservation_id = ANY (r_ids)
              ORDER BY reservation_id, line_no
              FOR UPDATE SKIP LOCKED) x;
        SELECT array_agg(coalesce(l.lines, 0) ORDER BY u.n), array_agg(l.bucket ORDER BY u.n),
               array_agg(l.qty ORDER BY u.n), array_agg(l.held ORDER BY u.n),
               array_agg(l.line_no ORDER BY u.n), array_agg(l.backordered ORDER BY u.n),
               array_agg((SELECT count(*)::integer FROM unnest(v_line_ids) AS x(id)
                          WHERE x.id = u.id) ORDER BY u.n)
        INTO r_lines, r_bucket, r_qty, r_held, r_line, r_backordered, r_locked
        FROM unnest(r_ids) WITH ORDINALITY AS u(id, n)
        LEFT JOIN LATERAL (
            SELECT count(*)::integer AS lines, min(bucket_id) AS bucket,
                   min(quantity) AS qty, bool_or(held) AS held, min(line_no) AS line_no,
                   max(backordered) AS backordered
            FROM reservation_line
            WHERE tenant_id = p_tenant AND reservation_id = u.id) l ON true;
    END IF;

    -- A batch of reserves only, at a plainly sold-out bucket, needs no bucket
    -- lock: one statement sees, at one instant, less free beyond the safety
    -- stock than the smallest request, no backorder allowance, no unit in the
    -- pool (a unit another batch is taking still counts: its delete has not
    -- committed) and no hold past its expiry, as reserve_v1's sold-out probe
    -- does. Every reserve of it is then refused
    -- without writing the bucket row, so the sold-out batches of several
    -- processes commit side by side instead of one after another.
    IF p_kinds <@ ARRAY['reserve'] THEN
        SELECT * INTO b FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
        IF NOT FOUND THEN
            RETURN to_jsonb(array_fill('{"retry": true}'::jsonb, ARRAY[v_n]));
        END IF;
        IF b.free - b.safety_stock < (SELECT min(q) FROM unnest(p_quantities) AS q)
           AND b.backorder_limit = 0 THEN
            -- (expiry judged at the statement's own instant, read inside it)
            SELECT x.free, x.safety_stock,
                   x.free - x.safety_stock < (SELECT min(q) FROM unnest(p_quantities) AS q)
                   AND x.backorder_limit = 0
                   AND NOT EXISTS (SELECT 1 FROM stock_unit u
                                   WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket)
                   AND NOT EXISTS (SELECT 1 FROM reservation_line l
                                   WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                                     AND l.held AND l.expires_at <= t.at),
                   t.at
            INTO v_free, v_safety, v_looked, v_now
            FROM stock_bucket x, LATERAL (SELECT coalesce(p_now, clock_timestamp()) AS at) t
            WHERE x.tenant_id = p_tenant AND x.bucket_id = p_bucket;
        END IF;
    END IF;
    IF v_looked THEN
        -- plainly sold out: every reserve below is refused (v_looked skips
        -- the look; v_free and v_safety are the figures of that instant)
        v_shortfall := b.shortfall;
    ELSE
        SELECT * INTO b FROM stock_bucket WHERE tenant_id = p_tenant AND bucket_id = p_bucket
        FOR NO KEY UPDATE;
        IF NOT FOUND THEN
            RETURN to_jsonb(array_fill('{"retry": true}'::jsonb, ARRAY[v_n]));
        END IF;
        -- the batch's instant: after its lock waits, so expiry is judged now
        v_now := coalesce(p_now, clock_timestamp());
        v_free := b.free;
        v_shortfall := b.shortfall;
        v_safety := b.safety_stock;
    END IF;

    SELECT array_agg(request_key), array_agg(operation), array_agg(digest), array_agg(outcome)
    INTO k_keys, k_ops, k_digests, k_outcomes
    FROM request_ledger
    WHERE tenant_id = p_tenant
      AND request_key = ANY (p_keys);
    k_keys := coalesce(k_keys, '{}');
    IF 'reserve' = ANY (p_kinds)
       AND EXISTS (SELECT 1 FROM stock_freeze f
                   WHERE f.tenant_id = p_tenant AND f.lifted_at IS NULL
                     AND f.bucket_id IN (0, p_bucket)) THEN
        v_frozen := freeze_refusal_v1(p_tenant, ARRAY[p_bucket]);
    END IF;

    FOR i IN 1 .. v_n LOOP
        IF v_stop THEN
            v_out[i] := '{"deferred": true}';
            CONTINUE;
        END IF;
        IF i = v_wait_at OR (p_kinds[i] IN ('claim', 'release')
                             AND p_ids[i] = ANY (v_busy_ids)) THEN
            v_out[i] := '{"retry": true}';  -- its lock is another transaction's
            v_stop := true;
            CONTINUE;
        END IF;
        IF p_keys[i] IS NOT NULL THEN
            j := array_position(k_keys, p_keys[i]);
            IF j IS NOT NULL THEN
                IF k_ops[j] <> p_kinds[i] OR k_digests[j] <> p_digests[i] THEN
                    v_out[i] := jsonb_build_object(
                        'error', 'PR422', 'detail', k_ops[j], 'message',
                        format('request key %s was already used with different parameters',
                               p_keys[i]));
                ELSE
                    v_out[i] := jsonb_build_object(
                        'ok', k_outcomes[j] || '{"replayed": true}'::jsonb);
                END IF;
                CONTINUE;
            END IF;
        END IF;

        IF p_kinds[i] = 'reserve' THEN
            v_q := p_quantities[i];
            -- over the SKU's per-cart limit (the bucket row's copy), first
            v_limited := CASE WHEN v_q > b.cart_limit THEN cart_limit_refusal_v1(
                ARRAY[b.sku], ARRAY[v_q], ARRAY[b.cart_limit]) END;
            -- The batch holds the bucket row: it takes from free first (a
            -- counter) and deletes pool units only for what free cannot cover.
            IF v_frozen IS NULL AND v_limited IS NULL
               AND v_units + greatest(0, v_free - v_safety) < v_q AND NOT v_looked THEN
                v_looked := true;
                IF v_dfree <> 0 OR v_don_hand <> 0 OR v_dshortfall <> 0 THEN
                    -- the look gives expired holds back against the bucket row
                    -- (shortfall first): it must see what this batch changed
                    UPDATE stock_bucket
                    SET free = free + v_dfree, on_hand = on_hand + v_don_hand,
                        shortfall = shortfall + v_dshortfall, updated_at = v_now
                    WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
                    v_dfree := 0; v_don_hand := 0; v_dshortfall := 0;
                END IF;
                -- (it sees free beyond the safety stock only; it judges expiry at
                -- its own instant: a hold may have passed its expiry since v_now,
                -- and what others took since is gone from what it reads)
                SELECT * INTO v_units, v_free, v_others, v_shortfall
                FROM bucket_batch_look_v1(p_tenant, p_bucket, b.strategy, b.pool_cap,
                                          coalesce(p_now, clock_timestamp()),
                                          i, p_kinds, p_quantities, v_units,
                                          v_free - v_safety, r_ids);
                v_free := v_free + v_safety;
            END IF;
            IF v_limited IS NOT NULL OR v_frozen IS NOT NULL THEN
                -- stored under its key like any answer
                v_doc := coalesce(v_limited, v_frozen);
                l_status := l_status || 'rejected'::text;
            ELSIF v_units + greatest(0, v_free - v_safety) >= v_q THEN
                v_w := least(greatest(0, v_free - v_safety), v_q);
                v_free := v_free - v_w;
                v_dfree := v_dfree - v_w;
                v_units := v_units - (v_q - v_w);
                v_id := gen_random_uuid();
                v_view := jsonb_build_object(
                    'id', v_id, 'status', 'active', 'created_at', v_now,
                    'expires_at', v_now + p_ttls[i], 'claimed_at', NULL, 'released_at', NULL,
                    'expired_at', NULL,
                    'lines', jsonb_build_array(jsonb_build_object(
                        'sku', b.sku, 'location', b.location, 'quantity', v_q)),
                    'reference', p_references[i],
                    'metadata', coalesce(p_metadata[i], '{}'));
                v_doc := jsonb_build_object('status', 'held', 'reservation', v_view);
                h_ids := h_ids || v_id;
                h_keys := h_keys || p_keys[i];
                h_qty := h_qty || v_q;
                h_expires := h_expires || (v_now + p_ttls[i]);
                h_views := h_views || v_view;
                h_references := h_references || p_references[i];
                h_metadata := h_metadata || coalesce(p_metadata[i], '{}');
                l_status := l_status || 'succeeded'::text;
            ELSIF v_others OR b.backorder_limit > 0 THEN
                -- units another transaction holds may cover it, or the backorder
                -- allowance (taken unbatched, policy.sql): not for here
                v_out[i] := '{"retry": true}';
                v_stop := true;
                CONTINUE;
            ELSE
                -- under the bucket lock: free is exact, the pool is empty and
                -- no expired hold is left, so this is what the bucket can serve
                v_doc := jsonb_build_object(
                    'status', 'rejected', 'reason', 'insufficient_stock',
                    'short_lines', jsonb_build_array(jsonb_build_object(
                        'sku', b.sku, 'location', b.location, 'requested', v_q,
                        'available', v_units + greatest(0, v_free - v_safety))));
                l_status := l_status || 'rejected'::text;
            END IF;
            l_keys := l_keys || p_keys[i];
            l_ops := l_ops || 'reserve'::text;
            l_digests := l_digests || p_digests[i];
            l_outcomes := l_outcomes || v_doc;
            k_keys := k_keys || p_keys[i];
            k_ops := k_ops || 'reserve'::text;
            k_digests := k_digests || p_digests[i];
            k_outcomes := k_outcomes || v_doc;
            v_out[i] := jsonb_build_object('ok', v_doc);
            CONTINUE;
        END IF;

        IF p_kinds[i] = 'refill' THEN
            v_refill := true;  -- answered at the end
            CONTINUE;
        END IF;

        -- claim, release or expire
        j := array_position(r_ids, p_ids[i]);
        IF j IS NULL AND p_kinds[i] = 'expire' THEN
            v_out[i] := '{"skipped": true}';  -- locked elsewhere, or gone
            CONTINUE;
        ELSIF j IS NULL THEN
            v_out[i] := jsonb_build_object(
                'error', 'PR410', 'message', format('unknown reservation %s', p_ids[i]));
            CONTINUE;
        ELSIF r_locked[j] < r_lines[j] THEN
            -- a line of it is another transaction's (above)
            IF p_kinds[i] = 'expire' THEN
                v_out[i] := '{"skipped": true}';
            ELSE
                v_out[i] := '{"retry": true}';
                v_stop := true;
            END IF;
            CONTINUE;
        END IF;
        -- (a changed cart's one line may have another number than 1: it goes
        -- alone; a backordered line settles its allowance unbatched, policy.sql)
        IF r_lines[j] <> 1 OR r_bucket[j] <> p_bucket OR r_line[j] <> 1
           OR r_backordered[j] > 0 THEN
            v_out[i] := '{"retry": true}';
            v_stop := true;
            CONTINUE;
        END IF;
        v_q := r_qty[j];
        IF p_kinds[i] = 'claim' THEN
            IF r_status[j] = 'released' THEN
                v_out[i] := jsonb_build_object(
                    'error', 'PR423', 'message', format('reservation %s was released', p_ids[i]));
                CONTINUE;
            ELSIF r_status[j] <> 'claimed' THEN
                IF p_ids[i] = ANY (t_ids) THEN
                    -- expired earlier in this batch: one row update per
                    -- reservation and batch, so this late claim goes alone
                    v_out[i] := '{"retry": true}';
                    v_stop := true;
                    CONTINUE;
                END IF;
                IF NOT r_held[j] THEN
                    -- given up at expiry: take the units again, or fail the claim
                    IF v_units + greatest(0, v_free - v_safety) < v_q AND NOT v_looked THEN
                        v_looked := true;
                        IF v_dfree <> 0 OR v_don_hand <> 0 OR v_dshortfall <> 0 THEN
                            -- the look gives expired holds back against the bucket row
                            -- (shortfall first): it must see what this batch changed
                            UPDATE stock_bucket
                            SET free = free + v_dfree, on_hand = on_hand + v_don_hand,
                                shortfall = shortfall + v_dshortfall, updated_at = v_now
                            WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
                            v_dfree := 0; v_don_hand := 0; v_dshortfall := 0;
                        END IF;
                        SELECT * INTO v_units, v_free, v_others, v_shortfall
                        FROM bucket_batch_look_v1(p_tenant, p_bucket, b.strategy, b.pool_cap,
                                                  coalesce(p_now, clock_timestamp()), i,
                                                  p_kinds, p_quantities, v_units,
                                                  v_free - v_safety, r_ids);
                        v_free := v_free + v_safety;
                    END IF;
                    IF v_units + greatest(0, v_free - v_safety) < v_q THEN
                        IF v_others THEN
                            v_out[i] := '{"retry": true}';
                            v_stop := true;
                        ELSE
                            v_out[i] := jsonb_build_object(
                                'error', 'PR425', 'message',
                                format('reservation %s expired and its stock is gone', p_ids[i]));
                        END IF;
                        CONTINUE;
                    END IF;
                    v_w := least(greatest(0, v_free - v_safety), v_q);
                    v_free := v_free - v_w;
                    v_dfree := v_dfree - v_w;
                    v_units := v_units - (v_q - v_w);
                END IF;
                v_don_hand := v_don_hand - v_q;
                t_given_up := t_given_up || NOT r_held[j];
                r_held[j] := false;
                r_status[j] := 'claimed';
                r_claimed[j] := v_now;
                t_ids := t_ids || p_ids[i];
                t_kinds := t_kinds || 'claim'::text;
                t_qty := t_qty || v_q;
            END IF;
        ELSE
            -- release or expire: an active hold gives its units back
            IF p_kinds[i] = 'expire' AND (r_status[j] <> 'active' OR r_expires[j] > v_now) THEN
                v_out[i] := '{"skipped": true}';
                CONTINUE;
            ELSIF p_kinds[i] = 'release' AND r_status[j] = 'claimed' THEN
                v_out[i] := jsonb_build_object(
                    'error', 'PR424', 'message', format('reservation %s was claimed', p_ids[i]));
                CONTINUE;
            ELSIF r_status[j] = 'active' THEN
                IF NOT r_held[j] THEN
                    NULL;  -- given up at expiry already: its units are back
                ELSE
                    -- back into free (a pool bucket's too: the next holds take
                    -- free first); units a forced correction found missing
                    -- are written off
                    v_w := least(v_shortfall, v_q);
                    v_shortfall := v_shortfall - v_w;
                    v_dshortfall := v_dshortfall - v_w;
                    v_don_hand := v_don_hand - v_w;
                    v_free := v_free + v_q - v_w;
                    v_dfree := v_dfree + v_q - v_w;
                END IF;
                t_given_up := t_given_up || NOT r_held[j];
                r_held[j] := false;
                IF p_kinds[i] = 'expire' THEN
                    r_status[j] := 'expired';
                    r_expired[j] := v_now;
                ELSE
                    r_status[j] := 'released';
                    r_released[j] := v_now;
                END IF;
                t_ids := t_ids || p_ids[i];
                t_kinds := t_kinds || p_kinds[i];
                t_qty := t_qty || v_q;
            END IF;
        END IF;
        v_view := jsonb_build_object(
            'id', r_ids[j],
            'status', CASE WHEN r_status[j] = 'active' AND r_expires[j] <= v_now
                           THEN 'expired' ELSE r_status[j] END,
            'created_at', r_created[j], 'expires_at', r_expires[j],
            'claimed_at', r_claimed[j], 'released_at', r_released[j],
            'expired_at', coalesce(r_expired[j],
                                   CASE WHEN r_status[j] = 'active' AND r_expires[j] <= v_now
                                        THEN r_expires[j] END),
            'lines', jsonb_build_array(jsonb_build_object(
                'sku', b.sku, 'location', b.location, 'quantity', v_q)),
            'reference', r_reference[j], 'metadata', r_metadata[j]);
        IF t_ids <> '{}' AND t_ids[cardinality(t_ids)] = p_ids[i]
           AND cardinality(t_views) < cardinality(t_ids) THEN
            t_views := t_views || v_view;
        END IF;
        IF p_keys[i] IS NULL THEN
            v_out[i] := jsonb_build_object('ok', v_view);
        ELSE
            v_doc := jsonb_build_object('status', 'applied', 'reservation', v_view);
            l_keys := l_keys || p_keys[i];
            l_ops := l_ops || p_kinds[i];
            l_digests := l_digests || p_digests[i];
            l_status := l_status || 'succeeded'::text;
            l_outcomes := l_outcomes || v_doc;
            k_keys := k_keys || p_keys[i];
            k_ops := k_ops || p_kinds[i];
            k_digests := k_digests || p_digests[i];
            k_outcomes := k_outcomes || v_doc;
            v_out[i] := jsonb_build_object('ok', v_doc);
        END IF;
    END LOOP;

    IF h_ids <> '{}' THEN
        WITH held AS (
            INSERT INTO reservation (tenant_id, reservation_id, request_key, created_at,
                                     expires_at, reference, metadata)
            SELECT p_tenant, id, k, v_now, e, ref, meta
            FROM unnest(h_ids, h_keys, h_expires, h_references, h_metadata)
                 AS u(id, k, e, ref, meta)
        ), held_lines AS (
            INSERT INTO reservation_line (tenant_id, reservation_id, line_no, bucket_id,
                                          quantity, expires_at)
            SELECT p_tenant, id, 1, p_bucket, q, e FROM unnest(h_ids, h_qty, h_expires) AS u(id, q, e)
        )
        INSERT INTO outbox_event (tenant_id, type, payload)
        SELECT p_tenant, 'reservation.created', v FROM unnest(h_views) WITH ORDINALITY AS u(v, n)
        ORDER BY n;
    END IF;

    IF t_ids <> '{}' THEN
        -- (ids as an array: an index condition on both key columns, whatever the
        -- statistics the plan was made with; a join let a young plan scan the tenant)
        UPDATE reservation_line l SET held = false
        WHERE l.tenant_id = p_tenant AND l.reservation_id = ANY (t_ids) AND l.held;
        INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity, reservation_id,
                                    line_no, reason)
        SELECT p_tenant, p_bucket, CASE WHEN k = 'claim' THEN 'sale' ELSE 'restore' END,
               CASE WHEN k = 'claim' THEN -q ELSE q END, id, 1,
               CASE k WHEN 'claim' THEN NULL WHEN 'expire' THEN 'expired' ELSE 'released' END
        FROM unnest(t_ids, t_kinds, t_qty, t_given_up) AS u(id, k, q, given_up)
        -- a hold given up at expiry had its units restored then, once
        WHERE k = 'claim' OR NOT given_up;
        UPDATE reservation r
        SET status = CASE u.k WHEN 'claim' THEN 'claimed' WHEN 'expire' THEN 'expired'
                              ELSE 'released' END,
            claimed_at = CASE WHEN u.k = 'claim' THEN v_now ELSE r.claimed_at END,
            released_at = CASE WHEN u.k = 'release' THEN v_now ELSE r.released_at END,
            expired_at = CASE WHEN u.k = 'expire' THEN v_now ELSE r.expired_at END
        FROM unnest(t_ids, t_kinds) AS u(id, k)
        WHERE r.tenant_id = p_tenant AND r.reservation_id = u.id
          AND r.reservation_id = ANY (t_ids);
        INSERT INTO outbox_event (tenant_id, type, payload)
        SELECT p_tenant, CASE k WHEN 'claim' THEN 'reservation.claimed'
                                WHEN 'expire' THEN 'reservation.expired'
                                ELSE 'reservation.released' END, v
        FROM unnest(t_kinds, t_views) WITH ORDINALITY AS u(k, v, n)
        ORDER BY n;
    END IF;

    IF l_keys <> '{}' THEN
        INSERT INTO request_ledger (tenant_id, request_key, operation, digest, status, outcome)
        SELECT p_tenant, k, o, d, s, doc
        FROM unnest(l_keys, l_ops, l_digests, l_status, l_outcomes) AS u(k, o, d, s, doc)
        ON CONFLICT (tenant_id, request_key) DO NOTHING;
        GET DIAGNOSTICS j = ROW_COUNT;
        IF j <> cardinality(l_keys) THEN
            RAISE EXCEPTION 'a request key of the batch was committed by a concurrent request'
                USING ERRCODE = 'PR409';
        END IF;
    END IF;

    IF v_units > 0 THEN
        -- pool units deleted for the batch but not used: back into the pool
        INSERT INTO stock_unit (tenant_id, bucket_id)
        SELECT p_tenant, p_bucket FROM generate_series(1, v_units);
    END IF;
    IF v_dfree <> 0 OR v_don_hand <> 0 OR v_dshortfall <> 0 THEN
        UPDATE stock_bucket
        SET free = free + v_dfree, on_hand = on_hand + v_don_hand,
            shortfall = shortfall + v_dshortfall, updated_at = v_now
        WHERE tenant_id = p_tenant AND bucket_id = p_bucket;
    END IF;
    IF v_refill THEN
        -- after the batch's own writes: what it left free fills the pool
        v_w := CASE WHEN b.strategy = 'pool'
                    THEN (pool_replenish_v1(p_tenant, p_bucket, 0, v_now)).added ELSE 0 END;
        FOR i IN 1 .. v_n LOOP
            IF p_kinds[i] = 'refill' AND v_out[i] IS NULL THEN
                v_out[i] := jsonb_build_object('ok', jsonb_build_object('added', v_w));
                v_w := 0;
            END IF;
        END LOOP;
    END IF;
    RETURN to_jsonb(v_out);
END $$;

-- The first shortage of a batch (bucket_batch_v1 holds the bucket row lock):
-- take pool units for what the rest of the batch asks beyond free (a pool
-- bucket), give up
-- expired holds if that is still not enough, and tell whether units or
-- expired holds that other transactions hold remain (then a short request is
-- not decided in the batch).
CREATE OR REPLACE FUNCTION bucket_batch_look_v1(p_tenant bigint, p_bucket bigint,
                                                p_strategy text, p_cap integer,
                                                p_now timestamptz,
                                                p_from integer, p_kinds text[],
                                                p_quantities integer[],
                                                INOUT units bigint, INOUT free bigint,
                                                p_skip uuid[], OUT others boolean,
                                                OUT shortfall bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_demand bigint;
BEGIN
    SELECT coalesce(sum(p_quantities[x]), 0) INTO v_demand
    FROM generate_series(p_from, cardinality(p_kinds)) AS x WHERE p_kinds[x] = 'reserve';
    v_demand := greatest(v_demand, 1);
    IF p_strategy = 'pool' AND units + free < v_demand THEN
        units := units + pool_units_delete_v1(p_tenant, p_bucket, v_demand - units - free);
    END IF;
    IF units + free < v_demand THEN
        -- a pool bucket's for the batch and a full pool, as an inline refill's
        free := free + bucket_reclaim_expired_v1(
            p_tenant, p_bucket, p_now,
            v_demand - units - free + CASE WHEN p_strategy = 'pool' THEN p_cap ELSE 0 END,
            p_skip);
    END IF;
    -- the give-up may have paid some of it back
    SELECT b.shortfall INTO shortfall FROM stock_bucket b
    WHERE b.tenant_id = p_tenant AND b.bucket_id = p_bucket;
    others := EXISTS (SELECT 1 FROM stock_unit u
                      WHERE u.tenant_id = p_tenant AND u.bucket_id = p_bucket)
              OR EXISTS (SELECT 1 FROM reservation_line l
                         WHERE l.tenant_id = p_tenant AND l.bucket_id = p_bucket
                           AND l.held AND l.expires_at <= p_now);
END $$;

-- bucket_batch_v1 for requests that bring the API key their caller presented
-- (p_api_keys[i]: its SHA-256, or NULL when the caller was checked before).
-- Each key is checked here, in the batch's own transaction, which starts after
-- every request of it arrived: a key revoked before its request, or never
-- issued to this tenant, is answered {"error": "PR403"} and its request takes
-- no part in the batch (nothing is written or replayed for it). The others go
-- to bucket_batch_v1 in their order; the HTTP API saves the key's own read this
-- way once it has seen the key accepted.
CREATE OR REPLACE FUNCTION bucket_batch_keyed_v1(p_api_keys bytea[], p_tenant bigint,
                                                 p_bucket bigint, p_kinds text[],
                                                 p_keys text[], p_digests text[],
                                                 p_quantities integer[], p_ttls interval[],
                                                 p_ids uuid[], p_now timestamptz DEFAULT NULL,
                                                 p_references text[] DEFAULT NULL,
                                                 p_metadata jsonb[] DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_ok boolean[];
    v_kinds text[];
    v_keys text[];
    v_digests text[];
    v_quantities integer[];
    v_ttls interval[];
    v_ids uuid[];
    v_references text[];
    v_metadata jsonb[];
    v_out jsonb;
BEGIN
    IF cardinality(p_api_keys) IS DISTINCT FROM cardinality(p_kinds) THEN
        RAISE EXCEPTION 'one API key (or NULL) per request' USING ERRCODE = 'PR400';
    END IF;
    SELECT array_agg(u.h IS NULL OR k.key_hash IS NOT NULL ORDER BY u.n)
    INTO v_ok
    FROM unnest(p_api_keys) WITH ORDINALITY AS u(h, n)
    LEFT JOIN api_key k ON k.key_hash = u.h AND k.tenant_id = p_tenant
                       AND k.revoked_at IS NULL;
    IF true = ALL (v_ok) THEN
        RETURN bucket_batch_v1(p_tenant, p_bucket, p_kinds, p_keys, p_digests, p_quantities,
                               p_ttls, p_ids, p_now, p_references, p_metadata);
    END IF;
    -- the accepted requests, in their order (a NULL references or metadata array
    -- reads as NULL elements)
    SELECT array_agg(kind ORDER BY n), array_agg(k ORDER BY n), array_agg(d ORDER BY n),
           array_agg(q ORDER BY n), array_agg(ttl ORDER BY n), array_agg(id ORDER BY n),
           array_agg(ref ORDER BY n), array_agg(meta ORDER BY n)
    INTO v_kinds, v_keys, v_digests, v_quantities, v_ttls, v_ids, v_references, v_metadata
    FROM unnest(p_kinds, p_keys, p_digests, p_quantities, p_ttls, p_ids, p_references,
                p_metadata, v_ok) WITH ORDINALITY AS u(kind, k, d, q, ttl, id, ref, meta, ok, n)
    WHERE ok;
    IF v_kinds IS NOT NULL THEN
        v_out := bucket_batch_v1(p_tenant, p_bucket, v_kinds, v_keys, v_digests, v_quantities,
                                 v_ttls, v_ids, p_now, v_references, v_metadata);
    END IF;
    -- the answers back in the requests' places, a refusal for each refused key
    RETURN (SELECT jsonb_agg(CASE WHEN u.ok THEN v_out -> (u.rank - 1)
                                  ELSE '{"error": "PR403", "message": "unknown API key"}'::jsonb
                             END ORDER BY u.n)
            FROM (SELECT ok, n, count(*) FILTER (WHERE ok) OVER (ORDER BY n)::integer AS rank
                  FROM unnest(v_ok) WITH ORDINALITY AS x(ok, n)) u);
END $$;
