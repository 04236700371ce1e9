"""The raw and quarantine tables' layout: their DDL, created if missing (``CREATE TABLE IF NOT
EXISTS``, one catalog commit each), and tables in an old layout refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backfill_assets.errors import ReplayError
from backfill_assets.lake.decode.envelope import KAFKA_COLUMNS
from backfill_assets.spec.model import SPARK_TYPES, TopicSpec

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import Schema
    from pyiceberg.types import IcebergType
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

    from backfill_assets.stack.settings import Settings


def table_ddl(spec: TopicSpec, spark_name: str) -> str:
    cols = [f"{name} {ctype}" for name, ctype in KAFKA_COLUMNS]
    cols += [f"{c.name} {SPARK_TYPES[c.type]}" for c in spec.columns]
    cols.append("ingest_run_id string")
    return (
        f"CREATE TABLE IF NOT EXISTS {spark_name} ({', '.join(cols)}) USING iceberg "
        "PARTITIONED BY (hours(kafka_hour)) "
        "TBLPROPERTIES ('format-version'='2', 'write.wap.enabled'='true')"
    )


# Quarantine columns added after the first layout (added in place to older tables): the raw
# bytes' lengths, which stay when maintenance drops the bytes (BACKFILL_QUARANTINE_BYTES_DAYS).
QUARANTINE_ADDED = (("key_bytes", "int"), ("value_bytes", "int"))


def quarantine_ddl(spark_name: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {spark_name} (topic string, kafka_partition int, "
        "kafka_offset bigint, kafka_timestamp timestamp, kafka_hour timestamp, "
        "record_hash bigint, kafka_key binary, kafka_value binary, "
        "reason string, ingest_run_id string, key_bytes int, value_bytes int) USING iceberg "
        "PARTITIONED BY (hours(kafka_hour)) TBLPROPERTIES ('format-version'='2')"
    )


def ensure_tables(
    spark: SparkSession,
    settings: Settings,
    spec: TopicSpec,
    table: str,
    qtable: str,
    catalog: Catalog | None = None,
) -> None:
    """Create the raw and quarantine tables; refuse tables in the old layout, which partitioned
    rows by their own timestamps (not by the window that read them).

    With ``catalog`` (the same catalog, through pyiceberg), tables that exist in the current
    layout are seen from their metadata alone: no Spark SQL statement, each of which costs a
    fresh run process a few hundred milliseconds."""
    names = tuple(c.name for c in spec.columns)  # a column added to the spec: added here
    if catalog is not None and all(
        _current_layout(catalog, name, added) for name, added in ((table, names), (qtable, _ADDED))
    ):
        return
    spark.sql(
        f"CREATE NAMESPACE IF NOT EXISTS {settings.catalog.name}.{settings.catalog.namespace}"
    )
    spark.sql(table_ddl(spec, table))
    spark.sql(quarantine_ddl(qtable))
    missing = [f"{n} {t}" for n, t in QUARANTINE_ADDED if n not in spark.table(qtable).columns]
    if missing:  # one schema update, no data file rewritten; old rows read NULL
        spark.sql(f"ALTER TABLE {qtable} ADD COLUMNS ({', '.join(missing)})")
    for name in (table, qtable):
        if "kafka_hour" not in spark.table(name).columns:
            raise ReplayError(
                f"table {name} has the old layout (rows partitioned by their own Kafka "
                "timestamp, not by the offset window that read them), which can misplace "
                f"records. Drop it (Spark SQL: DROP TABLE {name} PURGE) and backfill again; "
                "the local demo stack can simply be reset by deleting .stack/"
            )
    add_columns(spark, table, [(c.name, SPARK_TYPES[c.type]) for c in spec.columns])


_ADDED = tuple(name for name, _ in QUARANTINE_ADDED)


def add_columns(
    spark: SparkSession,
    table: str,
    columns: list[tuple[str, str]],
    schema: StructType | None = None,
) -> list[str]:
    """Add the ``(name, Spark type)`` columns ``table`` lacks (a column added to the spec:
    NULL in the rows written before; re-run their hours to fill it), in one catalog commit;
    refuse a column whose type changed. ``schema``: the table's, if the caller just read it.
    Returns the names added."""
    schema = spark.table(table).schema if schema is None else schema
    have = {f.name: f.dataType.simpleString() for f in schema.fields}
    changed = {n: (have[n], t) for n, t in columns if n in have and have[n] != t}
    if changed:
        raise ReplayError(
            f"table {table}: the spec changes the type of column(s) {changed} (table, spec); "
            "a column's type cannot change in place: give it another name, or drop the table "
            f"(DROP TABLE {table} PURGE) and backfill again"
        )
    missing = [(n, t) for n, t in columns if n not in have]
    if missing:
        spark.sql(f"ALTER TABLE {table} ADD COLUMNS ({', '.join(f'{n} {t}' for n, t in missing)})")
    return [n for n, _ in missing]


def spark_type(field_type: IcebergType) -> str | None:
    """The Spark type (its ``simpleString``) Iceberg's Spark runtime shows for a column of
    pyiceberg's ``field_type`` (Iceberg's ``TypeToSparkType``), for the types a spec's column
    can have; None for any other type (then only Spark can say)."""
    from pyiceberg import types

    if isinstance(field_type, types.DecimalType):
        return f"decimal({field_type.precision},{field_type.scale})"
    names: dict[type[IcebergType], str] = {
        types.StringType: "string",
        types.LongType: "bigint",
        types.IntegerType: "int",
        types.DoubleType: "double",
        types.BooleanType: "boolean",
        types.TimestamptzType: "timestamp",
    }
    return names.get(type(field_type))


def has_columns(schema: Schema, columns: list[tuple[str, str]]) -> bool:
    """Whether ``schema`` (pyiceberg's, from the catalog's metadata) holds every ``(name, Spark
    type)`` of ``columns`` at that type: then :func:`add_columns` would neither add a column
    nor refuse one. False whenever Spark's answer is needed to tell."""
    have = {f.name: spark_type(f.field_type) for f in schema.fields}
    return all(have.get(name) == spark for name, spark in columns)


def _current_layout(catalog: Catalog, spark_name: str, added: tuple[str, ...] = ()) -> bool:
    """Whether ``catalog.namespace.table`` exists with a ``kafka_hour`` column (and the
    ``added`` ones)."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        table = catalog.load_table(spark_name.split(".", 1)[1])
    except NoSuchTableError:
        return False
    names = {f.name for f in table.schema().fields}
    return "kafka_hour" in names and set(added) <= names
