"""The north star's floor: the Spark jobs a user would write by hand for the same outputs as the
backfill (bench/northstar.py ``--hand-written``), each timed, each written to Iceberg.

1. **raw**: the contract's offsets read from Kafka (``read_committed``, as the backfill reads),
   ``from_json`` with the topic's columns (``event_time`` epoch millis -> timestamp), the
   records the topic's contract refuses filtered out (a NULL required field, a value outside
   ``allowed``/``min``/``max``, an event time out of range, key + value above
   ``max_record_bytes``, a tombstone without a key), appended one day at a time to a table
   partitioned by Kafka hour. No quarantine table: refused records are dropped.
2. **events**: the winner per event id by the project's version rule (within a Kafka partition
   the later offset, across partitions the later Kafka timestamp, then the higher partition:
   ``derived.newest``), two windows over the raw table, a cached view under the topic's name
   (the relation the declared SQL reads), shared by the current state and the declared tables.
3. **current**: per key, the latest of the winners and the tombstones by the spec's ``order_by``
   (Kafka time for a tombstone), ties broken by the same version rule; a tombstone (or an event
   matching ``deleted_when``) leaves the key with ``deleted = true``. One
   ``CREATE OR REPLACE TABLE ... AS SELECT``.
4. **each declared table**: its declared SQL (``{start}``/``{end}`` the backfill's range for that
   table), one ``CREATE OR REPLACE TABLE ... AS SELECT`` over the cached events.

No write-audit-publish, no checks, no Dagster, no planner: what the floor leaves out is what the
backfill adds on top.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime
from typing import TYPE_CHECKING

from backfill_assets.spec import declared
from backfill_assets.spec.model import SPARK_TYPES
from backfill_assets.spec.transforms import MAX_EPOCH_MS, MIN_EPOCH_MS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from backfill_assets.lake.offsets.contract import OffsetContract
    from backfill_assets.spec.model import TableSpec, TopicSpec
    from backfill_assets.stack.settings import Settings

NAMESPACE = "bench_hand"
_POSITION = "kafka_timestamp, kafka_partition, kafka_offset"


@dataclasses.dataclass
class Output:
    """One hand-written output: its table (None for the cached events), seconds, rows."""

    name: str
    table: str | None
    seconds: float
    rows: int


def _json_schema(spec: TopicSpec) -> str:
    """``from_json``'s schema: the topic's columns, a timestamp read as its epoch millis."""
    return ", ".join(
        f"`{c.name}` {'bigint' if c.type == 'timestamp' else SPARK_TYPES[c.type]}"
        for c in spec.columns
    )


def _quoted(value: object) -> str:
    return "'" + str(value).replace("'", "''") + "'" if isinstance(value, str) else str(value)


def contract_filter(spec: TopicSpec) -> str:
    """The SQL predicate a row of ``parsed`` must meet to be kept: a tombstone with a key, or
    an event meeting every column's contract; and key + value within ``max_record_bytes``."""
    rules = []
    for c in spec.columns:
        col = f"j.`{c.name}`"
        if not c.nullable:
            rules.append(f"{col} IS NOT NULL")
        if c.allowed is not None:
            rules.append(f"{col} IN ({', '.join(_quoted(v) for v in c.allowed)})")
        if c.min is not None:
            rules.append(f"{col} >= {c.min}")
        if c.max is not None:
            rules.append(f"{col} <= {c.max}")
        if c.type == "timestamp":
            rules.append(f"{col} BETWEEN {MIN_EPOCH_MS} AND {MAX_EPOCH_MS}")
    size = "coalesce(octet_length(key), 0) + coalesce(octet_length(value), 0)"
    event = " AND ".join(f"({r})" for r in rules)
    return (
        f"{size} <= {spec.max_record_bytes} AND ((value IS NULL AND key IS NOT NULL) OR ({event}))"
    )


def _parsed_sql(spec: TopicSpec, view: str) -> str:
    """The raw rows of the Kafka records in ``view``: position, key, the parsed columns."""
    columns = ", ".join(
        f"timestamp_millis(j.`{c.name}`) AS `{c.name}`"
        if c.type == "timestamp"
        else f"j.`{c.name}`"
        for c in spec.columns
    )
    return (
        "SELECT kafka_partition, kafka_offset, kafka_timestamp, kafka_key, "
        f"{columns} FROM (SELECT partition AS kafka_partition, offset AS kafka_offset, "
        "timestamp AS kafka_timestamp, CAST(key AS STRING) AS kafka_key, key, value, "
        f"from_json(CAST(value AS STRING), '{_json_schema(spec)}') AS j FROM {view}) "
        f"WHERE {contract_filter(spec)}"
    )


def write_raw(
    spark: SparkSession,
    settings: Settings,
    spec: TopicSpec,
    contracts: list[OffsetContract],
    table: str,
) -> Output:
    """Each contract (a day) read, parsed, filtered and appended; the first creates the table
    (``writeTo().createOrReplace()``, partitioned by Kafka hour)."""
    from pyspark.sql import functions as F

    from backfill_assets.lake.write.read import read_contract

    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {table.rsplit('.', 1)[0]}")
    view = "_hand_kafka"
    began = time.monotonic()
    for i, contract in enumerate(contracts):
        read_contract(spark, settings, contract).createOrReplaceTempView(view)
        writer = spark.sql(_parsed_sql(spec, view)).writeTo(table)
        if i == 0:
            writer.using("iceberg").partitionedBy(F.hours("kafka_timestamp")).createOrReplace()
        else:
            writer.append()
    seconds = time.monotonic() - began
    spark.catalog.dropTempView(view)
    return Output("raw", table, seconds, spark.table(table).count())  # counted, not timed


def _newest_sql(rows: str, by: str) -> str:
    """``derived.newest`` without ``first`` as SQL over the query ``rows``: per ``by``, the
    last offset of each Kafka partition, then the latest Kafka timestamp, then the higher
    partition. Adds nothing to ``rows``' columns but ``_next`` and ``_n``."""
    return (
        "SELECT * EXCEPT (_next, _n) FROM (SELECT *, row_number() OVER (PARTITION BY "
        f"{by} ORDER BY kafka_timestamp DESC, kafka_partition DESC) AS _n FROM (SELECT *, "
        f"lead(kafka_partition) OVER (PARTITION BY {by} ORDER BY kafka_partition, kafka_offset)"
        f" AS _next FROM ({rows})) WHERE _next IS NULL OR _next <> kafka_partition) WHERE _n = 1"
    )


def cache_events(spark: SparkSession, spec: TopicSpec, raw_table: str) -> Output:
    """The winner of every event id, a cached temporary view named as the topic's relation."""
    columns = ", ".join(f"`{c.name}`" for c in spec.columns)
    events = f"SELECT {columns}, {_POSITION} FROM {raw_table}"
    events += f" WHERE `{spec.event_id_field}` IS NOT NULL"
    began = time.monotonic()
    view = _newest_sql(events, spec.event_id_field)
    spark.sql(f"CREATE OR REPLACE TEMP VIEW `{spec.name}` AS {view}")
    spark.sql(f"CACHE TABLE `{spec.name}`")  # eager: the winners are computed here
    seconds = time.monotonic() - began
    return Output("events (cached)", None, seconds, spark.table(spec.name).count())


def current_sql(spec: TopicSpec, raw_table: str) -> str:
    """The current state over the cached events and the raw table's tombstones."""
    rule = spec.current_rule
    key = rule.key
    payload = [c.name for c in spec.columns if c.name != key]
    cols = ", ".join(f"`{c}`" for c in payload)
    nulls = ", ".join(
        f"CAST(NULL AS {SPARK_TYPES[c.type]}) AS `{c.name}`" for c in spec.columns if c.name != key
    )
    deleted = f"coalesce({rule.deleted_when}, false)" if rule.deleted_when else "false"
    events = (
        f"SELECT `{key}`, {cols}, {deleted} AS deleted, coalesce(`{rule.order_by}`, "
        f"kafka_timestamp) AS order_ts, {_POSITION} FROM `{spec.name}`"
    )
    tombstones = (
        f"SELECT kafka_key AS `{key}`, {nulls}, true AS deleted, kafka_timestamp AS order_ts, "
        f"{_POSITION} FROM {raw_table} WHERE `{spec.event_id_field}` IS NULL"
    )
    latest = (
        "SELECT * EXCEPT (_top) FROM (SELECT *, max(order_ts) OVER (PARTITION BY "
        f"`{key}`) AS _top FROM ({events} UNION ALL {tombstones})) WHERE order_ts = _top"
    )
    return _newest_sql(latest, f"`{key}`")


def _ctas(spark: SparkSession, name: str, table: str, sql: str) -> Output:
    began = time.monotonic()
    spark.sql(f"CREATE OR REPLACE TABLE {table} USING iceberg AS {sql}")
    seconds = time.monotonic() - began
    return Output(name, table, seconds, spark.table(table).count())  # counted, not timed


def write_current(spark: SparkSession, spec: TopicSpec, raw_table: str, table: str) -> Output:
    return _ctas(spark, "current", table, current_sql(spec, raw_table))


def write_declared(
    spark: SparkSession, table_spec: TableSpec, start: datetime, end: datetime, table: str
) -> Output:
    """A declared table's own SQL over ``[start, end)``, as a backfill run renders it."""
    return _ctas(spark, table_spec.name, table, declared.render(table_spec.sql, start, end))


def run(
    spark: SparkSession,
    settings: Settings,
    spec: TopicSpec,
    contracts: list[OffsetContract],
    table_ends: dict[str, tuple[datetime, datetime]],
) -> list[Output]:
    """Every hand-written output in order (raw, events, current, each declared table in
    ``table_ends``: name -> its [start, end)), into ``<catalog>.bench_hand``."""

    def full(name: str) -> str:
        return f"{settings.catalog.name}.{NAMESPACE}.{name}"

    raw = full(spec.raw_table)
    outputs = [write_raw(spark, settings, spec, contracts, raw)]
    outputs.append(cache_events(spark, spec, raw))
    try:
        outputs.append(write_current(spark, spec, raw, full(spec.current_table)))
        tables = {t.name: t for t in spec.tables}
        for name, (start, end) in table_ends.items():
            outputs.append(write_declared(spark, tables[name], start, end, full(name)))
    finally:
        spark.sql(f"UNCACHE TABLE IF EXISTS `{spec.name}`")
        spark.catalog.dropTempView(spec.name)
    return outputs
