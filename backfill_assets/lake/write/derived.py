"""Derived lakehouse tables, computed in Spark from the published raw table: each topic's
current state, and the tables declared in the spec (:mod:`backfill_assets.spec.declared`).

**The version rule** (:func:`newest`; it does not depend on where runs start or end, nor on
producer clocks within a partition): the raw table keeps every committed record. Among the
versions of one event id, within one Kafka partition the later offset wins (the log's order,
whatever the Kafka timestamps say); across partitions, which share no order, the partitions'
latest versions compare by Kafka timestamp, then partition number. Identical re-sends collapse
into the winner, and an id whose versions differ in content is a *conflict*, counted in the
run's metadata. A declared table's SQL sees only winners, as the relation named after the
topic.

* A **declared table** is event-time partitioned: a run of hours ``[start, end)`` runs its SQL
  with those bounds over the topic's winning events (of ids with a version in
  ``[start - lookback, end)``), other topics' current state and other declared tables as main
  holds them, and overwrites exactly those hours on a run branch. Its hour H is expected to read
  Kafka hours H - lookback .. H + lateness (the partition mapping); the late-data sensor re-runs
  H when records arrive even later. Each relation is read at one snapshot of its table's main,
  pinned when the run starts, and the run's publish records which (its lineage: an input
  publish it did not read makes the hour stale, whatever the clocks say).
* ``<topic>_current``: per key, the latest of the winning events and the tombstones by the
  spec's ``order_by`` (Kafka time for tombstones); among those tied on it, the version rule
  above (later offset within a partition, then Kafka time, partition); an event
  matching ``deleted_when`` or a tombstone leaves the key with ``deleted = true``. A run of
  Kafka hours W recomputes every key with a raw row in W or whose current row came from W,
  from all of main's raw rows, so re-publishing or rolling back raw hours and re-running
  converges; a key with no raw row left is removed.

Each is written on a run branch and published through :mod:`backfill_assets.lake.write.wap`; each
build
function returns the branch and the audit outcomes it computed on that branch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.write import checks
from backfill_assets.lake.write.checks import CheckOutcome
from backfill_assets.lake.write.schema_contract import (
    contract_failures,
    contract_schema,
    contract_violations,
)
from backfill_assets.lake.write.tables import add_columns, has_columns, spark_type
from backfill_assets.lake.write.wap import (
    Branch,
    hour_writer,
    iceberg_table,
    open_branch,
    ref_snapshot,
)
from backfill_assets.spec import declared
from backfill_assets.spec.model import (
    EVENT_META_COLUMNS,
    SPARK_TYPES,
    ColumnSpec,
    TableSpec,
    TopicSpec,
)
from backfill_assets.stack import fetch

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

CURRENT_CHECKS = ("uniqueness", "source_applied", "schema_contract")


def declared_checks(table: TableSpec) -> tuple[str, ...]:
    """The blocking checks of a declared table (reconciliation only if it declares measures)."""
    return ("schema_contract", "uniqueness", *(("reconciliation",) if table.measures else ()))


# What each check of a declared or current-state table asserts (the asset check descriptions).
DESCRIPTIONS = {
    "schema_contract": (
        "Every row on the run's branch satisfies the declared columns' pandera contract (types, "
        "nullability, allowed values, ranges), and no row falls outside the run's window."
    ),
    "uniqueness": "No grain value (the declared grain, or the key) appears twice.",
    "reconciliation": (
        "Each declared measure aggregated over the table's window equals the same measure over "
        "its source relation's window."
    ),
    "source_applied": (
        "Every key the window touched holds its latest raw record, and keys whose last record "
        "is a delete are gone."
    ),
}


@dataclass
class DerivedOutcome:
    branch: Branch
    checks: list[CheckOutcome]
    metadata: dict[str, Any] = field(default_factory=dict)
    # Per partition hour (ISO-8601, UTC): that hour's own figures; "rows" is its row count.
    per_hour: dict[str, dict[str, int]] = field(default_factory=dict)
    # Input table -> (snapshot id, sequence number) of the main it read (declared tables, and
    # the current state: the raw table).
    reads: dict[str, tuple[int, int]] = field(default_factory=dict)


def rows_per_hour(frame: DataFrame, column: str, start: datetime, end: datetime) -> dict[str, int]:
    """Rows of ``frame`` per hour of timestamp ``column`` in ``[start, end)``, keyed by the
    hour's ISO-8601 UTC start (collected as epoch millis: never a local-zone datetime)."""
    counts = fetch.rows(_hour_counts(frame, column, start, end))
    return {_hour_key(r["h"]): int(r["count"]) for r in counts}


def _hour_counts(frame: DataFrame, column: str, start: datetime, end: datetime) -> DataFrame:
    """:func:`rows_per_hour` as a frame: per hour of ``column`` in ``[start, end)``, its start
    in epoch millis (``h``) and its rows (``count``)."""
    from pyspark.sql import functions as F

    ts = F.col(column)
    hour_ms = F.unix_millis(F.date_trunc("hour", ts)).alias("h")
    return frame.where((ts >= _ts(start)) & (ts < _ts(end))).groupBy(hour_ms).count()


def _hour_key(millis: int) -> str:
    """An hour's ISO-8601 UTC start from its epoch millis."""
    return datetime.fromtimestamp(millis / 1000, UTC).isoformat()


def current_table(spec: TopicSpec) -> str:
    return spec.current_table


def _ts(value: datetime) -> Column:
    """A UTC timestamp literal. Aware on purpose: PySpark reads a naive datetime in the
    machine's local zone."""
    from pyspark.sql import functions as F

    return F.lit(value.astimezone(UTC))


# A raw row's place in the raw table: its Kafka hour (the table's partition) and position.
_POSITION = ("kafka_hour", "kafka_partition", "kafka_offset")


def _hours_of(frame: DataFrame) -> Column:
    """A filter on ``kafka_hour`` to the Kafka hours ``frame`` holds, as timestamp literals
    Iceberg prunes the raw table's files by (collected as epoch millis: never a local-zone
    datetime)."""
    from pyspark.sql import functions as F

    hours = fetch.rows(frame.select(F.unix_millis("kafka_hour").alias("h")).distinct())
    return F.col("kafka_hour").isin(
        [_ts(datetime.fromtimestamp(row["h"] / 1000, UTC)) for row in hours]
    )


def winning_versions(
    spark: SparkSession, spec: TopicSpec, raw_table: str, in_window: Column, *, whole: bool = False
) -> DataFrame:
    """The winning version of every event id with some version where ``in_window`` holds
    (and possibly of a few others: keep the winners where it holds), from all of the raw
    table's rows, with ``_versions`` (distinct contents) per id.

    The ids' versions are found in one pass over the raw rows: a broadcast set of the ids'
    64-bit hashes keeps every version of each id, and the rare rows of another id whose hash
    collides. Those add only winners outside the window: a winner inside it is a version
    inside it. No join with the ids themselves: that shuffle of every candidate row cost ~20%
    of a month's relation (bench/HISTORY.md, twentieth pass). Rows without an event id never
    win.

    (A narrow scan for the versions' Kafka hours, then those hours read whole, was measured and
    not kept: no faster at 7 days of the 30-day north star, bench/README tenth pass.)

    ``whole``: the winner of every id of the table, without narrowing (cheaper when the window
    holds most of the table's rows: the narrowing reads the table twice to keep nearly all of
    it; see :func:`events_in`)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    key = spec.event_id_field
    events = spark.table(raw_table).where(~F.col("is_tombstone") & F.col(key).isNotNull())
    versions = events if whole else _candidates(events, events.where(in_window).select(key), key)
    content = F.xxhash64(*[F.col(c.name) for c in spec.columns])
    every = Window.partitionBy(key)
    counted = versions.withColumn("_versions", F.size(F.collect_set(content).over(every)))
    return newest(counted, key)


def newest(frame: DataFrame, by: str, first: Column | None = None) -> DataFrame:
    """Per value of ``by``, the one row the version rule picks: the largest ``first`` (an event
    field the spec orders by; null-safe, nulls lose); among rows tied on it, within one Kafka
    partition the later offset, whatever the producers' clocks stamped; across partitions the
    later Kafka timestamp of each partition's pick, then the higher partition.

    Every window is partitioned by ``by`` alone, so Spark shuffles once."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    rows = frame
    if first is not None:
        rows = (
            rows.withColumn("_first", first)
            .withColumn("_top", F.max("_first").over(Window.partitionBy(by)))
            .where(F.col("_first").eqNullSafe(F.col("_top")) | F.col("_top").isNull())
            .drop("_top")
        )
    log = Window.partitionBy(by).orderBy("kafka_partition", "kafka_offset")
    newest_first = Window.partitionBy(by).orderBy(
        F.col("kafka_timestamp").desc(), F.col("kafka_partition").desc()
    )
    nxt = F.lead("kafka_partition").over(log)
    return (
        rows.withColumn("_next_partition", nxt)
        # The last row of its Kafka partition (for this value of ``by``): the log's newest.
        .where(
            F.col("_next_partition").isNull()
            | (F.col("_next_partition") != F.col("kafka_partition"))
        )
        .withColumn("_n", F.row_number().over(newest_first))
        .where(F.col("_n") == 1)
        .drop("_n", "_next_partition", *(["_first"] if first is not None else []))
    )


def other_version_hours(
    spark: SparkSession, spec: TopicSpec, table: str, start: datetime, end: datetime
) -> dict[datetime, set[datetime]]:
    """Per Kafka hour in ``[start, end)`` of raw ``table`` (main or a run's branch): the
    event-time hours of the other versions (any Kafka hour) of its rows' event ids, where they
    differ from the row's own: a correction that moves an event changes the hour of the version
    it supersedes as well as its own, so the publish records both."""
    from pyspark.sql import functions as F

    key, event = spec.event_id_field, F.col(spec.event_time_field)
    rows = spark.table(table).where(~F.col("is_tombstone") & event.isNotNull())
    hours = (F.col("kafka_hour") >= _ts(start)) & (F.col("kafka_hour") < _ts(end))
    mine = rows.where(hours).select(
        key,
        F.col("kafka_hour").alias("_k"),
        F.date_trunc("hour", event).alias("_own"),
        F.col("kafka_partition").alias("_p"),
        F.col("kafka_offset").alias("_o"),
    )
    # Hash candidates: the join with ``mine`` on the id drops a colliding id's rows.
    others = _candidates(rows, mine.select(key), key).select(
        key, F.date_trunc("hour", event).alias("_e"), "kafka_partition", "kafka_offset"
    )
    pairs = fetch.rows(
        mine.join(others, key)
        .where(
            (F.col("_e") != F.col("_own"))
            & ((F.col("_p") != F.col("kafka_partition")) | (F.col("_o") != F.col("kafka_offset")))
        )
        .select(F.unix_millis("_k").alias("k"), F.unix_millis("_e").alias("e"))
        .distinct()
    )
    out: dict[datetime, set[datetime]] = {}
    for row in pairs:
        kafka_hour = datetime.fromtimestamp(row["k"] / 1000, UTC)
        out.setdefault(kafka_hour, set()).add(datetime.fromtimestamp(row["e"] / 1000, UTC))
    return out


def events_in(
    spark: SparkSession, spec: TopicSpec, raw_table: str, start: datetime, end: datetime
) -> DataFrame:
    """The winning versions whose event time is in ``[start, end)``, with the topic's columns
    and the Kafka position columns: the relation a declared table's SQL reads as the topic.

    Where the window's Kafka hours hold at least :data:`WHOLE_TABLE_SHARE` of the raw table's
    rows (a backfill of most of the table), every id's winner is computed and the window kept,
    rather than narrowing the ids first; both give the same rows."""
    from pyspark.sql import functions as F

    event_time = F.col(spec.event_time_field)
    in_window = (event_time >= _ts(start)) & (event_time < _ts(end))
    whole = _mostly(spark, raw_table, start, end)
    # Every id with some version in the window, then each id's winner (whose event time may
    # have been corrected out of the window, or into it from another id's hour).
    return (
        winning_versions(spark, spec, raw_table, in_window, whole=whole)
        .where(in_window)
        .select(*[c.name for c in spec.columns], *[c for c, _ in EVENT_META_COLUMNS], "_versions")
    )


# From this share of the raw table's rows in a window's Kafka hours, the events relation and
# the current state read the whole table rather than narrowing their ids and keys first
# (bench/HISTORY.md, twenty-first pass).
WHOLE_TABLE_SHARE = 0.5
# Shorter windows are narrowed without asking (the metadata query costs ~0.3 s; a table whose
# window of a few hours is most of it is small, and either way is cheap).
_SHARE_FROM = timedelta(hours=24)


def _mostly(spark: SparkSession, raw_table: str, start: datetime, end: datetime) -> bool:
    """Whether ``[start, end)`` holds most of the raw table (read it whole, not narrowed)."""
    return end - start >= _SHARE_FROM and (
        window_share(spark, raw_table, start, end) >= WHOLE_TABLE_SHARE
    )


def window_share(spark: SparkSession, raw_table: str, start: datetime, end: datetime) -> float:
    """The share of the raw table's rows whose Kafka hour is in ``[start, end)``, from its
    partitions' metadata (no data file read; the current snapshot's, an estimate for a pinned
    one); 0.0 for an empty table or one without that metadata. Only an estimate: both ways of
    reading give the same rows."""
    from pyspark.sql import functions as F

    table = raw_table.split(".snapshot_id_", 1)[0]
    hour = F.col("partition.kafka_hour_hour")
    first, last = (int(t.timestamp()) // 3600 for t in (start, end))
    inside = F.when((hour >= first) & (hour < last), F.col("record_count"))
    try:
        row = (
            spark.table(f"{table}.partitions")
            .agg(F.sum("record_count").alias("rows"), F.sum(inside).alias("inside"))
            .first()
        )
    except Exception:  # no such metadata (not an hour-partitioned Iceberg table): narrow it
        return 0.0
    if row is None or not row["rows"]:
        return 0.0
    return float(row["inside"] or 0) / float(row["rows"])


@dataclass
class Sources:
    """How a run finds what a declared table reads: topic specs by name and full table names."""

    specs: dict[str, TopicSpec]
    table_name: Callable[[str], str]  # a short table name -> the catalog's full name


def _input_table(rel: declared.Relation, sources: Sources) -> str:
    """The catalog's full name of the table a relation is read from."""
    if rel.kind == "events":
        return sources.table_name(sources.specs[rel.topic].raw_table)
    return sources.table_name(rel.name)


def pin_inputs(
    spark: SparkSession, table: TableSpec, sources: Sources, known: dict[str, declared.Relation]
) -> tuple[dict[str, str], dict[str, tuple[int, int]]]:
    """Per relation ``table`` reads, the Spark identifier of its table at main's current
    snapshot (``<table>.snapshot_id_<id>``), so everything the run reads comes from one known
    publish of each input; and input table -> (snapshot id, sequence number) read. A table
    that does not exist (or has no snapshot) yet is read by its name and not recorded."""
    idents: dict[str, str] = {}
    reads: dict[str, tuple[int, int]] = {}
    for ref in table.refs:
        name = _input_table(known[ref], sources)
        pin = ref_snapshot(spark, name, "main")
        if pin is None:
            idents[ref] = name
            continue
        idents[ref] = f"{name}.snapshot_id_{pin[0]}"
        reads[name] = pin
    return idents, reads


def _relation(
    spark: SparkSession,
    name: str,
    sources: Sources,
    known: dict[str, declared.Relation],
    start: datetime,
    end: datetime,
    idents: dict[str, str],
) -> DataFrame:
    rel = known[name]
    if rel.kind == "events":
        return events_in(spark, sources.specs[rel.topic], idents[name], start, end)
    return spark.table(idents[name])


def build_declared(
    spark: SparkSession,
    table: TableSpec,
    sources: Sources,
    start: datetime,
    end: datetime,
    run_id: str,
    attempt: int = 0,
) -> DerivedOutcome:
    """Recompute event-time hours ``[start, end)`` of a declared table onto a run branch: its
    SQL over the relations it reads (registered as temporary views under their spec names),
    one atomic overwrite of those hours on the branch, then the checks on the branch."""
    full = sources.table_name(table.name)
    known = declared.relations(list(sources.specs.values()))
    _ensure_declared_table(spark, full, table)
    lookback = timedelta(hours=table.lookback_hours)
    idents, reads = pin_inputs(spark, table, sources, known)
    inputs = _Inputs(sources, known, idents)
    views: list[str] = []
    persisted: list[DataFrame] = []
    try:
        frames, conflicts = _register_relations(
            spark, table, inputs, start - lookback, end, views, persisted
        )
        result, window, outside = _declared_result(spark, table, start, end, persisted)
        source_figures = _source_figures(spark, table, inputs, frames, start, end)
        branch = open_branch(spark, full, run_id, attempt)
        hour_writer(result.where(window), branch.ident).overwrite(window)
    finally:
        for view in views:
            spark.catalog.dropTempView(view)
        for frame in persisted:
            frame.unpersist()
    written = _check_written(spark, table, branch, window, start, end)
    contract = _with_outside(written.contract, outside, start, end, table)
    outcomes = [
        contract,
        CheckOutcome(
            "uniqueness",
            written.repeated == 0,
            f"{written.repeated} grain value(s) ({', '.join(table.grain)}) appear more than once",
            {
                "rows": written.rows,
                "repeated_grain_values": written.repeated,
                "grain": list(table.grain),
            },
        ),
    ]
    if table.measures:
        outcomes.append(_reconciliation(table, written.figures, source_figures))
    return DerivedOutcome(
        branch,
        outcomes,
        {
            "rows": written.rows,
            "event_time_window": f"{start.isoformat()}/{end.isoformat()}",
            "reads": list(table.refs),
            "conflicting_event_ids": conflicts,
            **{f"measure/{k}": v for k, v in written.figures.items()},
        },
        {h: {"rows": n} for h, n in written.hourly.items()},
        reads,
    )


@dataclass
class _Inputs:
    """How one declared-table run reads its relations: the sources, the relations the specs
    declare, and each read relation's pinned Spark identifier."""

    sources: Sources
    known: dict[str, declared.Relation]
    idents: dict[str, str]


@dataclass
class _Written:
    """What the checks measured on the hours a declared-table run wrote to its branch."""

    rows: int
    hourly: dict[str, int]
    repeated: int
    figures: dict[str, Any]
    contract: CheckOutcome


def _ensure_declared_table(spark: SparkSession, full: str, table: TableSpec) -> None:
    """Create the declared table if it does not exist; refuse one with other columns."""
    cols = ", ".join(f"{c.name} {SPARK_TYPES[c.type]}" for c in table.columns)
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {full} ({cols}) USING iceberg "
        # Hour partitions align with the overwrite window, so re-running any hour range
        # replaces whole files (a day partition would need row-level deletes).
        f"PARTITIONED BY (hours({table.event_time})) TBLPROPERTIES ('format-version'='2')"
    )
    _same_layout(spark, full, table)


def _register_relations(
    spark: SparkSession,
    table: TableSpec,
    inputs: _Inputs,
    start: datetime,
    end: datetime,
    views: list[str],
    persisted: list[DataFrame],
) -> tuple[dict[str, DataFrame], int]:
    """Register each relation ``table`` reads as a temporary view under its spec name; return
    the frames by name and the conflicting event ids counted. Appends to ``views`` and
    ``persisted`` as it goes, so the caller releases whatever was registered if one fails."""

    conflicts = 0
    frames: dict[str, DataFrame] = {}
    for ref in table.refs:
        if inputs.known[ref].kind == "events":
            frame, n = _events(spark, ref, inputs, start, end, persisted)
            conflicts += n
            frame = frame.drop("_versions")
        else:
            frame = _relation(spark, ref, inputs.sources, inputs.known, start, end, inputs.idents)
        frames[ref] = frame
        frame.createOrReplaceTempView(ref)
        views.append(ref)
    return frames, conflicts


@dataclass
class _SharedEvents:
    spark: SparkSession
    key: tuple[str, datetime, datetime]  # (pinned snapshot identifier, start, end)
    frame: DataFrame
    conflicts: int


# The events relation last built from a pinned snapshot, kept for the run's next declared table.
_shared: list[_SharedEvents] = []


def _events(
    spark: SparkSession,
    ref: str,
    inputs: _Inputs,
    start: datetime,
    end: datetime,
    persisted: list[DataFrame],
) -> tuple[DataFrame, int]:
    """The events relation ``ref`` over ``[start, end)``, persisted, and how many of its event
    ids have conflicting versions. Read from a pinned snapshot (immutable), it is kept after
    the table's run and reused by the next declared table asking for the same snapshot and
    hours (a run's tables run one after another in its process): built once per run, not once
    per table. Anything else is built for the table alone (appended to ``persisted``)."""
    from pyspark.sql import functions as F

    ident = inputs.idents[ref]
    key = (ident, start, end)
    pinned = ".snapshot_id_" in ident
    if pinned and _shared and _shared[0].spark is spark and _shared[0].key == key:
        return _shared[0].frame, _shared[0].conflicts
    frame = _relation(spark, ref, inputs.sources, inputs.known, start, end, inputs.idents)
    frame = frame.persist()
    try:
        conflicts = frame.where(F.col("_versions") > 1).count()
    except BaseException:
        frame.unpersist()
        raise
    if not pinned:
        persisted.append(frame)
        return frame, conflicts
    release_shared_events()
    _shared.append(_SharedEvents(spark, key, frame, conflicts))
    return frame, conflicts


def release_shared_events() -> None:
    """Unpersist the kept events relation, if any (nothing to do when its session is gone)."""
    while _shared:
        kept = _shared.pop()
        with contextlib.suppress(Exception):  # a stopped session has dropped its cache
            kept.frame.unpersist()


def _declared_result(
    spark: SparkSession,
    table: TableSpec,
    start: datetime,
    end: datetime,
    persisted: list[DataFrame],
) -> tuple[DataFrame, Column, int]:
    """The declared SQL's result cast to the declared columns and checkpointed (appended to
    ``persisted``), the run's window predicate, and how many result rows fall outside it."""
    from pyspark.sql import functions as F

    result = spark.sql(declared.render(table.sql, start, end)).select(
        *[F.col(c.name).cast(SPARK_TYPES[c.type]).alias(c.name) for c in table.columns]
    )
    ts = F.col(table.event_time)
    window = (ts >= _ts(start)) & (ts < _ts(end))
    # Rows outside the window are not written (they would land in hours this run does not
    # own); the contract check counts them, so such SQL cannot publish.
    result = result.localCheckpoint(eager=True)
    persisted.append(result)
    outside = result.where(~window | ts.isNull()).count()
    return result, window, outside


def _source_figures(
    spark: SparkSession,
    table: TableSpec,
    inputs: _Inputs,
    frames: dict[str, DataFrame],
    start: datetime,
    end: datetime,
) -> dict[str, Any]:
    """Each measure's aggregate over the source relation's rows in ``[start, end)``."""
    src_rel = inputs.known[table.source]
    src = (
        frames[table.source]
        if src_rel.kind == "events" and not table.lookback_hours
        else _relation(spark, table.source, inputs.sources, inputs.known, start, end, inputs.idents)
    )
    if "_versions" in src.columns:
        src = src.drop("_versions")
    return _measure_figures(table, src.where(_window_on(src_rel, start, end)), side="source")


def _check_written(
    spark: SparkSession,
    table: TableSpec,
    branch: Branch,
    window: Column,
    start: datetime,
    end: datetime,
) -> _Written:
    """Measure the window's rows on the run branch (persisted while measured)."""
    from pyspark.sql import functions as F

    written = spark.table(branch.ident).where(window).persist()
    try:
        rows = written.count()
        hourly = rows_per_hour(written, table.event_time, start, end)
        repeated = (
            written.groupBy(*table.grain).count().where(F.col("count") > 1).count() if rows else 0
        )
        table_figures = _measure_figures(table, written, side="table")
        contract = checks.schema_contract(written, table.columns, at_most=rows)
    finally:
        written.unpersist()
    return _Written(rows, hourly, repeated, table_figures, contract)


def _window_on(rel: declared.Relation, start: datetime, end: datetime) -> Column:
    from pyspark.sql import functions as F

    assert rel.event_time is not None
    ts = F.col(rel.event_time)
    return (ts >= _ts(start)) & (ts < _ts(end))


def _measure_figures(table: TableSpec, frame: DataFrame, side: str) -> dict[str, Any]:
    """Each measure's aggregate over ``frame`` (the table's or the source's window rows), in
    one action: the measures' SQL as ``frame``'s own expressions (over Spark Connect, a
    temporary view, its query and its drop cost three more round trips)."""
    if not table.measures:
        return {}
    row = frame.selectExpr(
        *[f"{m.table if side == 'table' else m.source} AS `{m.name}`" for m in table.measures]
    ).first()
    assert row is not None
    return {m.name: _plain(row[m.name]) for m in table.measures}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, int | str | bool):
        return value
    if isinstance(value, float):
        return value
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return str(value)
    return int(as_float) if as_float.is_integer() else as_float


def _equal(a: Any, b: Any) -> bool:
    """Measure equality; NULL (an empty window's sum) equals 0, floats within 1e-9 relative."""
    a, b = (0 if a is None else a), (0 if b is None else b)
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)), abs(float(b)))
    return bool(a == b)


def _reconciliation(
    table: TableSpec, table_figures: dict[str, Any], source_figures: dict[str, Any]
) -> CheckOutcome:
    off = {
        m.name: {"table": table_figures[m.name], "source": source_figures[m.name]}
        for m in table.measures
        if not _equal(table_figures[m.name], source_figures[m.name])
    }
    detail = "; ".join(
        f"{name}: table {v['table']} vs {table.source} {v['source']}" for name, v in off.items()
    )
    return CheckOutcome(
        "reconciliation",
        not off,
        f"every declared measure matches {table.source}" if not off else detail,
        {
            "table": table_figures,
            "source": source_figures,
            "source_relation": table.source,
            "measures": {m.name: {"table": m.table, "source": m.source} for m in table.measures},
        },
    )


def _with_outside(
    contract: CheckOutcome, outside: int, start: datetime, end: datetime, table: TableSpec
) -> CheckOutcome:
    if not outside:
        return contract
    msg = (
        f"{outside} row(s) with {table.event_time} outside the window "
        f"[{start.isoformat()}, {end.isoformat()}) or NULL (not written)"
    )
    return CheckOutcome(
        contract.name,
        False,
        msg if contract.passed else f"{contract.summary}; {msg}",
        {**contract.metadata, "rows_outside_window": outside},
    )


def _same_layout(spark: SparkSession, full: str, table: TableSpec) -> None:
    """Refuse to write when the existing table's columns are not the declared ones."""
    have = {f.name: f.dataType.simpleString() for f in spark.table(full).schema.fields}
    want = {c.name: SPARK_TYPES[c.type] for c in table.columns}
    if have != want:
        raise ValueError(
            f"table {full} has columns {have} but {table.name} declares {want}; a declared "
            f"table's columns cannot change in place: give the new declaration another name, "
            f"or drop the old table (DROP TABLE {full} PURGE) and backfill it again"
        )


# The columns a current-state row holds after its key and the topic's payload columns.
_STATE_COLUMNS = (
    "deleted",
    "order_ts",
    "kafka_timestamp",
    "kafka_hour",
    "kafka_partition",
    "kafka_offset",
)


def build_current(
    spark: SparkSession,
    spec: TopicSpec,
    raw_table: str,
    table: str,
    start: datetime,
    end: datetime,
    run_id: str,
    attempt: int = 0,
) -> DerivedOutcome:
    """Recompute, onto a run branch of the current-state table, every key touched by Kafka
    hours ``[start, end)``: keys with a raw row there, and keys whose current row came from
    there (so a rolled-back raw hour is undone by re-running it). One MERGE commit. The raw
    table is read at one snapshot of its main, pinned when the run starts, and the outcome's
    ``reads`` records which (its lineage: a raw publish it did not read makes the hour due)."""
    key = spec.current_rule.key
    payload = [c.name for c in spec.columns if c.name != key]
    _ensure_current_table(spark, spec, table)
    # The raw table's main from the catalog's metadata (pyiceberg; None: no such table yet).
    pin = ref_snapshot(spark, raw_table, "main")
    pinned = f"{raw_table}.snapshot_id_{pin[0]}" if pin is not None else raw_table
    raw = spark.table(pinned)
    clock = _Clock()
    source = _current_source(spark, spec, pinned, raw, table, start, end)
    clock.lap("source")
    branch = open_branch(spark, table, run_id, attempt)
    _merge_current(spark, branch, source, key, payload)
    clock.lap("merge")
    state = spark.table(branch.ident)
    types = _column_types(table, spec.columns)
    figures = current_figures(key, raw, state, source, start, end, spec.columns, types)
    outcome = _current_outcome(spec, state, branch, figures)
    clock.lap("checks")
    outcome.metadata["seconds"] = clock.laps
    if pin is not None:
        outcome.reads[raw_table] = pin
    return outcome


class _Clock:
    """Seconds per phase of a run (its metadata: where a run's time went)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._at = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(now - self._at, 2)
        self._at = now


def _ensure_current_table(spark: SparkSession, spec: TopicSpec, table: str) -> None:
    """Create the current-state table if it does not exist (the key as its column's type, a
    string before the key took it); refuse one with the old layout; add the columns the spec
    gained since. A table in the current layout with every column at the spec's type is seen
    from the catalog's metadata (pyiceberg: no Spark question); any other costs one schema
    question of Spark, which decides."""
    from pyspark.errors import AnalysisException

    key = spec.current_rule.key
    columns = [(c.name, SPARK_TYPES[c.type]) for c in spec.columns if c.name != key]
    found = iceberg_table(table)
    if found is not None:
        schema_now = found.schema()
        if any(f.name == "kafka_hour" for f in schema_now.fields) and has_columns(
            schema_now, columns
        ):
            return
    try:
        schema = spark.table(table).schema
    except AnalysisException:  # no such table (yet)
        cols = ", ".join(f"{c.name} {SPARK_TYPES[c.type]}" for c in spec.columns if c.name != key)
        key_type = next(SPARK_TYPES[c.type] for c in spec.columns if c.name == key)
        spark.sql(
            f"CREATE TABLE IF NOT EXISTS {table} ({key} {key_type}, {cols}, "
            "deleted boolean, order_ts timestamp, kafka_timestamp timestamp, "
            "kafka_hour timestamp, kafka_partition int, kafka_offset bigint) "
            "USING iceberg TBLPROPERTIES ('format-version'='2')"
        )
        schema = spark.table(table).schema
    if "kafka_hour" not in schema.fieldNames():
        raise ValueError(
            f"table {table} has the old layout; drop it (DROP TABLE {table} PURGE) and re-run "
            "the current-state backfill"
        )
    add_columns(spark, table, columns, schema)


def _current_source(
    spark: SparkSession,
    spec: TopicSpec,
    raw_table: str,
    raw: DataFrame,
    table: str,
    start: datetime,
    end: datetime,
) -> DataFrame:
    """Per key touched by Kafka hours ``[start, end)``: its latest winning event or tombstone
    (``_gone`` when no raw row is left), checkpointed so the MERGE does not read the raw
    table's lineage.

    The winners are picked from a narrow scan of every raw row (keys, event ids, times and
    positions, :func:`_picked`); only the picked rows are then read whole, from the Kafka hours
    that hold them. Where the window holds most of the raw table (:func:`_mostly`), every
    key's winner is picked without narrowing the keys and ids first."""
    from pyspark.sql import functions as F

    rule = spec.current_rule
    key = rule.key
    payload = [c.name for c in spec.columns if c.name != key]
    hours = (F.col("kafka_hour") >= _ts(start)) & (F.col("kafka_hour") < _ts(end))
    touched = (
        raw.where(hours)
        .select(key)
        .unionByName(spark.table(table).where(hours).select(key))
        .where(F.col(key).isNotNull())
        .distinct()
        .localCheckpoint(eager=True)
    )
    cdc = spec.envelope == "debezium"
    if cdc:
        picked = picked_by_position(spec, raw, touched)
    else:
        picked = _picked(spec, raw, touched, whole=_mostly(spark, raw_table, start, end))
    picked = picked.localCheckpoint(eager=True)
    deleted = F.col("is_tombstone")
    if rule.deleted_when is not None:
        deleted = deleted | F.coalesce(F.expr(rule.deleted_when), F.lit(False))
    winners = raw.where(_hours_of(picked)).join(picked, list(_POSITION), "left_semi")
    if cdc:
        winners = _fill_unavailable(spec, raw, winners)
    winners = winners.withColumn(
        "order_ts", F.coalesce(F.col(rule.order_by), F.col("kafka_timestamp"))
    ).select(key, *payload, deleted.alias("deleted"), *_STATE_COLUMNS[1:])
    # Touched keys with no raw row left (their hours were rolled back) are removed.
    # Cut the lineage to the raw table: Spark 4.1 cannot plan a MERGE whose source view still
    # references another Iceberg table ("No plan for TableReference"). The checkpoints are not
    # unpersisted: a checkpointed frame's unpersist() leaves its blocks (it is not in Spark's
    # cache manager; measured on 4.1), so it would cost a Spark Connect round trip for nothing.
    # Its blocks go once nothing refers to the frame (Spark's context cleaner).
    return (
        touched.join(winners, key, "left")
        .withColumn("_gone", F.col("order_ts").isNull())
        .localCheckpoint(eager=True)
    )


def _picked(spec: TopicSpec, raw: DataFrame, touched: DataFrame, *, whole: bool) -> DataFrame:
    """The positions (:data:`_POSITION`) of each touched key's latest row: among the winning
    versions of the event ids of its events (every version of those ids, whatever its key)
    and its tombstones, by ``order_by`` (Kafka time for tombstones), then the version rule
    (:func:`newest`), and possibly those of a few keys not touched (the caller keeps the
    touched keys'). Reads only the narrow columns of the raw table. ``whole``: every key's
    pick, without narrowing (for a window holding most of the table)."""
    from pyspark.sql import functions as F

    rule = spec.current_rule
    key, event_id = rule.key, spec.event_id_field
    columns = [key, event_id, "is_tombstone", "kafka_timestamp", *_POSITION, rule.order_by]
    narrow = raw.select(*dict.fromkeys(columns))
    # Hash candidates, not exact semi-joins: a row of another key or id whose hash collides
    # only adds a pick for a key that is not touched, which the caller's join with the
    # touched keys drops (the winner of an id is a row of its own key, so an id whose winner
    # holds a touched key is always among the touched keys' ids).
    real = narrow.where(~F.col("is_tombstone") & F.col(event_id).isNotNull())
    if whole:
        mine, events = narrow, newest(real, event_id)
    else:
        mine = _candidates(narrow, touched, key)
        ids = mine.where(~F.col("is_tombstone")).select(event_id).distinct()
        events = newest(_candidates(real, ids.localCheckpoint(eager=True), event_id), event_id)
    order = F.coalesce(F.col(rule.order_by), F.col("kafka_timestamp"))
    return newest(events.unionByName(mine.where(F.col("is_tombstone"))), key, order).select(
        *_POSITION
    )


def cdc_position() -> Column:
    """A Debezium row's position in the source's log: (``cdc_lsn``, 0 for a snapshot read
    else 1). A snapshot's reads all carry the LSN its slot started at and show the table as of
    that point; a change can carry that same LSN and is then newer than the read, whichever
    reached Kafka first (docs/cdc.md)."""
    from pyspark.sql import functions as F

    rank = F.when(F.col("cdc_op") == F.lit("r"), F.lit(0)).otherwise(F.lit(1))
    return F.struct(F.col("cdc_lsn").alias("lsn"), rank.alias("rank"))


def picked_by_position(spec: TopicSpec, raw: DataFrame, touched: DataFrame) -> DataFrame:
    """A Debezium topic's :func:`_picked`: each touched key's latest row by its position in the
    source's log (:func:`cdc_position`), then by the version rule (:func:`newest`: the later
    offset within a partition), never by arrival alone. A tombstone has no position of its
    own: it takes the largest position before it among its key's rows in its partition (the
    delete it follows), so the later offset then makes it the latest; one with nothing before
    it (compacted away) loses to any row with a position."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    key = spec.current_rule.key
    narrow = raw.select(
        key, "is_tombstone", "kafka_timestamp", *_POSITION, cdc_position().alias("_own")
    )
    before = (
        Window.partitionBy(key, "kafka_partition")
        .orderBy("kafka_offset")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    mine = _among(narrow, touched, key).withColumn(
        "_position",
        F.when(
            F.col("is_tombstone"), F.max(F.when(~F.col("is_tombstone"), F.col("_own"))).over(before)
        ).otherwise(F.col("_own")),
    )
    return newest(mine, key, F.col("_position")).select(*_POSITION)


def _fill_unavailable(spec: TopicSpec, raw: DataFrame, winners: DataFrame) -> DataFrame:
    """``winners`` (whole raw rows) with each column their Debezium change left out (an
    unchanged TOAST value, named in ``cdc_unavailable``) taken from the key's latest earlier
    row that carries it, by position (:func:`cdc_position`, then Kafka offset); ``cdc_unavailable``
    then names the columns no earlier row carries (left NULL: the current state never holds
    the placeholder nor a guess)."""
    from pyspark.sql import functions as F

    from backfill_assets.lake.decode.debezium import toastable, unavailable

    key = spec.current_rule.key
    columns = [c.name for c in spec.source_columns if toastable(c) and c.name != key]
    if not columns:
        return winners
    position = F.struct(cdc_position().alias("p"), F.col("kafka_offset").alias("o"))
    gaps = winners.where(F.col("cdc_unavailable").isNotNull()).select(key, position.alias("_at"))
    earlier = (
        _among(raw.where(F.col("cdc_op").isin("r", "c", "u")), gaps.select(key), key)
        .join(gaps, key)
        .where(position < F.col("_at"))
    )
    found = earlier.groupBy(key).agg(
        *[
            F.max_by(F.struct(F.col(c).alias("v")), F.when(~unavailable(c), position)).alias(
                f"_f_{c}"
            )
            for c in columns
        ]
    )
    filled = winners.join(found, key, "left")
    missing = {c: unavailable(c) for c in columns}
    still = F.concat_ws(
        ",", *[F.when(gap & F.col(f"_f_{c}").isNull(), F.lit(c)) for c, gap in missing.items()]
    )
    return filled.select(
        *[
            F.when(missing[c.name], F.col(f"_f_{c.name}.v")).otherwise(F.col(c.name)).alias(c.name)
            if c.name in missing
            else F.col(c.name)
            for c in spec.columns
            if c.name != "cdc_unavailable"
        ],
        F.when(still != F.lit(""), still).alias("cdc_unavailable"),
        *[c for c in raw.columns if c not in {col.name for col in spec.columns}],
    )


def _among(frame: DataFrame, values: DataFrame, column: str) -> DataFrame:
    """The rows of ``frame`` whose ``column`` is one of ``values``' (a left semi-join).

    The rows are first narrowed by :func:`_candidates`, so the exact join that follows
    shuffles only the candidates: a hash collision lets a row past the first step, never past
    the second."""
    return _candidates(frame, values, column).join(values, column, "left_semi")


def _candidates(frame: DataFrame, values: DataFrame, column: str) -> DataFrame:
    """The rows of ``frame`` whose ``column``'s 64-bit hash is one of ``values``' (a broadcast
    set, small where the values were not): every row of each value, and possibly a few rows of
    other values whose hash collides, which the caller must drop exactly."""
    from pyspark.sql import functions as F

    hashes = values.select(F.xxhash64(column).alias("_hash")).distinct()
    return (
        frame.withColumn("_hash", F.xxhash64(column))
        .join(F.broadcast(hashes), "_hash", "left_semi")
        .drop("_hash")
    )


def _merge_current(
    spark: SparkSession, branch: Branch, source: DataFrame, key: str, payload: list[str]
) -> None:
    """Apply ``source`` to the branch in one MERGE (one atomic commit): delete gone keys,
    update matched ones, insert new ones. The source is passed to ``spark.sql`` as a frame: a
    classic session registers it as a temporary view for the statement and drops it; over
    Spark Connect it travels with the statement (no view to create and drop: two round trips
    fewer)."""
    keep = ", ".join(f"{c} = s.{c}" for c in [*payload, *_STATE_COLUMNS])
    insert_cols = [key, *payload, *_STATE_COLUMNS]
    spark.sql(
        f"MERGE INTO {branch.ident} t USING {{source}} s ON t.{key} = s.{key} "
        "WHEN MATCHED AND s._gone THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {keep} "
        f"WHEN NOT MATCHED AND NOT s._gone THEN INSERT ({', '.join(insert_cols)}) "
        f"VALUES ({', '.join('s.' + c for c in insert_cols)})",
        source=source,
    )


def _not_applied(source: DataFrame, state: DataFrame, key: str) -> DataFrame:
    """Touched keys whose state row is not their source row (or is there though gone)."""
    from pyspark.sql import functions as F

    joined = source.alias("s").join(state.alias("t"), key, "left")
    return joined.where(
        (F.col("s._gone") & F.col("t.order_ts").isNotNull())
        | (
            ~F.col("s._gone")
            & (
                F.col("t.order_ts").isNull()
                | (F.col("t.kafka_partition") != F.col("s.kafka_partition"))
                | (F.col("t.kafka_offset") != F.col("s.kafka_offset"))
            )
        )
    )


@dataclass
class CurrentFigures:
    """What a current-state run measures on its branch: rows, distinct keys, touched keys (the
    source's rows), those not applied, and per Kafka hour (ISO-8601 UTC) the raw records read
    (``raw_records``) and the state rows whose latest record is from that hour (``rows``)."""

    rows: int
    keys: int
    source_keys: int
    not_applied: int
    per_hour: dict[str, dict[str, int]]
    # pandera's report on the live rows (``"<column>: <check>"`` -> failures), counted in the
    # same action; None when it was not (no contract asked, or a check without a translation)
    contract: dict[str, int] | None = None


def current_figures(
    key: str,
    raw: DataFrame,
    state: DataFrame,
    source: DataFrame,
    start: datetime,
    end: datetime,
    contract: tuple[ColumnSpec, ...] | None = None,
    types: Mapping[str, str] | None = None,
) -> CurrentFigures:
    """:class:`CurrentFigures` in one Spark action: each figure is the aggregation it would be
    alone (``count``, ``countDistinct``, :func:`_not_applied`, :func:`rows_per_hour`), and one
    collect of their union brings them all (over Spark Connect two round trips, where one
    action per figure cost eight). Every part reads the branch as it stands after the MERGE;
    nothing writes to it meanwhile. With ``contract`` (the state's columns), the live rows'
    violations of it are counted in the same action (pandera's checks as Spark expressions,
    :func:`~backfill_assets.lake.write.schema_contract.contract_violations`), when every check
    has a translation. ``types``: the state columns' Spark types, if known (else Spark is
    asked)."""
    from pyspark.sql import functions as F

    none = F.lit(None).cast("bigint")

    def part(
        frame: DataFrame, name: str, a: str, b: str | None = None, h: str | None = None
    ) -> DataFrame:
        """One figure's rows as (f, h, a, b): its name, hour, value(s)."""
        return frame.select(
            F.lit(name).alias("f"),
            none.alias("h") if h is None else F.col(h).cast("bigint").alias("h"),
            F.col(a).cast("bigint").alias("a"),
            none.alias("b") if b is None else F.col(b).cast("bigint").alias("b"),
        )

    count = F.count("*").alias("n")
    parts = [
        part(state.agg(count, F.countDistinct(key).alias("k")), "state", "n", "k"),
        part(source.agg(count), "source", "n"),
        part(_not_applied(source, state, key).agg(count), "not_applied", "n"),
        part(_hour_counts(raw, "kafka_hour", start, end), "raw_records", "count", h="h"),
        part(_hour_counts(state, "kafka_hour", start, end), "rows", "count", h="h"),
    ]
    counters = _live_counters(state, contract, types)
    if counters:
        parts.append(_counter_part(state, counters))
    union = parts[0]
    for other in parts[1:]:
        union = union.unionByName(other)
    found: dict[str, tuple[int, int]] = {}
    per_hour: dict[str, dict[str, int]] = {}
    sums: dict[str, int] = {}
    for row in fetch.rows(union):
        if row["f"] in ("raw_records", "rows"):
            per_hour.setdefault(_hour_key(row["h"]), {})[row["f"]] = int(row["a"])
        elif row["f"].startswith(_COUNTER):
            sums[list(counters or {})[int(row["f"].removeprefix(_COUNTER))]] = int(row["a"] or 0)
        else:
            found[row["f"]] = (int(row["a"]), int(row["b"] or 0))
    return CurrentFigures(
        rows=found["state"][0],
        keys=found["state"][1],
        source_keys=found["source"][0],
        not_applied=found["not_applied"][0],
        per_hour=per_hour,
        contract=None if counters is None else contract_failures(sums),
    )


def _column_types(table: str, columns: tuple[ColumnSpec, ...]) -> dict[str, str] | None:
    """The Spark types of ``columns`` in ``table``, from the catalog's metadata (no Spark
    question); None if one is missing or of a type only Spark can name."""
    found = iceberg_table(table)
    if found is None:
        return None
    have = {f.name: spark_type(f.field_type) for f in found.schema().fields}
    types = {c.name: have.get(c.name) for c in columns}
    if any(t is None for t in types.values()):
        return None
    return {name: t for name, t in types.items() if t is not None}


# The figure name of contract counter i in current_figures' union.
_COUNTER = "contract:"


def _live_counters(
    state: DataFrame,
    contract: tuple[ColumnSpec, ...] | None,
    types: Mapping[str, str] | None = None,
) -> dict[str, Column] | None:
    """The contract's counters over the state's live rows (``types``: their Spark types, when
    known without asking Spark); None without a contract or a translation."""
    if contract is None:
        return None
    return contract_violations(contract_schema(contract), _live(state, contract), types)


def _live(state: DataFrame, columns: tuple[ColumnSpec, ...]) -> DataFrame:
    """The state rows of keys not deleted, with the state's own columns (what the contract
    is checked on)."""
    from pyspark.sql import functions as F

    return state.where(~F.col("deleted")).select(*[c.name for c in columns])


def _counter_part(state: DataFrame, counters: dict[str, Column]) -> DataFrame:
    """The counters' sums over the live rows as current_figures' rows (f, h, a, b): one
    aggregation, one row per counter."""
    from pyspark.sql import functions as F

    none = F.lit(None).cast("bigint")
    sums = state.where(~F.col("deleted")).agg(
        *[F.sum(c).cast("bigint").alias(f"_v{i}") for i, c in enumerate(counters.values())]
    )
    rows = [
        F.struct(
            F.lit(f"{_COUNTER}{i}").alias("f"),
            none.alias("h"),
            F.col(f"_v{i}").alias("a"),
            none.alias("b"),
        )
        for i in range(len(counters))
    ]
    return sums.select(F.explode(F.array(*rows)).alias("_r")).select("_r.*")


def _current_outcome(
    spec: TopicSpec, state: DataFrame, branch: Branch, figures: CurrentFigures
) -> DerivedOutcome:
    """The checks of a current-state run's branch from its figures, and the contract check."""

    key = spec.current_rule.key
    rows, not_applied, source_keys = figures.rows, figures.not_applied, figures.source_keys
    if figures.contract is not None:
        contract = checks.contract_outcome(figures.contract, spec.columns)
    else:
        contract = checks.schema_contract(_live(state, spec.columns), spec.columns, at_most=rows)
    outcomes = [
        CheckOutcome(
            "uniqueness",
            rows == figures.keys,
            f"{rows - figures.keys} repeated {key}",
            {"rows": rows},
        ),
        CheckOutcome(
            "source_applied",
            not_applied == 0,
            f"{not_applied} of {source_keys} touched keys do not hold their latest raw record",
            {"source_keys": source_keys, "not_applied": not_applied},
        ),
        contract,
    ]
    return DerivedOutcome(
        branch, outcomes, {"source_keys": source_keys, "rows": rows}, figures.per_hour
    )
