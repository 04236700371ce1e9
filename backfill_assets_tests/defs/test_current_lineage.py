"""The current state follows its raw table by lineage (issue 51 item 3).

A current-state publish records which raw publish it read (the raw table's main, pinned when
the run starts). When a raw hour is republished without a current-state build after it (a
raw-only materialization, or a run whose current step failed), the gap sensor finds the
current state's hour due, and the run it requests brings the current state back to the raw
winners. Here the raw republish follows a tightened contract (two records now quarantined),
so the stale current state visibly holds keys the raw table no longer has. Real broker,
Spark, catalog and Dagster instance.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import build_gap_sensor
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range
from backfill_assets_tests.support.small_topic import EVENTS, START, produce, with_max

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _requests(
    sensor: dg.SensorDefinition, assets: list[dg.AssetsDefinition], instance: dg.DagsterInstance
) -> list[tuple[list[str], str]]:
    context = dg.build_sensor_context(
        instance=instance,
        resources=RESOURCES,
        definitions=dg.Definitions(assets=assets, sensors=[sensor], resources=RESOURCES),
    )
    return sorted(
        (
            sorted(k.to_user_string() for k in req.asset_selection or []),
            req.tags["dagster/asset_partition_range_start"],
        )
        for req in sensor.evaluate_tick(context).run_requests or []
    )


def test_a_raw_republish_makes_the_current_state_due_and_the_sensor_repairs_it(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    produce(stack_settings, topic)
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    raw_key, current_key = f"raw/{spec.name}", f"lakehouse/{spec.current_table}"
    hour = START.strftime("%Y-%m-%d-%H:%M")
    current = CatalogClient().spark_name(spec.current_table)

    def keys() -> set[str]:
        spark_session.sql(f"REFRESH TABLE {current}")
        rows = spark_session.table(current).where("NOT deleted").select("order_id").collect()
        return {r[0] for r in rows}

    with dg.instance_for_test() as instance:
        assets = build_topic_assets(spec)
        pair = [a for a in assets if a.key.to_user_string() in (raw_key, current_key)]
        assert materialize_range(pair, instance, START, START + timedelta(hours=1)).success
        sensor = build_gap_sensor(spec)
        assert (sorted([raw_key, current_key]), hour) not in _requests(sensor, assets, instance)
        assert {f"o{i}" for i in range(EVENTS)} <= keys()

        # The raw hour alone is republished: o58 and o59 are quarantined now.
        strict = [a for a in build_topic_assets(with_max(spec, 5_800)) if a.key.path[0] == "raw"]
        assert materialize_range(strict, instance, START, START + timedelta(hours=1)).success
        assert {"o58", "o59"} <= keys()  # the current state has not followed yet

        due = _requests(sensor, assets, instance)
        assert ([current_key], hour) in due, due
        only_current = [a for a in assets if a.key.to_user_string() == current_key]
        assert materialize_range(only_current, instance, START, START + timedelta(hours=1)).success
        assert not {"o58", "o59"} & keys()
        assert ([current_key], hour) not in _requests(sensor, assets, instance)


def test_a_raw_run_ending_during_a_tick_is_not_requested_again(
    stack_settings: Settings, spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raw request's run publishes raw, then current. A tick that finds the gaps while the
    run has published raw only sees the current hours due; if the run ends before the tick
    looks at the runs in flight, it must still count as in flight for that tick (the tick reads
    them first), else the hours are requested again as a current-only run (seen under the
    real daemon by the cdc tier: one extra run per phase)."""
    from backfill_assets.defs import sensors
    from backfill_assets.lake.coverage import detect

    topic = f"orders_{uuid.uuid4().hex[:8]}"
    produce(stack_settings, topic)
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    raw_key, current_key = f"raw/{spec.name}", f"lakehouse/{spec.current_table}"
    fmt = "%Y-%m-%d-%H:%M"
    span = f"{START:{fmt}}...{START + timedelta(hours=1):{fmt}}"
    with dg.instance_for_test() as instance:
        assets = build_topic_assets(spec)
        raw = [a for a in assets if a.key.to_user_string() == raw_key]
        # The run's state mid-way: raw published, the current state not yet.
        assert materialize_range(raw, instance, START, START + timedelta(hours=1)).success
        sensor = build_gap_sensor(spec)
        run = dg.DagsterRun(
            job_name="__ASSET_JOB",
            run_id=str(uuid.uuid4()),
            status=dg.DagsterRunStatus.STARTED,
            tags={"dagster/sensor_name": sensor.name, sensors.REQUEST_TAG: f"raw:{span}"},
        )
        instance.add_run(run)
        find = detect.find

        def find_then_the_run_ends(*args: Any, **kwargs: Any) -> Any:
            found = find(*args, **kwargs)
            instance.delete_run(run.run_id)
            instance.add_run(run.with_status(dg.DagsterRunStatus.SUCCESS))
            return found

        monkeypatch.setattr(detect, "find", find_then_the_run_ends)
        requested = _requests(sensor, assets, instance)
        assert not [r for r in requested if r[0] == [current_key]], requested
