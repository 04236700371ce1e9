"""History beyond Kafka's retention: archive a real topic, delete its oldest records from the
broker, and backfill a range spanning the boundary from archive plus Kafka.

Real broker (records really deleted with DeleteRecords), real Spark, real catalog, archive in
a local directory through pyarrow.fs (the same code path as s3://).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from dagster_shared.error import SerializableErrorInfo

from backfill_assets import audit, catalog, planner
from backfill_assets.archive import Archive, ArchiveError
from backfill_assets.archiver import build_archive_asset, run_archiver
from backfill_assets.assets import build_raw_asset
from backfill_assets.definitions import RESOURCES, SPECS
from backfill_assets.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.replay import checksum_expr
from backfill_assets.resources import IcebergResource, KafkaResource
from backfill_assets.settings import Settings
from backfill_assets.spec import TopicSpec

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 4, 1, tzinfo=UTC)
RANGE = ("2026-04-01-01:00", "2026-04-01-04:00")  # window [01:00, 05:00)
WINDOW = (START + timedelta(hours=1), START + timedelta(hours=5))
# Offsets below the start of hour 3 plus this many records are deleted from Kafka, so the
# boundary between archive and Kafka falls inside hour 3 of the range.
CUT_INTO_HOUR_3 = 5


@dataclasses.dataclass
class World:
    spec: TopicSpec
    truth: GroundTruth
    instance: dg.DagsterInstance
    table: str


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"arch_{uuid.uuid4().hex[:8]}"
    spec = dataclasses.replace(SPECS[0], topic=topic)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=150, seed=5),
    )
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    with dg.instance_for_test() as instance:
        yield World(spec, truth, instance, table)


def _backfill(world: World, spec: TopicSpec | None = None) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [build_raw_asset(spec or world.spec)],
        resources=RESOURCES,
        instance=world.instance,
        tags={
            "dagster/asset_partition_range_start": RANGE[0],
            "dagster/asset_partition_range_end": RANGE[1],
        },
        raise_on_error=False,
    )


def _main(spark: SparkSession, world: World) -> tuple[int, str, dict[str, str]]:
    df = spark.table(world.table)
    checksum = df.agg(checksum_expr(world.spec)).first()[0]  # type: ignore[index]
    row = spark.sql(
        f"SELECT s.summary FROM {world.table}.snapshots s JOIN {world.table}.refs r "
        "ON s.snapshot_id = r.snapshot_id WHERE r.name = 'main'"
    ).first()
    assert row is not None
    return df.count(), str(checksum), dict(row[0])


def _kafka_records(settings: Settings, topic: str, partition: int, end: int) -> list[Any]:
    consumer = Consumer(
        {**settings.kafka.client_config(), "group.id": "t", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, partition, 0)])
    out: list[Any] = []
    try:
        while len(out) < end:
            msg = consumer.poll(10)
            assert msg is not None and msg.error() is None
            out.append(
                (msg.offset(), msg.timestamp()[1], msg.key(), msg.value(), msg.headers() or [])
            )
    finally:
        consumer.close()
    return out


def _delete_below(settings: Settings, topic: str, offsets: dict[int, int]) -> None:
    admin = AdminClient(settings.kafka.client_config())
    futures = admin.delete_records([TopicPartition(topic, p, o) for p, o in offsets.items()])
    for future in futures.values():
        future.result(30)


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    failures = result.get_step_failure_events()
    assert failures, "the run was expected to fail"
    data = failures[0].step_failure_data
    assert data.error is not None
    messages: list[str] = []
    error: SerializableErrorInfo | None = data.error
    while error is not None:
        messages.append(error.message)
        error = error.cause
    return " | ".join(messages)


def test_archive_delete_then_hybrid_backfill_matches(
    world: World, stack_settings: Settings, spark_session: SparkSession
) -> None:
    spec, truth = world.spec, world.truth
    kafka, iceberg = KafkaResource(), IcebergResource()

    # Reference: the range backfilled while Kafka still holds all of it.
    reference = _backfill(world)
    assert reference.success
    ref_rows, ref_checksum, _ = _main(spark_session, world)
    ref_meta = reference.get_asset_materialization_events()[0].materialization.metadata
    ref_read = ref_meta["records_read"].value

    # Archive the topic (through the Dagster asset, as the schedule does).
    arch = dg.materialize([build_archive_asset(spec)], resources=RESOURCES, instance=world.instance)
    assert arch.success
    meta = arch.get_asset_materialization_events()[0].materialization.metadata
    high = truth.end_offsets()
    assert meta["records"].value == sum(high.values())
    assert meta["lost_before_archiving"].value == {}
    store = Archive(stack_settings)
    for p in range(6):
        assert store.coverage(spec.topic, p) == [(0, high[p])]
    # The archived records are byte-identical to Kafka's (key, value, headers, timestamp).
    table = store.read_records(spec.topic, 0, 0, high[0])
    archived = [
        (r["offset"], int(r["timestamp"].timestamp() * 1000), r["key"], r["value"],
         [(h["key"], h["value"]) for h in r["headers"] or []])
        for r in table.to_pylist()
    ]  # fmt: skip
    assert archived == _kafka_records(stack_settings, spec.topic, 0, high[0])

    # Exactly once: a second pass copies nothing; new records are appended as one new file.
    _, summary = run_archiver(kafka, iceberg, spec)
    assert summary["records"] == 0 and summary["files"] == 0
    producer = Producer(stack_settings.kafka.client_config())
    late_ts = int((START + timedelta(hours=5, minutes=30)).timestamp() * 1000)
    for i in range(3):
        producer.produce(spec.topic, value=b"{}", key=f"k{i}".encode(), partition=0,
                         timestamp=late_ts)  # fmt: skip
    producer.flush(10)
    _, summary = run_archiver(kafka, iceberg, spec)
    assert summary["records"] == 3 and summary["files"] == 1
    assert store.coverage(spec.topic, 0) == [(0, high[0] + 3)]
    assert [f.start for f in store.chain(spec.topic, 0)][-1] == high[0]

    # Kafka deletes its oldest records: the boundary falls inside hour 3 of the range.
    hour3 = (START + timedelta(hours=3)).isoformat()
    cut = {p: truth.hour_offsets[p][hour3][0] + CUT_INTO_HOUR_3 for p in range(6)}
    _delete_below(stack_settings, spec.topic, cut)
    assert {p: lo for p, (lo, _) in kafka.watermarks(spec.topic).items()} == cut

    # The plan shows which share of the range comes from the archive and which from Kafka.
    hour1 = (START + timedelta(hours=1)).isoformat()
    first = {p: truth.hour_offsets[p][hour1][0] for p in range(6)}
    plan = planner.make_plan(kafka, spec, *WINDOW, instance=None, concurrency=1)
    assert plan.missing_offsets == {}
    assert plan.records_from_archive == sum(cut[p] - first[p] for p in range(6))
    assert plan.records_from_archive + plan.records_from_kafka == plan.records
    assert plan.archive_offsets == {str(p): [first[p], cut[p]] for p in range(6)}
    assert "archive" in plan.human()

    # The same range again, now from archive plus Kafka: identical result.
    hybrid = _backfill(world)
    assert hybrid.success, _failure_message(hybrid)
    rows, checksum, summary_after = _main(spark_session, world)
    assert (rows, checksum) == (ref_rows, ref_checksum)
    assert summary_after["backfill.run-id"] == hybrid.run_id
    assert json.loads(summary_after["backfill.archive-offsets"]) == plan.archive_offsets
    hybrid_meta = hybrid.get_asset_materialization_events()[0].materialization.metadata
    assert hybrid_meta["records_read"].value == ref_read
    assert hybrid_meta["checksum"].value == ref_meta["checksum"].value
    ref_checks = {e.check_name: e for e in reference.get_asset_check_evaluations()}
    for e in hybrid.get_asset_check_evaluations():
        assert e.passed, e.check_name
        if e.check_name == "count_reconciliation":
            assert (
                e.metadata["per_hour"].value == ref_checks[e.check_name].metadata["per_hour"].value
            )


def test_range_in_neither_kafka_nor_archive_fails_naming_offsets(
    world: World, stack_settings: Settings, spark_session: SparkSession
) -> None:
    topic = f"gone_{uuid.uuid4().hex[:8]}"
    spec = dataclasses.replace(SPECS[0], topic=topic)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=60, seed=6),
    )
    hour2 = (START + timedelta(hours=2)).isoformat()
    cut = {p: truth.hour_offsets[p][hour2][0] for p in range(6)}
    _delete_below(stack_settings, topic, cut)

    # Archiving now cannot bring them back, and says so.
    _, summary = run_archiver(KafkaResource(), IcebergResource(), spec)
    assert summary["lost_before_archiving"] == {str(p): [0, cut[p]] for p in range(6)}

    plan = planner.make_plan(KafkaResource(), spec, *WINDOW, instance=None, concurrency=1)
    assert plan.missing_offsets == {str(p): [0, cut[p]] for p in range(6)}
    closure = next(s for s in plan.scorecard if s.dimension == "closure")
    assert closure.color == "red"

    result = _backfill(world, spec)
    assert not result.success
    message = _failure_message(result)
    for p in range(6):
        assert f"partition {p} offsets [0, {cut[p]})" in message
    assert "neither in Kafka nor in the archive" in message

    # Nothing was published: main does not exist, no row was written.
    name = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    refs = [r["name"] for r in spark_session.sql(f"SELECT name FROM {name}.refs").collect()]
    assert "main" not in refs
    rows = audit.query(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        run_id=result.run_id,
    )
    assert [r["event"] for r in rows] == ["run_failed"]
    assert f"offsets [0, {cut[0]})" in rows[0]["detail"]


def test_unknown_offsets_rule() -> None:
    """Offsets below the log start that are not archived block a window that overlaps them
    or begins right after them (their timestamps are unknown), and nothing else."""
    from backfill_assets.replay import _unknown_in

    assert _unknown_in([(0, 100)], 100, 40, 160) is None  # fully archived below log start
    assert _unknown_in([], 100, 100, 160) == (0, 100)  # window may begin in deleted data
    assert _unknown_in([], 100, 120, 160) is None  # Kafka itself has earlier records
    assert _unknown_in([(50, 100)], 100, 50, 80) == (0, 50)  # archiving began too late
    assert _unknown_in([(0, 30), (60, 100)], 100, 10, 80) == (30, 60)  # hole inside the window
    assert _unknown_in([(0, 30), (60, 100)], 100, 70, 90) is None


def test_s3_archive_settings_reach_spark_and_pyarrow(stack_env: dict[str, str]) -> None:
    from backfill_assets.spark import spark_config

    env = {
        **stack_env,
        "BACKFILL_ARCHIVE_URI": "s3://kafka-archive/topics",
        "BACKFILL_S3_ENDPOINT": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "key",
        "AWS_REGION": "eu-west-1",
    }
    settings = Settings.from_env(env)
    conf = spark_config(settings)
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9"
    assert conf["spark.hadoop.fs.s3a.access.key"] == "id"
    store = Archive(settings)
    assert store.root == "kafka-archive/topics"
    assert (
        store.spark_uri(f"{store.root}/t/0/x.parquet") == "s3a://kafka-archive/topics/t/0/x.parquet"
    )
    with pytest.raises(ArchiveError, match="BACKFILL_ARCHIVE_URI"):
        Archive(Settings.from_env({**stack_env, "BACKFILL_ARCHIVE_URI": "/no/scheme"}))


def test_archive_cli_names_allowed_topics(
    stack_settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    from backfill_assets.cli import main

    assert main(["archive", "--topic", "no_such_topic"]) == 2
    err = capsys.readouterr().err
    assert "unknown topic 'no_such_topic'" in err and "orders" in err
