"""Derived tables: event-time aggregates equal the generator's truth; the current-state table
equals the last event per key and converges whatever order its windows are backfilled in."""

from __future__ import annotations

import dataclasses
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate, plan_events
from backfill_assets.lake.write import derived
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range
from backfill_assets_tests.support.versions import newest

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


def test_a_window_holding_most_of_the_raw_table_reads_it_whole(
    world: World, spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The share of the raw table a window's Kafka hours hold is read from the table's
    partition metadata (pinned or not); where it reaches ``WHOLE_TABLE_SHARE`` the events
    relation takes every id's winner without narrowing the ids first, and the declared table
    a run writes is the same, every check passed."""
    from pyspark.sql import functions as F

    raw = f"{world.ns}.{world.spec.raw_table}"
    window = (START, START + timedelta(hours=5))
    table = spark_session.table(raw)
    inside = table.where((F.col("kafka_hour") >= window[0]) & (F.col("kafka_hour") < window[1]))
    share = inside.count() / table.count()
    assert 0.0 < share < 1.0
    assert derived.window_share(spark_session, raw, *window) == pytest.approx(share)
    [snapshot] = spark_session.table(f"{raw}.snapshots").orderBy(F.desc("committed_at")).take(1)
    pinned = f"{raw}.snapshot_id_{snapshot['snapshot_id']}"
    assert derived.window_share(spark_session, pinned, *window) == pytest.approx(share)
    before = (START - timedelta(days=30), START - timedelta(days=29))
    assert derived.window_share(spark_session, raw, *before) == 0.0
    view = f"no_metadata_{uuid.uuid4().hex[:8]}"  # a view has no partitions metadata: narrowed
    spark_session.range(3).createOrReplaceTempView(view)
    assert derived.window_share(spark_session, view, *window) == 0.0

    chosen: list[bool] = []
    real = derived.winning_versions

    def spy(*args: Any, whole: bool = False) -> Any:
        chosen.append(whole)
        return real(*args, whole=whole)

    monkeypatch.setattr(derived, "winning_versions", spy)
    monkeypatch.setattr(derived, "_SHARE_FROM", timedelta(0))
    monkeypatch.setattr(derived, "WHOLE_TABLE_SHARE", share)  # this window's share: whole
    derived.release_shared_events()
    result = _run(world, [hourly_table(world.spec)], "2026-04-01-00:00", "2026-04-01-04:00")
    assert result.success, result.all_events
    checks = result.get_asset_check_evaluations()
    assert checks and all(c.passed for c in checks), checks
    assert chosen == [True]
    assert _hourly(spark_session, world) == {
        (hour, cur): (v["events"], v["amount_minor"])
        for hour, by_cur in world.truth.event_hours.items()
        if window[0] <= datetime.fromisoformat(hour) < window[1]
        for cur, v in by_cur.items()
    }


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


@pytest.mark.parametrize("way", ["narrowed", "whole-table"])
def test_current_state_is_last_event_per_key(
    world: World, spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """Every key's latest event or tombstone, the keys and ids narrowed first or (a window
    holding most of the raw table, here all of it) every key's pick taken from the whole."""
    chosen: list[bool] = []
    real = derived._picked

    def spy(*args: Any, whole: bool) -> Any:
        chosen.append(whole)
        return real(*args, whole=whole)

    monkeypatch.setattr(derived, "_picked", spy)
    if way == "whole-table":  # from an 8-hour window on; its share is read from the table
        monkeypatch.setattr(derived, "_SHARE_FROM", timedelta(hours=8))
    result = _run(world, [current_table(world.spec)], "2026-04-01-00:00", "2026-04-01-07:00")
    assert result.success, result.all_events
    assert chosen == [way == "whole-table"]
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
    rows: list[tuple[str | None, datetime | None, datetime, int, int, bool]],
    start: datetime,
    end: datetime,
) -> dict[datetime, set[datetime]]:
    """The definition, row by row: for each row of the window, the event hours of the other
    rows (any Kafka hour) of its event id that differ from its own."""
    live = [r for r in rows if not r[5] and r[1] is not None and r[0] is not None]
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


@pytest.mark.parametrize("collide", [False, True], ids=["hashes", "every-hash-collides"])
def test_other_version_hours_follows_its_definition(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch, collide: bool
) -> None:
    """Versions of ids spread over Kafka hours and event hours (moved corrections, versions in
    one hour, tombstones, missing event times, windows that cut ids in two) give exactly the
    pairs of the row-by-row definition; also with every row a hash candidate (the ids' rows
    are narrowed by 64-bit hashes, and colliding ids dropped by the join that follows)."""
    import random

    from backfill_assets.lake.write.derived import other_version_hours

    if collide:
        monkeypatch.setattr(derived, "_candidates", lambda frame, _values, _column: frame)

    rng = random.Random(7)
    rows: list[tuple[str | None, datetime | None, datetime, int, int, bool]] = []
    base = datetime(2026, 4, 1, tzinfo=UTC)
    for offset in range(600):
        kafka_hour = base + timedelta(hours=rng.randrange(6))
        drift = timedelta(minutes=rng.randrange(-150, 60))
        event = None if rng.random() < 0.03 else kafka_hour + drift
        tombstone = rng.random() < 0.03
        rows.append((f"e{rng.randrange(150)}", event, kafka_hour, offset % 3, offset, tombstone))
    # Rows without an event id (the id column may be nullable) are nobody's other version.
    rows += [
        (None, base + timedelta(hours=h, minutes=90), base + timedelta(hours=h), 0, 600 + h, False)
        for h in range(6)
    ]
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


_RAW_COLUMNS = (
    "event_id string, order_id string, customer_id string, event_type string, status string, "
    "amount_minor bigint, currency string, channel string, event_time timestamp, "
    "kafka_timestamp timestamp, kafka_partition int, kafka_offset bigint, "
    "kafka_hour timestamp, is_tombstone boolean"
)
# 2026-11-01 05:00 and 06:00 UTC are both 01:00 in New York (the session's zone, conftest): a
# Kafka hour collected as a local datetime and sent back as a literal loses one of them.
_FALL_BACK = datetime(2026, 11, 1, tzinfo=UTC)


def _hostile_raw_rows(seed: int) -> list[tuple[Any, ...]]:
    """Raw rows of 12 Kafka hours around New York's fall-back, each key's events within about
    two hours of each other (so the winners of a window's keys sit in its hours and the next):
    ids with versions in several hours (identical re-sends, corrections, some moved to another
    key two hours later), skewed and missing event times, tombstones."""
    import random

    rng = random.Random(seed)
    rows: list[tuple[Any, ...]] = []
    for offset in range(600):
        hour = rng.randrange(12)
        number = hour * 3 + rng.randrange(6)
        key = f"o{number}"
        if rng.random() < 0.08:  # a correction moving the event to a key of its own, later
            key, hour = f"o{number + 100}", min(hour + 2, 11)
        kafka_hour = _FALL_BACK + timedelta(hours=hour)
        kafka_ts = kafka_hour + timedelta(minutes=rng.randrange(60))
        place = (kafka_ts, offset % 3, offset, kafka_hour)
        if rng.random() < 0.04:
            rows.append((None, key, *[None] * 7, *place, True))
            continue
        skew = timedelta(minutes=rng.randrange(-150, 60))
        event = None if rng.random() < 0.03 else kafka_ts + skew
        status = rng.choice(["placed", "paid"]) if rng.random() < 0.3 else "placed"
        event_id = f"e{number}-{rng.randrange(4)}"
        payload = (event_id, key, "c1", "order", status, 100 + number, "EUR", "web", event)
        rows.append((*payload, *place, False))
    return rows


def _rows_without_an_event_id() -> list[tuple[Any, ...]]:
    """Live rows with no event id (the id column may be nullable), the newest of their keys
    and in every window: never a winner, so neither an event nor a key's current row."""
    out = []
    for hour in range(12):
        kafka_ts = _FALL_BACK + timedelta(hours=hour, minutes=59)
        key = f"o{hour * 3}"
        payload = (None, key, "c1", "order", "paid", 999, "EUR", "web", kafka_ts)
        out.append(
            (*payload, kafka_ts, 0, 10_000 + hour, _FALL_BACK + timedelta(hours=hour), False)
        )
    return out


def _winners_by_definition(rows: list[tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """Per event id, the version the version rule picks (support.versions.newest)."""
    by_id: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in rows:
        if not row[13] and row[0] is not None:
            by_id[row[0]].append(row)
    return {eid: newest(versions, _position) for eid, versions in by_id.items()}


def _position(row: tuple[Any, ...]) -> tuple[Any, int, int]:
    return (row[9], row[10], row[11])


def _current_by_definition(
    rows: list[tuple[Any, ...]], start: datetime, end: datetime
) -> dict[str, tuple[int, int] | None]:
    """Per key with a row in Kafka hours [start, end): the position of the latest of the
    winners holding that key and its tombstones (None: no row left)."""
    touched = {row[1] for row in rows if start <= row[12] < end}
    candidates = [*_winners_by_definition(rows).values(), *(r for r in rows if r[13])]
    out: dict[str, tuple[int, int] | None] = {}
    for key in touched:
        mine = [r for r in candidates if r[1] == key]
        latest = newest(mine, _position, first=lambda r: r[8] or r[9]) if mine else None
        out[key] = None if latest is None else (latest[10], latest[11])
    return out


def _events_by_definition(
    rows: list[tuple[Any, ...]], start: datetime, end: datetime
) -> dict[str, tuple[int, int, int]]:
    """Per event id with a version of event time in [start, end) whose winner is there too:
    the winner's position and how many distinct contents its versions have."""
    winners = _winners_by_definition(rows)
    out = {}
    for event_id, win in winners.items():
        if win[8] is None or not start <= win[8] < end:
            continue
        contents = {r[:9] for r in rows if r[0] == event_id and not r[13]}
        out[event_id] = (win[10], win[11], len(contents))
    return out


@pytest.mark.parametrize("way", ["hashes", "every-hash-collides", "whole-table"])
def test_winners_are_read_from_every_kafka_hour_across_a_clock_change(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """The current-state source finds its winners with a narrow scan and reads whole rows only
    from the Kafka hours holding them, the events relation reads every hour: a winner in any
    hour (both 01:00s of New York's fall-back included, a correction moved to another key) is
    still the one picked. Both narrow their rows by 64-bit hashes of the keys and ids and drop
    colliding rows later, not by an exact join: with every hash colliding (every row a
    candidate), the same rows come out; and with the events relation reading the whole table
    (a window holding most of it), too."""
    from pyspark.sql import functions as F

    if way == "every-hash-collides":
        monkeypatch.setattr(derived, "_candidates", lambda frame, _values, _column: frame)
    if way == "whole-table":  # a temporary view has no partition metadata: the share is given
        monkeypatch.setattr(derived, "_SHARE_FROM", timedelta(0))
        monkeypatch.setattr(derived, "window_share", lambda *_args: 1.0)

    rows = _hostile_raw_rows(seed=11) + _rows_without_an_event_id()
    raw, state = f"raw_{uuid.uuid4().hex[:8]}", f"state_{uuid.uuid4().hex[:8]}"
    spark_session.createDataFrame(rows, _RAW_COLUMNS).createOrReplaceTempView(raw)
    spark_session.createDataFrame(
        [], "order_id string, kafka_hour timestamp"
    ).createOrReplaceTempView(state)
    spec = SPECS[0]
    held: set[tuple[int, int]] = set()
    for first, last in ((5, 6), (6, 7), (0, 12), (8, 10)):
        start, end = _FALL_BACK + timedelta(hours=first), _FALL_BACK + timedelta(hours=last)
        source = derived._current_source(
            spark_session, spec, raw, spark_session.table(raw), state, start, end
        )
        got = {
            r["order_id"]: None if r["_gone"] else (r["kafka_partition"], r["kafka_offset"])
            for r in source.collect()
        }
        expected = _current_by_definition(rows, start, end)
        assert got == expected, (first, last)
        held.update(p for p in expected.values() if p is not None)
        events = derived.events_in(spark_session, spec, raw, start, end).select(
            "event_id", "kafka_partition", "kafka_offset", F.col("_versions")
        )
        assert {r[0]: tuple(r[1:]) for r in events.collect()} == _events_by_definition(
            rows, start, end
        ), (first, last)
    hours = {row[12] for row in rows if (row[10], row[11]) in held}
    assert {_FALL_BACK + timedelta(hours=5), _FALL_BACK + timedelta(hours=6)} <= hours
