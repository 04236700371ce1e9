"""The planner's duration model: its breakdown, its fit over earlier runs and its confidence.
Pure functions: no stack (bench/planner.py measures the predictions against real backfills)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest

from backfill_assets.ops import planner
from backfill_assets.ops.planner import (
    DAEMON_PERIOD_S,
    DAEMON_PHASE_MAX_AGE_S,
    DAEMON_WAIT_S,
    DECLARED_RUN_S,
    DECLARED_WAIT_S,
    RUN_OVERHEAD_S,
    RUN_START_S,
    predict,
)

# Earlier runs on an exact line: 20 s fixed + 100 records/s.
LINE = [(r, 20.0 + r / 100) for r in (100.0, 1_000.0, 5_000.0)]


def _predict(**overrides: object) -> planner.Estimate:
    args: dict[str, object] = {
        "records": 3_000,
        "partitions": 6,
        "runs": 1,
        "concurrency": 2,
        "history": LINE,
        "sample_rate": 1_000.0,
        "declared_tables": 0,
        "declared_walls": [],
    }
    args.update(overrides)
    return predict(**args)  # type: ignore[arg-type]


def test_one_hour_is_one_run_without_the_daemons_wait() -> None:
    est = _predict(records=300, partitions=1)
    assert est.launched_as == "one run"
    raw = est.overhead_s + 300 / est.rate  # about 20 + 3 s (the line through LINE)
    assert raw == pytest.approx(23.0, rel=0.05)
    assert est.breakdown == pytest.approx({"launch": RUN_START_S, "raw runs": raw})
    assert est.total_s == pytest.approx(RUN_START_S + raw)


def test_a_range_waits_for_the_backfill_daemon_before_raw_and_declared_runs() -> None:
    est = _predict(declared_tables=2, declared_walls=[30.0, 40.0, 50.0])
    assert est.launched_as == "backfill"
    assert est.breakdown == pytest.approx(
        {
            "launch": DAEMON_WAIT_S + RUN_START_S,
            "raw runs": est.overhead_s + 3_000 / est.rate,
            "declared tables": DECLARED_WAIT_S + RUN_START_S + 40.0,
        }
    )
    assert est.total_s == pytest.approx(sum(est.breakdown.values()))
    assert "backfill daemon" in est.basis


def test_a_known_daemon_pass_times_the_first_runs_to_the_next_pass() -> None:
    now = 1_000_000.0
    # The daemon's last pass began 10 s ago: the next one is 20.25 s away.
    est = _predict(declared_tables=1, declared_walls=[40.0], daemon_pass=now - 10.0, now=now)
    assert est.breakdown["launch"] == pytest.approx(DAEMON_PERIOD_S - 10.0 + RUN_START_S)
    # The declared tables' runs follow the raw runs without a whole pass.
    assert est.breakdown["declared tables"] == pytest.approx(DECLARED_WAIT_S + RUN_START_S + 40.0)
    assert "ago" in est.basis and "counted as" not in est.basis
    just_missed = _predict(daemon_pass=now - 0.5, now=now)
    assert just_missed.breakdown["launch"] == pytest.approx(DAEMON_PERIOD_S - 0.5 + RUN_START_S)


@pytest.mark.parametrize("age", [DAEMON_PHASE_MAX_AGE_S + 1.0, -5.0])
def test_a_stale_or_future_daemon_pass_counts_the_average_wait(age: float) -> None:
    now = 1_000_000.0
    est = _predict(declared_tables=1, declared_walls=[40.0], daemon_pass=now - age, now=now)
    assert est.breakdown["launch"] == pytest.approx(DAEMON_WAIT_S + RUN_START_S)
    assert "counted as" in est.basis


def test_the_fit_recovers_fixed_cost_and_rate_and_is_confident_inside_its_history() -> None:
    est = _predict()
    # Runs that measure the slope precisely outweigh the prior (10x slower here) almost wholly.
    assert (est.overhead_s, est.rate) == pytest.approx((20.0, 100.0), rel=0.05)
    assert est.confidence == "high"
    assert "3 earlier runs of 100-5,000 records" in est.basis
    assert "99% from their slope" in est.source


# Raw runs of the demo measured by bench/planner.py on 2026-11-26 (records, RUN_START to end):
# below ~2,000 records the walls are noise around the fixed cost (302 records took longer
# than 926), above it they grow by 0.0013 s per record.
DEMO_RUNS = [(926.0, 59.5), (302.0, 66.0), (1_835.0, 73.5), (7_335.0, 80.8)]
DEMO_7D = (51_415.0, 138.8)


def test_noise_among_small_runs_cannot_set_the_slope() -> None:
    est = _predict(history=DEMO_RUNS, records=DEMO_7D[0], runs=1)
    raw = est.breakdown["raw runs"]
    # A plain least-squares line through these runs says 0.0024 s per record: 188 s, +36%.
    assert abs(raw - DEMO_7D[1]) / DEMO_7D[1] <= 0.30
    # Two small runs whose walls differ by 6 s cannot claim 100 records/s for a large run.
    two = _predict(history=[(300.0, 60.0), (900.0, 66.0)], records=50_000, runs=1)
    assert two.rate > 100.0 * 2
    assert "from the prior rate" in two.source


def test_predictions_grow_with_the_work() -> None:
    for history in ([], DEMO_RUNS[:2], DEMO_RUNS, LINE, [(500.0, 70.0), (600.0, 40.0)]):
        totals = [
            _predict(history=history, records=n, runs=1).total_s
            for n in (300, 3_000, 30_000, 300_000, 3_000_000)
        ]
        assert totals == sorted(totals) and len(set(totals)) == len(totals), (history, totals)


def test_a_history_without_a_per_record_cost_keeps_the_prior_rate() -> None:
    est = _predict(history=[(500.0, 70.0), (600.0, 40.0)])
    assert est.rate == pytest.approx(1.0 / planner.PRIOR_S_PER_RECORD)
    assert "no per-record cost visible" in est.source


def test_no_run_costs_more_per_record_than_its_whole_wall() -> None:
    """One large run (the 3-day north star's raw run of 2026-11-27: 859,929 records, about
    60 s) is far faster than the prior rate; the prior must not predict its own range at
    860 s, and a range ten times larger must not be predicted faster."""
    big = [(859_929.0, 60.0)]
    same = _predict(history=big, records=859_929, runs=1)
    assert same.breakdown["raw runs"] <= 60.0 * 1.25
    assert same.rate == pytest.approx(859_929 / 60.0)
    assert "capped at" in same.source
    ten = _predict(history=big, records=8_599_290, runs=1)
    assert ten.breakdown["raw runs"] > same.breakdown["raw runs"]
    # Slow runs leave the prior alone: the cap only binds when a run beats it.
    assert "capped" not in _predict(history=DEMO_RUNS, records=DEMO_7D[0], runs=1).source


def test_runs_beyond_the_history_lower_the_confidence() -> None:
    est = _predict(records=50_000)
    assert est.confidence == "medium"
    assert "beyond them" in est.basis
    assert est.breakdown["raw runs"] == pytest.approx(20.0 + 500.0, rel=0.05)


def test_scattered_history_lowers_the_confidence() -> None:
    noisy = [(100.0, 10.0), (1_000.0, 60.0), (2_000.0, 30.0), (3_000.0, 90.0)]
    est = _predict(history=noisy)
    assert est.confidence in ("medium", "low")
    assert est.confidence != "high"


def test_waves_of_runs_follow_the_concurrency() -> None:
    est = _predict(records=8_000, partitions=400, runs=4, concurrency=2)
    # 4 runs of 2,000 records, 2 at a time: 2 waves of about 20 s + 20 s.
    assert est.breakdown["raw runs"] == pytest.approx(2 * (est.overhead_s + 2_000 / est.rate))
    assert est.breakdown["raw runs"] == pytest.approx(80.0, rel=0.05)


def test_declared_runs_queue_behind_the_raw_runs_and_share_the_slots() -> None:
    """A 30-day range in weekly runs: 5 raw runs then 5 declared runs, 2 at a time (the 30-day
    north star of 2026-11-27 ran like that). Predicting one declared wall after the raw waves
    left out 4 of the 5 declared runs."""
    est = _predict(
        records=10_000, partitions=720, runs=5, declared_tables=2, declared_runs=5,
        declared_walls=[100.0],
    )  # fmt: skip
    w = est.overhead_s + 2_000 / est.rate  # one raw run, about 40 s
    d = DECLARED_WAIT_S + RUN_START_S + 100.0  # one declared run, its creation included
    # Raw runs end at w, w, 2w, 2w, 3w. Declared runs 1 and 3 take the slot freed at 2w, 2
    # and 4 the one freed at 3w, 5 the first slot free again: 2w + 3d in all.
    assert est.breakdown["raw runs"] == pytest.approx(3 * w)
    assert est.breakdown["declared tables"] == pytest.approx(2 * w + 3 * d - 3 * w)
    assert est.total_s == pytest.approx(sum(est.breakdown.values()))


def test_a_declared_run_waits_for_the_raw_runs_it_reads_even_with_free_slots() -> None:
    est = _predict(
        records=4_000, partitions=336, runs=2, concurrency=4, declared_tables=1,
        declared_runs=2, declared_walls=[10.0],
    )  # fmt: skip
    # Two slots stay free while the raw runs work: the declared runs still start after them.
    assert est.breakdown["declared tables"] == pytest.approx(DECLARED_WAIT_S + RUN_START_S + 10.0)


def test_runs_that_share_the_cores_take_turns_at_the_work() -> None:
    """On one machine (local Spark, or a Connect server on it) two runs at a time each go at
    half speed: 4 runs of w seconds alone end at 4w, not at 2w as on a cluster."""
    alone = _predict(records=8_000, partitions=400, runs=4, concurrency=2)
    shared = _predict(records=8_000, partitions=400, runs=4, concurrency=2, shared=True)
    w = shared.overhead_s + 2_000 / shared.rate
    assert alone.breakdown["raw runs"] == pytest.approx(2 * w)
    assert shared.breakdown["raw runs"] == pytest.approx(4 * w)
    # One run has the cores to itself either way.
    one = _predict(records=2_000, partitions=168, runs=1, concurrency=2, shared=True)
    assert one.breakdown["raw runs"] == pytest.approx(w)


def test_shared_declared_runs_still_wait_for_the_raw_runs_they_read() -> None:
    est = _predict(
        records=4_000, partitions=336, runs=2, concurrency=4, declared_tables=1,
        declared_runs=2, declared_walls=[10.0], shared=True,
    )  # fmt: skip
    w = est.overhead_s + 2_000 / est.rate
    d = DECLARED_WAIT_S + RUN_START_S + 10.0
    # The two raw runs share the cores (2w); the declared runs then share them too (2d).
    assert est.breakdown["raw runs"] == pytest.approx(2 * w)
    assert est.breakdown["declared tables"] == pytest.approx(2 * d)


def test_a_declared_runs_cost_follows_the_hours_it_covers() -> None:
    """The north star's history (nineteenth pass): weekly declared runs ~25 s alone, month
    runs ~87 s. A month's declared run was predicted at the weekly median (-27% in all)."""
    walls, lengths = [24.0, 26.0, 25.0, 86.0, 88.0], [168.0, 168.0, 168.0, 720.0, 720.0]
    month = planner._declared_seconds(walls, lengths, 720.0)
    assert month == pytest.approx(87.0, rel=0.02)
    assert planner._declared_seconds(walls, lengths, 168.0) == pytest.approx(25.0, rel=0.05)
    # One length says nothing of the cost per hour: their median, as before.
    assert planner._declared_seconds([24.0, 26.0, 25.0], [168.0] * 3, 720.0) == 25.0
    # Short runs (the late-data sensor's) do not set a month's cost per hour.
    assert planner._declared_seconds([20.0, 24.0], [1.0, 2.0], 720.0) == 22.0
    # A line falling with the hours (noise) is not extrapolated either.
    assert planner._declared_seconds([40.0, 20.0], [6.0, 24.0], 168.0) == 30.0
    assert planner._declared_seconds([], None, 720.0) == DECLARED_RUN_S
    est = _predict(
        records=3_000, partitions=720, runs=1, declared_tables=2, declared_runs=1,
        declared_walls=walls, declared_lengths=lengths, declared_hours=720.0,
    )  # fmt: skip
    assert est.breakdown["declared tables"] == pytest.approx(DECLARED_WAIT_S + RUN_START_S + month)


def test_runs_in_flight_are_averaged_over_a_runs_wall() -> None:
    assert planner.in_flight(100.0, 200.0, [(100.0, 200.0)]) == 1.0
    # Another run over its whole wall, a third over its second half (still running), one
    # before it, one never started: 50 s at 2 runs + 50 s at 3 = 41.7 s of work alone.
    spans = [(100.0, 200.0), (90.0, 210.0), (150.0, None), (10.0, 90.0), (None, None)]
    assert planner.in_flight(100.0, 200.0, spans) == pytest.approx(100.0 / (25.0 + 50.0 / 3))
    # Half alone, half with two others: 50 + 50/3 s of work, not 100 / 2 (the average).
    half = [(0.0, 100.0), (50.0, 100.0), (50.0, 100.0)]
    assert planner.in_flight(0.0, 100.0, half) == pytest.approx(100.0 / (50.0 + 50.0 / 3))
    # Weekly runs two at a time: each wall read alone is half of it.
    run = {"records": 1_000.0, "wall_s": 120.0, "in_flight": 2.0}
    assert planner._alone(run, shared=True) == 60.0
    assert planner._alone(run, shared=False) == 120.0


def test_runs_share_the_cores_on_this_machine_only() -> None:
    from backfill_assets.stack.settings import Settings

    assert planner.shares_cores(Settings.from_env({"BACKFILL_SPARK_MASTER": "local[2]"}))
    here = {"BACKFILL_SPARK_CONNECT": "sc://127.0.0.1:15002"}
    assert planner.shares_cores(Settings.from_env(here))
    cluster = {"BACKFILL_SPARK_CONNECT": "sc://spark-connect.data.svc:15002"}
    assert not planner.shares_cores(Settings.from_env(cluster))
    master = {"BACKFILL_SPARK_MASTER": "spark://spark-master:7077"}
    assert not planner.shares_cores(Settings.from_env(master))


def test_the_history_holds_runs_not_a_fixed_number_of_materializations() -> None:
    """Runs of 168 hours write 168 materializations each: the history still holds every run
    (a real instance, runs of a partitioned asset)."""
    hours = dg.HourlyPartitionsDefinition(start_date="2026-06-01-00:00")

    @dg.asset(partitions_def=hours, backfill_policy=dg.BackfillPolicy.single_run())
    def ranged(context) -> dg.MaterializeResult[None]:  # type: ignore[no-untyped-def]
        # One result of a ranged run: Dagster records it once per hour of the range. (The
        # context is left unannotated: Dagster refuses this module's string annotations.)
        return dg.MaterializeResult(
            metadata={"run": {"records_read": 1_000 * len(context.partition_keys)}}
        )

    keys = hours.get_partition_keys(
        dynamic_partitions_store=None, current_time=datetime(2026, 6, 30, tzinfo=UTC)
    )
    with dg.DagsterInstance.ephemeral() as instance:
        for first in (0, 168, 336, 504):
            result = dg.materialize(
                [ranged],
                instance=instance,
                tags={
                    "dagster/asset_partition_range_start": keys[first],
                    "dagster/asset_partition_range_end": keys[first + 167],
                },
            )
            assert result.success
        assert len(instance.fetch_materializations(ranged.key, limit=1_000).records) == 4 * 168
        history = planner._history(instance, ranged.key)
    assert len(history) == 4
    assert sorted(h["records"] for h in history.values()) == [168_000.0] * 4
    assert [h["hours"] for h in history.values()] == [168.0] * 4
    assert [h["in_flight"] for h in history.values()] == [1.0] * 4  # one after another


def test_without_history_the_defaults_are_said_to_be_defaults() -> None:
    est = _predict(history=[], declared_tables=1, sample_rate=300.0)
    assert (est.overhead_s, est.rate) == (RUN_OVERHEAD_S, 300.0)
    # A sample read faster than the prior rate: a run cannot be faster than the prior.
    fast = _predict(history=[], sample_rate=50_000.0)
    assert fast.rate == pytest.approx(1.0 / planner.PRIOR_S_PER_RECORD)
    assert est.confidence == "low"
    assert "no earlier runs" in est.basis


def test_declared_tables_without_history_cap_the_confidence() -> None:
    assert _predict(declared_tables=1, declared_walls=[30.0]).confidence == "high"
    est = _predict(declared_tables=1)
    assert est.confidence == "medium"
    assert f"default {DECLARED_RUN_S:.0f}s per run" in est.basis
    assert est.breakdown["declared tables"] == pytest.approx(
        DECLARED_WAIT_S + RUN_START_S + DECLARED_RUN_S
    )


def test_backfill_ranges_leave_out_declared_tables_whose_hours_have_not_settled() -> None:
    from backfill_assets.defs.definitions import SPECS

    spec = next(s for s in SPECS if s.topic == "orders")
    start = datetime(2026, 6, 1, tzinfo=UTC)
    one = planner.backfill_ranges(spec, start, start + timedelta(hours=1))
    assert [[k.to_user_string() for k in keys] for keys, _, _ in one] == [
        ["raw/orders", "lakehouse/orders_current"]
    ]
    week = planner.backfill_ranges(spec, start, start + timedelta(days=7))
    assert len(week) > 1 and all(a == start for _, a, _ in week)
