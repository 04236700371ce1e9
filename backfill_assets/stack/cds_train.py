"""The workload that fills the Spark driver's CDS archive (:mod:`backfill_assets.stack.cds`).

Run as ``python -m backfill_assets.stack.cds_train OUT`` by :func:`backfill_assets.stack.cds.build`
in a throwaway environment; the JVM writes the archive to ``OUT`` when it exits.
"""

from __future__ import annotations

import sys
from pathlib import Path

from backfill_assets.stack import spark as spark_mod
from backfill_assets.stack.cds import QUIET
from backfill_assets.stack.settings import Settings


def _train(out: Path) -> None:
    """The workload whose classes go in the archive: what a run does, on a tiny table (Iceberg
    DDL, branch write, metadata tables, fast-forward, VARIANT parse, hashes, a disk cache, a
    pandas UDF, the Kafka source's planning). The archive is written when this JVM exits."""
    import pandas as pd
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    settings = Settings.from_env()
    session = spark_mod.get_session(
        settings,
        {"spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={out} {QUIET}"},
    )
    cat = settings.catalog.name
    table = f"{cat}.cds_train.events"
    session.sql(f"CREATE NAMESPACE IF NOT EXISTS {cat}.cds_train")
    session.sql(
        f"CREATE TABLE {table} (p int, o bigint, h timestamp, k binary, v string, x bigint) "
        "USING iceberg PARTITIONED BY (hours(h)) "
        "TBLPROPERTIES ('format-version'='2', 'write.wap.enabled'='true')"
    )
    rows = session.range(2000).select(
        (F.col("id") % 3).cast("int").alias("p"),
        F.col("id").alias("o"),
        F.timestamp_millis(F.lit(1_780_000_000_000) + F.col("id") * 1000).alias("h"),
        F.col("id").cast("string").cast("binary").alias("k"),
        F.to_json(F.struct(F.col("id").alias("a"), F.lit("x").alias("b"))).alias("v"),
    )
    parsed = rows.select(
        "p",
        "o",
        "h",
        "k",
        "v",
        F.xxhash64("p", "o", "k", "v").alias("x"),
        F.try_variant_get(F.try_parse_json("v"), "$.a", "bigint").alias("a"),
    ).persist(StorageLevel.DISK_ONLY)
    parsed.count()
    parsed.drop("a").writeTo(table).append()
    session.sql(f"ALTER TABLE {table} CREATE BRANCH b1")
    since = F.lit(0).cast("timestamp")
    parsed.drop("a").writeTo(f"{table}.branch_b1").overwrite(F.col("h") >= since)
    session.sql(f"SELECT * FROM {table}.refs").collect()
    session.sql(f"SELECT summary FROM {table}.snapshots").collect()
    session.sql(f"CALL {cat}.system.fast_forward('{table}', 'main', 'b1')").collect()
    session.table(table).groupBy(F.window("h", "1 hour")).agg(
        F.count("*"), F.sum(F.col("x").cast("decimal(38,0)"))
    ).collect()

    def count(frames):  # type: ignore[no-untyped-def]
        for frame in frames:
            yield pd.DataFrame({"n": [len(frame)]})

    parsed.mapInPandas(count, "n long").agg(F.sum("n")).collect()
    parsed.unpersist()
    kafka = session.read.format("kafka").option("kafka.bootstrap.servers", "127.0.0.1:9")
    assert kafka.option("subscribe", "t").load().columns  # plans the source, reads nothing
    session.stop()


if __name__ == "__main__":
    _train(Path(sys.argv[1]))
