"""Plan a backfill before running it: the replay contract, whether Kafka still holds it, how
long it should take, what it costs, and a readiness scorecard. Planning reads Kafka metadata,
a small sample of records and the Dagster instance's history; it writes nothing."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
from confluent_kafka import Consumer, TopicPartition

from backfill_assets.defs.assets import BACKFILL_POLICY, raw_asset_key, table_asset_key
from backfill_assets.defs.resources import KafkaResource
from backfill_assets.lake import ledger
from backfill_assets.lake.archive import Archive
from backfill_assets.lake.replay import OffsetContract, offset_contract
from backfill_assets.lake.spec import TopicSpec
from backfill_assets.lake.windows import WindowError, WindowNotSealed
from backfill_assets.stack import catalog

SAMPLE_RECORDS = 2000
# Fixed cost of one run (process, Spark session, branch, checks, publish), used until history
# has measured it. Measured on the demo stack: see the issue closing notes.
RUN_OVERHEAD_S = 25.0
DEFAULT_WRITE_RATIO = 0.6
# Time from launch until the daemon starts the first run (backfill daemon tick + run queue);
# observed ~19 s on the demo stack.
DAEMON_LATENCY_S = 20.0
# The event-time table runs after the raw runs it depends on; its run's wall time until
# history has measured it (observed 36 s on the demo stack).
HOURLY_TAIL_S = 35.0  # Parquet bytes written per Kafka byte read, until measured
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
            f"  runs         {self.runs} (<= {BACKFILL_POLICY.max_partitions_per_run} partitions "
            f"each), {self.concurrency} at a time",
            f"  duration     ~{_duration(self.predicted_duration_s)}"
            + (
                f" against a window of {_duration(self.window_s)}: "
                + ("fits" if self.fits_window else "DOES NOT FIT")
                if self.window_s is not None
                else ""
            ),
            f"  cost         read {_size(self.estimated_bytes)}, write ~"
            f"{_size(self.bytes_written_estimate)}, ~{self.files_estimate} data files",
            "  readiness",
        ]
        lines += [f"    {s.color:<6} {s.dimension:<10} {s.reason}" for s in self.scorecard]
        return "\n".join(lines)


def target_tables(spec: TopicSpec) -> list[str]:
    """The tables a backfill of the topic writes, in dependency order."""
    from backfill_assets.lake.declared import ordered

    return [spec.raw_table, spec.current_table, *(t.name for t in ordered([spec]))]


def make_plan(
    kafka: KafkaResource,
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
    published = ledger.published_offsets(
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        f"{settings.catalog.name}.{settings.catalog.namespace}.{spec.raw_table}",
    )
    try:
        contract = offset_contract(
            kafka,
            spec.topic,
            start,
            end,
            archive=Archive(settings),
            published=published,
            seal_grace=timedelta(seconds=settings.seal_grace_s),
        )
    except (WindowError, WindowNotSealed) as err:
        missing_ranges = err.missing if isinstance(err, WindowError) else {}
        return _blocked(spec, start, end, partitions, concurrency, window, str(err), missing_ranges)
    missing: dict[str, list[int]] = {}
    sample = _sample(kafka, contract, spec)
    history = _history(instance, raw_asset_key(spec)) if instance is not None else {}
    per_run_history = list(history.values())[:20]
    overhead, rate, source = _fit(per_run_history, sample["rate"])
    ratios = [h["write_ratio"] for h in per_run_history if h["write_ratio"]]
    ratio = statistics.median(ratios) if ratios else DEFAULT_WRITE_RATIO
    runs = max(1, math.ceil(partitions / BACKFILL_POLICY.max_partitions_per_run))  # type: ignore[operator]
    waves = math.ceil(runs / max(1, concurrency))
    per_run_records = contract.records / runs
    finished = _backfill_history(instance, raw_asset_key(spec), history) if instance else []
    if len({r for r, _ in finished}) >= 2:
        # Whole earlier backfills (launch to last run end): includes the daemon's latencies.
        slope, intercept = statistics.linear_regression(
            [r for r, _ in finished], [w for _, w in finished]
        )
        fixed = max(intercept, 0.0)
        per_record = max(slope, 0.0)
        predicted = fixed + waves * per_run_records * per_record + (runs - 1) * overhead
        source += f"; whole-backfill fit over {len(finished)} earlier backfills"
    else:
        tail = HOURLY_TAIL_S
        if instance is not None:
            # The declared tables run after the raw table: the slowest one's median run.
            medians = [
                statistics.median(t)
                for table in spec.tables
                if (
                    t := [
                        h["wall_s"]
                        for h in _history(instance, table_asset_key(table.name)).values()
                    ]
                )
            ]
            tail = max(medians) if medians else HOURLY_TAIL_S
        per_run = overhead + (per_run_records / rate if rate > 0 else 0.0)
        predicted = DAEMON_LATENCY_S + waves * per_run + tail
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
        concurrency=concurrency,
        predicted_duration_s=predicted,
        window_s=window_s,
        fits_window=fits,
        bytes_written_estimate=int(est_bytes * ratio),
        files_estimate=partitions * 3,
    )
    plan.scorecard = _scorecard(plan, spec, end)
    return plan


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
    scores = []
    if plan.records == 0:
        scores.append(Score("scope", "yellow", "the range holds no records; nothing to replay"))
    elif end > datetime.now(UTC):
        scores.append(Score("scope", "red", "the range has not closed yet"))
    else:
        scores.append(
            Score("scope", "green", f"{plan.partitions} closed hours, exact offsets known")
        )
    if plan.fits_window is None:
        scores.append(
            Score(
                "capacity",
                "yellow",
                "no --window given; predicted " + _duration(plan.predicted_duration_s),
            )
        )
    elif plan.fits_window:
        scores.append(Score("capacity", "green", "predicted duration fits the window"))
    else:
        scores.append(
            Score(
                "capacity",
                "red",
                f"predicted {_duration(plan.predicted_duration_s)} > window "
                f"{_duration(plan.window_s or 0)}; split the range or raise concurrency",
            )
        )
    if plan.estimated_bytes >= COST_RED_BYTES:
        scores.append(Score("cost", "red", f"reads ~{_size(plan.estimated_bytes)}"))
    elif plan.estimated_bytes >= COST_YELLOW_BYTES:
        scores.append(Score("cost", "yellow", f"reads ~{_size(plan.estimated_bytes)}"))
    else:
        scores.append(Score("cost", "green", f"reads ~{_size(plan.estimated_bytes)}"))
    scores.append(
        Score(
            "recovery",
            "green",
            "each run publishes by one fast-forward; `backfill-assets rollback` restores the "
            "snapshot before it",
        )
    )
    scores.append(
        Score(
            "governance",
            "green",
            f"{len(spec.columns)}-column contract and blocking checks gate publication; every "
            "publish is written to the audit table",
        )
    )
    if plan.missing_offsets:
        scores.append(_missing_score(plan))
    elif plan.all_in_kafka:
        scores.append(Score("closure", "green", "every offset of the range is still in Kafka"))
    else:
        scores.append(
            Score(
                "closure",
                "green",
                f"{plan.records_from_archive:,} offsets below Kafka's log start come from the "
                f"archive, {plan.records_from_kafka:,} from Kafka",
            )
        )
    return scores


def _sample(kafka: KafkaResource, contract: OffsetContract, spec: TopicSpec) -> dict[str, Any]:
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
    began = time.monotonic()
    try:
        while count < SAMPLE_RECORDS and time.monotonic() - began < 10:
            msgs = consumer.consume(500, timeout=1.0)
            if not msgs:
                break
            for msg in msgs:
                offset, partition = msg.offset(), msg.partition()
                if msg.error() or offset is None or partition is None or offset >= ends[partition]:
                    continue
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
    kafka: KafkaResource, contract: OffsetContract, spec: TopicSpec
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


def _history(instance: dg.DagsterInstance, key: dg.AssetKey) -> dict[str, dict[str, float]]:
    """Per recent raw run: records read, wall time (start to end of the run) and write ratio."""
    result = instance.fetch_materializations(key, limit=200)
    per_run: dict[str, dict[str, float]] = {}
    for record in result.records:
        mat = record.asset_materialization
        if mat is None or record.run_id in per_run:
            continue
        meta = {k: v.value for k, v in mat.metadata.items()}
        records = meta.get("records_read", meta.get("events", 0))
        if not isinstance(records, int):
            continue
        stats = instance.get_run_stats(record.run_id)
        if stats.start_time is None or stats.end_time is None:
            continue
        read_b, written_b = meta.get("bytes_read"), meta.get("bytes_written")
        per_run[record.run_id] = {
            "records": float(records),
            "wall_s": stats.end_time - stats.start_time,
            "write_ratio": float(written_b) / float(read_b)
            if isinstance(read_b, int) and isinstance(written_b, int) and read_b
            else 0.0,
        }
    return per_run


def _backfill_history(
    instance: dg.DagsterInstance, key: dg.AssetKey, runs: dict[str, dict[str, float]]
) -> list[tuple[float, float]]:
    """(records, wall seconds from launch to the end of its last run) of finished backfills."""
    out = []
    for backfill in instance.get_backfills(limit=50):
        if backfill.status.value not in ("COMPLETED", "COMPLETED_SUCCESS"):
            continue
        if key not in (backfill.asset_selection or []):
            continue
        records = instance.get_run_records(
            dg.RunsFilter(tags={"dagster/backfill": backfill.backfill_id})
        )
        ends = [r.end_time for r in records if r.end_time is not None]
        total = sum(
            runs[r.dagster_run.run_id]["records"] for r in records if r.dagster_run.run_id in runs
        )
        if ends and total:
            out.append((float(total), max(ends) - backfill.backfill_timestamp))
    return out


def _fit(history: list[dict[str, float]], sample_rate: float) -> tuple[float, float, str]:
    """(fixed seconds per run, records per second) from run history, else defaults."""
    xs = [h["records"] for h in history]
    ys = [h["wall_s"] for h in history]
    if len(set(xs)) >= 2:
        slope, intercept = statistics.linear_regression(xs, ys)
        if slope > 0:
            return max(intercept, 0.0), 1.0 / slope, f"fit over {len(xs)} earlier runs"
    if history:
        overhead = min(RUN_OVERHEAD_S, statistics.median(ys) * 0.9)
        spent = statistics.median(y - overhead for y in ys)
        rate = statistics.median(xs) / spent if spent > 0 else sample_rate
        return overhead, rate, f"{len(history)} earlier run(s) + default overhead"
    return RUN_OVERHEAD_S, sample_rate, "sample read (no earlier runs) + default overhead"


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
