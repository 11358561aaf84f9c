-- Freezes (table stock_freeze, migration 0003): an operator stops new holds of a
-- bucket or of a whole tenant (bucket_id 0). The paths that create holds
-- (reserve_v1, bucket_batch_v1) take freeze_lock_v1's lock shared before they
-- read the live freezes; freeze_set_v1 takes it exclusively, so once a freeze
-- has committed no transaction that missed it can still create a hold.

-- The tenant's freeze lock: an advisory key of its own class (two int4 keys,
-- apart from the request keys' bigint locks). A hash collision between two
-- tenants only makes a freeze of one wait for the other's takes in flight.
CREATE OR REPLACE FUNCTION freeze_lock_key_v1(p_tenant bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT hashint8(p_tenant) $$;

-- (Every function here is PL/pgSQL, with no row types of stock_freeze: the
-- function files are applied after every migration step, also before 0003.)

-- Freeze a bucket (p_bucket > 0) or the tenant (p_bucket = 0). Returns the
-- live freeze, with "already": true when it was frozen before.
CREATE OR REPLACE FUNCTION freeze_set_v1(p_tenant bigint, p_bucket bigint, p_reason text,
                                         p_by text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    -- waits for every take in flight of this tenant, and holds off new ones
    -- until this transaction ends
    PERFORM pg_advisory_xact_lock(1885827686, freeze_lock_key_v1(p_tenant));
    INSERT INTO stock_freeze (tenant_id, bucket_id, reason, frozen_by, frozen_at)
    VALUES (p_tenant, p_bucket, p_reason, p_by, clock_timestamp())
    ON CONFLICT (tenant_id, bucket_id) WHERE lifted_at IS NULL DO NOTHING
    RETURNING freeze_id INTO v_id;
    IF FOUND THEN
        RETURN freeze_doc_v1(p_tenant, v_id) || '{"already": false}'::jsonb;
    END IF;
    SELECT freeze_id INTO v_id FROM stock_freeze
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND lifted_at IS NULL;
    RETURN freeze_doc_v1(p_tenant, v_id) || '{"already": true}'::jsonb;
END $$;

-- Lift the live freeze of a bucket or tenant; NULL when there is none. The
-- row stays, with who lifted it, when and why.
CREATE OR REPLACE FUNCTION freeze_lift_v1(p_tenant bigint, p_bucket bigint, p_reason text,
                                          p_by text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    UPDATE stock_freeze
    SET lifted_at = clock_timestamp(), lifted_by = p_by, lift_reason = p_reason
    WHERE tenant_id = p_tenant AND bucket_id = p_bucket AND lifted_at IS NULL
    RETURNING freeze_id INTO v_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN freeze_doc_v1(p_tenant, v_id);
END $$;

-- One freeze as the CLI, /ops and the operator endpoints show it.
CREATE OR REPLACE FUNCTION freeze_doc_v1(p_tenant bigint, p_id bigint) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        SELECT jsonb_build_object(
            'id', f.freeze_id, 'tenant_id', f.tenant_id, 'tenant', t.name,
            'scope', CASE WHEN f.bucket_id = 0 THEN 'tenant' ELSE 'bucket' END,
            'sku', b.sku, 'location', b.location,
            'reason', f.reason, 'frozen_by', f.frozen_by, 'frozen_at', f.frozen_at,
            'lifted_by', f.lifted_by, 'lifted_at', f.lifted_at, 'lift_reason', f.lift_reason)
        FROM stock_freeze f
        JOIN tenant t ON t.tenant_id = f.tenant_id
        LEFT JOIN stock_bucket b ON b.tenant_id = f.tenant_id AND b.bucket_id = f.bucket_id
        WHERE f.tenant_id = p_tenant AND f.freeze_id = p_id);
END $$;

-- The refusal a reserve stores when its tenant or one of its buckets is
-- frozen (NULL when none is). Read after the caller took the freeze lock shared.
CREATE OR REPLACE FUNCTION freeze_refusal_v1(p_tenant bigint, p_buckets bigint[])
RETURNS jsonb LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (
        SELECT CASE
            WHEN bool_or(f.bucket_id = 0) THEN jsonb_build_object(
                'status', 'rejected', 'reason', 'tenant_frozen', 'frozen_lines', '[]'::jsonb)
            WHEN count(*) > 0 THEN jsonb_build_object(
                'status', 'rejected', 'reason', 'bucket_frozen',
                'frozen_lines', jsonb_agg(jsonb_build_object('sku', b.sku, 'location', b.location)
                                          ORDER BY b.sku COLLATE "C",
                                                   b.location COLLATE "C"))
            END
        FROM stock_freeze f
        LEFT JOIN stock_bucket b ON b.tenant_id = f.tenant_id AND b.bucket_id = f.bucket_id
        WHERE f.tenant_id = p_tenant AND f.lifted_at IS NULL
          AND f.bucket_id = ANY (p_buckets || 0::bigint));
END $$;
