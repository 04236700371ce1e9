"""Issue 51, item 2: the archive belongs to one log.

A topic is archived, deleted and recreated with other records (a new log: its offsets restart
at 0), archived again, and Kafka deletes the new log's oldest records. The backfill of a range
below the new log start must read the NEW log's archived records; before the archive kept a
folder per log, the second archiver pass resumed at the old log's end and the run read the old
log's records at the same offsets, with every check green. Real broker (DeleteRecords, topic
deletion), real Spark run, real catalog; the archiver through its Dagster asset.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pyarrow.fs as pafs
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.archiver import build_archive_asset
from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.offsets.archive import Archive
from backfill_assets.ops import planner
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 5, 1, tzinfo=UTC)


def _stamps(settings: Settings, topic: str, end: int) -> dict[int, int]:
    """Offset -> Kafka timestamp (ms) of partition 0's records below ``end``, read here."""
    consumer = Consumer(
        {**settings.kafka.client_config(), "group.id": "t", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: dict[int, int] = {}
    try:
        while len(out) < end:
            msg = consumer.poll(10)
            assert msg is not None and msg.error() is None
            out[int(msg.offset())] = msg.timestamp()[1]  # type: ignore[arg-type]
    finally:
        consumer.close()
    return out


def _recreate(settings: Settings, topic: str) -> None:
    admin = AdminClient(settings.kafka.client_config())
    admin.delete_topics([topic], operation_timeout=30)[topic].result()
    deadline = time.monotonic() + 60
    while topic in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, "the topic was not deleted"
        time.sleep(0.5)


def _archive(spec_topic: str, instance: dg.DagsterInstance) -> dict[str, object]:
    spec = renamed(SPECS[0], topic=spec_topic, partition_start=START, tables=())
    result = dg.materialize([build_archive_asset(spec)], resources=RESOURCES, instance=instance)
    assert result.success
    meta = result.get_asset_materialization_events()[0].materialization.metadata
    return {k: v.value for k, v in meta.items()}


@pytest.mark.slow  # 30 s: the default tier stays under 15 minutes
def test_recreated_topic_is_archived_and_read_as_its_own_log(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    topic = f"arch_log_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, partition_start=START, tables=())
    config = GeneratorConfig(topic=topic, start=START, hours=3, partitions=1, events_per_hour=40)
    kafka = KafkaClient()
    with dg.instance_for_test() as instance:
        old = generate(stack_settings, config)
        old_log = kafka.topic_identity(topic)
        old_end = old.end_offsets()[0]
        old_stamps = _stamps(stack_settings, topic, old_end)
        _archive(topic, instance)

        _recreate(stack_settings, topic)
        new = generate(stack_settings, dataclasses.replace(config, seed=99))
        new_log = kafka.topic_identity(topic)
        assert new_log.topic_id != old_log.topic_id
        new_end = new.end_offsets()[0]
        new_stamps = _stamps(stack_settings, topic, new_end)
        # The new log's records sit at offsets the old log's archive also holds, differently.
        assert new_end <= old_end and new_stamps != {o: old_stamps[o] for o in new_stamps}

        # A file of the first layout (no log folder): never read, listed by the archiver.
        old_files = Archive(stack_settings, {topic: old_log}).files(topic, 0)
        first_layout = Path(f"{Archive(stack_settings).root}/{topic}/0")
        first_layout.mkdir(parents=True)
        shutil.copy(old_files[0].path, first_layout / Path(old_files[0].path).name)

        # The archiver archives the new log from its start, not from the old log's end.
        meta = _archive(topic, instance)
        assert meta["records"] == new_end
        assert meta["lost_before_archiving"] == {}
        store = Archive(stack_settings)
        assert store.log(topic) == new_log
        assert store.coverage(topic, 0) == [(0, new_end)]
        run = store.archive_topic(kafka, topic)[0].to_json()
        assert [u["file"] for u in run["unattributed"]] == [
            str(first_layout / Path(old_files[0].path).name)
        ]
        assert store.directory(topic, 0) in run["unattributed"][0]["why"]
        # Nothing of the old log is lost: its folder still reads its own records.
        assert Archive(stack_settings, {topic: old_log}).coverage(topic, 0) == [(0, old_end)]

        # Kafka deletes the new log's records below the middle of hour 1.
        hour1 = new.hour_offsets[0][(START + timedelta(hours=1)).isoformat()]
        cut = (hour1[0] + hour1[1]) // 2
        admin = AdminClient(stack_settings.kafka.client_config())
        for future in admin.delete_records([TopicPartition(topic, 0, cut)]).values():
            future.result(30)
        window = (START, START + timedelta(hours=2))
        plan = planner.make_plan(kafka, spec, *window, instance=None, concurrency=1)
        assert plan.missing_offsets == {} and plan.records_from_archive == cut

        result = materialize_range(
            [build_raw_asset(spec)], instance, "2026-05-01-00:00", "2026-05-01-01:00"
        )
        assert result.success
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    rows = spark_session.table(table).selectExpr(
        "kafka_offset", "CAST(unix_millis(kafka_timestamp) AS BIGINT) AS ts"
    )
    stored = {int(r["kafka_offset"]): int(r["ts"]) for r in rows.collect()}
    assert stored, "the run published no rows"
    # Every row is the NEW log's record at its offset, the archived ones below `cut` included.
    assert {o: new_stamps[o] for o in stored} == stored
    assert any(o < cut and old_stamps.get(o) != ts for o, ts in stored.items())


# Topic ids as confluent-kafka prints them (standard base64): about one topic in four has a
# "/" in its id and one in two hundred a "//" (CI, stop 63: "Empty path component in path
# lake-archive/archive/orders/log-UgYaSwO6RbKF//DQ75dg0A/0", every run of the backfill failed).
SLASHED = ["UgYaSwO6RbKF//DQ75dg0A", "/gYa+wO6RbKF/DQ75dg0A"]


def _topic_with(settings: Settings, prefix: str, records: int) -> str:
    """A new one-partition topic (a real name: dots and hyphens) holding ``records`` records."""
    topic = f"{prefix}.orders-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(settings.kafka.client_config())
    admin.create_topics([NewTopic(topic, 1, 1)], operation_timeout=30)[topic].result(30)
    _more(settings, topic, records)
    return topic


def _more(settings: Settings, topic: str, records: int) -> None:
    producer = Producer(settings.kafka.client_config())
    for i in range(records):
        producer.produce(topic, value=f"v{i}".encode(), partition=0)
    assert producer.flush(30) == 0


def _names(store: Archive, topic: str) -> list[str]:
    """What the archive's folder of ``topic`` holds (a local directory or an S3 prefix)."""
    folder = pafs.FileSelector(f"{store.root}/{topic}", allow_not_found=True)
    return sorted(info.base_name for info in store.fs.get_file_info(folder))


def _kafka_spelling(topic_id: str) -> str:
    return topic_id.replace("+", "-").replace("/", "_")


@pytest.mark.parametrize("topic_id", SLASHED, ids=["double-slash", "leading-slash-and-plus"])
def test_a_log_whose_id_has_slashes_is_archived_in_one_folder_and_read(
    stack_settings: Settings, topic_id: str
) -> None:
    topic = _topic_with(stack_settings, "arch.slash", 12)
    log = dataclasses.replace(KafkaClient().topic_identity(topic), topic_id=topic_id)

    [run] = Archive(stack_settings, {topic: log}).archive_topic(KafkaClient(), topic)
    assert (run.start, run.end, run.records) == (0, 12, 12)

    # One folder, named by the id as Kafka itself spells it (URL-safe base64).
    reader = Archive(stack_settings, {topic: log})
    assert _names(reader, topic) == [f"log-{_kafka_spelling(topic_id)}"]
    assert reader.coverage(topic, 0) == [(0, 12)]
    values = reader.read_records(topic, 0, 0, 12).column("value").to_pylist()
    assert values == [f"v{i}".encode() for i in range(12)]


def test_a_log_archived_under_the_first_spelling_of_its_id_keeps_its_folder(
    stack_settings: Settings,
) -> None:
    topic = _topic_with(stack_settings, "arch.plus", 5)
    log = dataclasses.replace(KafkaClient().topic_identity(topic), topic_id="Ug+a/wO6RbKF+DQ7dg0Aw")
    [run] = Archive(stack_settings, {topic: log}).archive_topic(KafkaClient(), topic)
    # Where the archiver put the log before it spelt ids as Kafka does: "/" split the folder.
    store = Archive(stack_settings, {topic: log})
    spelt = f"{store.root}/{topic}/log-{_kafka_spelling(log.topic_id)}/0"
    for info in store.fs.get_file_info(pafs.FileSelector(spelt)):
        store.fs.create_dir(f"{store.root}/{topic}/log-Ug+a/wO6RbKF+DQ7dg0Aw/0")
        store.fs.move(
            info.path, f"{store.root}/{topic}/log-Ug+a/wO6RbKF+DQ7dg0Aw/0/{info.base_name}"
        )
    store.fs.delete_dir(f"{store.root}/{topic}/log-{_kafka_spelling(log.topic_id)}")

    _more(stack_settings, topic, 3)
    assert store.coverage(topic, 0) == [(0, 5)]  # nothing archived is lost
    [more] = store.archive_topic(KafkaClient(), topic)
    assert (run.end, more.start, more.end) == (5, 5, 8)  # appended to the same chain
    assert Archive(stack_settings, {topic: log}).coverage(topic, 0) == [(0, 8)]
    assert _names(store, topic) == ["log-Ug+a"]
