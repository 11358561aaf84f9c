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
