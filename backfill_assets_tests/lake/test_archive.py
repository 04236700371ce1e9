"""History beyond Kafka's retention: archive a real topic, delete its oldest records from the
broker, and backfill a range spanning the boundary from archive plus Kafka.

Real broker (records really deleted with DeleteRecords), real Spark, real catalog, archive in
a local directory through pyarrow.fs (the same code path as s3://).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Consumer, IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec  # type: ignore[attr-defined]
from dagster_shared.error import SerializableErrorInfo

from backfill_assets.defs.archiver import build_archive_asset
from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.errors import ArchiveError
from backfill_assets.lake.offsets.archive import SCHEMA, Archive
from backfill_assets.lake.operations.archiver import run_archiver
from backfill_assets.lake.write import audit
from backfill_assets.lake.write.replay import checksum_expr
from backfill_assets.ops import planner
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

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
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=150, seed=5),
    )
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    with dg.instance_for_test() as instance:
        yield World(spec, truth, instance, table)


def _backfill(world: World, spec: TopicSpec | None = None) -> dg.ExecuteInProcessResult:
    return materialize_range(
        [build_raw_asset(spec or world.spec)], world.instance, *RANGE, raise_on_error=False
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


# slow tier (CI runs it): ~38 s; the default tier stays under 15 minutes.
@pytest.mark.slow
def test_archive_delete_then_hybrid_backfill_matches(
    world: World, stack_settings: Settings, spark_session: SparkSession
) -> None:
    spec, truth = world.spec, world.truth
    kafka, iceberg = KafkaClient(), CatalogClient()

    # Reference: the range backfilled while Kafka still holds all of it.
    reference = _backfill(world)
    assert reference.success
    ref_rows, ref_checksum, _ = _main(spark_session, world)
    ref_meta = reference.get_asset_materialization_events()[0].materialization.metadata
    ref_run = ref_meta["run"].value
    assert isinstance(ref_run, dict)
    ref_read = ref_run["records_read"]

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
    hybrid_run = hybrid_meta["run"].value
    assert isinstance(hybrid_run, dict) and hybrid_run["records_read"] == ref_read
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
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=60, seed=6),
    )
    hour2 = (START + timedelta(hours=2)).isoformat()
    cut = {p: truth.hour_offsets[p][hour2][0] for p in range(6)}
    _delete_below(stack_settings, topic, cut)

    # Archiving now cannot bring them back, and says so.
    _, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    assert summary["lost_before_archiving"] == {str(p): [0, cut[p]] for p in range(6)}

    plan = planner.make_plan(KafkaClient(), spec, *WINDOW, instance=None, concurrency=1)
    assert plan.missing_offsets == {str(p): [0, cut[p]] for p in range(6)}
    closure = next(s for s in plan.scorecard if s.dimension == "closure")
    assert closure.color == "red"

    result = _backfill(world, spec)
    assert not result.success
    message = _failure_message(result)
    for p in range(6):
        assert f"partition {p} offsets [0, {cut[p]})" in message
    assert "neither in Kafka nor in the archive" in message

    # Nothing was written: the window failed before any table was touched (the run fixes its
    # offsets before its first Spark statement), so the raw table was not even created.
    name = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    assert not spark_session.catalog.tableExists(name)
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
    from backfill_assets.lake.offsets.scan import _unknown

    assert _unknown(40, 100, [(0, 100)]) is None  # fully archived below log start
    assert _unknown(100, 100, []) == (0, 100)  # window may begin in deleted data
    assert _unknown(120, 100, []) is None  # Kafka itself has earlier records
    assert _unknown(50, 100, [(50, 100)]) == (0, 50)  # archiving began too late
    assert _unknown(100, 100, [(50, 100)]) is None  # the record below the start is known
    assert _unknown(10, 100, [(0, 30), (60, 100)]) == (30, 60)  # hole inside the window
    assert _unknown(70, 100, [(0, 30), (60, 100)]) is None
    assert _unknown(0, 100, [(0, 100)]) is None
    assert _unknown(0, 0, []) is None


def test_s3_archive_settings_reach_spark_and_pyarrow(stack_env: dict[str, str]) -> None:
    from backfill_assets.stack.spark import spark_config

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
    from backfill_assets.ops.cli import main

    assert main(["archive", "--topic", "no_such_topic"]) == 2
    err = capsys.readouterr().err
    assert "unknown topic 'no_such_topic'" in err and "orders" in err


# -- committed records only -----------------------------------------------------------------
# Transactions on real topics: records of aborted transactions are in the log (next to the
# transaction markers) and must never reach the archive.

Rec = tuple[int, int, bytes | None, bytes | None, list[tuple[str, bytes | None]]]
TX_TS = int((START + timedelta(hours=2)).timestamp() * 1000)  # CreateTime in the past


def _new_topic(settings: Settings, prefix: str) -> str:
    topic = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = AdminClient(settings.kafka.client_config())
    admin.create_topics([NewTopic(topic, 1, 1)], operation_timeout=30)[topic].result(30)
    return topic


def _tx_producer(settings: Settings, topic: str) -> Producer:
    producer = Producer(
        {**settings.kafka.client_config(), "transactional.id": f"tx-{topic}-{uuid.uuid4().hex}"}
    )
    producer.init_transactions(60)
    return producer


def _produce(producer: Producer, topic: str, values: list[bytes]) -> None:
    for v in values:
        producer.produce(
            topic, value=v, key=b"k-" + v, partition=0, timestamp=TX_TS, headers=[("h", v)]
        )


def _transaction(producer: Producer, topic: str, values: list[bytes], *, commit: bool) -> None:
    producer.begin_transaction()
    _produce(producer, topic, values)
    # abort_transaction purges records not sent yet: flush first, so that the aborted records
    # really are in the log, as on real topics.
    producer.flush(30)
    if commit:
        producer.commit_transaction(60)
    else:
        producer.abort_transaction(60)


def _plain(settings: Settings, topic: str, values: list[bytes]) -> None:
    producer = Producer(settings.kafka.client_config())
    _produce(producer, topic, values)
    assert producer.flush(30) == 0


def _log_ends(
    settings: Settings, topic: str, admin: AdminClient | None = None
) -> tuple[int, int, int]:
    """(log start, last stable offset, high watermark) of partition 0, asked independently of
    the code under test."""
    admin = admin or AdminClient(settings.kafka.client_config())
    tp = TopicPartition(topic, 0)
    out = []
    for latest, level in (
        (False, IsolationLevel.READ_UNCOMMITTED),
        (True, IsolationLevel.READ_COMMITTED),
        (True, IsolationLevel.READ_UNCOMMITTED),
    ):
        spec = OffsetSpec.latest() if latest else OffsetSpec.earliest()  # type: ignore[no-untyped-call]
        future = admin.list_offsets({tp: spec}, isolation_level=level, request_timeout=30)[tp]
        out.append(int(future.result(30).offset))
    return out[0], out[1], out[2]


def _wait_ends(
    settings: Settings, topic: str, *, high: int | None = None, settled: bool = True
) -> tuple[int, int, int]:
    """Wait until the high watermark is ``high`` (if given) and, if ``settled``, the last
    stable offset has reached it (commit/abort markers are written asynchronously)."""
    deadline = time.monotonic() + 60
    admin = AdminClient(settings.kafka.client_config())
    while True:
        ends = _log_ends(settings, topic, admin)
        if (high is None or ends[2] == high) and (not settled or ends[1] == ends[2]):
            return ends
        assert time.monotonic() < deadline, f"offsets of {topic} did not settle: {ends}"
        time.sleep(0.2)


def _read_log(
    settings: Settings, topic: str, end: int, isolation: str, start: int = 0
) -> list[Rec]:
    """Partition 0's records of ``[start, end)`` as a librdkafka consumer with ``isolation``
    returns them."""
    consumer = Consumer(
        {
            **settings.kafka.client_config(),
            "group.id": "t",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    consumer.assign([TopicPartition(topic, 0, start)])
    out: list[Rec] = []
    deadline = time.monotonic() + 30
    try:
        while consumer.position([TopicPartition(topic, 0)])[0].offset < end:
            assert time.monotonic() < deadline, f"{isolation} read of {topic} stalled"
            for msg in consumer.consume(100, 1.0):
                assert msg.error() is None, msg.error()
                offset = msg.offset()
                assert offset is not None
                headers: list[tuple[str, bytes | None]] = msg.headers() or []  # type: ignore[assignment]
                if offset < end:
                    out.append((offset, msg.timestamp()[1], msg.key(), msg.value(), headers))
    finally:
        consumer.close()
    return out


def _archived(store: Archive, topic: str, start: int, end: int) -> list[Rec]:
    return [
        (r["offset"], int(r["timestamp"].timestamp() * 1000), r["key"], r["value"],
         [(h["key"], h["value"]) for h in r["headers"] or []])
        for r in store.read_records(topic, 0, start, end).to_pylist()
    ]  # fmt: skip


def _isolation(path: str) -> str | None:
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[b"backfill.archive"]).get("isolation")  # type: ignore[no-any-return]


def _write_legacy(store: Archive, topic: str, start: int, end: int, records: list[Rec]) -> str:
    """A file as the archiver wrote it before it read committed records only: every record
    of the range (aborted ones included), no ``isolation`` in its metadata."""
    rows = [
        {"topic": topic, "partition": 0, "offset": o, "timestamp": ts, "timestampType": 0,
         "key": k, "value": v, "headers": [{"key": hk, "value": hv} for hk, hv in h]}
        for o, ts, k, v, h in records
        if start <= o < end
    ]  # fmt: skip
    stamps = [ts for o, ts, *_ in records if start <= o < end]
    meta = {
        "topic": topic,
        "partition": 0,
        "start": start,
        "end": end,
        "records": len(rows),
        "min_timestamp_ms": min(stamps, default=None),
        "max_timestamp_ms": max(stamps, default=None),
    }
    schema = SCHEMA.with_metadata({b"backfill.archive": json.dumps(meta).encode()})
    directory = store.directory(topic, 0)
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = f"{directory}/{start:020d}-{end:020d}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def _spec(topic: str) -> TopicSpec:
    return renamed(SPECS[0], topic=topic)


def test_archive_holds_exactly_the_committed_records(stack_settings: Settings) -> None:
    topic = _new_topic(stack_settings, "txn")
    tx = _tx_producer(stack_settings, topic)
    _plain(stack_settings, topic, [b"n0"])
    _transaction(tx, topic, [b"c0", b"c1", b"c2"], commit=True)
    _transaction(tx, topic, [b"a0", b"a1"], commit=False)
    _plain(stack_settings, topic, [b"n1"])
    _transaction(tx, topic, [b"c3"], commit=True)
    _transaction(tx, topic, [b"a2", b"a3", b"a4"], commit=False)  # the log ends aborted
    # 1 + 3 + marker + 2 + marker + 1 + 1 + marker + 3 + marker
    _, _, high = _wait_ends(stack_settings, topic, high=15)
    committed_values = [b"n0", b"c0", b"c1", b"c2", b"n1", b"c3"]
    aborted_values = {b"a0", b"a1", b"a2", b"a3", b"a4"}

    # The aborted records really are in the log (a read of everything returns them) ...
    everything = _read_log(stack_settings, topic, high, "read_uncommitted")
    assert aborted_values <= {r[3] for r in everything}
    # ... and a committed reader skips them.
    committed = _read_log(stack_settings, topic, high, "read_committed")
    assert [r[3] for r in committed] == committed_values
    assert all(r[1] == TX_TS and r[2] == b"k-" + r[3] for r in committed)  # type: ignore[operator]

    # Two records per file, so file boundaries fall next to aborted records and markers.
    store = Archive(dataclasses.replace(stack_settings, archive_file_records=2))
    began = time.monotonic()
    [run] = store.archive_topic(KafkaClient(), topic)
    assert time.monotonic() - began < 15  # never waits for records that are not coming
    assert (run.start, run.end, run.records) == (0, high, len(committed_values))
    assert run.waiting_for_transaction is None and not run.rearchived
    # n0 c0 | c1 c2 | marker a0 a1 marker n1 c3 | marker a2 a3 a4 marker
    assert [(f.start, f.end) for f in store.files(topic, 0)] == [(0, 2), (2, 4), (4, 10), (10, 15)]
    assert len(run.files) == 4
    assert store.coverage(topic, 0) == [(0, high)]
    assert _archived(store, topic, 0, high) == committed
    assert all(_isolation(f.path) == "read_committed" for f in store.files(topic, 0))

    # Offsets that hold only aborted records and markers are archived as an empty file, at once.
    _transaction(tx, topic, [b"a5", b"a6"], commit=False)
    _, _, high2 = _wait_ends(stack_settings, topic, high=high + 3)
    began = time.monotonic()
    [run] = store.archive_topic(KafkaClient(), topic)
    assert time.monotonic() - began < 15
    assert (run.start, run.end, run.records, len(run.files)) == (high, high2, 0, 1)
    assert store.coverage(topic, 0) == [(0, high2)]
    assert _archived(store, topic, 0, high2) == committed
    assert _read_log(stack_settings, topic, high2, "read_committed") == committed
    [run] = store.archive_topic(KafkaClient(), topic)
    assert (run.records, run.files) == (0, [])
    tx.flush(10)


def test_open_transaction_holds_archive_at_lso_then_rest_exactly_once(
    stack_settings: Settings,
) -> None:
    topic = _new_topic(stack_settings, "open")
    spec = _spec(topic)
    kafka, iceberg = KafkaClient(), CatalogClient()
    tx = _tx_producer(stack_settings, topic)
    _plain(stack_settings, topic, [b"n0", b"n1"])
    _transaction(tx, topic, [b"c0"], commit=True)
    _, lso, _ = _wait_ends(stack_settings, topic, high=4)
    tx.begin_transaction()
    _produce(tx, topic, [b"o0", b"o1"])
    tx.flush(30)
    _plain(stack_settings, topic, [b"late"])  # not transactional, but behind the open one
    _, lso_open, high = _wait_ends(stack_settings, topic, high=lso + 3, settled=False)
    assert lso_open == lso  # the open transaction holds the LSO at its first record

    began = time.monotonic()
    runs, summary = run_archiver(kafka, iceberg, spec)
    assert time.monotonic() - began < 15
    assert (runs[0].start, runs[0].end, summary["records"]) == (0, lso, 3)
    assert summary["waiting_for_transaction"] == {"0": [lso, high]}
    assert summary["partitions"]["0"]["waiting_for_transaction"] == [lso, high]
    store = Archive(stack_settings)
    assert store.coverage(topic, 0) == [(0, lso)]
    rows = audit.query(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        table_name=f"archive/{topic}",
    )
    assert json.loads(rows[0]["detail"])["waiting_for_transaction"] == {"0": [lso, high]}

    # Still open: nothing more to archive, still waiting.
    _, summary = run_archiver(kafka, iceberg, spec)
    assert (summary["records"], summary["files"]) == (0, 0)
    assert summary["waiting_for_transaction"] == {"0": [lso, high]}

    tx.commit_transaction(60)
    _, _, high2 = _wait_ends(stack_settings, topic, high=high + 1)
    runs, summary = run_archiver(kafka, iceberg, spec)
    assert (runs[0].start, runs[0].end, summary["records"]) == (lso, high2, 3)
    assert summary["waiting_for_transaction"] == {}
    assert store.coverage(topic, 0) == [(0, high2)]
    archived = _archived(store, topic, 0, high2)
    assert archived == _read_log(stack_settings, topic, high2, "read_committed")
    assert [r[3] for r in archived] == [b"n0", b"n1", b"c0", b"o0", b"o1", b"late"]
    offsets = [r[0] for r in archived]
    assert offsets == sorted(set(offsets))  # each offset exactly once
    _, summary = run_archiver(kafka, iceberg, spec)
    assert (summary["records"], summary["files"]) == (0, 0)


def test_legacy_file_is_refused_then_rearchived_committed(stack_settings: Settings) -> None:
    topic = _new_topic(stack_settings, "legacy")
    spec = _spec(topic)
    tx = _tx_producer(stack_settings, topic)
    _plain(stack_settings, topic, [b"n0"])
    _transaction(tx, topic, [b"c0", b"c1"], commit=True)
    _transaction(tx, topic, [b"a0", b"a1"], commit=False)
    _plain(stack_settings, topic, [b"n1"])
    _, _, high = _wait_ends(stack_settings, topic, high=8)
    # What the archiver wrote when it read every record: the aborted ones included.
    everything = _read_log(stack_settings, topic, high, "read_uncommitted")
    store = Archive(stack_settings)
    path = _write_legacy(store, topic, 0, high, everything)
    assert {b"a0", b"a1"} <= {r[3] for r in _archived_unchecked(path)}

    for read in (
        lambda: store.files_for(topic, 0, 0, high),
        lambda: store.files_for(topic, 0, 2, 3),
        lambda: store.first_offset_at(topic, 0, TX_TS, below=high),
        lambda: store.read_records(topic, 0, 0, high),
    ):
        with pytest.raises(ArchiveError) as err:
            read()
        message = str(err.value)
        assert path in message and "partition 0" in message and f"[0, {high})" in message
        assert f"backfill-assets archive --topic {topic}" in message
        assert "aborted transactions" in message

    # The next pass re-archives it in place (and archives what came after it).
    _transaction(tx, topic, [b"c2"], commit=True)
    _, _, high2 = _wait_ends(stack_settings, topic, high=high + 2)
    runs, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    legacy_entry = {
        "file": path,
        "offsets": [0, high],
        "records_before": len(everything),
        "records_after": 4,
    }
    assert summary["rearchived"] == {"0": [legacy_entry]}
    assert summary["unverifiable_legacy"] == {}
    assert (runs[0].start, runs[0].end, summary["records"]) == (high, high2, 1)
    assert [(f.start, f.end) for f in store.files(topic, 0)] == [(0, high), (high, high2)]
    assert _isolation(path) == "read_committed"
    assert sorted(p.name for p in Path(path).parent.iterdir()) == sorted(
        Path(f.path).name for f in store.files(topic, 0)
    )  # no temporary file left behind
    rows = audit.query(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        table_name=f"archive/{topic}",
    )
    assert rows[0]["outcome"] == "ok"
    assert json.loads(rows[0]["detail"])["rearchived"] == {"0": [legacy_entry]}

    # Readers now get the committed records only (a fresh reader too).
    committed = _read_log(stack_settings, topic, high2, "read_committed")
    assert [r[3] for r in committed] == [b"n0", b"c0", b"c1", b"n1", b"c2"]
    for reader in (store, Archive(stack_settings)):
        assert _archived(reader, topic, 0, high2) == committed
        assert reader.first_offset_at(topic, 0, TX_TS, below=high2) == 0
        assert reader.files_for(topic, 0, 0, high2)[0].path == path

    _, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    assert summary["rearchived"] == {} and summary["records"] == 0
    tx.flush(10)


def test_legacy_file_below_log_start_is_unverifiable_and_refused(
    stack_settings: Settings,
) -> None:
    topic = _new_topic(stack_settings, "unver")
    spec = _spec(topic)
    tx = _tx_producer(stack_settings, topic)
    _plain(stack_settings, topic, [b"n0", b"n1", b"n2"])
    _transaction(tx, topic, [b"a0"], commit=False)  # offset 3, abort marker 4
    _transaction(tx, topic, [b"c0", b"c1"], commit=True)  # 5, 6, commit marker 7
    _plain(stack_settings, topic, [b"n3"])  # 8
    _, _, high = _wait_ends(stack_settings, topic, high=9)
    everything = _read_log(stack_settings, topic, high, "read_uncommitted")
    store = Archive(stack_settings)
    path = _write_legacy(store, topic, 0, 5, everything)
    before = Path(path).read_bytes()
    _delete_below(stack_settings, topic, {0: 2})
    assert _log_ends(stack_settings, topic)[0] == 2

    runs, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    entry = {"file": path, "offsets": [0, 5], "kafka_deleted": [0, 2]}
    assert summary["unverifiable_legacy"] == {"0": [entry]}
    assert summary["partitions"]["0"]["unverifiable_legacy"] == [entry]
    assert summary["rearchived"] == {}
    assert (runs[0].start, runs[0].end, summary["records"]) == (5, high, 3)
    rows = audit.query(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        table_name=f"archive/{topic}",
    )
    assert rows[0]["outcome"] == "unverifiable_legacy"
    assert json.loads(rows[0]["detail"])["unverifiable_legacy"] == {"0": [entry]}
    assert Path(path).read_bytes() == before  # left as it is

    for read in (
        lambda: store.files_for(topic, 0, 0, high),
        lambda: store.first_offset_at(topic, 0, TX_TS, below=high),
        lambda: Archive(stack_settings).read_records(topic, 0, 3, 4),
    ):
        with pytest.raises(ArchiveError) as err:
            read()
        message = str(err.value)
        assert f"{path} (topic {topic!r} partition 0 offsets [0, 5))" in message
        assert "cannot be re-archived because Kafka deleted offsets [0, 2)" in message
        assert "restore" in message and f"operator delete {path}" in message
    # The committed rest of the archive reads as usual.
    assert [r[3] for r in _archived(store, topic, 5, high)] == [b"c0", b"c1", b"n3"]

    # A later pass still cannot fix it, and says so again.
    _, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    assert summary["unverifiable_legacy"] == {"0": [entry]}
    assert Path(path).read_bytes() == before
    tx.flush(10)


def test_legacy_file_past_lso_waits_and_a_differing_one_is_kept(
    stack_settings: Settings,
) -> None:
    """A legacy file reaching past the last stable offset waits for the transaction; one whose
    records differ from Kafka's (a recreated topic) is never replaced by other history."""
    topic = _new_topic(stack_settings, "lsolegacy")
    spec = _spec(topic)
    tx = _tx_producer(stack_settings, topic)
    _plain(stack_settings, topic, [b"n0", b"n1"])
    tx.begin_transaction()
    _produce(tx, topic, [b"o0"])
    tx.flush(30)
    _, lso, high = _wait_ends(stack_settings, topic, high=3, settled=False)
    assert lso == 2
    everything = _read_log(stack_settings, topic, high, "read_uncommitted")
    store = Archive(stack_settings)
    # As the old archiver wrote it while the transaction was open, but n0 is not Kafka's n0.
    tampered = [(o, ts, k, b"other" if v == b"n0" else v, h) for o, ts, k, v, h in everything]
    path = _write_legacy(store, topic, 0, high, tampered)

    _, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    entry = {"file": path, "offsets": [0, high]}
    assert summary["legacy_waiting_for_transaction"] == {"0": [{**entry, "last_stable_offset": 2}]}
    assert summary["rearchived"] == {} and summary["records"] == 0
    with pytest.raises(ArchiveError, match="aborted transactions"):
        store.files_for(topic, 0, 0, high)

    tx.commit_transaction(60)
    _, _, high2 = _wait_ends(stack_settings, topic, high=high + 1)
    _, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    assert summary["unverifiable_legacy"] == {
        "0": [{**entry, "reason": "Kafka holds records that differ from the file's"}]
    }
    assert summary["rearchived"] == {}
    assert _isolation(path) is None  # kept as it was
    with pytest.raises(ArchiveError, match="aborted transactions"):
        store.read_records(topic, 0, 0, high)

    # The faithful legacy file (what the old archiver really wrote) is re-archived.
    _write_legacy(store, topic, 0, high, everything)
    _, summary = run_archiver(KafkaClient(), CatalogClient(), spec)
    assert summary["rearchived"] == {"0": [{**entry, "records_before": 3, "records_after": 3}]}
    assert summary["unverifiable_legacy"] == {} and summary["legacy_waiting_for_transaction"] == {}
    assert _archived(store, topic, 0, high2) == _read_log(
        stack_settings, topic, high2, "read_committed"
    )


def _archived_unchecked(path: str) -> list[Rec]:
    return [(r["offset"], 0, r["key"], r["value"], []) for r in pq.read_table(path).to_pylist()]
