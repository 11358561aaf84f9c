-- Takes are all or nothing and report what they took; the old signatures go
-- (their replacements are in sql/functions/). on_hand gets the bound that every
-- input is checked against, so no sum of accepted inputs overflows.
DROP FUNCTION IF EXISTS pool_take_units_v1(bigint, bigint, integer, bigint);
DROP FUNCTION IF EXISTS bucket_take_v1(bigint, bigint, integer, timestamptz, text, bigint, bigint);
DROP FUNCTION IF EXISTS bucket_untake_v1(bigint, bigint, integer, text);
DROP FUNCTION IF EXISTS bucket_reclaim_expired_v1(bigint, bigint, timestamptz, bigint);

ALTER TABLE stock_bucket ADD CONSTRAINT stock_bucket_on_hand_bound
    CHECK (on_hand <= 9007199254740992);
