"""Protobuf topics: Confluent's wire format, decoded with each record's writer schema.

A value is magic byte 0, the registry's schema id (4 bytes, big-endian), the *message-index
path* (zig-zag varints: a count, then the index of the message at each nesting level; a single
0 means the file's first message), then the protobuf payload. Every id present in a window is
looked up in the schema registry once per run as a serialized ``FileDescriptorProto``
(``format=serialized``), and judged here in Python before any Spark expression is built
(:func:`judge`):

* the registry has no such id: its records are quarantined ``unknown_schema_id:<id>``;
* the id's schema is not a Protobuf one, imports a file other than the well-known
  ``google/protobuf/timestamp.proto`` (not supported yet), has no message
  of the spec's name (``message``; default: the file's first), or has a field named as a column
  whose type cannot be read as the column without loss (:data:`READABLE`; repeated and message
  fields never can): ``incompatible_schema:<id>``, never coerced;
* a schema held as ``.proto`` text is compiled by protoc first (grpcio-tools' wheel);
* otherwise its records are decoded on the JVM by the project's ``ProtobufRow`` function
  (protobuf-java's ``DynamicMessage``; ``stack/java``). A record whose index path names another
  message is quarantined ``incompatible_schema:<id>``, one whose bytes do not parse
  ``invalid_protobuf:<id>``.

Protobuf resolves versions by field *name* here, as the columns are named: a field the writer
schema lacks is NULL; a field that tracks presence (``optional``, proto2) and is unset is NULL;
an unset proto3 scalar without presence is its zero value, which is what protobuf says it is.
int32 widens to bigint and float to double. A timestamp column reads a
``google.protobuf.Timestamp`` or an int64 of epoch milliseconds.

The raw table's ``schema_version`` holds the registry's schema id of the record's writer schema.
The decoded_content check's own decode (:class:`IndependentDecode`) uses confluent-kafka's
``ProtobufDeserializer`` and Python's protobuf runtime, nothing of the JVM decoder.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.decode import avro
from backfill_assets.lake.decode.envelope import WIRE_HEADER, schema_id, wire_stage
from backfill_assets.spec import proto
from backfill_assets.spec.model import TopicSpec

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from google.protobuf.descriptor_pb2 import FileDescriptorProto
    from pyspark.sql import Column, DataFrame, SparkSession

NOT_WIRE = "not_protobuf_wire_format"
PROTOBUF_ROW_CLASS = "backfill_assets.udf.ProtobufRow"
# FieldDescriptorProto.Type numbers: 1 double, 2 float, 3 int64, 5 int32, 8 bool, 9 string,
# 15 sfixed32, 16 sfixed64, 17 sint32, 18 sint64. Unsigned types are left out: protobuf-java
# hands them over as signed numbers.
READABLE: dict[str, frozenset[int]] = {
    "string": frozenset({9}),
    "bigint": frozenset({3, 5, 15, 16, 17, 18}),
    "int": frozenset({5, 15, 17}),
    "double": frozenset({1, 2}),
    "boolean": frozenset({8}),
    "timestamp": frozenset({3, 16, 18}),  # epoch milliseconds (or a Timestamp message)
}
TIMESTAMP_TYPE, TIMESTAMP_FILE = proto.TIMESTAMP_TYPE, proto.TIMESTAMP_FILE
_REPEATED = 3  # FieldDescriptorProto.Label
_STATUS = {1: "incompatible_schema", 2: "invalid_protobuf"}  # ProtobufRow's status


@dataclass(frozen=True)
class Writer:
    """One schema id of a window: its writer schema (a base64 ``FileDescriptorProto``), the full
    name and index path of the message read, or the reason its records are quarantined."""

    schema_id: int
    descriptor: str | None = None
    message: str | None = None
    path: tuple[int, ...] = ()
    reason: str | None = None


def judge(spec: TopicSpec, sid: int, found: tuple[str, str] | None) -> Writer:
    """The disposition of schema id ``sid`` whose (type, serialized schema) the registry gave
    (None: the registry has no such id)."""
    if found is None:
        return Writer(sid, reason=f"unknown_schema_id:{sid}")
    incompatible = Writer(sid, reason=f"incompatible_schema:{sid}")
    file = _file(found)
    chosen = None if file is None else proto.chosen(file, spec.message)
    if file is None or chosen is None:
        return incompatible
    name, path, msg = chosen
    fields = {f.name: f for f in msg.field}
    for col in spec.columns:
        field = fields.get(col.name)
        if field is None:
            continue
        stamp = col.type == "timestamp" and field.type_name == TIMESTAMP_TYPE
        if field.label == _REPEATED or (field.type not in READABLE[col.type] and not stamp):
            return incompatible
    descriptor = base64.b64encode(file.SerializeToString()).decode()
    return Writer(sid, descriptor=descriptor, message=name, path=path)


def _file(found: tuple[str, str]) -> FileDescriptorProto | None:
    """The writer schema of a registry answer (:func:`backfill_assets.spec.proto.descriptor`), if
    it is a Protobuf file that imports nothing but the well-known Timestamp."""
    if found[0] != "PROTOBUF":
        return None
    file = proto.descriptor(found[1])
    if file is None or set(file.dependency) - {TIMESTAMP_FILE} or not file.message_type:
        return None
    return file


def resolve(
    spec: TopicSpec, url: str, ids: Iterable[int], auth: Mapping[str, str] | None = None
) -> dict[int, Writer]:
    """Every schema id of ``ids`` judged (:func:`judge`) against the registry at ``url``."""
    registry = avro.client(url, auth)
    return {
        sid: judge(spec, sid, avro.lookup(registry, sid, serialized=True))
        for sid in sorted(set(ids))
    }


def _request(spec: TopicSpec, message: str) -> str:
    """ProtobufRow's request: the message's full name, then ``<field>\\t<kind>`` per column."""
    return "\n".join([message, *(f"{c.name}\t{c.type}" for c in spec.columns)])


def _struct(spec: TopicSpec) -> str:
    """ProtobufRow's result type: its status, then each column (a timestamp as epoch micros)."""
    kinds = ["bigint" if c.type == "timestamp" else c.type for c in spec.columns]
    return "struct<status: int" + "".join(f", c{i}: {k}" for i, k in enumerate(kinds)) + ">"


def _row_function(spark: SparkSession, spec: TopicSpec) -> str:
    """The name ProtobufRow is registered under for the spec's column types (the name says
    what it returns)."""
    from pyspark.sql.types import _parse_datatype_string

    struct = _struct(spec)
    name = "backfill_protobuf_row_" + hashlib.sha256(struct.encode()).hexdigest()[:16]
    if not spark.catalog.functionExists(name):
        spark.udf.registerJavaFunction(name, PROTOBUF_ROW_CLASS, _parse_datatype_string(struct))
    return name


def decode_stage(
    spec: TopicSpec, raw: DataFrame, writers: Mapping[int, Writer]
) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, ``schema_version`` (the schema id), ``_wire`` (the wire-format reason,
    NULL for a decoded record) and the spec's columns; and the names of the Kafka columns."""
    from pyspark.sql import functions as F

    df, kafka_cols = wire_stage(raw)
    sid = F.col("_sid")
    decoded: Column | None = None
    readable = [w for w in writers.values() if w.descriptor is not None and w.message]
    if readable:
        function = _row_function(raw.sparkSession, spec)
        for w in readable:
            assert w.descriptor is not None and w.message is not None
            one = F.call_function(
                function,
                F.col("kafka_value"),
                F.lit(w.descriptor),
                F.lit(_request(spec, w.message)),
            )
            decoded = (
                F.when(sid == w.schema_id, one)
                if decoded is None
                else decoded.when(sid == w.schema_id, one)
            )
    empty = _struct(spec)
    df = df.select(
        *kafka_cols,
        "_sid",
        (decoded if decoded is not None else F.lit(None).cast(empty)).alias("_p"),
    )
    wire: Column = F.when(sid.isNull(), F.lit(NOT_WIRE))
    wire = wire.when(
        ~sid.isin(list(writers)), F.concat(F.lit("unknown_schema_id:"), sid.cast("string"))
    )
    for w in writers.values():
        if w.reason is not None:
            wire = wire.when(sid == w.schema_id, F.lit(w.reason))
    status = F.col("_p").getField("status")
    for code, reason in _STATUS.items():
        wire = wire.when(status == code, F.concat(F.lit(f"{reason}:"), sid.cast("string")))
    wire = wire.when(status.isNull(), F.concat(F.lit("invalid_protobuf:"), sid.cast("string")))
    columns = []
    for i, c in enumerate(spec.columns):
        value = F.col("_p").getField(f"c{i}")
        columns.append(
            (F.timestamp_micros(value) if c.type == "timestamp" else value).alias(c.name)
        )
    df = df.select(
        *kafka_cols, sid.cast("int").alias("schema_version"), wire.alias("_wire"), *columns
    )
    return df, kafka_cols


def message_path(value: bytes) -> tuple[tuple[int, ...], int] | None:
    """The message-index path after the header of ``value`` and where the payload starts; None
    if the bytes end inside it."""
    pos = WIRE_HEADER

    def varint() -> int | None:
        nonlocal pos
        shift = result = 0
        while pos < len(value) and shift < 64:
            byte = value[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1)  # zig-zag
            shift += 7
        return None

    count = varint()
    if count is None or count < 0 or count > 64:
        return None
    if count == 0:
        return (0,), pos
    path = []
    for _ in range(count):
        index = varint()
        if index is None:
            return None
        path.append(index)
    return tuple(path), pos


class IndependentDecode:
    """The decoded_content check's own decode of a protobuf value
    (:class:`backfill_assets.lake.decode.content.RecordDecoder`): confluent-kafka's
    ``ProtobufDeserializer`` (Python's protobuf runtime, its own registry client) with a message
    class built from the registry's writer schema of each id. Returns the typed row (a timestamp
    as epoch microseconds) or the quarantine reason; nothing of the JVM decoder is used."""

    def __init__(self, spec: TopicSpec, url: str, auth: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.url = url
        self.auth = dict(auth or {})
        self.stamps = {c.name for c in spec.columns if c.type == "timestamp"}
        self._registry: SchemaRegistryClient | None = None
        self._by_id: dict[int, tuple[Writer, Any, Any] | str] = {}

    def __call__(self, value: bytes) -> dict[str, Any] | str:
        sid = schema_id(value)
        if sid is None:
            return NOT_WIRE
        known = self._by_id.get(sid)
        if known is None:
            known = self._by_id[sid] = self._deserializer(sid)
        if isinstance(known, str):
            return known
        writer, deserialize, fields = known
        found = message_path(value)
        if found is None:
            return f"invalid_protobuf:{sid}"
        if found[0] != writer.path:
            return f"incompatible_schema:{sid}"
        try:
            msg = deserialize(value, None)
        except Exception:
            return f"invalid_protobuf:{sid}"
        row: dict[str, Any] = {}
        for name, field in fields.items():
            if field is None or (field.has_presence and not msg.HasField(name)):
                row[name] = None
            else:
                value_ = getattr(msg, name)
                row[name] = _micros(value_) if name in self.stamps else value_
        return row

    def _deserializer(self, sid: int) -> tuple[Writer, Any, Any] | str:
        from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
        from google.protobuf import descriptor_pool, message_factory, timestamp_pb2
        from google.protobuf.descriptor_pb2 import FileDescriptorProto

        if self._registry is None:
            self._registry = avro.client(self.url, self.auth)
        writer = judge(self.spec, sid, avro.lookup(self._registry, sid, serialized=True))
        if writer.reason is not None:
            return writer.reason
        assert writer.descriptor is not None and writer.message is not None
        pool = descriptor_pool.DescriptorPool()
        pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
        pool.Add(FileDescriptorProto.FromString(base64.b64decode(writer.descriptor)))
        message = pool.FindMessageTypeByName(writer.message)
        cls = message_factory.GetMessageClass(message)
        fields = {c.name: message.fields_by_name.get(c.name) for c in self.spec.columns}
        # No registry client: the writer schema is already known, and the deserializer would
        # fetch it again as a serialized descriptor, which not every registry gives.
        return writer, ProtobufDeserializer(cls, {}, None), fields


_LONG = (-(2**63), 2**63 - 1)


def _micros(value: Any) -> int | None:
    """Epoch microseconds of an int64 of epoch milliseconds or a Timestamp message, as
    ProtobufRow gives them (None if they do not fit a long)."""
    micros = (
        value * 1000 if isinstance(value, int) else value.seconds * 1_000_000 + value.nanos // 1000
    )
    return micros if _LONG[0] <= micros <= _LONG[1] else None
