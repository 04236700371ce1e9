"""Running raw and table assets over a partition range, and reading a table keyed by offset.

The tests materialize a range of hourly partitions the way the gap sensor and the CLI do (the
``dagster/asset_partition_range_*`` tags), then compare a lake table's rows with what was
produced, keyed by (kafka_partition, kafka_offset).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import dagster as dg

from backfill_assets.lake.coverage.detect import PARTITION_FMT

if TYPE_CHECKING:
    from pyspark.sql import Row, SparkSession

RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
# The raw table's columns plus its event time as epoch milliseconds, to compare with what
# was produced without timezone conversions.
WITH_EVENT_TIME_MS = ("*", "unix_millis(event_time) AS event_time_ms")


def partition_key(hour: str | datetime) -> str:
    """``hour`` as an hourly partition key: a key is returned as it is, a datetime formatted."""
    return hour if isinstance(hour, str) else hour.strftime(PARTITION_FMT)


def materialize_range(
    assets: Sequence[dg.AssetsDefinition],
    instance: dg.DagsterInstance | None,
    first: str | datetime,
    last: str | datetime | None = None,
    *,
    raise_on_error: bool = True,
    resources: Mapping[str, object] | None = None,
    tags: Mapping[str, str] | None = None,
    **kw: Any,
) -> dg.ExecuteInProcessResult:
    """``dg.materialize`` of ``assets`` over the partitions ``first..last`` (``last`` defaults
    to ``first``), as one partition-range run.

    ``resources`` defaults to the project's ``RESOURCES`` (imported here, when first needed);
    ``tags`` are added to the two range tags; ``kw`` goes to ``dg.materialize`` as it is
    (``selection=`` for one).
    """
    if resources is None:
        from backfill_assets.defs.definitions import RESOURCES

        resources = RESOURCES
    return dg.materialize(
        assets,
        resources=resources,
        instance=instance,
        tags={
            RANGE_START_TAG: partition_key(first),
            RANGE_END_TAG: partition_key(last if last is not None else first),
            **(tags or {}),
        },
        raise_on_error=raise_on_error,
        **kw,
    )


def rows_by_offset(
    spark: SparkSession, table: str, *select_exprs: str
) -> dict[tuple[int, int], Row]:
    """The rows of ``table`` (a full name), keyed by (kafka_partition, kafka_offset); with
    ``select_exprs``, the rows of ``table.selectExpr(*select_exprs)``."""
    frame = spark.table(table)
    if select_exprs:
        frame = frame.selectExpr(*select_exprs)
    return {(r["kafka_partition"], r["kafka_offset"]): r for r in frame.collect()}


def dicts_by_offset(
    spark: SparkSession, table: str, *select_exprs: str
) -> dict[tuple[int, int], dict[str, Any]]:
    """:func:`rows_by_offset`, each row as a dict (``Row.asDict()``)."""
    return {k: r.asDict() for k, r in rows_by_offset(spark, table, *select_exprs).items()}
