"""A registry topic's columns derived from its subject's latest schema (issue 28).

Against the real local schema registry (no Spark): Avro, Protobuf (serialized descriptors and
.proto text) and JSON Schema subjects give the columns topics.yaml would declare; a field that
cannot be a column, a missing subject and a registry that does not answer are errors saying
what to do; declared columns load without asking the registry; ``backfill-assets columns``
prints a block that, pasted into the spec, loads to the same columns.
"""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from google.protobuf import descriptor_pb2

from backfill_assets.errors import ColumnsError, RegistryUnavailable, SpecError
from backfill_assets.ops import cli
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import TopicSpec
from backfill_assets.spec.registry_columns import derive_columns
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import CCOMPAT_PATH
from backfill_assets_tests.support import services

_F = descriptor_pb2.FieldDescriptorProto


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _col(name: str, kind: str, nullable: bool = True) -> dict[str, Any]:
    return {"name": name, "type": kind, "nullable": nullable}


def _avro(fields: list[dict[str, Any]]) -> str:
    return json.dumps({"type": "record", "name": "Order", "namespace": "shop", "fields": fields})


AVRO_FIELDS: list[dict[str, Any]] = [
    {"name": "event_id", "type": "string"},
    {"name": "order_id", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "quantity", "type": "int"},
    {"name": "amount", "type": "long"},
    {"name": "rate", "type": "float"},
    {"name": "score", "type": ["null", "double"], "default": None},
    {"name": "gift", "type": "boolean"},
    {"name": "note", "type": ["null", "string"], "default": None},
    {"name": "event_time", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "shipped", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
]
AVRO_COLUMNS = [
    _col("event_id", "string", False),
    _col("order_id", "string", False),
    _col("quantity", "int", False),
    _col("amount", "bigint", False),
    _col("rate", "double", False),
    _col("score", "double"),
    _col("gift", "boolean", False),
    _col("note", "string"),
    _col("event_time", "timestamp", False),
    _col("shipped", "timestamp"),
]


def _proto_file() -> descriptor_pb2.FileDescriptorProto:
    """``order.proto``: ``shop.Order`` with a field of each readable type, then ``shop.Refund``."""
    file = descriptor_pb2.FileDescriptorProto(name="order.proto", package="shop", syntax="proto3")
    msg = file.message_type.add(name="Order")
    kinds = [
        ("event_id", _F.TYPE_STRING),
        ("quantity", _F.TYPE_INT32),
        ("delta", _F.TYPE_SINT32),
        ("slot", _F.TYPE_SFIXED32),
        ("amount", _F.TYPE_INT64),
        ("balance", _F.TYPE_SINT64),
        ("event_time", _F.TYPE_SFIXED64),
        ("rate", _F.TYPE_FLOAT),
        ("score", _F.TYPE_DOUBLE),
        ("gift", _F.TYPE_BOOL),
    ]
    for number, (name, kind) in enumerate(kinds, start=1):
        msg.field.add(name=name, number=number, type=kind, label=_F.LABEL_OPTIONAL)
    refund = file.message_type.add(name="Refund")
    refund.field.add(name="refund_id", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    return file


PROTO_COLUMNS = [
    _col("event_id", "string"),
    _col("quantity", "int"),
    _col("delta", "int"),
    _col("slot", "int"),
    _col("amount", "bigint"),
    _col("balance", "bigint"),
    _col("event_time", "bigint"),  # epoch millis: declare it to read it as a timestamp
    _col("rate", "double"),
    _col("score", "double"),
    _col("gift", "boolean"),
]
PROTO_TEXT = """syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";
message Order {
  string event_id = 1;
  int64 amount = 2;
  optional string note = 3;
  bool gift = 4;
  google.protobuf.Timestamp paid_at = 5;
}
"""
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "event_id": {"type": "string"},
        "order_id": {"type": "string"},
        "amount": {"type": "integer"},
        "rate": {"type": "number"},
        "gift": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
        "event_time": {"type": "string", "format": "date-time"},
    },
    "required": ["event_id", "order_id", "amount", "event_time", "note"],
}
JSON_COLUMNS = [
    _col("event_id", "string", False),
    _col("order_id", "string", False),
    _col("amount", "bigint", False),
    _col("rate", "double"),
    _col("gift", "boolean"),
    _col("note", "string"),  # required, but null is one of its types
    _col("event_time", "timestamp", False),
]


def _serialized(file: descriptor_pb2.FileDescriptorProto) -> str:
    return base64.b64encode(file.SerializeToString()).decode()


@pytest.fixture
def client(registry: LocalRegistry) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": registry.url})


def _dead_url() -> str:
    return f"http://127.0.0.1:{services.free_port()}{CCOMPAT_PATH}"


def test_avro_fields_derive_as_columns(registry: LocalRegistry, client: Any) -> None:
    subject = f"{_name('avro')}-value"
    client.register_schema(subject, Schema(_avro(AVRO_FIELDS[:3]), "AVRO"))
    client.register_schema(subject, Schema(_avro(AVRO_FIELDS), "AVRO"))  # the latest is read
    assert derive_columns("avro", subject, registry.url) == AVRO_COLUMNS


def test_protobuf_fields_derive_as_columns(registry: LocalRegistry, client: Any) -> None:
    subject = f"{_name('proto')}-value"
    client.register_schema(subject, Schema(_serialized(_proto_file()), "PROTOBUF"))
    assert derive_columns("protobuf", subject, registry.url) == PROTO_COLUMNS
    # The spec's `message` picks another message of the file.
    refund = derive_columns("protobuf", subject, registry.url, "shop.Refund")
    assert refund == [_col("refund_id", "string")]
    with pytest.raises(ColumnsError, match=r"no message 'shop\.Nope'"):
        derive_columns("protobuf", subject, registry.url, "shop.Nope")
    # .proto text (as Java producers register it) is compiled by protoc; the well-known
    # Timestamp is a timestamp column.
    text_subject = f"{_name('proto_text')}-value"
    client.register_schema(text_subject, Schema(PROTO_TEXT, "PROTOBUF"))
    assert derive_columns("protobuf", text_subject, registry.url) == [
        _col("event_id", "string"),
        _col("amount", "bigint"),
        _col("note", "string"),
        _col("gift", "boolean"),
        _col("paid_at", "timestamp"),
    ]


def test_json_schema_properties_derive_as_columns(registry: LocalRegistry, client: Any) -> None:
    subject = f"{_name('json')}-value"
    client.register_schema(subject, Schema(json.dumps(JSON_SCHEMA), "JSON"))
    assert derive_columns("json_schema", subject, registry.url) == JSON_COLUMNS


def test_a_field_that_cannot_be_a_column_is_named(registry: LocalRegistry, client: Any) -> None:
    subject = f"{_name('avro_bad')}-value"
    tags = {"name": "tags", "type": {"type": "array", "items": "string"}}
    either = {"name": "either", "type": ["null", "string", "long"]}
    client.register_schema(subject, Schema(_avro([*AVRO_FIELDS[:2], tags, either]), "AVRO"))
    with pytest.raises(ColumnsError) as err:
        derive_columns("avro", subject, registry.url)
    message = str(err.value)
    assert message.startswith(f"subject {subject!r}: field 'tags' has type"), message
    assert "field 'either' is a union of 2 non-null types" in message
    assert message.endswith("declare `columns` in topics.yaml to pin the ones wanted")

    proto = f"{_name('proto_bad')}-value"
    file = _proto_file()
    file.message_type[0].field[0].label = _F.LABEL_REPEATED
    file.message_type[0].field.add(name="meta", number=20, type=_F.TYPE_BYTES)
    client.register_schema(proto, Schema(_serialized(file), "PROTOBUF"))
    with pytest.raises(ColumnsError, match=r"field 'event_id' is repeated.*field 'meta' is bytes"):
        derive_columns("protobuf", proto, registry.url)

    js = f"{_name('json_bad')}-value"
    props = {"event_id": {"type": "string"}, "o": {"type": "object"}}
    nested = {**JSON_SCHEMA, "properties": props}
    client.register_schema(js, Schema(json.dumps(nested), "JSON"))
    with pytest.raises(ColumnsError, match=f"subject '{js}': field 'o' has type"):
        derive_columns("json_schema", js, registry.url)


def test_a_missing_subject_names_it_and_the_registry(registry: LocalRegistry) -> None:
    with pytest.raises(ColumnsError) as err:
        derive_columns("avro", "nowhere-value", registry.url)
    assert not isinstance(err.value, RegistryUnavailable)
    assert f"subject 'nowhere-value' is not in the schema registry at {registry.url}" in str(
        err.value
    )


# --- load_specs -----------------------------------------------------------------------------


def _topic(name: str, fmt: str = "avro", **over: Any) -> dict[str, Any]:
    return {
        "topic": name,
        "format": fmt,
        "key_field": "order_id",
        "event_id_field": "event_id",
        "event_time_field": "event_time",
        "partition_start": "2026-03-01T00:00:00+00:00",
        "allowed_lateness_hours": 0,
        "quarantine_max_ratio": 0.0,
        **over,
    }


def _declared(spec: TopicSpec) -> list[dict[str, Any]]:
    return [c.model_dump(include={"name", "type", "nullable"}) for c in spec.columns]


def _save(tmp_path: Path, *topics: dict[str, Any]) -> Path:
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump({"topics": list(topics)}, sort_keys=False))
    return path


def test_a_spec_without_columns_loads_the_latest_schemas(
    tmp_path: Path, registry: LocalRegistry, client: Any
) -> None:
    avro, js = _name("avro"), _name("js")
    client.register_schema(f"{avro}-value", Schema(_avro(AVRO_FIELDS), "AVRO"))
    client.register_schema(f"{js}-orders", Schema(json.dumps(JSON_SCHEMA), "JSON"))
    specs = load_specs(
        _save(tmp_path, _topic(avro), _topic(js, "json_schema", subject=f"{js}-orders"))
    )
    assert [_declared(s) for s in specs] == [AVRO_COLUMNS, JSON_COLUMNS]


def test_derived_columns_still_obey_the_field_rules(
    tmp_path: Path, registry: LocalRegistry, client: Any
) -> None:
    """An Avro topic's event time must be a timestamp-millis (or -micros) field."""
    name = _name("avro_time")
    plain = [*AVRO_FIELDS[:2], {"name": "event_time", "type": "long"}]
    client.register_schema(f"{name}-value", Schema(_avro(plain), "AVRO"))
    with pytest.raises(SpecError) as err:
        load_specs(_save(tmp_path, _topic(name)))
    assert str(err.value) == (
        f"{tmp_path / 'topics.yaml'}: topic {name!r}: event_time_field: 'event_time' must be a "
        f"timestamp column (one of []) (columns derived from the latest schema of subject "
        f"'{name}-value'; declare `columns` to pin them)"
    )


def test_an_unsupported_field_is_a_spec_error(
    tmp_path: Path, registry: LocalRegistry, client: Any
) -> None:
    name = _name("avro_tags")
    tags = {"name": "tags", "type": {"type": "map", "values": "string"}}
    client.register_schema(f"{name}-value", Schema(_avro([*AVRO_FIELDS, tags]), "AVRO"))
    with pytest.raises(SpecError) as err:
        load_specs(_save(tmp_path, _topic(name)))
    assert str(err.value).startswith(
        f"{tmp_path / 'topics.yaml'}: topic {name!r}: columns: subject '{name}-value': "
        "field 'tags' has type"
    )


def test_declared_columns_load_without_a_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Declared columns pin the table: the registry is not asked (it does not answer here)."""
    monkeypatch.setenv("BACKFILL_SCHEMA_REGISTRY_URL", _dead_url())
    for fmt in ("avro", "json_schema", "protobuf"):
        (spec,) = load_specs(_save(tmp_path, _topic("pinned", fmt, columns=AVRO_COLUMNS)))
        assert [c.name for c in spec.columns] == [c["name"] for c in AVRO_COLUMNS]


def test_no_columns_and_no_registry_names_the_url_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _dead_url()
    monkeypatch.setenv("BACKFILL_SCHEMA_REGISTRY_URL", url)
    with pytest.raises(SpecError) as err:
        load_specs(_save(tmp_path, _topic("unpinned")))
    message = str(err.value)
    assert message.startswith(
        f"{tmp_path / 'topics.yaml'}: topic 'unpinned': columns: the schema registry at {url} "
        "did not answer for subject 'unpinned-value'"
    ), message
    assert "`backfill-assets stack up`" in message
    assert "declare `columns` in topics.yaml to pin them" in message
    assert len(message.splitlines()) == 1


# --- the CLI ---------------------------------------------------------------------------------


def test_the_printed_block_pasted_back_loads_to_the_same_columns(
    tmp_path: Path,
    registry: LocalRegistry,
    client: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = _name("avro_cli")
    tags = {"name": "tags", "type": {"type": "array", "items": "string"}}
    client.register_schema(f"{name}-value", Schema(_avro([*AVRO_FIELDS, tags]), "AVRO"))
    spec = _save(tmp_path, _topic(name))
    monkeypatch.setenv("BACKFILL_SPEC", str(spec))
    assert cli.main(["columns", "--topic", name]) == 0
    out, err = capsys.readouterr()
    assert "    # not a column: field 'tags' has type" in out
    assert "left out: subject" in err and "field 'tags'" in err
    block = yaml.safe_load(out)
    assert block == {"columns": AVRO_COLUMNS}
    # Pasted into the topic's entry, the columns are pinned: no registry needed to load them.
    pinned = _save(tmp_path, _topic(name, **block))
    monkeypatch.setenv("BACKFILL_SCHEMA_REGISTRY_URL", _dead_url())
    (loaded,) = load_specs(pinned)
    assert _declared(loaded) == AVRO_COLUMNS

    assert cli.main(["columns", "--topic", name, "--json"]) == 3  # the registry is gone
    out, err = capsys.readouterr()
    assert out == "" and "error: the schema registry at" in err


def test_the_command_refuses_a_topic_without_a_subject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _save(tmp_path, _topic("plain", "json", columns=AVRO_COLUMNS, latest_version=1))
    monkeypatch.setenv("BACKFILL_SPEC", str(spec))
    assert cli.main(["columns", "--topic", "plain"]) == 2
    assert "topic 'plain' has format 'json'" in capsys.readouterr().err
    assert cli.main(["columns", "--topic", "payments"]) == 2
    assert "unknown topic 'payments'" in capsys.readouterr().err
