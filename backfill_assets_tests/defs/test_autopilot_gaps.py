"""Issue 30 items 1, 4 and 5 (sensor run keys): the gap detection on a transactional topic, and
gap-sensor requests after a rollback and after a failed run.

Real broker, real Spark runs, real catalog and ledger; the sensors are evaluated tick by tick
against a real Dagster instance (as in test_sensors.py). A failed request is represented by a
failed Dagster run carrying the tags the daemon gives a sensor's run (sensor name, request,
partition range): that is all the sensor reads of a run.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import REQUEST_TAG, build_gap_sensor, gap_sensor_name
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.operations import rollback
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support import hostile
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

Request = tuple[str, list[str], str, str]


@dataclasses.dataclass
class World:
    spec: TopicSpec
    start: datetime
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    cursor: str | None = None
    expected: list[datetime] = dataclasses.field(default_factory=list)
    raw_run: str = ""

    @property
    def raw(self) -> str:
        return f"raw/{self.spec.topic}"

    @property
    def current(self) -> str:
        return f"lakehouse/{self.spec.topic}_current"

    @property
    def tables(self) -> list[str]:
        return sorted(f"lakehouse/{t.name}" for t in self.spec.tables)

    def h(self, hour: int) -> str:
        return (self.start + timedelta(hours=hour)).strftime(detect.PARTITION_FMT)


def _tick(world: World, sensor: dg.SensorDefinition | None = None) -> list[Request]:
    """Evaluate one gap-sensor tick; (kind, asset keys, first, last) per run request."""
    sensor = sensor or build_gap_sensor(world.spec)
    context = dg.build_sensor_context(
        instance=world.instance,
        cursor=world.cursor,
        resources=RESOURCES,
        definitions=dg.Definitions(assets=world.assets, sensors=[sensor], resources=RESOURCES),
    )
    data = sensor.evaluate_tick(context)
    world.cursor = data.cursor
    out = []
    for req in data.run_requests or []:
        out.append(
            (
                req.tags[REQUEST_TAG].split(":")[0],
                sorted(k.to_user_string() for k in req.asset_selection or []),
                req.tags["dagster/asset_partition_range_start"],
                req.tags["dagster/asset_partition_range_end"],
            )
        )
    return sorted(out)


def _run(world: World, keys: list[str], first: str, last: str) -> str:
    selection = [a for a in world.assets if a.key.to_user_string() in keys]
    result = materialize_range(selection, world.instance, first, last)
    assert result.success
    return result.run_id


@dg.asset(name="requested_run_that_fails")
def _fails() -> None:
    raise RuntimeError("the requested run failed")


def _failed_run(world: World, kind: str, first: str, last: str) -> None:
    """A run of the gap sensor's request ``kind`` over ``first..last`` that failed."""
    result = dg.materialize(
        [_fails],
        instance=world.instance,
        raise_on_error=False,
        tags={
            "dagster/sensor_name": gap_sensor_name(world.spec),
            "dagster/asset_partition_range_start": first,
            "dagster/asset_partition_range_end": last,
            REQUEST_TAG: f"{kind}:{first}...{last}",
        },
    )
    assert not result.success


# ------------------------------------------------------------------------------------------
# Item 1: a transactional topic (back-dated history, every hour's last offset a commit marker)
# ------------------------------------------------------------------------------------------

TXN_START = datetime(2026, 10, 5, tzinfo=UTC)


@pytest.fixture(scope="module")
def txn_world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"txn_{uuid.uuid4().hex[:8]}"
    config = hostile.HostileConfig(
        start=TXN_START,
        topic=topic,
        partitions=3,
        hours=4,
        events_per_hour=40,
        max_transaction_records=20,
        seed=30,
    )
    truth = hostile.generate(stack_settings, config)
    kafka = KafkaClient()
    deadline = time.monotonic() + 30
    while not all(lso == hw for _low, lso, hw in kafka.log_ends(topic).values()):
        assert time.monotonic() < deadline, "a transaction stayed open"
        time.sleep(0.2)
    hours = [TXN_START + timedelta(hours=i) for i in range(-1, 6)]
    sets = hostile.normalise_windows(truth, hostile.windows(truth, hours))
    world_hours = sorted(h for h, members in sets.items() if members)
    assert len(world_hours) >= 4
    assert world_hours[-1] - world_hours[0] == (len(world_hours) - 1) * timedelta(hours=1)
    # The partitions start with the data: late events' event hours before it (which a declared
    # table builds once their Kafka hours are published) are not what these tests are about.
    spec = renamed(SPECS[0], topic=topic, partition_start=world_hours[0])
    with dg.instance_for_test() as instance:
        yield World(spec, world_hours[0], instance, build_topic_assets(spec), None, world_hours)


def test_transactional_topic_every_closed_hour_is_a_gap(
    txn_world: World, stack_settings: Settings
) -> None:
    world = txn_world
    expected = world.expected
    cat = catalog.load(stack_settings.catalog)
    ns = stack_settings.catalog.namespace
    # Every hour's partitions end on commit markers: the detection must not wait for a record
    # at high_watermark - 1 (a committed reader never gets one), and must see every hour.
    began = time.monotonic()
    found = detect.find(KafkaClient(), cat, ns, world.spec)
    elapsed = time.monotonic() - began
    assert found.raw_gaps == expected
    assert elapsed < 10, f"detection took {elapsed:.1f} s"
    last = len(expected) - 1
    assert _tick(world) == [("raw", sorted([world.current, world.raw]), world.h(0), world.h(last))]

    # The first two hours published: the others are still gaps.
    _run(world, [world.raw, world.current], world.h(0), world.h(1))
    found = detect.find(KafkaClient(), cat, ns, world.spec)
    assert found.raw_gaps == expected[2:]
    assert found.current_gaps == expected[2:]
    assert _tick(world) == [("raw", sorted([world.current, world.raw]), world.h(2), world.h(last))]

    # Everything published: nothing is a raw gap, and nothing is read again to say so.
    _run(world, [world.raw, world.current], world.h(2), world.h(last))
    found = detect.find(KafkaClient(), cat, ns, world.spec)
    assert found.raw_gaps == [] and found.current_gaps == []


# ------------------------------------------------------------------------------------------
# Items 4 and 5: rollbacks and failed runs must not wedge the sensor
# ------------------------------------------------------------------------------------------

START = datetime(2026, 8, 3, tzinfo=UTC)


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"wedge_{uuid.uuid4().hex[:8]}"
    # Partitions from the first hour of data: the declared tables' requests then cover exactly
    # the hours 0-3 (late events of earlier event hours are outside the partitions).
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=4, events_per_hour=40, seed=30),
    )
    with dg.instance_for_test() as instance:
        yield World(spec, START, instance, build_topic_assets(spec))


def test_rolled_back_declared_table_is_requested_again(
    world: World, stack_settings: Settings
) -> None:
    raw_current = sorted([world.current, world.raw])
    _run(world, raw_current, world.h(0), world.h(1))
    assert _tick(world) == [("raw", raw_current, world.h(2), world.h(3))]
    world.raw_run = _run(world, raw_current, world.h(2), world.h(3))
    assert _tick(world) == [("derived", world.tables, world.h(0), world.h(3))]
    tables_run = _run(world, world.tables, world.h(0), world.h(3))
    assert _tick(world) == []

    # Undo the declared tables' run: raw main does not change, the tables' hours are gaps again.
    rollback.rollback(
        catalog.load(stack_settings.catalog), stack_settings.catalog.namespace, run_id=tables_run
    )
    assert _tick(world) == [("derived", world.tables, world.h(0), world.h(3))]
    assert _tick(world) == []


def test_raw_rollback_back_to_a_requested_snapshot_is_requested_again(
    world: World, stack_settings: Settings
) -> None:
    # Main of the raw table returns to the snapshot from which hours 2-3 were requested.
    rollback.rollback(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        run_id=world.raw_run,
    )
    assert _tick(world) == [("raw", sorted([world.current, world.raw]), world.h(2), world.h(3))]
    assert _tick(world) == []


@pytest.fixture
def fresh(stack_settings: Settings) -> Iterator[World]:
    """A topic of 6 closed hours, nothing published; no declared tables (only raw and current
    state are requested)."""
    topic = f"fails_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, tables=())
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=20, seed=31),
    )
    with dg.instance_for_test() as instance:
        yield World(spec, START, instance, build_topic_assets(spec))


def test_failed_request_is_retried_with_backoff_and_its_bad_hour_isolated(
    fresh: World,
) -> None:
    world = fresh
    rc = sorted([world.current, world.raw])
    sensor = build_gap_sensor(world.spec)  # the default backoff
    assert _tick(world, sensor) == [("raw", rc, world.h(0), world.h(5))]

    # The run fails: nothing changed in the tables, yet the request is retried at once (a new
    # request: its halves, so that a bad hour ends up alone).
    _failed_run(world, "raw", world.h(0), world.h(5))
    assert _tick(world, sensor) == [
        ("raw", rc, world.h(0), world.h(2)),
        ("raw", rc, world.h(3), world.h(5)),
    ]
    assert _tick(world, sensor) == []
    # Hour 1 fails every time; the half without it succeeds (published, not a gap any more).
    _failed_run(world, "raw", world.h(0), world.h(2))
    _run(world, rc, world.h(3), world.h(5))
    assert _tick(world, sensor) == [
        ("raw", rc, world.h(0), world.h(1)),
        ("raw", rc, world.h(2), world.h(2)),
    ]
    _failed_run(world, "raw", world.h(0), world.h(1))
    _run(world, rc, world.h(2), world.h(2))
    assert _tick(world, sensor) == [
        ("raw", rc, world.h(0), world.h(0)),
        ("raw", rc, world.h(1), world.h(1)),
    ]
    _failed_run(world, "raw", world.h(1), world.h(1))
    _run(world, rc, world.h(0), world.h(0))

    # Hour 1 alone is left: the same request again, so it waits for its backoff, and the skip
    # reason says so; once the backoff has passed it is retried, alone, after every failure.
    later = build_gap_sensor(world.spec, retry_backoff=timedelta(hours=1))
    now = build_gap_sensor(world.spec, retry_backoff=timedelta(0))
    context = dg.build_sensor_context(
        instance=world.instance,
        cursor=world.cursor,
        resources=RESOURCES,
        definitions=dg.Definitions(assets=world.assets, sensors=[later], resources=RESOURCES),
    )
    data = later.evaluate_tick(context)
    assert not data.run_requests
    assert data.skip_message is not None
    assert f"raw:{world.h(1)}...{world.h(1)} failed 1 time(s)" in data.skip_message
    assert _tick(world, now) == [("raw", rc, world.h(1), world.h(1))]
    _failed_run(world, "raw", world.h(1), world.h(1))
    assert _tick(world, now) == [("raw", rc, world.h(1), world.h(1))]
