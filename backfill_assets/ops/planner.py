"""Plan a backfill before running it: the replay contract, whether Kafka still holds it, how
long it should take, what it costs, and a readiness scorecard. Planning reads Kafka metadata,
a small sample of records and the Dagster instance's history; it writes nothing."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
from confluent_kafka import Consumer, TopicPartition

from backfill_assets.defs.assets import backfill_policy, raw_asset_key, table_asset_key
from backfill_assets.errors import WindowError, WindowNotSealed
from backfill_assets.lake.coverage.detect import PARTITION_FMT
from backfill_assets.lake.offsets.archive import Archive
from backfill_assets.lake.offsets.contract import OffsetContract, window_contract
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets.stack.spark import endpoint

SAMPLE_RECORDS = 2000
# Fixed cost of one run (Spark session, branch, checks, publish: RUN_START to RUN_SUCCESS),
# used until history has measured it (bench/latency.py: ~30 s for a 1-hour run of the demo).
RUN_OVERHEAD_S = 30.0
DEFAULT_WRITE_RATIO = 0.6  # Parquet bytes written per Kafka byte read, until measured
# From launch to RUN_START of the first run, by how it is launched (bench/latency.py): a
# single-hour run goes straight to the run queue (dequeued every 1 s, then the run worker
# starts and loads the code); a backfill object first waits for the backfill daemon's pass
# (every 30 s: 15 s on average). The declared tables' runs, which the daemon creates once the
# raw runs they read have ended, do not wait for a whole pass: bench/planner.py measured
# 0.4-3.1 s from the raw run's end to their creation (2026-11-25, 6 h, 24 h and 7 d ranges).
RUN_START_S = 3.5
DAEMON_WAIT_S = 15.0
DECLARED_WAIT_S = 2.0
# The backfill daemon starts a pass every 30 s, plus up to 0.5 s of its sleep loop's step
# (0.25 s on average). A run it created recently marks one pass: the next ones follow at this
# period. Older than DAEMON_PHASE_MAX_AGE_S, the drift (and a daemon restart) make the mark
# worthless and the average wait is counted instead.
DAEMON_PERIOD_S = 30.25
DAEMON_PHASE_MAX_AGE_S = 900.0
BACKFILL_TAG = "dagster/backfill"  # on every run the backfill daemon creates for a backfill
# A ranged run's first and last partition (hourly keys, PARTITION_FMT).
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
# A declared table's run (RUN_START to its end), until history has measured it
# (bench/planner.py: 25.4 s for the declared tables of a 6 h range of the demo on 2026-11-24,
# 15.5 s on 2026-11-25; 30.4 and 31.3 s on two quiet runs of 2026-11-26, where the 16 s then
# used made the 6 h range, the first with declared tables, -28% and -29%).
DECLARED_RUN_S = 30.0
# Confidence: a fit whose median error over its own history is within this is "high", within
# twice this "medium"; extrapolating beyond EXTRAPOLATION x the largest earlier run lowers it.
FIT_ERROR_HIGH = 0.15
EXTRAPOLATION = 3.0
# Seconds per record of a raw run beyond its fixed cost, before history has pinned it down:
# bench/planner.py on the demo (2026-11-26, 7 d against 24 h: 0.0013 s at load 4-6). A slope
# measured from earlier runs replaces it in proportion to how precisely they measure it; runs
# are taken to scatter by at least NOISE_FLOOR_S around their line (the demo's runs of a few
# hundred to a few thousand records scatter by 5-10 s); the prior is trusted within a factor of
# PRIOR_FACTOR (machines and topics differ).
PRIOR_S_PER_RECORD = 0.001
PRIOR_FACTOR = 3.0
NOISE_FLOOR_S = 5.0
# The planner learns from the newest HISTORY_RUNS runs of each table, read from at most
# HISTORY_PAGES pages of HISTORY_PAGE materializations.
HISTORY_RUNS = 20
HISTORY_PAGE = 500
HISTORY_PAGES = 10
IN_FLIGHT_RUNS = 200  # the most runs read to tell how many an earlier run shared the cores with
LOOPBACK = ("127.0.0.1", "localhost")  # a Spark Connect server on this machine
COST_YELLOW_BYTES = 10 * 2**30
COST_RED_BYTES = 100 * 2**30


@dataclass
class Score:
    dimension: str
    color: str  # green | yellow | red
    reason: str


@dataclass
class Plan:
    topic: str
    target_tables: list[str]
    start: str
    end: str
    partitions: int
    offsets: dict[str, list[int]]
    records: int
    estimated_bytes: int
    schema_versions_seen: list[int]
    unknown_versions_seen: list[int]
    expected_rows_at_most: int
    all_in_kafka: bool
    missing_offsets: dict[str, list[int]]
    records_from_archive: int
    records_from_kafka: int
    archive_offsets: dict[str, list[int]]
    drain_rate_records_per_s: float
    run_overhead_s: float
    rate_source: str
    runs: int
    concurrency: int
    predicted_duration_s: float
    window_s: float | None
    fits_window: bool | None
    bytes_written_estimate: int
    files_estimate: int
    scorecard: list[Score] = field(default_factory=list)
    # Why the range cannot be mapped to offsets now (a run would refuse), or None.
    blocked: str | None = None
    # How it would be launched ("one run" for a single hour, else "backfill"), the predicted
    # seconds per phase (they add up to predicted_duration_s) and how far to trust them.
    launched_as: str = "backfill"
    predicted_breakdown: dict[str, float] = field(default_factory=dict)
    confidence: str = "low"
    confidence_basis: str = ""
    # BACKFILL_MAX_HOURS_PER_RUN when planned: the range is cut into runs of at most this.
    hours_per_run: int = 720

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def _sources(self) -> str:
        total = max(self.records, 1)
        text = (
            f"Kafka {self.records_from_kafka:,} ({100 * self.records_from_kafka / total:.0f}%), "
            f"archive {self.records_from_archive:,} "
            f"({100 * self.records_from_archive / total:.0f}%)"
        )
        if self.archive_offsets:
            text += " from " + ", ".join(
                f"p{p}:[{s},{e})" for p, (s, e) in sorted(self.archive_offsets.items())
            )
        if self.missing_offsets:
            text += "; NEITHER holds " + ", ".join(
                f"p{p}:[{s},{e})" for p, (s, e) in sorted(self.missing_offsets.items())
            )
        return text

    def human(self) -> str:
        if self.blocked is not None:
            lines = [
                f"Backfill plan: topic {self.topic!r} -> {', '.join(self.target_tables)}",
                f"  range        {self.start} .. {self.end} ({self.partitions} hourly partitions)",
                "  BLOCKED      a run of this range would refuse and write nothing:",
                f"    {self.blocked}",
                "  readiness",
            ]
            lines += [f"    {s.color:<6} {s.dimension:<10} {s.reason}" for s in self.scorecard]
            return "\n".join(lines)
        lines = [
            f"Backfill plan: topic {self.topic!r} -> {', '.join(self.target_tables)}",
            f"  range        {self.start} .. {self.end} ({self.partitions} hourly partitions)",
            "  offsets      "
            + ", ".join(f"p{p}:[{s},{e})" for p, (s, e) in sorted(self.offsets.items())),
            f"  records      {self.records:,} (~{_size(self.estimated_bytes)}); schema versions "
            f"seen {self.schema_versions_seen or 'none'}"
            + (
                f" (unknown {self.unknown_versions_seen}: quarantined)"
                if self.unknown_versions_seen
                else ""
            )
            + f"; rows <= {self.expected_rows_at_most:,}",
            f"  sources      {self._sources()}",
            f"  drain rate   {self.drain_rate_records_per_s:,.0f} records/s + "
            f"{self.run_overhead_s:.0f}s per run ({self.rate_source})",
            f"  runs         {self.runs} (<= {self.hours_per_run} partitions "
            f"each), {self.concurrency} at a time",
            f"  duration     ~{_duration(self.predicted_duration_s)}"
            + (
                f" against a window of {_duration(self.window_s)}: "
                + ("fits" if self.fits_window else "DOES NOT FIT")
                if self.window_s is not None
                else ""
            )
            + f"; launched as {self.launched_as}",
            "  breakdown    "
            + ", ".join(f"{k} {_duration(v)}" for k, v in self.predicted_breakdown.items()),
            f"  confidence   {self.confidence}: {self.confidence_basis}",
            f"  cost         read {_size(self.estimated_bytes)}, write ~"
            f"{_size(self.bytes_written_estimate)}, ~{self.files_estimate} data files",
            "  readiness",
        ]
        lines += [f"    {s.color:<6} {s.dimension:<10} {s.reason}" for s in self.scorecard]
        return "\n".join(lines)


def target_tables(spec: TopicSpec) -> list[str]:
    """The tables a backfill of the topic writes, in dependency order."""
    from backfill_assets.spec.declared import ordered

    return [spec.raw_table, spec.current_table, *(t.name for t in ordered([spec]))]


def make_plan(
    kafka: KafkaClient,
    spec: TopicSpec,
    start: datetime,
    end: datetime,
    *,
    instance: dg.DagsterInstance | None,
    concurrency: int,
    window: timedelta | None = None,
) -> Plan:
    partitions = int((end - start) / timedelta(hours=1))
    settings = kafka.settings
    try:
        contract = window_contract(
            settings=settings,
            kafka=kafka,
            iceberg=CatalogClient(settings),
            spec=spec,
            start=start,
            end=end,
            decode=False,
        )
    except (WindowError, WindowNotSealed) as err:
        missing_ranges = err.missing if isinstance(err, WindowError) else {}
        return _blocked(spec, start, end, partitions, concurrency, window, str(err), missing_ranges)
    missing: dict[str, list[int]] = {}
    sample = _sample(kafka, contract, spec)
    history = _history(instance, raw_asset_key(spec)) if instance is not None else {}
    per_run_history = [h for h in history.values() if h["records"] >= 0][:20]
    ratios = [h["write_ratio"] for h in per_run_history if h["write_ratio"]]
    ratio = statistics.median(ratios) if ratios else DEFAULT_WRITE_RATIO
    runs = max(1, math.ceil(partitions / _hours_per_run()))
    estimate = _estimate(
        spec, start, end, instance, contract.records, partitions, runs, concurrency,
        per_run_history, sample["rate"], shares_cores(settings),
    )  # fmt: skip
    overhead, rate, source = estimate.overhead_s, estimate.rate, estimate.source
    predicted = estimate.total_s
    est_bytes = int(sample["avg_bytes"] * contract.records)
    window_s = window.total_seconds() if window is not None else None
    fits = None if window_s is None else predicted <= window_s
    plan = Plan(
        topic=spec.topic,
        target_tables=target_tables(spec),
        start=start.isoformat(),
        end=end.isoformat(),
        partitions=partitions,
        offsets={str(p): [s, e] for p, (s, e) in contract.ranges.items()},
        records=contract.records,
        estimated_bytes=est_bytes,
        schema_versions_seen=[v for v in sample["versions"] if v in spec.versions],
        unknown_versions_seen=[v for v in sample["versions"] if v not in spec.versions],
        expected_rows_at_most=contract.records,
        all_in_kafka=not missing and not contract.archive_ranges,
        missing_offsets=missing,
        records_from_archive=contract.archived_records,
        records_from_kafka=contract.records - contract.archived_records,
        archive_offsets={str(p): [s, e] for p, (s, e) in contract.archive_ranges.items()},
        drain_rate_records_per_s=rate,
        run_overhead_s=overhead,
        rate_source=source,
        runs=runs,
        hours_per_run=_hours_per_run(),
        concurrency=concurrency,
        predicted_duration_s=predicted,
        window_s=window_s,
        fits_window=fits,
        bytes_written_estimate=int(est_bytes * ratio),
        files_estimate=partitions * 3,
        launched_as=estimate.launched_as,
        predicted_breakdown=estimate.breakdown,
        confidence=estimate.confidence,
        confidence_basis=estimate.basis,
    )
    plan.scorecard = _scorecard(plan, spec, end)
    return plan


def _hours_per_run() -> int:
    """The most hours one run of a backfill covers (:func:`backfill_policy`)."""
    return backfill_policy().max_partitions_per_run or 1


def _estimate(
    spec: TopicSpec,
    start: datetime,
    end: datetime,
    instance: dg.DagsterInstance | None,
    records: int,
    partitions: int,
    runs: int,
    concurrency: int,
    per_run_history: list[dict[str, Any]],
    sample_rate: float,
    shared: bool = False,
) -> Estimate:
    """:func:`predict` fed from the instance's history of the raw and declared tables' runs.
    With ``shared`` (:func:`shares_cores`), each earlier run's wall is taken as its own work
    times the runs it shared the cores with (``in_flight``): the history is read as one run's
    work alone, and :func:`predict` shares the cores again as the planned runs will."""
    declared = backfill_ranges(spec, start, end)[1:]
    declared_tables = [key for keys, _, _ in declared for key in keys]
    # The backfill daemon puts a range's tables in the same runs, cut at the policy's size.
    per_run = _hours_per_run()
    declared_runs = sum(
        math.ceil(hours / per_run)
        for hours in {int((e - s) / timedelta(hours=1)) for _, s, e in declared}
    )
    # The declared tables' runs (one run may hold several of them: each run counts once).
    runs_of = {
        run_id: h
        for key in declared_tables
        for run_id, h in (_history(instance, key).items() if instance is not None else [])
    }
    earlier = list(runs_of.values())[:20]
    total_hours = sum({int((e - s) / timedelta(hours=1)) for _, s, e in declared})
    return predict(
        daemon_pass=_daemon_pass(instance) if instance is not None else None,
        now=time.time(),
        records=records,
        partitions=partitions,
        runs=runs,
        concurrency=concurrency,
        history=[(h["records"], _alone(h, shared)) for h in per_run_history],
        sample_rate=sample_rate,
        declared_tables=len(declared_tables),
        declared_walls=[_alone(h, shared) for h in earlier],
        declared_runs=declared_runs,
        shared=shared,
        declared_lengths=[h["hours"] for h in earlier],
        declared_hours=total_hours / declared_runs if declared_runs else None,
    )


def _declared_seconds(
    walls: list[float], lengths: list[float] | None, hours: float | None
) -> float:
    """One declared run's seconds over ``hours`` hours, from earlier declared runs' seconds
    (``walls``) and the hours each covered (``lengths``): a line through them when they cover
    two lengths or more, the longest at least half of ``hours``, and it rises with the hours
    from a fixed cost of 0 or more (a week's runs, ~25 s each alone, and a month's, ~87 s:
    0.11 s an hour, nineteenth pass); else their median, whatever the length (one length says
    nothing of the cost per hour, and the late-data sensor's 1-3 hour runs must not set a
    month's).
    DECLARED_RUN_S without earlier runs."""
    if not walls:
        return DECLARED_RUN_S
    if hours is not None and lengths and len(set(lengths)) >= 2 and 2 * max(lengths) >= hours:
        slope, fixed = statistics.linear_regression(lengths, walls)
        if slope > 0 and fixed >= 0:
            return fixed + slope * hours
    return statistics.median(walls)


def _alone(run: dict[str, float], shared: bool) -> float:
    """An earlier run's wall as if it had had the cores to itself (``shared``), else as run."""
    return run["wall_s"] / max(1.0, run.get("in_flight", 1.0)) if shared else run["wall_s"]


def shares_cores(settings: Settings) -> bool:
    """Whether a backfill's concurrent runs share one machine's cores: Spark in the run
    process (``local[...]``) or a Spark Connect server on this machine. Two weekly runs at a
    time on two cores each took about twice as long as alone (bench/HISTORY.md, eighteenth
    pass), so runs there are modelled as sharing; on a cluster they are not."""
    if settings.spark_connect:
        return endpoint(settings.spark_connect)[0] in LOOPBACK
    return settings.spark_master.startswith("local")


@dataclass
class Estimate:
    """The planner's duration model; ``breakdown`` adds up to ``total_s``."""

    overhead_s: float  # fixed seconds per raw run
    rate: float  # records per second within a run
    source: str
    launched_as: str
    breakdown: dict[str, float]
    confidence: str
    basis: str

    @property
    def total_s(self) -> float:
        return sum(self.breakdown.values())


def predict(
    *,
    records: int,
    partitions: int,
    runs: int,
    concurrency: int,
    history: list[tuple[float, float]],
    sample_rate: float,
    declared_tables: int,
    declared_walls: list[float],
    daemon_pass: float | None = None,
    now: float = 0.0,
    declared_runs: int = 1,
    shared: bool = False,
    declared_lengths: list[float] | None = None,
    declared_hours: float | None = None,
) -> Estimate:
    """Launch-to-published seconds of a range launched at ``now`` (epoch seconds), phase by
    phase.

    ``history`` holds (records, wall seconds) of earlier raw runs (RUN_START to RUN_SUCCESS,
    current-state table included); a line through them, its slope pulled towards a prior
    while they leave it uncertain (:func:`_fit`), gives the fixed seconds per run and the
    records per second. ``declared_walls`` are earlier runs of the declared tables the range
    also materializes (``declared_tables`` of them, in ``declared_runs`` runs of
    ``declared_hours`` each; ``declared_lengths``: the hours each earlier run covered, see
    :func:`_declared_seconds`). The runs are
    laid out as the run queue starts them (:func:`_schedule`): ``concurrency`` at a time, in
    the order they were queued, each declared run after the raw runs whose hours it reads;
    with ``shared``, the runs in flight share the cores (the walls given are each run's alone).
    ``daemon_pass`` is when the backfill daemon last started a pass, if known recently: a
    backfill's first runs then wait until the daemon's next pass, otherwise 15 s on average."""
    overhead, rate, source = _fit(history, sample_rate)
    single = partitions == 1
    per_run = records / runs
    if daemon_pass is not None and not 0 <= now - daemon_pass <= DAEMON_PHASE_MAX_AGE_S:
        daemon_pass = None

    # seconds from now to the backfill daemon's next pass
    wait = DAEMON_WAIT_S if daemon_pass is None else (daemon_pass - now) % DAEMON_PERIOD_S
    launch = RUN_START_S if single else wait + RUN_START_S
    raw_wall = overhead + (per_run / rate if rate > 0 else 0.0)
    declared_wall = _declared_seconds(declared_walls, declared_lengths, declared_hours)
    raw_end, declared_end = _schedule(
        [raw_wall] * runs,
        [DECLARED_WAIT_S + RUN_START_S + declared_wall] * (declared_runs if declared_tables else 0),
        concurrency,
        shared,
    )
    breakdown = {"launch": launch, "raw runs": raw_end}
    if declared_tables:
        breakdown["declared tables"] = declared_end - raw_end
    confidence, basis = _confidence(history, overhead, rate, per_run)
    if declared_tables and not declared_walls:
        basis += f"; declared tables: default {DECLARED_RUN_S:.0f}s per run (no earlier runs)"
        confidence = "medium" if confidence == "high" else confidence
    if not single and daemon_pass is None:
        basis += (
            f"; the backfill daemon's pass (every 30 s) adds 0-30 s before the first runs, "
            f"counted as {DAEMON_WAIT_S:.0f}s"
        )
    elif not single:
        basis += (
            "; the first runs wait for the backfill daemon's next pass (every 30 s), timed "
            f"from its pass {now - (daemon_pass or now):.0f}s ago, if launched now"
        )
    return Estimate(
        overhead_s=overhead,
        rate=rate,
        source=source,
        launched_as="one run" if single else "backfill",
        breakdown=breakdown,
        confidence=confidence,
        basis=basis,
    )


def _schedule(
    raw: list[float], declared: list[float], concurrency: int, shared: bool = False
) -> tuple[float, float]:
    """(when the last raw run ends, when the last run ends), in seconds from the first run's
    start: the runs take ``concurrency`` slots in order, raw runs first (the backfill queues
    them at once); declared run ``i`` (its wait for creation included) starts once raw runs
    ``0..i+1`` ended, the ones holding its event hours and the hours its lateness reaches into.
    A 30-day north star (5 raw and 5 declared runs, 2 at a time) ran like that. With
    ``shared``, see :func:`_shared_schedule`."""
    if shared:
        return _shared_schedule(raw, declared, concurrency)
    slots = [0.0] * max(1, concurrency)
    raw_ends = []
    for wall in raw:
        slot = slots.index(min(slots))
        slots[slot] += wall
        raw_ends.append(slots[slot])
    raw_end = max(raw_ends, default=0.0)
    for i, wall in enumerate(declared):
        ready = max(raw_ends[: i + 2], default=0.0)
        slot = slots.index(min(slots))
        slots[slot] = max(slots[slot], ready) + wall
    return raw_end, max([raw_end, *slots]) if declared else raw_end


def _shared_schedule(
    raw: list[float], declared: list[float], concurrency: int
) -> tuple[float, float]:
    """:func:`_schedule` with the runs in flight sharing the cores: each of ``m`` runs does
    1/``m`` of its work (its wall alone) per second. Started in the same order, at most
    ``concurrency`` at a time."""
    queue = [(True, i, w) for i, w in enumerate(raw)] + [
        (False, i, w) for i, w in enumerate(declared)
    ]
    raw_ends: dict[int, float] = {}
    running: dict[int, float] = {}  # queue index -> work left (seconds alone)
    now = last = 0.0
    started = 0
    while started < len(queue) or running:
        while started < len(queue) and len(running) < max(1, concurrency):
            is_raw, i, work = queue[started]
            if not is_raw and any(k not in raw_ends for k in range(min(i + 2, len(raw)))):
                break  # a declared run waits for the raw runs it reads (and so do later ones)
            running[started] = work
            started += 1
        share = len(running)
        step = min(running.values())  # the next run to end, in work
        now += step * share
        for j in list(running):
            running[j] -= step
            if running[j] <= 1e-9:
                del running[j]
                last = now
                if queue[j][0]:
                    raw_ends[queue[j][1]] = now
    raw_end = max(raw_ends.values(), default=0.0)
    return raw_end, max(last, raw_end) if declared else raw_end


def _confidence(
    history: list[tuple[float, float]], overhead: float, rate: float, per_run: float
) -> tuple[str, str]:
    """How far the fitted line can be trusted for a run of ``per_run`` records."""
    if not history:
        return "low", "no earlier runs: default overhead and the rate of a sample read"
    sizes = [r for r, _ in history]
    errors = [abs(overhead + r / rate - w) / w for r, w in history if w > 0 and rate > 0]
    error = statistics.median(errors) if errors else 1.0
    basis = (
        f"{len(history)} earlier runs of {min(sizes):,.0f}-{max(sizes):,.0f} records, the fit "
        f"off by {100 * error:.0f}% (median) on them"
    )
    if len(set(sizes)) < 2 or len(history) < 3:
        return "low", basis + " (too few runs of different sizes for a fit)"
    if per_run > EXTRAPOLATION * max(sizes):
        return "medium", basis + f"; this run ({per_run:,.0f} records) is beyond them"
    if error <= FIT_ERROR_HIGH:
        return "high", basis
    return ("medium" if error <= 2 * FIT_ERROR_HIGH else "low"), basis


def backfill_ranges(
    spec: TopicSpec, start: datetime, end: datetime
) -> list[tuple[list[dg.AssetKey], datetime, datetime]]:
    """What a backfill of Kafka hours [start, end) materializes, in dependency order: the raw
    and current-state tables over [start, end); each declared table over the event-time hours
    whose inputs all arrived within the range: [start, end - lateness) for a table reading a
    topic, the hours its declared inputs cover for one reading declared tables."""
    from backfill_assets.defs.assets import current_asset_key
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.spec import declared

    known = declared.relations(SPECS)
    settled: dict[str, datetime] = {}
    out = [([raw_asset_key(spec), current_asset_key(spec)], start, end)]
    for table in declared.ordered(SPECS):
        ends = [
            settled.get(ref, end)
            if known[ref].kind == "table"
            else end - timedelta(hours=table.lateness_hours)
            for ref in table.refs
        ]
        settled[table.name] = min(ends, default=end)
        if table.topic == spec.topic and settled[table.name] > start:
            out.append(([table_asset_key(table.name)], start, settled[table.name]))
    return out


def _blocked(
    spec: TopicSpec,
    start: datetime,
    end: datetime,
    partitions: int,
    concurrency: int,
    window: timedelta | None,
    reason: str,
    missing: dict[int, tuple[int, int]],
) -> Plan:
    """The plan of a range a run would refuse: no offsets, no estimate, a red scorecard."""
    plan = Plan(
        topic=spec.topic,
        target_tables=target_tables(spec),
        start=start.isoformat(),
        end=end.isoformat(),
        partitions=partitions,
        offsets={},
        records=0,
        estimated_bytes=0,
        schema_versions_seen=[],
        unknown_versions_seen=[],
        expected_rows_at_most=0,
        all_in_kafka=False,
        missing_offsets={str(p): [s, e] for p, (s, e) in sorted(missing.items())},
        records_from_archive=0,
        records_from_kafka=0,
        archive_offsets={},
        drain_rate_records_per_s=0.0,
        run_overhead_s=0.0,
        rate_source="not estimated: the range cannot be mapped to offsets",
        runs=0,
        concurrency=concurrency,
        predicted_duration_s=0.0,
        window_s=window.total_seconds() if window is not None else None,
        fits_window=None,
        bytes_written_estimate=0,
        files_estimate=0,
        blocked=reason,
    )
    plan.scorecard = [Score("scope", "red", reason)]
    if missing:
        plan.scorecard.append(_missing_score(plan))
    return plan


def _missing_score(plan: Plan) -> Score:
    return Score(
        "closure",
        "red",
        "offsets deleted by retention and not archived (the run would refuse): "
        + ", ".join(f"p{p}:[{s},{e})" for p, (s, e) in plan.missing_offsets.items()),
    )


def _scorecard(plan: Plan, spec: TopicSpec, end: datetime) -> list[Score]:
    return [
        _scope_score(plan, end),
        _capacity_score(plan),
        _cost_score(plan),
        Score(
            "recovery",
            "green",
            "each run publishes by one fast-forward; `backfill-assets rollback` restores the "
            "snapshot before it",
        ),
        Score(
            "governance",
            "green",
            f"{len(spec.columns)}-column contract and blocking checks gate publication; every "
            "publish is written to the audit table",
        ),
        _closure_score(plan),
    ]


def _scope_score(plan: Plan, end: datetime) -> Score:
    if plan.records == 0:
        return Score("scope", "yellow", "the range holds no records; nothing to replay")
    if end > datetime.now(UTC):
        return Score("scope", "red", "the range has not closed yet")
    return Score("scope", "green", f"{plan.partitions} closed hours, exact offsets known")


def _capacity_score(plan: Plan) -> Score:
    if plan.fits_window is None:
        predicted = "no --window given; predicted " + _duration(plan.predicted_duration_s)
        return Score("capacity", "yellow", predicted)
    if plan.fits_window:
        return Score("capacity", "green", "predicted duration fits the window")
    return Score(
        "capacity",
        "red",
        f"predicted {_duration(plan.predicted_duration_s)} > window "
        f"{_duration(plan.window_s or 0)}; split the range or raise concurrency",
    )


def _cost_score(plan: Plan) -> Score:
    if plan.estimated_bytes >= COST_RED_BYTES:
        color = "red"
    elif plan.estimated_bytes >= COST_YELLOW_BYTES:
        color = "yellow"
    else:
        color = "green"
    return Score("cost", color, f"reads ~{_size(plan.estimated_bytes)}")


def _closure_score(plan: Plan) -> Score:
    if plan.missing_offsets:
        return _missing_score(plan)
    if plan.all_in_kafka:
        return Score("closure", "green", "every offset of the range is still in Kafka")
    return Score(
        "closure",
        "green",
        f"{plan.records_from_archive:,} offsets below Kafka's log start come from the "
        f"archive, {plan.records_from_kafka:,} from Kafka",
    )


def _sample(kafka: KafkaClient, contract: OffsetContract, spec: TopicSpec) -> dict[str, Any]:
    """Read up to SAMPLE_RECORDS from the start of the range (no group join, no commit)."""
    consumer: Consumer = kafka.offsets_consumer()
    in_kafka = contract.kafka_ranges
    assigned = [TopicPartition(contract.topic, p, s) for p, (s, e) in in_kafka.items() if e > s]
    if not assigned:
        consumer.close()
        return _sample_archive(kafka, contract, spec)
    ends = {p: e for p, (_, e) in in_kafka.items()}
    consumer.assign(assigned)
    count, size, versions = 0, 0, set()
    # Done when every partition delivered its range's last offset, when SAMPLE_RECORDS were
    # read, or after a second without records (a range may end on a transaction marker,
    # which is never delivered). Short polls: consume() waits for a full batch or its timeout.
    pending = {tp.partition for tp in assigned}
    began = last = time.monotonic()
    try:
        while count < SAMPLE_RECORDS and pending and time.monotonic() - began < 10:
            msgs = consumer.consume(500, timeout=0.05)
            if not msgs:
                if time.monotonic() - last >= 1.0:
                    break
                continue
            last = time.monotonic()
            for msg in msgs:
                offset, partition = msg.offset(), msg.partition()
                if msg.error() or offset is None or partition is None or offset >= ends[partition]:
                    continue
                if offset == ends[partition] - 1:
                    pending.discard(partition)
                count += 1
                value = msg.value() or b""
                size += len(value) + len(msg.key() or b"")
                versions.add(_version(value, spec))
    finally:
        consumer.close()
    elapsed = max(time.monotonic() - began, 1e-3)
    return {
        "rate": count / elapsed,
        "avg_bytes": size / count if count else 0.0,
        "count": count,
        "versions": sorted(v for v in versions if v is not None),
    }


def _sample_archive(
    kafka: KafkaClient, contract: OffsetContract, spec: TopicSpec
) -> dict[str, Any]:
    """Sample the archived part of a range (when none of it is in Kafka any more)."""
    store = Archive(kafka.settings)
    began = time.monotonic()
    count, size, versions = 0, 0, set()
    for p, (s, e) in sorted(contract.archive_ranges.items()):
        if count >= SAMPLE_RECORDS:
            break
        table = store.read_records(contract.topic, p, s, min(e, s + SAMPLE_RECORDS - count))
        for key, value in zip(
            table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True
        ):
            count += 1
            size += len(value or b"") + len(key or b"")
            versions.add(_version(value or b"", spec))
    elapsed = max(time.monotonic() - began, 1e-3)
    return {
        "rate": count / elapsed if count else 0.0,
        "avg_bytes": size / count if count else 0.0,
        "count": count,
        "versions": sorted(v for v in versions if v is not None),
    }


def _version(value: bytes, spec: TopicSpec) -> int | None:
    if spec.version_field is None:
        return spec.latest_version
    try:
        doc = json.loads(value)
    except ValueError:
        return None
    version = doc.get(spec.version_field) if isinstance(doc, dict) else None
    return version if isinstance(version, int) else None


def _daemon_pass(instance: dg.DagsterInstance) -> float | None:
    """When the backfill daemon last started a pass, as far as the instance shows: the newest
    run it created for a backfill (it creates them at the start of a pass)."""
    newest = None
    for backfill in instance.get_backfills(limit=3):
        records = instance.get_run_records(
            dg.RunsFilter(tags={BACKFILL_TAG: backfill.backfill_id}), limit=1
        )
        for record in records:
            created = record.create_timestamp.timestamp()
            newest = created if newest is None else max(newest, created)
    return newest


def _history(instance: dg.DagsterInstance, key: dg.AssetKey) -> dict[str, dict[str, float]]:
    """Per recent run that materialized ``key``: records read (the run's total, -1 when its
    materializations do not say), wall time (RUN_START to the run's end) and write ratio.

    A run writes one materialization per hour (168 for a 7-day run): the records are read a
    page at a time until HISTORY_RUNS runs are known, not a fixed number of records (200 of
    them held only 2 of a 30-day backfill's 5 raw runs)."""
    per_run: dict[str, dict[str, float]] = {}
    for record in _materializations(instance, key):
        if len(per_run) >= HISTORY_RUNS and record.run_id not in per_run:
            break
        mat = record.asset_materialization
        if mat is None or record.run_id in per_run:
            continue
        meta = {k: v.value for k, v in mat.metadata.items()}
        # A raw run's totals are in its "run" entry; the plain entries are each partition's own.
        totals = meta.get("run") if isinstance(meta.get("run"), dict) else meta
        assert isinstance(totals, dict)
        records = totals.get("records_read", totals.get("events"))
        stats = instance.get_run_stats(record.run_id)
        if stats.start_time is None or stats.end_time is None:
            continue
        read_b, written_b = totals.get("bytes_read"), totals.get("bytes_written")
        per_run[record.run_id] = {
            "records": float(records) if isinstance(records, int) else -1.0,
            "wall_s": stats.end_time - stats.start_time,
            "in_flight": _in_flight(instance, stats.start_time, stats.end_time),
            "hours": _run_hours(instance, record.run_id),
            "write_ratio": float(written_b) / float(read_b)
            if isinstance(read_b, int) and isinstance(written_b, int) and read_b
            else 0.0,
        }
    return per_run


def _run_hours(instance: dg.DagsterInstance, run_id: str) -> float:
    """The hourly partitions a run covered: its partition range's tags, else 1 (one hour)."""
    run = instance.get_run_by_id(run_id)
    tags = run.tags if run is not None else {}
    first, last = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    try:
        span = datetime.strptime(last or "", PARTITION_FMT) - datetime.strptime(
            first or "", PARTITION_FMT
        )
    except ValueError:  # no range, or not hourly keys
        return 1.0
    return span / timedelta(hours=1) + 1


def _in_flight(instance: dg.DagsterInstance, start: float, end: float) -> float:
    """How many runs of the instance were in flight, on average, from ``start`` to ``end``
    (epoch seconds) of one run, that run included (:func:`in_flight`)."""
    records = instance.get_run_records(
        dg.RunsFilter(
            created_before=datetime.fromtimestamp(end, UTC),
            updated_after=datetime.fromtimestamp(start, UTC),
        ),
        limit=IN_FLIGHT_RUNS,
    )
    return in_flight(start, end, [(r.start_time, r.end_time) for r in records])


def in_flight(
    start: float, end: float, spans: Sequence[tuple[float | None, float | None]]
) -> float:
    """How many runs shared the cores with the run of ``[start, end)``, as a factor of its
    wall: the wall over its work alone, where each second with ``m`` runs in flight (the
    run itself included) counts 1/``m`` second of work (the processor sharing of
    :func:`_shared_schedule`). ``spans``: the runs' (start, end); no start: never ran, no
    end: still running. At least 1."""
    if end <= start:
        return 1.0
    clipped = [
        (max(start, s), min(end, e if e is not None else end)) for s, e in spans if s is not None
    ]
    cuts = sorted({start, end, *(t for span in clipped for t in span if start < t < end)})
    work = 0.0
    for lo, hi in itertools.pairwise(cuts):
        running = sum(1 for s, e in clipped if s <= lo and e >= hi)
        work += (hi - lo) / max(1, running)
    return (end - start) / work


def _materializations(instance: dg.DagsterInstance, key: dg.AssetKey) -> Iterator[Any]:
    """``key``'s materialization records, newest first, HISTORY_PAGE at a time (at most
    HISTORY_PAGES pages)."""
    cursor = None
    for _ in range(HISTORY_PAGES):
        result = instance.fetch_materializations(key, limit=HISTORY_PAGE, cursor=cursor)
        yield from result.records
        if not result.has_more:
            return
        cursor = result.cursor


def _fit(history: list[tuple[float, float]], sample_rate: float) -> tuple[float, float, str]:
    """(fixed seconds per run, records per second, where they come from).

    The seconds per record are the least-squares slope through earlier runs' (records, wall
    seconds), shrunk towards PRIOR_S_PER_RECORD by how uncertain the slope is: runs a few
    hundred records apart differ by noise, not by work, and alone they would set any slope
    (the cause of the planner's +66% on 24 h). The fixed cost is then the median of what each
    run left after its records. No history: the default fixed cost, and the slower of the
    sample read and the prior rate.

    A fixed cost is never negative, so no run spent more per record than its whole wall: the
    slope is capped at the smallest wall per record among the runs. Without that, one large
    run (a 3-day north star: 859,929 records in about 60 s) left the prior's 0.001 s per
    record in place and predicted its own range at 860 s."""
    if not history:
        rate = min(sample_rate, 1.0 / PRIOR_S_PER_RECORD) if sample_rate > 0 else 0.0
        return RUN_OVERHEAD_S, rate, "sample read (no earlier runs) + default overhead"
    slope, how = _slope(history)
    bound = min((w / r for r, w in history if r > 0), default=slope)
    if slope > bound:
        slope = bound
        how += f"; capped at {bound:.2g} s per record, a run's wall over its records"
    overhead = max(0.0, statistics.median(w - slope * r for r, w in history))
    return overhead, 1.0 / slope, f"fit over {len(history)} earlier run(s), {how}"


def _slope(history: list[tuple[float, float]]) -> tuple[float, str]:
    """Seconds per record: the data's slope and the prior, averaged on a log scale, each
    weighted by the inverse of its relative variance (the data's from the scatter of the runs
    around their line, at least NOISE_FLOOR_S per run; the prior's is PRIOR_FACTOR)."""
    xs = [r for r, _ in history]
    ys = [w for _, w in history]
    mean_x = statistics.fmean(xs)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if len(history) < 2 or sxx == 0:
        return PRIOR_S_PER_RECORD, "the prior rate (no runs of different sizes)"
    slope, intercept = statistics.linear_regression(xs, ys)
    if slope <= 0:
        return PRIOR_S_PER_RECORD, "the prior rate (no per-record cost visible in them)"
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    scatter = (sum(e * e for e in residuals) / (len(xs) - 2)) ** 0.5 if len(xs) > 2 else 0.0
    data_w = slope**2 * sxx / max(scatter, NOISE_FLOOR_S) ** 2  # 1 / relative variance
    prior_w = 1.0 / math.log(PRIOR_FACTOR) ** 2
    share = data_w / (data_w + prior_w)
    blended = math.exp(share * math.log(slope) + (1 - share) * math.log(PRIOR_S_PER_RECORD))
    return blended, f"{100 * share:.0f}% from their slope, the rest from the prior rate"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
