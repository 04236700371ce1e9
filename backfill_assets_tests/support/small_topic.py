"""A small JSON orders topic for tests: 60 events of one hour with amounts 100..6000, a cut
record (quarantined as invalid JSON) and a record of the next hour that seals the first, in
one partition; and the shipped spec with ``amount_minor``'s max tightened, as a team does when
a contract changes (records above it are quarantined)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

START = datetime(2026, 7, 12, tzinfo=UTC)
EVENTS = 60  # amounts 100, 200, ..., 6000


def order(i: int) -> bytes:
    return json.dumps(
        {
            "schema_version": 2,
            "event_id": f"e{i}",
            "order_id": f"o{i}",
            "customer_id": "c-00001",
            "event_type": "created",
            "amount_minor": 100 * (i + 1),
            "currency": "EUR",
            "status": "open",
            "event_time": int((START + timedelta(minutes=i % 60)).timestamp()) * 1000,
            "channel": "web",
        }
    ).encode()


def produce(settings: Settings, topic: str) -> None:
    config = settings.kafka.client_config()
    admin = AdminClient(config)  # kept until the future is done: a dropped client cancels it
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer(config)
    stamp = int(START.timestamp() * 1000)
    for i in range(EVENTS):
        producer.produce(topic, key=f"o{i}".encode(), value=order(i), timestamp=stamp + i * 1000)
    producer.produce(topic, key=b"o-bad", value=b'{"event_id": "cut', timestamp=stamp + 61_000)
    # A record of the next hour seals hour 0.
    producer.produce(topic, key=b"o-next", value=order(0), timestamp=stamp + 3_700_000)
    assert producer.flush(30) == 0


def with_max(spec: TopicSpec, highest: int) -> TopicSpec:
    columns = [
        c.model_copy(update={"max": highest}) if c.name == "amount_minor" else c
        for c in spec.columns
    ]
    return spec.model_copy(update={"columns": tuple(columns)})
