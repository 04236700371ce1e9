"""The project's single Dagster entry point (loaded by workspace.yaml and the tests)."""

from __future__ import annotations

import dagster as dg

from backfill_assets.archiver import build_archive_asset, build_archive_schedule
from backfill_assets.assets import build_topic_assets
from backfill_assets.resources import IcebergResource, KafkaResource, SparkResource
from backfill_assets.sensors import build_gap_sensor, build_late_data_sensor
from backfill_assets.spec import load_specs

SPECS = load_specs()

RESOURCES: dict[str, object] = {
    "kafka": KafkaResource(),
    "spark": SparkResource(),
    "iceberg": IcebergResource(),
}

ASSETS = [asset for spec in SPECS for asset in build_topic_assets(spec)] + [
    build_archive_asset(spec) for spec in SPECS
]
SENSORS = [
    sensor for spec in SPECS for sensor in (build_gap_sensor(spec), build_late_data_sensor(spec))
]

SCHEDULES = [build_archive_schedule(spec) for spec in SPECS]

defs = dg.Definitions(assets=ASSETS, sensors=SENSORS, schedules=SCHEDULES, resources=RESOURCES)
