"""A class-data-sharing (CDS) archive for the local Spark driver JVM.

A fresh Spark driver spends most of its first seconds loading, verifying and linking classes
(Spark SQL, Iceberg, Parquet, Kafka). The JVM can map them from an archive instead (JDK dynamic
CDS): :func:`build` (``backfill-assets jars cds``, run by scripts/bootstrap.sh) runs a small
Spark workload once with ``-XX:ArchiveClassesAtExit``, and every later local driver JVM starts
with ``-XX:SharedArchiveFile`` (:func:`java_options`, added by
:func:`backfill_assets.stack.spark.spark_config`). A 1-hour run starts its session and does its
first Iceberg work in about half the time (bench/README.md).

The archive is named by what it depends on (pyspark's version, the JVM, the jars), so a change
makes a new one instead of reusing a stale one; an archive the JVM cannot use is ignored
(``-Xshare:auto``), and the JVM's own warnings go to stderr, not to the stdout of a command
that prints JSON. The archive is written to a temporary name and renamed: readers see a whole
file or none. ``BACKFILL_SPARK_CDS=off`` disables it. Only the local driver JVM uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backfill_assets.errors import BackfillError
from backfill_assets.stack import jars
from backfill_assets.stack.settings import Settings

# JVM logging: warnings to stderr (by default they go to stdout).
_QUIET = "-Xlog:disable -Xlog:all=warning:stderr"


class CdsError(BackfillError):
    """The archive could not be built (the project runs without it, only slower to start)."""


def archive_path(settings: Settings) -> Path:
    """Where the archive for this pyspark, JVM and jar set lives (in the jar cache)."""
    import pyspark

    java = os.environ.get("JAVA_HOME") or shutil.which("java") or "java"
    spark_jars = sorted(p.name for p in jars.jars(settings, "spark"))
    key = json.dumps([pyspark.__version__, os.path.realpath(java), spark_jars])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return settings.jar_cache / "cds" / f"spark-driver-{digest}.jsa"


def java_options(settings: Settings) -> str:
    """The driver JVM options that map the archive, or "" (disabled, not local, not built)."""
    if not settings.spark_cds or not settings.spark_master.startswith("local"):
        return ""
    path = archive_path(settings)
    if not path.is_file():
        return ""
    return f"-XX:SharedArchiveFile={path} -Xshare:auto {_QUIET}"


def build(settings: Settings, timeout_s: float = 600) -> tuple[Path, bool]:
    """Build the archive unless it exists; (its path, whether it was built now)."""
    path = archive_path(settings)
    if path.is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cds-train-") as home:
        partial = path.parent / f".{path.name}.{os.getpid()}.partial"
        # The workload runs on its own throwaway local catalog, whatever this process uses.
        env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
        env.update(
            BACKFILL_HOME=home,
            BACKFILL_JAR_CACHE=str(settings.jar_cache),
            PYICEBERG_HOME=home,
            BACKFILL_SPARK_CDS="off",
        )
        began = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "backfill_assets.stack.cds", str(partial)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0 or not partial.is_file() or partial.stat().st_size == 0:
            partial.unlink(missing_ok=True)
            raise CdsError(
                f"building the Spark CDS archive failed after {time.monotonic() - began:.0f}s "
                f"(exit {proc.returncode}); Spark still works, it only starts slower. "
                f"Output: {(proc.stdout + proc.stderr).strip()[-1500:]}"
            )
        os.replace(partial, path)
    return path, True


def _train(out: Path) -> None:
    """The workload whose classes go in the archive: what a run does, on a tiny table (Iceberg
    DDL, branch write, metadata tables, fast-forward, VARIANT parse, hashes, a disk cache, a
    pandas UDF, the Kafka source's planning). The archive is written when this JVM exits."""
    import pandas as pd
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from backfill_assets.stack import spark as spark_mod

    settings = Settings.from_env()
    session = spark_mod.get_session(
        settings,
        {"spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={out} {_QUIET}"},
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
