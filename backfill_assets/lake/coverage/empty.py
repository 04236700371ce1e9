"""Hours that provably hold nothing: what the partition bar may show as done without a run.

An hour a run covered is materialized by that run, empty or not. The hours no run covers are
those before the first published hour (since the spec's ``partition_start``), those between two
separately published ranges (the gap sensor requests each run of hours holding records, so an
empty hour splits its requests), and those after the newest record. Each is *known empty* only
from facts that cannot be wrong on any topic (transactional, compacted, with skewed clocks),
under the window rules of :mod:`backfill_assets.lake.offsets.windows` (a record belongs to the hour
whose offset range holds it; boundary T is the first committed record at or after the previous
boundary whose timestamp is >= T):

* **between published hours**: two published hours A < B whose windows chain (A's end offset
  is B's start offset on every partition) leave no offset to the hours between them;
* **before the data**: before the first published hour whose windows start at offset 0 on every
  partition, or, when nothing was ever deleted from the log (log start 0), before the hour of the
  oldest committed record (read, one record per partition: no ListOffsets-by-timestamp, whose
  answer can be a transaction marker stamped with the broker's clock);
* **after the data**: no transaction open and every offset published, or no committed record
  with a timestamp in or after the hour (Kafka's max-timestamp offset, which counts markers too,
  so it can only make this later), and the hour ended ``seal_grace`` ago (the idle-seal rule).

A declared table's event hour is known empty when every Kafka hour it reads (its partition
mapping: H - lookback .. H + lateness) is published or known empty, no published raw hour holds
an event of H - lookback .. H (the ledger's ``event_hours``), and every declared table it reads
is known empty for H - lookback .. H. A table read as current state needs its Kafka hours empty.

Nothing here enters the ledger: a known-empty hour is a statement for the UI, never coverage,
so the gap detection still requests any hour that gains records later. Reads the ledger and
Kafka's offsets only; never starts Spark. No Dagster import (layers: lake).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pyiceberg.catalog import Catalog

from backfill_assets.lake.offsets import identity, ledger
from backfill_assets.lake.offsets.windows import hour_of_ms
from backfill_assets.spec import declared
from backfill_assets.spec.model import TableSpec, TopicSpec
from backfill_assets.stack.kafka import KafkaClient, offsets_gone

HOUR = timedelta(hours=1)
_READ_S = 5.0  # reading each partition's oldest committed record, all partitions at once


@dataclass
class EmptyHours:
    """Known-empty hours: Kafka-time hours of a topic (its raw and current-state tables), and
    event-time hours of each declared table."""

    kafka: set[datetime] = field(default_factory=set)
    tables: dict[str, set[datetime]] = field(default_factory=dict)


def _hour(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _span(first: datetime, end: datetime) -> set[datetime]:
    out, hour = set(), first
    while hour < end:
        out.add(hour)
        hour += HOUR
    return out


@dataclass(frozen=True)
class _LogView:
    """A topic's log as the ledger and Kafka show it: the published ``hours`` (sorted) with
    their ``windows``, and Kafka's ``ends`` per partition (log start, LSO, high watermark)."""

    kafka: KafkaClient
    topic: str
    hours: list[datetime]
    windows: Mapping[datetime, dict[int, tuple[int, int]] | None]
    ends: Mapping[int, tuple[int, int, int]]

    @property
    def holding(self) -> dict[int, tuple[int, int, int]]:
        """The partitions whose log holds records (high watermark above the log start)."""
        return {p: e for p, e in self.ends.items() if e[2] > e[0]}


def kafka_hours(
    kafka: KafkaClient,
    topic: str,
    entries: Mapping[datetime, ledger.Entry],
    first: datetime,
    sealed_until: datetime,
) -> set[datetime]:
    """Unpublished Kafka-time hours of ``topic`` in ``[first, sealed_until)`` that hold no
    record (module docstring); ``entries`` are the raw table's live ledger rows."""
    if sealed_until <= first:
        return set()
    out: set[datetime] = set()
    hours = sorted(entries)
    windows = {h: entries[h].offsets for h in hours}
    # Between published hours whose windows chain.
    for a, b in itertools.pairwise(hours):
        wa, wb = windows[a], windows[b]
        if b - a > HOUR and wa is not None and wb is not None and _chained(wa, wb):
            out |= _span(a + HOUR, b)
    log = _LogView(kafka, topic, hours, windows, kafka.log_ends(topic))
    # Before the data.
    oldest = _oldest_hour(log, sealed_until)
    if oldest is not None:
        out |= _span(first, min(oldest, sealed_until))
    # After the data: only while no transaction is open.
    if all(lso == hw for _, lso, hw in log.ends.values()):
        newest = _newest_hour(log)
        if newest is not None:
            out |= _span(max(first, newest + HOUR), sealed_until)
    return {h for h in out if first <= h < sealed_until and h not in entries}


def _oldest_hour(log: _LogView, sealed_until: datetime) -> datetime | None:
    """The hour the topic's data starts at, when known: every hour before it holds no record
    (None: not known)."""
    hours, holding = log.hours, log.holding
    head = log.windows[hours[0]] if hours else None
    if head is not None and all(s == 0 for s, _ in head.values()):
        return hours[0]
    if not hours and all(hw == 0 for _, _, hw in log.ends.values()):
        return sealed_until  # nothing was ever written
    if holding and all(lo == 0 for lo, _, _ in holding.values()):
        found = _oldest_record_hour(log.kafka, log.topic, list(holding))
        if found is not None:
            return min(found, hours[0]) if hours else found
    return None


def _newest_hour(log: _LogView) -> datetime | None:
    """The hour the topic's data ends in, when known: every hour after it holds no record
    (None: not known). Only meaningful while no transaction is open."""
    last = log.hours[-1] if log.hours else None
    tail = log.windows[last] if last is not None else None
    if last is not None and tail is not None and _covers_log(tail, log.ends):
        return last
    holding = log.holding
    if holding:
        newest = _newest_timestamp_hour(log.kafka, log.topic, list(holding))
        if newest is not None and last is not None:
            newest = max(newest, last)
        return newest
    return None


def _chained(a: dict[int, tuple[int, int]], b: dict[int, tuple[int, int]]) -> bool:
    """B starts exactly where A ends on every partition (a partition absent from A did not
    exist when A was sealed: it starts at 0)."""
    if set(a) - set(b):
        return False
    return all(b[p][0] == a.get(p, (0, 0))[1] for p in b)


def _covers_log(
    window: dict[int, tuple[int, int]], ends: Mapping[int, tuple[int, int, int]]
) -> bool:
    """Every committed offset of every partition is at or before the window's end."""
    return all(window.get(p, (0, 0))[1] == hw for p, (_, _, hw) in ends.items())


def _oldest_record_hour(kafka: KafkaClient, topic: str, parts: list[int]) -> datetime | None:
    """The hour of the oldest committed record over ``parts`` (read from each partition's log
    start; aborted records and markers are never returned), or None if a partition did not
    answer. A partition holding no committed record at all answers end-of-partition."""
    from confluent_kafka import KafkaError, TopicPartition

    # Called only while every log starts at 0; a log start that moves meanwhile is an error
    # message (no answer), never a jump to the new start, whose record would pass for the
    # oldest and make the deleted records' hours look empty.
    consumer = kafka.range_consumer("oldest-record")
    stamps: list[int] = []
    want = set(parts)
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        deadline = time.monotonic() + _READ_S
        while want and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=len(parts), timeout=0.5):
                p = msg.partition()
                if p not in want:
                    continue
                err = msg.error()
                if err is None:
                    stamps.append(msg.timestamp()[1])
                    want.discard(p)
                elif offsets_gone(err):
                    return None
                elif err.code() == KafkaError._PARTITION_EOF:
                    want.discard(p)
    finally:
        consumer.close()
    if want or not stamps:
        return None
    return hour_of_ms(min(stamps))


def _newest_timestamp_hour(kafka: KafkaClient, topic: str, parts: list[int]) -> datetime | None:
    """The hour of the largest timestamp Kafka holds over ``parts`` (ListOffsets max-timestamp;
    transaction markers count, which can only make it later), or None if it does not say."""
    stamps = []
    for offset, ms in kafka.newest_records(topic, parts, committed=False).values():
        if offset < 0 or ms < 0:
            return None
        stamps.append(ms)
    return hour_of_ms(max(stamps)) if stamps else None


def find(
    kafka: KafkaClient,
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    *,
    specs: list[TopicSpec] | None = None,
    now: datetime | None = None,
    seal_grace: timedelta | None = None,
) -> EmptyHours:
    """Known-empty hours of ``spec``'s topic and of its declared tables, from the spec's
    ``partition_start`` to the last hour sealed at ``now``; ``specs`` (all topics) resolve what
    the declared tables read from other topics."""
    now = now or datetime.now(UTC)
    grace = seal_grace if seal_grace is not None else timedelta(seconds=kafka.settings.seal_grace_s)
    sealed_until = _hour(now - grace)
    every = list(specs) if specs is not None else [spec]
    by_topic = {s.topic: s for s in every}
    raw_entries: dict[str, dict[datetime, ledger.Entry]] = {}
    empty_kafka: dict[str, set[datetime]] = {}

    logs: dict[str, ledger.Log] = {}

    def entries(topic: str) -> dict[datetime, ledger.Entry]:
        if topic not in raw_entries:
            raw = f"{catalog.name}.{namespace}.{by_topic[topic].raw_table}"
            raw_entries[topic], logs[topic] = ledger.log_coverage(catalog, namespace, raw)
        return raw_entries[topic]

    def empty(topic: str) -> set[datetime]:
        if topic not in empty_kafka:
            empty_kafka[topic] = _log_hours(kafka, topic, entries(topic), logs[topic])
        return empty_kafka[topic]

    def _log_hours(
        kafka: KafkaClient, topic: str, live: dict[datetime, ledger.Entry], log: ledger.Log
    ) -> set[datetime]:
        """Known-empty Kafka hours of the log Kafka holds now: none while it is not the
        ledger's (a recreated topic: its hours are not compared until adopted); publishes of
        an older log fix no window of it, and their hours are not reported."""
        if identity.compare(topic, log, kafka.topic_identity(topic)) is not None:
            return set()
        mine = {h: e for h, e in live.items() if log.holds(e)}
        start = by_topic[topic].partition_start
        return kafka_hours(kafka, topic, mine, start, sealed_until) - set(live)

    out = EmptyHours(kafka=empty(spec.topic))
    known = declared.relations(every)
    # This topic's declared tables, and the declared tables they read (transitively).
    needed = {t.name for t in spec.tables}
    for table in reversed(declared.ordered(every)):
        if table.name in needed:
            needed |= {r for r in table.refs if known[r].kind == "table"}
    tables: dict[str, set[datetime]] = {}
    for table in declared.ordered(every):
        if table.name in needed:
            start = by_topic[table.topic].partition_start
            tables[table.name] = table_hours(table, known, entries, empty, tables, start)
    out.tables = {t.name: tables[t.name] for t in spec.tables}
    return out


def table_hours(
    table: TableSpec,
    known: Mapping[str, declared.Relation],
    entries: Callable[[str], Mapping[datetime, ledger.Entry]],
    empty: Callable[[str], set[datetime]],
    tables: Mapping[str, set[datetime]],
    first: datetime,
) -> set[datetime]:
    """Known-empty event hours of a declared table (module docstring): ``entries(topic)`` are
    a topic's live raw ledger rows, ``empty(topic)`` its known-empty Kafka hours, ``tables``
    the known-empty hours of the declared tables computed before (dependency order)."""
    candidates: set[datetime] | None = None
    for ref in table.refs:
        rel = known[ref]
        if rel.kind == "table":
            ok = _table_ok(tables.get(rel.name, set()), table.lookback_hours)
        else:
            ok = _topic_ok(
                entries(rel.topic),
                empty(rel.topic),
                table.lookback_hours,
                table.lateness_hours,
                events=rel.kind == "events",
            )
        candidates = ok if candidates is None else candidates & ok
    return {h for h in candidates or set() if h >= first}


def _table_ok(empty: set[datetime], lookback: int) -> set[datetime]:
    """Hours H whose H - lookback .. H are all known empty in the table read."""
    return {h for h in empty if all(h - i * HOUR in empty for i in range(1, lookback + 1))}


def _topic_ok(
    entries: Mapping[datetime, ledger.Entry],
    empty: set[datetime],
    lookback: int,
    lateness: int,
    *,
    events: bool,
) -> set[datetime]:
    """Event hours H of a topic whose Kafka hours H - lookback .. H + lateness are settled
    (published or known empty) and whose events (``events``; else its records, for a table
    read as current state) in H - lookback .. H are none."""
    if events:
        settled = empty | set(entries)
        held: set[datetime] = set()
        for entry in entries.values():
            if entry.event_hours is None and (
                entry.offsets is None or any(e > s for s, e in entry.offsets.values())
            ):
                return set()  # a publish whose event hours are unknown: claim nothing
            held |= set(entry.event_hours or {})
    else:
        settled = empty | {
            hour
            for hour, entry in entries.items()
            if entry.offsets is not None and all(e == s for s, e in entry.offsets.values())
        }
        held = set()
    out = set()
    for hour in settled:
        reads = [hour + i * HOUR for i in range(-lookback, lateness + 1)]
        holds = [hour - i * HOUR for i in range(lookback + 1)]
        if all(r in settled for r in reads) and not any(h in held for h in holds):
            out.add(hour)
    return out
