-- The version of what an operator sets on a stock line (on_hand by a count or an
-- adjustment, strategy, pool_cap): the ETag of GET /v1/stock/{location}/{sku} and the
-- value If-Match is checked against, by the conditional write that bumps it
-- (sql/functions/stock.sql). Holds, claims, releases and expiry never touch it, so the
-- hot path writes nothing more. A constant default: no table rewrite.
ALTER TABLE stock_bucket ADD COLUMN version bigint NOT NULL DEFAULT 1 CHECK (version >= 1);

-- GET /v1/stock pages by (sku, location) in byte order, whatever the database's
-- collation, so a cursor means the same on every server; an SKU prefix is a range of
-- this index (starts_with under the C collation). Neither column is ever updated, so
-- the hot path's updates of the bucket row stay HOT.
CREATE INDEX stock_bucket_list_idx
    ON stock_bucket (tenant_id, sku COLLATE "C", location COLLATE "C");
