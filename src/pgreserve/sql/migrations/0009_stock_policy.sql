-- Stock policy per bucket: safety stock and backorders (sql/functions/policy.sql).
--
-- safety_stock: units never promised to buyers. Every take from free is the
-- conditional write "free - n >= safety_stock", and the pool is filled only from
-- free above safety_stock, so the units a bucket keeps back always sit in free:
-- a pool bucket with units in its pool has free >= safety_stock. What can be
-- promised is pool + max(0, free (+ usable expired holds) - safety_stock).
--
-- backorder_limit: units that may be held beyond on_hand. A line that needs more
-- than is promisable takes the rest from the allowance; reservation_line.backordered
-- is that part of the line, fixed when it is held. backorder_held counts the
-- backordered units of held lines, backorder_owed those of claimed lines that no
-- receipt has covered yet; the conditional write that takes allowance checks
-- backorder_held + backorder_owed + n <= backorder_limit. Receipts (and units given
-- back) pay shortfall first, then backorder_owed, before anything is free again.
--
-- The accounting identity of the 0001 baseline becomes
--     on_hand = free + pool + held - backorder_held
-- (a backordered unit is held but not on hand), and the movement ledger's
--     on_hand - shortfall - backorder_owed = counts + adjustments + sales
-- (a claim records its whole quantity as a sale; the owed part leaves on_hand
-- only when a receipt pays it). invariant_violations_v1 checks both.
-- Constant defaults: no table rewrite.
ALTER TABLE stock_bucket
    ADD COLUMN safety_stock bigint NOT NULL DEFAULT 0
        CHECK (safety_stock BETWEEN 0 AND 9007199254740992),
    ADD COLUMN backorder_limit bigint NOT NULL DEFAULT 0
        CHECK (backorder_limit BETWEEN 0 AND 9007199254740992),
    ADD COLUMN backorder_held bigint NOT NULL DEFAULT 0 CHECK (backorder_held >= 0),
    ADD COLUMN backorder_owed bigint NOT NULL DEFAULT 0 CHECK (backorder_owed >= 0);

ALTER TABLE reservation_line
    ADD COLUMN backordered integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT reservation_line_backordered_range
        CHECK (backordered >= 0 AND backordered <= quantity);
