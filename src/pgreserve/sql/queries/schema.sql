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
