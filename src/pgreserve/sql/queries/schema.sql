-- The schema runner's own statements (db/migrate.py).

-- name: schema_lock
-- One runner at a time: the others wait here, then find nothing to do.
SELECT pg_advisory_xact_lock(%s);

-- name: schema_migration_table_create
CREATE TABLE IF NOT EXISTS pgreserve_migration (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now());

-- name: schema_function_file_table_create
CREATE TABLE IF NOT EXISTS pgreserve_function_file (
    name       text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now());

-- name: schema_migration_table_exists
SELECT to_regclass('pgreserve_migration');

-- name: schema_function_file_table_exists
SELECT to_regclass('pgreserve_function_file');

-- name: schema_migration_list
SELECT version, name, checksum FROM pgreserve_migration ORDER BY version;

-- name: schema_migration_record
INSERT INTO pgreserve_migration (version, name, checksum) VALUES (%s, %s, %s);

-- name: schema_function_file_list
SELECT name, checksum FROM pgreserve_function_file;

-- name: schema_function_file_record
INSERT INTO pgreserve_function_file (name, checksum) VALUES (%s, %s)
ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now();

-- name: schema_create
CREATE SCHEMA IF NOT EXISTS {};

-- name: schema_search_path
-- The runner's search_path: objects are created in the schema, and `SET search_path
-- FROM CURRENT` in a function records it (pg_temp last: never searched first).
SET LOCAL search_path TO {}, pg_temp;

-- name: schema_public_install_exists
-- An installation made before pgreserve had a schema of its own: its tables are in
-- public, and the schema being migrated has none yet.
SELECT to_regclass('public.pgreserve_migration') IS NOT NULL
   AND to_regclass(quote_ident(%s) || '.pgreserve_migration') IS NULL;

-- name: schema_public_migration_list
SELECT version, name, checksum FROM public.pgreserve_migration ORDER BY version;

-- name: schema_adopt_public
-- Move every object that pgreserve's migrations and function files create from
-- public into the current schema (the one being migrated), data, indexes, triggers,
-- grants and sequences with them. Only these names: a shop's own objects in public
-- stay where they are. The moved functions are replaced by the function files next.
-- (Releases before the schema had migrations 0001-0004; the list names every table
-- and function of today's, which test_schema.py checks leave nothing in public.)
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT c.relname, c.relkind
        FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace
          AND c.relkind IN ('r', 'p', 'S')
          AND (c.relname = ANY (ARRAY[
                  'pgreserve_migration', 'pgreserve_function_file', 'tenant',
                  'stock_bucket', 'stock_unit_id_seq', 'stock_unit', 'reservation',
                  'reservation_line', 'request_ledger', 'stock_movement', 'outbox_event',
                  'api_key', 'webhook_endpoint', 'webhook_delivery', 'stock_freeze',
                  'rollout_mode', 'rollout_mode_change', 'rollout_comparison',
                  'rollout_traffic', 'rollout_legacy_sale', 'sku_setting',
                  'location_priority', 'sku_location_priority'])
               OR c.relname ~ '^stock_unit_p[0-9]+$')
          -- identity and serial sequences move with their table
          AND (c.relkind <> 'S' OR NOT EXISTS (
                   SELECT 1 FROM pg_depend d
                   WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                     AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')))
    LOOP
        EXECUTE format('ALTER %s public.%I SET SCHEMA %I',
                       CASE r.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
                       r.relname, current_schema());
    END LOOP;
    FOR r IN
        SELECT p.oid::regprocedure AS signature
        FROM pg_proc p
        WHERE p.pronamespace = 'public'::regnamespace
          AND NOT EXISTS (SELECT 1 FROM pg_depend d
                          WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                            AND d.deptype = 'e')
          AND p.proname = ANY (ARRAY[
              'bucket_backorder_give_back_v1', 'bucket_backorder_take_v1',
              'bucket_apply_on_hand_v1', 'bucket_batch_keyed_v1', 'bucket_batch_look_v1',
              'bucket_batch_v1',
              'bucket_give_back_v1', 'bucket_lock_exclusive_v1', 'bucket_reclaim_expired_v1',
              'bucket_take_v1', 'bucket_untake_v1', 'bucket_view_v1', 'cart_limit_refusal_v1',
              'change_v1', 'claim_v1', 'expire_due_v1', 'expire_due_v2', 'extend_v1', 'extend_v2', 'freeze_doc_v1', 'freeze_lift_v1',
              'freeze_lock_key_v1', 'freeze_refusal_v1', 'freeze_set_v1',
              'invariant_violations_v1', 'ledger_check_v1', 'ledger_record_v1',
              'ledger_hold_told_v1', 'ledger_refusal_record_v1',
              'location_priority_get_v1', 'location_priority_of_v1',
              'location_priority_set_v1', 'reserve_allocated_v1', 'sku_update_v1',
              'pool_refill_candidates_v1', 'pool_refill_v1', 'pool_replenish_v1',
              'pool_take_units_v1', 'pool_units_delete_v1', 'release_v1',
              'request_begin_v1', 'request_keys_purge_v1', 'request_view_v1',
              'reservation_give_back_v1',
              'reservation_line_held_guard', 'reservation_lines_held_v1', 'reservation_lock_v1',
              'reservation_transition_guard', 'reservation_view_v1', 'reserve_v1',
              'sku_limit_set_v1', 'sku_lock_v1', 'sku_settings_v1',
              'stock_adjust_v1', 'stock_adjust_v2', 'stock_precondition_failed_v1',
              'stock_set_v1', 'stock_set_v2', 'stock_set_v3', 'tenant_create_v1', 'tenant_create_v2',
              'tenant_require_v1', 'transition_keyed_v1', 'transition_keyed_v2',
              'webhook_advance_v1',
              'webhook_claim_v1', 'webhook_claim_v2', 'webhook_fail_v1', 'webhook_register_v1',
              'webhook_release_v1'])
    LOOP
        EXECUTE format('ALTER ROUTINE %s SET SCHEMA %I', r.signature, current_schema());
    END LOOP;
END $$;

-- name: schema_function_file_forget
-- After a move from public: every function file is applied again in the schema.
DELETE FROM pgreserve_function_file;
