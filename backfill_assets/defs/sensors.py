"""Sensors that turn detected gaps and late data into exactly the needed partition runs.

The gap sensor also reports, as materializations with ``empty: true`` and zero rows, the hours
no run covers that provably hold nothing (:mod:`backfill_assets.lake.coverage.empty`): hours before
the
data, between separately published ranges, after the newest record. So "Missing" on a
partition bar is a real gap (records not published), or an hour not settled yet. These reports
never enter the ledger: they are not coverage, and an hour that gains records later is
requested like any other gap (its run's materialization then replaces the report).

Requests are deduplicated across ticks: every request has a key made of what it covers and
the ledger's state it was computed from (:func:`backfill_assets.lake.offsets.ledger.generation`);
the
cursor remembers keys already requested, and hours whose runs are still queued or running are
not requested again. Every publish and every rollback of any table changes the ledger's state
(main's snapshot id does not: a rollback restores an earlier one), so a gap that reappears
after a rollback is requested again.

A topic deleted and recreated (or failed over to another cluster) is a new log the ledger's
windows do not describe (:mod:`backfill_assets.lake.offsets.identity`): no raw or current hour of
it is
requested, on any tick, until ``backfill-assets adopt`` adopts it; every tick says so in its
log and skip reason. Declared tables over hours already published are still requested.

A request whose run failed is retried with backoff (``retry_backoff``, doubling per failure up
to ``RETRY_BACKOFF_MAX``) and reported in the sensor's log and skip reason. Its hours are
isolated from the others: a failed range is retried as its two halves, and a half that fails is
halved again, so one hour that fails every time ends up retried alone while the hours around it
and every later hour are requested apart from it. Offsets are never committed anywhere: the
ledger is the only checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg

from backfill_assets.defs.assets import current_asset_key, raw_asset_key, table_asset_key
from backfill_assets.defs.partitions import kafka_hours
from backfill_assets.defs.resources import IcebergResource, KafkaResource
from backfill_assets.lake.coverage import detect, empty
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.offsets.windows import hours_between
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

    from backfill_assets.stack.kafka import KafkaClient

REQUEST_TAG = "backfill_assets/request"
# Known-empty hours reported per tick, newest first: a fresh deployment whose partition_start
# is months before the data drains its backlog over a few ticks (the daemon stores the
# reports one by one), and a tick stays short.
MAX_EMPTY_REPORTS = 2000
EMPTY_TAG = "backfill_assets/empty"
_CURSOR_KEYS = 500
RETRY_BACKOFF = timedelta(minutes=2)
RETRY_BACKOFF_MAX = timedelta(hours=1)
_ACTIVE = {
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
}
_FAILED = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
_HISTORY_RUNS = 1000


def gap_sensor_name(spec: TopicSpec) -> str:
    return f"{spec.name}_offset_gaps"


def late_sensor_name(spec: TopicSpec) -> str:
    return f"{spec.name}_late_data"


def _default_status() -> dg.DefaultSensorStatus:
    running = Settings.from_env().sensors_running
    return dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED


def _merged(
    kind: str, due: dict[str, dict[datetime, str]], max_hours: int
) -> list[tuple[str, list[dg.AssetKey], list[datetime]]]:
    """One request per contiguous range of at most ``max_hours`` hours where any declared table
    is due, selecting (in dependency order; Dagster runs them in that order) the tables due in
    that range."""
    hours = sorted({h for table_due in due.values() for h in table_due})
    out = []
    for first, last in detect.contiguous(hours, max_hours):
        names = [n for n, d in due.items() if any(first <= h <= last for h in d)]
        span = [h for h in hours if first <= h <= last]
        out.append((kind, [table_asset_key(n) for n in names], span))
    return out


def build_gap_sensor(
    spec: TopicSpec,
    specs: list[TopicSpec] | None = None,
    *,
    retry_backoff: timedelta = RETRY_BACKOFF,
) -> dg.SensorDefinition:
    raw, current = raw_asset_key(spec), current_asset_key(spec)
    tables = [table_asset_key(t.name) for t in spec.tables]

    @dg.sensor(
        name=gap_sensor_name(spec),
        description=(
            f"Compares topic {spec.topic!r} with the offsets published on main and requests "
            "runs for exactly the uncovered hours; warns before retention deletes them."
        ),
        asset_selection=[raw, current, *tables],
        minimum_interval_seconds=Settings.from_env().sensor_interval_s,
        default_status=_default_status(),
    )
    def _gaps(
        context: dg.SensorEvaluationContext, kafka: KafkaResource, iceberg: IcebergResource
    ) -> dg.SensorResult | dg.SkipReason:
        # The runs in flight first: a run that ends while the gaps are looked for is still in
        # flight for this tick, never requested again from what it had not published yet.
        history = _history(context.instance, gap_sensor_name(spec))
        ns = iceberg.settings.catalog.namespace
        cat = iceberg.catalog()
        found = detect.find(
            kafka.client(), cat, ns, spec, specs=specs, read_budget=iceberg.settings.gap_read_budget
        )
        if found.replaced is not None:  # every tick, until the new log is adopted
            context.log.warning(f"REFUSED: {found.replaced}")
        state = ledger.generation(cat, ns)
        raw_and_current = set(found.raw_gaps)
        only_current = set(found.current_gaps) - raw_and_current
        wanted = [
            ("raw", [raw, current], sorted(raw_and_current)),
            ("current", [current], sorted(only_current)),
            *_merged("derived", found.tables_due, iceberg.settings.max_hours_per_run),
        ]
        try:
            reports = _empty_reports(context, kafka, iceberg, spec, specs)
        except Exception as exc:  # the bar can wait a tick; the gap requests cannot
            context.log.warning(f"known-empty hours not reported this tick: {exc}")
            reports = []
        for risk in found.retention_risks:
            context.log.warning(
                f"retention risk: {risk['topic']} hour {risk['hour']} (offsets "
                f"{risk['offsets']}) is not materialized and leaves Kafka at "
                f"{risk['leaves_kafka_at']}; "
                + (
                    "it is archived, so it can still be backfilled later"
                    if risk["archived"]
                    else f"it is NOT archived: run `backfill-assets archive --topic {spec.topic}`"
                )
            )
        return _requests(
            context,
            gap_sensor_name(spec),
            wanted,
            state,
            found.retention_risks,
            retry_backoff,
            reports,
            refused=str(found.replaced) if found.replaced is not None else None,
            history=history,
            max_hours=iceberg.settings.max_hours_per_run,
        )

    return _gaps


def _empty_reports(
    context: dg.SensorEvaluationContext,
    kafka: KafkaResource,
    iceberg: IcebergResource,
    spec: TopicSpec,
    specs: list[TopicSpec] | None,
) -> list[dg.AssetMaterialization]:
    """This tick's share of the known-empty hours Dagster has no materialization for yet."""
    wanted = empty_reports(
        context.instance,
        kafka.client(),
        iceberg.catalog(),
        iceberg.settings.catalog.namespace,
        spec,
        specs,
    )
    if len(wanted) > MAX_EMPTY_REPORTS:
        context.log.info(
            f"{len(wanted)} known-empty hours to report; {MAX_EMPTY_REPORTS} now (newest first), "
            "the rest on the next ticks"
        )
    return wanted[:MAX_EMPTY_REPORTS]


def empty_reports(
    instance: dg.DagsterInstance,
    client: KafkaClient,
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    specs: list[TopicSpec] | None = None,
) -> list[dg.AssetMaterialization]:
    """Materializations, marked empty, of every known-empty hour of ``spec``'s assets that
    ``instance`` has none for yet, newest first (:mod:`backfill_assets.lake.coverage.empty`
    says which hours provably hold nothing). Reading only: the caller stores them (the gap
    sensor a share per tick, ``backfill-assets report-empty`` all at once)."""
    known = empty.find(client, catalog, namespace, spec, specs=specs)
    valid = set(kafka_hours(spec).get_partition_keys())
    wanted: list[tuple[datetime, dg.AssetKey, str]] = []
    per_asset = [
        (raw_asset_key(spec), known.kafka, "Kafka hour"),
        (current_asset_key(spec), known.kafka, "Kafka hour"),
        *((table_asset_key(n), hours, "event hour") for n, hours in known.tables.items()),
    ]
    for key, hours, what in per_asset:
        done = instance.get_materialized_partitions(key)
        for hour in hours:
            pkey = f"{hour:{detect.PARTITION_FMT}}"
            if pkey in valid and pkey not in done:
                wanted.append((hour, key, what))
    wanted.sort(key=lambda w: (w[0], w[1].to_user_string()), reverse=True)
    return [
        dg.AssetMaterialization(
            asset_key=key,
            partition=f"{hour:{detect.PARTITION_FMT}}",
            description=f"Nothing to hold: the {what} is sealed and holds no records.",
            metadata={
                "empty": True,
                "dagster/partition_row_count": 0,
                "reported_by": gap_sensor_name(spec),
            },
            tags={EMPTY_TAG: "true"},
        )
        for hour, key, what in wanted
    ]


def build_late_data_sensor(
    spec: TopicSpec,
    specs: list[TopicSpec] | None = None,
    *,
    retry_backoff: timedelta = RETRY_BACKOFF,
) -> dg.SensorDefinition:
    # Every table reading the topic's events, wherever it is declared.
    tables = [table_asset_key(t.name) for t in detect.late_readers(spec, specs)]

    @dg.sensor(
        name=late_sensor_name(spec),
        description=(
            f"Re-materializes event-time hours of {spec.topic!r}'s declared tables that "
            "received records after they were published, beyond the allowed lateness."
        ),
        asset_selection=tables or [raw_asset_key(spec)],
        minimum_interval_seconds=Settings.from_env().sensor_interval_s,
        default_status=_default_status(),
    )
    def _late(
        context: dg.SensorEvaluationContext, iceberg: IcebergResource
    ) -> dg.SensorResult | dg.SkipReason:
        history = _history(context.instance, late_sensor_name(spec))  # before: see _gaps
        cat, ns = iceberg.catalog(), iceberg.settings.catalog.namespace
        due = detect.late_event_hours(cat, ns, spec, specs=specs)
        state = ledger.generation(cat, ns)
        hours = iceberg.settings.max_hours_per_run
        return _requests(
            context, late_sensor_name(spec), _merged("late", due, hours), state, None,
            retry_backoff, history=history, max_hours=hours,
        )  # fmt: skip

    return _late


def _requests(
    context: dg.SensorEvaluationContext,
    sensor: str,
    wanted: Iterable[tuple[str, list[dg.AssetKey], list[datetime]]],
    state: str,
    risks: list[dict[str, object]] | None = None,
    retry_backoff: timedelta = RETRY_BACKOFF,
    reports: list[dg.AssetMaterialization] | None = None,
    *,
    refused: str | None = None,
    history: _History | None = None,
    max_hours: int,
) -> dg.SensorResult | dg.SkipReason:
    """The run requests for ``wanted`` not yet requested at ledger ``state``, nor in flight in
    ``history`` (read before ``wanted`` was computed; default: now), each of at most
    ``max_hours`` hours (``BACKFILL_MAX_HOURS_PER_RUN``, as a backfill's runs)."""
    seen: list[str] = json.loads(context.cursor) if context.cursor else []
    history = history if history is not None else _history(context.instance, sensor)
    now = datetime.now(UTC)
    requests: list[dg.RunRequest] = []
    waiting: list[str] = []
    for kind, keys, hours in wanted:
        for first, last in _spans(kind, hours, history, max_hours):
            span = f"{first:{detect.PARTITION_FMT}}...{last:{detect.PARTITION_FMT}}"
            tag = f"{kind}:{span}"
            failed = history.failed.get(tag)
            attempt = ""
            if failed is not None:
                due_at = failed.ended + min(
                    retry_backoff * 2 ** (failed.count - 1), max(RETRY_BACKOFF_MAX, retry_backoff)
                )
                if due_at > now:
                    waiting.append(
                        f"{tag} failed {failed.count} time(s) (last run {failed.run_id}); "
                        f"next retry at {due_at.isoformat(timespec='seconds')}"
                    )
                    continue
                attempt = f"#retry{failed.count}"
                context.log.warning(
                    f"{tag}: run {failed.run_id} failed ({failed.count} time(s)); retrying"
                )
            key = f"{tag}@{state}{attempt}"
            if key in seen:
                continue
            seen.append(key)
            requests.append(
                dg.RunRequest(
                    run_key=key,
                    asset_selection=keys,
                    tags={
                        "dagster/asset_partition_range_start": f"{first:{detect.PARTITION_FMT}}",
                        "dagster/asset_partition_range_end": f"{last:{detect.PARTITION_FMT}}",
                        REQUEST_TAG: tag,
                    },
                )
            )
    for note in waiting:
        context.log.warning(f"failed request waiting for its retry: {note}")
    cursor = json.dumps(seen[-_CURSOR_KEYS:])
    if requests:
        return dg.SensorResult(run_requests=requests, cursor=cursor, asset_events=reports or [])
    reason = "nothing uncovered, or every gap is already requested"
    if refused is not None:
        reason = f"REFUSED: {refused}; otherwise {reason}"
    if waiting:
        reason += "; FAILED, retried with backoff: " + "; ".join(waiting)
    if risks:
        reason += "; RETENTION RISK: " + "; ".join(
            f"{r['topic']} {r['hour']} leaves Kafka at {r['leaves_kafka_at']} "
            + ("(archived)" if r["archived"] else "(NOT archived)")
            for r in risks
        )
    if reports:
        reason += f"; reported {len(reports)} known-empty hour(s) as empty materializations"
        return dg.SensorResult(skip_reason=reason, cursor=cursor, asset_events=reports)
    context.update_cursor(cursor)
    return dg.SkipReason(reason)


@dataclass(frozen=True)
class _Failed:
    """Failures of one request (kind and span) since its last success."""

    count: int
    ended: datetime
    run_id: str


@dataclass
class _History:
    """What this sensor's earlier runs say: the hours still queued or running per kind, and
    the requests whose runs failed since they last succeeded."""

    active: dict[str, set[datetime]] = field(default_factory=dict)
    failed: dict[str, _Failed] = field(default_factory=dict)


def _parse_tag(tag: str) -> tuple[str, datetime, datetime] | None:
    kind, _, span = tag.partition(":")
    first, _, last = span.partition("...")
    try:
        return (
            kind,
            datetime.strptime(first, detect.PARTITION_FMT).replace(tzinfo=UTC),
            datetime.strptime(last, detect.PARTITION_FMT).replace(tzinfo=UTC),
        )
    except ValueError:
        return None


def _history(instance: dg.DagsterInstance, sensor: str) -> _History:
    records = instance.get_run_records(
        dg.RunsFilter(tags={"dagster/sensor_name": sensor}), limit=_HISTORY_RUNS
    )
    out = _History()
    succeeded: set[str] = set()
    for record in records:  # newest first
        run = record.dagster_run
        tag = run.tags.get(REQUEST_TAG)
        parsed = _parse_tag(tag) if tag else None
        if tag is None or parsed is None:
            continue
        kind, first, last = parsed
        if run.status in _ACTIVE:
            out.active.setdefault(kind, set()).update(hours_between(first, last + detect.HOUR))
        elif run.status == dg.DagsterRunStatus.SUCCESS:
            succeeded.add(tag)
        elif run.status in _FAILED and tag not in succeeded:
            ended = datetime.fromtimestamp(
                record.end_time or record.create_timestamp.timestamp(), UTC
            )
            prior = out.failed.get(tag)
            out.failed[tag] = (
                _Failed(prior.count + 1, prior.ended, prior.run_id)
                if prior is not None
                else _Failed(1, ended, run.run_id)
            )
    return out


def _spans(
    kind: str, hours: Iterable[datetime], history: _History, max_hours: int
) -> list[tuple[datetime, datetime]]:
    """The ranges of at most ``max_hours`` hours to request for ``hours`` of ``kind``: hours
    whose runs are in flight are left out; hours of a failed request are requested apart from
    the others, in halves of the smallest failed range that holds them (one hour alone once
    that range is one hour)."""
    busy = set(history.active.get(kind, set()))
    if kind == "current":  # a raw request materializes the current state of its hours too
        busy |= history.active.get("raw", set())
    failed = [p[1:] for tag in history.failed if (p := _parse_tag(tag)) and p[0] == kind]
    groups: dict[tuple[datetime, datetime] | None, list[datetime]] = {}
    for hour in sorted(set(hours) - busy):
        holding = [(a, b) for a, b in failed if a <= hour <= b]
        group = None
        if holding:
            a, b = min(holding, key=lambda s: s[1] - s[0])
            if a < b:
                mid = a + ((b - a) // detect.HOUR // 2) * detect.HOUR
                a, b = (a, mid) if hour <= mid else (mid + detect.HOUR, b)
            group = (a, b)
        groups.setdefault(group, []).append(hour)
    out: list[tuple[datetime, datetime]] = []
    for members in groups.values():
        out.extend(detect.contiguous(members, max_hours))
    return sorted(out)
