"""Replay an exact Kafka-time window into a raw Iceberg table, write-audit-publish.

Steps, and what is atomic:

1. **Contract**: the window ``[start, end)`` becomes per-partition ``[start_offset,
   end_offset)`` through ListOffsets-by-timestamp. No consumer group is joined or committed.
2. **Read**: Spark's Kafka batch source reads exactly those offsets in executors.
3. **Parse**: payloads are parsed to VARIANT and upcast per schema version; a record that fails
   (invalid JSON, unknown version, a contract column NULL or out of range) is quarantined with
   its offsets, raw bytes and reason. Events repeated by producer retries are dropped (lowest
   offset wins). Tombstones stay as rows with ``is_tombstone``.
4. **Write**: quarantine rows overwrite the window in the quarantine table (one atomic commit,
   kept even if the run fails, as evidence). Table rows overwrite the window on a branch unique
   to the run (one atomic commit on the branch; main is not touched).
5. **Audit**: the checks read the branch (see :mod:`backfill_assets.checks`).
6. **Publish**: :func:`backfill_assets.wap.publish` (one catalog commit, or nothing).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from backfill_assets.errors import BackfillError
from backfill_assets.spec import TopicSpec
from backfill_assets.wap import SUMMARY_PREFIX, Branch, open_branch

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from backfill_assets.resources import IcebergResource, KafkaResource
    from backfill_assets.settings import Settings

_SPARK_TYPES = {
    "string": "string",
    "bigint": "bigint",
    "int": "int",
    "double": "double",
    "boolean": "boolean",
    "timestamp": "timestamp",
}
KAFKA_COLUMNS = (
    ("topic", "string"),
    ("kafka_partition", "int"),
    ("kafka_offset", "bigint"),
    ("kafka_timestamp", "timestamp"),
    ("kafka_key", "binary"),
    ("is_tombstone", "boolean"),
    ("schema_version", "int"),
)


class ReplayError(BackfillError):
    """A replay could not read, write or publish its window."""


@dataclass(frozen=True)
class OffsetContract:
    """Exactly which offsets a window covers: partition -> [start, end)."""

    topic: str
    start: datetime
    end: datetime
    ranges: dict[int, tuple[int, int]]

    @property
    def records(self) -> int:
        return sum(e - s for s, e in self.ranges.values())

    def to_json(self) -> str:
        return json.dumps(
            {str(p): [s, e] for p, (s, e) in sorted(self.ranges.items())}, separators=(",", ":")
        )


@dataclass
class ReplayOutcome:
    """What one replay wrote, with the figures the checks and the UI need."""

    contract: OffsetContract
    branch: Branch
    run_id: str
    records_read: int
    rows_written: int
    duplicates: int
    quarantined: int
    checksum: str
    per_hour: dict[str, dict[str, int]]
    quarantine_reasons: dict[str, int]
    bytes_read: int
    bytes_written: int
    files_written: int
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def audit_summary(contract: OffsetContract, run_id: str) -> dict[str, str]:
    """What every snapshot a replay commits records about itself (without the prefix)."""
    return {
        "run-id": run_id,
        "topic": contract.topic,
        "window": f"{contract.start.isoformat()}/{contract.end.isoformat()}",
        "offsets": contract.to_json(),
    }


def branch_write_stats(spark: SparkSession, branch: Branch) -> dict[str, int]:
    """Numeric figures of the snapshot at the head of ``branch`` (files and bytes added...)."""
    row = spark.sql(
        f"SELECT s.summary FROM {branch.table}.snapshots s JOIN {branch.table}.refs r "
        f"ON s.snapshot_id = r.snapshot_id WHERE r.name = '{branch.name}'"
    ).first()
    summary = dict(row[0]) if row is not None else {}
    return {k: int(v) for k, v in summary.items() if v.isdigit()}


def table_ddl(spec: TopicSpec, spark_name: str) -> str:
    cols = [f"{name} {ctype}" for name, ctype in KAFKA_COLUMNS]
    cols += [f"{c.name} {_SPARK_TYPES[c.type]}" for c in spec.columns]
    cols.append("ingest_run_id string")
    return (
        f"CREATE TABLE IF NOT EXISTS {spark_name} ({', '.join(cols)}) USING iceberg "
        "PARTITIONED BY (hours(kafka_timestamp)) "
        "TBLPROPERTIES ('format-version'='2', 'write.wap.enabled'='true')"
    )


def quarantine_ddl(spark_name: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {spark_name} (topic string, kafka_partition int, "
        "kafka_offset bigint, kafka_timestamp timestamp, kafka_key binary, kafka_value binary, "
        "reason string, ingest_run_id string) USING iceberg "
        "PARTITIONED BY (hours(kafka_timestamp)) TBLPROPERTIES ('format-version'='2')"
    )


def offset_contract(
    kafka: KafkaResource, topic: str, start: datetime, end: datetime
) -> OffsetContract:
    """Map a Kafka-time window to per-partition offsets via ListOffsets-by-timestamp."""
    if end > datetime.now(UTC):
        raise ReplayError(
            f"window {start.isoformat()}..{end.isoformat()} of topic {topic!r} has not closed "
            "yet; backfill only hours that have ended"
        )
    lo = kafka.offsets_for_times(topic, int(start.timestamp() * 1000))
    hi = kafka.offsets_for_times(topic, int(end.timestamp() * 1000))
    return OffsetContract(topic, start, end, {p: (lo[p], hi[p]) for p in sorted(lo)})


def read_contract(spark: SparkSession, settings: Settings, contract: OffsetContract) -> DataFrame:
    """Spark's Kafka batch source over exactly the contract's offsets (read in executors)."""
    topic = contract.topic
    parts = sorted(contract.ranges)
    reader = spark.read.format("kafka")
    for key, value in settings.kafka.spark_options().items():
        reader = reader.option(key, value)
    return (
        reader.option("assign", json.dumps({topic: parts}))
        .option(
            "startingOffsets", json.dumps({topic: {str(p): contract.ranges[p][0] for p in parts}})
        )
        .option(
            "endingOffsets", json.dumps({topic: {str(p): contract.ranges[p][1] for p in parts}})
        )
        .option("failOnDataLoss", "true")
        .option("includeHeaders", "false")
        .load()
    )


def chunk_contract(contract: OffsetContract, max_records: int) -> list[OffsetContract]:
    """Split a contract into consecutive pieces of at most ``max_records`` offsets, each
    advancing every partition in proportion to what it has left."""
    if max_records <= 0:
        raise ReplayError("max_records must be positive")
    pos = {p: s for p, (s, _) in contract.ranges.items()}
    end = {p: e for p, (_, e) in contract.ranges.items()}
    pieces = []
    while any(pos[p] < end[p] for p in pos):
        left = {p: end[p] - pos[p] for p in pos}
        total = sum(left.values())
        budget = min(max_records, total)
        take = {p: (left[p] * budget) // total for p in pos}
        # Hand out what integer division left over, one offset at a time.
        spare = budget - sum(take.values())
        for p in sorted(pos, key=lambda q: left[q] - take[q], reverse=True):
            if spare == 0:
                break
            if take[p] < left[p]:
                take[p] += 1
                spare -= 1
        pieces.append(
            OffsetContract(
                contract.topic,
                contract.start,
                contract.end,
                {p: (pos[p], pos[p] + take[p]) for p in sorted(pos)},
            )
        )
        pos = {p: pos[p] + take[p] for p in pos}
    return pieces


def read_throttled(
    spark: SparkSession,
    settings: Settings,
    contract: OffsetContract,
    max_records_per_s: int,
    chunk_seconds: float = 5.0,
) -> tuple[DataFrame, list[DataFrame]]:
    """Read the contract chunk by chunk so the read rate stays at or under the cap.

    Each chunk (``cap * chunk_seconds`` offsets) is read and cached, then the reader sleeps
    until the elapsed time matches the records read so far at the cap. Returns the union of
    the chunks and the cached pieces (to unpersist when done).
    """
    pieces = chunk_contract(contract, max(1, int(max_records_per_s * chunk_seconds)))
    began = time.monotonic()
    done = 0
    cached: list[DataFrame] = []
    for piece in pieces:
        frame = read_contract(spark, settings, piece).persist()
        frame.count()
        cached.append(frame)
        done += piece.records
        pause = done / max_records_per_s - (time.monotonic() - began)
        if pause > 0:
            time.sleep(pause)
    if not cached:
        return read_contract(spark, settings, contract), []
    union = cached[0]
    for frame in cached[1:]:
        union = union.unionByName(frame)
    return union, cached


def parse(spec: TopicSpec, raw: DataFrame, run_id: str) -> tuple[DataFrame, DataFrame]:
    """Split Kafka records into (table rows, quarantine rows), upcast to the latest schema.

    Duplicates are not removed here (see :func:`deduplicate`).
    """
    from pyspark.sql import functions as F

    value_str = F.col("value").cast("string")
    df = raw.select(
        F.col("topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        F.col("key").alias("kafka_key"),
        F.col("value").alias("kafka_value"),
        F.col("value").isNull().alias("is_tombstone"),
        F.try_parse_json(value_str).alias("_v"),
    )
    v = F.col("_v")
    version = F.try_variant_get(v, f"$.{spec.version_field}", "int")
    df = df.withColumn("schema_version", version)
    versions = sorted(spec.upcasters)
    upcast = {ver: spec.upcaster(ver)(v) for ver in versions}
    for col in spec.columns:
        expr: Column | None = None
        for ver in versions:
            branch = upcast[ver].get(col.name, F.lit(None))
            expr = (
                F.when(version == ver, branch)
                if expr is None
                else expr.when(version == ver, branch)
            )
        assert expr is not None
        df = df.withColumn(col.name, expr.cast(_SPARK_TYPES[col.type]))
    key_str = F.col("kafka_key").cast("string")
    df = df.withColumn(spec.key_field, F.coalesce(F.col(spec.key_field), key_str))
    reason: Column = F.when(F.col("is_tombstone"), F.lit(None).cast("string"))
    reason = reason.when(v.isNull(), F.lit("invalid_json"))
    reason = reason.when(
        version.isNull() | ~version.isin(versions),
        F.concat(F.lit("unknown_schema_version:"), F.coalesce(version.cast("string"), F.lit("?"))),
    )
    for col in spec.columns:
        c = F.col(col.name)
        if not col.nullable:
            reason = reason.when(c.isNull(), F.lit(f"missing_or_invalid:{col.name}"))
        if col.allowed is not None:
            reason = reason.when(~c.isin(list(col.allowed)), F.lit(f"not_allowed:{col.name}"))
        if col.min is not None:
            reason = reason.when(c < F.lit(col.min), F.lit(f"below_min:{col.name}"))
        if col.max is not None:
            reason = reason.when(c > F.lit(col.max), F.lit(f"above_max:{col.name}"))
    df = df.withColumn("_reason", reason).withColumn("ingest_run_id", F.lit(run_id))
    quarantine = df.where(F.col("_reason").isNotNull()).select(
        "topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_timestamp",
        "kafka_key",
        "kafka_value",
        F.col("_reason").alias("reason"),
        "ingest_run_id",
    )
    table_cols = [name for name, _ in KAFKA_COLUMNS] + [c.name for c in spec.columns]
    rows = df.where(F.col("_reason").isNull()).select(*table_cols, "ingest_run_id")
    # Tombstones carry only the key; their payload columns stay NULL.
    return rows, quarantine


def deduplicate(spec: TopicSpec, rows: DataFrame) -> DataFrame:
    """Keep the lowest offset of every event id (producer retries repeat the same event)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy(spec.event_id_field).orderBy("kafka_partition", "kafka_offset")
    events = rows.where(~F.col("is_tombstone"))
    kept = events.withColumn("_n", F.row_number().over(order)).where(F.col("_n") == 1).drop("_n")
    return kept.unionByName(rows.where(F.col("is_tombstone")))


def checksum_expr(spec: TopicSpec) -> Column:
    """Order-independent checksum: the sum of a 64-bit hash of every row's key columns."""
    from pyspark.sql import functions as F

    cols = ["kafka_partition", "kafka_offset", "is_tombstone", *[c.name for c in spec.columns]]
    return F.coalesce(
        F.sum(F.xxhash64(*[F.col(c) for c in cols]).cast("decimal(38,0)")), F.lit(0)
    ).cast("string")


def window_filter(contract: OffsetContract) -> Column:
    from pyspark.sql import functions as F

    start = contract.start.astimezone(UTC).replace(tzinfo=None)
    end = contract.end.astimezone(UTC).replace(tzinfo=None)
    return (F.col("kafka_timestamp") >= F.lit(start)) & (F.col("kafka_timestamp") < F.lit(end))


def replay_to_branch(
    spark: SparkSession,
    *,
    settings: Settings,
    kafka: KafkaResource,
    iceberg: IcebergResource,
    spec: TopicSpec,
    start: datetime,
    end: datetime,
    run_id: str,
) -> ReplayOutcome:
    """Steps 1-4: contract, read, parse, write the window to a run branch (main untouched)."""
    from pyspark.sql import functions as F

    began = time.monotonic()
    table = iceberg.spark_name(spec.raw_table)
    qtable = iceberg.spark_name(spec.quarantine_table)
    spark.sql(
        f"CREATE NAMESPACE IF NOT EXISTS {settings.catalog.name}.{settings.catalog.namespace}"
    )
    spark.sql(table_ddl(spec, table))
    spark.sql(quarantine_ddl(qtable))

    contract = offset_contract(kafka, spec.topic, start, end)
    chunks: list[DataFrame] = []
    if settings.replay_max_records_per_s:
        source, chunks = read_throttled(
            spark, settings, contract, settings.replay_max_records_per_s
        )
    else:
        source = read_contract(spark, settings, contract)
    raw = source.persist()
    try:
        stats = raw.agg(
            F.count("*").alias("n"),
            F.coalesce(
                F.sum(
                    F.coalesce(F.length("value"), F.lit(0)) + F.coalesce(F.length("key"), F.lit(0))
                ),
                F.lit(0),
            ).alias("bytes"),
        ).first()
        assert stats is not None
        records_read, bytes_read = int(stats["n"]), int(stats["bytes"])
        rows, quarantine = parse(spec, raw, run_id)
        rows = deduplicate(spec, rows).persist()
        quarantine = quarantine.persist()
        n_rows = rows.count()
        n_quarantined = quarantine.count()
        duplicates = records_read - n_quarantined - n_rows
        checksum = rows.agg(checksum_expr(spec)).first()[0]  # type: ignore[index]
        per_hour = _per_hour(raw, rows, quarantine)
        reasons = {
            r["reason"]: int(r["n"])
            for r in quarantine.groupBy("reason").agg(F.count("*").alias("n")).collect()
        }

        props = audit_summary(contract, run_id)
        qwriter = quarantine.writeTo(qtable)
        for key, value in props.items():
            qwriter = qwriter.option(f"snapshot-property.{SUMMARY_PREFIX}{key}", value)
        qwriter.overwrite(window_filter(contract))

        branch = open_branch(spark, table, run_id)
        writer = rows.writeTo(branch.ident)
        for key, value in props.items():
            writer = writer.option(f"snapshot-property.{SUMMARY_PREFIX}{key}", value)
        writer.overwrite(window_filter(contract))
        written = branch_write_stats(spark, branch)
    finally:
        raw.unpersist()
        for chunk in chunks:
            chunk.unpersist()
    rows.unpersist()
    quarantine.unpersist()
    return ReplayOutcome(
        contract=contract,
        branch=branch,
        run_id=run_id,
        records_read=records_read,
        rows_written=n_rows,
        duplicates=duplicates,
        quarantined=n_quarantined,
        checksum=str(checksum),
        per_hour=per_hour,
        quarantine_reasons=reasons,
        bytes_read=bytes_read,
        bytes_written=written.get("added-files-size", 0),
        files_written=written.get("added-data-files", 0),
        duration_s=time.monotonic() - began,
    )


def _per_hour(raw: DataFrame, rows: DataFrame, quarantine: DataFrame) -> dict[str, dict[str, int]]:
    """Per Kafka-time hour: records read, rows written, quarantined, duplicates."""
    from pyspark.sql import functions as F

    def counts(df: DataFrame) -> dict[str, int]:
        hour = F.date_trunc(
            "hour", F.col("timestamp" if "timestamp" in df.columns else "kafka_timestamp")
        )
        return {
            _hour_key(r["h"]): int(r["n"])
            for r in df.groupBy(hour.alias("h")).agg(F.count("*").alias("n")).collect()
        }

    read, written, quarantined = counts(raw), counts(rows), counts(quarantine)
    out: dict[str, dict[str, int]] = {}
    for hour in sorted(set(read) | set(written) | set(quarantined)):
        r, w, q = read.get(hour, 0), written.get(hour, 0), quarantined.get(hour, 0)
        out[hour] = {"read": r, "written": w, "quarantined": q, "duplicates": r - w - q}
    return out


def _hour_key(value: datetime) -> str:
    return value.replace(tzinfo=UTC).isoformat()
