-- pgreserve HTTP service: API keys, keyed state transitions, request-key retention.
--
-- API keys are stored as the sha256 of the key, never the key itself: a leaked
-- table does not let anyone call the API. A tenant may have several keys.

CREATE TABLE api_key (
    tenant_id  bigint NOT NULL REFERENCES tenant,
    key_hash   bytea NOT NULL PRIMARY KEY CHECK (length(key_hash) = 32),
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE INDEX api_key_tenant_idx ON api_key (tenant_id);

-- Create a tenant and its first API key in one transaction.
CREATE FUNCTION tenant_create_v1(p_name text, p_key_hash bytea)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_tenant bigint;
BEGIN
    INSERT INTO tenant (name) VALUES (p_name) RETURNING tenant_id INTO v_tenant;
    INSERT INTO api_key (tenant_id, key_hash) VALUES (v_tenant, p_key_hash);
    RETURN v_tenant;
END $$;

-- Claim, release or extend under a request key (the HTTP Idempotency-Key).
-- The transition and its stored outcome commit together, so a repeat with the
-- same key replays the first answer (even for extend, which is not idempotent
-- by state), and the same key with other parameters raises PR422. A failed
-- transition (PR4xx) rolls back and stores nothing.
CREATE FUNCTION transition_keyed_v1(p_tenant bigint, p_key text, p_operation text,
                                    p_digest text, p_id uuid, p_ttl interval,
                                    p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_replay jsonb;
    v_view jsonb;
    v_outcome jsonb;
BEGIN
    v_replay := ledger_check_v1(p_tenant, p_key, p_operation, p_digest);
    IF v_replay IS NOT NULL THEN
        RETURN v_replay;
    END IF;
    v_view := CASE p_operation
        WHEN 'claim' THEN claim_v1(p_tenant, p_id, p_now)
        WHEN 'release' THEN release_v1(p_tenant, p_id, p_now)
        WHEN 'extend' THEN extend_v1(p_tenant, p_id, p_ttl, p_now)
    END;
    IF v_view IS NULL THEN
        RAISE EXCEPTION 'unknown operation %', p_operation USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_outcome := jsonb_build_object('status', 'applied', 'reservation', v_view);
    PERFORM ledger_record_v1(p_tenant, p_key, p_operation, p_digest, 'succeeded', v_outcome);
    RETURN v_outcome;
END $$;

-- Forget request keys older than p_keep, at most p_batch per call (the
-- request_ledger_created_idx index serves the scan). Returns how many went.
CREATE FUNCTION request_keys_purge_v1(p_keep interval, p_batch integer,
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
