"""The project's single Dagster entry point (loaded by workspace.yaml and the tests)."""

from __future__ import annotations

import dagster as dg

from backfill_assets.assets import build_raw_asset
from backfill_assets.resources import IcebergResource, KafkaResource, SparkResource
from backfill_assets.spec import load_specs

SPECS = load_specs()

RESOURCES: dict[str, object] = {
    "kafka": KafkaResource(),
    "spark": SparkResource(),
    "iceberg": IcebergResource(),
}

defs = dg.Definitions(assets=[build_raw_asset(spec) for spec in SPECS], resources=RESOURCES)
