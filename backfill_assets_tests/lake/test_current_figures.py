"""The current state's figures and layout, as cheap as Spark Connect allows and no weaker.

* Every figure of a run (rows, keys, touched keys, keys not applied, per-hour counts) comes from
  one Spark action, and each equals what its own aggregation gives alone; the uniqueness and
  ``source_applied`` checks built from them fail on planted faults (a key held twice, a key
  left at an older row, a gone key kept, a touched key missing).
* An existing current-state table is judged from pyiceberg's schema only when it is in the
  current layout with every column at the spec's type; any other table goes to Spark, which
  adds a missing column and refuses a changed type or the old layout as before.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.defs.definitions import SPECS
from backfill_assets.errors import ReplayError
from backfill_assets.lake.write import checks, derived, tables
from backfill_assets.lake.write.wap import Branch
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import DataFrame, SparkSession

# 2026-11-01 05:00 and 06:00 UTC are both 01:00 in New York (the session's zone, conftest).
HOUR = datetime(2026, 11, 1, 5, tzinfo=UTC)
START, END = HOUR, HOUR + timedelta(hours=2)
_PAYLOAD = ("c1", "created", "open", 100, "EUR", "web")
_STATE = (
    "order_id string, event_id string, customer_id string, event_type string, status string, "
    "amount_minor bigint, currency string, channel string, event_time timestamp, "
    "deleted boolean, order_ts timestamp, kafka_timestamp timestamp, kafka_hour timestamp, "
    "kafka_partition int, kafka_offset bigint"
)
_SOURCE = (
    "order_id string, kafka_partition int, kafka_offset bigint, order_ts timestamp, _gone boolean"
)


def _state_row(key: str, hour: int, offset: int, deleted: bool = False) -> tuple[Any, ...]:
    at = HOUR + timedelta(hours=hour)
    return (key, f"e-{key}-{offset}", *_PAYLOAD, at, deleted, at, at, at, 0, offset)


def _source_row(key: str, hour: int, offset: int | None) -> tuple[Any, ...]:
    """A touched key's source row: its latest raw row's position, or gone (``offset`` None)."""
    at = HOUR + timedelta(hours=hour)
    return (key, None, None, None, True) if offset is None else (key, 0, offset, at, False)


def _frames(
    spark: SparkSession, state: list[tuple[Any, ...]], source: list[tuple[Any, ...]]
) -> tuple[DataFrame, DataFrame, DataFrame]:
    raw = spark.createDataFrame(
        [(HOUR + timedelta(hours=h),) for h in (-1, 0, 0, 0, 1, 1, 2)], "kafka_hour timestamp"
    )
    return raw, spark.createDataFrame(state, _STATE), spark.createDataFrame(source, _SOURCE)


def _not_applied_by_definition(state: list[tuple[Any, ...]], source: list[tuple[Any, ...]]) -> int:
    """Rows of source LEFT JOIN state on the key that are not applied: a gone key still held,
    or a live key missing or held at another position."""
    n = 0
    for key, partition, offset, _at, gone in source:
        held: list[tuple[Any, Any] | None] = [(r[13], r[14]) for r in state if r[0] == key]
        for position in held or [None]:
            n += (position is not None) if gone else position != (partition, offset)
    return n


def test_one_action_gives_each_figure_its_own_aggregation_gives(
    spark_session: SparkSession,
) -> None:
    state = [
        _state_row("k1", 0, 10),
        _state_row("k2", 1, 20),
        _state_row("k2", 1, 21),  # a key held twice
        _state_row("k3", 1, 31),  # the source says offset 30
        _state_row("k4", 0, 40),  # the source says gone
        _state_row("k6", -1, 60, deleted=True),  # before the window
        _state_row("k7", 2, 70),  # after it
    ]
    source = [
        _source_row("k1", 0, 10),
        _source_row("k2", 1, 21),
        _source_row("k3", 1, 30),
        _source_row("k4", 0, None),
        _source_row("k5", 1, 50),  # not held at all
    ]
    raw, state_df, source_df = _frames(spark_session, state, source)

    figures = derived.current_figures("order_id", raw, state_df, source_df, START, END)

    hours = [HOUR.isoformat(), (HOUR + timedelta(hours=1)).isoformat()]
    assert figures.per_hour == {
        hours[0]: {"raw_records": 3, "rows": 2},
        hours[1]: {"raw_records": 2, "rows": 3},
    }
    expected_not_applied = _not_applied_by_definition(state, source)
    assert expected_not_applied == 4  # k2's older copy, k3, k4, k5
    assert (figures.rows, figures.keys, figures.source_keys, figures.not_applied) == (
        7,
        6,
        5,
        expected_not_applied,
    )
    # Each figure alone, one Spark action each, as the run measured them before.
    from pyspark.sql import functions as F

    alone = state_df.agg(F.count("*").alias("n"), F.countDistinct("order_id").alias("k")).first()
    assert alone is not None
    assert (alone["n"], alone["k"]) == (figures.rows, figures.keys)
    assert source_df.count() == figures.source_keys
    assert derived._not_applied(source_df, state_df, "order_id").count() == figures.not_applied
    for name, frame in (("raw_records", raw), ("rows", state_df)):
        mine = {h: f[name] for h, f in figures.per_hour.items() if name in f}
        assert derived.rows_per_hour(frame, "kafka_hour", START, END) == mine


@pytest.mark.parametrize("faults", [False, True])
def test_the_checks_fail_on_planted_faults(spark_session: SparkSession, faults: bool) -> None:
    """Clean, both checks pass; with a key held twice (the same row), a key left at an older
    row, a gone key kept and a touched key missing, uniqueness counts the one and
    source_applied the three others."""
    state = [_state_row("k1", 0, 10), _state_row("k2", 1, 20), _state_row("k4", 1, 40)]
    source = [
        _source_row("k1", 0, 10),
        _source_row("k2", 1, 20),
        _source_row("k3", 1, None),
        _source_row("k4", 1, 40),
    ]
    if faults:
        state = [state[0], state[0], _state_row("k2", 1, 19), _state_row("k3", 0, 30)]
    raw, state_df, source_df = _frames(spark_session, state, source)
    figures = derived.current_figures("order_id", raw, state_df, source_df, START, END)

    outcome = derived._current_outcome(SPECS[0], state_df, Branch("t", "b", None), figures)

    checks = {c.name: c for c in outcome.checks}
    assert {n: c.passed for n, c in checks.items()} == {
        "uniqueness": not faults,
        "source_applied": not faults,
        "schema_contract": True,
    }
    assert checks["uniqueness"].summary == f"{int(faults)} repeated order_id"
    assert checks["source_applied"].metadata == {"source_keys": 4, "not_applied": 3 * faults}
    assert outcome.metadata == {"source_keys": 4, "rows": len(state)}


@pytest.mark.parametrize("known_types", [False, True])
def test_the_contract_counted_with_the_figures_is_pandera_s_report(
    spark_session: SparkSession, known_types: bool
) -> None:
    """The live rows' contract is counted in the figures' one action (the deleted key's row
    left out), and its report is the one schema_contract gives reading them on its own: a
    status outside the allowed ones, a negative amount and a missing event id each fail."""
    from pyspark.sql import functions as F

    spec = SPECS[0]
    state = [
        _state_row("k1", 0, 10),
        (*_state_row("k2", 1, 20)[:4], "bogus", *_state_row("k2", 1, 20)[5:]),
        (*_state_row("k3", 1, 30)[:5], -5, *_state_row("k3", 1, 30)[6:]),
        ("k4", None, *_state_row("k4", 0, 40)[2:]),
        (*_state_row("k5", 0, 50, deleted=True)[:5], -7, *_state_row("k5", 0, 50)[6:]),
    ]
    raw, state_df, source_df = _frames(spark_session, state, [_source_row("k1", 0, 10)])
    types = {c.name: dict(state_df.dtypes)[c.name] for c in spec.columns} if known_types else None
    figures = derived.current_figures(
        "order_id", raw, state_df, source_df, START, END, spec.columns, types
    )
    live = state_df.where(~F.col("deleted")).select(*[c.name for c in spec.columns])
    alone = checks.schema_contract(live, spec.columns).metadata["violations"]
    assert figures.contract == alone
    assert len(alone) == 3, alone
    outcome = derived._current_outcome(spec, state_df, Branch("t", "b", None), figures)
    (contract,) = [c for c in outcome.checks if c.name == "schema_contract"]
    assert not contract.passed and contract.metadata["violations"] == alone
    assert (
        derived.current_figures("order_id", raw, state_df, source_df, START, END).contract is None
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
