"""The current-state checks read only the rows of the keys a run touches once main is a publish
checked under the same contract, and still catch a fault anywhere on the run's branch: a
duplicate or a contract violation planted outside the touched keys fails them, as one inside
does, and a main changed outside a publish makes the next run check the whole table."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.defs.definitions import SPECS
from backfill_assets.lake.write import derived, publish, wap
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.slow

START = datetime(2026, 5, 1, tzinfo=UTC)
_RAW_COLUMNS = (
    "event_id string, order_id string, customer_id string, event_type string, status string, "
    "amount_minor bigint, currency string, channel string, event_time timestamp, "
    "kafka_timestamp timestamp, kafka_partition int, kafka_offset bigint, "
    "kafka_hour timestamp, is_tombstone boolean"
)


def _raw_rows() -> list[tuple[Any, ...]]:
    """12 Kafka hours: keys ``a1, a3 .. a9`` only in hours 0-5 (untouched by a run of hours 6-12),
    keys ``b0..b9`` in every hour; one tombstone of ``b9`` in hour 8."""
    rows: list[tuple[Any, ...]] = []
    for offset in range(240):
        hour = offset // 20
        key = f"a{offset % 10}" if hour < 6 and offset % 2 else f"b{offset % 10}"
        at = START + timedelta(hours=hour, minutes=offset % 60)
        place = (at, offset % 2, offset, START + timedelta(hours=hour))
        if hour == 8 and key == "b9":
            rows.append((None, key, *[None] * 7, *place, True))
            continue
        payload = (f"e{offset}", key, "c1", "updated", "open", 100 + offset, "EUR", "web", at)
        rows.append((*payload, *place, False))
    return rows


def _build(
    spark: SparkSession, raw: str, table: str, hours: tuple[int, int]
) -> derived.DerivedOutcome:
    start, end = (START + timedelta(hours=h) for h in hours)
    return derived.build_current(spark, SPECS[0], raw, table, start, end, str(uuid.uuid4()))


def _publish(spark: SparkSession, table: str, outcome: derived.DerivedOutcome) -> None:
    assert all(c.passed for c in outcome.checks), outcome.checks
    window = (START, START + timedelta(hours=6))
    request = publish.derived_request(
        spark, table, outcome, lambda _a: outcome, "first-run", window
    )
    wap.publish(spark, request.branch, request.summary, window)


def _checks(outcome: derived.DerivedOutcome) -> dict[str, bool]:
    return {c.name: c.passed for c in outcome.checks}


def _with_fault(monkeypatch: pytest.MonkeyPatch, spark: SparkSession, statement: str) -> None:
    """After the run's real MERGE, ``statement`` (``{branch}``: the branch) on its branch."""
    merge: Callable[..., None] = derived._merge_current

    def faulty(spark_: SparkSession, branch: wap.Branch, *args: Any) -> None:
        merge(spark_, branch, *args)
        spark.sql(statement.format(branch=branch.ident))

    monkeypatch.setattr(derived, "_merge_current", faulty)


def test_checks_read_the_touched_keys_and_catch_faults_outside_them(
    stack_settings: Settings, spark_session: SparkSession, iceberg_catalog: Any
) -> None:
    ns = f"{stack_settings.catalog.name}.{stack_settings.catalog.namespace}"
    tag = uuid.uuid4().hex[:8]
    raw, table = f"{ns}.raw_checks_{tag}", f"{ns}.current_checks_{tag}"
    spark_session.createDataFrame(_raw_rows(), _RAW_COLUMNS).writeTo(raw).create()

    first = _build(spark_session, raw, table, (0, 6))
    assert first.metadata["checked"] == "whole table"  # nothing checked before: all of it
    _publish(spark_session, table, first)
    assert first.summary == {derived.CHECKED_PROPERTY: derived.checks_fingerprint(SPECS[0])}

    clean = _build(spark_session, raw, table, (6, 12))
    assert _checks(clean) == dict.fromkeys(derived.CURRENT_CHECKS, True), clean.checks
    assert clean.metadata["checked"] == "touched keys"
    assert clean.metadata["checked_rows"] == 10 < clean.metadata["rows"] == 15

    with pytest.MonkeyPatch.context() as mp:  # a duplicate of an untouched key
        _with_fault(
            mp, spark_session, "INSERT INTO {branch} SELECT * FROM {branch} WHERE order_id = 'a1'"
        )
        dup = _build(spark_session, raw, table, (6, 12))
    assert _checks(dup) == {"uniqueness": False, "source_applied": True, "schema_contract": False}
    with pytest.MonkeyPatch.context() as mp:  # a contract violation in an untouched row
        _with_fault(
            mp, spark_session, "UPDATE {branch} SET amount_minor = -5 WHERE order_id = 'a3'"
        )
        bad = _build(spark_session, raw, table, (6, 12))
    assert not _checks(bad)["schema_contract"], bad.checks
    with pytest.MonkeyPatch.context() as mp:  # a duplicate of a touched key
        _with_fault(
            mp, spark_session, "INSERT INTO {branch} SELECT * FROM {branch} WHERE order_id = 'b2'"
        )
        touched = _build(spark_session, raw, table, (6, 12))
    uniqueness = next(c for c in touched.checks if c.name == "uniqueness")
    assert not uniqueness.passed and "outside" not in uniqueness.metadata, uniqueness

    # main changed outside a publish (a duplicate of an untouched key): the whole table again
    spark_session.sql(f"INSERT INTO {table} SELECT * FROM {table} WHERE order_id = 'a5'")
    after = _build(spark_session, raw, table, (6, 12))
    assert after.metadata["checked"] == "whole table"
    assert not _checks(after)["uniqueness"], after.checks
