"""Readers across topics are as fresh as readers of their own topic (issue 51 item 4).

Topic B declares a table that reads topic A's events. Late records arrive on A, beyond the
table's allowed lateness; once A's raw hour is published, A's late-data sensor asks for the
table's event hour, though the table is declared under B. Real broker, Spark, catalog and
Dagster instance.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
from confluent_kafka import Producer

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import build_late_data_sensor
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.spec import declared
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

START = datetime(2026, 7, 16, tzinfo=UTC)


def _late(settings: Settings, topic: str, *, kafka_hour: int, event_hour: int) -> None:
    producer = Producer(settings.kafka.client_config())
    event = {
        "schema_version": 2,
        "event_id": f"late-{uuid.uuid4()}",
        "order_id": "o-late",
        "customer_id": "c-00001",
        "event_type": "created",
        "amount_minor": 1234,
        "currency": "EUR",
        "status": "open",
        "event_time": int((START + timedelta(hours=event_hour, minutes=5)).timestamp() * 1000),
        "channel": "web",
    }
    stamp = int((START + timedelta(hours=kafka_hour, minutes=10)).timestamp() * 1000)
    producer.produce(topic, key=b"o-late", value=json.dumps(event).encode(), timestamp=stamp)
    assert producer.flush(30) == 0


def test_late_records_on_a_topic_make_a_table_declared_elsewhere_due(
    stack_settings: Settings,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    a = renamed(SPECS[0], topic=f"a_{suffix}", partition_start=START)
    hourly = next(t for t in a.tables if t.name.endswith("_hourly"))
    b = renamed(SPECS[0], topic=f"b_{suffix}", partition_start=START).model_copy(
        update={
            "tables": (
                hourly.model_copy(update={"name": f"b_{suffix}_reads_a", "topic": f"b_{suffix}"}),
            )
        }
    )
    a, b = declared.validate([a.model_copy(update={"tables": ()}), b], Path("test"))
    table = b.tables[0]
    assert a.name in table.refs and table.topic == b.topic
    generate(stack_settings, GeneratorConfig(topic=a.topic, start=START, hours=3, partitions=1))
    assets = [*build_topic_assets(a, [a, b]), *build_topic_assets(b, [a, b])]

    def run(keys: list[str], first: datetime, last: datetime) -> None:
        selection = [x for x in assets if x.key.to_user_string() in keys]
        assert materialize_range(selection, instance, first, last).success

    raw, current = f"raw/{a.name}", f"lakehouse/{a.current_table}"
    key = f"lakehouse/{table.name}"
    sensor = build_late_data_sensor(a, [a, b])
    with dg.instance_for_test() as instance:
        run([raw, current], START, START + timedelta(hours=2))
        run([key], START, START + timedelta(hours=2))

        def tick() -> list[tuple[list[str], str]]:
            context = dg.build_sensor_context(
                instance=instance,
                resources=RESOURCES,
                definitions=dg.Definitions(assets=assets, sensors=[sensor], resources=RESOURCES),
            )
            return [
                (
                    sorted(k.to_user_string() for k in req.asset_selection or []),
                    req.tags["dagster/asset_partition_range_start"],
                )
                for req in sensor.evaluate_tick(context).run_requests or []
            ]

        assert tick() == []
        # A record of event hour 1 arrives in Kafka hour 8 (the lateness is 3 h).
        _late(stack_settings, a.topic, kafka_hour=8, event_hour=1)
        run([raw, current], START + timedelta(hours=8), START + timedelta(hours=8))
        hour = (START + timedelta(hours=1)).strftime("%Y-%m-%d-%H:%M")
        assert tick() == [([key], hour)]
