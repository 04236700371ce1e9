"""The sensors alone keep declared tables equal to Kafka's truth (issue 30, items 2, 3 and 5):

* an outage hour (no records in Kafka hour 01) whose events arrive late in hour 02 still gets
  its event hour built: event hours come from the data, not from the Kafka hours that hold
  records;
* a correction that moves an event to another hour invalidates the hour of the version it
  supersedes as well as its own;
* a table with ``lookback_hours > 0`` is re-run for every hour that looks back on a changed
  one;
* freshness is judged by lineage: a declared run that read raw main before a raw publish is
  stale, however late its own publish was recorded.

Real broker, Spark and catalog; each tick is evaluated against a real Dagster instance and
every request it makes is run, until the sensors request nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
import yaml
from confluent_kafka import Producer

# NewTopic and AdminClient are public but only implicitly re-exported.
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES
from backfill_assets.defs.sensors import build_gap_sensor, build_late_data_sensor
from backfill_assets.demo.generator import TOPIC_CONFIGS, partition_for
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.write import derived, wap
from backfill_assets.spec.loader import load_specs, spec_path
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 8, 3, tzinfo=UTC)
PARTITIONS = 2
LOOKBACK = 2
ROUNDS = 6  # sensor rounds allowed before the tables must have settled

HOURLY_SQL = """
SELECT date_trunc('HOUR', event_time) AS event_hour, count(*) AS events,
       CAST(sum(amount_minor) AS BIGINT) AS amount_minor
FROM {topic}
WHERE event_time >= {{start}} AND event_time < {{end}}
GROUP BY date_trunc('HOUR', event_time)
"""
# Per event hour that holds events: the events of that hour and the LOOKBACK hours before it.
ROLLING_SQL = """
SELECT h.event_hour, count(*) AS events_3h
FROM (
  SELECT DISTINCT date_trunc('HOUR', event_time) AS event_hour
  FROM {topic}
  WHERE event_time >= {{start}} AND event_time < {{end}}
) AS h
JOIN {topic} AS o
  ON o.event_time >= h.event_hour - INTERVAL {lookback} HOURS
  AND o.event_time < h.event_hour + INTERVAL 1 HOUR
GROUP BY h.event_hour
"""


@dataclasses.dataclass(frozen=True)
class Event:
    event_id: str
    order_id: str
    event_hour: int  # hours after START
    kafka_hour: int
    amount: int = 1000


@dataclasses.dataclass
class World:
    spec: TopicSpec
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    gap: dg.SensorDefinition
    late: dg.SensorDefinition
    cursors: dict[str, str | None]
    settings: Settings
    produced: list[tuple[Event, int]] = dataclasses.field(default_factory=list)  # (event, ts)

    @property
    def raw(self) -> str:
        return f"raw/{self.spec.topic}"

    @property
    def current(self) -> str:
        return f"lakehouse/{self.spec.topic}_current"

    def table(self, suffix: str) -> str:
        return f"{self.spec.topic}_{suffix}"


def _spec(directory: Path, topic: str) -> TopicSpec:
    """The shipped orders topic under a new name, with two declared tables: ``<topic>_hourly``
    (events per event hour) and ``<topic>_rolling`` (lookback LOOKBACK h)."""
    doc = yaml.safe_load(spec_path().read_text())
    (entry,) = [t for t in doc["topics"] if t["topic"] == "orders"]
    entry = {**entry, "topic": topic, "partition_start": START.isoformat()}
    entry["tables"] = [
        {
            "name": f"{topic}_hourly",
            "sql": HOURLY_SQL.format(topic=topic),
            "event_time": "event_hour",
            "grain": ["event_hour"],
            "columns": [
                {"name": "event_hour", "type": "timestamp", "nullable": False},
                {"name": "events", "type": "bigint", "nullable": False},
                {"name": "amount_minor", "type": "bigint", "nullable": False},
            ],
            "measures": [{"name": "events", "table": "sum(events)", "source": "count(*)"}],
        },
        {
            "name": f"{topic}_rolling",
            "sql": ROLLING_SQL.format(topic=topic, lookback=LOOKBACK),
            "event_time": "event_hour",
            "grain": ["event_hour"],
            "lookback_hours": LOOKBACK,
            "columns": [
                {"name": "event_hour", "type": "timestamp", "nullable": False},
                {"name": "events_3h", "type": "bigint", "nullable": False},
            ],
        },
    ]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "topics.yaml"
    path.write_text(yaml.safe_dump({"topics": [entry]}))
    (spec,) = load_specs(path)
    return spec


@pytest.fixture
def make_world(
    stack_settings: Settings, spark_session: SparkSession, tmp_path: Path
) -> Iterator[Callable[[], World]]:
    with dg.instance_for_test() as instance:

        def make() -> World:
            topic = f"hours_{uuid.uuid4().hex[:8]}"
            admin = AdminClient(stack_settings.kafka.client_config())
            new = NewTopic(
                topic, num_partitions=PARTITIONS, replication_factor=1, config=TOPIC_CONFIGS
            )
            admin.create_topics([new])[topic].result(timeout=30)
            spec = _spec(tmp_path / topic, topic)
            return World(
                spec,
                instance,
                build_topic_assets(spec, [spec]),
                build_gap_sensor(spec, [spec]),
                build_late_data_sensor(spec, [spec]),
                {"gap": None, "late": None},
                stack_settings,
            )

        yield make


def _produce(world: World, events: list[Event]) -> None:
    """One record per event, in Kafka-time order (per partition, timestamps never decrease)."""
    producer = Producer(world.settings.kafka.client_config())
    base = len(world.produced)
    for i, ev in enumerate(sorted(events, key=lambda e: e.kafka_hour)):
        ts = START + timedelta(hours=ev.kafka_hour, minutes=10, seconds=base + i)
        payload = {
            "schema_version": 2,
            "event_id": ev.event_id,
            "order_id": ev.order_id,
            "customer_id": "c-00001",
            "event_type": "created",
            "amount_minor": ev.amount,
            "currency": "EUR",
            "status": "open",
            "event_time": int((START + timedelta(hours=ev.event_hour, minutes=5)).timestamp())
            * 1000,
            "channel": "web",
        }
        producer.produce(
            world.spec.topic,
            key=ev.order_id.encode(),
            value=json.dumps(payload).encode(),
            partition=partition_for(ev.order_id, PARTITIONS),
            timestamp=int(ts.timestamp() * 1000),
        )
        world.produced.append((ev, int(ts.timestamp() * 1000)))
    assert producer.flush(30) == 0


def _events(prefix: str, event_hour: int, kafka_hour: int, count: int) -> list[Event]:
    return [
        Event(f"{prefix}-{event_hour}-{kafka_hour}-{i}", f"o-{prefix}-{i}", event_hour, kafka_hour)
        for i in range(count)
    ]


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
        out.append(
            (
                req.tags["backfill_assets/request"].split(":")[0],
                sorted(k.to_user_string() for k in req.asset_selection or []),
                req.tags["dagster/asset_partition_range_start"],
                req.tags["dagster/asset_partition_range_end"],
            )
        )
    return sorted(out)


def _run(world: World, keys: list[str], first: str, last: str) -> None:
    selection = [a for a in world.assets if a.key.to_user_string() in keys]
    result = materialize_range(selection, world.instance, first, last)
    assert result.success


def _settle(world: World) -> list[tuple[str, list[str], str, str]]:
    """Tick both sensors and run what they request until they request nothing; return every
    request made."""
    made: list[tuple[str, list[str], str, str]] = []
    for _ in range(ROUNDS):
        requests = _tick(world, "gap") + _tick(world, "late")
        if not requests:
            return made
        made += requests
        for _kind, keys, first, last in requests:
            _run(world, keys, first, last)
    raise AssertionError(f"the sensors did not settle in {ROUNDS} rounds: {made}")


def _h(hour: int) -> str:
    return (START + timedelta(hours=hour)).strftime("%Y-%m-%d-%H:%M")


def _winners(world: World) -> list[Event]:
    """Per event id, the version produced last (the highest Kafka timestamp wins)."""
    best: dict[str, tuple[Event, int]] = {}
    for ev, ts in world.produced:
        if ev.event_id not in best or ts > best[ev.event_id][1]:
            best[ev.event_id] = (ev, ts)
    return [ev for ev, _ in best.values()]


def _truth_hourly(world: World) -> dict[datetime, int]:
    counts = Counter(START + timedelta(hours=ev.event_hour) for ev in _winners(world))
    return dict(counts)


def _truth_rolling(world: World) -> dict[datetime, int]:
    hourly = _truth_hourly(world)
    return {
        hour: sum(hourly.get(hour - timedelta(hours=i), 0) for i in range(LOOKBACK + 1))
        for hour in hourly
    }


def _table(world: World, suffix: str, column: str) -> dict[datetime, int]:
    cat = catalog.load(world.settings.catalog)
    rows = (
        cat.load_table(f"{world.settings.catalog.namespace}.{world.table(suffix)}")
        .scan()
        .to_arrow()
        .to_pylist()
    )
    return {r["event_hour"].astimezone(UTC): int(r[column]) for r in rows}


def _assert_truth(world: World) -> None:
    assert _table(world, "hourly", "events") == _truth_hourly(world)
    assert _table(world, "rolling", "events_3h") == _truth_rolling(world)


def test_outage_hour_gets_its_late_events(make_world: Callable[[], World]) -> None:
    """Item 2: Kafka hour 01 holds nothing (an outage); its events arrive in hour 02, inside
    the allowed lateness. Event hour 01 is built by the sensors alone."""
    world = make_world()
    _produce(
        world,
        [*_events("a", 0, 0, 4), *_events("b", 1, 2, 3), *_events("c", 2, 2, 2)],
    )
    _settle(world)
    assert _table(world, "hourly", "events").get(START + timedelta(hours=1)) == 3
    _assert_truth(world)


# Long (about 35 s): in the slow tier, which CI runs, to keep the default tier under 15 min.
@pytest.mark.slow
def test_correction_moving_an_event_invalidates_both_hours(
    make_world: Callable[[], World],
) -> None:
    """Item 3: a correction in Kafka hour 06 moves one event from event hour 00 to 05. Hour 00
    no longer counts it (the late-data sensor asks for it) and hour 05 does."""
    world = make_world()
    base = _events("a", 0, 0, 4)
    _produce(world, base)
    _settle(world)
    assert _table(world, "hourly", "events") == {START: 4}
    moved = dataclasses.replace(base[0], event_hour=5, kafka_hour=6, amount=2000)
    _produce(world, [*_events("b", 5, 5, 2), moved])
    made = _settle(world)
    assert any(k == "late" and f <= _h(0) <= la for k, _, f, la in made), made
    assert _table(world, "hourly", "events") == {START: 3, START + timedelta(hours=5): 3}
    _assert_truth(world)


# slow tier (CI runs it): ~65 s, to keep the default tier near 20 minutes.
@pytest.mark.slow
def test_lookback_hours_rerun_after_late_events(make_world: Callable[[], World]) -> None:
    """Item 5a: an event of hour 00 arrives in Kafka hour 06 (beyond the 3 h lateness). The
    rolling table (lookback 2 h) is re-run for hours 00, 01 and 02, not only 00."""
    world = make_world()
    _produce(world, [ev for h in range(3) for ev in _events(f"a{h}", h, h, 2)])
    _settle(world)
    _assert_truth(world)
    _produce(world, _events("late", 0, 6, 1))
    made = _settle(world)
    rolling = f"lakehouse/{world.table('rolling')}"
    late = {(f, la) for k, keys, f, la in made if k == "late" and rolling in keys}
    assert any(f <= _h(2) <= la for f, la in late), made
    _assert_truth(world)


def test_stale_by_lineage_not_by_clock(
    make_world: Callable[[], World], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5b: a declared run reads raw main, then a raw publish of Kafka hour 01 (late events
    of event hour 00, inside the lateness) lands before the declared run publishes. The
    declared hour did not read that publish: the gap sensor asks for it again, although its
    own publish was recorded later."""
    world = make_world()
    _produce(world, _events("a", 0, 0, 3))
    _settle(world)
    _assert_truth(world)
    _produce(world, _events("late", 0, 1, 2))
    hourly = f"lakehouse/{world.table('hourly')}"
    requested = _tick(world, "gap")
    assert ("raw", sorted([world.current, world.raw]), _h(1), _h(1)) in requested, requested

    # While an (operator's) re-run of event hour 00 is between its read and its publish, the
    # raw run the sensor requested publishes Kafka hour 01.
    original = wap.open_branch
    fired: list[bool] = []

    def raw_publishes_meanwhile(spark: Any, table: str, run_id: str, attempt: int = 0) -> Any:
        if table.endswith(world.table("hourly")) and not fired:
            fired.append(True)
            worker = threading.Thread(
                target=_run, args=(world, [world.raw, world.current], _h(1), _h(1))
            )
            worker.start()
            worker.join()
        return original(spark, table, run_id, attempt)

    monkeypatch.setattr(derived, "open_branch", raw_publishes_meanwhile)
    _run(world, [hourly], _h(0), _h(0))
    monkeypatch.setattr(derived, "open_branch", original)
    assert fired
    assert _table(world, "hourly", "events") == {START: 3}, "the run read raw before the publish"
    # What `gaps` and the gap sensor see: event hour 00 did not read Kafka hour 01's publish,
    # although its own publish was recorded after it.
    cat = catalog.load(world.settings.catalog)
    ns = world.settings.catalog.namespace
    found = detect.find(KafkaClient(), cat, ns, world.spec, specs=[world.spec])
    assert START in found.tables_due[world.table("hourly")], found.tables_due
    made = _settle(world)
    assert any(hourly in keys and f <= _h(0) <= la for _, keys, f, la in made), made
    _assert_truth(world)
