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
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

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
