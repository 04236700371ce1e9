"""Exactness against hostile producers: every table equals the generator's ground truth.

The topic is written the way real systems write (``backfill_assets_tests.support.hostile``):
three producers whose clocks disagree by tens of seconds, transactions of which some abort,
identical re-sends, corrections of an event, tombstones, and two partitions added after four
hours of history. The whole session runs with a non-UTC ``TZ`` (conftest), so nothing here
may depend on the machine's zone.

Raw hours 0-3 are backfilled before the partitions are added, hours 4-7 after, so the second
run chains on the first one's published windows. The expected hour of every committed record
comes from the truth alone (:func:`backfill_assets_tests.support.hostile.hour_of`), never from
the product.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import SPECS
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.offsets.scan import scan
from backfill_assets.lake.offsets.windows import HOUR
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.faults import branch_mutation
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support import hostile
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

START = datetime(2026, 3, 2, tzinfo=UTC)
HOURS = [START + timedelta(hours=i) for i in range(8)]
# Columns a re-run may change: who wrote the row. Everything else must be identical.
RUN_COLUMNS = {"ingest_run_id"}


@dataclasses.dataclass
class World:
    spec: TopicSpec
    settings: Settings
    truth: hostile.HostileTruth
    expected_hour: dict[tuple[int, int], datetime]
    assets: list[dg.AssetsDefinition]
    table: str
    first: dg.ExecuteInProcessResult
    second: dg.ExecuteInProcessResult
    rows: set[tuple[Any, ...]]

    def run(self, keys: list[str], first: datetime, last: datetime) -> dg.ExecuteInProcessResult:
        return _materialize(self.assets, keys, first, last)


def _materialize(
    assets: list[dg.AssetsDefinition], keys: list[str], first: datetime, last: datetime
) -> dg.ExecuteInProcessResult:
    selection = [a for a in assets if a.key.path[-1] in keys or a.key.path[0] in keys]
    return materialize_range(
        selection, None, first, last, raise_on_error=False, selection=[a.key for a in selection]
    )


def _wait_stable(settings: Settings, topic: str) -> None:
    """Transaction markers are written just after commit returns: wait until LSO == HW."""
    kafka = KafkaClient()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(lso == hw for _low, lso, hw in kafka.log_ends(topic).values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"{topic}: a transaction stayed open")


def _table_rows(spark: SparkSession, table: str) -> set[tuple[Any, ...]]:
    """Every row as a tuple of its columns (timestamps as epoch millis), run columns left out."""
    from pyspark.sql import functions as F

    df = spark.table(table)
    cols = []
    for field in df.schema.fields:
        if field.name in RUN_COLUMNS:
            continue
        if field.dataType.typeName() == "timestamp":
            cols.append(F.unix_millis(F.col(field.name)).alias(field.name))
        else:
            cols.append(F.col(field.name))
    rows = df.select(*cols).collect()
    return {tuple(bytes(v) if isinstance(v, bytearray) else v for v in r) for r in rows}


def _failed(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(str(e.event_specific_data) for e in result.all_events if e.is_failure)


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"hostile_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, quarantine_max_ratio=0.0)
    config = hostile.HostileConfig(
        start=START, topic=topic, partitions=3, hours=8, events_per_hour=40, seed=11
    )
    assets = build_topic_assets(spec)
    first_truth = hostile.produce(stack_settings, config, 0, 3)
    _wait_stable(stack_settings, topic)
    first = _materialize(assets, ["raw"], HOURS[0], HOURS[3])
    assert first.success, _failed(first)

    assert hostile.add_partitions(stack_settings, topic, 5) == 5
    second_truth = hostile.produce(stack_settings, config, 4, 7)
    _wait_stable(stack_settings, topic)
    second = _materialize(assets, ["raw"], HOURS[4], HOURS[7])
    assert second.success, _failed(second)

    truth = hostile.merge(first_truth, second_truth)
    # The truth's windows: hours 0-3 from what existed then; hours 4-7 continue each old
    # partition's chain and start the new partitions at offset 0.
    before = hostile.windows(first_truth, HOURS[:4])
    expected = hostile.hour_of(first_truth, HOURS[:4])
    expected.update(
        hostile.hour_of(
            truth,
            HOURS[4:],
            joined_at={3: HOURS[4], 4: HOURS[4]},
            start_offsets={p: before[HOURS[3]][p][1] for p in range(3)},
        )
    )
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    yield World(
        spec,
        stack_settings,
        truth,
        expected,
        assets,
        table,
        first,
        second,
        _table_rows(spark_session, table),
    )


def _published(world: World) -> hostile.HostileTruth:
    """The truth restricted to the records the raw table should hold."""
    return dataclasses.replace(
        world.truth,
        records=tuple(
            r for r in world.truth.records if r.committed and r.position in world.expected_hour
        ),
    )


def test_raw_holds_exactly_the_committed_records_in_their_offset_hours(
    world: World, spark_session: SparkSession
) -> None:
    from pyspark.sql import functions as F

    truth = world.truth
    # The generator was hostile enough for this to mean something.
    assert truth.aborted(), "no aborted transactions were produced"
    skewed = [
        r
        for r in truth.committed()
        if r.position in world.expected_hour
        and hostile.hour_floor(r.timestamp_ms) != world.expected_hour[r.position]
    ]
    assert skewed, "no record sits in an hour other than its timestamp's"
    assert any(p >= 3 for p, _ in world.expected_hour), "the added partitions got no records"

    rows = spark_session.table(world.table).select(
        "kafka_partition",
        "kafka_offset",
        F.unix_millis("kafka_hour").alias("h"),
        F.unix_millis("kafka_timestamp").alias("ts"),
        "record_hash",
    )
    got = {(r[0], r[1]): (r[2], r[3], r[4]) for r in rows.collect()}
    quarantined = spark_session.table(
        f"lake.{world.settings.catalog.namespace}.{world.spec.quarantine_table}"
    ).count()
    assert quarantined == 0
    by_position = truth.by_position()
    want = {
        pos: (
            int(hour.timestamp() * 1000),
            by_position[pos].timestamp_ms,
            hostile.record_hash(*pos, by_position[pos].key, by_position[pos].value),
        )
        for pos, hour in world.expected_hour.items()
    }
    assert set(got) == set(want), (
        f"missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"
    )
    assert got == want
    aborted = {r.position for r in truth.aborted()}
    assert not aborted & set(got)


def test_checks_and_metadata_count_kafka_not_the_written_frame(world: World) -> None:
    by_hour: Counter[str] = Counter(h.isoformat() for h in world.expected_hour.values())
    per_hour: dict[str, Any] = {}
    for result in (world.first, world.second):
        evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
        assert evaluations and all(e.passed for e in evaluations.values())
        value = evaluations["count_reconciliation"].metadata["per_hour"].value
        assert isinstance(value, dict)
        per_hour.update(value)
    assert {h: v["kafka_committed"] for h, v in per_hour.items()} == dict(by_hour)
    assert all(v["rows"] == v["kafka_committed"] for v in per_hour.values())

    # Repeated and conflicting event ids of the first run, from the truth.
    published = _published(world)
    first_hours = set(HOURS[:4])
    contents: dict[str, list[bytes]] = defaultdict(list)
    for r in published.committed():
        if r.value is not None and r.event_id and world.expected_hour[r.position] in first_hours:
            contents[r.event_id].append(r.value)
    meta = world.first.get_asset_materialization_events()[-1].materialization.metadata
    resent = sum(len(v) - 1 for v in contents.values())
    conflicting = sum(1 for v in contents.values() if len(set(v)) > 1)
    assert conflicting > 0, "the first four hours hold no correction"
    run = meta["run"].value
    assert isinstance(run, dict)
    assert run["resent_event_ids"] == resent
    assert run["conflicting_event_ids"] == conflicting


def test_second_run_chains_on_the_first_runs_windows(world: World) -> None:
    cat = catalog.load(world.settings.catalog)
    windows = ledger.published_offsets(cat, world.settings.catalog.namespace, world.table)
    assert sorted(windows) == HOURS
    for prev, hour in itertools.pairwise(HOURS):
        for p, (start, _end) in windows[hour].items():
            assert start == (windows[prev][p][1] if p in windows[prev] else 0), (hour, p)
    assert set(windows[HOURS[3]]) == {0, 1, 2}
    assert set(windows[HOURS[4]]) == {0, 1, 2, 3, 4}
    # Any single hour, or a range before the partitions were added, scanned again with the
    # ledger maps to exactly its published offsets (added partitions empty before they exist).
    kafka = KafkaClient()
    for first, last in [(h, h) for h in HOURS] + [(HOURS[0], HOURS[1]), (HOURS[2], HOURS[3])]:
        again = scan(kafka, world.spec.topic, first, last + HOUR, published=windows)
        for hour in again.hours:
            offsets = again.hour_offsets(hour)
            assert {p: r for p, r in offsets.items() if p in windows[hour]} == windows[hour]
            assert all(r == (0, 0) for p, r in offsets.items() if p not in windows[hour])


def test_sub_range_reruns_give_the_identical_table(
    world: World, spark_session: SparkSession
) -> None:
    # Across the skewed boundaries and the partition addition; then a single hour.
    for first, last in ((HOURS[2], HOURS[5]), (HOURS[6], HOURS[6])):
        result = world.run(["raw"], first, last)
        assert result.success, _failed(result)
        assert _table_rows(spark_session, world.table) == world.rows


def test_derived_tables_equal_the_ground_truth(world: World, spark_session: SparkSession) -> None:
    ns = world.settings.catalog.namespace
    published = _published(world)
    result = world.run([hourly_table(world.spec), current_table(world.spec)], HOURS[0], HOURS[7])
    assert result.success, _failed(result)

    rows = spark_session.sql(
        f"SELECT unix_millis(event_hour) AS h, currency, events, orders, amount_minor, cancelled "
        f"FROM lake.{ns}.{hourly_table(world.spec)}"
    ).collect()
    got = {
        (datetime.fromtimestamp(r["h"] / 1000, UTC), r["currency"]): hostile.HourlyFigures(
            r["events"], r["orders"], r["amount_minor"], r["cancelled"]
        )
        for r in rows
    }
    want = {k: v for k, v in hostile.expected_hourly(published).items() if k[0] in HOURS}
    assert got == want

    current = spark_session.table(f"lake.{ns}.{current_table(world.spec)}")
    state = {
        r["order_id"]: (r["deleted"], r["kafka_partition"], r["kafka_offset"])
        for r in current.collect()
    }
    expected = hostile.expected_current(published)
    assert state == {
        k: (row.deleted, row.record.partition, row.record.offset) for k, row in expected.items()
    }
    assert any(row.deleted for row in expected.values()), "no tombstone decided a key"
    amounts = {r["order_id"]: r["amount_minor"] for r in current.collect() if not r["deleted"]}
    assert amounts == {
        k: row.columns["amount_minor"] for k, row in expected.items() if not row.deleted
    }


def test_disjoint_runs_publish_concurrently_and_overlaps_name_the_run(
    world: World, spark_session: SparkSession
) -> None:
    """Both runs write their branches before either publishes (a barrier in the write path),
    so one always finds main moved. Disjoint windows rebase and publish; overlapping ones
    refuse, naming the run that published first."""

    def race(ranges: list[tuple[datetime, datetime]]) -> list[dg.ExecuteInProcessResult]:
        barrier = threading.Barrier(len(ranges), timeout=300)

        def wait(*_args: Any) -> None:
            barrier.wait()

        results: list[dg.ExecuteInProcessResult | None] = [None] * len(ranges)

        def one(i: int) -> None:
            results[i] = world.run(["raw"], *ranges[i])

        with branch_mutation(wait):
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ranges))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    disjoint = race([(HOURS[0], HOURS[1]), (HOURS[2], HOURS[3])])
    assert all(r.success for r in disjoint), [_failed(r) for r in disjoint]
    branches = [
        r.get_asset_materialization_events()[-1].materialization.metadata["branch"].value
        for r in disjoint
    ]
    assert any(str(b).endswith("_r1") for b in branches), branches  # one rebased
    assert _table_rows(spark_session, world.table) == world.rows

    overlapping = race([(HOURS[0], HOURS[2]), (HOURS[2], HOURS[3])])
    ok = [r for r in overlapping if r.success]
    refused = [r for r in overlapping if not r.success]
    assert len(ok) == 1 and len(refused) == 1
    message = _failed(refused[0])
    assert f"run {ok[0].run_id}" in message and "overlaps this run's window" in message
    assert _table_rows(spark_session, world.table) == world.rows


def test_an_open_transaction_holds_the_hour_until_it_ends(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    """A partition whose next committed record is behind an open transaction cannot seal the
    hour: the run fails retryably, naming the partition and the transaction, and writes
    nothing. Once the transaction commits, the same run publishes, its record included."""
    topic = f"opentxn_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    assets = build_topic_assets(spec)
    config = hostile.HostileConfig(
        start=START, topic=topic, partitions=2, hours=2, events_per_hour=10, seed=3
    )
    truth = hostile.produce(stack_settings, config)
    _wait_stable(stack_settings, topic)
    # Hours 0-1 hold the history (stamped below 02:00:35 at most): hour 2 has no committed
    # record yet, and only the open transaction's record will be in it.
    assert _materialize(assets, ["raw"], HOURS[0], HOURS[1]).success
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    main_before = _main_snapshot(spark_session, table)

    pending = hostile.open_transaction(stack_settings, topic, 0, HOURS[2] + timedelta(minutes=50))
    try:
        held = _materialize(assets, ["raw"], HOURS[2], HOURS[2])
        assert not held.success
        message = _failed(held)
        assert "WindowNotSealed" in message and "partition 0" in message
        assert "a transaction is open" in message and "retry" in message
        assert _main_snapshot(spark_session, table) == main_before
        record = pending.commit()
    except BaseException:
        pending.abort()
        raise
    _wait_stable(stack_settings, topic)
    done = _materialize(assets, ["raw"], HOURS[2], HOURS[2])
    assert done.success, _failed(done)
    rows = {
        (r[0], r[1])
        for r in spark_session.table(table).select("kafka_partition", "kafka_offset").collect()
    }
    committed = {r.position for r in truth.committed()}
    assert record.position in rows
    assert rows - {record.position} <= committed
    assert not {r.position for r in truth.aborted()} & rows


# ---------------------------------------------------------------------------------------------
# Mutation tests: each check must block the fault it exists to catch. A mutation is applied
# to the run's branch right after its write (backfill_assets.stack.faults.branch_mutation).
# ---------------------------------------------------------------------------------------------


def _main_snapshot(spark: SparkSession, table: str) -> int:
    row = spark.sql(f"SELECT snapshot_id FROM {table}.refs WHERE name = 'main'").first()
    assert row is not None
    return int(row[0])


def _one_row(spark: SparkSession, branch: str, hour: datetime) -> DataFrame:
    from pyspark.sql import functions as F

    return (
        spark.table(branch)
        .where(F.unix_millis("kafka_hour") == int(hour.timestamp() * 1000))
        .orderBy("kafka_partition", "kafka_offset")
        .limit(1)
    )


def _drop_a_row(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
    row = _one_row(spark, branch, HOURS[1]).first()
    assert row is not None
    spark.sql(
        f"DELETE FROM {branch} WHERE kafka_partition = {row['kafka_partition']} "
        f"AND kafka_offset = {row['kafka_offset']}"
    )


def _duplicate_an_offset(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
    _one_row(spark, branch, HOURS[1]).writeTo(branch).append()


def _shift_an_hour(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
    later = (HOURS[2]).strftime("%Y-%m-%d %H:%M:%S")
    spark.sql(
        f"UPDATE {branch} SET kafka_hour = to_utc_timestamp('{later}', 'UTC') "
        f"WHERE unix_millis(kafka_hour) = {int(HOURS[1].timestamp() * 1000)}"
    )


def _corrupt_bytes(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
    row = _one_row(spark, branch, HOURS[1]).first()
    assert row is not None
    spark.sql(
        f"UPDATE {branch} SET record_hash = record_hash + 1 "
        f"WHERE kafka_partition = {row['kafka_partition']} "
        f"AND kafka_offset = {row['kafka_offset']}"
    )


def _break_the_contract(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
    """A value the topic's contract does not allow (the parse would have quarantined it)."""
    row = _one_row(spark, branch, HOURS[1]).where("NOT is_tombstone").first()
    assert row is not None
    spark.sql(
        f"UPDATE {branch} SET currency = 'XXX' "
        f"WHERE kafka_partition = {row['kafka_partition']} "
        f"AND kafka_offset = {row['kafka_offset']}"
    )


def _alter_a_typed_value(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
    """What a parse or upcaster bug leaves: a typed value inside the contract that the record's
    bytes do not say (its bytes and record_hash are kept)."""
    row = _one_row(spark, branch, HOURS[1]).where("NOT is_tombstone").first()
    assert row is not None
    spark.sql(
        f"UPDATE {branch} SET amount_minor = amount_minor + 1 "
        f"WHERE kafka_partition = {row['kafka_partition']} "
        f"AND kafka_offset = {row['kafka_offset']}"
    )


def _extra_aborted(world: World) -> Mutation:
    """What a read_uncommitted source would add: an aborted record of hour 1, as a row."""
    from pyspark.sql import functions as F

    windows = hostile.windows(world.truth, HOURS[:4])
    aborted = next(
        r
        for r in world.truth.aborted()
        if r.partition in windows[HOURS[1]]
        and windows[HOURS[1]][r.partition][0] <= r.offset < windows[HOURS[1]][r.partition][1]
    )

    def mutate(spark: SparkSession, branch: str, _q: str, _c: Any) -> None:
        row = _one_row(spark, branch, HOURS[1])
        row.withColumn("kafka_partition", F.lit(aborted.partition)).withColumn(
            "kafka_offset", F.lit(aborted.offset).cast("bigint")
        ).withColumn(
            "record_hash",
            F.lit(
                hostile.record_hash(aborted.partition, aborted.offset, aborted.key, aborted.value)
            ).cast("bigint"),
        ).writeTo(branch).append()

    return mutate


Mutation = Callable[["SparkSession", str, str, Any], None]
# Every fault that changes the rows also changes what the independent decode of the same Kafka
# records expects (decoded_content); corrupted bytes alone do not touch a typed value.
MUTATIONS: dict[str, tuple[Callable[[World], Mutation], set[str]]] = {
    "dropped row": (
        lambda w: _drop_a_row,
        {"count_reconciliation", "checksum", "decoded_content"},
    ),
    "extra aborted record": (
        _extra_aborted,
        {"count_reconciliation", "checksum", "decoded_content"},
    ),
    "window shifted by an hour": (
        lambda w: _shift_an_hour,
        {"count_reconciliation", "checksum", "decoded_content"},
    ),
    "duplicated offset": (
        lambda w: _duplicate_an_offset,
        {"count_reconciliation", "checksum", "uniqueness", "decoded_content"},
    ),
    "corrupted bytes": (lambda w: _corrupt_bytes, {"checksum"}),
    "value outside the contract": (
        lambda w: _break_the_contract,
        {"schema_contract", "decoded_content"},
    ),
    "typed value altered, bytes kept": (lambda w: _alter_a_typed_value, {"decoded_content"}),
}


@pytest.mark.faults
@pytest.mark.parametrize("way", ["small window", "large window"])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_check_blocks_the_fault_it_exists_to_catch(
    world: World,
    spark_session: SparkSession,
    name: str,
    way: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each fault, audited the way a small window is (figures and pandera in the driver
    process) and the way a large one is (Spark's aggregations; the contract as Spark
    expressions)."""
    from backfill_assets.lake.write import checks, schema_contract

    if way == "large window":
        monkeypatch.setattr(checks, "FIGURES_DRIVER_ROWS", 0)
        monkeypatch.setattr(schema_contract, "CONTRACT_DRIVER_ROWS", 0)
    factory, must_fail = MUTATIONS[name]
    main_before = _main_snapshot(spark_session, world.table)
    with branch_mutation(factory(world)):
        result = world.run(["raw"], HOURS[1], HOURS[2])
    assert not result.success
    failed = {e.check_name for e in result.get_asset_check_evaluations() if not e.passed}
    assert failed == must_fail, failed
    assert "blocking" in _failed(result) or failed
    assert _main_snapshot(spark_session, world.table) == main_before
    assert _table_rows(spark_session, world.table) == world.rows


@pytest.mark.slow
def test_the_same_tables_on_a_machine_in_berlin(tmp_path: Any) -> None:
    """Issue 11 reproduced with TZ=Europe/Berlin ("rows on branch 0"): the module's default-tier
    tests again, in a fresh session (own broker, Spark JVM and catalog) in that zone."""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BACKFILL_", "PYICEBERG_")) or k == "BACKFILL_JAR_CACHE"
    }
    env["BACKFILL_TEST_TZ"] = "Europe/Berlin"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-m",
            "not faults and not slow",
            "-p",
            "no:logging",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def hourly_table(spec: TopicSpec) -> str:
    """The shipped spec's event-time aggregate, renamed with the test's topic."""
    return f"{spec.topic}_hourly"


def current_table(spec: TopicSpec) -> str:
    return spec.current_table
