"""Partition definitions, named once and reused by assets, checks and sensors."""

from __future__ import annotations

import dagster as dg

from backfill_assets.spec.model import TopicSpec


def kafka_hours(spec: TopicSpec) -> dg.HourlyPartitionsDefinition:
    """Hourly partitions on the Kafka record timestamp (UTC) of one topic."""
    return dg.HourlyPartitionsDefinition(
        start_date=spec.partition_start.strftime("%Y-%m-%d-%H:%M"), timezone="UTC"
    )
