"""Step 2 of a replay: Spark reads exactly a contract's offsets (Kafka in executors, the archive's
Parquet below Kafka's log start), throttled when asked, and tags each record with the hour whose
offset range holds it. Reads only."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from backfill_assets.errors import ReplayError
from backfill_assets.lake.offsets.archive import Archive
from backfill_assets.lake.offsets.contract import OffsetContract
from backfill_assets.stack.spark import cache_on_disk

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from backfill_assets.stack.settings import Settings


def read_contract(spark: SparkSession, settings: Settings, contract: OffsetContract) -> DataFrame:
    """Exactly the contract's offsets, with Spark's Kafka source schema: offsets below Kafka's
    log start from the archive's Parquet files, the rest from Kafka (read in executors)."""
    from pyspark.sql import functions as F

    archived = contract.archive_ranges
    frames = []
    if not archived or any(e > s for s, e in contract.kafka_ranges.values()):
        frames.append(_read_kafka(spark, settings, contract.topic, contract.kafka_ranges))
    if archived:
        # The log the contract read, never another log's offsets under the same name.
        store = Archive(
            settings, {contract.topic: contract.identity} if contract.identity else None
        )
        paths: list[str] = []
        cond: Column | None = None
        for p, (s, e) in sorted(archived.items()):
            paths += [store.spark_uri(f.path) for f in store.files_for(contract.topic, p, s, e)]
            part = (F.col("partition") == p) & (F.col("offset") >= s) & (F.col("offset") < e)
            cond = part if cond is None else cond | part
        assert cond is not None
        frames.append(
            spark.read.parquet(*paths)
            .where(cond)
            .select("key", "value", "topic", "partition", "offset", "timestamp", "timestampType")
        )
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    return union


def _read_kafka(
    spark: SparkSession, settings: Settings, topic: str, ranges: dict[int, tuple[int, int]]
) -> DataFrame:
    parts = sorted(ranges)
    reader = spark.read.format("kafka")
    for key, value in settings.kafka.spark_options().items():
        reader = reader.option(key, value)
    return (
        reader.option("assign", json.dumps({topic: parts}))
        .option("startingOffsets", json.dumps({topic: {str(p): ranges[p][0] for p in parts}}))
        .option("endingOffsets", json.dumps({topic: {str(p): ranges[p][1] for p in parts}}))
        .option("failOnDataLoss", "true")
        .option("includeHeaders", "false")
        .load()
    )


def chunk_contract(contract: OffsetContract, max_records: int) -> list[OffsetContract]:
    """Split a contract into consecutive pieces of at most ``max_records`` offsets, each
    advancing every partition in proportion to what it has left. A piece is a plain offset
    range: the contract's per-hour windows (and their record counts) describe the whole, so
    pieces do not carry them."""
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
            replace(
                contract,
                ranges={p: (pos[p], pos[p] + take[p]) for p in sorted(pos)},
                windows=None,
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
        frame = cache_on_disk(read_contract(spark, settings, piece))
        frame.count()
        cached.append(frame)
        done += piece.offsets
        pause = done / max_records_per_s - (time.monotonic() - began)
        if pause > 0:
            time.sleep(pause)
    if not cached:
        return read_contract(spark, settings, contract), []
    union = cached[0]
    for frame in cached[1:]:
        union = union.unionByName(frame)
    return union, cached


def record_hash_expr() -> Column:
    """:func:`backfill_assets.lake.offsets.windows.record_hash` in Spark, over the Kafka columns."""
    from pyspark.sql import functions as F

    key, value = F.col("key"), F.col("value")
    return F.xxhash64(F.col("partition"), F.col("offset"), key, value, key.isNull(), value.isNull())


def attribute(spark: SparkSession, source: DataFrame, contract: OffsetContract) -> DataFrame:
    """Tag every record with the hour whose offset range holds it (``kafka_hour``) and with
    its ``record_hash``. A record outside every range gets a NULL hour (the checks count it)."""
    import pyarrow as pa
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StructField, StructType

    from backfill_assets.lake.offsets.windows import as_spark_rows
    from backfill_assets.stack import fetch

    if contract.windows is None:
        raise ReplayError("attribute() needs a contract made by offset_contract()")
    schema = StructType(
        [StructField(n, LongType(), False) for n in ("w_partition", "w_start", "w_end", "w_ms")]
    )
    columns = list(zip(*as_spark_rows(contract.windows), strict=True)) or [(), (), (), ()]
    arrays = {
        name: pa.array(col, pa.int64()) for name, col in zip(schema.names, columns, strict=True)
    }
    cells = fetch.local_frame(spark, pa.table(arrays), schema)
    joined = source.join(
        F.broadcast(cells),
        (F.col("partition") == F.col("w_partition"))
        & (F.col("offset") >= F.col("w_start"))
        & (F.col("offset") < F.col("w_end")),
        "left",
    )
    # The source's columns, then the two tags: the cells' columns dropped by name, so Spark is
    # not asked for the source's columns (over Spark Connect, a round trip).
    return joined.select(
        "*",
        F.timestamp_millis(F.col("w_ms")).alias("kafka_hour"),
        record_hash_expr().alias("record_hash"),
    ).drop(*schema.names)
