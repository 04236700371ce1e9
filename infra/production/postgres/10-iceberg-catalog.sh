#!/bin/sh
# Run once by the postgres image's entrypoint on an empty data directory (docker-compose.yml
# mounts this folder at /docker-entrypoint-initdb.d; never run here: no Docker engine). Makes
# what backfill_assets_tests/support/postgres.py makes for the Iceberg JDBC catalog, which ran
# on Postgres 15: the role `iceberg` (password BACKFILL_CATALOG_JDBC_PASSWORD, scram-sha-256)
# owning the database `iceberg_catalog`. The `dagster` role and database are the image's
# POSTGRES_USER/POSTGRES_DB. The password reaches psql as a variable, never as a file.
set -eu
psql -v ON_ERROR_STOP=1 -v pw="$BACKFILL_CATALOG_JDBC_PASSWORD" \
    --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<'SQL'
SET password_encryption = 'scram-sha-256';
CREATE ROLE iceberg LOGIN PASSWORD :'pw';
CREATE DATABASE iceberg_catalog OWNER iceberg;
SQL
