"""What a real ``dagster-daemon`` running the package's sensors did, read from its instance:
the tests that leave every launch to the sensors (``defs/test_convergence.py``,
``lake/test_cdc_lake.py``) wait on these conditions, never on sleeps.

Start the daemon with :func:`backfill_assets_tests.support.services.dagster_services` (or
``dagster_daemon``, without the webserver) over a workspace whose ``BACKFILL_SPEC`` names the
test's own topics, ``BACKFILL_SENSORS=on`` and a short ``BACKFILL_SENSOR_INTERVAL_S``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import dagster as dg
from dagster._core.scheduler.instigation import InstigatorType, TickStatus

ACTIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
# The sensors whose runs these tests wait for (the archive schedules' runs are not).
SENSOR_SUFFIXES = ("_offset_gaps", "_late_data")


def sensor_ticks(instance: dg.DagsterInstance, name: str, after: float) -> list[Any]:
    """The daemon's finished ticks of sensor ``name`` since ``after`` (epoch seconds), newest
    first (a tick still being evaluated has no outcome yet)."""
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.instigator_name == name:
            ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, after=after)
            return [t for t in ticks if t.status != TickStatus.STARTED]
    return []


def tick_summary(instance: dg.DagsterInstance, sensors: list[str], after: float) -> str:
    """The last three ticks of each of ``sensors`` since ``after``: status, runs, skip reason
    and error, one line each."""
    lines = []
    for name in sensors:
        for tick in sensor_ticks(instance, name, after)[:3]:
            lines.append(
                f"  {name} {tick.status.value} runs={tick.run_ids} "
                f"skip={tick.skip_reason!r} error={tick.error and tick.error.message!r}"
            )
    return "\n".join(lines)


def sensor_runs(
    instance: dg.DagsterInstance,
    statuses: list[dg.DagsterRunStatus] | None = None,
    after: float | None = None,
) -> list[dg.DagsterRun]:
    """Runs the gap and late-data sensors launched, in ``statuses`` (default: any), updated
    since ``after`` (epoch seconds; default: ever)."""
    updated = datetime.fromtimestamp(after, UTC) if after is not None else None
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=statuses or [], updated_after=updated))
    return [r for r in runs if r.tags.get("dagster/sensor_name", "").endswith(SENSOR_SUFFIXES)]


def failures(instance: dg.DagsterInstance, after: float) -> list[str]:
    """One line per sensor-launched run that failed since ``after``: its assets and last
    errors."""
    out = []
    for run in sensor_runs(instance, [dg.DagsterRunStatus.FAILURE], after):
        errors = [
            e.message
            for e in instance.all_logs(run.run_id)
            if e.dagster_event and e.dagster_event.is_failure
        ]
        out.append(f"run {run.run_id} ({run.asset_selection}) failed: {errors[-3:]}")
    return out


def check_results(instance: dg.DagsterInstance, run_ids: list[str]) -> dict[str, list[bool]]:
    """``asset:check`` -> whether each evaluation of it in the runs ``run_ids`` passed."""
    out: dict[str, list[bool]] = {}
    for run_id in run_ids:
        events = instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        for event in events:
            assert event.dagster_event is not None
            evaluation = event.dagster_event.event_specific_data
            key = f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"  # type: ignore[union-attr]
            out.setdefault(key, []).append(bool(evaluation.passed))  # type: ignore[union-attr]
    return out
