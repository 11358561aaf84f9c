CREATE OR REPLACE FUNCTION ledger_check_v1(p_tenant bigint, p_key text, p_operation text, p_digest text)
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

CREATE OR REPLACE FUNCTION ledger_record_v1(p_tenant bigint, p_key text, p_operation text,
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

-- Forget request keys older than p_keep, at most p_batch per call (the
-- request_ledger_created_idx index serves the scan). Returns how many went.
CREATE OR REPLACE FUNCTION request_keys_purge_v1(p_keep interval, p_batch integer,
                                      p_now timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_count integer;
BEGIN
    DELETE FROM request_ledger l
    USING (SELECT tenant_id, request_key FROM request_ledger
           WHERE created_at < v_now - p_keep
           ORDER BY created_at
           LIMIT p_batch
           FOR UPDATE SKIP LOCKED) due
    WHERE l.tenant_id = due.tenant_id AND l.request_key = due.request_key;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END $$;

-- The start of a keyed request that may take stock: requests with one key run one
-- after another (a transaction-scoped lock on the key's hash; a collision only
-- serialises two unrelated requests), then the tenant's freeze lock is taken
-- shared (freeze.sql: a freeze commits only when no take that did not see it is
-- still open). Returns the key's stored answer (a replay), or NULL for a new
-- request; the key used with other parameters raises PR422. reserve_v1 writes the
-- same steps inline (its hottest path); change_v1 and reserve_allocated_v1 call it.
CREATE OR REPLACE FUNCTION request_begin_v1(p_tenant bigint, p_key text, p_operation text,
                                            p_digest text)
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, p_tenant));
    PERFORM pg_advisory_xact_lock_shared(1885827686, freeze_lock_key_v1(p_tenant));
    RETURN ledger_check_v1(p_tenant, p_key, p_operation, p_digest);
END $$;

-- Rollout, primary mode (rollout/router.py): the legacy store refused a cart that
-- pgreserve held (the legacy store has every hold of every mode, so its refusal
-- means the units are held elsewhere). Under the key's lock, and only if the key's
-- answer is still that hold and no caller can have been told it (rollout_told: it
-- was answered while the legacy store did not answer; claimed: someone who had the
-- hold sold it), the hold goes back and the refusal becomes the key's stored answer,
-- in one transaction, so a replay under any later mode gives the refusal. Lock order
-- as everywhere: the request key, then the reservation. Returns whether the key's
-- answer is now the refusal (recorded here, or by a request of the key before);
-- false: the hold stands.
CREATE OR REPLACE FUNCTION ledger_refusal_record_v1(p_tenant bigint, p_key text, p_id uuid,
                                                    p_outcome jsonb)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_row request_ledger;
    v_status text;
BEGIN
    IF p_outcome ->> 'status' IS DISTINCT FROM 'rejected' THEN
        RAISE EXCEPTION 'a refusal is recorded, not %', p_outcome ->> 'status'
            USING ERRCODE = 'PR400';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, p_tenant));
    SELECT * INTO v_row FROM request_ledger
    WHERE tenant_id = p_tenant AND request_key = p_key
    FOR UPDATE;
    IF NOT FOUND OR v_row.operation <> 'reserve' THEN
        RETURN false;
    ELSIF v_row.status = 'rejected' THEN
        RETURN true;
    ELSIF v_row.rollout_told OR v_row.outcome -> 'reservation' ->> 'id' IS DISTINCT FROM p_id::text THEN
        RETURN false;
    END IF;
    SELECT status INTO v_status FROM reservation
    WHERE tenant_id = p_tenant AND reservation_id = p_id
    FOR UPDATE;
    IF v_status IS NULL OR v_status = 'claimed' THEN
        RETURN false;  -- claimed (or gone): the hold was someone's
    END IF;
    PERFORM release_v1(p_tenant, p_id);
    UPDATE request_ledger
    SET status = 'rejected', outcome = p_outcome
    WHERE tenant_id = p_tenant AND request_key = p_key;
    RETURN true;
END $$;

-- Rollout: the caller is told pgreserve's hold while the legacy store did not
-- answer, or had no answer under the key yet (rollout_told, above). Under the key's
-- lock, and only if the key's answer is still that hold (a row marked already is
-- not written again); false: a refusal was recorded meanwhile (by a request of the
-- key in another process), which is then the answer.
CREATE OR REPLACE FUNCTION ledger_hold_told_v1(p_tenant bigint, p_key text, p_id uuid)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_told boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, p_tenant));
    SELECT rollout_told INTO v_told FROM request_ledger
    WHERE tenant_id = p_tenant AND request_key = p_key AND operation = 'reserve'
      AND status = 'succeeded' AND outcome -> 'reservation' ->> 'id' = p_id::text;
    IF NOT FOUND THEN
        RETURN false;
    ELSIF NOT v_told THEN
        UPDATE request_ledger SET rollout_told = true
        WHERE tenant_id = p_tenant AND request_key = p_key;
    END IF;
    RETURN true;
END $$;

-- GET /v1/requests/{key}: the answer stored under a key and, when it names a
-- reservation, that reservation as it is now; no row for a key never used; one row
-- with in_progress (and nothing else) while a request under the key runs. A request
-- holds the key's lock (pg_advisory_xact_lock above, reserve_v1, the batch's try)
-- until it commits its answer, so a key with no answer yet whose lock is taken may
-- still get one: saying "never used" then would let a client that lost its reply
-- hold the stock again under a new key. The lock is tried (shared: lookups do not
-- wait for each other) before the ledger is read, by a statement of its own: in a
-- READ COMMITTED transaction (the caller's) that read sees every answer committed
-- before the try found the lock free.
CREATE OR REPLACE FUNCTION request_view_v1(p_now timestamptz, p_tenant bigint, p_key text,
                                           OUT operation text, OUT status text,
                                           OUT outcome jsonb, OUT created_at timestamptz,
                                           OUT reservation jsonb, OUT in_progress boolean)
RETURNS SETOF record LANGUAGE plpgsql AS $$
DECLARE
    v_free boolean;
BEGIN
    v_free := pg_try_advisory_xact_lock_shared(hashtextextended(p_key, p_tenant));
    RETURN QUERY
    SELECT l.operation, l.status, l.outcome, l.created_at,
           CASE WHEN l.outcome -> 'reservation' ->> 'id' IS NOT NULL
                THEN reservation_view_v1(l.tenant_id,
                                         (l.outcome -> 'reservation' ->> 'id')::uuid,
                                         coalesce(p_now, clock_timestamp())) END,
           false
    FROM request_ledger l
    WHERE l.tenant_id = p_tenant AND l.request_key = p_key;
    IF NOT FOUND AND NOT v_free THEN
        RETURN QUERY SELECT NULL::text, NULL::text, NULL::jsonb, NULL::timestamptz,
                            NULL::jsonb, true;
    END IF;
END $$;
