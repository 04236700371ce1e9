"""What is missing or stale: the Kafka log compared with what main of each table has published.

The authoritative checkpoint is the ledger of published windows
(:mod:`backfill_assets.lake.ledger`), which table maintenance cannot erase: a rolled-back
publish is no longer live and so becomes a gap again.
Everything here reads Kafka metadata and Iceberg metadata (pyiceberg), never data files except
for the late-data look-up, and never starts Spark, so sensors stay cheap.

Kafka-time hours are compared as units: an hour "has records" when some partition's offsets
for it are non-empty (ListOffsets-by-timestamp at the hour's bounds). Transaction markers and
compaction holes only shift offsets inside an hour's range, so they never create a gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyiceberg.catalog import Catalog

from backfill_assets.defs.resources import KafkaResource
from backfill_assets.lake import declared, ledger
from backfill_assets.lake.spec import TableSpec, TopicSpec

HOUR = timedelta(hours=1)
PARTITION_FMT = "%Y-%m-%d-%H:%M"


@dataclass(frozen=True)
class Publish:
    """One publish still on main: its window, run and commit time."""

    start: datetime
    end: datetime
    run_id: str
    committed_ms: int


@dataclass
class Findings:
    """Per table, the hours (partition starts) to (re)materialize, and retention risks."""

    raw_gaps: list[datetime] = field(default_factory=list)
    current_gaps: list[datetime] = field(default_factory=list)
    # declared table -> hour -> reason, tables in dependency order
    tables_due: dict[str, dict[datetime, str]] = field(default_factory=dict)
    retention_risks: list[dict[str, Any]] = field(default_factory=list)
    closed_until: datetime | None = None


def published(catalog: Catalog, identifier: str) -> list[Publish]:
    """Live publishes of ``namespace.table``, newest first, one per covered hour, from the
    ledger (:mod:`backfill_assets.lake.ledger`): it survives snapshot expiry, and a rolled-back
    publish is no longer live."""
    namespace = identifier.split(".", 1)[0]
    entries = ledger.coverage(catalog, namespace, f"{catalog.name}.{identifier}")
    out = [Publish(hour, hour + HOUR, e.run_id, e.committed_ms) for hour, e in entries.items()]
    return sorted(out, key=lambda p: p.committed_ms, reverse=True)


def _publish(entry: ledger.Entry) -> Publish:
    return Publish(entry.hour, entry.hour + HOUR, entry.run_id, entry.committed_ms)


def _windows(entries: dict[datetime, ledger.Entry]) -> dict[datetime, dict[int, tuple[int, int]]]:
    """The published offsets of each covered hour of a raw table (hours without: none)."""
    return {h: dict(e.offsets) for h, e in entries.items() if e.offsets is not None}


def covered_hours(publishes: list[Publish]) -> dict[datetime, Publish]:
    """Hour -> the newest publish on main that covers it."""
    out: dict[datetime, Publish] = {}
    for pub in sorted(publishes, key=lambda p: p.committed_ms):
        hour = pub.start
        while hour < pub.end:
            out[hour] = pub
            hour += HOUR
    return out


def hours_with_records(
    kafka: KafkaResource,
    topic: str,
    first: datetime,
    last: datetime,
    known: dict[datetime, dict[int, tuple[int, int]]] | None = None,
) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Kafka-time hours in ``[first, last)`` that hold records, with their offsets.

    An hour in ``known`` (the ledger's published windows of the topic's raw table) takes its
    offsets from there; only the other hours' bounds are asked of Kafka (ListOffsets by
    timestamp, one request per bound), so a tick costs what is unpublished, not what the
    history holds."""
    hours = []
    hour = first
    while hour < last:
        hours.append(hour)
        hour += HOUR
    known = known or {}
    probe = sorted({b for h in hours if h not in known for b in (h, h + HOUR)})
    bounds = kafka.offsets_for_many(topic, [_ms(b) for b in probe]) if probe else {}
    out: dict[datetime, dict[int, tuple[int, int]]] = {}
    for start in hours:
        if start in known:
            ranges = dict(known[start])
        else:
            lo, hi = bounds[_ms(start)], bounds[_ms(start + HOUR)]
            ranges = {p: (lo[p], hi[p]) for p in lo}
        if any(e > s for s, e in ranges.values()):
            out[start] = ranges
    return out


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def record_hours(
    kafka: KafkaResource, topic: str, floor: datetime
) -> tuple[datetime, datetime] | None:
    """The hours of the oldest and the newest record still in Kafka (oldest not before
    ``floor``), read from the first and last record of each partition; None if empty.

    All partitions are assigned at once, first at their log start, then at their last offset,
    so a tick makes two fetch rounds whatever the partition count (one poll per partition
    waited up to half a second each: 12 s for 12 partitions, bench/sensors.py)."""
    from confluent_kafka import TopicPartition

    consumer = kafka.offsets_consumer()
    stamps: list[int] = []
    try:
        marks = {p: (lo, hi) for p, (lo, hi) in kafka.watermarks(topic).items() if hi > lo}
        for pick in (0, 1):
            want = {p: (lo if pick == 0 else hi - 1) for p, (lo, hi) in marks.items()}
            if not want:
                break
            consumer.assign([TopicPartition(topic, p, o) for p, o in want.items()])
            deadline = time.monotonic() + kafka.request_timeout_s
            while want and time.monotonic() < deadline:
                for msg in consumer.consume(num_messages=len(want), timeout=0.5):
                    p = msg.partition()
                    if msg.error() is None and p in want:
                        stamps.append(msg.timestamp()[1])
                        del want[p]
            consumer.unassign()
    finally:
        consumer.close()
    if not stamps:
        return None
    oldest = _hour(datetime.fromtimestamp(min(stamps) / 1000, UTC))
    newest = _hour(datetime.fromtimestamp(max(stamps) / 1000, UTC))
    return max(oldest, floor), newest


def find(
    kafka: KafkaResource,
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    *,
    specs: list[TopicSpec] | None = None,
    now: datetime | None = None,
    retention_horizon: timedelta = timedelta(hours=24),
) -> Findings:
    """Everything the gap, late-data and retention checks need, in one pass; ``specs`` (all
    topics) resolve what the topic's declared tables read from other topics."""
    now = now or datetime.now(UTC)
    last_closed = now.replace(minute=0, second=0, microsecond=0)
    findings = Findings(closed_until=last_closed)
    span = record_hours(kafka, spec.topic, spec.partition_start)
    if span is None:
        return findings
    # Hours after the newest record hold nothing (its hour's end is the last bound needed);
    # records newer than the last closed hour wait until their hour closes.
    raw_entries = ledger.coverage(
        catalog, namespace, f"{catalog.name}.{namespace}.{spec.raw_table}"
    )
    in_kafka = hours_with_records(
        kafka, spec.topic, span[0], min(last_closed, span[1] + HOUR), _windows(raw_entries)
    )
    raw_pub = {h: _publish(e) for h, e in raw_entries.items()}
    cur_pub = covered_hours(published(catalog, f"{namespace}.{spec.current_table}"))
    findings.raw_gaps = sorted(h for h in in_kafka if h not in raw_pub)
    findings.current_gaps = sorted(h for h in in_kafka if h not in cur_pub)
    every = list(specs) if specs is not None else [spec]
    known = declared.relations(every)
    kafka_hours = {spec.topic: in_kafka}
    coverage: dict[str, dict[datetime, Publish]] = {}

    def expected(topic: str) -> dict[datetime, dict[int, tuple[int, int]]]:
        if topic not in kafka_hours:
            other = record_hours(kafka, topic, spec.partition_start)
            raw = f"{catalog.name}.{namespace}.raw_{topic}"
            kafka_hours[topic] = (
                hours_with_records(
                    kafka,
                    topic,
                    other[0],
                    min(last_closed, other[1] + HOUR),
                    _windows(ledger.coverage(catalog, namespace, raw)),
                )
                if other
                else {}
            )
        return kafka_hours[topic]

    def covered(table: str) -> dict[datetime, Publish]:
        if table not in coverage:
            coverage[table] = covered_hours(published(catalog, f"{namespace}.{table}"))
        return coverage[table]

    for table in declared.ordered(every):
        if table.topic == spec.topic:
            findings.tables_due[table.name] = _due(
                table, known, in_kafka, expected, covered, last_closed
            )
    findings.retention_risks = _retention_risks(
        kafka, spec.topic, in_kafka, raw_pub, now, retention_horizon
    )
    return findings


def _due(
    table: TableSpec,
    known: dict[str, declared.Relation],
    in_kafka: dict[datetime, Any],
    expected: Any,
    covered: Any,
    last_closed: datetime,
) -> dict[datetime, str]:
    """Event-time hours of ``table`` to (re)materialize: never published, or a relation it
    reads was republished after it for the hours it maps to. An hour waits until every hour it
    reads has closed and, where Kafka holds records for it, been published."""
    mine = covered(table.name)
    due: dict[datetime, str] = {}
    for hour in sorted(in_kafka):
        wait, newer = False, ""
        for ref in table.refs:
            rel = known[ref]
            later = table.lateness_hours if rel.kind != "table" else 0
            deps = [hour + i * HOUR for i in range(-table.lookback_hours, later + 1)]
            if any(d > last_closed - HOUR for d in deps):
                wait = True
                break
            dep_table = f"raw_{rel.topic}" if rel.kind == "events" else rel.name
            pubs = covered(dep_table)
            has_records = expected(rel.topic)
            if any(d in has_records and d not in pubs for d in deps):
                wait = True  # an hour it reads is not published yet
                break
            own = mine.get(hour)
            later_pubs = [
                pubs[d]
                for d in deps
                if d in pubs and own and pubs[d].committed_ms > own.committed_ms
            ]
            if later_pubs and not newer:
                newer = f"{dep_table} hours republished by run {later_pubs[0].run_id}"
        if wait:
            continue
        if hour not in mine:
            due[hour] = "never published"
        elif newer:
            due[hour] = newer
    return due


def late_event_hours(
    catalog: Catalog, namespace: str, spec: TopicSpec, *, now: datetime | None = None
) -> dict[str, dict[datetime, str]]:
    """Per declared table that reads the topic's events: event-time hours that received
    records after the table's hour was published, from Kafka hours beyond the table's allowed
    lateness (so the partition mapping alone misses them)."""
    readers = [t for t in spec.tables if spec.topic in t.refs]
    raw_pubs = published(catalog, f"{namespace}.{spec.raw_table}")
    out: dict[str, dict[datetime, str]] = {}
    if not raw_pubs or not readers:
        return out
    rows: list[dict[str, Any]] | None = None
    committed = {p.run_id: p.committed_ms for p in raw_pubs}
    for table in readers:
        mine = covered_hours(published(catalog, f"{namespace}.{table.name}"))
        if not mine:
            continue
        oldest = min(p.committed_ms for p in mine.values())
        if rows is None:
            rows = _recent_rows(catalog, namespace, spec, raw_pubs, oldest)
        lateness = timedelta(hours=table.lateness_hours)
        due: dict[datetime, str] = {}
        for row in rows:
            event_time = row[spec.event_time_field]
            if event_time is None:
                continue
            event_hour = _hour(event_time)
            pub = mine.get(event_hour)
            if pub is None:
                continue  # never published: the gap sensor handles it
            if _hour(row["kafka_hour"]) <= event_hour + lateness:
                continue  # inside the mapping: the gap sensor's staleness rule handles it
            if committed[row["ingest_run_id"]] > pub.committed_ms:
                due[event_hour] = f"late records ingested by run {row['ingest_run_id']}"
        if due:
            out[table.name] = due
    return out


def _recent_rows(
    catalog: Catalog, namespace: str, spec: TopicSpec, raw_pubs: list[Publish], since_ms: int
) -> list[dict[str, Any]]:
    """Event time, Kafka hour and run of the raw rows published after ``since_ms``."""
    recent_runs = sorted({p.run_id for p in raw_pubs if p.committed_ms > since_ms})
    if not recent_runs:
        return []
    table = catalog.load_table(f"{namespace}.{spec.raw_table}")
    quoted = ", ".join(f"'{r}'" for r in recent_runs if "'" not in r)
    rows: list[dict[str, Any]] = (
        table.scan(
            row_filter=f"ingest_run_id IN ({quoted}) AND is_tombstone == false",
            selected_fields=(spec.event_time_field, "kafka_hour", "ingest_run_id"),
        )
        .to_arrow()
        .to_pylist()
    )
    return rows


def _retention_risks(
    kafka: KafkaResource,
    topic: str,
    in_kafka: dict[datetime, dict[int, tuple[int, int]]],
    raw_pub: dict[datetime, Publish],
    now: datetime,
    horizon: timedelta,
) -> list[dict[str, Any]]:
    kept_ms = retention_ms(kafka, topic)
    if kept_ms is None or kept_ms < 0:
        return []
    from backfill_assets.lake.archive import Archive

    store = Archive(kafka.settings)
    out = []
    for hour, ranges in sorted(in_kafka.items()):
        if hour in raw_pub:
            continue
        leaves_at = hour + HOUR + timedelta(milliseconds=kept_ms)
        if leaves_at - now <= horizon:
            out.append(
                {
                    "topic": topic,
                    "hour": hour.isoformat(),
                    "leaves_kafka_at": leaves_at.isoformat(),
                    "offsets": {str(p): [s, e] for p, (s, e) in ranges.items() if e > s},
                    # Archived hours can still be backfilled after Kafka deletes them.
                    "archived": all(store.covers(topic, p, s, e) for p, (s, e) in ranges.items()),
                }
            )
    return out


def retention_ms(kafka: KafkaResource, topic: str) -> int | None:
    """The topic's ``retention.ms`` (negative: unlimited), None if the broker does not say."""
    from confluent_kafka.admin import ConfigResource, ResourceType  # type: ignore[attr-defined]

    admin = kafka.admin()
    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=kafka.request_timeout_s)
    entry = configs.get("retention.ms")
    return int(entry.value) if entry is not None and entry.value is not None else None


def _hour(value: datetime) -> datetime:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def contiguous(hours: list[datetime], max_len: int) -> list[tuple[datetime, datetime]]:
    """Group sorted hours into [first, last] runs of consecutive hours, at most max_len long."""
    out: list[tuple[datetime, datetime]] = []
    for hour in sorted(hours):
        if out and hour - out[-1][1] == HOUR and (hour - out[-1][0]) / HOUR < max_len:
            out[-1] = (out[-1][0], hour)
        else:
            out.append((hour, hour))
    return out
