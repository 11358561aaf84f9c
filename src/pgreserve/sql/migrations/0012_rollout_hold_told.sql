-- Rollout, mode primary (rollout/router.py): a hold pgreserve answered while the
-- legacy store did not answer is the caller's answer, and `rollout_told` says so:
-- a refusal the legacy store keeps under the key (its reserve may still have run
-- after the caller stopped waiting for it) never replaces that hold
-- (ledger_refusal_record_v1).
ALTER TABLE request_ledger ADD COLUMN rollout_told boolean NOT NULL DEFAULT false;
