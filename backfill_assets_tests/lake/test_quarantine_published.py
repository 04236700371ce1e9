"""Quarantine is published with its data (issue 51 item 5).

A run's quarantine rows are written on its own branch of the quarantine table and published
right after its rows: a re-run that fails its checks leaves the published quarantine as it
was, a rollback takes it back with the rows, and no offset is ever both a row of the raw
table's main and a row of the quarantine's main.

The re-runs quarantine more because the operator tightened the spec (``amount_minor``'s max),
as a team does when a contract changes. Real broker, Spark, catalog and Dagster.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.lake.operations import rollback
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support import small_topic
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _offsets(spark: SparkSession, table: str) -> set[int]:
    hour = int(small_topic.START.timestamp() * 1000)
    rows = spark.sql(
        f"SELECT kafka_offset FROM {table} WHERE unix_millis(kafka_hour) = {hour}"
    ).collect()
    return {int(r[0]) for r in rows}


def _run(spec: TopicSpec, instance: dg.DagsterInstance) -> Any:
    return materialize_range(
        [build_raw_asset(spec)],
        instance,
        small_topic.START,
        small_topic.START + timedelta(hours=1),
        raise_on_error=False,
    )


def test_quarantine_is_published_with_the_rows_and_rolled_back_with_them(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    small_topic.produce(stack_settings, topic)
    spec = renamed(SPECS[0], topic=topic, partition_start=small_topic.START)
    iceberg = CatalogClient()
    raw, quarantine = iceberg.spark_name(spec.raw_table), iceberg.spark_name(spec.quarantine_table)
    spark = spark_session

    def state() -> tuple[set[int], set[int]]:
        spark.sql(f"REFRESH TABLE {raw}")
        spark.sql(f"REFRESH TABLE {quarantine}")
        rows, held = _offsets(spark, raw), _offsets(spark, quarantine)
        assert not rows & held, f"offsets both a row and quarantined on main: {rows & held}"
        return rows, held

    with dg.instance_for_test() as instance:
        first = _run(spec, instance)
        assert first.success
        published = state()
        assert published == (
            set(range(small_topic.EVENTS)),
            {small_topic.EVENTS},
        )  # the cut record is quarantined

        # The contract tightened so that 31 of 61 records break it: the quarantine ratio check
        # fails the run. Its quarantine rows stay on its branch; main's are as published.
        failed = _run(small_topic.with_max(spec, 2_900), instance)
        assert not failed.success
        checks = {e.check_name: e.passed for e in failed.get_asset_check_evaluations()}
        assert checks["quarantine_ratio"] is False
        assert state() == published

        # Tightened less (2 more quarantined, within the ratio): published with its rows.
        second = _run(small_topic.with_max(spec, 5_800), instance)
        assert second.success
        assert state() == (
            set(range(small_topic.EVENTS - 2)),
            {small_topic.EVENTS - 2, small_topic.EVENTS - 1, small_topic.EVENTS},
        )

    # Rolling the second run back takes its quarantine back with its rows.
    ns = stack_settings.catalog.namespace
    rollback.rollback(
        catalog.load(stack_settings.catalog),
        ns,
        run_id=second.run_id,
        table_name=raw,
        specs=[spec],
    )
    assert state() == published


def test_a_quarantine_left_unpublished_is_published_by_the_next_run(
    stack_settings: Settings, spark_session: SparkSession, monkeypatch: Any
) -> None:
    """A run whose rows were published but whose quarantine was not (its process died between
    the two commits; here the quarantine publish fails, which leaves the same state) has its
    quarantine published by the topic's next run, before that run writes its own."""
    from backfill_assets.lake.write import replay

    topic = f"orders_{uuid.uuid4().hex[:8]}"
    small_topic.produce(stack_settings, topic)
    spec = renamed(SPECS[0], topic=topic, partition_start=small_topic.START)
    iceberg = CatalogClient()
    quarantine = iceberg.spark_name(spec.quarantine_table)
    real = replay.publish_quarantine

    def dies(*_args: Any) -> int:
        raise RuntimeError("the process died here")

    with dg.instance_for_test() as instance:
        monkeypatch.setattr(replay, "publish_quarantine", dies)
        first = _run(spec, instance)
        assert first.success  # its rows are published
        spark_session.sql(f"REFRESH TABLE {quarantine}")
        assert _offsets(spark_session, quarantine) == set()
        refs = {r[0] for r in spark_session.sql(f"SELECT name FROM {quarantine}.refs").collect()}
        assert len(refs - {"main"}) == 1, refs  # the run's quarantine branch waits

        monkeypatch.setattr(replay, "publish_quarantine", real)
        later = materialize_range(
            [build_raw_asset(spec)],
            instance,
            small_topic.START + timedelta(hours=1),
            small_topic.START + timedelta(hours=2),
            raise_on_error=False,
        )
        assert later.success
    spark_session.sql(f"REFRESH TABLE {quarantine}")
    assert _offsets(spark_session, quarantine) == {small_topic.EVENTS}
    refs = {r[0] for r in spark_session.sql(f"SELECT name FROM {quarantine}.refs").collect()}
    assert refs == {"main"}


@pytest.mark.slow
def test_a_quarantine_another_run_finished_first_is_not_reported_missing(
    stack_settings: Settings, spark_session: SparkSession, monkeypatch: Any
) -> None:
    """Another run of the topic starts between this run's raw publish and its quarantine
    publish, and its ``finish_quarantine`` publishes this run's quarantine first. This run's
    own publish of it then fails (its branch is gone): it must see that its quarantine is on
    main, not warn that it is "not published yet"."""
    from backfill_assets.lake.write import replay

    topic = f"orders_{uuid.uuid4().hex[:8]}"
    small_topic.produce(stack_settings, topic)
    spec = renamed(SPECS[0], topic=topic, partition_start=small_topic.START)
    quarantine = CatalogClient().spark_name(spec.quarantine_table)
    real = replay.publish_quarantine
    finished: list[list[str]] = []

    def raced(spark: Any, qbranch: Any, window: Any, summary: dict[str, str]) -> int:
        if not finished:  # the other run's finish comes first (and calls this again)
            finished.append([])
            finished[0] = replay.finish_quarantine(spark, CatalogClient(), spec)
        return real(spark, qbranch, window, summary)

    with dg.instance_for_test() as instance:
        monkeypatch.setattr(replay, "publish_quarantine", raced)
        run = _run(spec, instance)
        assert run.success
        assert finished == [[run.run_id]]  # the other run did publish it
        messages = [e.message for e in instance.all_logs(run.run_id) if e.message]
    assert not [m for m in messages if "not published yet" in m], messages
    spark_session.sql(f"REFRESH TABLE {quarantine}")
    assert _offsets(spark_session, quarantine) == {small_topic.EVENTS}
