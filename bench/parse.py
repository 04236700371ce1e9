"""Micro-benchmark: where the raw parse spends its time, without Kafka, Iceberg or Dagster.

Generates ``--hours`` x ``--events-per-hour`` orders records (the demo generator's planned
records: valid, malformed, tombstones, both schema versions), stores them once as Parquet in the
Kafka source's layout, then times (best of ``--repeat``, noop sink) pieces of
``parse.parse``'s projection against ``from_json`` with a typed schema, in one Spark session.

Run from the repository root (after scripts/bootstrap.sh):
    .venv/bin/python bench/parse.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import UTC, datetime


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=10)
    parser.add_argument("--events-per-hour", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--parse-only",
        action="store_true",
        help="time only the whole parse, once warmed (compare JVM options with it, e.g. "
        'BACKFILL_SPARK_CONF=\'{"spark.driver.extraJavaOptions": '
        '"-XX:+DontCompileHugeMethods"}\')',
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    home = tempfile.mkdtemp(prefix="bench-parse-")
    os.environ.update(
        BACKFILL_HOME=home,
        BACKFILL_JAR_CACHE=os.path.abspath(".stack/jars"),
        PYICEBERG_HOME=home,
    )
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from backfill_assets.demo.generator import GeneratorConfig, plan_events
    from backfill_assets.lake.decode import parse
    from backfill_assets.lake.write import read
    from backfill_assets.spec.loader import load_specs
    from backfill_assets.spec.model import SPARK_TYPES
    from backfill_assets.stack.settings import Settings
    from backfill_assets.stack.spark import get_session

    spark = get_session(Settings.from_env())
    try:
        start = datetime(2026, 9, 1, tzinfo=UTC)
        planned = plan_events(
            GeneratorConfig(start=start, hours=args.hours, events_per_hour=args.events_per_hour)
        )
        rows = [
            (
                r.key,
                r.value,
                "orders",
                r.partition,
                i,
                datetime.fromtimestamp(r.timestamp_ms / 1000, UTC),
                0,
                start,
                1,
            )
            for i, r in enumerate(planned)
        ]
        schema = (
            "key binary, value binary, topic string, partition int, offset bigint, "
            "timestamp timestamp, timestampType int, kafka_hour timestamp, record_hash bigint"
        )
        spark.createDataFrame(rows, schema).repartition(6).write.parquet(f"{home}/src")
        del rows
        src = spark.read.parquet(f"{home}/src")
        n = src.count()
        (spec,) = [s for s in load_specs() if s.topic == "orders"]

        def noop(df: DataFrame) -> None:
            df.write.format("noop").mode("overwrite").save()

        def timed(label: str, fn: Callable[[], None]) -> None:
            best = min(_seconds(fn) for _ in range(args.repeat))
            print(f"  {label:<58} {best:7.2f}s {n / best:10,.0f} rec/s", flush=True)

        cache = parse.cache_on_disk
        parse.cache_on_disk = lambda df: df  # no cache: time the projection itself
        try:
            _, _, parsed = parse.parse(spec, src, "bench")
        finally:
            parse.cache_on_disk = cache
        if args.parse_only:
            noop(parsed)  # warm: class loading, JIT
            print(f"{n:,} records, best of {args.repeat} after one warm-up run:")
            timed("parse: everything (no filter, no cache)", lambda: noop(parsed))
            return
        text = F.col("value").cast("string")
        typed = ", ".join(f"`{c.name}` {SPARK_TYPES[c.type]}" for c in spec.columns)
        print(f"{n:,} records, best of {args.repeat}:")
        timed("source only", lambda: noop(src))
        timed("try_parse_json(value)", lambda: noop(src.select(F.try_parse_json(text))))
        timed("read.record_hash_expr()", lambda: noop(src.select(read.record_hash_expr())))
        timed("parse: schema_version only", lambda: noop(parsed.select("schema_version")))
        timed(
            "parse: typed columns only",
            lambda: noop(parsed.select(*[c.name for c in spec.columns])),
        )
        timed("parse: quarantine reason only", lambda: noop(parsed.select("_reason")))
        timed("parse: everything (no filter, no cache)", lambda: noop(parsed))
        timed(
            "from_json(value, typed schema) (coerces)",
            lambda: noop(src.select(F.from_json(text, typed).alias("j")).select("j.*")),
        )
    finally:
        spark.stop()
        shutil.rmtree(home, ignore_errors=True)


def _seconds(fn: Callable[[], None]) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began


if __name__ == "__main__":
    main()
