"""Dagster definitions: assets, checks, sensors, resources and partitions."""
