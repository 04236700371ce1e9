"""Spark and pyiceberg see one catalog: each reads what the other wrote."""

from __future__ import annotations

import sqlite3
import uuid
from typing import TYPE_CHECKING

import pyarrow as pa

from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession


def test_spark_writes_pyiceberg_reads(
    spark_session: SparkSession, iceberg_catalog: Catalog, stack_settings: Settings
) -> None:
    ns = stack_settings.catalog.namespace
    name = f"spark_made_{uuid.uuid4().hex[:8]}"
    spark_session.sql(f"CREATE TABLE lake.{ns}.{name} (id BIGINT, label STRING) USING iceberg")
    spark_session.sql(f"INSERT INTO lake.{ns}.{name} VALUES (1, 'a'), (2, 'b'), (3, NULL)")
    table = iceberg_catalog.load_table(f"{ns}.{name}")
    rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["id"])
    assert rows == [
        {"id": 1, "label": "a"},
        {"id": 2, "label": "b"},
        {"id": 3, "label": None},
    ]
    assert table.current_snapshot() is not None


def test_pyiceberg_writes_spark_reads(
    spark_session: SparkSession, iceberg_catalog: Catalog, stack_settings: Settings
) -> None:
    ns = stack_settings.catalog.namespace
    name = f"py_made_{uuid.uuid4().hex[:8]}"
    schema = pa.schema([pa.field("order_id", pa.string()), pa.field("amount", pa.int64())])
    table = iceberg_catalog.create_table(f"{ns}.{name}", schema=schema)
    table.append(pa.table({"order_id": ["o-1", "o-2"], "amount": [100, 250]}, schema=schema))
    got = spark_session.table(f"lake.{ns}.{name}").orderBy("order_id").collect()
    assert [(r.order_id, r.amount) for r in got] == [("o-1", 100), ("o-2", 250)]
    listed = {r.tableName for r in spark_session.sql(f"SHOW TABLES IN lake.{ns}").collect()}
    assert name in listed


def test_local_catalog_is_sqlite_in_wal_mode(
    iceberg_catalog: Catalog, stack_settings: Settings
) -> None:
    path = stack_settings.catalog.sqlite_path
    assert path is not None and path.is_file()
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
