-- Change a held cart: the whole new cart of an active reservation, in one
-- transaction, under a request key (migration 0008 explains the line numbers).
--
-- Per bucket of the old and the new cart together:
--   same quantity   the line is left as it is (same units held, no movement)
--   more            only the difference is taken, as a reserve takes (row or pool)
--   less            only the difference is given back: its line number gets its
--                   one restore record (reason 'changed') and the units kept move to
--                   a line with a new number
--   not any more    the line is given back whole (its restore record) and goes
--   new             a line with a new number takes its units
-- All or nothing: when a line that takes cannot be served, every write of the
-- change is undone (a subtransaction) and the rejection, with its short lines, is
-- stored under the key. The new cart obeys the per-cart limits; a freeze refuses a
-- change that takes from a frozen bucket (or any take of a frozen tenant), while
-- one that only gives back goes on, as a release does. The expiry does not change.
--
-- Lock order, as everywhere: the request key (advisory), the reservation, its
-- lines, then each bucket of the change in (sku, location) order, taken from and
-- given back to in that one pass, then units and the insert-only tables.
CREATE OR REPLACE FUNCTION change_v1(p_tenant bigint, p_key text, p_digest text, p_id uuid,
                                     p_skus text[], p_locations text[],
                                     p_quantities integer[], p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET search_path FROM CURRENT
AS $$
DECLARE
    v_now timestamptz;
    v_replay jsonb;
    v_res reservation;
    v_missing jsonb;
    v_plan record;
    v_take record;
    v_bo record;
    v_backordered integer;
    v_outcome jsonb;
    v_view jsonb;
    v_short jsonb := '[]'::jsonb;
    v_changed boolean := false;
    v_held boolean;
    v_next integer;
    v_unit_buckets bigint[] := '{}';
    v_unit_ids bigint[] := '{}';
BEGIN
    -- one key's requests one after another, the freeze lock shared (ledger.sql)
    v_replay := request_begin_v1(p_tenant, p_key, 'change', p_digest);
    IF v_replay IS NOT NULL THEN
        RETURN v_replay;
    END IF;

    v_res := reservation_lock_v1(p_tenant, p_id);
    IF v_res.status = 'claimed' THEN
        RAISE EXCEPTION 'reservation % was claimed', p_id USING ERRCODE = 'PR424';
    ELSIF v_res.status = 'released' THEN
        RAISE EXCEPTION 'reservation % was released', p_id USING ERRCODE = 'PR423';
    END IF;
    -- Its lines, locked; one given up by a reserve after it expired: expired.
    v_held := reservation_lines_held_v1(p_tenant, p_id);
    v_now := coalesce(p_now, clock_timestamp());  -- after the lock waits, the lines' too
    IF NOT v_held OR v_res.status <> 'active' OR v_res.expires_at <= v_now THEN
        RAISE EXCEPTION 'reservation % is not active', p_id USING ERRCODE = 'PR426',
            DETAIL = 'expired';
    END IF;
    -- A line holding backordered units (policy.sql) keeps its allowance on the
    -- line; a change would renumber or give back that line without settling it.
    IF EXISTS (SELECT 1 FROM reservation_line
               WHERE tenant_id = p_tenant AND reservation_id = p_id AND backordered > 0) THEN
        RAISE EXCEPTION 'reservation % holds backordered units and cannot be changed: '
                        'release it and reserve the new cart', p_id USING ERRCODE = 'PR429';
    END IF;

    SELECT jsonb_agg(jsonb_build_object('sku', u.sku, 'location', u.loc) ORDER BY u.ord)
    INTO v_missing
    FROM unnest(p_skus, p_locations) WITH ORDINALITY AS u(sku, loc, ord)
    WHERE NOT EXISTS (SELECT 1 FROM stock_bucket b
                      WHERE b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc);
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'unknown stock' USING ERRCODE = 'PR404', DETAIL = v_missing::text;
    END IF;

    -- The new cart against the per-cart limits (each bucket row carries its SKU's).
    -- A SKU the new cart has no more of than the reservation holds now is not held
    -- to a limit lowered since the hold: the cart sent as it is, or lowered, goes on;
    -- only a change adding to such a SKU is refused.
    SELECT cart_limit_refusal_v1(p_skus, p_quantities, array_agg(
               CASE WHEN (SELECT sum(n.q) FROM unnest(p_skus, p_quantities) AS n(s, q)
                          WHERE n.s = u.sku)
                         <= (SELECT coalesce(sum(l.quantity), 0)
                             FROM reservation_line l
                             JOIN stock_bucket lb ON lb.tenant_id = l.tenant_id
                                                 AND lb.bucket_id = l.bucket_id
                             WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id
                               AND lb.sku = u.sku)
                    THEN NULL ELSE b.cart_limit END ORDER BY u.ord))
    INTO v_outcome
    FROM unnest(p_skus, p_locations) WITH ORDINALITY AS u(sku, loc, ord)
    JOIN stock_bucket b ON b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc;
    -- A freeze stops what the change would take (read after the freeze lock).
    IF v_outcome IS NULL THEN
        SELECT freeze_refusal_v1(p_tenant, array_agg(b.bucket_id))
        INTO v_outcome
        FROM unnest(p_skus, p_locations, p_quantities) AS u(sku, loc, qty)
        JOIN stock_bucket b ON b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc
        WHERE u.qty > coalesce((SELECT l.quantity FROM reservation_line l
                                WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id
                                  AND l.bucket_id = b.bucket_id), 0)
        HAVING count(*) > 0;
    END IF;
    IF v_outcome IS NOT NULL THEN
        PERFORM ledger_record_v1(p_tenant, p_key, 'change', p_digest, 'rejected', v_outcome);
        RETURN v_outcome;
    END IF;

    -- New line numbers: after every number the reservation has used (a number
    -- with a restore or sale record is never used again).
    SELECT greatest(
               (SELECT max(line_no) FROM reservation_line
                WHERE tenant_id = p_tenant AND reservation_id = p_id),
               (SELECT max(line_no) FROM stock_movement
                WHERE tenant_id = p_tenant AND reservation_id = p_id AND kind = 'restore'),
               (SELECT max(line_no) FROM stock_movement
                WHERE tenant_id = p_tenant AND reservation_id = p_id AND kind = 'sale'),
               0) + 1
    INTO v_next;
    IF v_next + cardinality(p_skus) > 32768 THEN
        RAISE EXCEPTION 'reservation % was changed too often: reserve a new cart', p_id
            USING ERRCODE = 'PR400';
    END IF;

    BEGIN
        FOR v_plan IN
            WITH new_cart AS (
                SELECT b.bucket_id, u.qty
                FROM unnest(p_skus, p_locations, p_quantities) AS u(sku, loc, qty)
                JOIN stock_bucket b
                  ON b.tenant_id = p_tenant AND b.sku = u.sku AND b.location = u.loc
            ), old_cart AS (
                SELECT l.bucket_id, l.quantity AS qty, l.line_no
                FROM reservation_line l
                WHERE l.tenant_id = p_tenant AND l.reservation_id = p_id
            )
            SELECT b.bucket_id, b.sku, b.location, b.strategy, b.pool_lo, b.pool_hi,
                   coalesce(o.qty, 0) AS old_qty, coalesce(n.qty, 0) AS new_qty, o.line_no
            FROM new_cart n
            FULL JOIN old_cart o ON o.bucket_id = n.bucket_id
            JOIN stock_bucket b
              ON b.tenant_id = p_tenant AND b.bucket_id = coalesce(n.bucket_id, o.bucket_id)
            WHERE coalesce(o.qty, 0) <> coalesce(n.qty, 0)
            ORDER BY b.sku COLLATE "C", b.location COLLATE "C"
        LOOP
            v_changed := true;
            IF v_plan.new_qty > v_plan.old_qty THEN
                -- p_now, not v_now: a take that waited judges expiry when it decides
                v_take := bucket_take_v1(p_tenant, v_plan.bucket_id,
                                         v_plan.new_qty - v_plan.old_qty, p_now,
                                         v_plan.strategy, v_plan.pool_lo, v_plan.pool_hi, true);
                v_backordered := 0;
                IF NOT v_take.ok THEN
                    -- short: the rest from the bucket's backorder allowance, if it
                    -- has one, as a reserve takes it (policy.sql; a short take took
                    -- nothing)
                    v_bo := bucket_backorder_take_v1(p_tenant, v_plan.bucket_id,
                                                     v_plan.new_qty - v_plan.old_qty,
                                                     p_now, true);
                    IF NOT v_bo.ok THEN
                        -- what this line could have: the units it holds and what is
                        -- available (the allowance left included)
                        v_short := v_short || jsonb_build_object(
                            'sku', v_plan.sku, 'location', v_plan.location,
                            'requested', v_plan.new_qty,
                            'available', v_plan.old_qty + coalesce(
                                v_bo.seen_available, v_take.seen_available,
                                (bucket_view_v1(p_tenant, v_plan.bucket_id, v_now)
                                 ->> 'available')::bigint));
                        CONTINUE;
                    END IF;
                    v_take := v_bo;
                    v_backordered := v_bo.backordered;
                END IF;
                IF v_take.units IS NOT NULL THEN
                    v_unit_buckets := v_unit_buckets
                        || array_fill(v_plan.bucket_id, ARRAY[cardinality(v_take.units)]);
                    v_unit_ids := v_unit_ids || v_take.units;
                END IF;
                IF v_plan.line_no IS NULL THEN
                    INSERT INTO reservation_line (tenant_id, reservation_id, line_no, bucket_id,
                                                  quantity, expires_at, backordered)
                    VALUES (p_tenant, p_id, v_next, v_plan.bucket_id, v_plan.new_qty,
                            v_res.expires_at, v_backordered);
                    v_next := v_next + 1;
                ELSE
                    -- a raised line keeps its number: nothing of it was restored
                    -- (none of its units were backordered: such a cart is not changed)
                    UPDATE reservation_line
                    SET quantity = v_plan.new_qty, backordered = v_backordered
                    WHERE tenant_id = p_tenant AND reservation_id = p_id
                      AND line_no = v_plan.line_no;
                END IF;
            ELSE
                -- less, or none: the line number's one restore record, then the units
                INSERT INTO stock_movement (tenant_id, bucket_id, kind, quantity,
                                            reservation_id, line_no, request_key, reason)
                VALUES (p_tenant, v_plan.bucket_id, 'restore',
                        v_plan.old_qty - v_plan.new_qty, p_id, v_plan.line_no, p_key,
                        'changed');
                PERFORM bucket_give_back_v1(p_tenant, v_plan.bucket_id,
                                            v_plan.old_qty - v_plan.new_qty, v_now);
                IF v_plan.new_qty = 0 THEN
                    DELETE FROM reservation_line
                    WHERE tenant_id = p_tenant AND reservation_id = p_id
                      AND line_no = v_plan.line_no;
                ELSE
                    UPDATE reservation_line SET line_no = v_next, quantity = v_plan.new_qty
                    WHERE tenant_id = p_tenant AND reservation_id = p_id
                      AND line_no = v_plan.line_no;
                    v_next := v_next + 1;
                END IF;
            END IF;
        END LOOP;
        -- A take that waited judges expiry when it decides: if the reservation had
        -- expired by then, the take gave this reservation's own lines up (its lines
        -- are locked by this transaction, so nothing else can have): the change came
        -- too late, and nothing of it stays.
        IF EXISTS (SELECT 1 FROM reservation_line
                   WHERE tenant_id = p_tenant AND reservation_id = p_id AND NOT held) THEN
            RAISE EXCEPTION 'reservation % is not active', p_id USING ERRCODE = 'PR426',
                DETAIL = 'expired';
        END IF;
        IF v_short <> '[]'::jsonb THEN
            -- undo every write of the change (and the row locks taken inside the
            -- block: those before it, the reservation's and its lines', stay)
            RAISE EXCEPTION 'short' USING ERRCODE = 'PRC01';
        END IF;
        IF v_unit_ids <> '{}' THEN
            DELETE FROM stock_unit u
            USING unnest(v_unit_buckets, v_unit_ids) AS k(bucket, unit)
            WHERE u.tenant_id = p_tenant AND u.bucket_id = k.bucket AND u.unit_id = k.unit
              -- (as index conditions too: a join alone read the tenant's whole pool)
              AND u.bucket_id = ANY (v_unit_buckets) AND u.unit_id = ANY (v_unit_ids);
        END IF;
    EXCEPTION WHEN SQLSTATE 'PRC01' THEN
        v_outcome := jsonb_build_object('status', 'rejected', 'reason', 'insufficient_stock',
                                        'short_lines', v_short);
        PERFORM ledger_record_v1(p_tenant, p_key, 'change', p_digest, 'rejected', v_outcome);
        RETURN v_outcome;
    END;
    v_view := reservation_view_v1(p_tenant, p_id, v_now);
    IF v_changed THEN
        INSERT INTO outbox_event (tenant_id, type, payload)
        VALUES (p_tenant, 'reservation.changed', v_view);
    END IF;
    v_outcome := jsonb_build_object('status', 'held', 'reservation', v_view);
    PERFORM ledger_record_v1(p_tenant, p_key, 'change', p_digest, 'succeeded', v_outcome);
    RETURN v_outcome;
END $$;
