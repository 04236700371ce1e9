"""The pandera contract check gives the same verdict whether pandera validates in the driver
process (small windows), Spark counts the schema's checks translated to expressions (large ones),
or pandera validates inside Spark executors (a schema with a check without translation), and
never validates only part of the rows in the driver."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.lake.write import checks, schema_contract
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import TopicSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

WHEN = datetime(2026, 3, 1, 1, 30, tzinfo=UTC)


def _orders() -> TopicSpec:
    (spec,) = [s for s in load_specs() if s.topic == "orders"]
    return spec


def _row(i: int, **changes: Any) -> dict[str, Any]:
    row = {
        "event_id": f"e{i}",
        "order_id": f"o{i}",
        "customer_id": f"c{i}",
        "event_type": "created",
        "status": "open",
        "amount_minor": 100 * i,
        "currency": "EUR",
        "channel": "web",
        "event_time": WHEN,
    }
    row.update(changes)
    return row


def _frame(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    spec = _orders()
    ddl = ", ".join(f"{c.name} {c.type}" for c in spec.columns)
    names = [c.name for c in spec.columns]
    return spark.createDataFrame([tuple(r[n] for n in names) for r in rows], ddl)


BROKEN = [
    _row(1),
    _row(2, currency="XXX"),
    _row(3, amount_minor=-5),
    _row(4, status="lost"),
    _row(5, event_id=None),
    _row(6, amount_minor=None),
]
EXPECTED = {
    "currency: isin(['EUR', 'USD', 'GBP'])": 1,
    "amount_minor: greater_than_or_equal_to(0)": 1,
    "status: isin(['open', 'paid', 'cancelled'])": 1,
}


def test_driver_spark_and_executors_report_the_same_violations(
    spark_session: SparkSession,
) -> None:
    spec = _orders()
    frame = _frame(spark_session, BROKEN)
    here = checks.schema_contract(frame, spec.columns, at_most=len(BROKEN))
    there = checks.schema_contract(frame, spec.columns)  # no bound: Spark expressions
    assert not here.passed and not there.passed
    assert here.metadata["violations"] == there.metadata["violations"]
    assert (
        schema_contract._violations_in_executors(frame, spec.columns) == here.metadata["violations"]
    )
    violations = here.metadata["violations"]
    for name, n in EXPECTED.items():
        assert violations.get(name) == n, (name, violations)
    # The NULLs of non-nullable columns are named, in whatever words pandera uses.
    assert any(k.startswith("event_id: ") for k in violations), violations
    assert any(k.startswith("amount_minor: ") and "null" in k for k in violations), violations


def test_valid_rows_pass_both_ways(spark_session: SparkSession) -> None:
    spec = _orders()
    frame = _frame(spark_session, [_row(i) for i in range(1, 20)])
    assert checks.schema_contract(frame, spec.columns, at_most=19).passed
    assert checks.schema_contract(frame, spec.columns).passed


def test_an_understated_bound_falls_back_to_the_executors(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bound that lies must not make the driver validate only the first rows."""
    monkeypatch.setattr(schema_contract, "CONTRACT_DRIVER_ROWS", 3)
    spec = _orders()
    rows = [_row(i) for i in range(1, 6)] + [_row(6, currency="XXX")]
    outcome = checks.schema_contract(_frame(spark_session, rows), spec.columns, at_most=2)
    assert not outcome.passed
    assert outcome.metadata["violations"] == {"currency: isin(['EUR', 'USD', 'GBP'])": 1}


def test_a_column_of_another_type_fails_its_type_checks_every_way(
    spark_session: SparkSession,
) -> None:
    """A table whose amount column came out as text, and whose time column as a number."""
    spec = _orders()
    frame = _frame(spark_session, [_row(i) for i in range(1, 4)]).selectExpr(
        *[
            "cast(amount_minor as string) as amount_minor"
            if c.name == "amount_minor"
            else "unix_millis(event_time) as event_time"
            if c.name == "event_time"
            else c.name
            for c in spec.columns
        ]
    )
    here = checks.schema_contract(frame, spec.columns, at_most=3)
    there = checks.schema_contract(frame, spec.columns)
    assert not there.passed
    assert there.metadata["violations"] == here.metadata["violations"]
    assert "event_time: is_datetime" in there.metadata["violations"]
    assert any(k.startswith("amount_minor: dtype") for k in there.metadata["violations"])


def test_a_check_without_a_translation_is_validated_by_pandera_in_executors(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pandera.pandas as pa

    spec = _orders()
    plain = schema_contract.contract_schema

    def with_custom_check(columns: Any) -> pa.DataFrameSchema:
        schema = plain(columns)
        custom = pa.Check(lambda s: s.str.startswith("e"), name="starts_with_e")
        return schema.update_column("event_id", checks=[custom])

    monkeypatch.setattr(schema_contract, "contract_schema", with_custom_check)
    frame = _frame(spark_session, [_row(1), _row(2, event_id="x2")])
    assert schema_contract.contract_violations(with_custom_check(spec.columns), frame) is None
    outcome = checks.schema_contract(frame, spec.columns)
    assert outcome.metadata["violations"] == {"event_id: starts_with_e": 1}
