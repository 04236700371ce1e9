-- Run once by the postgres image's entrypoint on an empty data directory (docker-compose.yml mounts
-- this folder at /docker-entrypoint-initdb.d). Only needed for the JDBC/Postgres SQL-catalog variant
-- (BACKFILL_CATALOG_KIND=sql); the REST variant keeps its catalog inside the REST service.
-- No credentials here: the owner is the POSTGRES_USER the container was started with.
CREATE DATABASE iceberg_catalog;
