"""Versions are ordered by the log, not by producer clocks.

A producer whose clock runs 90 s fast writes an event; a producer with a true clock corrects
it a few seconds later, in the same partition: the correction is at the later offset but
carries the earlier Kafka timestamp. The correction must win in the raw table's winners (the
declared hourly table) and in the current state. Two events of one key with the same event
time (the spec's ``order_by``) tie the same way: the later offset wins. Across partitions,
which share no order, the later Kafka timestamp wins (the written rule). Real broker, Spark,
catalog and Dagster, through the assets' runs.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import SPECS
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 7, 9, tzinfo=UTC)
FAST_MS = 90_000  # the fast producer's clock error


def _order(event_id: str, order_id: str, amount: int, status: str, minute: int) -> bytes:
    return json.dumps(
        {
            "schema_version": 2,
            "event_id": event_id,
            "order_id": order_id,
            "customer_id": "c-00001",
            "event_type": "created",
            "amount_minor": amount,
            "currency": "EUR",
            "status": status,
            "event_time": int((START + timedelta(minutes=minute)).timestamp()) * 1000,
            "channel": "web",
        }
    ).encode()


def _at(minute: float, fast: bool = False) -> int:
    return int((START + timedelta(minutes=minute)).timestamp() * 1000) + (FAST_MS if fast else 0)


# (partition, event id, order id, amount, status, event minute, Kafka minute, fast clock)
RECORDS = [
    # a: the fast producer's version, then its correction (later offset, earlier timestamp).
    (0, "a", "o-a", 1000, "open", 5, 10.0, True),
    (0, "a", "o-a", 2000, "paid", 5, 10.5, False),
    # o-b: two events with the same event time; the later offset wins the key.
    (0, "b1", "o-b", 3000, "open", 20, 30.0, True),
    (0, "b2", "o-b", 4000, "paid", 20, 30.5, False),
    # c: versions in two partitions; the later Kafka timestamp wins.
    (1, "c", "o-c", 5000, "open", 25, 40.0, False),
    (0, "c", "o-c", 6000, "paid", 25, 45.0, False),
    # Records of the next hour seal hour 0 on both partitions.
    (0, "d", "o-d", 100, "open", 65, 70.0, False),
    (1, "e", "o-e", 100, "open", 65, 70.0, False),
]


def test_the_later_offset_wins_over_a_fast_clock(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    config = stack_settings.kafka.client_config()
    admin = AdminClient(config)  # kept until the future is done: a dropped client cancels it
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    producer = Producer(config)
    for partition, event_id, order_id, amount, status, minute, kafka_minute, fast in RECORDS:
        producer.produce(
            topic,
            key=order_id.encode(),
            value=_order(event_id, order_id, amount, status, minute),
            partition=partition,
            timestamp=_at(kafka_minute, fast),
        )
        producer.flush(30)  # one at a time: the offsets follow the list's order
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    assets = build_topic_assets(spec)
    with dg.instance_for_test() as instance:
        result = materialize_range(assets, instance, START, START + timedelta(hours=1))
    assert result.success

    ns = stack_settings.catalog.namespace
    current = {
        row["order_id"]: (row["event_id"], row["amount_minor"], row["status"])
        for row in spark_session.table(f"lake.{ns}.{spec.current_table}").collect()
    }
    assert current["o-a"] == ("a", 2000, "paid"), "the fast clock's version won over its correction"
    assert current["o-b"] == ("b2", 4000, "paid"), "an event-time tie went to the earlier offset"
    assert current["o-c"] == ("c", 6000, "paid")
    hourly = spark_session.sql(
        f"SELECT sum(amount_minor) AS amount, sum(events) AS events "
        f"FROM lake.{ns}.{topic}_hourly WHERE event_hour = TIMESTAMP '{START.isoformat()}'"
    ).collect()[0]
    # Winners a (2000), b1 (3000), b2 (4000), c (6000): four events of event hour 0.
    assert (hourly["events"], hourly["amount"]) == (4, 2000 + 3000 + 4000 + 6000)
