"""The project's single Dagster entry point (loaded by workspace.yaml and the tests)."""

from __future__ import annotations

import dagster as dg

from backfill_assets.resources import IcebergResource, KafkaResource, SparkResource

RESOURCES: dict[str, object] = {
    "kafka": KafkaResource(),
    "spark": SparkResource(),
    "iceberg": IcebergResource(),
}

defs = dg.Definitions(resources=RESOURCES)
