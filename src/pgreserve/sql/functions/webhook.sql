-- Register an endpoint. Its cursor starts after the tenant's last event that
-- has surely ended (xid below the snapshot's xmin): events from then on are
-- delivered, including those of transactions still open now.
CREATE OR REPLACE FUNCTION webhook_register_v1(p_tenant bigint, p_url text, p_secret text)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
    v_created timestamptz;
    v_xid xid8 := '0';
    v_event bigint := 0;
    v_next timestamptz;
BEGIN
    PERFORM 1 FROM tenant WHERE tenant_id = p_tenant;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown tenant %', p_tenant USING ERRCODE = 'PR401';
    END IF;
    SELECT xid, event_id INTO v_xid, v_event FROM outbox_event
     WHERE tenant_id = p_tenant AND xid < pg_snapshot_xmin(pg_current_snapshot())
     ORDER BY xid DESC, event_id DESC LIMIT 1;
    INSERT INTO webhook_endpoint (tenant_id, url, secret) VALUES (p_tenant, p_url, p_secret)
    RETURNING endpoint_id, created_at INTO v_id, v_created;
    INSERT INTO webhook_delivery (tenant_id, endpoint_id, cursor_xid, cursor_event_id)
    VALUES (p_tenant, v_id, coalesce(v_xid, '0'), coalesce(v_event, 0))
    RETURNING next_attempt_at INTO v_next;
    -- (its delivery state as the list shows it: due now, nothing sent or tried yet)
    RETURN jsonb_build_object('id', v_id, 'url', p_url, 'created_at', v_created,
                              'next_attempt_at', v_next);
END $$;

-- Claim up to p_limit due endpoints for p_lease, each with a new lease token, with a
-- share per tenant: a worker delivering to p_busy_counts[i]
-- endpoints of tenant p_busy_tenants[i] claims no more of that tenant's than brings
-- it to p_per_tenant, so endpoints that hang (each holding a delivery slot until its
-- timeout) take at most that many of the worker's slots; other tenants' endpoints get
-- the rest. Among the due endpoints, the longest due first.
CREATE OR REPLACE FUNCTION webhook_claim_v2(p_limit integer, p_lease interval,
                                            p_per_tenant integer, p_busy_tenants bigint[],
                                            p_busy_counts integer[],
                                            p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_out jsonb;
BEGIN
    WITH busy AS (
        SELECT b.tenant_id, sum(b.n)::integer AS n
        FROM unnest(p_busy_tenants, p_busy_counts) AS b(tenant_id, n)
        GROUP BY b.tenant_id
    ), ranked AS (
        SELECT d.tenant_id, d.endpoint_id, d.next_attempt_at,
               coalesce(busy.n, 0)
               + row_number() OVER (PARTITION BY d.tenant_id
                                    ORDER BY d.next_attempt_at, d.endpoint_id) AS slot
        FROM webhook_delivery d
        LEFT JOIN busy ON busy.tenant_id = d.tenant_id
        WHERE d.next_attempt_at <= v_now
    ), due AS (
        SELECT d.tenant_id, d.endpoint_id
        FROM webhook_delivery d
        JOIN ranked r ON r.tenant_id = d.tenant_id AND r.endpoint_id = d.endpoint_id
        WHERE r.slot <= p_per_tenant AND d.next_attempt_at <= v_now
        ORDER BY r.next_attempt_at
        LIMIT p_limit
        FOR UPDATE OF d SKIP LOCKED
    ), claimed AS (
        UPDATE webhook_delivery d
           SET lease_token = gen_random_uuid(), next_attempt_at = v_now + p_lease
          FROM due
         WHERE d.tenant_id = due.tenant_id AND d.endpoint_id = due.endpoint_id
        RETURNING d.tenant_id, d.endpoint_id, d.lease_token, d.cursor_xid,
                  d.cursor_event_id, d.attempts
    )
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'tenant', c.tenant_id, 'endpoint', c.endpoint_id, 'token', c.lease_token,
               'xid', c.cursor_xid::text::bigint, 'event_id', c.cursor_event_id,
               'attempts', c.attempts, 'url', e.url, 'secret', e.secret)), '[]'::jsonb)
      INTO v_out
      FROM claimed c JOIN webhook_endpoint e USING (tenant_id, endpoint_id);
    RETURN v_out;
END $$;

-- (kept for processes of the previous release during an upgrade: no share per tenant)
CREATE OR REPLACE FUNCTION webhook_claim_v1(p_limit integer, p_lease interval,
                                            p_now timestamptz DEFAULT NULL)
RETURNS jsonb LANGUAGE sql AS $$
    SELECT webhook_claim_v2(p_limit, p_lease, p_limit, '{}', '{}', p_now)
$$;

-- The event after the cursor was acknowledged: move the cursor and renew the
-- lease. False when the lease was lost (expired and claimed again, or the
-- endpoint was deleted): the caller must stop.
CREATE OR REPLACE FUNCTION webhook_advance_v1(p_tenant bigint, p_endpoint bigint, p_token uuid,
                                   p_xid bigint, p_event bigint, p_lease interval,
                                   p_now timestamptz DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
BEGIN
    UPDATE webhook_delivery
       SET cursor_xid = p_xid::text::xid8, cursor_event_id = p_event,
           delivered = delivered + 1, attempts = 0,
           last_attempt_at = v_now, last_success_at = v_now,
           next_attempt_at = v_now + p_lease
     WHERE tenant_id = p_tenant AND endpoint_id = p_endpoint AND lease_token = p_token;
    RETURN FOUND;
END $$;

-- Delivery of the next event failed: count the attempt, keep the error, and
-- give up the lease until a capped exponential backoff (with jitter) has passed.
-- Returns the attempts so far, or NULL when the lease was lost.
CREATE OR REPLACE FUNCTION webhook_fail_v1(p_tenant bigint, p_endpoint bigint, p_token uuid,
                                p_error text, p_base interval, p_cap interval,
                                p_now timestamptz DEFAULT NULL)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, clock_timestamp());
    v_attempts integer;
BEGIN
    UPDATE webhook_delivery
       SET attempts = attempts + 1, last_error = left(p_error, 1000), last_attempt_at = v_now,
           next_attempt_at = v_now + least(p_cap, p_base * power(2, least(attempts, 30)))
                                     * (0.5 + random() / 2),
           lease_token = NULL
     WHERE tenant_id = p_tenant AND endpoint_id = p_endpoint AND lease_token = p_token
    RETURNING attempts INTO v_attempts;
    RETURN v_attempts;
END $$;

-- Give up the lease; the endpoint is due again after p_after.
CREATE OR REPLACE FUNCTION webhook_release_v1(p_tenant bigint, p_endpoint bigint, p_token uuid,
                                   p_after interval, p_now timestamptz DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    UPDATE webhook_delivery
       SET next_attempt_at = coalesce(p_now, clock_timestamp()) + p_after, lease_token = NULL
     WHERE tenant_id = p_tenant AND endpoint_id = p_endpoint AND lease_token = p_token;
    RETURN FOUND;
END $$;
