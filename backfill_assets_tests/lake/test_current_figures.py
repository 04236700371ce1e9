"""The current state's table layout, as cheap as Spark Connect allows and no weaker.

* An existing current-state table is judged from pyiceberg's schema only when it is in the
  current layout with every column at the spec's type; any other table goes to Spark, which
  adds a missing column and refuses a changed type or the old layout as before.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import pytest

from backfill_assets.defs.definitions import SPECS
from backfill_assets.errors import ReplayError
from backfill_assets.lake.write import derived, tables
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

_STATE = (
    "order_id string, event_id string, customer_id string, event_type string, status string, "
    "amount_minor bigint, currency string, channel string, event_time timestamp, "
    "deleted boolean, order_ts timestamp, kafka_timestamp timestamp, kafka_hour timestamp, "
    "kafka_partition int, kafka_offset bigint"
)


def test_pyiceberg_types_read_as_spark_shows_them(
    spark_session: SparkSession, stack_settings: Settings, iceberg_catalog: Catalog
) -> None:
    """:func:`tables.spark_type` gives, for each type a spec's column can have, the type Spark
    shows for the same Iceberg column; None for the others (then Spark is asked)."""
    ns = stack_settings.catalog.namespace
    name = f"types_{uuid.uuid4().hex[:8]}"
    spark_session.sql(
        f"CREATE TABLE lake.{ns}.{name} (s string, b bigint, i int, d double, f boolean, "
        "t timestamp, m decimal(12,3), z timestamp_ntz, day date, r float) USING iceberg"
    )
    shown = {
        f.name: f.dataType.simpleString() for f in spark_session.table(f"lake.{ns}.{name}").schema
    }
    read = {
        f.name: tables.spark_type(f.field_type)
        for f in iceberg_catalog.load_table(f"{ns}.{name}").schema().fields
    }
    assert read == {n: None if n in ("z", "day", "r") else t for n, t in shown.items()}
    assert shown["z"] == "timestamp_ntz" and shown["t"] == "timestamp"


def _current_ddl(table: str, amount: str = "bigint", without: str = "") -> str:
    cols = [c for c in _STATE.split(", ") if c.split()[0] != without]
    cols = [f"amount_minor {amount}" if c.startswith("amount_minor ") else c for c in cols]
    return f"CREATE TABLE {table} ({', '.join(cols)}) USING iceberg"


def test_an_existing_current_table_is_judged_as_spark_judges_it(
    spark_session: SparkSession, stack_settings: Settings
) -> None:
    """The layout the run writes passes from pyiceberg's schema; a missing column is added, a
    changed type and the old layout are refused, all by Spark as before."""
    spec, ns = SPECS[0], stack_settings.catalog.namespace

    def table() -> str:
        return f"lake.{ns}.current_{uuid.uuid4().hex[:8]}"

    def columns(name: str) -> dict[str, str]:
        return {f.name: f.dataType.simpleString() for f in spark_session.table(name).schema}

    created = table()
    derived._ensure_current_table(spark_session, spec, created)
    laid_out = columns(created)
    derived._ensure_current_table(spark_session, spec, created)  # from its metadata alone
    assert columns(created) == laid_out
    assert laid_out == {n: t for n, t in (c.split() for c in _STATE.split(", "))}

    lacking = table()
    spark_session.sql(_current_ddl(lacking, without="channel"))
    derived._ensure_current_table(spark_session, spec, lacking)
    assert columns(lacking)["channel"] == "string"

    changed = table()
    spark_session.sql(_current_ddl(changed, amount="int"))
    with pytest.raises(ReplayError, match="amount_minor"):
        derived._ensure_current_table(spark_session, spec, changed)

    old = table()
    spark_session.sql(_current_ddl(old, without="kafka_hour"))
    with pytest.raises(ValueError, match="old layout"):
        derived._ensure_current_table(spark_session, spec, old)
