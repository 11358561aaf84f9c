-- Rollout beside a legacy Redis hold store (src/pgreserve/rollout/).

-- Each tenant's current mode; a tenant without a row is in mode 'pgreserve'.
-- redis_until: until then, holds taken while Redis was written may still be
-- claimed or released, and finish under the mode they were taken in.
CREATE TABLE rollout_mode (
    tenant_id   bigint PRIMARY KEY REFERENCES tenant (tenant_id),
    mode        text NOT NULL CHECK (mode IN ('legacy', 'shadow', 'primary', 'pgreserve')),
    redis_until timestamptz,
    changed_at  timestamptz NOT NULL DEFAULT now(),
    changed_by  text NOT NULL CHECK (length(changed_by) BETWEEN 1 AND 200)
);

-- Every switch, who made it and when.
CREATE TABLE rollout_mode_change (
    tenant_id  bigint NOT NULL REFERENCES tenant (tenant_id),
    change_id  bigint GENERATED ALWAYS AS IDENTITY,
    from_mode  text NOT NULL,
    to_mode    text NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL,
    PRIMARY KEY (tenant_id, change_id)
);

-- One row per request seen by both stores (shadow and primary modes).
CREATE TABLE rollout_comparison (
    tenant_id         bigint NOT NULL REFERENCES tenant (tenant_id),
    comparison_id     bigint GENERATED ALWAYS AS IDENTITY,
    at                timestamptz NOT NULL,
    mode              text NOT NULL,
    operation         text NOT NULL,
    request_key       text NOT NULL,
    agree             boolean NOT NULL,
    legacy_outcome    jsonb NOT NULL,
    pgreserve_outcome jsonb NOT NULL,
    legacy_ms         double precision NOT NULL,
    pgreserve_ms      double precision NOT NULL,
    PRIMARY KEY (tenant_id, comparison_id)
);
CREATE INDEX rollout_comparison_disagree ON rollout_comparison (tenant_id, comparison_id)
    WHERE NOT agree;

-- Requests per tenant and day that went through the rollout layer (rollout plan).
CREATE TABLE rollout_traffic (
    tenant_id bigint NOT NULL REFERENCES tenant (tenant_id),
    day       date NOT NULL,
    requests  bigint NOT NULL CHECK (requests >= 0),
    PRIMARY KEY (tenant_id, day)
);

-- The legacy design's order ledger: a sale written after Redis dropped the hold,
-- in a transaction of its own (the crash gap that pgreserve's claim closes).
CREATE TABLE rollout_legacy_sale (
    tenant_id      bigint NOT NULL REFERENCES tenant (tenant_id),
    reservation_id uuid NOT NULL,
    sku            text NOT NULL,
    location       text NOT NULL,
    quantity       integer NOT NULL CHECK (quantity > 0),
    sold_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, reservation_id, sku, location)
);
