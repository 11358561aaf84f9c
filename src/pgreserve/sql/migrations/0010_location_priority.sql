-- Allocation across locations (sql/functions/allocation.sql): a cart line that
-- names no location takes its units from the SKU's locations in priority order.
-- The tenant's order applies to every SKU; a SKU's own order replaces it for
-- that SKU. Locations a list does not name come after the named ones, in name
-- order; names of locations a SKU has no stock at are ignored.
CREATE TABLE location_priority (
    tenant_id  bigint NOT NULL REFERENCES tenant PRIMARY KEY,
    locations  text[] NOT NULL CHECK (cardinality(locations) <= 100),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sku_location_priority (
    tenant_id  bigint NOT NULL REFERENCES tenant,
    sku        text NOT NULL,
    locations  text[] NOT NULL CHECK (cardinality(locations) <= 100),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, sku)
);
