"""Avro topics: Confluent's wire format, decoded with each record's writer schema.

A value is magic byte 0, the registry's schema id (4 bytes, big-endian), then Avro binary.
Every id present in a window is looked up in the schema registry
(``BACKFILL_SCHEMA_REGISTRY_URL``) once per run, and judged here in Python before any Spark
expression is built (:func:`resolve`):

* the registry has no such id: its records are quarantined ``unknown_schema_id:<id>``;
* the writer schema cannot be resolved to the *reader schema* (:func:`reader_schema`: the
  spec's columns, each nullable, with the default the subject's latest schema gives the field,
  else NULL), as Avro's schema resolution rules say (checked with the ``avro`` package's
  compatibility checker): ``incompatible_schema:<id>``, never coerced;
* otherwise its records are decoded by Spark's ``from_avro(payload, writer, {"avroSchema":
  reader})`` (spark-avro builds ``GenericDatumReader(writer, reader)``: the function's schema is
  the writer's, the option's the reader's), so an added field takes its default, a removed
  optional field is NULL and an int is widened to long.

The raw table's ``schema_version`` holds the registry's schema id of the record's writer schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from backfill_assets.errors import RegistryUnavailable
from backfill_assets.lake.decode.envelope import WIRE_HEADER, schema_id, wire_stage
from backfill_assets.spec.model import SPARK_TYPES, TopicSpec

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from pyspark.sql import Column, DataFrame

# A field only the reader schema has, defaulting to true: Spark's PERMISSIVE from_avro returns
# a struct of NULLs (not a NULL struct) for bytes that do not decode, so this field being NULL
# is what says the decode failed.
DECODED = "__backfill_decoded"
_AVRO_TYPES = {
    "string": "string",
    "bigint": "long",
    "int": "int",
    "double": "double",
    "boolean": "boolean",
}
_TIMESTAMPS = ("timestamp-millis", "timestamp-micros")


@dataclass(frozen=True)
class Writer:
    """One schema id of a window: its writer schema and the reader schema it resolves to
    (JSON texts), or the reason its records are quarantined."""

    schema_id: int
    writer: str | None = None
    reader: str | None = None
    reason: str | None = None


def client(url: str, auth: Mapping[str, str] | None = None) -> SchemaRegistryClient:
    """A registry client for ``url`` with the credentials ``auth`` (``Settings.
    schema_registry_auth``: basic or bearer settings of the client; None: none)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    return SchemaRegistryClient({"url": url, **(auth or {})})


def latest_fields(registry: SchemaRegistryClient, subject: str) -> dict[str, dict[str, Any]]:
    """The fields of the subject's latest schema by name ({} if the subject has none)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        latest = registry.get_latest_version(subject)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return {}
        raise RegistryUnavailable(f"schema registry: subject {subject!r}: {exc}") from exc
    except Exception as exc:
        raise RegistryUnavailable(f"schema registry: subject {subject!r}: {exc}") from exc
    parsed = json.loads(str(latest.schema.schema_str))
    if not isinstance(parsed, dict):
        return {}
    return {f["name"]: f for f in parsed.get("fields", [])}


def _field_type(field: Mapping[str, Any] | None) -> Any:
    """A field's type with a ``["null", T]`` union reduced to T."""
    if field is None:
        return None
    kind = field.get("type")
    if isinstance(kind, list):
        rest = [k for k in kind if k != "null"]
        kind = rest[0] if len(rest) == 1 else kind
    return kind


def reader_schema(
    spec: TopicSpec, writer: Mapping[str, Any], latest: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The reader schema for ``writer``: a record of the writer's name with the spec's columns,
    every one nullable, defaulting to the latest schema's default for the field (else NULL). A
    timestamp column reads the writer's timestamp-millis/-micros long (millis if it has none).
    Last, the DECODED marker (true once decoded)."""
    writer_fields = {f["name"]: f for f in writer.get("fields", [])}
    fields: list[dict[str, Any]] = []
    for col in spec.columns:
        if col.type == "timestamp":
            kind = _field_type(writer_fields.get(col.name))
            logical = kind.get("logicalType") if isinstance(kind, dict) else None
            avro_type: Any = {
                "type": "long",
                "logicalType": logical if logical in _TIMESTAMPS else "timestamp-millis",
            }
        else:
            avro_type = _AVRO_TYPES[col.type]
        default = (latest.get(col.name) or {}).get("default")
        if default is None:
            fields.append({"name": col.name, "type": ["null", avro_type], "default": None})
        else:
            fields.append({"name": col.name, "type": [avro_type, "null"], "default": default})
    fields.append({"name": DECODED, "type": "boolean", "default": True})
    out = {"type": "record", "name": writer.get("name", "Record"), "fields": fields}
    if writer.get("namespace"):
        out["namespace"] = writer["namespace"]
    return out


def judge(spec: TopicSpec, sid: int, writer_text: str | None, latest: Any) -> Writer:
    """The disposition of schema id ``sid`` whose writer schema is ``writer_text`` (None: the
    registry has no such id)."""
    import avro.schema
    from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType

    if writer_text is None:
        return Writer(sid, reason=f"unknown_schema_id:{sid}")
    incompatible = Writer(sid, writer=writer_text, reason=f"incompatible_schema:{sid}")
    writer = json.loads(writer_text)
    if not isinstance(writer, dict) or writer.get("type") != "record":
        return incompatible
    reader = json.dumps(reader_schema(spec, writer, latest))
    try:
        verdict = ReaderWriterCompatibilityChecker().get_compatibility(  # type: ignore[no-untyped-call]
            reader=avro.schema.parse(reader), writer=avro.schema.parse(writer_text)
        )
    except avro.errors.AvroException:
        return incompatible
    if verdict.compatibility is not SchemaCompatibilityType.compatible:
        return incompatible
    return Writer(sid, writer=writer_text, reader=reader)


def lookup(
    registry: SchemaRegistryClient, sid: int, *, serialized: bool = False
) -> tuple[str, str] | None:
    """The schema type (``AVRO``, ``JSON``, ``PROTOBUF``) and text of ``sid`` (None if the
    registry has no such id); with ``serialized``, the registry's serialized form instead of the
    text (a base64 ``FileDescriptorProto`` for Protobuf). A registry that does not answer raises
    :class:`RegistryUnavailable`."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        schema = registry.get_schema(sid, fmt="serialized" if serialized else None)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            return None
        raise RegistryUnavailable(f"schema registry: schema id {sid}: {exc}") from exc
    except Exception as exc:
        raise RegistryUnavailable(f"schema registry: schema id {sid}: {exc}") from exc
    return str(schema.schema_type or "AVRO"), str(schema.schema_str)


def writer_text(registry: SchemaRegistryClient, sid: int) -> str | None:
    """The writer schema of ``sid`` (None if the registry has no such id); a registry that does
    not answer raises :class:`RegistryUnavailable`."""
    found = lookup(registry, sid)
    if found is None:
        return None
    if found[0] != "AVRO":
        return json.dumps({"type": "not-avro"})  # judged incompatible
    return found[1]


def resolve(
    spec: TopicSpec, url: str, ids: Iterable[int], auth: Mapping[str, str] | None = None
) -> dict[int, Writer]:
    """Every schema id of ``ids`` judged (:func:`judge`) against the registry at ``url``."""
    registry = client(url, auth)
    assert spec.subject is not None
    latest = latest_fields(registry, spec.subject)
    return {sid: judge(spec, sid, writer_text(registry, sid), latest) for sid in sorted(set(ids))}


def decode_stage(
    spec: TopicSpec, raw: DataFrame, writers: Mapping[int, Writer]
) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, ``schema_version`` (the schema id), ``_wire`` (the wire-format reason,
    NULL for a decoded record) and the spec's columns; and the names of the Kafka columns."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    types = [f"`{c.name}`: {SPARK_TYPES[c.type]}" for c in spec.columns]
    struct = "struct<" + ", ".join([*types, f"`{DECODED}`: boolean"]) + ">"
    sid = F.col("_sid")
    payload = F.expr(f"substring(kafka_value, {WIRE_HEADER + 1})")
    decoded: Column | None = None
    for w in writers.values():
        if w.reader is None or w.writer is None:
            continue
        options = {"avroSchema": w.reader, "mode": "PERMISSIVE"}
        one = from_avro(payload, w.writer, options).cast(struct)
        decoded = (
            F.when(sid == w.schema_id, one)
            if decoded is None
            else decoded.when(sid == w.schema_id, one)
        )
    df, kafka_cols = wire_stage(raw)
    df = df.select(
        *kafka_cols,
        "_sid",
        (decoded if decoded is not None else F.lit(None).cast(struct)).alias("_a"),
    )
    wire: Column = F.when(sid.isNull(), F.lit("not_avro_wire_format"))
    wire = wire.when(
        ~sid.isin(list(writers)), F.concat(F.lit("unknown_schema_id:"), sid.cast("string"))
    )
    for w in writers.values():
        if w.reason is not None:
            wire = wire.when(sid == w.schema_id, F.lit(w.reason))
    failed = F.col("_a").isNull() | F.col("_a").getField(DECODED).isNull()
    wire = wire.when(failed, F.concat(F.lit("invalid_avro:"), sid.cast("string")))
    df = df.select(
        *kafka_cols,
        sid.cast("int").alias("schema_version"),
        wire.alias("_wire"),
        *[F.col("_a").getField(c.name).alias(c.name) for c in spec.columns],
    )
    return df, kafka_cols


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class IndependentDecode:
    """The decoded_content check's own decode of an avro value
    (:class:`backfill_assets.lake.decode.content.RecordDecoder`): confluent-kafka's AvroDeserializer
    (fastavro, with its own registry client) reads each record with its writer schema resolved
    to the same reader schema; nothing of Spark's decoder is used. Returns the typed row (a
    timestamp as epoch microseconds) or the quarantine reason.

    The deserializer is called without a serialization context, as Spark's ``from_avro`` reads
    a value: the schema id from the 5-byte prefix, Avro resolution, nothing else. With one it
    would also look up and run the subject's data-contract rules on every record (a third of
    the decode's CPU here), which the replay does not run either."""

    def __init__(self, spec: TopicSpec, url: str, auth: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.url = url
        self.auth = dict(auth or {})
        self.names = [c.name for c in spec.columns]
        self.stamps = [c.name for c in spec.columns if c.type == "timestamp"]
        self._registry: SchemaRegistryClient | None = None
        self._latest: dict[str, dict[str, Any]] | None = None
        self._by_id: dict[int, Any] = {}

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
        row = {name: record.get(name) for name in self.names}
        for name in self.stamps:
            row[name] = _micros(row[name])
        return row

    def _deserializer(self, sid: int) -> Any:
        from confluent_kafka.schema_registry.avro import AvroDeserializer

        if self._registry is None:
            self._registry = client(self.url, self.auth)
            assert self.spec.subject is not None
            self._latest = latest_fields(self._registry, self.spec.subject)
        verdict = judge(self.spec, sid, writer_text(self._registry, sid), self._latest or {})
        if verdict.reason is not None:
            return verdict.reason
        return AvroDeserializer(self._registry, schema_str=verdict.reader)


def _micros(value: Any) -> Any:
    """A decoded timestamp as epoch microseconds (fastavro gives a datetime)."""
    if isinstance(value, datetime):
        moment = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return (moment - _EPOCH) // timedelta(microseconds=1)
    return value
