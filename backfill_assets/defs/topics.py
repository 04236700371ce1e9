"""Kafka topics as external assets, the start of the lineage: topic -> archive -> raw -> tables.

Dagster does not materialize a topic; it observes it. The observer sensor of each topic (and
every raw run, at its start) records an ``AssetObservation`` of the topic: partitions, per
partition the log start offset, last stable offset and high watermark, the records Kafka
retains and the topic's retention. Observing reads Kafka metadata only (ListOffsets,
DescribeConfigs); it never consumes, joins a group or commits.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from backfill_assets.defs.resources import KafkaResource
from backfill_assets.lake.coverage.detect import retention_ms
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings

OBSERVE_INTERVAL_S = 300


def topic_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return dg.AssetKey(["kafka", spec.name])


def observer_name(spec: TopicSpec) -> str:
    return f"{spec.name}_observe_topic"


def topic_asset(spec: TopicSpec) -> dg.AssetSpec:
    """The topic as an external asset (observed, never materialized by this project)."""
    return dg.AssetSpec(
        key=topic_asset_key(spec),
        description=(
            f"Kafka topic {spec.topic!r}, written by its producers. Observed every "
            f"{OBSERVE_INTERVAL_S // 60} minutes by sensor {observer_name(spec)!r}: partitions, "
            "offsets per partition and retention."
        ),
        group_name="kafka",
        kinds={"kafka"},
        metadata={
            "topic": spec.topic,
            "key_field": spec.key_field,
            "event_time_field": spec.event_time_field,
            "allowed_lateness_hours": spec.allowed_lateness_hours,
        },
    )


def topic_figures(kafka: KafkaClient, spec: TopicSpec) -> dict[str, Any]:
    """What Kafka holds of the topic now: plain values, also used by the CLI and tests."""
    ends = kafka.log_ends(spec.topic)
    ms = retention_ms(kafka, spec.topic)
    return {
        "partitions": len(ends),
        "offsets": {
            str(p): {"log_start": s, "last_stable": lso, "high_watermark": hw}
            for p, (s, lso, hw) in sorted(ends.items())
        },
        "records_retained": sum(hw - s for s, _, hw in ends.values()),
        "open_transaction_partitions": sorted(p for p, (_, lso, hw) in ends.items() if lso < hw),
        "retention_hours": None if ms is None or ms < 0 else round(ms / 3_600_000, 2),
    }


def observation(kafka: KafkaResource, spec: TopicSpec) -> dg.AssetObservation:
    figures = topic_figures(kafka.client(), spec)
    return dg.AssetObservation(
        asset_key=topic_asset_key(spec),
        metadata={
            "partitions": figures["partitions"],
            "records_retained": figures["records_retained"],
            "retention_hours": dg.MetadataValue.float(float(figures["retention_hours"]))
            if figures["retention_hours"] is not None
            else dg.MetadataValue.text("unlimited"),
            "offsets": dg.MetadataValue.json(figures["offsets"]),
            "open_transaction_partitions": dg.MetadataValue.json(
                figures["open_transaction_partitions"]
            ),
        },
    )


def build_topic_observer(spec: TopicSpec) -> dg.SensorDefinition:
    running = Settings.from_env().sensors_running

    @dg.sensor(
        name=observer_name(spec),
        description=f"Records the offsets, partitions and retention of Kafka topic {spec.topic!r}.",
        minimum_interval_seconds=OBSERVE_INTERVAL_S,
        default_status=(
            dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED
        ),
    )
    def _observe(context: dg.SensorEvaluationContext, kafka: KafkaResource) -> dg.SensorResult:
        return dg.SensorResult(asset_events=[observation(kafka, spec)])

    return _observe
