"""The project's single Dagster entry point (loaded by workspace.yaml and the tests)."""

from __future__ import annotations

import dagster as dg

from backfill_assets.assets import build_topic_assets
from backfill_assets.resources import IcebergResource, KafkaResource, SparkResource
from backfill_assets.spec import load_specs

SPECS = load_specs()

RESOURCES: dict[str, object] = {
    "kafka": KafkaResource(),
    "spark": SparkResource(),
    "iceberg": IcebergResource(),
}

ASSETS = [asset for spec in SPECS for asset in build_topic_assets(spec)]

defs = dg.Definitions(assets=ASSETS, resources=RESOURCES)
