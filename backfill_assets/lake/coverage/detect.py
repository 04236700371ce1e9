"""What is missing or stale: the Kafka log compared with what main of each table has published.

The authoritative checkpoint is the ledger of published windows
(:mod:`backfill_assets.lake.offsets.ledger`), which table maintenance cannot erase: a rolled-back
publish is no longer live and so becomes a gap again.
Everything here reads Kafka metadata, Iceberg metadata and the ledger (pyiceberg), never the
tables' data files (the late-data look-up too: the ledger records the event-time hours of each
published Kafka hour; only a publish whose ledger rows predate that has its own rows read), and
never starts Spark, so sensors stay cheap.

Kafka-time hours are compared as units: an hour "has records" when some partition's offsets
for it hold a committed record. What Kafka holds is bounded by ListOffsets (log start, last
stable offset), never by reading the record at ``high_watermark - 1``: on a transactional topic
that offset is a commit marker, which a committed reader never receives. Published hours take
their offsets from the ledger; only offsets no published window holds are read (committed
records, timestamps only), so a tick costs what is unpublished (:func:`kafka_hours`).
A declared table's candidate hours are the event hours that exist (recorded by the raw
publishes in the ledger) and the hours that look back on them, as well as the Kafka hours that
hold records: an outage hour holds no records but can have late events. A publish makes an
hour stale when the hour's own publish did not read it (lineage: the input's sequence number
it read, recorded with the publish; wall-clock times only for publishes recorded before).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyiceberg.catalog import Catalog

from backfill_assets.errors import KafkaClientError, TopicReplaced
from backfill_assets.lake.offsets import identity, ledger
from backfill_assets.lake.offsets.windows import hour_of_ms
from backfill_assets.spec import declared
from backfill_assets.spec.model import TableSpec, TopicSpec
from backfill_assets.stack.kafka import KafkaClient, offsets_gone
from backfill_assets.stack.settings import GAP_READ_BUDGET

HOUR = timedelta(hours=1)
HOUR_MS = 3_600_000
PARTITION_FMT = "%Y-%m-%d-%H:%M"


@dataclass(frozen=True)
class Publish:
    """One publish still on main: its window, run, commit time and order (the table's
    sequence number), and for a derived table the sequence number of each input it read."""

    start: datetime
    end: datetime
    run_id: str
    committed_ms: int
    sequence_number: int = 0
    reads: dict[str, int] | None = None

    def read(self, other: Publish, table: str) -> bool:
        """Whether this (derived) publish read ``other``, a publish of its input ``table``
        (``catalog.namespace.table``): by the input's sequence number it recorded; for a
        publish that recorded none, by commit time."""
        if self.reads is not None and table in self.reads:
            return other.sequence_number <= self.reads[table]
        return other.committed_ms <= self.committed_ms


@dataclass
class Findings:
    """Per table, the hours (partition starts) to (re)materialize, and retention risks."""

    raw_gaps: list[datetime] = field(default_factory=list)
    current_gaps: list[datetime] = field(default_factory=list)
    # declared table -> hour -> reason, tables in dependency order
    tables_due: dict[str, dict[datetime, str]] = field(default_factory=dict)
    retention_risks: list[dict[str, Any]] = field(default_factory=list)
    closed_until: datetime | None = None
    # Kafka's log of the topic is not the ledger's (deleted and recreated, or failed over):
    # no raw or current hour is compared until the new log is adopted
    replaced: TopicReplaced | None = None
    # Hours the current log holds records for that are covered by publishes of an older log
    # (adopted since): they are not re-read unless those publishes are rolled back
    shadowed: dict[datetime, ledger.Entry] = field(default_factory=dict)


def published(catalog: Catalog, identifier: str) -> list[Publish]:
    """Live publishes of ``namespace.table``, newest first, one per covered hour, from the
    ledger (:mod:`backfill_assets.lake.offsets.ledger`): it survives snapshot expiry, and a
    rolled-back
    publish is no longer live."""
    namespace = identifier.split(".", 1)[0]
    entries = ledger.coverage(catalog, namespace, f"{catalog.name}.{identifier}")
    out = [_publish(e) for e in entries.values()]
    return sorted(out, key=lambda p: p.committed_ms, reverse=True)


def _publish(entry: ledger.Entry) -> Publish:
    return Publish(
        entry.hour,
        entry.hour + HOUR,
        entry.run_id,
        entry.committed_ms,
        entry.sequence_number,
        entry.reads,
    )


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
    kafka: KafkaClient,
    topic: str,
    first: datetime,
    last: datetime,
    known: dict[datetime, dict[int, tuple[int, int]]] | None = None,
) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Kafka-time hours in ``[first, last)`` that hold records, with their offsets.

    An hour in ``known`` (the ledger's published windows of the topic's raw table) takes its
    offsets from there; only the other hours' bounds are asked of Kafka (ListOffsets by
    timestamp, one request per bound), so a tick costs what is unpublished, not what the
    history holds.

    Kafka's -1 ("no record at or after T") is checked against the partition's newest record
    (ListOffsets max-timestamp): once the log cleaner has emptied a compacted partition's first
    segment, the broker answers -1 for every earlier time (see ``scan._hints``). Such a
    partition's hours are read instead, from its log start (timestamps of committed records)."""
    hours = []
    hour = first
    while hour < last:
        hours.append(hour)
        hour += HOUR
    known = known or {}
    probe = sorted({b for h in hours if h not in known for b in (h, h + HOUR)})
    bounds = kafka.offsets_for_many(topic, [_ms(b) for b in probe], raw=True) if probe else {}
    ends = kafka.log_ends(topic) if probe else {}
    blind, read = _blind_hours(kafka, topic, bounds, ends)
    out: dict[datetime, dict[int, tuple[int, int]]] = {}
    for start in hours:
        if start in known:
            ranges = dict(known[start])
        else:
            lo, hi = bounds[_ms(start)], bounds[_ms(start + HOUR)]
            ranges = {
                p: (_or_end(lo[p], ends[p]), _or_end(hi[p], ends[p])) for p in lo if p not in blind
            }
            ranges.update(read.get(_ms(start), {}))
        if any(e > s for s, e in ranges.values()):
            out[start] = ranges
    return out


def _or_end(offset: int, ends: tuple[int, int, int]) -> int:
    """A ListOffsets answer, Kafka's -1 ("none at or after it") as the high watermark."""
    return offset if offset >= 0 else ends[2]


def _blind_hours(
    kafka: KafkaClient,
    topic: str,
    bounds: dict[int, dict[int, int]],
    ends: dict[int, tuple[int, int, int]],
) -> tuple[set[int], dict[int, dict[int, tuple[int, int]]]]:
    """The partitions whose -1 answers in ``bounds`` contradict their newest committed record
    (at or after the time asked, below the LSO), and their hours read from the records
    (hour ms -> partition -> offsets)."""
    earliest: dict[int, int] = {}
    for ts, per in bounds.items():
        for p, offset in per.items():
            if offset < 0 and ends[p][0] < ends[p][1]:
                earliest[p] = min(ts, earliest.get(p, ts))
    if not earliest:
        return set(), {}
    blind: dict[int, list[tuple[int, int, int | None, int | None]]] = {
        p: [(ends[p][0], ends[p][1], None, None)]
        for p, (offset, ts_ms) in kafka.newest_records(topic, sorted(earliest)).items()
        if ts_ms >= earliest[p] and ends[p][0] <= offset < ends[p][1]
    }
    if not blind:
        return set(), {}
    cells, rest = _read_hours(kafka, topic, blind, 1 << 62)
    if rest:
        raise KafkaClientError(
            f"topic {topic!r} partitions {sorted(rest)}: Kafka answered ListOffsets by time "
            "with -1 though they hold later records (a compacted partition whose first segment "
            "the log cleaner emptied), and reading their records instead got no answer within "
            f"{kafka.request_timeout_s:.0f}s, so their hours are unknown. The next tick retries; "
            "if this persists, check the brokers (`backfill-assets gaps` runs the same look-up)."
        )
    return set(blind), cells


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


# Records read per tick from the offsets the ledger does not cover, before the rest is left to
# ListOffsets-by-timestamp probes (exact on topics without transactions; see kafka_hours).
READ_BUDGET = GAP_READ_BUDGET
_POLL_S = 0.05


def kafka_hours(
    kafka: KafkaClient,
    topic: str,
    floor: datetime,
    until: datetime,
    known: dict[datetime, dict[int, tuple[int, int]]] | None = None,
    *,
    read_budget: int = READ_BUDGET,
) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Kafka-time hours in ``[floor, until)`` that hold committed records, with their offsets.

    Bounded by what Kafka says it holds (ListOffsets: log start, last stable offset), never by
    a record read at ``high_watermark - 1``, which on a transactional topic is a commit marker
    that a committed reader never receives. Hours in ``known`` (the ledger's published windows
    of the topic's raw table) take their offsets from there. The offsets below the last stable
    offset that no published window holds are read once (committed records only, timestamps
    only; aborted records and markers are skipped by the broker), each record going to the hour
    of the highest timestamp seen so far in its partition (the ListOffsets-by-timestamp rule
    the windows follow), kept between the published hours around it. ListOffsets by timestamp
    alone is not used for them: on a transactional topic its answer for a back-dated hour is a
    commit marker stamped with the broker's clock, which makes every later hour look empty.

    A tick therefore costs what is unpublished: nothing to read when the ledger covers the log.
    Past ``read_budget`` records, the rest of a partition is probed by timestamp
    (:func:`hours_with_records`) up to the hour of the topic's max timestamp (ListOffsets)."""
    known = known or {}
    out: dict[datetime, dict[int, tuple[int, int]]] = {
        h: dict(r)
        for h, r in known.items()
        if floor <= h < until and any(e > s for s, e in r.values())
    }
    ends = kafka.log_ends(topic)
    tasks = {p: _unpublished(known, p, low, lso) for p, (low, lso, _hw) in ends.items()}
    tasks = {p: t for p, t in tasks.items() if t}
    if not tasks:
        return out
    cells, rest = _read_hours(kafka, topic, tasks, read_budget)
    for hour_ms, per in cells.items():
        hour = datetime.fromtimestamp(hour_ms / 1000, UTC)
        if floor <= hour < until:
            out.setdefault(hour, {}).update(per)
    if rest:
        newest = _max_timestamp_hour(kafka, topic, list(rest))
        lowest = min(ms for _offset, ms in rest.values())
        first = floor if lowest < 0 else max(floor, datetime.fromtimestamp(lowest / 1000, UTC))
        last = min(until, newest + HOUR) if newest is not None else until
        probed = hours_with_records(kafka, topic, first, last) if first < last else {}
        for hour, ranges in probed.items():
            for p, (s, e) in ranges.items():
                if p in rest and e > max(s, rest[p][0]):
                    # The read may have ended inside this hour: its cell and the probe's join.
                    cell = out.setdefault(hour, {})
                    read = cell.get(p, (max(s, rest[p][0]), e))
                    cell[p] = (min(read[0], max(s, rest[p][0])), max(read[1], e))
    return out


def _unpublished(
    known: dict[datetime, dict[int, tuple[int, int]]], partition: int, low: int, lso: int
) -> list[tuple[int, int, int | None, int | None]]:
    """Offset ranges of ``partition`` below ``lso`` that no published window holds, each with
    the hours (epoch ms) of the published windows before and after it (None: none)."""
    chain = sorted(
        # Absent from a published hour: the partition did not exist yet (it starts at 0).
        (_ms(h), *r.get(partition, (0, 0)))
        for h, r in known.items()
    )
    out: list[tuple[int, int, int | None, int | None]] = []
    start, before = low, None
    for hour_ms, s, e in chain:
        if min(s, lso) > start:
            out.append((start, min(s, lso), before, hour_ms))
        start, before = max(start, e), hour_ms
    if lso > start:
        out.append((start, lso, before, None))
    return out


def _read_hours(
    kafka: KafkaClient,
    topic: str,
    tasks: dict[int, list[tuple[int, int, int | None, int | None]]],
    budget: int,
) -> tuple[dict[int, dict[int, tuple[int, int]]], dict[int, tuple[int, int]]]:
    """Hour (epoch ms) -> partition -> offsets of the committed records in the given ranges,
    and, per partition left unread (budget spent, or no answer), (next offset, its hour)."""
    reader = _HourReader(topic, budget, {p: list(reversed(t)) for p, t in tasks.items()})
    consumer = kafka.range_consumer("gap-scan")
    try:
        consumer.assign([reader.begin(p) for p in sorted(reader.pending)])
        active = set(reader.state)
        idle_since = time.monotonic()
        while active:
            msgs = consumer.consume(num_messages=10_000, timeout=_POLL_S)
            if not msgs:
                if time.monotonic() - idle_since > kafka.request_timeout_s:
                    break
                continue
            idle_since = time.monotonic()
            finished: set[int] = set()
            for msg in msgs:
                p = msg.partition()
                if p is None or p not in active or p in finished:
                    continue
                if reader.take(p, msg):
                    finished.add(p)
            reader.release(consumer, finished, active)
        reader.give_up(active)
    finally:
        consumer.close()
    return reader.cells, reader.rest


@dataclass
class _HourReader:
    """The state of one :func:`_read_hours` pass: the ranges left per partition, the one being
    read, the cells found so far and what is left to the probes."""

    topic: str
    budget: int
    pending: dict[int, list[tuple[int, int, int | None, int | None]]]
    cells: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    rest: dict[int, tuple[int, int]] = field(default_factory=dict)
    # partition -> [end, hour, cell start, running, lo, hi]
    state: dict[int, list[int]] = field(default_factory=dict)
    read: int = 0

    def close(self, p: int, at: int) -> None:
        """End partition ``p``'s current cell at offset ``at`` (capped at its range's end)."""
        end, hour, cell_start = self.state[p][0], self.state[p][1], self.state[p][2]
        if hour >= 0 and min(at, end) > cell_start:
            self.cells.setdefault(hour, {})[p] = (cell_start, min(at, end))

    def begin(self, p: int) -> Any:
        """Start partition ``p``'s next pending range; the assignment that reads it."""
        from confluent_kafka import TopicPartition

        start, end, before, after = self.pending[p].pop()
        lo = before + HOUR_MS if before is not None else -1
        hi = after - HOUR_MS if after is not None else 1 << 62
        self.state[p] = [end, -1, start, lo, lo, hi]
        return TopicPartition(self.topic, p, start)

    def take(self, p: int, msg: Any) -> bool:
        """Attribute one message of partition ``p``; True when the partition's range is done
        (its end, end of partition, or the budget spent)."""
        from confluent_kafka import KafkaError

        st = self.state[p]
        err = msg.error()
        offset = msg.offset()
        if err is not None:
            if offsets_gone(err):
                raise KafkaClientError(
                    f"topic {self.topic!r} partition {p}: offsets from "
                    f"{offset if offset is not None and offset >= 0 else st[2]} were deleted "
                    "from Kafka while the gap sensor read them (retention or delete_records); "
                    "no hour was judged from the rest. The next tick reads the log as it "
                    "stands then."
                )
            if err.code() != KafkaError._PARTITION_EOF:
                raise KafkaClientError(
                    f"topic {self.topic!r} partition {p}: Kafka error while looking for "
                    f"gaps: {err.str()}"
                )
            return True
        assert offset is not None
        if offset >= st[0]:
            return True
        self.read += 1
        ts = msg.timestamp()[1]
        hour = min(max(st[3], ts - ts % HOUR_MS), st[5])
        st[3] = max(st[3], hour)
        if hour != st[1]:
            if st[1] >= 0:
                self.close(p, offset)
                st[2] = offset
            st[1] = hour
        if offset + 1 >= st[0]:
            return True
        if self.read >= self.budget:
            self.rest[p] = (offset + 1, st[1])
            self.close(p, offset + 1)
            self.pending[p] = []
            return True
        return False

    def release(self, consumer: Any, finished: set[int], active: set[int]) -> None:
        """Close the ``finished`` partitions' cells and unassign them; start each one's next
        range while the budget lasts, else leave it to the probes and drop it from ``active``."""
        from confluent_kafka import TopicPartition

        for p in finished:
            if p not in self.rest:
                self.close(p, self.state[p][0])
            consumer.incremental_unassign([TopicPartition(self.topic, p)])
            if self.pending[p] and self.read < self.budget:
                consumer.incremental_assign([self.begin(p)])
                continue
            if self.pending[p]:  # budget spent before this range: left to the probes
                start, _end, before, _after = self.pending[p][-1]
                self.rest[p] = (start, before + HOUR_MS if before is not None else -1)
            active.discard(p)

    def give_up(self, active: set[int]) -> None:
        """Leave the partitions still ``active`` (no answer within the request timeout) to
        the probes."""
        for p in active:
            self.rest[p] = (self.state[p][2], max(self.state[p][1], self.state[p][4]))
            self.close(p, self.state[p][2])


def _max_timestamp_hour(kafka: KafkaClient, topic: str, parts: list[int]) -> datetime | None:
    """The hour of the greatest timestamp Kafka holds in ``parts`` (ListOffsets max-timestamp;
    on a transactional topic possibly a marker's, stamped with the broker's clock)."""
    stamps = [ms for _, ms in kafka.newest_records(topic, parts).values() if ms >= 0]
    return hour_of_ms(max(stamps)) if stamps else None


def find(
    kafka: KafkaClient,
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    *,
    specs: list[TopicSpec] | None = None,
    now: datetime | None = None,
    retention_horizon: timedelta = timedelta(hours=24),
    read_budget: int = READ_BUDGET,
) -> Findings:
    """Everything the gap, late-data and retention checks need, in one pass; ``specs`` (all
    topics) resolve what the topic's declared tables read from other topics; ``read_budget``
    bounds the records read per topic (:func:`kafka_hours`)."""
    now = now or datetime.now(UTC)
    last_closed = now.replace(minute=0, second=0, microsecond=0)
    findings = Findings(closed_until=last_closed)
    # Records newer than the last closed hour wait until their hour closes.
    raw_entries, in_kafka, findings.replaced, findings.shadowed = _raw_side(
        kafka, catalog, namespace, spec, last_closed, read_budget
    )
    raw_pub = {h: _publish(e) for h, e in raw_entries.items()}
    cur_pub = covered_hours(published(catalog, f"{namespace}.{spec.current_table}"))
    findings.raw_gaps = sorted(h for h in in_kafka if h not in raw_pub)
    raw_full = f"{catalog.name}.{namespace}.{spec.raw_table}"
    findings.current_gaps = _current_gaps(raw_full, in_kafka, raw_pub, cur_pub)
    every = list(specs) if specs is not None else [spec]
    known = declared.relations(every)
    by_topic = {spec.topic: in_kafka}
    coverage: dict[str, dict[datetime, Publish]] = {}
    raw_coverage = {spec.topic: raw_entries}

    logs: dict[str, ledger.Log] = {}
    raw_tables = {s.topic: s.raw_table for s in every}

    def raw_of(topic: str) -> dict[datetime, ledger.Entry]:
        if topic not in raw_coverage:
            raw = f"{catalog.name}.{namespace}.{raw_tables[topic]}"
            raw_coverage[topic], logs[topic] = ledger.log_coverage(catalog, namespace, raw)
        return raw_coverage[topic]

    def expected(topic: str) -> dict[datetime, dict[int, tuple[int, int]]]:
        if topic not in by_topic:
            mine = {h: e for h, e in raw_of(topic).items() if logs[topic].holds(e)}
            by_topic[topic] = kafka_hours(
                kafka,
                topic,
                spec.partition_start,
                last_closed,
                _windows(mine),
                read_budget=read_budget,
            )
        return by_topic[topic]

    def covered(table: str) -> dict[datetime, Publish]:
        if table not in coverage:
            coverage[table] = covered_hours(published(catalog, f"{namespace}.{table}"))
        return coverage[table]

    def full(table: str) -> str:
        return f"{catalog.name}.{namespace}.{table}"

    for table in declared.ordered(every):
        if table.topic == spec.topic:
            hours = _candidates(table, known, in_kafka, raw_of, covered)
            findings.tables_due[table.name] = _due(
                table,
                known,
                {h for h in hours if h >= spec.partition_start},
                expected,
                covered,
                last_closed,
                full,
            )
    if findings.replaced is None:
        findings.retention_risks = _retention_risks(
            kafka, spec.topic, in_kafka, raw_pub, now, retention_horizon
        )
    return findings


def _raw_side(
    kafka: KafkaClient,
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    last_closed: datetime,
    read_budget: int,
) -> tuple[
    dict[datetime, ledger.Entry],
    dict[datetime, dict[int, tuple[int, int]]],
    TopicReplaced | None,
    dict[datetime, ledger.Entry],
]:
    """The raw table's live publishes, the Kafka hours holding records (with their offsets),
    the refusal when Kafka's log is not the ledger's, and the hours of the current log covered
    by publishes of an older one. When refused, Kafka is not read: the hours "holding records"
    are the published ones, so only what reads published hours can be requested."""
    raw = f"{catalog.name}.{namespace}.{spec.raw_table}"
    entries, log = ledger.log_coverage(catalog, namespace, raw)
    refused = identity.compare(spec.topic, log, kafka.topic_identity(spec.topic))
    if refused is not None:
        held = {
            h: w
            for h, w in _windows(entries).items()
            if spec.partition_start <= h < last_closed and any(e > s for s, e in w.values())
        }
        return entries, held, refused, {}
    mine = {h: e for h, e in entries.items() if log.holds(e)}
    in_kafka = kafka_hours(
        kafka,
        spec.topic,
        spec.partition_start,
        last_closed,
        _windows(mine),
        read_budget=read_budget,
    )
    shadowed = {h: e for h, e in entries.items() if h in in_kafka and not log.holds(e)}
    return entries, in_kafka, None, shadowed


def _candidates(
    table: TableSpec,
    known: dict[str, declared.Relation],
    in_kafka: dict[datetime, Any],
    raw_of: Callable[[str], dict[datetime, ledger.Entry]],
    covered: Callable[[str], dict[datetime, Publish]],
) -> set[datetime]:
    """The hours ``table`` can hold rows for: the event hours of the events it reads (as the
    raw publishes recorded them; a publish that did not record them counts its Kafka hour),
    the published hours of the declared tables it reads, and the hours that look back on any
    of them; and the Kafka hours of its topic that hold records."""
    found: set[datetime] = set(in_kafka)
    for ref in table.refs:
        rel = known[ref]
        if rel.kind == "events":
            for kafka_hour, entry in raw_of(rel.topic).items():
                found.update(entry.event_hours if entry.event_hours is not None else [kafka_hour])
        elif rel.kind == "table":
            found.update(covered(rel.name))
    return {h + i * HOUR for h in found for i in range(table.lookback_hours + 1)}


def _due(
    table: TableSpec,
    known: dict[str, declared.Relation],
    candidates: set[datetime],
    expected: Any,
    covered: Callable[[str], dict[datetime, Publish]],
    last_closed: datetime,
    full: Callable[[str], str],
) -> dict[datetime, str]:
    """Event-time hours of ``table`` to (re)materialize: never published, or the publish of an
    hour it reads (as the partition mapping says) is one its own publish did not read. An hour
    waits until every hour it reads has closed and, where Kafka holds records for it, been
    published."""
    mine = covered(table.name)
    due: dict[datetime, str] = {}
    for hour in sorted(candidates):
        wait, newer = False, ""
        for ref in table.refs:
            rel = known[ref]
            later = table.lateness_hours if rel.kind != "table" else 0
            deps = [hour + i * HOUR for i in range(-table.lookback_hours, later + 1)]
            if any(d > last_closed - HOUR for d in deps):
                wait = True
                break
            dep_table = f"raw_{rel.name}" if rel.kind == "events" else rel.name
            pubs = covered(dep_table)
            has_records = expected(rel.topic)
            if any(d in has_records and d not in pubs for d in deps):
                wait = True  # an hour it reads is not published yet
                break
            own = mine.get(hour)
            unread = [
                pubs[d]
                for d in deps
                if d in pubs and own and not own.read(pubs[d], full(dep_table))
            ]
            if unread and not newer:
                newer = f"{dep_table} hours republished by run {unread[0].run_id}"
        if wait:
            continue
        if hour not in mine:
            due[hour] = "never published"
        elif newer:
            due[hour] = newer
    return due


def _current_gaps(
    raw_full: str,
    in_kafka: Iterable[datetime],
    raw_pub: dict[datetime, Publish],
    cur_pub: dict[datetime, Publish],
) -> list[datetime]:
    """The current state's due hours: Kafka hours it never published, and, by lineage, hours
    whose raw publish it did not read (a raw-only materialization, or a run whose current step
    failed, republished them)."""
    unread = {h for h, p in raw_pub.items() if h in cur_pub and not cur_pub[h].read(p, raw_full)}
    return sorted({h for h in in_kafka if h not in cur_pub} | unread)


def late_readers(spec: TopicSpec, specs: list[TopicSpec] | None = None) -> list[TableSpec]:
    """The declared tables that read ``spec``'s events or its current state, wherever they are
    declared (``specs``: every topic; default ``spec`` alone)."""
    every = list(specs) if specs is not None else [spec]
    if spec not in every:
        every.append(spec)
    mine = {spec.name, spec.current_table}
    return [t for s in every for t in s.tables if mine & set(t.refs)]


class _Touched:
    """The event-time hours each raw publish (Kafka hour) touched, from the ledger; a publish
    whose ledger rows do not say (appended before the ledger kept event hours, or recovered from
    main's history by sync_from_history) has its own rows read, once, and only those."""

    def __init__(self, catalog: Catalog, namespace: str, spec: TopicSpec) -> None:
        self.catalog, self.namespace, self.spec = catalog, namespace, spec
        self.rows: dict[datetime, dict[datetime, int]] = {}

    def prefetch(self, entries: Iterable[tuple[datetime, ledger.Entry]]) -> None:
        unknown = {k: e for k, e in entries if e.event_hours is None and k not in self.rows}
        if unknown:
            self.rows.update(
                _event_hours_from_rows(self.catalog, self.namespace, self.spec, unknown)
            )

    def of(self, kafka_hour: datetime, entry: ledger.Entry) -> set[datetime]:
        touched = entry.touched_hours
        return set(self.rows[kafka_hour]) if touched is None else touched


def late_event_hours(
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    *,
    specs: list[TopicSpec] | None = None,
    now: datetime | None = None,
) -> dict[str, dict[datetime, str]]:
    """Per declared table that reads the topic's events or current state (:func:`late_readers`:
    declared under any topic of ``specs``): event-time hours that a raw or current-state
    publish changed after the table's hour was published, from Kafka hours outside what the
    hour reads by its partition mapping (so the gap sensor's staleness rule misses them).

    Events: the raw publish of Kafka hour K touches event hour E when K's rows are of E, or
    when they are other versions of events of E (a correction that moves an event touches the
    hour of the version it supersedes as well as its own). Table hour H is due when its
    publish did not read that raw publish (lineage: the raw sequence number it read), H is E or
    looks back on E (E <= H <= E + lookback), and K is outside H - lookback .. H + lateness.

    Current state: a reader's hour H reads the whole current state, so a current-state publish
    of Kafka hour K it did not read makes H due when K is outside its mapping and the state
    changed at or before H: the earliest event hour K's raw publish touched is at most H
    (:func:`_late_on_current`).

    What each Kafka hour touches comes from the ledger (``Entry.event_hours``,
    ``Entry.superseded_hours``, the replay's own figures), so a tick reads ledger rows, never
    table rows, and costs the same whatever the tables hold."""
    readers = late_readers(spec, specs)
    out: dict[str, dict[datetime, str]] = {}
    if not readers:
        return out
    raw_name = f"{catalog.name}.{namespace}.{spec.raw_table}"
    raw_entries = ledger.coverage(catalog, namespace, raw_name)
    if not raw_entries:
        return out
    # Oldest commit first, so a reason names the newest run that brought late records.
    by_commit = sorted(
        raw_entries.items(), key=lambda kv: (kv[1].sequence_number, kv[1].recorded_at, kv[0])
    )
    touched = _Touched(catalog, namespace, spec)
    current: dict[datetime, Publish] | None = None
    for table in readers:
        mine = covered_hours(published(catalog, f"{namespace}.{table.name}"))
        if not mine:
            continue
        due: dict[datetime, str] = {}
        if spec.name in table.refs:
            due.update(_late_on_events(table, mine, by_commit, raw_name, touched))
        if spec.current_table in table.refs:
            if current is None:
                current = covered_hours(published(catalog, f"{namespace}.{spec.current_table}"))
            cur_name = f"{catalog.name}.{namespace}.{spec.current_table}"
            for hour, why in _late_on_current(
                table, mine, (current, cur_name), raw_entries, touched
            ).items():
                due.setdefault(hour, why)
        if due:
            out[table.name] = dict(sorted(due.items()))
    return out


def _late_on_events(
    table: TableSpec,
    mine: dict[datetime, Publish],
    by_commit: list[tuple[datetime, ledger.Entry]],
    raw_name: str,
    touched: _Touched,
) -> dict[datetime, str]:
    """The hours of ``table`` that raw publishes of its events made due beyond its mapping."""
    # Only raw publishes some published hour of the table did not read can make it due.
    runs = {p.run_id: p for p in mine.values()}.values()
    recent = [(k, e) for k, e in by_commit if any(not p.read(_publish(e), raw_name) for p in runs)]
    touched.prefetch(recent)
    lateness = timedelta(hours=table.lateness_hours)
    lookback = timedelta(hours=table.lookback_hours)
    due: dict[datetime, str] = {}
    for kafka_hour, entry in recent:
        for event_hour in sorted(touched.of(kafka_hour, entry)):
            hour = event_hour
            while hour <= event_hour + lookback:
                pub = mine.get(hour)
                # Never published: the gap sensor handles it; inside the mapping: its
                # staleness rule does.
                inside = hour - lookback <= kafka_hour <= hour + lateness
                if pub is not None and not inside and not pub.read(_publish(entry), raw_name):
                    due[hour] = _late_reason(entry, event_hour, hour)
                hour += HOUR
    return due


def _late_on_current(
    table: TableSpec,
    mine: dict[datetime, Publish],
    current: tuple[dict[datetime, Publish], str],
    raw_entries: dict[datetime, ledger.Entry],
    touched: _Touched,
) -> dict[datetime, str]:
    """The hours of ``table`` that current-state publishes made due beyond its mapping.

    Hour H reads the current state as a whole, at least as of Kafka hour H + lateness. A
    current-state publish of Kafka hour K that H's publish did not read (by lineage) changed
    what H should hold when K is outside H - lookback .. H + lateness (inside, the gap
    sensor's staleness rule sees it) and the state it brought is of an event hour at or before
    H: late records or a correction (K > H + lateness, earliest touched event hour <= H), or a
    republish of an older hour (K < H - lookback), whose state later hours carry forward."""
    publishes, cur_name = current
    lateness = timedelta(hours=table.lateness_hours)
    lookback = timedelta(hours=table.lookback_hours)
    runs = {p.run_id: p for p in mine.values()}.values()
    unread = sorted(
        (p.sequence_number, k, p)
        for k, p in publishes.items()
        if any(not r.read(p, cur_name) for r in runs)
    )
    touched.prefetch((k, raw_entries[k]) for _, k, _ in unread if k in raw_entries)
    due: dict[datetime, str] = {}
    for _, kafka_hour, cur in unread:
        entry = raw_entries.get(kafka_hour)
        hours = touched.of(kafka_hour, entry) if entry is not None else set()
        first = min(hours | {kafka_hour})
        for hour, pub in mine.items():
            inside = hour - lookback <= kafka_hour <= hour + lateness
            if hour >= first and not inside and not pub.read(cur, cur_name):
                due[hour] = (
                    f"the current state changed at Kafka hour {kafka_hour:%Y-%m-%d %H:00}"
                    f" (event hour {first:%Y-%m-%d %H:00}) by run {cur.run_id}, after this"
                    " hour read it"
                )
    return due


def _late_reason(entry: ledger.Entry, event_hour: datetime, hour: datetime) -> str:
    own = entry.event_hours is None or event_hour in entry.event_hours
    what = "late records" if own else "a correction of its events"
    why = "" if hour == event_hour else f" of hour {event_hour:%Y-%m-%d %H:00}, which it reads"
    return f"{what}{why} ingested by run {entry.run_id}"


def _event_hours_from_rows(
    catalog: Catalog, namespace: str, spec: TopicSpec, entries: dict[datetime, ledger.Entry]
) -> dict[datetime, dict[datetime, int]]:
    """Kafka hour -> event-time hour -> rows, for the given live raw publishes, from the raw
    table's rows of those runs in those hours (tombstones excluded, as the replay's figures).
    Read batch by batch and counted as they come: rows are never collected."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: dict[datetime, dict[datetime, int]] = {hour: {} for hour in entries}
    quoted = ", ".join(sorted({f"'{e.run_id}'" for e in entries.values() if "'" not in e.run_id}))
    if not quoted:
        return out
    table = catalog.load_table(f"{namespace}.{spec.raw_table}")
    # The hours' bounds prune the table's kafka_hour partitions (epoch microseconds).
    row_filter = (
        f"ingest_run_id IN ({quoted}) AND is_tombstone == false"
        f" AND kafka_hour >= {_us(min(entries))} AND kafka_hour < {_us(max(entries) + HOUR)}"
    )
    event = spec.event_time_field
    scan = table.scan(row_filter=row_filter, selected_fields=(event, "kafka_hour", "ingest_run_id"))
    for batch in scan.to_arrow_batch_reader():
        rows = pa.Table.from_batches([batch])
        rows = rows.filter(pc.is_valid(rows[event]))
        if rows.num_rows == 0:
            continue
        rows = rows.append_column("event_hour", pc.floor_temporal(rows[event], unit="hour"))
        groups = rows.group_by(["kafka_hour", "ingest_run_id", "event_hour"]).aggregate(
            [("kafka_hour", "count")]
        )
        for group in groups.to_pylist():
            kafka_hour = _hour(group["kafka_hour"])
            entry = entries.get(kafka_hour)
            if entry is None or entry.run_id != group["ingest_run_id"]:
                continue  # another run's rows, or an hour another run published since
            counts = out[kafka_hour]
            event_hour = _hour(group["event_hour"])
            counts[event_hour] = counts.get(event_hour, 0) + int(group["kafka_hour_count"])
    return out


def _us(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000)


def _retention_risks(
    kafka: KafkaClient,
    topic: str,
    in_kafka: dict[datetime, dict[int, tuple[int, int]]],
    raw_pub: dict[datetime, Publish],
    now: datetime,
    horizon: timedelta,
) -> list[dict[str, Any]]:
    kept_ms = retention_ms(kafka, topic)
    if kept_ms is None or kept_ms < 0:
        return []
    from backfill_assets.lake.offsets.archive import Archive

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


def retention_ms(kafka: KafkaClient, topic: str) -> int | None:
    """The topic's ``retention.ms`` (negative: unlimited), None if the broker does not say."""
    return kafka.retention_ms(topic)


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
