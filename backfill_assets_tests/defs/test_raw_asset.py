"""A backfill is an exact, idempotent, audited partition-range materialization.

Real broker, real Spark, real catalog, real Dagster instance. Each test module generates its own
topic (a copy of the orders spec under a unique name), so tables never collide.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, TopicPartition

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import (
    GeneratorConfig,
    GroundTruth,
    generate,
    hour_iso,
    plan_events,
)
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 3, 1, tzinfo=UTC)
RANGE = ("2026-03-01-01:00", "2026-03-01-04:00")  # four hours, inclusive
HOURS = [datetime(2026, 3, 1, h, tzinfo=UTC).isoformat() for h in range(1, 5)]
# The generator's malformed kinds and the quarantine reasons the replay gives them.
REASONS = {
    "invalid_json": "invalid_json",
    "missing_event_time": "missing_or_invalid:event_time",
    "wrong_type": "missing_or_invalid:amount_minor",
    "unknown_schema_version": "unknown_schema_version:9",
}


@dataclasses.dataclass
class World:
    spec: TopicSpec
    truth: GroundTruth
    table: str
    instance: dg.DagsterInstance


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=200, seed=11),
    )
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    with dg.instance_for_test() as instance:
        yield World(spec, truth, table, instance)


def _backfill(world: World, spec: TopicSpec | None = None) -> dg.ExecuteInProcessResult:
    asset = build_raw_asset(spec or world.spec)
    return materialize_range([asset], world.instance, *RANGE, raise_on_error=False)


def _main_summary(spark: SparkSession, table: str) -> dict[str, str]:
    row = spark.sql(
        f"SELECT s.summary FROM {table}.snapshots s JOIN {table}.refs r "
        "ON s.snapshot_id = r.snapshot_id WHERE r.name = 'main'"
    ).first()
    assert row is not None
    return dict(row[0])


def _main_checksum(spark: SparkSession, world: World) -> tuple[int, Any]:
    from backfill_assets.lake.write.replay import checksum_expr

    df = spark.table(world.table)
    return df.count(), df.agg(checksum_expr(world.spec)).first()[0]  # type: ignore[index]


def _live_group_offsets(settings: Settings, topic: str, group: str) -> list[tuple[int, int]]:
    consumer = Consumer({**settings.kafka.client_config(), "group.id": group})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in range(6)], timeout=15)
        return sorted((tp.partition, tp.offset) for tp in committed)
    finally:
        consumer.close()


def test_backfill_matches_ground_truth_and_publishes(
    world: World, stack_settings: Settings, spark_session: SparkSession
) -> None:
    # A live consumer group with committed progress, which the backfill must not move.
    group = f"live-{uuid.uuid4().hex[:6]}"
    live = Consumer(
        {
            **stack_settings.kafka.client_config(),
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    live.assign([TopicPartition(world.spec.topic, p, 0) for p in range(6)])
    got = 0
    while got < 300:
        msg = live.poll(5)
        assert msg is not None, "live consumer got no records"
        got += 1
    live.commit(asynchronous=False)
    live.close()
    before = _live_group_offsets(stack_settings, world.spec.topic, group)

    result = _backfill(world)
    assert result.success, result.all_events

    mats = [e.materialization for e in result.get_asset_materialization_events()]
    assert sorted(m.partition for m in mats if m.partition) == [
        f"2026-03-01-0{h}:00" for h in range(1, 5)
    ], "one materialization per partition of the range"
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == dict.fromkeys(checks, True) and len(checks) == 7

    meta = mats[-1].metadata
    # The raw table is the committed log: every well-formed record is a row, producer re-sends
    # included (derived tables apply the duplicates rule). Hours are read as epoch millis.
    per_hour_rows = spark_session.sql(
        f"SELECT unix_millis(kafka_hour) h, count(*) n FROM {world.table} GROUP BY 1"
    ).collect()
    written = {
        datetime.fromtimestamp(r["h"] / 1000, UTC).isoformat(): r["n"] for r in per_hour_rows
    }
    for hour in HOURS:
        truth = world.truth.kafka_hours[hour]
        assert written[hour] == truth["valid"] + truth["tombstones"] + truth["duplicates"], hour
    totals = {
        k: sum(world.truth.kafka_hours[h][k] for h in HOURS)
        for k in ("records", "duplicates", "malformed")
    }
    run = meta["run"].value
    assert isinstance(run, dict)
    assert run["records_read"] == totals["records"]
    assert run["resent_event_ids"] == totals["duplicates"]
    assert run["quarantined"] == totals["malformed"]
    # Each partition carries its own hour's figures, never the run's totals.
    own = {}
    for m in mats:
        assert m.partition is not None
        start = datetime.strptime(str(m.partition), "%Y-%m-%d-%H:%M").replace(tzinfo=UTC)
        truth = world.truth.kafka_hours[start.isoformat()]
        own[m.partition] = (
            m.metadata["records_read"].value,
            m.metadata["dagster/partition_row_count"].value,
            m.metadata["quarantined"].value,
        )
        assert own[m.partition] == (
            truth["records"],
            truth["valid"] + truth["tombstones"] + truth["duplicates"],
            truth["malformed"],
        ), m.partition
        # The table's total rows on main after the publish.
        assert m.metadata["dagster/row_count"].value == sum(written.values())
        # Nothing keyed by the run's hours repeats on each partition (count_reconciliation
        # holds the run's per-hour figures): a run's events grow with its hours, not squared.
        maps = [v.value for v in m.metadata.values() if isinstance(v.value, dict)]
        assert not [k for value in maps for k in value if k in HOURS], m.partition
    assert len(set(own.values())) > 1, "per-partition figures must differ between hours"
    # The checks audit this run's materialization, not the one before it.
    for evaluation in result.get_asset_check_evaluations():
        target = evaluation.target_materialization_data
        assert target is not None and target.run_id == result.run_id, evaluation.check_name
    # The run observed its Kafka topic (the asset upstream of the raw table).
    observed = [
        e.asset_observation_data.asset_observation
        for e in result.all_events
        if e.event_type_value == "ASSET_OBSERVATION"
    ]
    topic = [o for o in observed if o.asset_key == dg.AssetKey(["kafka", world.spec.topic])]
    assert topic and topic[0].metadata["partitions"].value == 6
    assert topic[0].metadata["records_retained"].value == sum(world.truth.end_offsets().values())
    quarantined = spark_session.table(
        f"lake.{stack_settings.catalog.namespace}.{world.spec.quarantine_table}"
    ).count()
    assert quarantined == totals["malformed"]

    # Per hour, the audit's figures equal the generator's truth.
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    per_hour: dict[str, Any] = evaluations["count_reconciliation"].metadata["per_hour"].value  # type: ignore[assignment]
    for hour in HOURS:
        truth = world.truth.kafka_hours[hour]
        assert per_hour[hour] == {
            "kafka_committed": truth["records"],
            "rows": truth["valid"] + truth["tombstones"] + truth["duplicates"],
            "quarantined": truth["malformed"],
        }, hour
    # Every malformed record is quarantined with the reason the generator planted.
    planted = Counter(
        REASONS[str(r.malformed_reason)]
        for r in plan_events(world.truth.generator_config())
        if r.kind == "malformed" and hour_iso(r.timestamp_ms) in HOURS
    )
    reasons = evaluations["quarantine_ratio"].metadata["reasons"].value
    assert reasons == dict(planted)

    summary = _main_summary(spark_session, world.table)
    assert summary["backfill.run-id"] == result.run_id
    offsets = json.loads(summary["backfill.offsets"])
    for p in range(6):
        first = world.truth.hour_offsets[p][HOURS[0]][0]
        last = world.truth.hour_offsets[p][HOURS[-1]][1]
        assert offsets[str(p)] == [first, last]
    assert json.loads(summary["backfill.checks"]) == dict.fromkeys(checks, "passed")

    assert _live_group_offsets(stack_settings, world.spec.topic, group) == before


def test_rerun_changes_nothing(world: World, spark_session: SparkSession) -> None:
    if spark_session.catalog.tableExists(world.table) is False:
        assert _backfill(world).success
    before = _main_checksum(spark_session, world)
    result = _backfill(world)
    assert result.success
    assert _main_checksum(spark_session, world) == before
    dup = spark_session.sql(
        f"SELECT count(*) - count(DISTINCT kafka_partition, kafka_offset) FROM {world.table}"
    ).first()
    assert dup is not None and dup[0] == 0, "a re-run must not add a second row for an offset"


def test_failed_check_leaves_main_untouched(world: World, spark_session: SparkSession) -> None:
    if spark_session.catalog.tableExists(world.table) is False:
        assert _backfill(world).success
    main_before = spark_session.sql(
        f"SELECT snapshot_id FROM {world.table}.refs WHERE name = 'main'"
    ).first()
    strict = world.spec.model_copy(update={"quarantine_max_ratio": 0.0})
    result = _backfill(world, strict)
    assert not result.success
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert evaluations["quarantine_ratio"].passed is False
    assert evaluations["count_reconciliation"].passed is True
    main_after = spark_session.sql(
        f"SELECT snapshot_id FROM {world.table}.refs WHERE name = 'main'"
    ).first()
    assert main_after == main_before
    branches = {
        r["name"] for r in spark_session.sql(f"SELECT name FROM {world.table}.refs").collect()
    }
    assert f"audit_{result.run_id.replace('-', '_')}" in branches, "failed branch is kept"


def test_any_failure_is_audited(world: World, stack_settings: Settings) -> None:
    from backfill_assets.lake.write import audit
    from backfill_assets.stack import catalog

    missing = world.spec.model_copy(update={"topic": f"missing_{uuid.uuid4().hex[:6]}"})
    result = _backfill(world, missing)
    assert not result.success
    rows = audit.query(
        catalog.load(stack_settings.catalog),
        stack_settings.catalog.namespace,
        run_id=result.run_id,
    )
    assert [r["event"] for r in rows] == ["run_failed"]
    assert missing.topic in rows[0]["detail"] and "does not exist" in rows[0]["detail"]


def test_throttled_replay_is_identical_and_slower(
    world: World, spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    if spark_session.catalog.tableExists(world.table) is False:
        assert _backfill(world).success
    before = _main_checksum(spark_session, world)
    cap = 300
    monkeypatch.setenv("BACKFILL_REPLAY_MAX_RECORDS_PER_S", str(cap))
    result = _backfill(world)
    assert result.success
    meta = result.get_asset_materialization_events()[0].materialization.metadata
    run = meta["run"].value
    assert isinstance(run, dict)
    records = run["records_read"]
    assert isinstance(records, int) and records > 0
    duration = run["duration_s"]
    assert isinstance(duration, float) and duration >= records / cap
    assert _main_checksum(spark_session, world) == before


def test_each_record_is_parsed_once(spark_session: SparkSession) -> None:
    """The parse's plan holds one JSON parse per record, by the strict JVM reader: the quarantine
    reason and the typed columns read its result, they do not re-parse it (a plan that inlines
    the stages parses the JSON once per field and per rule, tens of times), and the VARIANT
    parse no upcaster reads is pruned."""
    from backfill_assets.lake.decode.parse import parse

    spec = next(s for s in SPECS if s.topic == "orders")
    hour = datetime(2026, 7, 1, tzinfo=UTC)
    values = [b'{"event_id": "e"}', b"not json", None, b"[1]", b'{"a": 1} {"b": 2}']
    source = spark_session.createDataFrame(
        [("orders", 0, i, hour, hour, i, b"k", v) for i, v in enumerate(values)],
        "topic string, partition int, offset long, timestamp timestamp, kafka_hour timestamp, "
        "record_hash long, key binary, value binary",
    )
    rows, quarantine, parsed = parse(spec, source, "run")
    try:
        assert (parsed.count(), rows.count(), quarantine.count()) == (5, 1, 4)
        for frame in (parsed, rows, quarantine):
            plan = frame._jdf.queryExecution().executedPlan().toString()
            assert plan.count("backfill_strict_json_") == 1, plan
            assert "parseJson" not in plan, plan
    finally:
        parsed.unpersist()
