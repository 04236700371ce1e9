"""The Kafka resource maps times to offsets without touching any consumer group."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from confluent_kafka.admin import AdminClient

from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.errors import KafkaClientError
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings

START = datetime(2026, 5, 1, tzinfo=UTC)


def test_offsets_for_times_and_watermarks(stack_settings: Settings) -> None:
    topic = f"res_{uuid.uuid4().hex[:8]}"
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=3, events_per_hour=60, partitions=3),
    )
    kafka = KafkaClient()
    groups_before = {
        g.group_id
        for g in AdminClient(stack_settings.kafka.client_config())
        .list_consumer_groups()
        .result()
        .valid
    }

    hour1 = int(datetime(2026, 5, 1, 1, tzinfo=UTC).timestamp() * 1000)
    assert kafka.offsets_for_times(topic, hour1) == {
        p: truth.offset_for_time(p, hour1) for p in range(3)
    }
    # After the last record Kafka answers -1; the resource returns the high watermark instead,
    # so [offset(start), offset(end)) is always a valid range.
    after = int(datetime(2026, 5, 2, tzinfo=UTC).timestamp() * 1000)
    assert kafka.offsets_for_times(topic, after) == truth.end_offsets()
    assert kafka.watermarks(topic) == {p: (0, e) for p, e in truth.end_offsets().items()}

    groups_after = {
        g.group_id
        for g in AdminClient(stack_settings.kafka.client_config())
        .list_consumer_groups()
        .result()
        .valid
    }
    assert groups_after == groups_before, "look-ups must not create consumer groups"


def test_unknown_topic_is_named(stack_settings: Settings) -> None:
    with pytest.raises(KafkaClientError, match="no_such_topic"):
        KafkaClient().partitions("no_such_topic")
