"""Derived lakehouse tables, computed in Spark from the published raw table.

* ``<topic>_hourly``: per event-time hour and currency, events, orders and amount. Its hour H
  is expected to read raw Kafka hours H .. H + allowed lateness (the partition mapping); it
  reads every published raw row with an event time in H, so when the late-data sensor re-runs
  H for records that arrived even later, they are counted.
* ``<topic>_current``: the latest record per key by event time (Kafka time for tombstones),
  then offset. The latest record decides the whole row, so merges are order-independent and
  idempotent. A tombstone leaves the key with ``deleted = true`` and an empty payload instead of
  removing the row: replaying an older window can then never resurrect a deleted key. Readers
  filter ``NOT deleted``.

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
    from pyspark.sql import Column, SparkSession

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
    from pyspark.sql import functions as F

    return F.lit(value.astimezone(UTC).replace(tzinfo=None))


def build_hourly(
    spark: SparkSession,
    spec: TopicSpec,
    raw_table: str,
    table: str,
    start: datetime,
    end: datetime,
    run_id: str,
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
    source = (
        spark.table(raw_table)
        .where(~F.col("is_tombstone"))
        # Events of hour H reach Kafka at or after H. No upper bound on Kafka time: records
        # later than the allowed lateness are included when the late-data sensor re-runs H
        # (file-level event_time statistics keep the scan to the files that can match).
        .where(F.col("kafka_timestamp") >= _ts(start))
        .where((event_time >= _ts(start)) & (event_time < _ts(end)))
        .dropDuplicates([spec.event_id_field])
        .persist()
    )
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
        branch = open_branch(spark, table, run_id)
        window = (F.col("event_hour") >= _ts(start)) & (F.col("event_hour") < _ts(end))
        agg.writeTo(branch.ident).overwrite(window)
    finally:
        source.unpersist()

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
) -> DerivedOutcome:
    """Merge the raw rows of Kafka-time ``[start, end)`` into the current-state table."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    payload = [c.name for c in spec.columns if c.name != spec.key_field]
    cols = ", ".join(f"{c.name} {c.type}" for c in spec.columns if c.name != spec.key_field)
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {table} ({spec.key_field} string, {cols}, "
        "deleted boolean, order_ts timestamp, kafka_partition int, kafka_offset bigint) "
        "USING iceberg TBLPROPERTIES ('format-version'='2')"
    )
    key = spec.key_field
    order_ts = F.coalesce(F.col(spec.event_time_field), F.col("kafka_timestamp"))
    latest_first = Window.partitionBy(key).orderBy(order_ts.desc(), F.col("kafka_offset").desc())
    source = (
        spark.table(raw_table)
        .where((F.col("kafka_timestamp") >= _ts(start)) & (F.col("kafka_timestamp") < _ts(end)))
        .withColumn("order_ts", order_ts)
        .withColumn("_n", F.row_number().over(latest_first))
        .where(F.col("_n") == 1)
        .select(
            key,
            *payload,
            F.col("is_tombstone").alias("deleted"),
            "order_ts",
            "kafka_partition",
            "kafka_offset",
        )
        # Cut the lineage to the raw table: Spark 4.1 cannot plan a MERGE whose source view
        # still references another Iceberg table ("No plan for TableReference").
        .localCheckpoint(eager=True)
    )
    try:
        view = f"_current_src_{run_id.replace('-', '_')}"
        source.createOrReplaceTempView(view)
        branch = open_branch(spark, table, run_id)
        newer = (
            "(s.order_ts > t.order_ts OR (s.order_ts = t.order_ts "
            "AND s.kafka_offset > t.kafka_offset))"
        )
        keep = ", ".join(f"{c} = s.{c}" for c in payload)
        spark.sql(
            f"MERGE INTO {branch.ident} t USING {view} s ON t.{key} = s.{key} "
            f"WHEN MATCHED AND {newer} THEN UPDATE SET {keep}, deleted = s.deleted, "
            "order_ts = s.order_ts, kafka_partition = s.kafka_partition, "
            "kafka_offset = s.kafka_offset "
            "WHEN NOT MATCHED THEN INSERT *"
        )
        state = spark.table(branch.ident)
        joined = source.alias("s").join(state.alias("t"), key, "left")
        not_applied = joined.where(
            F.col("t.order_ts").isNull()
            | (F.col("t.order_ts") < F.col("s.order_ts"))
            | (
                (F.col("t.order_ts") == F.col("s.order_ts"))
                & (F.col("t.kafka_offset") < F.col("s.kafka_offset"))
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
            f"{not_applied} of {source_keys} keys from the window are older in the state table",
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
