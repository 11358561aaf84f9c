-- A reservation's reference (the shop's cart or order id) and metadata (free-form
-- string pairs), given at reserve and shown in every reservation document. A
-- reservation without them has reference NULL and metadata '{}': a constant
-- default, so no table rewrite. The rules (at most 50 keys of 1-40 characters,
-- values of at most 500) are checked before any SQL runs; the checks here keep
-- the shape.
ALTER TABLE reservation
    ADD COLUMN reference text CHECK (length(reference) BETWEEN 1 AND 200),
    ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object');

ALTER TABLE reservation ALTER COLUMN metadata SET STATISTICS 0;

-- GET /v1/reservations pages newest first by (created_at, reservation_id), both
-- never updated: one range of the tenant's part of each index, whatever other
-- tenants hold. The reference index has only the reservations that carry one.
CREATE INDEX reservation_list_idx ON reservation (tenant_id, created_at, reservation_id);
CREATE INDEX reservation_reference_idx
    ON reservation (tenant_id, reference, created_at, reservation_id)
    WHERE reference IS NOT NULL;

-- reserve_v1 and bucket_batch_v1 took the reference and metadata as new last
-- arguments with defaults (sql/functions/): their signatures without them go, so a
-- call in the older form resolves to the one function that has them.
DROP FUNCTION IF EXISTS reserve_v1(bigint, text, text, text[], text[], integer[], interval,
                                   timestamptz);
DROP FUNCTION IF EXISTS bucket_batch_v1(bigint, bigint, text[], text[], text[], integer[],
                                        interval[], uuid[], timestamptz);
