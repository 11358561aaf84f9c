-- Settings of a SKU over all its locations (table sku_setting, migration 0005):
-- today the per-cart limit. (PL/pgSQL where a table of 0005 is read: the
-- function files are applied after every migration step, also before 0005.)

-- The SKU's lock: taken by whoever writes the SKU's limit or creates one of its
-- buckets, so a new bucket always carries the limit in force. Its own class of
-- two-int advisory keys; a hash collision only serialises two such writes.
CREATE OR REPLACE FUNCTION sku_lock_v1(p_tenant bigint, p_sku text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(1885827687, hashtext(p_tenant::text || '/' || p_sku))
$$;

-- Set (p_limit 1..1,000,000) or remove (NULL) the SKU's per-cart limit, for its
-- buckets now and those created later. Returns the SKU's settings.
CREATE OR REPLACE FUNCTION sku_limit_set_v1(p_tenant bigint, p_sku text, p_limit integer)
RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    PERFORM sku_lock_v1(p_tenant, p_sku);
    INSERT INTO sku_setting (tenant_id, sku, cart_limit, updated_at)
    VALUES (p_tenant, p_sku, p_limit, clock_timestamp())
    ON CONFLICT (tenant_id, sku) DO UPDATE
        SET cart_limit = excluded.cart_limit, updated_at = excluded.updated_at;
    UPDATE stock_bucket SET cart_limit = p_limit
    WHERE tenant_id = p_tenant AND sku = p_sku AND cart_limit IS DISTINCT FROM p_limit;
    RETURN sku_settings_v1(p_tenant, p_sku);
END $$;

-- The SKU's settings (a SKU never set has none: cart_limit null), with its own
-- location priority (sku_location_priority, migration 0010; null: none).
CREATE OR REPLACE FUNCTION sku_settings_v1(p_tenant bigint, p_sku text) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM tenant_require_v1(p_tenant);
    RETURN jsonb_build_object('sku', p_sku, 'cart_limit',
        (SELECT cart_limit FROM sku_setting WHERE tenant_id = p_tenant AND sku = p_sku),
        'location_priority',
        (SELECT to_jsonb(locations) FROM sku_location_priority
         WHERE tenant_id = p_tenant AND sku = p_sku));
END $$;

-- The refusal of a cart that asks more units of a SKU (summed over its lines)
-- than the SKU's limit (p_limits: each line's bucket copy); NULL when it does not.
CREATE OR REPLACE FUNCTION cart_limit_refusal_v1(p_skus text[], p_quantities integer[],
                                                 p_limits integer[])
RETURNS jsonb LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT jsonb_build_object(
               'status', 'rejected', 'reason', 'cart_limit_exceeded',
               'limited_lines', jsonb_agg(jsonb_build_object(
                   'sku', sku, 'limit', lim, 'requested', total) ORDER BY sku COLLATE "C"))
    FROM (SELECT sku, min(lim) AS lim, sum(q) AS total
          FROM unnest(p_skus, p_quantities, p_limits) AS u(sku, q, lim)
          GROUP BY sku) s
    WHERE lim IS NOT NULL AND total > lim
    HAVING count(*) > 0
$$;
