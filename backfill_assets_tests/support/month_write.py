"""Write a month of quarantine hours in one Spark task through the project's hour writer, on a
driver as small as ``BACKFILL_SPARK_DRIVER_MEMORY`` says; print what was written as JSON.

Run as its own process (``python -m backfill_assets_tests.support.month_write HOURS``): a
local Spark driver's heap is fixed when its JVM starts, and the test session's is 2 GB."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta

from backfill_assets.lake.offsets.contract import hours_filter
from backfill_assets.lake.write.tables import quarantine_ddl
from backfill_assets.lake.write.wap import hour_writer
from backfill_assets.stack.settings import Settings
from backfill_assets.stack.spark import get_session

ROWS_PER_HOUR = 3


def main(hours: int) -> None:
    settings = Settings.from_env()
    spark = get_session(settings)
    cat = settings.catalog
    table = f"{cat.name}.{cat.namespace}.month_write"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {cat.name}.{cat.namespace}")
    spark.sql(quarantine_ddl(table))
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = spark.range(hours * ROWS_PER_HOUR).selectExpr(
        "'orders' AS topic",
        "CAST(id % 12 AS INT) AS kafka_partition",
        "id AS kafka_offset",
        f"TIMESTAMP '{start:%Y-%m-%d %H:%M:%S}' + make_interval(0, 0, 0, 0,"
        f" CAST(id % {hours} AS INT), 0, 0) AS kafka_timestamp",
        "kafka_timestamp AS kafka_hour",
        "xxhash64(id) AS record_hash",
        "CAST(CAST(id AS STRING) AS BINARY) AS kafka_key",
        "CAST(sha2(CAST(id AS STRING), 256) AS BINARY) AS kafka_value",
        "'not json' AS reason",
        "'month-write' AS ingest_run_id",
        "8 AS key_bytes",
        "64 AS value_bytes",
    )
    # A month's rows are a small result: one task holds every hour (the case that ran out of
    # heap with Iceberg's fanout writer).
    hour_writer(rows.coalesce(1), table).overwrite(
        hours_filter(start, start + timedelta(hours=hours))
    )
    files = spark.table(f"{table}.files").selectExpr("count(*)", "sum(record_count)").first()
    assert files is not None  # an aggregate has one row
    driver = {
        "master": spark.conf.get("spark.master"),
        "memory": spark.conf.get("spark.driver.memory"),
    }
    sys.stdout.write(json.dumps({"files": files[0], "rows": files[1], "driver": driver}) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]))
