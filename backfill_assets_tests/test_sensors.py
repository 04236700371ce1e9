"""The gap and late-data sensors on real gaps: hours never materialized, a rolled-back publish
and late events produced into published hours. Each tick is evaluated against a real Dagster
instance; the next tick must request nothing new."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from confluent_kafka import Producer

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import build_gap_sensor, build_late_data_sensor
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate, partition_for
from backfill_assets.lake import rollback
from backfill_assets.lake.declared import renamed
from backfill_assets.lake.spec import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 7, 1, tzinfo=UTC)
HOURS = 8


@dataclasses.dataclass
class World:
    spec: TopicSpec
    truth: GroundTruth
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    gap: dg.SensorDefinition
    late: dg.SensorDefinition
    cursors: dict[str, str | None]


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=HOURS, events_per_hour=80, seed=21),
    )
    with dg.instance_for_test() as instance:
        yield World(
            spec,
            truth,
            instance,
            build_topic_assets(spec),
            build_gap_sensor(spec),
            build_late_data_sensor(spec),
            {"gap": None, "late": None},
        )


def _tick(world: World, which: str) -> list[tuple[str, list[str], str, str]]:
    """Evaluate one tick; return (kind, asset keys, first, last) per run request."""
    sensor = world.gap if which == "gap" else world.late
    context = dg.build_sensor_context(
        instance=world.instance,
        cursor=world.cursors[which],
        resources=RESOURCES,
        definitions=dg.Definitions(
            assets=world.assets, sensors=[world.gap, world.late], resources=RESOURCES
        ),
    )
    data = sensor.evaluate_tick(context)
    world.cursors[which] = data.cursor
    out = []
    for req in data.run_requests or []:
        # Requests are real runs for the daemon: record them so "in flight" is real too.
        kind = req.tags["backfill_assets/request"].split(":")[0]
        keys = sorted(k.to_user_string() for k in req.asset_selection or [])
        out.append(
            (
                kind,
                keys,
                req.tags["dagster/asset_partition_range_start"],
                req.tags["dagster/asset_partition_range_end"],
            )
        )
    return sorted(out)


def _run(world: World, keys: list[str], first: str, last: str) -> str:
    selection = [a for a in world.assets if a.key.to_user_string() in keys]
    result = dg.materialize(
        selection,
        resources=RESOURCES,
        instance=world.instance,
        tags={
            "dagster/asset_partition_range_start": first,
            "dagster/asset_partition_range_end": last,
        },
    )
    return result.run_id


def _h(hour: int) -> str:
    return (START + timedelta(hours=hour)).strftime("%Y-%m-%d-%H:%M")


def test_gaps_rollbacks_and_late_data(
    world: World, stack_settings: Settings, spark_session: SparkSession
) -> None:
    raw = f"raw/{world.spec.topic}"
    current = f"lakehouse/{world.spec.topic}_current"
    # The declared tables (the shipped spec's orders_hourly and orders_large_paid, renamed):
    # both read the topic's events, so they are due for the same hours and requested together.
    tables = sorted(f"lakehouse/{t.name}" for t in world.spec.tables)
    assert len(tables) == 2

    # 1. Nothing materialized: all eight Kafka hours are one gap for raw + current.
    assert _tick(world, "gap") == [("raw", sorted([current, raw]), _h(0), _h(7))]
    assert _tick(world, "gap") == [], "the next tick requests nothing new"

    # 2. Hours 0-3 published: the rest is the gap; event hour 0 (reads Kafka hours 0-3) is due.
    first_run = _run(world, [raw, current], _h(0), _h(3))
    assert _tick(world, "gap") == [
        ("derived", tables, _h(0), _h(0)),
        ("raw", sorted([current, raw]), _h(4), _h(7)),
    ]
    assert _tick(world, "gap") == []

    # 3. A rolled-back publish is a gap again.
    rollback.rollback(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        run_id=first_run,
    )
    assert _tick(world, "gap") == [("raw", sorted([current, raw]), _h(0), _h(7))]
    assert _tick(world, "gap") == []

    # 4. Everything published: every event hour is due. Hours 5-7 too: the Kafka hours they
    # also read (up to 10) are closed and hold no records.
    _run(world, [raw, current], _h(0), _h(7))
    assert _tick(world, "gap") == [("derived", tables, _h(0), _h(7))]
    _run(world, tables, _h(0), _h(7))
    assert _tick(world, "gap") == []
    assert _tick(world, "late") == []

    # 5. Late events: hour 9 of Kafka time brings three events of event hour 1 (8 h late,
    # beyond the 3 h allowed lateness). The gap sensor asks for Kafka hour 9; once it is
    # published, the late-data sensor asks for event hour 1 and nothing else.
    _produce_late(world, stack_settings, kafka_hour=9, event_hour=1, count=3)
    assert _tick(world, "gap") == [("raw", sorted([current, raw]), _h(9), _h(9))]
    _run(world, [raw, current], _h(9), _h(9))
    assert _tick(world, "late") == [("late", tables, _h(1), _h(1))]
    assert _tick(world, "late") == []
    _run(world, tables, _h(1), _h(1))
    assert _tick(world, "late") == []

    # Event hours 6, 7 and 9 also read Kafka hour 9 (allowed lateness 3 h): they are due now
    # (hour 8 holds no records and is never due).
    assert _tick(world, "gap") == [
        ("derived", tables, _h(6), _h(7)),
        ("derived", tables, _h(9), _h(9)),
    ]
    _run(world, tables, _h(6), _h(7))
    _run(world, tables, _h(9), _h(9))
    assert _tick(world, "gap") == []
    assert _tick(world, "late") == []

    # 6. Table maintenance: coverage comes from the ledger, so expiring every snapshot but the
    # newest of each table leaves nothing for the sensors to request.
    _expire_snapshots(world, stack_settings, spark_session)
    assert _tick(world, "gap") == []
    assert _tick(world, "late") == []


def _expire_snapshots(world: World, stack_settings: Settings, spark_session: SparkSession) -> None:
    from backfill_assets.lake import ledger

    ns = stack_settings.catalog.namespace
    raw_table = f"lake.{ns}.{world.spec.raw_table}"
    oldest = ledger.publishes(catalog.load(stack_settings.catalog), ns, raw_table)[0]
    cutoff = (datetime.now(UTC) + timedelta(seconds=1)).strftime("%Y-%m-%d %H:%M:%S")
    for table in (
        world.spec.raw_table,
        f"{world.spec.topic}_current",
        *(t.name for t in world.spec.tables),
    ):
        before = spark_session.sql(f"SELECT snapshot_id FROM lake.{ns}.{table}.snapshots").count()
        spark_session.sql(
            f"CALL lake.system.expire_snapshots(table => '{ns}.{table}', "
            f"older_than => TIMESTAMP '{cutoff}', retain_last => 1)"
        ).collect()
        after = spark_session.sql(f"SELECT snapshot_id FROM lake.{ns}.{table}.snapshots").count()
        assert after < before, table
    ids = {
        r[0] for r in spark_session.sql(f"SELECT snapshot_id FROM {raw_table}.snapshots").collect()
    }
    assert oldest.snapshot_id not in ids, "the first publish's snapshot was expired"


def _produce_late(
    world: World, settings: Settings, *, kafka_hour: int, event_hour: int, count: int
) -> None:
    producer = Producer(settings.kafka.client_config())
    kafka_ts = START + timedelta(hours=kafka_hour, minutes=10)
    for i in range(count):
        order_id = f"o-late-{i}"
        event = {
            "schema_version": 2,
            "event_id": f"late-{uuid.uuid4()}",
            "order_id": order_id,
            "customer_id": "c-00001",
            "event_type": "created",
            "amount_minor": 1000 + i,
            "currency": "EUR",
            "status": "open",
            "event_time": int((START + timedelta(hours=event_hour, minutes=5)).timestamp() * 1000),
            "channel": "web",
        }
        producer.produce(
            world.spec.topic,
            key=order_id.encode(),
            value=json.dumps(event).encode(),
            partition=partition_for(order_id, 6),
            timestamp=int(kafka_ts.timestamp() * 1000) + i,
        )
    assert producer.flush(30) == 0
