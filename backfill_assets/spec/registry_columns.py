"""A registry topic's columns derived from its subject's latest schema.

A topic whose ``format`` is ``avro``, ``json_schema`` or ``protobuf`` may leave ``columns`` out
of topics.yaml: :func:`backfill_assets.spec.loader.load_specs` then asks the schema registry for
the subject's latest schema and reads its fields as columns (:func:`derive_columns`), each as
topics.yaml would declare it (``{name, type, nullable}``). Declared columns are used as they are
and the registry is not asked: declaring them pins them (``backfill-assets columns --topic X``
prints the derived ones as a block to paste).

* Avro (a record): ``string`` string, ``int`` int, ``long`` bigint, ``float``/``double``
  double, ``boolean`` boolean, a ``long`` with logicalType ``timestamp-millis``/``-micros``
  timestamp; nullable when its type is a ``["null", T]`` union (or its default is null).
* Protobuf (the spec's ``message``, else the file's first): string string, int32/sint32/
  sfixed32 int, int64/sint64/sfixed64 bigint, double/float double, bool boolean; every column
  nullable. A protobuf timestamp (an int64 of epoch milliseconds) derives as bigint: declare
  the columns to read it as a timestamp.
* JSON Schema (an object's ``properties``): string string (``format: date-time`` timestamp),
  integer bigint, number double, boolean boolean; nullable unless listed in ``required`` (or
  ``null`` is one of its types).

Any other field (arrays, maps, nested records or messages, enums, bytes, unions of two non-null
types, a Protobuf file importing others...) is an error naming the subject and the field: declare
the columns wanted instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backfill_assets.errors import ColumnsError, RegistryUnavailable, SettingsError
from backfill_assets.spec import proto

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import RegisteredSchema

# The schema type the registry gives each format's subjects (None: Avro, the registry default).
SCHEMA_TYPES = {"avro": "AVRO", "json_schema": "JSON", "protobuf": "PROTOBUF"}
PIN = "declare `columns` in topics.yaml to pin the ones wanted"
_AVRO = {"string": "string", "int": "int", "long": "bigint", "float": "double"}
_AVRO |= {"double": "double", "boolean": "boolean"}
_AVRO_TIMESTAMPS = ("timestamp-millis", "timestamp-micros")
# FieldDescriptorProto.Type numbers (backfill_assets.lake.decode.protobuf.READABLE reads each as the
# column type given here): unsigned, bytes, enum and message fields are not columns.
_PROTOBUF = {9: "string", 5: "int", 17: "int", 15: "int", 3: "bigint", 18: "bigint"}
_PROTOBUF |= {16: "bigint", 1: "double", 2: "double", 8: "boolean"}
_PROTOBUF_NAMES = {
    4: "uint64",
    6: "fixed64",
    7: "fixed32",
    10: "group",
    11: "a message",
    12: "bytes",
    13: "uint32",
    14: "an enum",
}
_REPEATED = 3  # FieldDescriptorProto.Label
_JSON = {"string": "string", "integer": "bigint", "number": "double", "boolean": "boolean"}


@dataclass(frozen=True)
class Derived:
    """The columns a subject's latest schema gives, and the fields that cannot be columns
    (name, why)."""

    subject: str
    version: int | None
    columns: list[dict[str, Any]]
    unsupported: list[tuple[str, str]]

    def problem(self) -> str | None:
        """The error for the unsupported fields, or None if there are none."""
        if not self.unsupported:
            return None
        fields = "; ".join(f"field {name!r} {why}" for name, why in self.unsupported)
        return f"subject {self.subject!r}: {fields}: {PIN}"


def derive_columns(
    format: str,
    subject: str,
    url: str,
    message: str | None = None,
    auth: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The columns of ``subject``'s latest schema in the registry at ``url``, as topics.yaml
    holds them; :class:`ColumnsError` if a field cannot be a column or the subject is not there,
    :class:`~backfill_assets.errors.RegistryUnavailable` if the registry does not answer."""
    derived = read_columns(format, subject, url, message, auth)
    problem = derived.problem()
    if problem is not None:
        raise ColumnsError(problem)
    return derived.columns


def read_columns(
    format: str,
    subject: str,
    url: str,
    message: str | None = None,
    auth: Mapping[str, str] | None = None,
) -> Derived:
    """The columns of ``subject``'s latest schema and the fields that cannot be columns;
    ``auth``: the registry's credentials (``Settings.schema_registry_auth``)."""
    if format not in SCHEMA_TYPES:
        raise ColumnsError(
            f"format {format!r} names no schema registry subject: only "
            f"{', '.join(SCHEMA_TYPES)} topics derive their columns; declare `columns`"
        )
    latest = _latest(subject, url, auth, serialized=format == "protobuf")
    kind = str(latest.schema.schema_type or "AVRO")
    if kind != SCHEMA_TYPES[format]:
        raise ColumnsError(
            f"subject {subject!r}: its latest schema is {kind}, not {SCHEMA_TYPES[format]} as "
            f"format {format!r} reads"
        )
    text = str(latest.schema.schema_str)
    version = latest.version
    if format == "avro":
        columns, unsupported = _avro(subject, text)
    elif format == "json_schema":
        columns, unsupported = _json_schema(subject, text)
    else:
        columns, unsupported = _protobuf(subject, text, message)
    return Derived(subject, version, columns, unsupported)


def _latest(
    subject: str, url: str, auth: Mapping[str, str] | None, *, serialized: bool
) -> RegisteredSchema:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    conf = {"url": url, "timeout": 10, "max.retries": 1, **(auth or {})}
    registry = SchemaRegistryClient(conf)
    try:
        return registry.get_latest_version(subject, fmt="serialized" if serialized else None)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            raise ColumnsError(
                f"subject {subject!r} is not in the schema registry at {url}: register its "
                f"schema first (or set `subject`), or declare `columns` in topics.yaml"
            ) from None
        if exc.http_status_code in (401, 403):
            raise refused(url, exc.http_status_code) from None
        reason = f"{exc.http_status_code} {exc.error_message}"
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    raise RegistryUnavailable(
        f"the schema registry at {url} did not answer for subject {subject!r} ({reason}): "
        "start it with `backfill-assets stack up` (or set BACKFILL_SCHEMA_REGISTRY_URL), or "
        "declare `columns` in topics.yaml to pin them so loading needs no registry"
    ) from None


def _column(name: str, kind: str, nullable: bool) -> dict[str, Any]:
    return {"name": name, "type": kind, "nullable": nullable}


Fields = tuple[list[dict[str, Any]], list[tuple[str, str]]]


def _avro(subject: str, text: str) -> Fields:
    try:
        schema = json.loads(text)
    except ValueError:
        schema = None
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise ColumnsError(f"subject {subject!r}: its latest Avro schema is not a record: {PIN}")
    columns, unsupported = [], []
    for field in schema.get("fields", []):
        name, kind = str(field.get("name")), field.get("type")
        nullable = "default" in field and field["default"] is None
        if isinstance(kind, list):
            rest = [k for k in kind if k != "null"]
            nullable = nullable or len(rest) < len(kind)
            if len(rest) != 1:
                unsupported.append((name, f"is a union of {len(rest)} non-null types"))
                continue
            kind = rest[0]
        column_type = _avro_type(kind)
        if column_type is None:
            unsupported.append((name, f"has type {json.dumps(kind)}, which is not a column type"))
        else:
            columns.append(_column(name, column_type, nullable))
    return columns, unsupported


def _avro_type(kind: Any) -> str | None:
    if isinstance(kind, str):
        return _AVRO.get(kind)
    if isinstance(kind, Mapping) and isinstance(kind.get("type"), str):
        logical = kind.get("logicalType")
        if logical is None:
            return _AVRO.get(kind["type"])
        if kind["type"] == "long" and logical in _AVRO_TIMESTAMPS:
            return "timestamp"
        if kind["type"] == "string" and logical == "uuid":
            return "string"
    return None


def _json_schema(subject: str, text: str) -> Fields:
    try:
        schema = json.loads(text)
    except ValueError:
        schema = None
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        raise ColumnsError(
            f"subject {subject!r}: its latest JSON Schema is not an object with `properties`: {PIN}"
        )
    required = set(schema.get("required") or ())
    columns, unsupported = [], []
    for name, prop in schema["properties"].items():
        kinds = prop.get("type") if isinstance(prop, dict) else None
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds:
            what = json.dumps(prop)
            unsupported.append((name, f"has no single type ({what[:80]}), so it is not a column"))
            continue
        rest = [k for k in kinds if k != "null"]
        nullable = name not in required or len(rest) < len(kinds)
        if len(rest) != 1 or rest[0] not in _JSON:
            unsupported.append((name, f"has type {json.dumps(kinds)}, which is not a column type"))
            continue
        column_type = _JSON[rest[0]]
        if rest[0] == "string" and prop.get("format") == "date-time":
            column_type = "timestamp"
        columns.append(_column(name, column_type, nullable))
    return columns, unsupported


def _protobuf(subject: str, text: str, message: str | None) -> Fields:
    file = proto.descriptor(text)
    if file is None:
        raise ColumnsError(
            f"subject {subject!r}: its latest Protobuf schema could not be read (neither a "
            f"serialized FileDescriptorProto nor .proto text protoc compiles): {PIN}"
        )
    others = sorted(set(file.dependency) - {proto.TIMESTAMP_FILE})
    if others:
        raise ColumnsError(
            f"subject {subject!r}: its latest Protobuf schema imports {others} (only "
            f"{proto.TIMESTAMP_FILE} is supported yet): {PIN}"
        )
    chosen = proto.chosen(file, message)
    if chosen is None:
        names = [m[0] for m in proto.messages(file.message_type, file.package)]
        wanted = f"message {message!r}" if message else "a message"
        raise ColumnsError(f"subject {subject!r}: its latest schema has no {wanted} (has {names})")
    columns, unsupported = [], []
    for field in chosen[2].field:
        if field.label == _REPEATED:
            unsupported.append((field.name, "is repeated (a list or a map), not a column"))
        elif field.type_name == proto.TIMESTAMP_TYPE:
            columns.append(_column(field.name, "timestamp", True))
        elif field.type not in _PROTOBUF:
            kind = _PROTOBUF_NAMES.get(field.type, f"type {field.type}")
            unsupported.append((field.name, f"is {kind}, which is not a column type"))
        else:
            columns.append(_column(field.name, _PROTOBUF[field.type], True))
    return columns, unsupported


def refused(url: str, status: int) -> SettingsError:
    """The registry at ``url`` refused our credentials (HTTP ``status``): one line naming the
    settings that hold them, never their values."""
    return SettingsError(
        f"BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH/BACKFILL_SCHEMA_REGISTRY_TOKEN: the schema registry "
        f"at {url} refused the request (HTTP {status}); set the registry's user:password or "
        "bearer token (one of the two) and run again"
    )
