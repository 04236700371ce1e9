"""Deterministic demo event generator for the ``orders`` topic, with a ground-truth manifest.

``plan_events`` turns a ``GeneratorConfig`` into an exact, byte-identical list of Kafka records
without touching Kafka; ``generate`` writes that plan into a real broker and returns a
``GroundTruth`` (per-partition offsets and timestamps, per-hour counts and amounts) that tests
and backfill checks compare against.

What the plan contains:

* Kafka timestamps (CreateTime) are simulated produce times in ``[start, end)``,
  ``events_per_hour`` slots per hour, non-decreasing per partition. Partition = crc32(order_id).
* Orders: created -> 0..2 updated -> maybe cancelled -> maybe deleted (a tombstone).
* ``event_time`` is 0..60 s before the Kafka timestamp, or 10 min..``max_lateness`` for late
  events; never after it.
* Schema v1 (``amount`` with two decimals, ISO ``event_time``) before the switch point, schema v2
  (``amount_minor``, epoch-millis ``event_time``, ``channel``) from it on.
* Duplicates: the same bytes again, right after the original, 1..50 ms later within its hour.
  They come on top of the ``events_per_hour`` slots.
* Malformed records (``invalid_json``, ``missing_event_time``, ``wrong_type`` = ``amount`` or
  ``amount_minor`` is ``"abc"``, ``unknown_schema_version`` = 9), keyed by a real order id.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

# ConfigResource, NewTopic and ResourceType are public but only implicitly re-exported.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from backfill_assets.errors import GeneratorError
from backfill_assets.stack.kafka import KafkaClient, client_log
from backfill_assets.stack.settings import Settings

RecordKind = Literal["valid", "duplicate", "malformed", "tombstone"]
Encoding = Literal["json", "avro"]
ENCODINGS: tuple[str, ...] = ("json", "avro")
SchemaVersion = Literal[1, 2]

HOUR_MS = 3_600_000
CURRENCIES: tuple[str, ...] = ("EUR", "USD", "GBP")
CHANNELS: tuple[str, ...] = ("web", "app", "store")
MALFORMED_REASONS: tuple[str, ...] = (
    "invalid_json",
    "missing_event_time",
    "wrong_type",
    "unknown_schema_version",
)
COUNT_KEYS: tuple[str, ...] = (
    "records",
    "valid",
    "duplicates",
    "malformed",
    "tombstones",
    "v1",
    "v2",
    "late",
)
TOPIC_CONFIGS: dict[str, str] = {
    "retention.ms": "-1",
    "retention.bytes": "-1",
    "message.timestamp.type": "CreateTime",
}

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MIN_START = datetime(2000, 1, 1, tzinfo=UTC)
_MAX_SHARE = 0.5
_MIN_LATENESS = timedelta(minutes=10)
_MAX_LATENESS = timedelta(days=7)
_NORMAL_JITTER_MS = 60_000
_MIN_AMOUNT_MINOR = 500
_MAX_AMOUNT_MINOR = 50_000
_CUSTOMERS = 2_000
_NEW_ORDER_PROBABILITY = 0.45
_CANCEL_PROBABILITY = 0.3
_DUPLICATE_DELAY_MS = (1, 50)
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_AMOUNT_PLACEHOLDER = "__amount_major__"
_ADMIN_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
    """What to generate. All fields are keyword-only; ``start`` is required.

    ``start`` is a whole UTC hour; the Kafka-time range is ``[start, start + hours)``.
    ``events_per_hour`` produce-time slots per hour are filled with valid, malformed or tombstone
    records; duplicates come on top. Shares are probabilities per slot (tombstones need an
    undeleted cancelled order, else the slot stays a valid event). Every trait is switched off
    by setting its share to 0.
    """

    start: datetime
    topic: str = "orders"
    partitions: int = 6
    hours: int = 24
    events_per_hour: int = 300
    seed: int = 7
    late_share: float = 0.05
    max_lateness: timedelta = timedelta(hours=3)
    duplicate_share: float = 0.02
    malformed_share: float = 0.01
    tombstone_share: float = 0.02
    schema_switch_fraction: float = 0.5
    # How generate() writes the planned records: "avro" serializes the same events in
    # Confluent's wire format through the schema registry (demo/avro.py).
    encoding: Encoding = "json"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``GeneratorError`` naming the first field whose value cannot be honoured."""
        if not isinstance(self.topic, str) or not _TOPIC_NAME.match(self.topic):
            raise GeneratorError(
                f"GeneratorConfig.topic={self.topic!r} is not a valid Kafka topic name; allowed: "
                "1-249 characters from [A-Za-z0-9._-]"
            )
        if self.topic in {".", ".."}:
            raise GeneratorError(f"GeneratorConfig.topic={self.topic!r} is reserved by Kafka")
        _positive_int("partitions", self.partitions)
        _positive_int("hours", self.hours)
        _positive_int("events_per_hour", self.events_per_hour)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise GeneratorError(f"GeneratorConfig.seed={self.seed!r} must be a whole number")
        start = self.start
        if not isinstance(start, datetime) or start.tzinfo is None or start.utcoffset() is None:
            raise GeneratorError(
                f"GeneratorConfig.start={start!r} must be a timezone-aware UTC datetime, "
                "e.g. datetime(2026, 1, 1, tzinfo=UTC)"
            )
        if start.utcoffset() != timedelta(0):
            raise GeneratorError(
                f"GeneratorConfig.start={start.isoformat()} must be in UTC (offset +00:00)"
            )
        if (start.minute, start.second, start.microsecond) != (0, 0, 0):
            raise GeneratorError(
                f"GeneratorConfig.start={start.isoformat()} must be aligned to a whole hour "
                "(minute, second and microsecond all 0)"
            )
        if start < _MIN_START:
            raise GeneratorError(
                f"GeneratorConfig.start={start.isoformat()} must be on or after "
                f"{_MIN_START.isoformat()}"
            )
        for name in ("late_share", "duplicate_share", "malformed_share", "tombstone_share"):
            _share(name, getattr(self, name), _MAX_SHARE)
        _share("schema_switch_fraction", self.schema_switch_fraction, 1.0)
        if self.encoding not in ENCODINGS:
            raise GeneratorError(
                f"GeneratorConfig.encoding={self.encoding!r} is not one of {', '.join(ENCODINGS)}"
            )
        if not isinstance(self.max_lateness, timedelta) or not (
            _MIN_LATENESS <= self.max_lateness <= _MAX_LATENESS
        ):
            raise GeneratorError(
                f"GeneratorConfig.max_lateness={self.max_lateness!r} is out of range; allowed: "
                f"{_MIN_LATENESS} <= max_lateness <= {_MAX_LATENESS} "
                "(set late_share=0 to switch late events off)"
            )

    @property
    def start_ms(self) -> int:
        """``start`` as epoch milliseconds."""
        return _to_ms(self.start)

    @property
    def end(self) -> datetime:
        """Exclusive end of the Kafka-time range."""
        return self.start + timedelta(hours=self.hours)

    @property
    def end_ms(self) -> int:
        """``end`` as epoch milliseconds (exclusive)."""
        return self.start_ms + self.hours * HOUR_MS

    @property
    def schema_switch_ms(self) -> int:
        """Kafka timestamp from which events are written as schema v2."""
        return self.start_ms + round(self.schema_switch_fraction * self.hours * HOUR_MS)

    def hour_starts_ms(self) -> list[int]:
        """Start of every Kafka-time hour in the range, as epoch milliseconds."""
        return [self.start_ms + h * HOUR_MS for h in range(self.hours)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``start`` as ISO-8601, ``max_lateness`` in seconds)."""
        return {
            "topic": self.topic,
            "partitions": self.partitions,
            "start": self.start.isoformat(),
            "hours": self.hours,
            "events_per_hour": self.events_per_hour,
            "seed": self.seed,
            "late_share": self.late_share,
            "max_lateness_seconds": self.max_lateness.total_seconds(),
            "duplicate_share": self.duplicate_share,
            "malformed_share": self.malformed_share,
            "tombstone_share": self.tombstone_share,
            "schema_switch_fraction": self.schema_switch_fraction,
            "encoding": self.encoding,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GeneratorConfig:
        """Inverse of ``to_dict``."""
        return cls(
            topic=str(data["topic"]),
            partitions=int(data["partitions"]),
            start=datetime.fromisoformat(str(data["start"])),
            hours=int(data["hours"]),
            events_per_hour=int(data["events_per_hour"]),
            seed=int(data["seed"]),
            late_share=float(data["late_share"]),
            max_lateness=timedelta(seconds=float(data["max_lateness_seconds"])),
            duplicate_share=float(data["duplicate_share"]),
            malformed_share=float(data["malformed_share"]),
            tombstone_share=float(data["tombstone_share"]),
            schema_switch_fraction=float(data["schema_switch_fraction"]),
            encoding=data.get("encoding", "json"),
        )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GeneratorError(f"GeneratorConfig.{name}={value!r} must be a whole number >= 1")


def _share(name: str, value: object, upper: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0.0 <= value <= upper
    ):
        raise GeneratorError(
            f"GeneratorConfig.{name}={value!r} is out of range; allowed: 0 <= {name} <= {upper}"
        )


# --------------------------------------------------------------------------------------------
# Planning (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRecord:
    """One Kafka record to produce, plus the ground-truth labels describing it."""

    partition: int
    key: bytes
    value: bytes | None
    timestamp_ms: int
    kind: RecordKind
    order_id: str
    event_id: str | None = None
    schema_version: SchemaVersion | None = None
    event_time_ms: int | None = None
    currency: str | None = None
    amount_minor: int | None = None
    event_type: str | None = None
    status: str | None = None
    late: bool = False
    malformed_reason: str | None = None


@dataclass
class _Order:
    order_id: str
    customer_id: str
    currency: str
    amount_minor: int
    status: str
    steps: list[str]


def partition_for(order_id: str, partitions: int) -> int:
    """Stable partition of an order: crc32 of the utf-8 order id modulo the partition count."""
    return zlib.crc32(order_id.encode("utf-8")) % partitions


def plan_events(config: GeneratorConfig) -> list[PlannedRecord]:
    """Plan every record in produce order. Pure and deterministic: same config, same bytes.

    Per partition, Kafka timestamps are non-decreasing and lie in ``[start, end)``.
    """
    config.validate()
    rng = random.Random(config.seed)
    slots: list[int] = []
    for hour_start in config.hour_starts_ms():
        slots.extend(
            sorted(hour_start + rng.randrange(HOUR_MS) for _ in range(config.events_per_hour))
        )

    planner = _Planner(config, rng)
    for ts in slots:
        planner.step(ts)
    return _settle_duplicates(planner.records, config.partitions)


class _Planner:
    """Walks the produce-time slots in order and evolves the order book."""

    def __init__(self, config: GeneratorConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self.records: list[PlannedRecord] = []
        self.orders: list[_Order] = []
        self.active: list[_Order] = []
        self.cancelled: list[_Order] = []
        self.switch_ms = config.schema_switch_ms
        self.min_lateness_ms = int(_MIN_LATENESS.total_seconds() * 1000)
        self.max_lateness_ms = int(config.max_lateness.total_seconds() * 1000)

    def step(self, ts: int) -> None:
        cfg = self.config
        roll = self.rng.random()
        if roll < cfg.malformed_share and self.orders:
            self._malformed(ts)
        elif roll < cfg.malformed_share + cfg.tombstone_share and self.cancelled:
            self._tombstone(ts)
        else:
            record = self._valid(ts)
            self.records.append(record)
            if self.rng.random() < cfg.duplicate_share:
                low, high = _DUPLICATE_DELAY_MS
                dup_ts = ts + self.rng.randint(low, high)
                if dup_ts // HOUR_MS != ts // HOUR_MS:
                    dup_ts = ts
                self.records.append(replace(record, kind="duplicate", timestamp_ms=dup_ts))

    def _new_order(self) -> _Order:
        rng = self.rng
        order = _Order(
            order_id=f"o-{len(self.orders) + 1:06d}",
            customer_id=f"c-{rng.randint(1, _CUSTOMERS):05d}",
            currency=rng.choice(CURRENCIES),
            amount_minor=rng.randint(_MIN_AMOUNT_MINOR, _MAX_AMOUNT_MINOR),
            status="open",
            steps=["updated"] * rng.randint(0, 2),
        )
        if rng.random() < _CANCEL_PROBABILITY:
            order.steps.append("cancelled")
        order.steps.reverse()  # pop() from the end yields the steps in lifecycle order
        self.orders.append(order)
        if order.steps:
            self.active.append(order)
        return order

    def _advance(self) -> tuple[_Order, str]:
        rng = self.rng
        index = rng.randrange(len(self.active))
        order = self.active[index]
        event_type = order.steps.pop()
        if event_type == "updated":
            if rng.random() < 0.5:
                order.amount_minor = rng.randint(_MIN_AMOUNT_MINOR, _MAX_AMOUNT_MINOR)
            if order.status != "paid":
                order.status = rng.choice(("open", "paid"))
        else:
            order.status = "cancelled"
            self.cancelled.append(order)
        if not order.steps:
            self.active[index] = self.active[-1]
            self.active.pop()
        return order, event_type

    def _event_time(self, ts: int) -> tuple[int, bool]:
        """Event time for a record produced at ``ts``, and whether it is late."""
        if self.rng.random() < self.config.late_share:
            lag = self.rng.randint(self.min_lateness_ms, self.max_lateness_ms)
            return ts - lag, True
        return ts - self.rng.randint(0, _NORMAL_JITTER_MS), False

    def _record_of(
        self, order: _Order, ts: int, kind: RecordKind, value: bytes | None, **labels: Any
    ) -> PlannedRecord:
        """A record of ``order`` produced at ``ts``: keyed by the order id, so every record of
        an order lands in the same partition, in order; ``labels`` are its other ground-truth
        fields."""
        return PlannedRecord(
            partition=partition_for(order.order_id, self.config.partitions),
            key=order.order_id.encode("utf-8"),
            value=value,
            timestamp_ms=ts,
            kind=kind,
            order_id=order.order_id,
            **labels,
        )

    def _valid(self, ts: int) -> PlannedRecord:
        if not self.active or self.rng.random() < _NEW_ORDER_PROBABILITY:
            order, event_type = self._new_order(), "created"
        else:
            order, event_type = self._advance()
        event_time_ms, late = self._event_time(ts)
        version: SchemaVersion = 1 if ts < self.switch_ms else 2
        event_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        channel = self.rng.choice(CHANNELS)
        payload = _payload(
            order,
            event_id=event_id,
            event_type=event_type,
            event_time_ms=event_time_ms,
            version=version,
            channel=channel,
        )
        return self._record_of(
            order,
            ts,
            "valid",
            _encode(payload),
            event_id=event_id,
            schema_version=version,
            event_time_ms=event_time_ms,
            currency=order.currency,
            amount_minor=order.amount_minor,
            event_type=event_type,
            status=order.status,
            late=late,
        )

    def _malformed(self, ts: int) -> None:
        rng = self.rng
        order = self.orders[rng.randrange(len(self.orders))]
        reason = rng.choice(MALFORMED_REASONS)
        event_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        event_time_ms = ts - rng.randint(0, _NORMAL_JITTER_MS)
        version: SchemaVersion = 1 if ts < self.switch_ms else 2
        payload = _payload(
            order,
            event_id=event_id,
            event_type="updated",
            event_time_ms=event_time_ms,
            version=version,
            channel=rng.choice(CHANNELS),
        )
        label_id: str | None = event_id
        if reason == "invalid_json":
            full = _encode(payload)
            value = full[: len(full) // 2]  # a cut JSON object never parses
            label_id = None
        else:
            if reason == "missing_event_time":
                del payload["event_time"]
            elif reason == "wrong_type":
                payload["amount_minor" if version == 2 else "amount"] = "abc"
            else:
                payload["schema_version"] = 9
            value = _encode(payload)
        self.records.append(
            self._record_of(
                order, ts, "malformed", value, event_id=label_id, malformed_reason=reason
            )
        )

    def _tombstone(self, ts: int) -> None:
        index = self.rng.randrange(len(self.cancelled))
        order = self.cancelled[index]
        self.cancelled[index] = self.cancelled[-1]
        self.cancelled.pop()
        self.records.append(self._record_of(order, ts, "tombstone", None))


def _payload(
    order: _Order,
    *,
    event_id: str,
    event_type: str,
    event_time_ms: int,
    version: SchemaVersion,
    channel: str,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "schema_version": version,
        "event_id": event_id,
        "order_id": order.order_id,
        "customer_id": order.customer_id,
        "event_type": event_type,
        "currency": order.currency,
        "status": order.status,
    }
    if version == 1:
        payload["amount"] = _AmountMajor(order.amount_minor)
        payload["event_time"] = iso_millis(event_time_ms)
    else:
        payload["amount_minor"] = order.amount_minor
        payload["event_time"] = event_time_ms
        payload["channel"] = channel
    return payload


@dataclass(frozen=True)
class _AmountMajor:
    """A v1 amount, serialised as a JSON number with exactly two decimals."""

    minor: int

    def literal(self) -> str:
        return f"{self.minor // 100}.{self.minor % 100:02d}"


def _encode(payload: Mapping[str, Any]) -> bytes:
    amount = payload.get("amount")
    plain = dict(payload)
    if isinstance(amount, _AmountMajor):
        plain["amount"] = _AMOUNT_PLACEHOLDER
    text = json.dumps(plain, separators=(",", ":"), sort_keys=True)
    if isinstance(amount, _AmountMajor):
        text = text.replace(f'"{_AMOUNT_PLACEHOLDER}"', amount.literal(), 1)
    return text.encode("utf-8")


def _settle_duplicates(records: list[PlannedRecord], partitions: int) -> list[PlannedRecord]:
    """Lower a duplicate's timestamp to the next record's in its partition, if it overtook it."""
    by_partition: list[list[int]] = [[] for _ in range(partitions)]
    for index, record in enumerate(records):
        by_partition[record.partition].append(index)
    for indexes in by_partition:
        for position, index in enumerate(indexes[:-1]):
            record = records[index]
            following = records[indexes[position + 1]].timestamp_ms
            if record.kind == "duplicate" and record.timestamp_ms > following:
                records[index] = replace(record, timestamp_ms=following)
    return records


def iso_millis(ms: int) -> str:
    """Epoch milliseconds as ``2026-01-01T00:12:34.567Z``."""
    moment = _EPOCH + timedelta(milliseconds=ms)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def hour_iso(ms: int) -> str:
    """The UTC hour containing ``ms``, as ``2026-01-01T03:00:00+00:00``."""
    return (_EPOCH + timedelta(milliseconds=ms - ms % HOUR_MS)).isoformat()


def _to_ms(moment: datetime) -> int:
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


# --------------------------------------------------------------------------------------------
# Ground truth
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionTruth:
    """Offsets of one partition: ``[first_offset, end_offset)`` and each record's timestamp."""

    first_offset: int
    end_offset: int
    timestamps_ms: list[int]


@dataclass
class GroundTruth:
    """What was written, in the terms a backfill is checked against.

    ``kafka_hours`` counts records per Kafka-time hour; ``valid``, ``v1``, ``v2`` and ``late``
    count distinct valid events only. ``event_hours`` sums valid events per event-time hour and
    currency. ``hour_offsets`` gives ``[start, end)`` offsets of each partition's Kafka-time hour.
    """

    topic: str
    partitions: int
    start: str
    end: str
    seed: int
    config: dict[str, Any]
    partition_offsets: dict[int, PartitionTruth]
    hour_offsets: dict[int, dict[str, list[int]]]
    kafka_hours: dict[str, dict[str, int]]
    event_hours: dict[str, dict[str, dict[str, int]]]
    malformed_reasons: dict[str, int]
    totals: dict[str, int]
    version: int = field(default=1)

    def offset_for_time(self, partition: int, ts_ms: int) -> int:
        """Earliest offset whose timestamp is >= ``ts_ms``; ``end_offset`` if there is none.

        This is what ``Consumer.offsets_for_times`` answers, except that Kafka says -1 (end)
        when no record qualifies, where this method returns the concrete ``end_offset``.
        """
        part = self.partition_offsets[partition]
        return part.first_offset + bisect.bisect_left(part.timestamps_ms, ts_ms)

    def end_offsets(self) -> dict[int, int]:
        """Exclusive end offset of every partition."""
        return {p: part.end_offset for p, part in self.partition_offsets.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (partition keys become strings)."""
        return {
            "version": self.version,
            "topic": self.topic,
            "partitions": self.partitions,
            "start": self.start,
            "end": self.end,
            "seed": self.seed,
            "config": self.config,
            "totals": self.totals,
            "malformed_reasons": self.malformed_reasons,
            "partition_offsets": {
                str(p): {
                    "first_offset": part.first_offset,
                    "end_offset": part.end_offset,
                    "timestamps_ms": part.timestamps_ms,
                }
                for p, part in self.partition_offsets.items()
            },
            "hour_offsets": {str(p): hours for p, hours in self.hour_offsets.items()},
            "kafka_hours": self.kafka_hours,
            "event_hours": self.event_hours,
        }

    def to_json(self) -> str:
        """Deterministic JSON text."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def write(self, path: Path) -> None:
        """Write ``to_json()`` to ``path`` atomically, creating parent directories."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GroundTruth:
        """Inverse of ``to_dict``."""
        return cls(
            version=int(data.get("version", 1)),
            topic=str(data["topic"]),
            partitions=int(data["partitions"]),
            start=str(data["start"]),
            end=str(data["end"]),
            seed=int(data["seed"]),
            config=dict(data["config"]),
            partition_offsets={
                int(p): PartitionTruth(
                    first_offset=int(part["first_offset"]),
                    end_offset=int(part["end_offset"]),
                    timestamps_ms=[int(t) for t in part["timestamps_ms"]],
                )
                for p, part in data["partition_offsets"].items()
            },
            hour_offsets={
                int(p): {h: [int(bound[0]), int(bound[1])] for h, bound in hours.items()}
                for p, hours in data["hour_offsets"].items()
            },
            kafka_hours={h: dict(c) for h, c in data["kafka_hours"].items()},
            event_hours={
                h: {cur: dict(v) for cur, v in per.items()}
                for h, per in data["event_hours"].items()
            },
            malformed_reasons=dict(data["malformed_reasons"]),
            totals=dict(data["totals"]),
        )

    @classmethod
    def from_json(cls, path: Path) -> GroundTruth:
        """Read a manifest written by ``write``."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise GeneratorError(f"cannot read ground-truth manifest {path}: {exc}") from exc
        return cls.from_dict(data)

    def generator_config(self) -> GeneratorConfig:
        """The configuration this ground truth was generated from."""
        return GeneratorConfig.from_dict(self.config)


def build_ground_truth(
    config: GeneratorConfig,
    plan: Sequence[PlannedRecord],
    first_offsets: Mapping[int, int] | None = None,
) -> GroundTruth:
    """Summarise a plan, assuming each partition's records got consecutive offsets.

    ``first_offsets`` gives the offset of each partition's first record (default 0).
    """
    firsts = dict(first_offsets or {})
    stamps: dict[int, list[int]] = {p: [] for p in range(config.partitions)}
    hour_keys = [hour_iso(h) for h in config.hour_starts_ms()]
    kafka_hours: dict[str, Counter[str]] = {h: Counter() for h in hour_keys}
    event_hours: dict[str, dict[str, dict[str, int]]] = {}
    reasons: Counter[str] = Counter()
    for record in plan:
        stamps[record.partition].append(record.timestamp_ms)
        counts = kafka_hours[hour_iso(record.timestamp_ms)]
        counts["records"] += 1
        if record.kind == "valid":
            counts["valid"] += 1
            counts[f"v{record.schema_version}"] += 1
            counts["late"] += int(record.late)
            if record.event_time_ms is None or record.currency is None:
                raise GeneratorError(f"valid record for {record.order_id} has no event time")
            if record.amount_minor is None:
                raise GeneratorError(f"valid record for {record.order_id} has no amount")
            per_currency = event_hours.setdefault(hour_iso(record.event_time_ms), {})
            sums = per_currency.setdefault(record.currency, {"events": 0, "amount_minor": 0})
            sums["events"] += 1
            sums["amount_minor"] += record.amount_minor
        elif record.kind == "duplicate":
            counts["duplicates"] += 1
        elif record.kind == "malformed":
            counts["malformed"] += 1
            reasons[record.malformed_reason or "unknown"] += 1
        else:
            counts["tombstones"] += 1

    partition_offsets = {
        p: PartitionTruth(
            first_offset=firsts.get(p, 0),
            end_offset=firsts.get(p, 0) + len(ts),
            timestamps_ms=ts,
        )
        for p, ts in stamps.items()
    }
    truth = GroundTruth(
        topic=config.topic,
        partitions=config.partitions,
        start=config.start.isoformat(),
        end=config.end.isoformat(),
        seed=config.seed,
        config=config.to_dict(),
        partition_offsets=partition_offsets,
        hour_offsets={},
        kafka_hours={h: {k: c[k] for k in COUNT_KEYS} for h, c in kafka_hours.items()},
        event_hours={
            h: {cur: event_hours[h][cur] for cur in sorted(event_hours[h])}
            for h in sorted(event_hours)
        },
        malformed_reasons={r: reasons[r] for r in MALFORMED_REASONS if reasons[r]},
        totals={k: sum(c[k] for c in kafka_hours.values()) for k in COUNT_KEYS},
    )
    truth.hour_offsets = {
        p: {
            hour_iso(h): [truth.offset_for_time(p, h), truth.offset_for_time(p, h + HOUR_MS)]
            for h in config.hour_starts_ms()
        }
        for p in range(config.partitions)
    }
    return truth


# --------------------------------------------------------------------------------------------
# Writing to Kafka
# --------------------------------------------------------------------------------------------


def generate(
    settings: Settings,
    config: GeneratorConfig,
    manifest_path: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> GroundTruth:
    """Create ``config.topic`` if needed (it must be empty), produce the plan, return the truth.

    With ``config.encoding="avro"`` the events' values are written in Avro through the schema
    registry (``settings.schema_registry_url``); the ground truth is the same.

    The manifest, if ``manifest_path`` is given, is written only after every record was
    acknowledged. ``on_progress(records handed to the producer, total)`` is called as it goes.
    """
    plan = plan_events(config)
    admin_conf: dict[str, str | int | float | bool] = dict(settings.kafka.client_config())
    admin = AdminClient(admin_conf)
    next_offsets = _prepare_topic(settings, admin, config)
    offsets = _produce(settings, config.topic, _encoded(settings, config, plan), on_progress)
    first_offsets = _first_offsets(config, plan, offsets, next_offsets)
    truth = build_ground_truth(config, plan, first_offsets)
    if manifest_path is not None:
        truth.write(manifest_path)
    return truth


def produce_history(
    settings: Settings,
    config: GeneratorConfig,
    chunk_hours: int = 12,
    on_progress: Callable[[int, int], None] | None = None,
) -> int:
    """Produce a long history (benchmarks: millions of records) ``chunk_hours`` at a time, so
    the plan of the whole range is never held in memory. Each chunk is planned like
    :func:`generate` with its own seed (duplicates and tombstones refer to orders of their own
    chunk). No ground truth is built. Returns the records produced;
    ``on_progress(hours done, hours)`` after each chunk."""
    if isinstance(chunk_hours, bool) or not isinstance(chunk_hours, int) or chunk_hours < 1:
        raise GeneratorError(f"chunk_hours={chunk_hours!r} must be a whole number >= 1")
    admin = AdminClient(dict(settings.kafka.client_config()))
    _prepare_topic(settings, admin, config)
    produced = 0
    for index, first in enumerate(range(0, config.hours, chunk_hours)):
        chunk = replace(
            config,
            start=config.start + timedelta(hours=first),
            hours=min(chunk_hours, config.hours - first),
            seed=config.seed + index,
        )
        plan = plan_events(chunk)
        _produce(settings, config.topic, _encoded(settings, config, plan))
        produced += len(plan)
        del plan
        if on_progress is not None:
            on_progress(first + chunk.hours, config.hours)
    return produced


def _encoded(
    settings: Settings, config: GeneratorConfig, plan: list[PlannedRecord]
) -> list[PlannedRecord]:
    """The plan as ``config.encoding`` writes it: JSON as planned, or Avro (demo/avro.py)."""
    if config.encoding == "json":
        return plan
    from backfill_assets.demo.avro import Encoder

    encode = Encoder(settings.schema_registry_url, config.topic, settings.schema_registry_auth)
    # Malformed records keep their JSON bytes (not the wire format: quarantined), tombstones NULL.
    return [replace(r, value=encode(r)) if r.kind in ("valid", "duplicate") else r for r in plan]


def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def _prepare_topic(
    settings: Settings, admin: AdminClient, config: GeneratorConfig
) -> dict[int, int]:
    """Create the topic or check the existing one is empty; return each partition's next offset."""
    topic = config.topic
    new = NewTopic(
        topic,
        num_partitions=config.partitions,
        # -1: the cluster's default.replication.factor (1 on the local broker, 3 on
        # the production-shaped cluster, whose min.insync.replicas=2 refuses a lone replica).
        replication_factor=-1,
        config=dict(TOPIC_CONFIGS),
    )
    futures = admin.create_topics(
        [new], operation_timeout=_ADMIN_TIMEOUT_S, request_timeout=_ADMIN_TIMEOUT_S
    )
    created = True
    try:
        futures[topic].result()
    except KafkaException as exc:
        err = _kafka_error(exc)
        if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise GeneratorError(
                f"could not create topic {topic!r}: {err.str() if err else exc}; "
                "check that the broker is reachable (backfill-assets kafka status)"
            ) from exc
        created = False
    partition_count = _wait_for_topic(admin, topic)
    if created:
        return dict.fromkeys(range(config.partitions), 0)
    if partition_count != config.partitions:
        raise GeneratorError(
            f"topic {topic!r} already exists with {partition_count} partitions, but "
            f"{config.partitions} were requested; pass a different --topic or delete it first"
        )
    _check_timestamp_type(admin, topic)
    earliest, latest = _watermarks(settings, topic, partition_count)
    if any(latest[p] > earliest[p] for p in latest):
        raise GeneratorError(
            f"topic {topic!r} already has data (end offsets by partition: {latest}); "
            "pass a different --topic or delete it first "
            f"(kafka-topics.sh --delete --topic {topic})"
        )
    return latest


def _wait_for_topic(admin: AdminClient, topic: str) -> int:
    """Wait until every partition of ``topic`` has a leader; return the partition count."""
    deadline = time.monotonic() + _ADMIN_TIMEOUT_S
    last_problem = "not in metadata"
    while True:
        try:
            metadata = admin.list_topics(topic=topic, timeout=10)
        except KafkaException as exc:
            last_problem = str(exc)
        else:
            described = metadata.topics.get(topic)
            if described is None:
                last_problem = "not in metadata"
            elif described.error is not None:
                last_problem = str(described.error)
            elif described.partitions and all(
                p.error is None and p.leader >= 0 for p in described.partitions.values()
            ):
                return len(described.partitions)
            else:
                last_problem = "partitions without a leader"
        if time.monotonic() >= deadline:
            raise GeneratorError(
                f"topic {topic!r} did not become usable within {_ADMIN_TIMEOUT_S:.0f}s "
                f"({last_problem}); check the broker (backfill-assets kafka status)"
            )
        time.sleep(0.2)


def _check_timestamp_type(admin: AdminClient, topic: str) -> None:
    resource = ConfigResource(ResourceType.TOPIC, topic)
    try:
        entries = admin.describe_configs([resource], request_timeout=_ADMIN_TIMEOUT_S)
        values = next(iter(entries.values())).result()
    except KafkaException as exc:
        raise GeneratorError(f"could not read the configuration of topic {topic!r}: {exc}") from exc
    entry = values.get("message.timestamp.type")
    if entry is not None and entry.value != "CreateTime":
        raise GeneratorError(
            f"topic {topic!r} has message.timestamp.type={entry.value}, so the broker would "
            "overwrite the back-dated timestamps; pass a different --topic or delete it first"
        )


def _watermarks(
    settings: Settings, topic: str, partitions: int
) -> tuple[dict[int, int], dict[int, int]]:
    """Low and high watermark of every partition (no group is joined, nothing is committed)."""
    consumer = KafkaClient(settings).offsets_consumer()
    low: dict[int, int] = {}
    high: dict[int, int] = {}
    deadline = time.monotonic() + _ADMIN_TIMEOUT_S
    try:
        for p in range(partitions):
            while p not in high:
                try:
                    low[p], high[p] = consumer.get_watermark_offsets(
                        TopicPartition(topic, p), timeout=_ADMIN_TIMEOUT_S
                    )
                except KafkaException as exc:
                    # A partition that was just created may not serve ListOffsets yet.
                    if not _transient(exc) or time.monotonic() >= deadline:
                        raise GeneratorError(
                            f"could not list the offsets of topic {topic!r} partition {p}: {exc}"
                        ) from exc
                    time.sleep(0.2)
    finally:
        consumer.close()
    return low, high


_TRANSIENT_CODES = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)


def _transient(exc: KafkaException) -> bool:
    err = _kafka_error(exc)
    return err is not None and (err.retriable() or err.code() in _TRANSIENT_CODES)


def _produce(
    settings: Settings,
    topic: str,
    plan: Sequence[PlannedRecord],
    on_progress: Callable[[int, int], None] | None = None,
) -> list[int | None]:
    """Produce every record in plan order; return the offset of each one."""
    conf: dict[str, Any] = {
        **settings.kafka.client_config(),
        "enable.idempotence": True,
        "linger.ms": 20,
        "compression.type": "lz4",
        # librdkafka's retries (e.g. while the broker loads its coordinator) go to a log file.
        "logger": client_log(settings),
    }
    producer = Producer(conf)
    offsets: list[int | None] = [None] * len(plan)
    failures: list[str] = []

    def reporter(index: int) -> Callable[[KafkaError | None, Message[Any, Any]], None]:
        def on_delivery(err: KafkaError | None, msg: Message[Any, Any]) -> None:
            if err is not None:
                hint = ""
                if err.code() == KafkaError.INVALID_TIMESTAMP:
                    hint = (
                        " (the broker rejects the timestamp: check the topic's "
                        "message.timestamp.before.max.ms / message.timestamp.after.max.ms)"
                    )
                failures.append(f"partition {plan[index].partition}: {err.str()}{hint}")
            else:
                offsets[index] = msg.offset()

        return on_delivery

    for index, record in enumerate(plan):
        while True:
            try:
                producer.produce(
                    topic,
                    value=record.value,
                    key=record.key,
                    partition=record.partition,
                    timestamp=record.timestamp_ms,
                    on_delivery=reporter(index),
                )
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
        if on_progress is not None and index % 1000 == 999:
            on_progress(index + 1, len(plan))
    remaining = producer.flush(max(60.0, len(plan) / 500))
    if on_progress is not None:
        on_progress(len(plan), len(plan))
    if remaining:
        raise GeneratorError(
            f"{remaining} of {len(plan)} records to topic {topic!r} were not acknowledged in "
            "time; check the broker (backfill-assets kafka status)"
        )
    if failures:
        shown = "; ".join(failures[:5])
        more = f" (and {len(failures) - 5} more)" if len(failures) > 5 else ""
        raise GeneratorError(
            f"{len(failures)} of {len(plan)} records to topic {topic!r} failed: {shown}{more}"
        )
    return offsets


def _first_offsets(
    config: GeneratorConfig,
    plan: Sequence[PlannedRecord],
    offsets: Sequence[int | None],
    next_offsets: Mapping[int, int],
) -> dict[int, int]:
    """Check each partition got consecutive offsets in plan order; return the first ones.

    A partition without records starts (and ends) at its offset before producing.
    """
    firsts: dict[int, int] = dict(next_offsets)
    seen: set[int] = set()
    expected: dict[int, int] = {}
    for record, offset in zip(plan, offsets, strict=True):
        if offset is None or offset < 0:
            raise GeneratorError(
                f"a record to {config.topic!r} partition {record.partition} was acknowledged "
                "without an offset"
            )
        p = record.partition
        if p not in seen:
            seen.add(p)
            firsts[p] = offset
        elif offset != expected[p]:
            raise GeneratorError(
                f"topic {config.topic!r} partition {p}: expected offset {expected[p]} but got "
                f"{offset}; is something else writing to this topic?"
            )
        expected[p] = offset + 1
    return firsts
