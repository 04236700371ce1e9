"""Paired micro-benchmark: the hour-partitioned tables' writer (``wap.hour_writer``: each
task's rows sorted by hour, Iceberg's clustered writer, one open file) against Iceberg's
default for them (the fanout writer: a Parquet writer open per hour a task holds), alternating
in one process on the same cached rows, into two tables of the raw table's layout.

Two shapes: ``--hours 24 --rows 489000`` (the throughput run's raw write: what the sort costs)
and ``--hours 720 --rows 2160`` (a month's small result, every hour in one task: what the
fanout writer's open writers cost). Classic ``local[2]``, the project's session settings with
a 2 GB driver unless ``BACKFILL_SPARK_DRIVER_MEMORY`` says otherwise; the catalog under a
temporary ``BACKFILL_HOME``. Prints each writer's median, the ratio and the load average.

Run from the repository root:
    .venv/bin/python bench/hour_writer.py --hours 24 --rows 489000 --runs 5
    .venv/bin/python bench/hour_writer.py --hours 720 --rows 2160 --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from backfill_assets.lake.offsets.contract import hours_filter
from backfill_assets.lake.write.tables import table_ddl
from backfill_assets.lake.write.wap import hour_writer
from backfill_assets.spec.loader import load_specs
from backfill_assets.stack.settings import Settings
from backfill_assets.stack.spark import get_session

START = datetime(2026, 1, 1, tzinfo=UTC)
VALUES = {
    "string": "concat('v', CAST(id % 9973 AS STRING))",
    "double": "CAST(id AS DOUBLE) / 7",
    "bigint": "id * 31",
    "int": "CAST(id % 100000 AS INT)",
    "boolean": "id % 2 = 0",
    "timestamp": "kafka_hour + make_interval(0, 0, 0, 0, 0, CAST(id % 60 AS INT), 0)",
    "date": "CAST(kafka_hour AS DATE)",
}


def _rows(spark, spec, hours: int, rows: int, where: str):  # type: ignore[no-untyped-def]
    """``rows`` rows of the raw table's layout over ``hours`` hours, cached as Parquet."""
    kafka = spark.range(rows).selectExpr(
        "*",
        f"TIMESTAMP '{START:%Y-%m-%d %H:%M:%S}' + make_interval(0, 0, 0, 0,"
        f" CAST(id % {hours} AS INT), 0, 0) AS kafka_hour",
    )
    cols = [
        f"'{spec.topic}' AS topic",
        "CAST(id % 6 AS INT) AS kafka_partition",
        "id AS kafka_offset",
        "kafka_hour AS kafka_timestamp",
        "kafka_hour",
        "xxhash64(id) AS record_hash",
        "CAST(CAST(id AS STRING) AS BINARY) AS kafka_key",
        "id % 50 = 0 AS is_tombstone",
        "1 AS schema_version",
        *[f"{VALUES.get(c.type, 'NULL')} AS {c.name}" for c in spec.columns],
        "'bench' AS ingest_run_id",
    ]
    kafka.selectExpr(*cols).write.parquet(where)
    return spark.read.parquet(where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--rows", type=int, default=489_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="hour-writer-"))
    os.environ["BACKFILL_HOME"] = str(home)
    os.environ.setdefault("BACKFILL_JAR_CACHE", str(Path(".stack/jars").resolve()))
    settings = Settings.from_env()
    spark = get_session(settings)
    (spec,) = [s for s in load_specs() if s.topic == "orders"]
    cat = settings.catalog
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {cat.name}.{cat.namespace}")
    rows = _rows(spark, spec, args.hours, args.rows, str(home / "rows"))
    window = hours_filter(START, START + timedelta(hours=args.hours))

    def clustered(table: str) -> None:
        hour_writer(rows, table).overwrite(window)

    def fanout(table: str) -> None:
        rows.writeTo(table).overwrite(window)

    forms = {"clustered": clustered, "fanout": fanout}
    seconds: dict[str, list[float]] = {name: [] for name in forms}
    for name in forms:
        spark.sql(table_ddl(spec, f"{cat.name}.{cat.namespace}.{name}"))
    for i in range(args.runs + 1):  # the first round warms up both and is not counted
        for name in forms if i % 2 == 0 else reversed(list(forms)):
            started = time.perf_counter()
            forms[name](f"{cat.name}.{cat.namespace}.{name}")
            if i:
                seconds[name].append(time.perf_counter() - started)
    for name in forms:
        table = f"{cat.name}.{cat.namespace}.{name}"
        files = spark.table(f"{table}.files").selectExpr("count(*)", "sum(record_count)").first()
        assert files is not None and files[1] == args.rows, f"{name}: {files}"
        listed = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(
            f"{name:9} median {statistics.median(seconds[name]):.2f} s  (runs {listed}); "
            f"{files[0]} files"
        )
    ratio = statistics.median(seconds["clustered"]) / statistics.median(seconds["fanout"])
    print(
        f"{args.hours} h, {args.rows:,} rows: clustered / fanout {ratio:.2f}x; "
        f"load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
