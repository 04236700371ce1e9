"""The independent decode behind the raw table's ``decoded_content`` check.

The librdkafka pass that fixes a run's windows (:func:`backfill_assets.lake.offsets.scan.scan`)
hands
every committed record of the window to a :class:`RecordDecoder`. It applies the replay's
quarantine rules (:data:`backfill_assets.lake.decode.parse.QUARANTINE_RULES`) and each schema
version's Python reference decode (:mod:`backfill_assets.spec.transforms.reference`, named by
the spec's ``decoders``), never Spark's parse, the JVM reader or the upcasters, and hashes the
typed row it expects the table to hold exactly as Spark's
``xxhash64(kafka_partition, kafka_offset, is_tombstone, <columns>...)`` hashes the stored row.
The check compares, per Kafka hour, the sum of those hashes with the same sum over the
branch's rows: a wrong upcaster, a wrong parse or a row whose typed values were altered
changes some hour's sum (one changed value in a window is enough: the sums are exact integers
of 64-bit hashes, so a miss needs a hash collision, about 2^-64).

The decode runs in Python on the run's driver, while librdkafka reads the records (about 20 us
a record of CPU, ``bench/decode.py``; the seconds are in the check's metadata). Whole or
sampled is decided per Kafka hour, never per run, so an hour is checked alike by a 1-hour and
a 168-hour run: an hour of at most ``BACKFILL_CONTENT_SAMPLE_ABOVE`` records (default 50,000)
is decoded whole. A larger hour is compared on the sample :func:`in_sample` picks, 1 record
in ``BACKFILL_CONTENT_SAMPLE`` (default 16) whose (partition, offset) hash is the run's
residue modulo K (drawn per run: a re-run checks other records), and the check sums the same
records on the table side (:func:`sample_condition`, the same predicate in Spark, told which
hours are sampled by :class:`Sample`): a fault touching m records of such an hour escapes with
probability (1 - 1/K)^m (:func:`miss_bound`). The scan decodes the records outside the sample
too while their hour has at most the threshold (two sums per cell), so it needs no buffer, and
an hour that proves larger keeps only its sample's sum. A record the reference quarantines
counts on neither side only if the table quarantined it too; a record one side keeps as a row
and the other quarantines changes the hour's sum and row count, so the check fails.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import xxhash

from backfill_assets.lake.decode import avro, debezium, debezium_avro, json_schema, protobuf
from backfill_assets.spec.model import CDC_NAMES, ColumnSpec, TopicSpec, decimal_of
from backfill_assets.spec.transforms import reference

if TYPE_CHECKING:
    from pyspark.sql import Column

# What the decode says about one record: a row and its content hash, a quarantine reason, or a
# version without a Python reference (not compared).
ROW, QUARANTINED, UNVERIFIED = "row", "quarantined", "unverified"
Decoded = tuple[str, Any]

# Timestamps a row may hold (parse.TIMESTAMP_RANGE, stated again: 1900-01-01 .. 2200-01-01
# UTC), as epoch microseconds.
TIMESTAMP_RANGE_US = (
    int((datetime.fromisoformat("1900-01-01T00:00:00+00:00")).timestamp()) * 1_000_000,
    int((datetime.fromisoformat("2200-01-01T00:00:00+00:00")).timestamp()) * 1_000_000,
)

_INT, _LONG, _DOUBLE = struct.Struct("<i"), struct.Struct("<q"), struct.Struct("<d")
_XXH64 = xxhash.xxh64_intdigest
_TWO_63, _TWO_64 = 1 << 63, 1 << 64
_TRUE, _FALSE = _INT.pack(1), _INT.pack(0)
_PACK_LONG = _LONG.pack


@functools.cache
def partition_seed(partition: int) -> int:
    """XXH64 of the partition (int, 4 bytes) from seed 42: Spark's first step of
    ``xxhash64(partition, ...)``."""
    return _XXH64(_INT.pack(partition), 42)


def position_hash(partition: int, offset: int) -> int:
    """XXH64 of the offset seeded by the partition's hash (unsigned): Spark's
    ``xxhash64(partition, offset)``, the first step of every record's hashes."""
    return _XXH64(_PACK_LONG(offset), partition_seed(partition))


@dataclass(frozen=True)
class Sample:
    """Which records the content check compares. Every record of an hour not in ``hours``; in
    the hours of ``hours`` (epoch millis: hours holding more records than the decode covers
    whole) the 1 in ``k`` whose position hash is ``residue`` modulo ``k``; never the records
    ``accepted`` names by (partition, offset) (an operator's ``accept``)."""

    k: int = 1
    residue: int = 0
    hours: frozenset[int] = frozenset()
    accepted: frozenset[tuple[int, int]] = frozenset()

    @property
    def whole(self) -> bool:
        return (self.k == 1 or not self.hours) and not self.accepted


def in_sample(
    partition: int, offset: int, k: int, position: int | None = None, residue: int = 0
) -> bool:
    """Whether the record at (``partition``, ``offset``) is in the 1-in-``k`` content sample of
    ``residue``: ``pmod(xxhash64(partition, offset), k) = residue`` as Spark computes it over
    ``kafka_partition`` (int) and ``kafka_offset`` (bigint), see :func:`sample_condition`. Every
    record for ``k == 1``. ``position``: :func:`position_hash` of the record, when known."""
    if k == 1:
        return True
    h = position_hash(partition, offset) if position is None else position
    # Python's % is Spark's pmod for k > 0.
    return (h - _TWO_64 if h >= _TWO_63 else h) % k == residue


def sample_condition(sample: Sample) -> Column | None:
    """:func:`in_sample` as a Spark condition over a raw table's rows (or quarantine rows):
    the rows ``sample`` compares (None: every row)."""
    from pyspark.sql import functions as F

    if sample.whole:
        return None
    chosen = F.lit(True)
    if sample.k > 1 and sample.hours:
        picked = F.pmod(F.xxhash64("kafka_partition", "kafka_offset"), F.lit(sample.k))
        hour = F.unix_millis("kafka_hour")
        chosen = (picked == sample.residue) | ~hour.isin(sorted(sample.hours))
    if sample.accepted:
        record = F.concat_ws(":", "kafka_partition", "kafka_offset")
        chosen = chosen & ~record.isin(sorted(f"{p}:{o}" for p, o in sample.accepted))
    return chosen


def miss_bound(k: int, m: int) -> float:
    """The probability that a 1-in-``k`` sample misses every one of ``m`` faulty records
    (each is in the sample with probability 1/k, independently as far as the hash goes)."""
    return (1 - 1 / k) ** m


def _string(value: Any) -> bytes:
    # A JVM string encodes an unpaired surrogate as '?', as "replace" does here.
    return str(value).encode("utf-8", "replace")


def _double(value: Any) -> bytes:
    return _DOUBLE.pack(0.0 if value == 0 else value)  # Spark hashes -0.0 as 0.0


# How Spark's xxhash64 sees a value of each column type (a timestamp: its epoch microseconds).
_AS_BYTES: dict[str, Callable[[Any], bytes]] = {
    "string": _string,
    "bigint": _LONG.pack,
    "timestamp": _LONG.pack,
    "int": _INT.pack,
    "boolean": lambda value: _TRUE if value else _FALSE,
    "double": _double,
}


def row_hash(
    partition: int,
    offset: int,
    tombstone: bool,
    columns: tuple[ColumnSpec, ...],
    values: dict[str, Any],
) -> int:
    """Spark's ``xxhash64(kafka_partition, kafka_offset, is_tombstone, <columns>...)`` of a row
    (XXH64 chained from seed 42, a NULL skipped), as a signed long."""
    return _row_hash(partition, offset, tombstone, _packers(columns), values)


def _decimal(precision: int, scale: int) -> Callable[[Any], bytes]:
    """How Spark's xxhash64 sees a ``decimal(precision, scale)``: its unscaled value as a long
    up to 18 digits, else the unscaled value's minimal two's-complement bytes (Java's
    ``BigInteger.toByteArray``)."""

    def pack(value: Any) -> bytes:
        unscaled = int(value.scaleb(scale))
        if precision <= 18:
            return _LONG.pack(unscaled)
        magnitude = ~unscaled if unscaled < 0 else unscaled
        return unscaled.to_bytes(magnitude.bit_length() // 8 + 1, "big", signed=True)

    return pack


def _packer(column_type: str) -> Callable[[Any], bytes]:
    decimal = decimal_of(column_type)
    return _AS_BYTES[column_type] if decimal is None else _decimal(*decimal)


def _packers(columns: tuple[ColumnSpec, ...]) -> list[tuple[str, Callable[[Any], bytes]]]:
    return [(c.name, _packer(c.type)) for c in columns]


def _row_hash(
    partition: int,
    offset: int,
    tombstone: bool,
    packers: list[tuple[str, Callable[[Any], bytes]]],
    values: dict[str, Any],
) -> int:
    h = _XXH64(_LONG.pack(offset), partition_seed(partition))
    h = _XXH64(_TRUE if tombstone else _FALSE, h)
    for name, pack in packers:
        value = values.get(name)
        if value is not None:
            h = _XXH64(pack(value), h)
    return h - _TWO_64 if h >= _TWO_63 else h


# A column's rules: (name, nullable, allowed, min, max, is a timestamp).
_Rule = tuple[str, bool, frozenset[str] | None, Any, Any, bool]


class RecordDecoder:
    """Decodes one Kafka record the way the replay must have: ``(ROW, content hash)``,
    ``(QUARANTINED, reason)`` or ``(UNVERIFIED, version)``."""

    def __init__(
        self,
        spec: TopicSpec,
        registry_url: str | None = None,
        registry_auth: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        # An avro or protobuf topic's values: confluent-kafka's deserializer with its own
        # registry client.
        self.decode: avro.IndependentDecode | protobuf.IndependentDecode | None = None
        # A Debezium avro topic's envelope: decoded by its own IndependentDecode, then read by
        # the envelope's rules (self.cdc) like a JSON one.
        self.envelope: debezium_avro.IndependentDecode | None = None
        if spec.format == "avro" and spec.envelope == "debezium":
            if registry_url is None:
                raise ValueError(f"topic {spec.topic!r} is avro: its decode needs a registry URL")
            self.envelope = debezium_avro.IndependentDecode(spec, registry_url, registry_auth)
        elif spec.format in ("avro", "protobuf"):
            if registry_url is None:
                raise ValueError(
                    f"topic {spec.topic!r} is {spec.format}: its decode needs a registry URL"
                )
            kind = avro if spec.format == "avro" else protobuf
            self.decode = kind.IndependentDecode(spec, registry_url, registry_auth)
        # A json_schema topic's header: checked against the registry in plain Python.
        self.wire = None
        if spec.format == "json_schema":
            if registry_url is None:
                raise ValueError(
                    f"topic {spec.topic!r} is json_schema: its decode needs a registry URL"
                )
            self.wire = json_schema.WireCheck(registry_url, registry_auth)
        # A Debezium topic's envelope, read in plain Python.
        self.cdc = debezium.Reference(spec) if spec.envelope == "debezium" else None
        self.columns = spec.columns
        self.references: dict[int, Callable[[reference.Payload], Any] | None] = {
            v: spec.decoder(v) for v in spec.versions
        }
        self.unverified = sorted(v for v, ref in self.references.items() if ref is None)
        self.packers = _packers(spec.columns)
        # (name, nullable, allowed, min, max, is a timestamp), in the replay's order
        self.rules: list[_Rule] = [
            (
                c.name,
                c.nullable,
                frozenset(c.allowed) if c.allowed is not None else None,
                c.min,
                c.max,
                c.type == "timestamp",
            )
            for c in spec.columns
        ]

    def __call__(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None
    ) -> Decoded:
        spec = self.spec
        size = len(key or b"") + len(value or b"")
        if size > spec.max_record_bytes:
            return QUARANTINED, f"record_too_large:{size}"
        key_text = _utf8(key)
        if value is None:
            return self._tombstone(partition, offset, key_text, key)
        if self.decode is not None or self.envelope is not None:
            return self._decoded(partition, offset, value)
        payload = self._json(value)
        if isinstance(payload, str):
            return QUARANTINED, payload
        if self.cdc is not None:
            return self._change(partition, offset, payload)
        return self._event(partition, offset, key_text, payload)

    def _tombstone(
        self, partition: int, offset: int, key_text: str | None, key_bytes: bytes | None
    ) -> Decoded:
        """A tombstone: a row with its key (a Debezium key's field, from its JSON or its
        Avro), if it has one."""
        if self.envelope is not None:
            key = self.envelope.tombstone_key(key_bytes)
        else:
            key = key_text if self.cdc is None else self.cdc.tombstone_key(key_text)
        if key is None:
            return QUARANTINED, f"missing_or_invalid:{self.spec.key_field}"
        return ROW, _row_hash(partition, offset, True, self.packers, {self.spec.key_field: key})

    def _change(self, partition: int, offset: int, payload: dict[str, Any]) -> Decoded:
        """A Debezium change event: its key and cdc columns' rules, then (unless a delete) the
        other columns', where a column Debezium left out (TOAST) is not missing."""
        assert self.cdc is not None
        row = self.cdc(payload)
        if isinstance(row, str):
            return QUARANTINED, row
        key = self.spec.key_field
        first = [r for r in self.rules if r[0] == key] + [
            r for r in self.rules if r[0] in CDC_NAMES
        ]
        reason = self._violation(row, first)
        if reason is None and row["cdc_op"] != debezium.DELETE:
            unavailable = frozenset((row["cdc_unavailable"] or "").split(","))
            rest = [r for r in self.rules if r not in first]
            reason = self._violation(row, rest, unavailable)
        if reason is not None:
            return QUARANTINED, reason
        return ROW, _row_hash(partition, offset, False, self.packers, row)

    def _json(self, value: bytes) -> dict[str, Any] | str:
        """The JSON object of a json (or json_schema, after its header) value, or the reason
        it is quarantined."""
        if self.wire is None or not value:
            return _payload(value)
        body = self.wire(value)
        if isinstance(body, str):
            return body
        return _payload(body) if body else "invalid_json"  # the header alone: no JSON value

    def _decoded(self, partition: int, offset: int, value: bytes) -> Decoded:
        """An avro or protobuf value, read by the topic's IndependentDecode (a Debezium avro
        envelope: then read as :meth:`_change` reads a JSON one)."""
        if not value:
            return QUARANTINED, "empty_value"
        if self.envelope is not None:
            payload = self.envelope(value)
            if isinstance(payload, str):
                return QUARANTINED, payload
            return self._change(partition, offset, payload)
        assert self.decode is not None
        row = self.decode(value)
        if isinstance(row, str):
            return QUARANTINED, row
        reason = self._violation(row)
        if reason is not None:
            return QUARANTINED, reason
        return ROW, _row_hash(partition, offset, False, self.packers, row)

    def _event(
        self, partition: int, offset: int, key_text: str | None, payload: dict[str, Any]
    ) -> Decoded:
        spec = self.spec
        if spec.version_field is None:
            version = spec.latest_version
        else:
            version = reference.field(payload, spec.version_field, "int")
        if version is None or version not in self.references:
            return QUARANTINED, f"unknown_schema_version:{'?' if version is None else version}"
        decode = self.references[version]
        if decode is None:
            return UNVERIFIED, version
        row = dict(decode(payload))
        if row.get(spec.key_field) is None and not reference.present(payload, spec.key_field):
            row[spec.key_field] = key_text
        reason = self._violation(row)
        if reason is not None:
            return QUARANTINED, reason
        return ROW, _row_hash(partition, offset, False, self.packers, row)

    def _violation(
        self,
        row: dict[str, Any],
        rules: list[_Rule] | None = None,
        excused: frozenset[str] = frozenset(),
    ) -> str | None:
        """The first column rule (of ``rules``, default all) a row breaks, in the replay's
        order; a NULL in a column of ``excused`` is not missing."""
        low, high = TIMESTAMP_RANGE_US
        for name, nullable, allowed, least, most, stamp in self.rules if rules is None else rules:
            value = row.get(name)
            if value is None:
                if not nullable and name not in excused:
                    return f"missing_or_invalid:{name}"
                continue
            if allowed is not None and value not in allowed:
                return f"not_allowed:{name}"
            if least is not None and value < least:
                return f"below_min:{name}"
            if most is not None and value > most:
                return f"above_max:{name}"
            if stamp and not low <= value < high:
                return f"out_of_range:{name}"
        return None


def _payload(value: bytes) -> dict[str, Any] | str:
    """The JSON object a value holds, or the reason it is quarantined."""
    if not value:
        return "empty_value"
    text = _utf8(value)
    if text is None:
        return "invalid_utf8"
    try:
        payload = reference.loads(text)
    except reference.InvalidJson:
        return "invalid_json"
    if not isinstance(payload, dict):
        return "not_json_object"
    return payload


def _utf8(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
