-- A legacy sale (rollout_legacy_sale) of units pgreserve never held also leaves
-- pgreserve's count of the line (sql/queries/rollout.sql,
-- rollout_legacy_sale_record): `counted` says it did, so that it does so once
-- however often the sale is recorded again (a repeated claim, after any request
-- key has been forgotten). Sales recorded before this column were not counted.
ALTER TABLE rollout_legacy_sale ADD COLUMN counted boolean NOT NULL DEFAULT false;
