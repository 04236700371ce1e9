"""backfill_assets: exact, audited Kafka -> Iceberg backfills as Dagster partition ranges."""
