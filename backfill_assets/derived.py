"""Derived lakehouse tables, computed in Spark from the published raw table.

**The duplicates rule** (both tables; it does not depend on where runs start or end): the raw
table keeps every committed record. Among the versions of one event id, the one with the
highest (Kafka timestamp, partition, offset) wins; identical re-sends collapse into it, and an
id whose versions differ in content is a *conflict*, counted in the run's metadata.

* ``<topic>_hourly``: per event-time hour and currency, events, orders and amount over the
  winning versions. Its hour H is expected to read raw Kafka hours H .. H + allowed lateness
  (the partition mapping); it reads every published raw row, so when the late-data sensor
  re-runs H for records that arrived even later, they are counted.
* ``<topic>_current``: per key, the latest of the winning events and the tombstones, by event
  time (Kafka time for tombstones), then Kafka time, partition, offset. A run of Kafka hours
  W recomputes every key with a raw row in W or whose current row came from W, from all of
  main's raw rows, so re-publishing or rolling back raw hours and re-running converges. A
  tombstone leaves the key with ``deleted = true``; a key with no raw row left is removed.

Both are written on a run branch and published through :mod:`backfill_assets.wap`; each
function returns the branch and the audit outcomes it computed on that branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from backfill_assets.checks import CheckOutcome
from backfill_assets.spec import TopicSpec
from backfill_assets.wap import Branch, open_branch

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

HOURLY_CHECKS = ("count_reconciliation", "amount_reconciliation", "uniqueness", "schema_contract")
CURRENT_CHECKS = ("uniqueness", "source_applied", "schema_contract")


@dataclass
class DerivedOutcome:
    branch: Branch
    checks: list[CheckOutcome]
    metadata: dict[str, Any] = field(default_factory=dict)


def hourly_table(spec: TopicSpec) -> str:
    return f"{spec.topic}_hourly"


def current_table(spec: TopicSpec) -> str:
    return f"{spec.topic}_current"


def _ts(value: datetime) -> Column:
    """A UTC timestamp literal. Aware on purpose: PySpark reads a naive datetime in the
    machine's local zone."""
    from pyspark.sql import functions as F

    return F.lit(value.astimezone(UTC))


def winning_versions(
    spark: SparkSession, spec: TopicSpec, raw_table: str, ids: DataFrame
) -> DataFrame:
    """For the event ids in ``ids`` (one column, the event id field), the winning version of
    each from all of main's raw rows, with ``_versions`` (distinct contents) per id."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    key = spec.event_id_field
    events = spark.table(raw_table).where(~F.col("is_tombstone"))
    versions = events.join(ids, key, "left_semi")
    content = F.xxhash64(*[F.col(c.name) for c in spec.columns])
    order = Window.partitionBy(key).orderBy(
        F.col("kafka_timestamp").desc(),
        F.col("kafka_partition").desc(),
        F.col("kafka_offset").desc(),
    )
    every = Window.partitionBy(key)
    return (
        versions.withColumn("_content", content)
        .withColumn("_n", F.row_number().over(order))
        .withColumn("_versions", F.size(F.collect_set("_content").over(every)))
        .where(F.col("_n") == 1)
        .drop("_n", "_content")
    )


def build_hourly(
    spark: SparkSession,
    spec: TopicSpec,
    raw_table: str,
    table: str,
    start: datetime,
    end: datetime,
    run_id: str,
    attempt: int = 0,
) -> DerivedOutcome:
    """Recompute event-time hours ``[start, end)`` onto a run branch of ``table``."""
    from pyspark.sql import functions as F

    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {table} (event_hour timestamp, currency string, "
        "events bigint, orders bigint, amount_minor bigint, cancelled bigint) USING iceberg "
        # Hour partitions align with the overwrite window, so re-running any hour range
        # replaces whole files (a day partition would need row-level deletes).
        "PARTITIONED BY (hours(event_hour)) TBLPROPERTIES ('format-version'='2')"
    )
    lateness = timedelta(hours=spec.allowed_lateness_hours)
    event_time = F.col(spec.event_time_field)
    in_window = (event_time >= _ts(start)) & (event_time < _ts(end))
    # Every id with some version in the window, then each id's winner (whose event time may
    # have been corrected out of the window, or into it from another id's hour).
    ids = (
        spark.table(raw_table)
        .where(~F.col("is_tombstone") & in_window)
        .select(spec.event_id_field)
        .distinct()
    )
    winners = winning_versions(spark, spec, raw_table, ids).persist()
    source = winners.where(in_window)
    try:
        agg = source.groupBy(
            F.date_trunc("hour", event_time).alias("event_hour"), F.col("currency")
        ).agg(
            F.count("*").alias("events"),
            F.countDistinct(spec.key_field).alias("orders"),
            F.sum("amount_minor").cast("bigint").alias("amount_minor"),
            F.sum(F.when(F.col("event_type") == "cancelled", 1).otherwise(0))
            .cast("bigint")
            .alias("cancelled"),
        )
        src = source.agg(F.count("*").alias("n"), F.sum("amount_minor").alias("amount")).first()
        assert src is not None
        conflicts = winners.where(F.col("_versions") > 1).count()
        branch = open_branch(spark, table, run_id, attempt)
        window = (F.col("event_hour") >= _ts(start)) & (F.col("event_hour") < _ts(end))
        agg.writeTo(branch.ident).overwrite(window)
    finally:
        winners.unpersist()

    written = spark.table(branch.ident).where(window).persist()
    try:
        tot = written.agg(
            F.coalesce(F.sum("events"), F.lit(0)).alias("events"),
            F.coalesce(F.sum("amount_minor"), F.lit(0)).alias("amount"),
            F.count("*").alias("rows"),
            F.countDistinct("event_hour", "currency").alias("keys"),
        ).first()
        assert tot is not None
        bad = written.where(
            F.col("event_hour").isNull()
            | F.col("currency").isNull()
            | (F.col("events") <= 0)
            | (F.col("orders") > F.col("events"))
            | (F.col("cancelled") > F.col("events"))
            | ~F.col("currency").isin(*_allowed(spec, "currency"))
        ).count()
    finally:
        written.unpersist()
    src_events, src_amount = int(src["n"]), int(src["amount"] or 0)
    checks = [
        CheckOutcome(
            "count_reconciliation",
            int(tot["events"]) == src_events,
            f"events on branch {tot['events']} vs distinct source events {src_events}",
            {"branch_events": int(tot["events"]), "source_events": src_events},
        ),
        CheckOutcome(
            "amount_reconciliation",
            int(tot["amount"]) == src_amount,
            f"amount_minor on branch {tot['amount']} vs source {src_amount}",
            {"branch_amount_minor": int(tot["amount"]), "source_amount_minor": src_amount},
        ),
        CheckOutcome(
            "uniqueness",
            int(tot["rows"]) == int(tot["keys"]),
            f"{int(tot['rows']) - int(tot['keys'])} repeated (event_hour, currency)",
            {"rows": int(tot["rows"])},
        ),
        CheckOutcome(
            "schema_contract",
            bad == 0,
            f"{bad} rows break the contract (non-null keys, events > 0, orders and "
            "cancelled <= events, known currency)",
            {"violations": bad},
        ),
    ]
    return DerivedOutcome(
        branch,
        checks,
        {
            "source_kafka_window": f"{start.isoformat()}/{(end + lateness).isoformat()}",
            "events": src_events,
            "amount_minor": src_amount,
            "conflicting_event_ids": conflicts,
        },
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
    there (so a rolled-back raw hour is undone by re-running it). One MERGE commit."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    key = spec.key_field
    payload = [c.name for c in spec.columns if c.name != key]
    cols = ", ".join(f"{c.name} {c.type}" for c in spec.columns if c.name != key)
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {table} ({key} string, {cols}, "
        "deleted boolean, order_ts timestamp, kafka_timestamp timestamp, kafka_hour timestamp, "
        "kafka_partition int, kafka_offset bigint) "
        "USING iceberg TBLPROPERTIES ('format-version'='2')"
    )
    if "kafka_hour" not in spark.table(table).columns:
        raise ValueError(
            f"table {table} has the old layout; drop it (DROP TABLE {table} PURGE) and re-run "
            "the current-state backfill"
        )
    hours = (F.col("kafka_hour") >= _ts(start)) & (F.col("kafka_hour") < _ts(end))
    raw = spark.table(raw_table)
    touched = (
        raw.where(hours)
        .select(key)
        .unionByName(spark.table(table).where(hours).select(key))
        .where(F.col(key).isNotNull())
        .distinct()
    )
    events = winning_versions(
        spark,
        spec,
        raw_table,
        raw.join(touched, key, "left_semi")
        .where(~F.col("is_tombstone"))
        .select(spec.event_id_field)
        .distinct(),
    ).drop("_versions")
    tombstones = raw.join(touched, key, "left_semi").where(F.col("is_tombstone"))
    order_ts = F.coalesce(F.col(spec.event_time_field), F.col("kafka_timestamp"))
    latest_first = Window.partitionBy(key).orderBy(
        order_ts.desc(),
        F.col("kafka_timestamp").desc(),
        F.col("kafka_partition").desc(),
        F.col("kafka_offset").desc(),
    )
    winners = (
        events.unionByName(tombstones)
        .withColumn("order_ts", order_ts)
        .withColumn("_n", F.row_number().over(latest_first))
        .where(F.col("_n") == 1)
        .select(
            key,
            *payload,
            F.col("is_tombstone").alias("deleted"),
            "order_ts",
            "kafka_timestamp",
            "kafka_hour",
            "kafka_partition",
            "kafka_offset",
        )
    )
    # Touched keys with no raw row left (their hours were rolled back) are removed.
    source = (
        touched.join(winners, key, "left")
        .withColumn("_gone", F.col("order_ts").isNull())
        # Cut the lineage to the raw table: Spark 4.1 cannot plan a MERGE whose source view
        # still references another Iceberg table ("No plan for TableReference").
        .localCheckpoint(eager=True)
    )
    try:
        view = f"_current_src_{run_id.replace('-', '_')}_{attempt}"
        source.createOrReplaceTempView(view)
        branch = open_branch(spark, table, run_id, attempt)
        keep = ", ".join(
            f"{c} = s.{c}"
            for c in [
                *payload,
                "deleted",
                "order_ts",
                "kafka_timestamp",
                "kafka_hour",
                "kafka_partition",
                "kafka_offset",
            ]
        )
        insert_cols = [
            key,
            *payload,
            "deleted",
            "order_ts",
            "kafka_timestamp",
            "kafka_hour",
            "kafka_partition",
            "kafka_offset",
        ]
        spark.sql(
            f"MERGE INTO {branch.ident} t USING {view} s ON t.{key} = s.{key} "
            "WHEN MATCHED AND s._gone THEN DELETE "
            f"WHEN MATCHED THEN UPDATE SET {keep} "
            f"WHEN NOT MATCHED AND NOT s._gone THEN INSERT ({', '.join(insert_cols)}) "
            f"VALUES ({', '.join('s.' + c for c in insert_cols)})"
        )
        state = spark.table(branch.ident)
        joined = source.alias("s").join(state.alias("t"), key, "left")
        not_applied = joined.where(
            (F.col("s._gone") & F.col("t.order_ts").isNotNull())
            | (
                ~F.col("s._gone")
                & (
                    F.col("t.order_ts").isNull()
                    | (F.col("t.kafka_partition") != F.col("s.kafka_partition"))
                    | (F.col("t.kafka_offset") != F.col("s.kafka_offset"))
                )
            )
        ).count()
        source_keys = source.count()
        spark.catalog.dropTempView(view)
    finally:
        source.unpersist()
    agg = state.agg(F.count("*").alias("rows"), F.countDistinct(key).alias("keys")).first()
    assert agg is not None
    live = state.where(~F.col("deleted"))
    bad = live.where(
        F.col("status").isNull() | ~F.col("status").isin(*_allowed(spec, "status"))
    ).count()
    checks = [
        CheckOutcome(
            "uniqueness",
            agg["rows"] == agg["keys"],
            f"{int(agg['rows']) - int(agg['keys'])} repeated {key}",
            {"rows": int(agg["rows"])},
        ),
        CheckOutcome(
            "source_applied",
            not_applied == 0,
            f"{not_applied} of {source_keys} touched keys do not hold their latest raw record",
            {"source_keys": source_keys, "not_applied": not_applied},
        ),
        CheckOutcome(
            "schema_contract",
            bad == 0,
            f"{bad} live rows with a missing or unknown status",
            {"violations": bad},
        ),
    ]
    return DerivedOutcome(branch, checks, {"source_keys": source_keys, "rows": int(agg["rows"])})


def _allowed(spec: TopicSpec, column: str) -> list[str]:
    for c in spec.columns:
        if c.name == column and c.allowed:
            return list(c.allowed)
    return []
