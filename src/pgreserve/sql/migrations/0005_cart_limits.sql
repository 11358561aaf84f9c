-- Per-cart limits: a reservation may hold at most cart_limit units of a SKU,
-- over all its lines of that SKU. The limit belongs to the SKU (sku_setting);
-- every bucket of the SKU carries a copy in stock_bucket.cart_limit, the row
-- reserve_v1 and bucket_batch_v1 read anyway, so a reserve reads nothing more
-- for it. sku_limit_set_v1 writes the setting and every copy under the SKU's
-- lock, which stock_set_v1 takes too when it creates a bucket (sku.sql).
CREATE TABLE sku_setting (
    tenant_id  bigint NOT NULL REFERENCES tenant,
    sku        text NOT NULL,
    cart_limit integer CHECK (cart_limit BETWEEN 1 AND 1000000),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, sku)
);

ALTER TABLE stock_bucket ADD COLUMN cart_limit integer CHECK (cart_limit BETWEEN 1 AND 1000000);
