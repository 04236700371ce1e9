"""Issue 30 item 5: a re-run of a compacted topic must not silently publish fewer records than
the ledger says the hour held.

Real broker (its real log cleaner), real Spark runs, real catalog and ledger, a real Dagster
instance. The topic is written as a plain topic and hours 0-1 are published; then it becomes
``cleanup.policy=compact`` and newer versions of some keys of hours 0 and 2 (partition 0)
arrive, so the broker's log cleaner removes the older ones: records of the published hour 0,
and of hour 2 before its first publish. Nothing is faked: the tests wait (bounded) until a
read_committed consumer sees fewer records.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.write import audit
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 5, 3, tzinfo=UTC)
ACCEPT_TAG = "backfill_assets/accept_fewer_records"
# Real Kafka topic configs (kafka.apache.org, topic-level): the cleaner may compact any closed
# segment at once; a segment closes when a record 100 ms (timestamps) after its first arrives.
# (segment.index.bytes=64, to close segments every 8 batches, made the cleaner fail: "Attempt
# to append to a full index", partition marked uncleanable; segment.bytes may not go below
# 1 MiB on Kafka 4.)
COMPACT = {
    "cleanup.policy": "compact",
    "segment.ms": "100",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "max.compaction.lag.ms": "100",
}
# The broker's log.cleaner.backoff.ms is Kafka's default (15 s): a compaction shows within
# one or two cleaner passes.
COMPACTION_WAIT_S = 90


def hour(i: int) -> datetime:
    return START + timedelta(hours=i)


def key(i: int) -> str:
    return f"{hour(i):%Y-%m-%d-%H:%M}"


@dataclasses.dataclass
class World:
    spec: TopicSpec
    settings: Settings
    instance: dg.DagsterInstance
    table: str  # Spark name of the raw table
    quarantine: str
    # The ledger's publish of hours 0-1 before the topic was compacted.
    published: dict[datetime, ledger.Entry] = dataclasses.field(default_factory=dict)
    # The ledger's ``records`` of hours 0-1 at that publish.
    held: dict[datetime, int] = dataclasses.field(default_factory=dict)
    # Partition 0 records of hour 2 (offset range) whose key got a newer version.
    hour2_copied: tuple[int, int] = (0, 0)

    def ledger_records(self, run_id: str) -> dict[datetime, int]:
        """The ``records`` column of ``run_id``'s publish rows (read from the table itself)."""
        cat = CatalogClient().catalog()
        rows = (
            cat.load_table(f"{self.settings.catalog.namespace}.{ledger.LEDGER_TABLE}")
            .scan()
            .to_arrow()
            .to_pylist()
        )
        return {
            r["hour"].astimezone(UTC): int(r["records"])
            for r in rows
            if r["event"] == "publish" and r["run_id"] == run_id and r["table_name"] == self.table
        }

    def coverage(self) -> dict[datetime, ledger.Entry]:
        cat = CatalogClient().catalog()
        return ledger.coverage(cat, self.settings.catalog.namespace, self.table)


def _run(world: World, first: int, last: int, tags: dict[str, str] | None = None) -> Any:
    return materialize_range(
        [build_raw_asset(world.spec)],
        world.instance,
        key(first),
        key(last),
        raise_on_error=False,
        tags=tags,
    )


def _consumer(settings: Settings) -> Consumer:
    return Consumer(
        {
            **settings.kafka.client_config(),
            "group.id": f"test-compaction-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )


def _records(
    settings: Settings, topic: str, partition: int, start: int, end: int
) -> list[tuple[int, bytes | None, bytes | None]]:
    """(offset, key, value) of the committed records Kafka holds now in ``[start, end)``."""
    out: list[tuple[int, bytes | None, bytes | None]] = []
    if end <= start:
        return out
    consumer = _consumer(settings)
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err.str()
                return out
            offset = msg.offset()
            assert offset is not None
            if offset >= end:
                return out
            out.append((offset, msg.key(), msg.value()))
        raise AssertionError(f"could not read {topic} partition {partition} [{start}, {end})")
    finally:
        consumer.close()


def _held(settings: Settings, topic: str, window: dict[int, tuple[int, int]]) -> int:
    """Committed records Kafka holds now in an hour's window."""
    return sum(len(_records(settings, topic, p, s, e)) for p, (s, e) in window.items())


def _make_compacted(settings: Settings, topic: str) -> None:
    admin = AdminClient(dict(settings.kafka.client_config()))
    resource = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
            for name, value in COMPACT.items()
        ],
    )
    futures = admin.incremental_alter_configs([resource])
    for future in futures.values():
        future.result()
    # The broker applies a topic's new config to its logs shortly after the alter returns: a
    # record appended at once still went to the old segment (seen: no roll, nothing cleaned).
    time.sleep(3)


def _supersede(settings: Settings, topic: str, records: list[tuple[bytes, bytes | None]]) -> None:
    """Newer versions (same key and value) of ``records`` in partition 0, in Kafka hour 4 (after
    every generated record: segment.ms counts from the segment's first batch's newest
    timestamp), one batch each, 1 s apart (so each closes the segment before it); then one
    more, so the segment holding the last of them closes too (the cleaner never compacts the
    active segment)."""
    producer = Producer({**settings.kafka.client_config(), "linger.ms": 0})
    stamp = int(hour(4).timestamp() * 1000)
    for i, (k, v) in enumerate([*records, records[-1]]):
        producer.produce(topic, key=k, value=v, partition=0, timestamp=stamp + i * 1000)
        assert producer.flush(30) == 0
    assert producer.flush(30) == 0


def _wait_for_cleaner(world: World, hour0: dict[int, tuple[int, int]], expect_gone: int) -> float:
    """Wait until the cleaner removed records of hour 0 and of hour 2's copied range; seconds."""
    began = time.monotonic()
    held0 = world.held[hour(0)]
    s2, e2 = world.hour2_copied
    while True:
        now0 = _held(world.settings, world.spec.topic, hour0)
        now2 = len(_records(world.settings, world.spec.topic, 0, s2, e2))
        if now0 < held0 and now2 <= (e2 - s2) - expect_gone:
            return time.monotonic() - began
        assert time.monotonic() - began < COMPACTION_WAIT_S, (
            f"the log cleaner removed nothing within {COMPACTION_WAIT_S} s "
            f"(hour 0: {now0} of {held0}; hour 2 copied range: {now2} of {e2 - s2})"
        )
        time.sleep(1)


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"compacted_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    generate(
        stack_settings,
        GeneratorConfig(
            topic=topic,
            start=START,
            hours=4,
            events_per_hour=60,
            partitions=2,
            seed=41,
            tombstone_share=0.0,
            duplicate_share=0.0,
        ),
    )
    iceberg = CatalogClient()
    with dg.instance_for_test() as instance:
        w = World(
            spec,
            stack_settings,
            instance,
            iceberg.spark_name(spec.raw_table),
            iceberg.spark_name(spec.quarantine_table),
        )
        # First publish of hours 0-1, while the topic is a plain one.
        first = _run(w, 0, 1)
        assert first.success, first.all_events
        w.published = {h: e for h, e in w.coverage().items() if h in (hour(0), hour(1))}
        assert set(w.published) == {hour(0), hour(1)}
        w.held = w.ledger_records(first.run_id)
        assert set(w.held) == {hour(0), hour(1)}
        # The topic becomes compacted; newer versions of every other record of partition 0 in
        # hour 0 and of the first records of hour 2 (after hour 1's end) arrive in hour 4.
        _make_compacted(stack_settings, topic)
        h0 = w.published[hour(0)].offsets
        h1 = w.published[hour(1)].offsets
        assert h0 is not None and h1 is not None
        old0 = [(k, v) for _o, k, v in _records(stack_settings, topic, 0, *h0[0]) if k][::2]
        start2 = h1[0][1]
        later = [r for r in _records(stack_settings, topic, 0, start2, start2 + 10) if r[1]]
        w.hour2_copied = (start2, start2 + 10)
        _supersede(stack_settings, topic, [*old0, *[(k, v) for _o, k, v in later if k]])
        waited = _wait_for_cleaner(w, h0, len(later))
        sys.stderr.write(f"\nlog cleaner removed the superseded records in {waited:.1f} s\n")
        yield w


def _main_snapshot(spark: SparkSession, table: str) -> int:
    row = spark.sql(f"SELECT snapshot_id FROM {table}.refs WHERE name = 'main'").first()
    assert row is not None
    return int(row[0])


def _hour_rows(spark: SparkSession, table: str, h: datetime) -> int:
    from pyspark.sql import functions as F

    df = spark.table(table).where(
        (F.col("kafka_hour") >= F.lit(h)) & (F.col("kafka_hour") < F.lit(h + timedelta(hours=1)))
    )
    return df.count()


def _checks(result: Any) -> dict[str, Any]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def _step_failure(result: Any) -> str:
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.STEP_FAILURE:
            error = event.step_failure_data.error
            return str(error.message if error is not None else "")
    return ""


def test_rerun_of_a_compacted_hour_is_refused_and_main_unchanged(
    world: World, spark_session: SparkSession
) -> None:
    spark = spark_session
    topic = world.spec.topic
    before_snapshot = _main_snapshot(spark, world.table)
    before_rows = _hour_rows(spark, world.table, hour(0))
    before_ledger = world.coverage()
    held = world.held[hour(0)]

    # As the gap sensor would launch it: never accepted on its own.
    result = _run(world, 0, 0, {"dagster/sensor_name": "gap_sensor_test"})

    now = _held(world.settings, topic, world.published[hour(0)].offsets or {})
    assert now < held
    assert not result.success, "the re-run published fewer records than the ledger counted"
    kept = _checks(result)["records_kept"]
    assert not kept.passed
    message = kept.description or ""
    for part in (
        f"topic {topic!r}",
        f"hour {hour(0).isoformat()}",
        f"the ledger counted {held} committed records",
        f"Kafka holds {now} now",
        "partition 0:",
        f"removed {held - now} record(s)",
        "compaction",
        "Nothing was published",
        "--accept-fewer-records",
    ):
        assert part in message, (part, message)
    # The run's failure (what a sensor-launched run shows in the UI) says the same.
    failure = _step_failure(result)
    assert "records_kept" in failure and f"Kafka holds {now} now" in failure, failure
    assert "Main is unchanged" in failure
    # Nothing changed on main or in the ledger; the branch is left for inspection.
    assert _main_snapshot(spark, world.table) == before_snapshot
    assert _hour_rows(spark, world.table, hour(0)) == before_rows
    assert world.coverage() == before_ledger
    branch = kept.metadata["audited_branch"].value
    refs = {r[0] for r in spark.sql(f"SELECT name FROM {world.table}.refs").collect()}
    assert branch in refs


def test_accepted_loss_publishes_and_is_recorded(world: World, spark_session: SparkSession) -> None:
    spark = spark_session
    held = world.held[hour(0)]
    window = world.published[hour(0)].offsets or {}
    now = _held(world.settings, world.spec.topic, window)
    assert now < held

    result = _run(world, 0, 0, {ACCEPT_TAG: "true"})

    assert result.success, _step_failure(result)
    kept = _checks(result)["records_kept"]
    assert kept.passed and "ACCEPTED LOSS" in (kept.description or "")
    assert kept.metadata["records_removed"].value == held - now
    mats = result.get_asset_materialization_events()
    accepted = mats[-1].materialization.metadata["accepted_record_loss"].value
    assert f"the ledger counted {held}" in accepted and f"Kafka holds {now} now" in accepted
    # The ledger: hour 0 is now this run's publish, with the records Kafka holds.
    entry = world.coverage()[hour(0)]
    assert entry.run_id == result.run_id and entry.records == now
    assert world.ledger_records(result.run_id) == {hour(0): now}
    assert entry.offsets == window
    assert world.coverage()[hour(1)] == world.published[hour(1)]
    # The audit table's publish row says what was accepted.
    rows = (
        spark.table(f"lake.{world.settings.catalog.namespace}.{audit.AUDIT_TABLE}")
        .where(f"run_id = '{result.run_id}' AND event = 'publish'")
        .collect()
    )
    assert len(rows) == 1 and f"Kafka holds {now} now" in rows[0]["detail"]
    # Main holds exactly what Kafka holds now (rows plus quarantined records).
    rows_now = _hour_rows(spark, world.table, hour(0))
    quarantined = _hour_rows(spark, world.quarantine, hour(0))
    assert rows_now + quarantined == now


def test_first_ingest_of_a_compacted_hour_publishes_what_kafka_holds(
    world: World, spark_session: SparkSession
) -> None:
    result = _run(world, 2, 2)

    assert result.success, _step_failure(result)
    checks = _checks(result)
    assert all(c.passed for c in checks.values()), {n: c.description for n, c in checks.items()}
    assert "first ingest" in (checks["records_kept"].description or "")
    entry = world.coverage()[hour(2)]
    window = entry.offsets or {}
    held = _held(world.settings, world.spec.topic, window)
    spanned = sum(e - s for s, e in window.values())
    # Offsets with holes: compaction removed records of the hour before its first publish.
    assert held < spanned, (held, spanned)
    assert entry.records == held
    rows = _hour_rows(spark_session, world.table, hour(2))
    quarantined = _hour_rows(spark_session, world.quarantine, hour(2))
    assert rows + quarantined == held


def test_ledger_rows_recovered_after_a_crash_keep_their_record_counts(world: World) -> None:
    """Issue 51 item 8. A run killed between main's fast-forward and its ledger append leaves
    a publish on main without ledger rows (test_faults proves that state); here its rows are
    deleted to leave the same state. Rebuilt from main's history, the rows carry the records
    the publish counted, so a re-run of hour 1 is compared against them: not taken for a
    first ingest, which would let it publish fewer rows unnoticed."""
    run_id = world.published[hour(1)].run_id
    cat = CatalogClient().catalog()
    ns = world.settings.catalog.namespace
    cat.load_table(f"{ns}.{ledger.LEDGER_TABLE}").delete(
        f"table_name == '{world.table}' AND run_id == '{run_id}'"
    )
    assert hour(1) not in world.coverage()
    assert ledger.sync_from_history(cat, ns, world.table) == [run_id]
    recovered = world.coverage()[hour(1)]
    assert recovered.run_id == run_id
    assert recovered.records == world.held[hour(1)]

    held = world.held[hour(1)]
    now = _held(world.settings, world.spec.topic, world.published[hour(1)].offsets or {})

    result = _run(world, 1, 1)

    kept = _checks(result)["records_kept"]
    assert kept.metadata["republished_hours"].value == 1, kept.description
    assert "NOT COMPARED" not in (kept.description or "")
    if now < held:  # the cleaner also reached hour 1's records: refused against the count
        assert not result.success and not kept.passed
        assert f"the ledger counted {held} committed records when run {run_id}" in (
            kept.description or ""
        )
    else:
        assert result.success and kept.passed, _step_failure(result)
