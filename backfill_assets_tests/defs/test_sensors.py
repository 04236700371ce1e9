"""The gap and late-data sensors on real gaps: hours never materialized, a rolled-back publish
and late events produced into published hours. Each tick is evaluated against a real Dagster
instance; the next tick must request nothing new."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import dagster as dg
import pytest
from confluent_kafka import Producer

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import build_gap_sensor, build_late_data_sensor
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate, partition_for
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.operations import rollback
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
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
    result = materialize_range(selection, world.instance, first, last)
    return result.run_id


def _first_event_hour(world: World) -> int:
    """The first event hour of the generated events, in hours after START (late events of
    Kafka hour 0 can be of earlier hours)."""
    first = min(datetime.fromisoformat(h) for h in world.truth.event_hours)
    assert first < START, "the generator makes events that arrive late in Kafka hour 0"
    return int((first - START) / timedelta(hours=1))


def _h(hour: int) -> str:
    return (START + timedelta(hours=hour)).strftime("%Y-%m-%d-%H:%M")


# Long (2-4 min): in the slow tier, which CI runs, to keep the default tier near 20 min.
@pytest.mark.slow
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

    # 2. Hours 0-3 published: the rest is the gap; event hour 0 (reads Kafka hours 0-3) is due,
    # and so are the event hours before it whose events arrived late in Kafka hours 0-3 (event
    # hours come from the data, not from the Kafka hours that hold records).
    early = _h(_first_event_hour(world))
    first_run = _run(world, [raw, current], _h(0), _h(3))
    assert _tick(world, "gap") == [
        ("derived", tables, early, _h(0)),
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
    assert _tick(world, "gap") == [("derived", tables, early, _h(7))]
    _run(world, tables, early, _h(7))
    assert _tick(world, "gap") == []
    assert _tick(world, "late") == []

    # 5. Late events: hour 9 of Kafka time brings three events of event hour 1 (8 h late,
    # beyond the 3 h allowed lateness). The gap sensor asks for Kafka hour 9; once it is
    # published, the late-data sensor asks for event hour 1 and nothing else.
    _produce_late(world, stack_settings, kafka_hour=9, event_hour=1, count=3)
    assert _tick(world, "gap") == [("raw", sorted([current, raw]), _h(9), _h(9))]
    late_run = _run(world, [raw, current], _h(9), _h(9))
    # The publish recorded what the late-data sensor needs in the ledger: the event hours of
    # Kafka hour 9's rows. The sensor decides from that alone: with the raw table's data files
    # out of reach (any row read would fail), it still asks for event hour 1.
    cat = catalog.load(stack_settings.catalog)
    ns = stack_settings.catalog.namespace
    raw_name = f"lake.{ns}.{world.spec.raw_table}"
    entry = ledger.coverage(cat, ns, raw_name)[START + timedelta(hours=9)]
    assert entry.run_id == late_run
    assert entry.event_hours == {START + timedelta(hours=1): 3}
    with _rows_unreadable(cat, f"{ns}.{world.spec.raw_table}"):
        assert _tick(world, "late") == [("late", tables, _h(1), _h(1))]
        assert _tick(world, "late") == []
    # A publish whose ledger rows do not hold event hours (here: its ledger rows are lost and
    # recovered from main's history, as after a crash between the fast-forward and the ledger
    # append) is found from its own rows instead, and only those are read.
    expected = {
        t.name: {START + timedelta(hours=1): f"late records ingested by run {late_run}"}
        for t in world.spec.tables
    }
    assert detect.late_event_hours(cat, ns, world.spec) == expected
    cat.load_table(f"{ns}.{ledger.LEDGER_TABLE}").delete(
        f"table_name == '{raw_name}' AND run_id == '{late_run}'"
    )
    assert ledger.sync_from_history(cat, ns, raw_name) == [late_run]
    assert ledger.coverage(cat, ns, raw_name)[START + timedelta(hours=9)].event_hours is None
    assert detect.late_event_hours(cat, ns, world.spec) == expected
    with _rows_unreadable(cat, f"{ns}.{world.spec.raw_table}"), pytest.raises(OSError):
        detect.late_event_hours(cat, ns, world.spec)  # the fallback does read that run's rows
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


@contextlib.contextmanager
def _rows_unreadable(cat: Catalog, ident: str) -> Iterator[None]:
    """The table's data files moved out of reach (metadata stays): reading a row fails."""
    table = cat.load_table(ident)
    files = [task.file.file_path for task in table.scan().plan_files()]
    assert files, f"{ident} has data files"
    data = Path(urlparse(table.location()).path) / "data"
    assert all(urlparse(f).path.startswith(f"{data}/") for f in files), files
    hidden = data.with_name("data.unreachable")
    data.rename(hidden)
    try:
        yield
    finally:
        hidden.rename(data)


def _expire_snapshots(world: World, stack_settings: Settings, spark_session: SparkSession) -> None:
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


def test_old_ledger_gains_event_hours_in_place(iceberg_catalog: Catalog) -> None:
    """A ledger created before it kept event hours: the next append adds the column with one
    schema update; every old row and data file stays, and old rows read it as unknown."""
    import pyarrow as pa

    ns = f"ledger_{uuid.uuid4().hex[:8]}"
    iceberg_catalog.create_namespace(ns)
    raw = f"lake.{ns}.raw_orders"
    newer = (
        "event_hours",
        "rollback_id",
        "source_table",
        "superseded_hours",
        "reads",
        "topic_id",
        "cluster_id",
        "reason",
    )
    old_schema = pa.schema([f for f in ledger.SCHEMA if f.name not in newer])
    table = iceberg_catalog.create_table(f"{ns}.{ledger.LEDGER_TABLE}", schema=old_schema)
    at = datetime(2026, 7, 2, tzinfo=UTC)

    def publish(run: str, hour: int, seq: int) -> dict[str, object]:
        return {
            "event": "publish",
            "table_name": raw,
            "run_id": run,
            "hour": START + timedelta(hours=hour),
            "offsets": json.dumps({"0": [hour * 10, hour * 10 + 5]}),
            "records": 5,
            "snapshot_id": seq,
            "sequence_number": seq,
            "undone_runs": None,
            "recorded_at": at + timedelta(minutes=seq),
        }

    old_rows = [
        *(publish("old-run", h, 1) for h in range(3)),
        publish("undone-run", 3, 2),
        {
            **publish("x", 0, 3),
            "event": "rollback",
            "run_id": None,
            "hour": None,
            "offsets": None,
            "records": None,
            "sequence_number": None,
            "undone_runs": json.dumps(["undone-run"]),
        },
    ]
    table.append(pa.Table.from_pylist(old_rows, schema=old_schema))
    old_files = {task.file.file_path for task in table.scan().plan_files()}
    # Read as it is (not evolved yet): the value is unknown.
    assert [(e.run_id, e.event_hours) for e in ledger.publishes(iceberg_catalog, ns, raw)] == [
        ("old-run", None)
    ] * 3

    ledger.record_publish(
        iceberg_catalog,
        ns,
        raw,
        run_id="new-run",
        snapshot_id=4,
        sequence_number=4,
        hours=[START + timedelta(hours=3), START + timedelta(hours=4)],
        event_hours={START + timedelta(hours=4): {START: 2, START + timedelta(hours=4): 7}},
    )

    table = iceberg_catalog.load_table(f"{ns}.{ledger.LEDGER_TABLE}")
    assert table.schema().find_field("event_hours").optional
    assert old_files <= {task.file.file_path for task in table.scan().plan_files()}
    rows = table.scan().to_arrow().to_pylist()
    assert len(rows) == len(old_rows) + 2
    kept = [
        {k: v for k, v in r.items() if k not in newer} for r in rows if r["run_id"] != "new-run"
    ]
    assert sorted(kept, key=repr) == sorted(old_rows, key=repr)
    assert all(r["event_hours"] is None for r in rows if r["run_id"] != "new-run")
    assert [
        (e.hour, e.run_id, e.offsets, e.event_hours)
        for e in ledger.publishes(iceberg_catalog, ns, raw)
    ] == [
        *(
            (START + timedelta(hours=h), "old-run", {0: (h * 10, h * 10 + 5)}, None)
            for h in range(3)
        ),
        (START + timedelta(hours=3), "new-run", None, {}),  # published, no rows: nothing late
        (START + timedelta(hours=4), "new-run", None, {START: 2, START + timedelta(hours=4): 7}),
    ]
    # The next append finds the column in place (no second schema update).
    schema_id = table.schema().schema_id
    ledger.record_rollback(iceberg_catalog, ns, raw, runs=["new-run"], snapshot_id=5)
    table = iceberg_catalog.load_table(f"{ns}.{ledger.LEDGER_TABLE}")
    assert table.schema().schema_id == schema_id
    assert [e.run_id for e in ledger.publishes(iceberg_catalog, ns, raw)] == ["old-run"] * 3


def test_a_running_raw_run_keeps_its_current_hours_out_of_new_requests() -> None:
    """A raw request materializes raw and current. Between its raw publish and its current
    publish, the current hours it covers are gaps; the gap sensor must not request them as a
    current-only run (found by the convergence tier: a duplicate run, and two runs publishing
    the same current hours at once)."""
    from backfill_assets.defs import sensors

    sensor = "orders_offset_gaps"
    first = datetime(2026, 8, 10, 4, tzinfo=UTC)
    hours = [first + timedelta(hours=h) for h in range(3)]
    with dg.instance_for_test() as instance:
        instance.add_run(
            dg.DagsterRun(
                job_name="__ASSET_JOB",
                run_id=str(uuid.uuid4()),
                status=dg.DagsterRunStatus.STARTED,
                tags={
                    "dagster/sensor_name": sensor,
                    sensors.REQUEST_TAG: "raw:2026-08-10-04:00...2026-08-10-05:00",
                },
            )
        )
        history = sensors._history(instance, sensor)
        assert sensors._spans("current", hours, history, 720) == [(hours[2], hours[2])]
        assert sensors._spans("raw", hours, history, 720) == [(hours[2], hours[2])]


def _span_hours(first: str, last: str) -> list[str]:
    """The partition keys of the range ``first``...``last``."""
    a, b = (datetime.strptime(x, detect.PARTITION_FMT).replace(tzinfo=UTC) for x in (first, last))
    hour = timedelta(hours=1)
    return [_h(int((a - START) / hour) + i) for i in range(int((b - a) / hour) + 1)]


def test_gap_requests_are_cut_as_a_backfill_cuts_its_runs(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gap sensor requests a gap in runs of at most ``BACKFILL_MAX_HOURS_PER_RUN`` hours,
    as a backfill's policy cuts a range (it cut at 168 hours whatever the setting said)."""

    def tick() -> list[tuple[str, list[str], str, str]]:
        saved = world.cursors["gap"]
        try:
            return _tick(world, "gap")
        finally:
            world.cursors["gap"] = saved

    whole = [r for r in tick() if r[0] == "raw"]
    assert len(whole) == 1, whole  # the default (720) holds the history's 8 hours in one run
    monkeypatch.setenv("BACKFILL_MAX_HOURS_PER_RUN", "3")
    cut = [r for r in tick() if r[0] == "raw"]
    assert [len(_span_hours(r[2], r[3])) for r in cut] == [3, 3, 2], cut
    assert [h for r in cut for h in _span_hours(r[2], r[3])] == _span_hours(*whole[0][2:])
    assert {tuple(r[1]) for r in cut} == {tuple(whole[0][1])}
