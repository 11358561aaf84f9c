CREATE OR REPLACE FUNCTION tenant_require_v1(p_tenant bigint) RETURNS void
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM 1 FROM tenant WHERE tenant_id = p_tenant;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown tenant %', p_tenant USING ERRCODE = 'PR401';
    END IF;
END $$;

-- Create a tenant and its first API key in one transaction.
CREATE OR REPLACE FUNCTION tenant_create_v1(p_name text, p_key_hash bytea)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_tenant bigint;
BEGIN
    INSERT INTO tenant (name) VALUES (p_name) RETURNING tenant_id INTO v_tenant;
    INSERT INTO api_key (tenant_id, key_hash) VALUES (v_tenant, p_key_hash);
    RETURN v_tenant;
END $$;

-- The same, keeping the first characters of the key for `tenant key list`.
CREATE OR REPLACE FUNCTION tenant_create_v2(p_name text, p_key_hash bytea, p_key_prefix text)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_tenant bigint;
BEGIN
    INSERT INTO tenant (name) VALUES (p_name) RETURNING tenant_id INTO v_tenant;
    INSERT INTO api_key (tenant_id, key_hash, key_prefix) VALUES (v_tenant, p_key_hash, p_key_prefix);
    RETURN v_tenant;
END $$;
