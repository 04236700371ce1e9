"""A Protobuf topic through the schema registry, backfilled by the raw asset (issue 28).

Records in Confluent's wire format (magic byte 0, the registry's schema id, the message-index
path, protobuf binary) are produced by confluent-kafka's ProtobufSerializer with three versions
of the subject's schema: v2 adds ``currency``, v3 removes the optional ``note``, widens
``amount`` from int32 to int64 and adds a second message. Spark decodes each record with its
writer schema on the JVM (protobuf-java), so every row equals what was produced. A record with
an id the registry does not know, one whose schema cannot be read as the columns, one naming
another message of its schema, one cut short and one not in the wire format are quarantined with
their offsets and exact bytes; every check (the independent decode with confluent-kafka's
ProtobufDeserializer included) passes and nothing else is lost.
"""

from __future__ import annotations

import base64
import dataclasses
import struct
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.lake.decode import protobuf
from backfill_assets.spec import proto
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support import registry_topics
from backfill_assets_tests.support.registry_topics import World
from backfill_assets_tests.support.runs import (
    WITH_EVENT_TIME_MS,
    dicts_by_offset,
    materialize_range,
    rows_by_offset,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HOUR0 = datetime(2026, 2, 12, 7, tzinfo=UTC)
RANGE = ("2026-02-12-07:00", "2026-02-12-07:00")
UNKNOWN_ID = 987_655
_F = descriptor_pb2.FieldDescriptorProto
# (name, number, type, proto3 optional)
Field = tuple[str, int, int, bool]
_EVENT: Field = ("event_id", 1, _F.TYPE_STRING, False)
_ORDER: Field = ("order_id", 2, _F.TYPE_STRING, False)
_NOTE: Field = ("note", 4, _F.TYPE_STRING, True)
_TIME: Field = ("event_time", 5, _F.TYPE_INT64, False)  # epoch milliseconds
_CURRENCY: Field = ("currency", 6, _F.TYPE_STRING, False)
V1 = [_EVENT, _ORDER, ("amount", 3, _F.TYPE_INT32, False), _NOTE, _TIME]
V2 = [*V1, _CURRENCY]
V3 = [_EVENT, _ORDER, ("amount", 3, _F.TYPE_INT64, False), _TIME, _CURRENCY]
# v4, registered as .proto text, the way Java producers register (the others are registered as
# serialized descriptors, the way confluent-kafka's Python serializer does): compiled by protoc.
V4_TEXT = """syntax = "proto3";
package shop;
message Order {
  string event_id = 1;
  string order_id = 2;
  int64 amount = 3;
  int64 event_time = 5;
  string currency = 6;
  bool gift = 7;
}
"""
# v5, as text importing the well-known Timestamp, which its event_time now is.
V5_TEXT = """syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";
message Order {
  string event_id = 1;
  string order_id = 2;
  int64 amount = 3;
  google.protobuf.Timestamp event_time = 5;
}
"""
# Registered under another subject: its amount is a string, never read as the bigint column.
BAD = [_EVENT, _ORDER, ("amount", 3, _F.TYPE_STRING, False), _TIME]


def _file(fields: list[Field], *, refund: bool = False) -> descriptor_pb2.FileDescriptorProto:
    """``order.proto`` (package ``shop``) whose first message is ``Order`` with ``fields``; with
    ``refund``, a second message ``Refund``."""
    file = descriptor_pb2.FileDescriptorProto(name="order.proto", package="shop", syntax="proto3")
    msg = file.message_type.add(name="Order")
    for name, number, kind, optional in fields:
        field = msg.field.add(name=name, number=number, type=kind, label=_F.LABEL_OPTIONAL)
        if optional:  # proto3 `optional`: a synthetic oneof tracks its presence
            field.oneof_index = len(msg.oneof_decl)
            field.proto3_optional = True
            msg.oneof_decl.add(name=f"_{name}")
    if refund:
        other = file.message_type.add(name="Refund")
        other.field.add(name="event_id", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    return file


def _class(file: descriptor_pb2.FileDescriptorProto, name: str = "shop.Order") -> Any:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def _spec(topic: str) -> TopicSpec:
    return TopicSpec.model_validate(
        {
            "topic": topic,
            "format": "protobuf",
            "key_field": "order_id",
            "event_id_field": "event_id",
            "event_time_field": "event_time",
            "partition_start": HOUR0.isoformat(),
            "allowed_lateness_hours": 0,
            # A third of this corpus is bad on purpose: the ratio check lets the run publish.
            "quarantine_max_ratio": 1.0,
            "columns": [
                {"name": "event_id", "type": "string", "nullable": False},
                {"name": "order_id", "type": "string", "nullable": False},
                {"name": "amount", "type": "bigint", "nullable": False},
                {"name": "note", "type": "string"},
                {"name": "currency", "type": "string"},
                {"name": "event_time", "type": "timestamp", "nullable": False},
            ],
        }
    )


def _register(client: SchemaRegistryClient, subject: str, file: Any) -> int:
    text = base64.b64encode(file.SerializeToString()).decode()
    return client.register_schema(subject, Schema(text, "PROTOBUF"))


def _records(client: SchemaRegistryClient, topic: str) -> list[tuple[bytes | None, Any]]:
    """(value bytes, expected row or "q:<reason>"), in produce order."""
    subject = f"{topic}-value"
    files = [_file(V1), _file(V2), _file(V3, refund=True)]
    ids = [_register(client, subject, files[0])]
    client.set_compatibility(subject, "NONE")  # int32 -> int64 is wire-compatible, not BACKWARD
    ids += [_register(client, subject, f) for f in files[1:]]
    v4_id = client.register_schema(subject, Schema(V4_TEXT, "PROTOBUF"))
    v5_id = client.register_schema(subject, Schema(V5_TEXT, "PROTOBUF"))
    bad_id = _register(client, f"{topic}-legacy-value", _file(BAD))
    ctx = SerializationContext(topic, MessageField.VALUE)
    ms = int((HOUR0 + timedelta(minutes=3)).timestamp() * 1000)
    conf = {"auto.register.schemas": False, "use.latest.version": False}

    def ser(version: int, **value: Any) -> bytes:
        cls = _class(files[version - 1])
        data = ProtobufSerializer(cls, client, conf)(cls(event_time=ms, **value), ctx)
        assert isinstance(data, bytes) and struct.unpack(">I", data[1:5])[0] == ids[version - 1]
        return data

    def row(n: int, amount: int, note: str | None, currency: str | None, sid: int) -> Any:
        return {
            "event_id": f"e{n}",
            "order_id": f"o{n}",
            "amount": amount,
            "note": note,
            "currency": currency,
            "event_time_ms": ms,
            "schema_version": sid,  # the raw table keeps the writer schema's registry id
        }

    v1 = ser(1, event_id="e1", order_id="o1", amount=10, note="first")
    refund = _class(files[2], "shop.Refund")(event_id="r1")
    bad = _class(_file(BAD))(event_id="e5", order_id="o5", amount="x", event_time=ms)
    out: list[tuple[bytes | None, Any]] = [
        # v1: no currency field in the writer schema -> NULL
        (v1, row(1, 10, "first", None, ids[0])),
        # v2: note unset (it tracks presence) -> NULL
        (
            ser(2, event_id="e2", order_id="o2", amount=20, currency="USD"),
            row(2, 20, None, "USD", ids[1]),
        ),
        # v3: note removed, amount beyond int32
        (
            ser(3, event_id="e3", order_id="o3", amount=3_000_000_000, currency="G"),
            row(3, 3_000_000_000, None, "G", ids[2]),
        ),
        (b"\x00" + struct.pack(">I", UNKNOWN_ID) + v1[5:], f"q:unknown_schema_id:{UNKNOWN_ID}"),
        (
            b"\x00" + struct.pack(">I", bad_id) + b"\x00" + bad.SerializeToString(),
            f"q:incompatible_schema:{bad_id}",
        ),
        # v3's second message (index path [1]): not the Order the spec reads
        (
            b"\x00" + struct.pack(">I", ids[2]) + b"\x02\x02" + refund.SerializeToString(),
            f"q:incompatible_schema:{ids[2]}",
        ),
        (b'{"event_id": "e7"}', "q:not_protobuf_wire_format"),
        # v2 with currency unset: proto3's zero value, the empty string
        (ser(2, event_id="e8", order_id="o8", amount=80, note="n"), row(8, 80, "n", "", ids[1])),
        # v4 (a .proto text schema): its payload, with the index path of its first message.
        (
            b"\x00"
            + struct.pack(">I", v4_id)
            + b"\x00"
            + _class(files[2])(
                event_id="e9", order_id="o9", amount=9, event_time=ms, currency="C"
            ).SerializeToString(),
            row(9, 9, None, "C", v4_id),
        ),
        # v5: event_time is a google.protobuf.Timestamp
        (
            b"\x00"
            + struct.pack(">I", v5_id)
            + b"\x00"
            + _v5(event_id="e10", order_id="o10", ms=ms),
            row(10, 0, None, None, v5_id),
        ),
        # A tombstone (the 11th record, key o11): a row with its key field from the key.
        (None, {"order_id": "o11", "event_id": None, "amount": None, "is_tombstone": True}),
        # A known id whose payload is cut inside a string field.
        (v1[:9], f"q:invalid_protobuf:{ids[0]}"),
    ]
    assert len({*ids, v4_id, v5_id}) == 5 and bad_id not in ids
    return out


def _v5(event_id: str, order_id: str, ms: int) -> bytes:
    """A v5 payload (compiled from its text by protoc, with the well-known Timestamp)."""
    from google.protobuf import timestamp_pb2

    file = proto.compile_proto(V5_TEXT)
    assert file is not None
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(file)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order"))
    msg = cls(event_id=event_id, order_id=order_id)
    msg.event_time.seconds, msg.event_time.nanos = divmod(ms, 1000)
    msg.event_time.nanos *= 1_000_000
    return bytes(msg.SerializeToString())


def _produce(settings: Settings, topic: str, records: list[tuple[bytes | None, Any]]) -> list[int]:
    return registry_topics.produce(settings, topic, records, HOUR0)


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings, spark_session: SparkSession, registry: LocalRegistry
) -> Iterator[World]:
    topic = f"proto_{uuid.uuid4().hex[:8]}"
    spec = _spec(topic)
    records = _records(SchemaRegistryClient({"url": registry.url}), topic)
    offsets = _produce(stack_settings, topic, records)
    ns = stack_settings.catalog.namespace
    with dg.instance_for_test() as instance:
        result = materialize_range([build_raw_asset(spec)], instance, *RANGE, raise_on_error=False)
        rows = dicts_by_offset(spark_session, f"lake.{ns}.{spec.raw_table}", *WITH_EVENT_TIME_MS)
        quarantine = rows_by_offset(spark_session, f"lake.{ns}.{spec.quarantine_table}")
    expected = {(0, o): want for o, (_, want) in zip(offsets, records, strict=True)}
    values = {(0, o): value for o, (value, _) in zip(offsets, records, strict=True)}
    yield World(spec, result, expected, values, rows, quarantine)


def test_run_publishes_with_every_check_green(world: World) -> None:
    registry_topics.assert_publishes_with_every_check_green(world)


def test_rows_equal_what_was_produced_across_three_versions(world: World) -> None:
    registry_topics.assert_rows_equal_what_was_produced(world)


def test_bad_records_are_quarantined_with_reason_offsets_and_bytes(world: World) -> None:
    registry_topics.assert_bad_records_quarantined(world)


def _serialized(file: descriptor_pb2.FileDescriptorProto) -> tuple[str, str]:
    return "PROTOBUF", base64.b64encode(file.SerializeToString()).decode()


def test_each_writer_is_judged_against_the_columns() -> None:
    """No stack: which ids decode and which are quarantined, decided before any Spark
    expression."""
    spec = _spec("judged")
    for sid, fields in enumerate((V1, V2, V3), start=1):
        verdict = protobuf.judge(spec, sid, _serialized(_file(fields)))
        assert (verdict.reason, verdict.message, verdict.path) == (None, "shop.Order", (0,))
    assert protobuf.judge(spec, 9, _serialized(_file(BAD))).reason == "incompatible_schema:9"
    assert protobuf.judge(spec, 8, None).reason == "unknown_schema_id:8"
    assert protobuf.judge(spec, 7, ("AVRO", '"string"')).reason == "incompatible_schema:7"
    imports = _file(V1)
    imports.dependency.append("google/other.proto")
    assert protobuf.judge(spec, 6, _serialized(imports)).reason == "incompatible_schema:6"
    # The well-known Timestamp is the one import read (as a timestamp column only).
    stamped = protobuf.judge(spec, 6, ("PROTOBUF", V5_TEXT))
    assert (stamped.reason, stamped.message) == (None, "shop.Order")
    as_amount = V5_TEXT.replace("int64 amount = 3", "google.protobuf.Timestamp amount = 3")
    assert protobuf.judge(spec, 6, ("PROTOBUF", as_amount)).reason == "incompatible_schema:6"
    repeated = _file(V1)
    repeated.message_type[0].field[0].label = _F.LABEL_REPEATED
    assert protobuf.judge(spec, 5, _serialized(repeated)).reason == "incompatible_schema:5"
    # A spec naming the second message reads it at index path [1].
    refunds = spec.model_copy(update={"message": "shop.Refund"})
    verdict = protobuf.judge(refunds, 4, _serialized(_file(V1, refund=True)))
    assert (verdict.reason, verdict.path) == (None, (1,))
    assert protobuf.judge(refunds, 3, _serialized(_file(V1))).reason == "incompatible_schema:3"
    # .proto text is compiled by protoc; text protoc refuses is incompatible, never guessed at.
    text = protobuf.judge(spec, 2, ("PROTOBUF", V4_TEXT))
    assert (text.reason, text.message) == (None, "shop.Order")
    assert protobuf.judge(spec, 1, ("PROTOBUF", "message {")).reason == "incompatible_schema:1"


def test_the_message_index_path_is_read_as_confluent_writes_it() -> None:
    header = b"\x00\x00\x00\x00\x01"
    assert protobuf.message_path(header + b"\x00payload") == ((0,), 6)
    assert protobuf.message_path(header + b"\x02\x02payload") == ((1,), 7)
    assert protobuf.message_path(header + b"\x04\x00\x04payload") == ((0, 2), 8)
    assert protobuf.message_path(header + b"\x04\x00") is None  # cut inside the path
    assert protobuf.message_path(header + b"\x81") is None


def test_message_only_on_a_protobuf_topic() -> None:
    spec = _spec("m").model_dump()
    with pytest.raises(ValueError, match="message: only a protobuf topic"):
        TopicSpec.model_validate({**spec, "format": "avro", "message": "shop.Order"})


def test_registry_outage_fails_the_run_and_the_retry_publishes(
    stack_settings: Settings,
    spark_session: SparkSession,
    registry: LocalRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from backfill_assets_tests.support.services import free_port

    topic = f"proto_outage_{uuid.uuid4().hex[:8]}"
    spec = _spec(topic)
    _produce(
        stack_settings, topic, _records(SchemaRegistryClient({"url": registry.url}), topic)[:3]
    )
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    with dg.instance_for_test() as instance:
        with monkeypatch.context() as mp:
            mp.setenv("BACKFILL_SCHEMA_REGISTRY_URL", f"http://127.0.0.1:{free_port()}")
            failed = materialize_range(
                [build_raw_asset(spec)], instance, *RANGE, raise_on_error=False
            )
        assert not failed.success
        errors = " ".join(
            str(e.event_specific_data) for e in failed.all_events if e.is_step_failure
        )
        assert "schema registry" in errors and "RegistryUnavailable" in errors, errors[:2000]
        if spark_session.catalog.tableExists(table):
            assert spark_session.table(table).count() == 0
        assert materialize_range([build_raw_asset(spec)], instance, *RANGE).success
        assert spark_session.table(table).count() == 3


@pytest.mark.slow
def test_a_stale_writer_schema_in_spark_fails_decoded_content_and_main_is_unchanged(
    stack_settings: Settings,
    spark_session: SparkSession,
    registry: LocalRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault decoded_content exists to catch in a Protobuf topic: Spark decodes a record with
    another version's descriptor (a stale schema cache): v2's records read with v1's schema lose
    their currency, while the bytes and the counts stay right. The independent decode
    (ProtobufDeserializer, its own registry client) sees it; nothing is published."""
    topic = f"proto_stale_{uuid.uuid4().hex[:8]}"
    spec = _spec(topic)
    records = _records(SchemaRegistryClient({"url": registry.url}), topic)[:3]
    _produce(stack_settings, topic, records)
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    real_resolve = protobuf.resolve

    def stale(spec: TopicSpec, url: str, ids: Any, auth: Any = None) -> dict[int, protobuf.Writer]:
        writers = real_resolve(spec, url, ids, auth)
        first = writers[min(writers)]
        return {
            sid: dataclasses.replace(w, descriptor=first.descriptor) for sid, w in writers.items()
        }

    with dg.instance_for_test() as instance:
        assert materialize_range([build_raw_asset(spec)], instance, *RANGE).success
        snapshot = f"SELECT snapshot_id FROM {table}.refs WHERE name = 'main'"
        before = spark_session.sql(snapshot).collect()
        rows_before = sorted(map(tuple, spark_session.table(table).drop("ingest_run_id").collect()))
        with monkeypatch.context() as mp:
            mp.setattr(protobuf, "resolve", stale)
            wrong = materialize_range(
                [build_raw_asset(spec)], instance, *RANGE, raise_on_error=False
            )
    assert not wrong.success
    checks = {e.check_name: e for e in wrong.get_asset_check_evaluations()}
    assert {name for name, e in checks.items() if not e.passed} == {"decoded_content"}
    assert spark_session.sql(snapshot).collect() == before
    rows_after = sorted(map(tuple, spark_session.table(table).drop("ingest_run_id").collect()))
    assert rows_after == rows_before
    assert checks["decoded_content"].metadata["hours_that_differ"].value == [HOUR0.isoformat()]
