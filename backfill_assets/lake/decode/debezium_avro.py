"""Debezium change events in Avro through the schema registry (``format: avro``, ``envelope:
debezium``): what Debezium's connector writes through Apicurio's Avro converter
(stack/cdc.py: ``avro_converter``), keys and values in Confluent's wire format (magic byte 0,
the registry's 4-byte schema id, Avro binary).

The value's writer schema is Debezium's ``Envelope`` record (``before`` and ``after``: a union
of null and the table's ``Value`` record, ``source``, ``op``, ``ts_ms``...). Each schema id of a
window is looked up and judged in Python before any Spark expression is built (:func:`judge`),
as for any avro topic: it is read with a *reader schema* (:func:`reader_schema`) holding what
the rows need (``before``/``after`` with the spec's source columns, each nullable, a column the
writer lacks NULL; ``source.lsn``, ``source.ts_ms``, ``op``, ``ts_ms``), which Avro's schema
resolution must accept (``incompatible_schema:<id>`` otherwise). A column is read as the type
Debezium writes it: a string (``decimal(p,s)``: the decimal string of
``decimal.handling.mode=string``; ``timestamp``: a ``ZonedTimestamp`` ISO-8601 text), ``long``
for ``bigint``, ``int``, ``boolean``.

The decoded envelope then becomes a row by :mod:`backfill_assets.lake.decode.debezium`'s rules
(the same row, cdc columns, unavailable TOAST values and quarantine reasons as the JSON
envelope's). A tombstone's key is the Kafka key decoded with its writer schema, which must be a
version of the key subject ``<topic>-key`` (the converter's TopicIdStrategy); otherwise the key
is missing and the tombstone is quarantined ``missing_or_invalid:<key field>``.

:func:`decode_stage` is the replay's Spark side (``from_avro``); :class:`IndependentDecode` the
content check's (confluent-kafka's AvroDeserializer, fastavro), which hands the decoded envelope
to :class:`backfill_assets.lake.decode.debezium.Reference`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backfill_assets.errors import RegistryUnavailable
from backfill_assets.lake.decode import avro, debezium
from backfill_assets.lake.decode.envelope import WIRE_HEADER, schema_id, wire_stage
from backfill_assets.spec.model import ColumnSpec, TopicSpec, decimal_of

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from pyspark.sql import Column, DataFrame

DECODED = avro.DECODED
# The Avro type a column is read as (decimals and timestamps: Debezium's strings).
_AVRO_TYPES = {"string": "string", "bigint": "long", "int": "int", "boolean": "boolean"}
# Spark's type of each read field (before the column's own conversion).
_READ_TYPES = {"string": "string", "long": "bigint", "int": "int", "boolean": "boolean"}


def read_type(column: ColumnSpec) -> str:
    """The Avro type ``column`` is read as."""
    if column.type == "timestamp" or decimal_of(column.type) is not None:
        return "string"
    return _AVRO_TYPES[column.type]


def key_subject(spec: TopicSpec) -> str:
    """The registry subject of the topic's keys (Apicurio's and Confluent's TopicIdStrategy)."""
    return f"{spec.topic}-key"


# ----------------------------------------------------------------------------- schemas


def _record(writer: Any) -> dict[str, Any] | None:
    """The record of a field's type (``["null", record]`` or a record), or None."""
    if isinstance(writer, list):
        found = [t for t in writer if isinstance(t, dict) and t.get("type") == "record"]
        return found[0] if len(found) == 1 else None
    return writer if isinstance(writer, dict) and writer.get("type") == "record" else None


def _named(writer: Mapping[str, Any], fields: list[dict[str, Any]]) -> dict[str, Any]:
    """A record of ``writer``'s name and namespace with ``fields``."""
    out = {"type": "record", "name": writer.get("name", "Record"), "fields": fields}
    if writer.get("namespace"):
        out["namespace"] = writer["namespace"]
    return out


def _nullable(name: str, kind: Any) -> dict[str, Any]:
    return {"name": name, "type": ["null", kind], "default": None}


def reader_schema(spec: TopicSpec, writer: Mapping[str, Any]) -> dict[str, Any] | None:
    """The reader schema of an envelope whose writer schema is ``writer`` (None if it is not
    Debezium's envelope: no ``after`` record)."""
    fields = {f["name"]: f for f in writer.get("fields", []) if isinstance(f, dict)}
    value = _record(fields.get("after", {}).get("type")) or _record(
        fields.get("before", {}).get("type")
    )
    if value is None:
        return None
    source = _record(fields.get("source", {}).get("type")) or {"name": "Source"}
    row = _named(value, [_nullable(c.name, read_type(c)) for c in spec.source_columns])
    full = f"{row['namespace']}.{row['name']}" if "namespace" in row else row["name"]
    position = _named(source, [_nullable("lsn", "long"), _nullable("ts_ms", "long")])
    return _named(
        writer,
        [
            _nullable("before", row),
            _nullable("after", full),
            _nullable("source", position),
            _nullable("op", "string"),
            _nullable("ts_ms", "long"),
            {"name": DECODED, "type": "boolean", "default": True},
        ],
    )


def key_reader(spec: TopicSpec, writer: Mapping[str, Any]) -> dict[str, Any]:
    """The reader schema of a key: the key field, nullable."""
    key = debezium.key_column(spec)
    return _named(writer, [_nullable(key.name, read_type(key))])


def _compatible(reader: Mapping[str, Any], writer_text: str) -> bool:
    import avro.errors
    import avro.schema
    from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType

    try:
        verdict = ReaderWriterCompatibilityChecker().get_compatibility(  # type: ignore[no-untyped-call]
            reader=avro.schema.parse(json.dumps(reader)), writer=avro.schema.parse(writer_text)
        )
    except avro.errors.AvroException:
        return False
    return verdict.compatibility is SchemaCompatibilityType.compatible


def judge(spec: TopicSpec, sid: int, writer_text: str | None, *, key: bool = False) -> avro.Writer:
    """The disposition of a value's (``key``: a key's) schema id ``sid``."""
    if writer_text is None:
        return avro.Writer(sid, reason=f"unknown_schema_id:{sid}")
    incompatible = avro.Writer(sid, writer=writer_text, reason=f"incompatible_schema:{sid}")
    writer = json.loads(writer_text)
    if not isinstance(writer, dict) or writer.get("type") != "record":
        return incompatible
    reader = key_reader(spec, writer) if key else reader_schema(spec, writer)
    if reader is None or not _compatible(reader, writer_text):
        return incompatible
    return avro.Writer(sid, writer=writer_text, reader=json.dumps(reader))


@dataclass(frozen=True)
class Writers:
    """A window's value schema ids judged, and the key subject's versions (for tombstones)."""

    values: dict[int, avro.Writer]
    keys: dict[int, avro.Writer]


def key_versions(registry: SchemaRegistryClient, spec: TopicSpec) -> dict[int, avro.Writer]:
    """Every version of the key subject, judged as a key; {} if there is no such subject."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    subject = key_subject(spec)
    try:
        versions = registry.get_versions(subject)
        found = [registry.get_version(subject, v) for v in versions]
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return {}
        raise RegistryUnavailable(f"schema registry: subject {subject!r}: {exc}") from exc
    except Exception as exc:
        raise RegistryUnavailable(f"schema registry: subject {subject!r}: {exc}") from exc
    out = {}
    for v in found:
        if v.schema_id is not None:
            sid = int(v.schema_id)
            out[sid] = judge(spec, sid, str(v.schema.schema_str), key=True)
    return out


def resolve(
    spec: TopicSpec, url: str, ids: Iterable[int], auth: Mapping[str, str] | None = None
) -> Writers:
    """The value schema ids ``ids`` and the key subject's versions, judged against the
    registry at ``url``."""
    registry = avro.client(url, auth)
    values = {sid: judge(spec, sid, avro.writer_text(registry, sid)) for sid in sorted(set(ids))}
    return Writers(values, key_versions(registry, spec))


# ----------------------------------------------------------------------------- Spark


def _struct(spec: TopicSpec) -> str:
    row = ", ".join(f"`{c.name}`: {_READ_TYPES[read_type(c)]}" for c in spec.source_columns)
    return (
        f"struct<before: struct<{row}>, after: struct<{row}>, "
        f"source: struct<lsn: bigint, ts_ms: bigint>, op: string, ts_ms: bigint, "
        f"`{DECODED}`: boolean>"
    )


def _decoded(column: str, sid: Column, writers: Iterable[avro.Writer], struct: str) -> Column:
    """Column ``column``'s Avro payload decoded by the writer its schema id ``sid`` names
    (NULL for an id without a reader)."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    payload = F.expr(f"substring({column}, {WIRE_HEADER + 1})")
    out: Column | None = None
    for w in writers:
        if w.reader is None or w.writer is None:
            continue
        one = from_avro(payload, w.writer, {"avroSchema": w.reader, "mode": "PERMISSIVE"})
        one = one.cast(struct)
        out = F.when(sid == w.schema_id, one) if out is None else out.when(sid == w.schema_id, one)
    return out if out is not None else F.lit(None).cast(struct)


def _key_id() -> Column:
    from pyspark.sql import functions as F

    key = F.col("kafka_key")
    wire = (F.length(key) >= WIRE_HEADER) & (F.hex(F.substring(key, 1, 1)) == F.lit("00"))
    return F.when(wire, F.conv(F.hex(F.substring(key, 2, 4)), 16, 10).cast("bigint"))


def _typed(text: Column, column: ColumnSpec) -> Column:
    """A read field as the column's type (a decimal or timestamp from Debezium's string)."""
    from pyspark.sql import functions as F

    from backfill_assets.spec.transforms import text_timestamp

    if column.type == "timestamp":
        return text_timestamp(text)
    decimal = decimal_of(column.type)
    if decimal is not None:
        pattern = rf"^{debezium.decimal_text(*decimal)}\z"
        return F.when(text.rlike(pattern), text.try_cast(column.type))
    return text


def _wire(writers: Mapping[int, avro.Writer]) -> Column:
    """A value's wire-format reason (NULL once decoded)."""
    from pyspark.sql import functions as F

    sid = F.col("_sid")
    wire: Column = F.when(sid.isNull(), F.lit("not_avro_wire_format"))
    wire = wire.when(
        ~sid.isin(list(writers)), F.concat(F.lit("unknown_schema_id:"), sid.cast("string"))
    )
    for w in writers.values():
        if w.reason is not None:
            wire = wire.when(sid == w.schema_id, F.lit(w.reason))
    failed = F.col("_e").isNull() | F.col("_e").getField(DECODED).isNull()
    return wire.when(failed, F.concat(F.lit("invalid_avro:"), sid.cast("string")))


def decode_stage(spec: TopicSpec, raw: DataFrame, writers: Writers) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, ``schema_version`` (the value's schema id), the spec's columns and
    what :func:`rules` reads (``_wire``, ``_op``, ``_has_after``, ``_has_before``); and the names
    of the Kafka columns."""
    from pyspark.sql import functions as F

    key = debezium.key_column(spec)
    df, kafka_cols = wire_stage(raw)
    key_struct = f"struct<`{key.name}`: {_READ_TYPES[read_type(key)]}>"
    tombstone_key = _decoded("kafka_key", _key_id(), writers.keys.values(), key_struct)
    df = df.select(
        *kafka_cols,
        "_sid",
        _decoded("kafka_value", F.col("_sid"), writers.values.values(), _struct(spec))
        .alias("_e"),
        F.when(F.col("is_tombstone"), tombstone_key).alias("_k"),
    )  # fmt: skip
    e = F.col("_e")
    before, after = e.getField("before"), e.getField("after")
    read = {
        "_op": e.getField("op"),
        "_lsn": e.getField("source").getField("lsn"),
        "_ts_ms": e.getField("ts_ms"),
        "_source_ms": e.getField("source").getField("ts_ms"),
        "_before_key": _typed(before.getField(key.name), key),
        "_tombstone_key": _typed(F.col("_k").getField(key.name), key),
    }
    for c in spec.source_columns:
        read[f"_a_{c.name}"] = _typed(after.getField(c.name), c)
        if debezium.toastable(c):
            placeholder = after.getField(c.name) == F.lit(debezium.PLACEHOLDER)
            read[f"_t_{c.name}"] = F.coalesce(placeholder, F.lit(False))
    df = df.select(
        *kafka_cols,
        F.col("_sid").cast("int").alias("_version"),
        _wire(writers.values).alias("_wire"),
        *[expr.alias(name) for name, expr in read.items()],
        (after.getField(key.name).isNotNull()).alias("_has_after"),
        (before.getField(key.name).isNotNull()).alias("_has_before"),
    )
    rows = debezium.rows(spec, df, kafka_cols, F.col("_version"), ["_wire"])
    return rows, kafka_cols


def rules() -> list[tuple[Column, Column]]:
    """A value's reasons (conditions over :func:`decode_stage`'s frame), first match wins: the
    wire format's, then :data:`backfill_assets.lake.decode.debezium.REASONS`."""
    from pyspark.sql import functions as F

    return [(F.col("_wire").isNotNull(), F.col("_wire")), *debezium.envelope_rules()]


# ----------------------------------------------------------------------------- Python


class IndependentDecode:
    """The content check's decode of an Avro envelope: confluent-kafka's AvroDeserializer
    (fastavro, its own registry client) with the same reader schema, nothing of Spark's. A value
    becomes the envelope as a dict (what :class:`~backfill_assets.lake.decode.debezium.
    Reference` reads), or the quarantine reason; a tombstone's key its key field, or None."""

    def __init__(self, spec: TopicSpec, url: str, auth: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.url = url
        self.auth = dict(auth or {})
        self.key = debezium.key_column(spec)
        self._registry: SchemaRegistryClient | None = None
        self._by_id: dict[int, Any] = {}
        self._keys: dict[int, Any] | None = None

    def __call__(self, value: bytes) -> dict[str, Any] | str:
        sid = schema_id(value)
        if sid is None:
            return "not_avro_wire_format"
        decode = self._by_id.get(sid)
        if decode is None:
            decode = self._by_id[sid] = self._deserializer(sid)
        if isinstance(decode, str):
            return decode
        try:
            record = decode(value, None)
        except Exception:
            return f"invalid_avro:{sid}"
        if not isinstance(record, dict):
            return f"invalid_avro:{sid}"
        record.pop(DECODED, None)
        return record

    def tombstone_key(self, key: bytes | None) -> Any:
        """The key field of a tombstone's Kafka key, as the column's type; None if the key is
        not a version of the key subject or does not decode."""
        sid = schema_id(key)
        if sid is None or key is None:
            return None
        if self._keys is None:
            self._keys = {}
            for found, writer in key_versions(self._client(), self.spec).items():
                self._keys[found] = writer.reason or self._avro(writer.reader)
        decode = self._keys.get(sid)
        if decode is None or isinstance(decode, str):
            return None
        try:
            record = decode(key, None)
        except Exception:
            return None
        document = record if isinstance(record, dict) else {}
        return debezium.Reference.typed(document, self.key.name, self.key.type)

    def _client(self) -> SchemaRegistryClient:
        if self._registry is None:
            self._registry = avro.client(self.url, self.auth)
        return self._registry

    def _avro(self, reader: str | None) -> Any:
        from confluent_kafka.schema_registry.avro import AvroDeserializer

        return AvroDeserializer(self._client(), schema_str=reader)

    def _deserializer(self, sid: int) -> Any:
        verdict = judge(self.spec, sid, avro.writer_text(self._client(), sid))
        return verdict.reason if verdict.reason is not None else self._avro(verdict.reader)
