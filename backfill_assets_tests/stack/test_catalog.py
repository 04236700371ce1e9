"""Spark and pyiceberg see one catalog: each reads what the other wrote."""

from __future__ import annotations

import sqlite3
import uuid
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest

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


def test_a_commit_that_lost_a_race_is_retried_on_fresh_metadata(
    iceberg_catalog: Catalog, stack_settings: Settings
) -> None:
    """Two writers hold the same metadata and both evolve the schema; the second one's commit
    loses the race (the catalog refuses it), and retry_commit reloads and commits once more:
    both columns land."""
    from pyiceberg.types import LongType

    from backfill_assets.stack.catalog import retry_commit

    ns = stack_settings.catalog.namespace
    ident = f"{ns}.retry_{uuid.uuid4().hex[:8]}"
    iceberg_catalog.create_namespace_if_not_exists(ns)
    first = iceberg_catalog.create_table(ident, schema=pa.schema([("n", pa.int64())]))
    stale = iceberg_catalog.load_table(ident)
    with first.update_schema() as update:
        update.add_column("a", LongType())
    attempts: list[int] = []

    def commit(attempt: int) -> None:
        attempts.append(attempt)
        table = stale if attempt == 0 else iceberg_catalog.load_table(ident)
        with table.update_schema() as update:
            update.add_column("b", LongType())

    retry_commit(commit, attempts=3, backoff_s=0.0)
    assert attempts == [0, 1]
    names = [f.name for f in iceberg_catalog.load_table(ident).schema().fields]
    assert names == ["n", "a", "b"]


def test_retry_commit_raises_what_is_not_a_lost_race_and_the_last_attempt() -> None:
    from pyiceberg.exceptions import CommitFailedException

    from backfill_assets.stack.catalog import retry_commit

    calls: list[int] = []

    def broken(attempt: int) -> None:
        calls.append(attempt)
        raise ValueError("not a conflict")

    with pytest.raises(ValueError, match="not a conflict"):
        retry_commit(broken, attempts=3, backoff_s=0.0)
    assert calls == [0]

    def always_loses(attempt: int) -> None:
        calls.append(attempt)
        raise CommitFailedException("another writer")

    calls.clear()
    with pytest.raises(CommitFailedException):
        retry_commit(always_loses, attempts=3, backoff_s=0.0)
    assert calls == [0, 1, 2]


def test_only_a_rest_catalogs_refusal_is_reported_as_one(
    spark_session: SparkSession, stack_settings: Settings
) -> None:
    """``catalog.refusal`` names BACKFILL_CATALOG_PROPERTIES only for Iceberg's refusal of a
    REST catalog; any other Spark error (a missing table) stays as it is. The JVM's refusal
    itself: ``stack/test_rest_catalog.py`` (cluster tier, a real REST server)."""
    from dataclasses import replace

    from backfill_assets.stack import catalog

    rest = replace(stack_settings.catalog, kind="rest", uri="http://127.0.0.1:9/catalog")
    with pytest.raises(Exception) as caught:
        spark_session.sql(f"SELECT * FROM lake.{rest.namespace}.no_such_table").collect()
    assert catalog.refusal(rest, caught.value) is None
    planted = RuntimeError("org.apache.iceberg.exceptions.NotAuthorizedException: Not authorized")
    assert catalog.refusal(stack_settings.catalog, planted) is None  # a SQL catalog: no REST
    message = str(catalog.refusal(rest, planted))
    assert message.startswith("BACKFILL_CATALOG_PROPERTIES: the REST catalog http://127.0.0.1:9")
    assert "NotAuthorizedException: Not authorized" in message
