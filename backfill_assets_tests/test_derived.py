"""Derived tables: event-time aggregates equal the generator's truth; the current-state table
equals the last event per key and converges whatever order its windows are backfilled in."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate, plan_events
from backfill_assets.lake import derived
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 4, 1, tzinfo=UTC)
HOURS = 8


@dataclasses.dataclass
class World:
    spec: TopicSpec
    config: GeneratorConfig
    truth: GroundTruth
    ns: str
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]


def _run(world: World, keys: list[str], first: str, last: str) -> dg.ExecuteInProcessResult:
    selection = [a for a in world.assets if a.key.path[-1] in keys or a.key.path[0] in keys]
    return materialize_range(
        selection,
        world.instance,
        first,
        last,
        raise_on_error=False,
        selection=[a.key for a in selection],
    )


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    config = GeneratorConfig(topic=topic, start=START, hours=HOURS, events_per_hour=150, seed=5)
    truth = generate(stack_settings, config)
    with dg.instance_for_test() as instance:
        w = World(
            spec,
            config,
            truth,
            f"lake.{stack_settings.catalog.namespace}",
            instance,
            build_topic_assets(spec),
        )
        raw = _run(w, ["raw"], "2026-04-01-00:00", "2026-04-01-07:00")
        assert raw.success
        yield w


def test_hourly_aggregate_equals_ground_truth(world: World, spark_session: SparkSession) -> None:
    # Event hours 00..04 are complete: their events reached Kafka by hour H + 3 <= 07.
    result = _run(world, [hourly_table(world.spec)], "2026-04-01-00:00", "2026-04-01-04:00")
    assert result.success, result.all_events
    rows = spark_session.table(f"{world.ns}.{hourly_table(world.spec)}").collect()
    got = {
        (r["event_hour"].astimezone(UTC).isoformat(), r["currency"]): (
            r["events"],
            r["amount_minor"],
        )
        for r in rows
    }
    expected = {
        (hour, cur): (v["events"], v["amount_minor"])
        for hour, by_cur in world.truth.event_hours.items()
        if START <= datetime.fromisoformat(hour) < datetime(2026, 4, 1, 5, tzinfo=UTC)
        for cur, v in by_cur.items()
    }
    assert got == expected

    # Re-running an overlapping, shorter range replaces exactly those hours (regression: a
    # day-partitioned table could not overwrite an hour range).
    again = _run(world, [hourly_table(world.spec)], "2026-04-01-02:00", "2026-04-01-03:00")
    assert again.success, again.all_events
    rows = spark_session.table(f"{world.ns}.{hourly_table(world.spec)}").collect()
    assert {
        (r["event_hour"].astimezone(UTC).isoformat(), r["currency"]): (
            r["events"],
            r["amount_minor"],
        )
        for r in rows
    } == expected


def _hourly(spark: SparkSession, world: World) -> dict[tuple[str, str], tuple[int, int]]:
    rows = spark.table(f"{world.ns}.{hourly_table(world.spec)}").collect()
    return {
        (r["event_hour"].astimezone(UTC).isoformat(), r["currency"]): (
            r["events"],
            r["amount_minor"],
        )
        for r in rows
    }


def test_a_runs_declared_tables_build_the_events_relation_once(
    world: World, spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both declared tables of the topic in ONE run read the same pinned snapshot over the same
    hours: the events relation (the winning version of every event id, from the whole raw
    table) is built for the first and reused by the second; other hours build their own."""
    built: list[tuple[datetime, datetime]] = []
    real = derived.events_in

    def counting(*args: Any) -> Any:
        built.append((args[3], args[4]))
        return real(*args)

    monkeypatch.setattr(derived, "events_in", counting)  # counts, then builds the real relation
    derived.release_shared_events()
    tables = [hourly_table(world.spec), f"{world.spec.topic}_large_paid"]
    result = _run(world, tables, "2026-04-01-00:00", "2026-04-01-04:00")
    assert result.success, result.all_events
    checks = result.get_asset_check_evaluations()
    assert checks and all(c.passed for c in checks), checks
    assert built == [(START, START + timedelta(hours=5))]
    assert {
        (hour, cur): (v["events"], v["amount_minor"])
        for hour, by_cur in world.truth.event_hours.items()
        if START <= datetime.fromisoformat(hour) < START + timedelta(hours=5)
        for cur, v in by_cur.items()
    } == _hourly(spark_session, world)

    # Other hours: a relation of their own, again shared by the run's two tables.
    result = _run(world, tables, "2026-04-01-01:00", "2026-04-01-02:00")
    assert result.success, result.all_events
    assert built[1:] == [(START + timedelta(hours=1), START + timedelta(hours=3))]


def _expected_state(config: GeneratorConfig) -> dict[str, tuple[bool, str | None]]:
    """Last valid event or tombstone per order by (event time or Kafka time, offset)."""
    latest: dict[str, tuple[tuple[int, int], bool, str | None]] = {}
    for index, rec in enumerate(plan_events(config)):
        if rec.kind not in ("valid", "tombstone"):
            continue
        ts = rec.event_time_ms if rec.event_time_ms is not None else rec.timestamp_ms
        order = (ts, index)
        prev = latest.get(rec.order_id)
        if prev is None or order > prev[0]:
            # A tombstone clears the payload: the latest record decides the whole row.
            status = rec.status if rec.kind == "valid" else None
            latest[rec.order_id] = (order, rec.kind == "tombstone", status)
    return {k: (deleted, status) for k, (_, deleted, status) in latest.items()}


def _state(spark: SparkSession, world: World) -> dict[str, tuple[bool, str | None]]:
    rows = spark.table(f"{world.ns}.{current_table(world.spec)}").collect()
    return {r["order_id"]: (r["deleted"], r["status"]) for r in rows}


def test_current_state_is_last_event_per_key(world: World, spark_session: SparkSession) -> None:
    result = _run(world, [current_table(world.spec)], "2026-04-01-00:00", "2026-04-01-07:00")
    assert result.success, result.all_events
    state = _state(spark_session, world)
    expected = _expected_state(world.config)
    assert state == expected
    assert any(deleted for deleted, _ in state.values()), "demo data has deletions"


def test_current_state_converges_out_of_order(world: World, spark_session: SparkSession) -> None:
    table = f"{world.ns}.{current_table(world.spec)}"
    spark_session.sql(f"DROP TABLE IF EXISTS {table} PURGE")
    # Later hours first, then an overlapping earlier range, then the middle again.
    for first, last in [("05:00", "07:00"), ("00:00", "05:00"), ("02:00", "03:00")]:
        result = _run(
            world, [current_table(world.spec)], f"2026-04-01-{first}", f"2026-04-01-{last}"
        )
        assert result.success, result.all_events
    assert _state(spark_session, world) == _expected_state(world.config)


def hourly_table(spec: TopicSpec) -> str:
    """The shipped spec's event-time aggregate, renamed with the test's topic."""
    return f"{spec.topic}_hourly"


def current_table(spec: TopicSpec) -> str:
    return spec.current_table


def _other_version_hours_by_definition(
    rows: list[tuple[str, datetime | None, datetime, int, int, bool]],
    start: datetime,
    end: datetime,
) -> dict[datetime, set[datetime]]:
    """The definition, row by row: for each row of the window, the event hours of the other
    rows (any Kafka hour) of its event id that differ from its own."""
    live = [r for r in rows if not r[5] and r[1] is not None]
    out: dict[datetime, set[datetime]] = {}
    for key, event, kafka_hour, partition, offset, _ in live:
        if not start <= kafka_hour < end:
            continue
        assert event is not None
        own = event.replace(minute=0, second=0, microsecond=0)
        for k2, e2, _, p2, o2, _ in live:
            assert e2 is not None
            other = e2.replace(minute=0, second=0, microsecond=0)
            if k2 == key and (p2, o2) != (partition, offset) and other != own:
                out.setdefault(kafka_hour, set()).add(other)
    return out


def test_other_version_hours_follows_its_definition(spark_session: SparkSession) -> None:
    """Versions of ids spread over Kafka hours and event hours (moved corrections, versions in
    one hour, tombstones, missing event times, windows that cut ids in two) give exactly the
    pairs of the row-by-row definition."""
    import random

    from backfill_assets.lake.derived import other_version_hours

    rng = random.Random(7)
    rows: list[tuple[str, datetime | None, datetime, int, int, bool]] = []
    base = datetime(2026, 4, 1, tzinfo=UTC)
    for offset in range(600):
        kafka_hour = base + timedelta(hours=rng.randrange(6))
        drift = timedelta(minutes=rng.randrange(-150, 60))
        event = None if rng.random() < 0.03 else kafka_hour + drift
        tombstone = rng.random() < 0.03
        rows.append((f"e{rng.randrange(150)}", event, kafka_hour, offset % 3, offset, tombstone))
    view = f"versions_{uuid.uuid4().hex[:8]}"
    spark_session.createDataFrame(
        rows,
        "event_id string, event_time timestamp, kafka_hour timestamp, "
        "kafka_partition int, kafka_offset long, is_tombstone boolean",
    ).createOrReplaceTempView(view)
    spec = SPECS[0]
    for first, last in ((0, 6), (2, 3), (5, 6)):
        start, end = base + timedelta(hours=first), base + timedelta(hours=last)
        expected = _other_version_hours_by_definition(rows, start, end)
        assert expected, "the generated versions must move some events"
        assert other_version_hours(spark_session, spec, view, start, end) == expected
