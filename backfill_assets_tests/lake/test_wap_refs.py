"""The write-audit-publish ref commits (issue 49): branches are created, fast-forwarded and
dropped by pyiceberg catalog commits, not Spark statements. Each test injects the fault the
commit's precondition or retry exists for, on a real catalog and a real Spark session."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.errors import MainMoved, PublishError
from backfill_assets.lake.write import wap

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HOUR = timedelta(hours=1)
START = datetime(2026, 5, 1, tzinfo=UTC)


def _table(spark: SparkSession) -> str:
    ns = f"wap_{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS lake.{ns}")
    table = f"lake.{ns}.t"
    spark.sql(f"CREATE TABLE {table} (h timestamp, v bigint) USING iceberg")
    return table


def _branch_with_row(spark: SparkSession, table: str, run_id: str, v: int) -> wap.Branch:
    branch = wap.open_branch(spark, table, run_id)
    spark.sql(f"INSERT INTO {branch.ident} VALUES (TIMESTAMP'2026-05-01 00:00:00', {v})")
    return branch


def _summary(run_id: str, first_hour: int) -> tuple[dict[str, str], tuple[datetime, datetime]]:
    window = (START + first_hour * HOUR, START + (first_hour + 1) * HOUR)
    text = f"{window[0].isoformat()}/{window[1].isoformat()}"
    return {"run-id": run_id, "window": text}, window


def _values(spark: SparkSession, table: str) -> list[int]:
    return sorted(int(r["v"]) for r in spark.table(table).collect())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fast_forward_applies_only_to_the_main_publish_judged(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Run B publishes in the gap between run A's judgement of main and A's fast-forward
    (injected right after A's audit commit). The catalog refuses A's fast-forward (its
    precondition is the main A judged); A's window is then judged against B's: disjoint ->
    MainMoved (the caller rebases), overlapping -> PublishError naming B. Main is B's publish
    either way and A's branch is kept."""
    spark = spark_session
    table = _table(spark)
    a = _branch_with_row(spark, table, "run-a", 1)
    b = _branch_with_row(spark, table, "run-b", 2)
    summary_b, window_b = _summary("run-b", 0 if overlap else 5)
    summary_a, window_a = _summary("run-a", 0)
    real = wap._empty_commit
    published_b: list[int] = []

    def audit_then_b_publishes(tbl: str, ref: str, props: dict[str, str], **kw: Any) -> None:
        real(tbl, ref, props, **kw)
        if ref == a.name and not published_b:
            monkeypatch.setattr(wap, "_empty_commit", real)
            published_b.append(wap.publish(spark, b, summary_b, window_b))

    monkeypatch.setattr(wap, "_empty_commit", audit_then_b_publishes)
    expected = PublishError if overlap else MainMoved
    with pytest.raises(expected) as caught:
        wap.publish(spark, a, summary_a, window_a)

    assert published_b and wap.ref_snapshot_id(spark, table, "main") == published_b[0]
    assert _values(spark, table) == [2]
    assert a.name in wap._iceberg_table(table).metadata.refs
    if overlap:
        assert "run run-b published" in str(caught.value)


def test_a_fast_forward_refuses_a_branch_that_does_not_descend_from_main(
    spark_session: SparkSession,
) -> None:
    """A branch made from an older main is not fast-forwarded onto a newer one, even when the
    caller names the newer main as the one it expects: it would drop B's publish."""
    spark = spark_session
    table = _table(spark)
    a = _branch_with_row(spark, table, "run-a", 1)
    b = _branch_with_row(spark, table, "run-b", 2)
    summary_b, window_b = _summary("run-b", 0)
    main_b = wap.publish(spark, b, summary_b, window_b)

    with pytest.raises(PublishError, match="does not descend from main"):
        wap.fast_forward(table, a.name, main_b)
    assert wap.ref_snapshot_id(spark, table, "main") == main_b
    with pytest.raises(MainMoved):
        wap.fast_forward(table, a.name, a.main_before)


def test_ref_commits_that_lose_a_race_are_retried_on_fresh_metadata(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer commits to the table (a branch of its own) between each ref commit's
    load and its commit. The commit still applies to the catalog's current metadata (the
    catalog applies the change there after checking its precondition, or refuses it as a lost
    race and it is retried on a fresh load): the branch is made, main is fast-forwarded, the
    branch is dropped, and none of the other writer's branches is lost."""
    spark = spark_session
    table = _table(spark)
    a = _branch_with_row(spark, table, "run-a", 1)
    assert a.main_before is not None
    init = a.main_before
    real = wap._iceberg_table
    raced: list[str] = []

    def stale(name: str) -> Any:
        loaded = real(name)
        other = f"other_{len(raced)}"
        real(name).manage_snapshots().create_branch(init, other).commit()
        raced.append(other)
        return loaded

    def racing(fn: Any, *args: Any) -> None:
        monkeypatch.setattr(wap, "_iceberg_table", _once(stale, real))
        fn(*args)
        monkeypatch.setattr(wap, "_iceberg_table", real)

    main_before = wap.ref_snapshot_id(spark, table, "main")
    assert main_before is not None
    racing(wap.set_branch, table, "made", main_before)
    racing(wap.fast_forward, table, a.name, main_before)
    racing(wap.drop_branch, table, "made")

    refs = real(table).metadata.refs
    assert len(raced) == 3 and all(name in refs for name in raced)
    assert "made" not in refs
    assert wap.ref_snapshot_id(spark, table, "main") == refs[a.name].snapshot_id
    assert _values(spark, table) == [1]


def _once(first: Any, then: Any) -> Any:
    calls: list[int] = []

    def call(*args: Any) -> Any:
        calls.append(1)
        return first(*args) if len(calls) == 1 else then(*args)

    return call
