"""The partition bar tells the truth: after the gap sensor's tick, the partitions a real Dagster
instance has no materialization for are exactly the real gaps (hours holding records that are
not published) and the hours not settled yet; every hour with nothing to hold is done.

A fresh topic with records in Kafka hours 0, 1, 3, 4 and 5 (hour 2 an outage), and a
``partition_start`` three hours before the data. Raw and current state are published as the
gap sensor requests them, one run per range of hours holding records (0-1, 3-4), so no run
covers hour 2; hour 5 is left unpublished: the one real gap. The data ends 2-3 hours before
now, so the hours after it are part of the bar too.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import (
    build_topic_assets,
    current_asset_key,
    raw_asset_key,
    table_asset_key,
)
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.partitions import kafka_hours
from backfill_assets.defs.sensors import EMPTY_TAG, build_gap_sensor, empty_reports
from backfill_assets.demo.generator import TOPIC_CONFIGS
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

NOW = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
START = NOW - timedelta(hours=8)  # data in Kafka hours 0..5; hours 6 and 7 hold nothing
DATA_HOURS = (0, 1, 3, 4, 5)
PARTITIONS = 3


def _h(hour: int) -> str:
    return f"{START + timedelta(hours=hour):%Y-%m-%d-%H:%M}"


@dataclass
class World:
    spec: TopicSpec
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    sensor: dg.SensorDefinition
    cursor: str | None = None


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, partition_start=START - timedelta(hours=3))
    admin = AdminClient(stack_settings.kafka.client_config())
    admin.create_topics(
        [NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1, config=TOPIC_CONFIGS)]
    )[topic].result(timeout=30)
    producer = Producer(stack_settings.kafka.client_config())
    for hour in DATA_HOURS:
        for i in range(12):
            order_id = f"o-{hour}-{i}"
            at = START + timedelta(hours=hour, minutes=4 * i + 1)
            ms = int(at.timestamp() * 1000)
            event = {
                "schema_version": 2,
                "event_id": f"e-{hour}-{i}",
                "order_id": order_id,
                "customer_id": "c-00001",
                "event_type": "created",
                "amount_minor": 1000 + i,
                "currency": "EUR",
                "status": "open",
                "event_time": ms,
                "channel": "web",
            }
            producer.produce(
                topic,
                key=order_id.encode(),
                value=json.dumps(event).encode(),
                partition=i % PARTITIONS,
                timestamp=ms,
            )
    assert producer.flush(30) == 0
    with pytest.MonkeyPatch.context() as mp, dg.instance_for_test() as instance:
        # Hour 7 ended less than the default 300 s grace ago when the test runs early in an
        # hour; with no grace it is sealed as soon as it ends (and stays idle: nothing writes).
        mp.setenv("BACKFILL_SEAL_GRACE_S", "0")
        yield World(spec, instance, build_topic_assets(spec), build_gap_sensor(spec))


def _tick(world: World) -> tuple[list[dg.RunRequest], list[dg.AssetMaterialization]]:
    """One tick of the gap sensor; its asset events are stored as the daemon stores them."""
    context = dg.build_sensor_context(
        instance=world.instance,
        cursor=world.cursor,
        resources=RESOURCES,
        definitions=dg.Definitions(
            assets=world.assets, sensors=[world.sensor], resources=RESOURCES
        ),
    )
    data = world.sensor.evaluate_tick(context)
    world.cursor = data.cursor
    events = [e for e in data.asset_events if isinstance(e, dg.AssetMaterialization)]
    for event in events:
        world.instance.report_runless_asset_event(event)
    return list(data.run_requests or []), events


def _run(world: World, keys: list[dg.AssetKey], first: int, last: int) -> None:
    result = materialize_range(
        [a for a in world.assets if a.key in keys], world.instance, _h(first), _h(last)
    )
    assert result.success


def _missing(world: World, key: dg.AssetKey) -> list[int]:
    """What the partition bar calls Missing, as hours relative to START, up to hour 7 (the bar
    as it was when the test started, should an hour end while it runs)."""
    keys = kafka_hours(world.spec).get_partition_keys(current_time=NOW + timedelta(minutes=30))
    done = world.instance.get_materialized_partitions(key)
    return sorted(keys.index(k) - 3 for k in keys if k not in done)


# slow tier (CI runs it): ~35 s; the default tier stays under 15 minutes.
@pytest.mark.slow
def test_missing_partitions_are_exactly_the_real_gaps(world: World) -> None:
    spec = world.spec
    raw, current = raw_asset_key(spec), current_asset_key(spec)
    tables = [table_asset_key(t.name) for t in spec.tables]
    assert len(tables) == 2 and all(t.lateness_hours == 3 for t in spec.tables)

    # Before any run: the hours before the data (the oldest committed record is in hour 0)
    # and after it (no record is newer than hour 5) are done; everything else is not. All of
    # them reported at once, as `backfill-assets report-empty` does before the demo's UI
    # serves (a tick reports at most MAX_EMPTY_REPORTS); the tick then has none left.
    settings = Settings.from_env()
    every = empty_reports(
        world.instance,
        KafkaClient(settings),
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        spec,
    )
    # Up to hour 7: the bar as it was when the test started, should an hour end while it runs.
    bar = {_h(h) for h in range(-3, 8)}
    assert {e.partition for e in every if e.asset_key == raw} & bar == {
        _h(h) for h in (-3, -2, -1, 6, 7)
    }
    for event in every:
        world.instance.report_runless_asset_event(event)
    assert _missing(world, raw) == [0, 1, 2, 3, 4, 5]
    requests, first_tick = _tick(world)
    assert [(r.tags["dagster/asset_partition_range_start"]) for r in requests] == [_h(0), _h(3)]
    assert [e for e in first_tick if e.partition in {_h(h) for h in range(-3, 8)}] == []
    assert _missing(world, raw) == [0, 1, 2, 3, 4, 5]

    # The gap sensor's two ranges, except hour 5: the real gap.
    _run(world, [raw, current], 0, 1)
    _run(world, [raw, current], 3, 4)
    _, events = _tick(world)
    reported = {(e.asset_key, e.partition) for e in events}
    assert (raw, _h(2)) in reported and (current, _h(2)) in reported
    hour2 = next(e for e in events if (e.asset_key, e.partition) == (raw, _h(2)))
    assert hour2.metadata["empty"] == dg.BoolMetadataValue(True)
    assert hour2.metadata["dagster/partition_row_count"] == dg.IntMetadataValue(0)
    assert hour2.tags == {EMPTY_TAG: "true"}

    assert _missing(world, raw) == [5], "only the hour holding unpublished records"
    assert _missing(world, current) == [5]
    # Declared tables (event time, 3 h lateness): event hours -3..-1 read only settled Kafka
    # hours and no published hour holds their events: done. Hours 0, 1, 3, 4, 5 hold events
    # no run has built yet (real gaps); hour 2 reads Kafka hour 5 (the raw gap), hours 6 and 7
    # read hours not closed yet: not settled.
    for table in tables:
        assert _missing(world, table) == [0, 1, 2, 3, 4, 5, 6, 7], table

    # Nothing is reported twice.
    assert [e for e in _tick(world)[1] if e.partition in {_h(h) for h in range(-3, 8)}] == []

    # The real gap filled: raw and current are complete, and declared event hour 2, which
    # waited on it, turns done (no published hour holds an event of hour 2).
    _run(world, [raw, current], 5, 5)
    _, events = _tick(world)
    hours = {_h(h) for h in range(-3, 8)}
    assert {(e.asset_key, e.partition) for e in events if e.partition in hours} == {
        (t, _h(2)) for t in tables
    }
    assert _missing(world, raw) == []
    assert _missing(world, current) == []
    for table in tables:
        assert _missing(world, table) == [0, 1, 3, 4, 5, 6, 7], table
