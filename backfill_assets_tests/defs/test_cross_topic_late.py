"""Readers across topics are as fresh as readers of their own topic (issue 51 item 4).

Topic B declares a table that reads topic A's events (or A's current state). Late records
arrive on A, beyond the table's allowed lateness; once A's raw hour (and current state) is
published, A's late-data sensor asks for the table's hours, though the table is declared under
B. Real broker, Spark, catalog and Dagster instance.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from confluent_kafka import Producer

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import build_late_data_sensor
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.spec import declared
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TableSpec
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 7, 16, tzinfo=UTC)


def _late(
    settings: Settings, topic: str, *, kafka_hour: int, event_hour: int, status: str = "open"
) -> None:
    producer = Producer(settings.kafka.client_config())
    event = {
        "schema_version": 2,
        "event_id": f"late-{uuid.uuid4()}",
        "order_id": "o-late",
        "customer_id": "c-00001",
        "event_type": "created" if status == "open" else "updated",
        "amount_minor": 1234,
        "currency": "EUR",
        "status": status,
        "event_time": int((START + timedelta(hours=event_hour, minutes=5)).timestamp() * 1000),
        "channel": "web",
    }
    stamp = int((START + timedelta(hours=kafka_hour, minutes=10)).timestamp() * 1000)
    producer.produce(topic, key=b"o-late", value=json.dumps(event).encode(), timestamp=stamp)
    assert producer.flush(30) == 0


def _tick(
    sensor: dg.SensorDefinition, assets: list[dg.AssetsDefinition], instance: dg.DagsterInstance
) -> list[tuple[list[str], str]]:
    """The sensor's run requests on one tick: (asset keys, first partition of the range)."""
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


def _status_reader(a: str, b: str, name: str) -> TableSpec:
    """B's events with A's current status of the same order (a dimension look-up)."""
    return TableSpec.model_validate(
        {
            "name": name,
            "sql": (
                f"SELECT e.event_id, e.order_id, c.status AS a_status, e.event_time FROM {b} e"
                f" LEFT JOIN {a}_current c ON c.order_id = e.order_id AND NOT c.deleted"
                " WHERE e.event_time >= {start} AND e.event_time < {end}"
            ),
            "event_time": "event_time",
            "grain": ["event_id"],
            "lateness_hours": 3,
            "source": b,
            "columns": [
                {"name": "event_id", "type": "string", "nullable": False},
                {"name": "order_id", "type": "string", "nullable": False},
                {"name": "a_status", "type": "string", "nullable": True},
                {"name": "event_time", "type": "timestamp", "nullable": False},
            ],
        },
        context={"topic": b},
    )


# slow tier (CI runs it): ~36 s; the default tier stays under 15 minutes.
@pytest.mark.slow
def test_late_records_on_a_topic_make_tables_declared_elsewhere_due(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    """Topic B declares two tables: ``reads_a`` (A's events per hour) and ``a_status`` (B's
    events with A's current status of the same order). A record of event hour 1 arrives on A
    in Kafka hour 8, beyond the 3 h lateness, for an order B's hour 1 holds. A's late sensor
    asks for ``reads_a`` hour 1 and for ``a_status`` from hour 1 on (hours 1 and 2: the
    state changed at hour 1, outside their mapping of A's Kafka hours), not hour 0; the run
    brings the new status in, and the next tick asks nothing."""
    suffix = uuid.uuid4().hex[:8]
    a = renamed(SPECS[0], topic=f"a_{suffix}", partition_start=START)
    hourly = next(t for t in a.tables if t.name.endswith("_hourly"))
    b = renamed(SPECS[0], topic=f"b_{suffix}", partition_start=START)
    reads_a = hourly.model_copy(update={"name": f"b_{suffix}_reads_a", "topic": b.topic})
    status_reader = _status_reader(a.name, b.name, f"b_{suffix}_a_status")
    a, b = declared.validate(
        [
            a.model_copy(update={"tables": ()}),
            b.model_copy(update={"tables": (reads_a, status_reader)}),
        ],
        Path("test"),
    )
    assert a.name in b.tables[0].refs and a.current_table in b.tables[1].refs
    for spec in (a, b):
        generate(
            stack_settings,
            GeneratorConfig(topic=spec.topic, start=START, hours=3, partitions=1),
        )
    _late(stack_settings, b.topic, kafka_hour=1, event_hour=1)  # B's order o-late, on time
    assets = [*build_topic_assets(a, [a, b]), *build_topic_assets(b, [a, b])]
    keys = [f"lakehouse/{reads_a.name}", f"lakehouse/{status_reader.name}"]
    a_pair = [f"raw/{a.name}", f"lakehouse/{a.current_table}"]
    table = CatalogClient().spark_name(status_reader.name)

    def run(selected: list[str], first: datetime, last: datetime) -> None:
        selection = [x for x in assets if x.key.to_user_string() in selected]
        assert materialize_range(selection, instance, first, last).success

    def status() -> str | None:
        spark_session.sql(f"REFRESH TABLE {table}")
        rows = spark_session.table(table).where("order_id = 'o-late'").collect()
        assert len(rows) == 1, rows
        value = rows[0]["a_status"]
        return None if value is None else str(value)

    sensor = build_late_data_sensor(a, [a, b])
    with dg.instance_for_test() as instance:
        last = START + timedelta(hours=2)
        run(a_pair, START, last)
        run([f"raw/{b.name}", *keys], START, last)
        assert status() is None  # A has no such order yet
        assert _tick(sensor, assets, instance) == []
        _late(stack_settings, a.topic, kafka_hour=8, event_hour=1, status="paid")
        eight = START + timedelta(hours=8)
        run(a_pair, eight, eight)
        assert _tick(sensor, assets, instance) == [(sorted(keys), "2026-07-16-01:00")]
        run(keys, START + timedelta(hours=1), last)
        assert status() == "paid"
        assert _tick(sensor, assets, instance) == []
