"""A team's Dagster project: its own assets, and the lakehouse tables of backfill_assets."""
