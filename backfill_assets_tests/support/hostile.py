"""A hostile-producer generator for the ``orders`` topic, with an independent ground truth.

Real producers misbehave, and the project's tables must still be exact. This module writes
back-dated history (explicit CreateTime timestamps in the past) to a new topic the way real
systems produce it, and computes the ground truth from what it produced (delivery reports give
the offsets). It never reads the topic back, except for the compacted variant, whose surviving
records only the broker knows (``truth_from_log``).

What is produced (every payload is a valid ``orders`` schema_version 2 JSON object, encoded like
``generator.py`` does; keyed by ``order_id``; the partition is ``generator.partition_for`` over
the partitions that exist when the record is produced, and is passed explicitly):

* Several producers (default 3), each with its own clock skew (default -40 s, 0 s, +35 s):
  a record's Kafka timestamp is its true time plus its producer's skew, so CreateTime is not
  monotonic within a partition, and records near an hour boundary land on the "wrong" side of
  it by timestamp. A share of the true times (``boundary_share``) is placed in the first or the
  last 45 s of an hour, so that happens often.
* Transactions of 1..``max_transaction_records`` records per producer, never spanning an hour
  of true time; a share (``abort_share``) is aborted. Aborted records occupy offsets but must
  never appear anywhere. Every commit/abort marker occupies one more offset; the broker stamps
  markers with its wall clock, not with the back-dated time, and writes them asynchronously
  after ``commit_transaction`` returns.
* Identical re-sends (``resend_share``): the same key and value bytes again, 1 s..20 min later,
  by any producer (so possibly into another partition once partitions were added).
* Corrections (``correction_share``): the same ``event_id`` 1 s..30 min later with different
  content (another ``amount_minor``, sometimes another ``status``), within the column contract.
* Tombstones (``tombstone_share``): NULL values for the key of a cancelled order.
* Partitions added mid-history (``add_partitions``) between two ``produce`` phases.
* An open transaction on demand (``open_transaction``) that holds the last stable offset back.
* A compacted variant (``HostileConfig.compacted``) whose truth comes from ``truth_from_log``.

The plan (payloads, true times, producers, transactions and their fates) is a pure function of
the configuration (``plan_hostile``); only offsets, and partitions after ``add_partitions``,
come from Kafka. Produce order is plan order: every record is acknowledged before the next one
is sent, so each record is its own batch and the per-partition offset order is the plan order.

Everything is UTC: aware datetimes and epoch milliseconds; nothing depends on the local zone.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import json
import math
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import xxhash
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

# NewPartitions and NewTopic are public but only implicitly re-exported.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewPartitions,
    NewTopic,
)

from backfill_assets.demo.generator import (
    CHANNELS,
    CURRENCIES,
    HOUR_MS,
    TOPIC_CONFIGS,
    GeneratorConfig,
    _check_timestamp_type,
    _encode,
    _kafka_error,
    _Order,
    _payload,
    _prepare_topic,
    _to_ms,
    _wait_for_topic,
    partition_for,
)
from backfill_assets.errors import GeneratorError
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.versions import newest

Kind = Literal["event", "resend", "correction", "tombstone"]
KINDS: tuple[Kind, ...] = ("event", "resend", "correction", "tombstone")

# Broker-side compaction settings of the compacted variant. Kafka 4.x refuses segment.bytes
# below 1 MiB, and segment.ms alone does not roll a segment here: the roll check compares the
# new record's timestamp with the segment's first one, and a transaction marker (stamped with the
# broker's wall clock) at the start of a segment makes every back-dated record look older, so
# such a segment would never roll and never be cleaned. A tiny offset index (an entry per batch)
# rolls a segment every few batches instead, which lets the cleaner reach the history.
COMPACTED_TOPIC_CONFIGS: dict[str, str] = {
    "cleanup.policy": "compact",
    "segment.ms": "100",
    "segment.bytes": "1048576",
    "segment.index.bytes": "64",
    "index.interval.bytes": "1",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
}
PRODUCER_HEADER = "producer"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MIN_START = datetime(2000, 1, 1, tzinfo=UTC)
_BOUNDARY_MS = 45_000
_JITTER_MS = 60_000
_LATE_MS = (10 * 60_000, 2 * HOUR_MS)
_RESEND_DELAY_MS = (1_000, 20 * 60_000)
_CORRECTION_DELAY_MS = (1_000, 30 * 60_000)
_MIN_AMOUNT_MINOR = 500
_MAX_AMOUNT_MINOR = 50_000
_CUSTOMERS = 500
_NEW_ORDER_PROBABILITY = 0.45
_CANCEL_PROBABILITY = 0.35
_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------
# Configuration and plan (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HostileConfig:
    """What to produce. ``start`` is a whole UTC hour; true times lie in ``[start, end)``.

    ``events_per_hour`` true-time slots per hour each become an event or a tombstone; re-sends
    and corrections come on top. ``producer_skews_ms`` has one entry per producer.
    """

    start: datetime
    topic: str = "orders-hostile"
    partitions: int = 3
    hours: int = 8
    events_per_hour: int = 30
    seed: int = 7
    producer_skews_ms: tuple[int, ...] = (-40_000, 0, 35_000)
    max_transaction_records: int = 4
    abort_share: float = 0.15
    resend_share: float = 0.1
    correction_share: float = 0.1
    tombstone_share: float = 0.04
    boundary_share: float = 0.4
    late_share: float = 0.05
    compacted: bool = False
    transaction_timeout_ms: int = 60_000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``GeneratorError`` naming the first field whose value cannot be honoured."""
        start = self.start
        if not isinstance(start, datetime) or start.utcoffset() != timedelta(0):
            raise GeneratorError(
                f"HostileConfig.start={start!r} must be a UTC datetime, "
                "e.g. datetime(2026, 1, 1, tzinfo=UTC)"
            )
        if (start.minute, start.second, start.microsecond) != (0, 0, 0) or start < _MIN_START:
            raise GeneratorError(
                f"HostileConfig.start={start.isoformat()} must be a whole hour on or after "
                f"{_MIN_START.isoformat()}"
            )
        # The topic name rules are generator.py's; reuse its validation.
        try:
            GeneratorConfig(start=start, topic=self.topic)
        except GeneratorError as exc:
            raise GeneratorError(str(exc).replace("GeneratorConfig.", "HostileConfig.")) from None
        for name in ("partitions", "hours", "events_per_hour", "max_transaction_records"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GeneratorError(f"HostileConfig.{name}={value!r} must be a whole number >= 1")
        if not self.producer_skews_ms or any(
            isinstance(s, bool) or not isinstance(s, int) or abs(s) >= HOUR_MS // 2
            for s in self.producer_skews_ms
        ):
            raise GeneratorError(
                f"HostileConfig.producer_skews_ms={self.producer_skews_ms!r} needs at least one "
                "producer, each skew a whole number of milliseconds below 30 minutes"
            )
        for name in (
            "abort_share",
            "resend_share",
            "correction_share",
            "tombstone_share",
            "boundary_share",
            "late_share",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not 0.0 <= value <= 1.0
            ):
                raise GeneratorError(f"HostileConfig.{name}={value!r} must be in [0, 1]")
        if not 1_000 <= self.transaction_timeout_ms <= 900_000:
            raise GeneratorError(
                f"HostileConfig.transaction_timeout_ms={self.transaction_timeout_ms!r} must be "
                "in [1000, 900000] (the broker's transaction.max.timeout.ms)"
            )

    @property
    def start_ms(self) -> int:
        return _to_ms(self.start)

    @property
    def end(self) -> datetime:
        """Exclusive end of the true-time range."""
        return self.start + timedelta(hours=self.hours)

    def hour_starts(self) -> list[datetime]:
        """Every true-time hour of the range."""
        return [self.start + timedelta(hours=h) for h in range(self.hours)]


@dataclass(frozen=True)
class PlannedHostile:
    """One record to produce; its partition is chosen when it is produced."""

    index: int
    true_ms: int
    producer: int
    transaction: int
    commit: bool
    ends_transaction: bool
    kind: Kind
    order_id: str
    value: bytes | None
    event_id: str | None

    @property
    def key(self) -> bytes:
        return self.order_id.encode("utf-8")

    def timestamp_ms(self, config: HostileConfig) -> int:
        """Kafka timestamp: true time plus the producer's clock skew."""
        return self.true_ms + config.producer_skews_ms[self.producer]

    def hour_index(self, config: HostileConfig) -> int:
        """Index of the true-time hour this record is produced in."""
        return (self.true_ms - config.start_ms) // HOUR_MS


@dataclass(frozen=True)
class _Item:
    true_ms: int
    producer: int
    kind: Kind
    order_id: str
    value: bytes | None
    event_id: str | None


def plan_hostile(config: HostileConfig) -> list[PlannedHostile]:
    """Plan every record in produce order. Pure and deterministic for a configuration."""
    config.validate()
    rng = random.Random(config.seed)
    producers = len(config.producer_skews_ms)
    start_ms = config.start_ms
    end_ms = start_ms + config.hours * HOUR_MS
    slots: list[int] = []
    for h in range(config.hours):
        hour_ms = start_ms + h * HOUR_MS
        in_hour: list[int] = []
        for _ in range(config.events_per_hour):
            if rng.random() < config.boundary_share:
                near = rng.randrange(_BOUNDARY_MS)
                in_hour.append(hour_ms + (near if rng.random() < 0.5 else HOUR_MS - 1 - near))
            else:
                in_hour.append(hour_ms + rng.randrange(HOUR_MS))
        slots.extend(sorted(in_hour))

    orders: list[_Order] = []
    active: list[_Order] = []
    cancelled: list[_Order] = []
    pending: list[tuple[int, int, _Item]] = []
    items: list[_Item] = []
    sequence = 0

    def later(item: _Item) -> None:
        nonlocal sequence
        if item.true_ms < end_ms:
            heapq.heappush(pending, (item.true_ms, sequence, item))
            sequence += 1

    for ts in slots:
        while pending and pending[0][0] <= ts:
            items.append(heapq.heappop(pending)[2])
        producer = rng.randrange(producers)
        if cancelled and rng.random() < config.tombstone_share:
            order = cancelled.pop(rng.randrange(len(cancelled)))
            items.append(_Item(ts, producer, "tombstone", order.order_id, None, None))
            continue
        if not active or rng.random() < _NEW_ORDER_PROBABILITY:
            order = _Order(
                order_id=f"h-{len(orders) + 1:06d}",
                customer_id=f"c-{rng.randint(1, _CUSTOMERS):05d}",
                currency=rng.choice(CURRENCIES),
                amount_minor=rng.randint(_MIN_AMOUNT_MINOR, _MAX_AMOUNT_MINOR),
                status="open",
                steps=["updated"] * rng.randint(0, 2),
            )
            if rng.random() < _CANCEL_PROBABILITY:
                order.steps.append("cancelled")
            order.steps.reverse()
            orders.append(order)
            if order.steps:
                active.append(order)
            event_type = "created"
        else:
            index = rng.randrange(len(active))
            order = active[index]
            event_type = order.steps.pop()
            if event_type == "updated":
                if rng.random() < 0.5:
                    order.amount_minor = rng.randint(_MIN_AMOUNT_MINOR, _MAX_AMOUNT_MINOR)
                if order.status != "paid":
                    order.status = rng.choice(("open", "paid"))
            else:
                order.status = "cancelled"
                cancelled.append(order)
            if not order.steps:
                active.pop(index)
        if rng.random() < config.late_share:
            event_time_ms = ts - rng.randint(*_LATE_MS)
        else:
            event_time_ms = ts - rng.randint(0, _JITTER_MS)
        event_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        payload = _payload(
            order,
            event_id=event_id,
            event_type=event_type,
            event_time_ms=event_time_ms,
            version=2,
            channel=rng.choice(CHANNELS),
        )
        value = _encode(payload)
        items.append(_Item(ts, producer, "event", order.order_id, value, event_id))
        if rng.random() < config.resend_share:
            delay = rng.randint(*_RESEND_DELAY_MS)
            later(
                _Item(
                    ts + delay, rng.randrange(producers), "resend", order.order_id, value, event_id
                )
            )
        if rng.random() < config.correction_share:
            delay = rng.randint(*_CORRECTION_DELAY_MS)
            corrected = dict(payload)
            amount = rng.randint(_MIN_AMOUNT_MINOR, _MAX_AMOUNT_MINOR - 1)
            corrected["amount_minor"] = amount + (amount >= payload["amount_minor"])
            if event_type != "cancelled" and rng.random() < 0.5:
                corrected["status"] = "paid" if payload["status"] == "open" else "open"
            later(
                _Item(
                    ts + delay,
                    rng.randrange(producers),
                    "correction",
                    order.order_id,
                    _encode(corrected),
                    event_id,
                )
            )
    while pending:
        items.append(heapq.heappop(pending)[2])

    # Transactions: consecutive records of one producer within one true-time hour.
    planned: list[PlannedHostile] = []
    open_txn: dict[int, tuple[int, int, bool, int]] = {}  # producer -> (txn, left, commit, hour)
    last_index: dict[int, int] = {}  # transaction -> index of its latest record
    transactions = 0

    def close(producer: int) -> None:
        txn = open_txn.pop(producer)[0]
        at = last_index[txn]
        planned[at] = replace(planned[at], ends_transaction=True)

    for item in items:
        hour = (item.true_ms - start_ms) // HOUR_MS
        for producer in [p for p, state in open_txn.items() if state[3] != hour]:
            close(producer)
        if item.producer not in open_txn:
            size = rng.randint(1, config.max_transaction_records)
            commit = rng.random() >= config.abort_share
            open_txn[item.producer] = (transactions, size, commit, hour)
            transactions += 1
        txn, left, commit, _ = open_txn[item.producer]
        last_index[txn] = len(planned)
        planned.append(
            PlannedHostile(
                index=len(planned),
                true_ms=item.true_ms,
                producer=item.producer,
                transaction=txn,
                commit=commit,
                ends_transaction=False,
                kind=item.kind,
                order_id=item.order_id,
                value=item.value,
                event_id=item.event_id,
            )
        )
        open_txn[item.producer] = (txn, left - 1, commit, hour)
        if left == 1:
            close(item.producer)
    for producer in list(open_txn):
        close(producer)
    return planned


# --------------------------------------------------------------------------------------------
# Ground truth (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostileRecord:
    """One produced record as Kafka stored it. ``committed`` is False for aborted records."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    event_id: str | None
    producer: int
    kind: Kind
    committed: bool = True

    @property
    def position(self) -> tuple[int, int]:
        """``(partition, offset)``."""
        return (self.partition, self.offset)

    @property
    def size(self) -> int:
        """len(key) + len(value); NULL counts as 0."""
        return len(self.key or b"") + len(self.value or b"")

    def payload(self) -> dict[str, Any]:
        """The JSON payload (``{}`` for a tombstone)."""
        if self.value is None:
            return {}
        data = json.loads(self.value)
        if not isinstance(data, dict):
            raise GeneratorError(f"record {self.position} does not hold a JSON object")
        return data


@dataclass(frozen=True)
class HostileTruth:
    """Every record a hostile run produced (or, for a compacted topic, that survived)."""

    topic: str
    partitions: int
    records: tuple[HostileRecord, ...] = field(default_factory=tuple)

    def committed(self) -> list[HostileRecord]:
        """Committed records in (partition, offset) order."""
        return sorted((r for r in self.records if r.committed), key=lambda r: r.position)

    def aborted(self) -> list[HostileRecord]:
        """Records of aborted transactions in (partition, offset) order."""
        return sorted((r for r in self.records if not r.committed), key=lambda r: r.position)

    def by_position(self) -> dict[tuple[int, int], HostileRecord]:
        """Every record (committed or not) by ``(partition, offset)``."""
        return {r.position: r for r in self.records}


def merge(*truths: HostileTruth) -> HostileTruth:
    """The records of several phases of one topic as one truth."""
    if not truths:
        raise GeneratorError("merge() needs at least one truth")
    topics = {t.topic for t in truths}
    if len(topics) != 1:
        raise GeneratorError(f"cannot merge truths of different topics: {sorted(topics)}")
    records = sorted((r for t in truths for r in t.records), key=lambda r: r.position)
    for before, after in itertools.pairwise(records):
        if before.position == after.position:
            raise GeneratorError(f"two records claim {before.position}")
    return HostileTruth(
        topic=truths[0].topic,
        partitions=max(t.partitions for t in truths),
        records=tuple(records),
    )


def ms_to_datetime(ms: int) -> datetime:
    """Epoch milliseconds as an aware UTC datetime."""
    return _EPOCH + timedelta(milliseconds=ms)


def hour_floor(ms: int) -> datetime:
    """The UTC hour containing epoch millisecond ``ms``."""
    return ms_to_datetime(ms - ms % HOUR_MS)


def record_hash(partition: int, offset: int, key: bytes | None, value: bytes | None) -> int:
    """One record's share of the order-independent Kafka-side checksum.

    XXH64 chained from seed 42 over the partition (4 bytes, little-endian), the offset (8
    bytes), the key and the value bytes (each skipped when NULL), then ``key is None`` and
    ``value is None`` (4 bytes each, 1 or 0): every step's seed is the previous step's hash.
    The share is that unsigned 64-bit hash read as a signed one; an hour's checksum is the
    (Python int) sum of the shares of its committed records.
    """
    h = 42
    parts = [
        int(partition).to_bytes(4, "little", signed=True),
        int(offset).to_bytes(8, "little", signed=True),
        key,
        value,
        int(key is None).to_bytes(4, "little"),
        int(value is None).to_bytes(4, "little"),
    ]
    for part in parts:
        if part is not None:
            h = xxhash.xxh64(part, seed=h).intdigest()
    return h - 2**64 if h >= 2**63 else h


WindowMap = dict[datetime, dict[int, tuple[int, int]]]


def _hours(hours: Sequence[datetime]) -> list[datetime]:
    out: list[datetime] = []
    for h in hours:
        if not isinstance(h, datetime) or h.utcoffset() is None:
            raise GeneratorError(f"hour {h!r} must be a timezone-aware datetime")
        u = h.astimezone(UTC)
        if (u.minute, u.second, u.microsecond) != (0, 0, 0):
            raise GeneratorError(f"hour {u.isoformat()} is not a whole hour")
        if out and u != out[-1] + timedelta(hours=1):
            raise GeneratorError(f"hours must be consecutive; {u.isoformat()} follows {out[-1]}")
        out.append(u)
    if not out:
        raise GeneratorError("windows() needs at least one hour")
    return out


def windows(
    truth: HostileTruth,
    hours: Sequence[datetime],
    joined_at: Mapping[int, datetime] | None = None,
    start_offsets: Mapping[int, int] | None = None,
) -> WindowMap:
    """Offsets own windows: per hour and partition, the ``[start, end)`` offset range.

    For each partition p, walk its committed records in offset order. The boundary for time T
    after a previous boundary b is the offset of the first committed record at offset >= b with
    timestamp >= T; if there is none, the partition's end (one past its last committed record's
    offset, or b if that is larger). The first hour's start boundary is the first committed
    record with timestamp >= hours[0] (searching from offset 0); each later hour starts exactly
    where the previous ended (chained); hour H = [b(H.start), b(H.end)). A committed record
    belongs to hour H if its offset is in H's range, WHATEVER its own timestamp (a record
    stamped 10:59:40 after a record stamped 11:00:05 belongs to hour 11). For a partition listed
    in ``joined_at`` (created after earlier hours were sealed), its chain starts at offset 0 in
    hour joined_at[p], and it is absent from the hours before. ``start_offsets`` continues a
    chain: partition p's first hour starts at start_offsets[p] instead of being searched (a
    ``joined_at`` hour at or after hours[0] takes precedence). Aborted records and markers
    belong to no hour. ``hours`` are consecutive whole hours; partitions are 0..truth.partitions-1.
    """
    hs = _hours(hours)
    ends = [*hs[1:], hs[-1] + timedelta(hours=1)]
    ends_ms = [_to_ms(e) for e in ends]
    joined = {p: h.astimezone(UTC) for p, h in (joined_at or {}).items()}
    starts = dict(start_offsets or {})
    by_partition = _committed_by_partition(truth)
    out: WindowMap = {h: {} for h in hs}
    for p in range(truth.partitions):
        offsets, stamps = by_partition.get(p, ([], []))
        first = 0
        if p in joined and joined[p] >= hs[0]:
            if joined[p] > hs[-1]:
                continue
            if joined[p] not in hs:
                raise GeneratorError(f"joined_at[{p}]={joined[p].isoformat()} is not a whole hour")
            first = hs.index(joined[p])
            b = 0
        elif p in starts:
            b = starts[p]
        else:
            b = _boundary(offsets, stamps, 0, _to_ms(hs[0]))
        for i in range(first, len(hs)):
            e = _boundary(offsets, stamps, b, ends_ms[i])
            out[hs[i]][p] = (b, e)
            b = e
    return out


def _boundary(offsets: list[int], stamps: list[int], after: int, t_ms: int) -> int:
    """Offset of the first committed record at offset >= ``after`` with timestamp >= ``t_ms``;
    else the partition's end (one past its last committed record), but never before ``after``."""
    for j in range(bisect.bisect_left(offsets, after), len(offsets)):
        if stamps[j] >= t_ms:
            return offsets[j]
    return max(after, offsets[-1] + 1 if offsets else 0)


def _committed_by_partition(truth: HostileTruth) -> dict[int, tuple[list[int], list[int]]]:
    out: dict[int, tuple[list[int], list[int]]] = {}
    for r in truth.committed():
        offsets, stamps = out.setdefault(r.partition, ([], []))
        offsets.append(r.offset)
        stamps.append(r.timestamp_ms)
    return out


def normalise_windows(
    truth: HostileTruth, window_map: Mapping[datetime, Mapping[int, tuple[int, int]]]
) -> dict[datetime, frozenset[tuple[int, int]]]:
    """A window map as the set of committed ``(partition, offset)`` per hour.

    Boundary offsets that differ only by marker or aborted offsets give the same sets, so this
    is what two window maps (e.g. the truth's and one built from Kafka's ListOffsets answers)
    are compared by.
    """
    by_partition = _committed_by_partition(truth)
    out: dict[datetime, frozenset[tuple[int, int]]] = {}
    for hour, parts in window_map.items():
        members: set[tuple[int, int]] = set()
        for p, (lo, hi) in parts.items():
            offsets = by_partition.get(p, ([], []))[0]
            i, j = bisect.bisect_left(offsets, lo), bisect.bisect_left(offsets, hi)
            members.update((p, o) for o in offsets[i:j])
        out[hour.astimezone(UTC)] = frozenset(members)
    return out


def hour_of(
    truth: HostileTruth,
    hours: Sequence[datetime],
    joined_at: Mapping[int, datetime] | None = None,
    start_offsets: Mapping[int, int] | None = None,
) -> dict[tuple[int, int], datetime]:
    """The hour each committed ``(partition, offset)`` belongs to under ``windows()``.

    Records before the first boundary or at/after the last one are absent.
    """
    out: dict[tuple[int, int], datetime] = {}
    sets = normalise_windows(truth, windows(truth, hours, joined_at, start_offsets))
    for hour, members in sets.items():
        for position in members:
            if position in out:
                raise GeneratorError(f"{position} is in {out[position]} and {hour}")
            out[position] = hour
    return out


@dataclass(frozen=True)
class HourFigures:
    """Kafka-side figures of one hour's committed records."""

    records: int
    bytes: int
    checksum: int


def hour_figures(
    truth: HostileTruth,
    hours: Sequence[datetime],
    joined_at: Mapping[int, datetime] | None = None,
    start_offsets: Mapping[int, int] | None = None,
) -> dict[datetime, HourFigures]:
    """Per hour of ``windows()``: committed records, bytes (len(key)+len(value), NULL as 0),
    and an order-independent Kafka-side checksum: the (Python int) sum of every committed
    record's :func:`record_hash`."""
    by_position = truth.by_position()
    out: dict[datetime, HourFigures] = {}
    sets = normalise_windows(truth, windows(truth, hours, joined_at, start_offsets))
    for hour, members in sets.items():
        recs = [by_position[m] for m in members]
        out[hour] = HourFigures(
            records=len(recs),
            bytes=sum(r.size for r in recs),
            checksum=sum(record_hash(r.partition, r.offset, r.key, r.value) for r in recs),
        )
    return out


def _position(record: HostileRecord) -> tuple[int, int, int]:
    return (record.timestamp_ms, record.partition, record.offset)


def _versions(truth: HostileTruth) -> dict[str, list[HostileRecord]]:
    out: dict[str, list[HostileRecord]] = defaultdict(list)
    for r in truth.committed():
        if r.value is not None and r.event_id is not None:
            out[r.event_id].append(r)
    return out


def events(truth: HostileTruth) -> dict[str, HostileRecord]:
    """Duplicates and corrections rule: the winner of every event_id.

    Among the committed non-tombstone records with one event_id, the winner is the one the
    version rule picks (:func:`backfill_assets_tests.support.versions.newest`: the later
    offset within a partition, whatever the producers' clocks said; across partitions the
    later Kafka timestamp, then partition). Identical re-sends (same value bytes) collapse into it;
    an event_id whose committed versions have more than one distinct value is a conflict (see
    ``conflicts``). Aborted records never count.
    """
    return {eid: newest(versions, _position) for eid, versions in sorted(_versions(truth).items())}


def conflicts(truth: HostileTruth) -> dict[str, int]:
    """Per conflicting event_id, the number of distinct contents (value bytes) among its
    committed versions; event_ids with a single content (identical re-sends) are absent."""
    out: dict[str, int] = {}
    for eid, versions in sorted(_versions(truth).items()):
        distinct = len({r.value for r in versions})
        if distinct > 1:
            out[eid] = distinct
    return out


@dataclass(frozen=True)
class HourlyFigures:
    """Event-time figures of one (hour, currency)."""

    events: int
    orders: int
    amount_minor: int
    cancelled: int


def expected_hourly(truth: HostileTruth) -> dict[tuple[datetime, str], HourlyFigures]:
    """Per (UTC hour of the winner's event_time, currency), over event winners only: events,
    orders (distinct order_id), amount_minor sum, cancelled (event_type == 'cancelled')."""
    groups: dict[tuple[datetime, str], list[dict[str, Any]]] = defaultdict(list)
    for record in events(truth).values():
        payload = record.payload()
        groups[(hour_floor(int(payload["event_time"])), str(payload["currency"]))].append(payload)
    return {
        group: HourlyFigures(
            events=len(rows),
            orders=len({row["order_id"] for row in rows}),
            amount_minor=sum(int(row["amount_minor"]) for row in rows),
            cancelled=sum(row["event_type"] == "cancelled" for row in rows),
        )
        for group, rows in sorted(groups.items())
    }


CURRENT_COLUMNS: tuple[str, ...] = (
    "event_id",
    "order_id",
    "customer_id",
    "event_type",
    "status",
    "amount_minor",
    "currency",
    "channel",
    "event_time",
)


@dataclass(frozen=True)
class CurrentRow:
    """The current state of one order: deleted, or the winning event's payload columns
    (``event_time`` as an aware UTC datetime); ``record`` is the record that decided it."""

    order_id: str
    deleted: bool
    record: HostileRecord
    columns: dict[str, Any]


def expected_current(truth: HostileTruth) -> dict[str, CurrentRow]:
    """Per key (order_id): among the event winners of that key and its committed tombstones,
    the latest by event_time for events / Kafka timestamp for tombstones, then the version
    rule. The row is deleted=True for a tombstone, else the winner's columns."""
    candidates: dict[str, list[tuple[int, HostileRecord]]] = defaultdict(list)
    for record in events(truth).values():
        payload = record.payload()
        candidates[str(payload["order_id"])].append((int(payload["event_time"]), record))
    for record in truth.committed():
        if record.value is None and record.key is not None:
            candidates[record.key.decode("utf-8")].append((record.timestamp_ms, record))
    out: dict[str, CurrentRow] = {}
    for order, ranked in sorted(candidates.items()):
        record = newest(ranked, lambda pair: _position(pair[1]), first=lambda pair: pair[0])[1]
        if record.value is None:
            out[order] = CurrentRow(order_id=order, deleted=True, record=record, columns={})
            continue
        payload = record.payload()
        columns = {c: payload[c] for c in CURRENT_COLUMNS}
        columns["event_time"] = ms_to_datetime(int(payload["event_time"]))
        out[order] = CurrentRow(order_id=order, deleted=False, record=record, columns=columns)
    return out


# --------------------------------------------------------------------------------------------
# Kafka
# --------------------------------------------------------------------------------------------


def create_topic(settings: Settings, config: HostileConfig) -> None:
    """Create ``config.topic`` (CreateTime, no retention; compacted if ``config.compacted``).

    A plain topic may already exist if it is empty (generator.py's rules); a compacted one must
    be new.
    """
    admin = AdminClient(dict(settings.kafka.client_config()))
    if not config.compacted:
        gen = GeneratorConfig(start=config.start, topic=config.topic, partitions=config.partitions)
        _prepare_topic(settings, admin, gen)
        return
    topic = config.topic
    new = NewTopic(
        topic,
        num_partitions=config.partitions,
        # -1: the cluster's default.replication.factor (1 on the local broker, 3 on
        # the production-shaped cluster, whose min.insync.replicas=2 refuses a lone replica).
        replication_factor=-1,
        config={**TOPIC_CONFIGS, **COMPACTED_TOPIC_CONFIGS},
    )
    futures = admin.create_topics([new], operation_timeout=_TIMEOUT_S, request_timeout=_TIMEOUT_S)
    try:
        futures[topic].result()
    except KafkaException as exc:
        err = _kafka_error(exc)
        raise GeneratorError(
            f"could not create compacted topic {topic!r}: {err.str() if err else exc}"
        ) from exc
    _wait_for_topic(admin, topic)


def _topic_exists(admin: AdminClient, topic: str) -> bool:
    try:
        metadata = admin.list_topics(topic=topic, timeout=_TIMEOUT_S)
    except KafkaException as exc:
        raise GeneratorError(f"could not read the metadata of topic {topic!r}: {exc}") from exc
    described = metadata.topics.get(topic)
    if described is None:
        return False
    error = described.error
    return error is None or error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART


def add_partitions(settings: Settings, topic: str, total: int) -> int:
    """Grow ``topic`` to ``total`` partitions and wait until all have a leader; return total."""
    admin = AdminClient(dict(settings.kafka.client_config()))
    futures = admin.create_partitions(
        [NewPartitions(topic, total)], operation_timeout=_TIMEOUT_S, request_timeout=_TIMEOUT_S
    )
    try:
        futures[topic].result()
    except KafkaException as exc:
        raise GeneratorError(
            f"could not grow topic {topic!r} to {total} partitions: {exc}"
        ) from exc
    deadline = time.monotonic() + _TIMEOUT_S
    while (count := _wait_for_topic(admin, topic)) < total:
        if time.monotonic() >= deadline:
            raise GeneratorError(f"topic {topic!r} still shows {count} of {total} partitions")
        time.sleep(0.2)
    return count


def _producer(settings: Settings, transactional_id: str, timeout_ms: int) -> Producer:
    conf: dict[str, Any] = {
        **settings.kafka.client_config(),
        "transactional.id": transactional_id,
        "transaction.timeout.ms": timeout_ms,
        "linger.ms": 0,
        # A new transaction waits for the previous one's markers (CONCURRENT_TRANSACTIONS);
        # retry that quickly instead of librdkafka's default 100 ms.
        "retry.backoff.ms": 10,
    }
    producer = Producer(conf)
    try:
        producer.init_transactions(_TIMEOUT_S)
    except KafkaException as exc:
        raise GeneratorError(f"init_transactions for {transactional_id!r} failed: {exc}") from exc
    return producer


def _send(
    producer: Producer,
    topic: str,
    partition: int,
    key: bytes,
    value: bytes | None,
    timestamp_ms: int,
    headers: list[tuple[str, str | bytes | None]],
) -> tuple[int, int]:
    """Produce one record and wait for its delivery report; return (offset, timestamp)."""
    report: list[tuple[KafkaError | None, int, int]] = []

    def on_delivery(err: KafkaError | None, msg: Message[Any, Any]) -> None:
        offset = msg.offset()
        report.append((err, -1 if offset is None else offset, msg.timestamp()[1]))

    while True:
        try:
            producer.produce(
                topic,
                value=value,
                key=key,
                partition=partition,
                timestamp=timestamp_ms,
                headers=headers,
                on_delivery=on_delivery,
            )
            break
        except BufferError:
            producer.poll(0.05)
    remaining = producer.flush(_TIMEOUT_S)
    if remaining or not report:
        raise GeneratorError(f"a record to {topic!r} partition {partition} was not acknowledged")
    err, offset, stamp = report[0]
    if err is not None:
        raise GeneratorError(f"a record to {topic!r} partition {partition} failed: {err.str()}")
    if offset < 0 or stamp != timestamp_ms:
        raise GeneratorError(
            f"a record to {topic!r} partition {partition} came back with offset {offset} and "
            f"timestamp {stamp} (sent {timestamp_ms}); is the topic LogAppendTime?"
        )
    return offset, stamp


def produce(
    settings: Settings,
    config: HostileConfig,
    first_hour_index: int = 0,
    last_hour_index: int | None = None,
) -> HostileTruth:
    """Produce the planned records whose true time is in hours ``first..last`` (inclusive).

    Creates the topic if it does not exist. Each record's partition is ``partition_for`` over
    the partitions the topic has when this call starts. Returns the truth of this call's
    records only; combine phases with ``merge``.
    """
    last = config.hours - 1 if last_hour_index is None else last_hour_index
    if not 0 <= first_hour_index <= last < config.hours:
        raise GeneratorError(
            f"hour indexes {first_hour_index}..{last} are outside 0..{config.hours - 1}"
        )
    chosen = [r for r in plan_hostile(config) if first_hour_index <= r.hour_index(config) <= last]
    admin = AdminClient(dict(settings.kafka.client_config()))
    if not _topic_exists(admin, config.topic):
        create_topic(settings, config)
    else:
        _check_timestamp_type(admin, config.topic)
    partitions = _wait_for_topic(admin, config.topic)
    producers = [
        _producer(settings, f"{config.topic}.hostile.{i}", config.transaction_timeout_ms)
        for i in range(len(config.producer_skews_ms))
    ]
    records: list[HostileRecord] = []
    in_txn: set[int] = set()
    try:
        for plan in chosen:
            producer = producers[plan.producer]
            if plan.producer not in in_txn:
                producer.begin_transaction()
                in_txn.add(plan.producer)
            partition = partition_for(plan.order_id, partitions)
            offset, stamp = _send(
                producer,
                config.topic,
                partition,
                plan.key,
                plan.value,
                plan.timestamp_ms(config),
                [(PRODUCER_HEADER, str(plan.producer).encode())],
            )
            records.append(
                HostileRecord(
                    partition=partition,
                    offset=offset,
                    timestamp_ms=stamp,
                    key=plan.key,
                    value=plan.value,
                    event_id=plan.event_id,
                    producer=plan.producer,
                    kind=plan.kind,
                    committed=plan.commit,
                )
            )
            if plan.ends_transaction:
                if plan.commit:
                    producer.commit_transaction(_TIMEOUT_S)
                else:
                    producer.abort_transaction(_TIMEOUT_S)
                in_txn.discard(plan.producer)
    except KafkaException as exc:
        raise GeneratorError(f"producing to {config.topic!r} failed: {exc}") from exc
    finally:
        for index in sorted(in_txn):
            with contextlib.suppress(KafkaException):
                producers[index].abort_transaction(_TIMEOUT_S)
        for producer in producers:
            producer.close()
    return HostileTruth(topic=config.topic, partitions=partitions, records=tuple(records))


def generate(settings: Settings, config: HostileConfig) -> HostileTruth:
    """Create the topic and produce every hour; return the truth."""
    create_topic(settings, config)
    return produce(settings, config)


class OpenTransaction:
    """A transaction with one record in it, left open: the partition's last stable offset stays
    at that record until ``commit()`` or ``abort()`` (or until the broker aborts it after
    ``transaction.timeout.ms``)."""

    def __init__(self, producer: Producer, record: HostileRecord) -> None:
        self._producer: Producer | None = producer
        self.record = record

    def _finish(self, commit: bool) -> HostileRecord:
        producer = self._producer
        if producer is None:
            raise GeneratorError("this transaction was already finished")
        self._producer = None
        try:
            if commit:
                producer.commit_transaction(_TIMEOUT_S)
            else:
                producer.abort_transaction(_TIMEOUT_S)
        except KafkaException as exc:
            raise GeneratorError(f"finishing the open transaction failed: {exc}") from exc
        finally:
            producer.close()
        self.record = replace(self.record, committed=commit)
        return self.record

    def commit(self) -> HostileRecord:
        """Commit; return the record (now committed). The marker is written asynchronously,
        so the last stable offset moves shortly after this returns, not necessarily before."""
        return self._finish(True)

    def abort(self) -> HostileRecord:
        """Abort; return the record (never visible to committed readers)."""
        return self._finish(False)


def open_transaction(
    settings: Settings,
    topic: str,
    partition: int,
    timestamp: datetime,
    *,
    transactional_id: str | None = None,
    transaction_timeout_ms: int = 60_000,
) -> OpenTransaction:
    """Begin a transaction, produce one valid ``orders`` v2 event stamped ``timestamp`` into
    ``partition`` of ``topic``, and leave the transaction open."""
    ts = _to_ms(timestamp)
    name = transactional_id or f"{topic}.hostile.open.{partition}.{ts}"
    event_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"hostile:{topic}:{partition}:{ts}:{name}"))
    order = _Order(
        order_id=f"h-open-{partition}-{ts}",
        customer_id="c-00001",
        currency=CURRENCIES[0],
        amount_minor=_MIN_AMOUNT_MINOR,
        status="open",
        steps=[],
    )
    value = _encode(
        _payload(
            order,
            event_id=event_id,
            event_type="created",
            event_time_ms=ts,
            version=2,
            channel=CHANNELS[0],
        )
    )
    key = order.order_id.encode("utf-8")
    producer = _producer(settings, name, transaction_timeout_ms)
    try:
        producer.begin_transaction()
        offset, stamp = _send(producer, topic, partition, key, value, ts, [])
    except BaseException:
        with contextlib.suppress(KafkaException):
            producer.abort_transaction(_TIMEOUT_S)
        producer.close()
        raise
    record = HostileRecord(
        partition=partition,
        offset=offset,
        timestamp_ms=stamp,
        key=key,
        value=value,
        event_id=event_id,
        producer=-1,
        kind="event",
        committed=False,
    )
    return OpenTransaction(producer, record)


def truth_from_log(settings: Settings, topic: str, timeout_s: float = 60.0) -> HostileTruth:
    """The truth of a compacted topic: its surviving committed records, read back.

    A read_committed consumer is assigned every partition from offset 0 (it never subscribes
    and never commits a group) and reads up to each partition's end (its last stable offset).
    Per record: event_id from the JSON payload, producer from the ``producer`` header (-1 if
    absent), and kind: ``tombstone`` for a NULL value, else ``event`` for the first surviving
    version of its event_id by (timestamp_ms, partition, offset), ``resend`` for a later one
    with the same bytes as an earlier one, ``correction`` otherwise.
    """
    admin = AdminClient(dict(settings.kafka.client_config()))
    partitions = _wait_for_topic(admin, topic)
    conf: dict[str, Any] = {
        **settings.kafka.client_config(),
        "group.id": f"backfill-hostile-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
    }
    consumer = Consumer(conf)
    raw: list[tuple[int, int, int, bytes | None, bytes | None, int]] = []
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < partitions:
            if time.monotonic() >= deadline:
                raise GeneratorError(
                    f"reading topic {topic!r} did not reach the end of partitions "
                    f"{sorted(set(range(partitions)) - done)} within {timeout_s:.0f}s"
                )
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    done.add(int(msg.partition() or 0))
                    continue
                raise GeneratorError(f"reading topic {topic!r} failed: {error.str()}")
            producer = -1
            headers = msg.headers() or []
            pairs = list(headers.items()) if isinstance(headers, dict) else headers
            for name, header in pairs:
                if name == PRODUCER_HEADER and header is not None:
                    text = header.decode() if isinstance(header, bytes) else header
                    producer = int(text)
            partition = msg.partition()
            offset = msg.offset()
            if partition is None or offset is None:
                raise GeneratorError(f"a record of {topic!r} came without partition or offset")
            raw.append((partition, offset, msg.timestamp()[1], msg.key(), msg.value(), producer))
    finally:
        consumer.close()
    return truth_from_records(topic, partitions, raw)


def truth_from_records(
    topic: str,
    partitions: int,
    rows: Iterable[tuple[int, int, int, bytes | None, bytes | None, int]],
) -> HostileTruth:
    """A truth of committed records given as (partition, offset, timestamp_ms, key, value,
    producer); event_id and kind are derived as ``truth_from_log`` documents."""
    ordered = sorted(rows, key=lambda row: (row[2], row[0], row[1]))
    seen: dict[str, set[bytes]] = defaultdict(set)
    records: list[HostileRecord] = []
    for partition, offset, stamp, key, value, producer in ordered:
        kind: Kind = "tombstone"
        event_id: str | None = None
        if value is not None:
            data = json.loads(value)
            if not isinstance(data, dict) or "event_id" not in data:
                raise GeneratorError(f"record {(partition, offset)} of {topic!r} has no event_id")
            event_id = str(data["event_id"])
            earlier = seen[event_id]
            kind = "event" if not earlier else ("resend" if value in earlier else "correction")
            earlier.add(value)
        records.append(
            HostileRecord(
                partition=partition,
                offset=offset,
                timestamp_ms=stamp,
                key=key,
                value=value,
                event_id=event_id,
                producer=producer,
                kind=kind,
                committed=True,
            )
        )
    records.sort(key=lambda r: r.position)
    return HostileTruth(topic=topic, partitions=partitions, records=tuple(records))
