"""Definitions from a list of topic specs: assets, checks, sensors, schedules, jobs,
resources and the run executor. No module-level state: the project's code location
(``defs/definitions.py``) and a team's (``defs/embed.py``) each call :func:`build_defs`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from backfill_assets.defs.archiver import build_archive_asset, build_archive_schedule
from backfill_assets.defs.assets import build_topic_assets, quarantine_asset
from backfill_assets.defs.maintenance import build_maintenance_defs
from backfill_assets.defs.resources import (
    CATALOG_SECRETS,
    KAFKA_SECRETS,
    SPARK_SECRETS,
    IcebergResource,
    KafkaResource,
    SparkResource,
)
from backfill_assets.defs.sensors import build_gap_sensor, build_late_data_sensor
from backfill_assets.defs.topics import build_topic_observer, topic_asset
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings


def build_resources(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The resources, each secret a ``dg.EnvVar`` when its variable is set in ``environ``
    (default: the process environment): the Dagster UI shows the variable's name, never its
    value, and the run resolves it. An unset variable stays None, so nothing requires it."""
    env = os.environ if environ is None else environ

    def secrets(fields: Mapping[str, str]) -> dict[str, Any]:
        return {field: dg.EnvVar(var) if var in env else None for field, var in fields.items()}

    return {
        "kafka": KafkaResource(**secrets(KAFKA_SECRETS)),
        "spark": SparkResource(**secrets(SPARK_SECRETS)),
        "iceberg": IcebergResource(**secrets(CATALOG_SECRETS)),
    }


def run_executor() -> dg.ExecutorDefinition:
    """The executor of every run, however launched (UI, CLI, sensors): ``BACKFILL_RUN_EXECUTOR``.

    ``in_process`` (default) runs a run's steps one after another in the run worker, on one
    Spark session. Dagster's own default, ``multiprocess``, starts a process per step that loads
    the code location again and starts its own Spark session: ~10 s per step on 2 cores
    (bench/latency.py), for no parallelism, since a run's steps read what the previous one
    published (current state and declared tables read the raw table). What a step writes, checks
    and publishes is the same either way."""
    if Settings.from_env().run_executor == "multiprocess":
        return dg.multiprocess_executor
    return dg.in_process_executor


def build_defs(specs: Sequence[TopicSpec]) -> dg.Definitions:
    """Assets, checks, sensors and schedules for ``specs``, with the default resources and
    executor (:func:`run_executor`)."""
    specs = list(specs)
    assets: list[dg.AssetsDefinition | dg.AssetSpec] = [topic_asset(spec) for spec in specs]
    assets += [build_archive_asset(spec) for spec in specs]
    with warnings.catch_warnings():
        # A deliberate choice (assets.BACKFILL_POLICY), said once per asset by Dagster 1.13 on
        # every load of the code location, CLI command and run: noise for an operator.
        warnings.filterwarnings(
            "ignore", message="Parameter `backfill_policy`", category=dg.BetaWarning
        )
        assets += [asset for spec in specs for asset in build_topic_assets(spec, specs)]
    assets += [quarantine_asset(spec) for spec in specs]
    sensors = [
        sensor
        for spec in specs
        for sensor in (
            build_topic_observer(spec),
            build_gap_sensor(spec, specs),
            build_late_data_sensor(spec, specs),
        )
    ]
    maintenance_jobs, maintenance_schedules = build_maintenance_defs(specs)
    return dg.Definitions(
        assets=assets,
        sensors=sensors,
        schedules=[build_archive_schedule(spec) for spec in specs] + maintenance_schedules,
        jobs=maintenance_jobs,
        resources=build_resources(),
        executor=run_executor(),
    )
