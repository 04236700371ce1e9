"""The local schema registry (issue 28's foundation): a real Apicurio Registry, started once per
session from the application bootstrap built from Maven Central, used through confluent-kafka's
Confluent-API client and serializers, with records that travel through the session's broker."""

from __future__ import annotations

import json
import struct
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer

# NewTopic is public but only implicitly re-exported.
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext, SerializationError
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import Settings


def _order(fields: list[dict[str, Any]]) -> str:
    return json.dumps({"type": "record", "name": "Order", "namespace": "t", "fields": fields})


_ID = {"name": "id", "type": "long"}
_NOTE = {"name": "note", "type": ["null", "string"], "default": None}
_CURRENCY = {"name": "currency", "type": "string", "default": "EUR"}
# Three BACKWARD-compatible versions: v2 adds a field with a default, v3 removes the optional
# note and widens amount from int to long.
V1 = _order([_ID, {"name": "amount", "type": "int"}, _NOTE])
V2 = _order([_ID, {"name": "amount", "type": "int"}, _NOTE, _CURRENCY])
V3 = _order([_ID, {"name": "amount", "type": "long"}, _CURRENCY])
# Not BACKWARD-compatible with v3: a field without a default that v3 records lack.
V4_BAD = _order(
    [_ID, {"name": "amount", "type": "long"}, _CURRENCY, {"name": "sku", "type": "string"}]
)


@pytest.fixture()
def client(registry: LocalRegistry) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": registry.url})


def _frame_id(data: bytes) -> int:
    """The schema id of Confluent's wire format: magic byte 0, then a big-endian int32."""
    assert data[0] == 0
    return int(struct.unpack(">I", data[1:5])[0])


def _new_topic(settings: Settings) -> str:
    topic = f"registry-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(dict(settings.kafka.client_config()))
    futures = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=-1)])
    futures[topic].result(timeout=30)
    return topic


def _produce_and_consume(settings: Settings, topic: str, values: list[bytes]) -> list[bytes]:
    producer = Producer({**settings.kafka.client_config(), "enable.idempotence": True})
    for value in values:
        producer.produce(topic, value=value)
    assert producer.flush(30) == 0
    consumer = Consumer(
        {
            **settings.kafka.client_config(),
            "group.id": f"test-{topic}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got: list[bytes] = []
    try:
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is None:
                if len(got) == len(values):
                    break
                continue
            assert msg.error() is None, msg.error()
            payload: bytes | None = msg.value()
            assert payload is not None
            got.append(payload)
    finally:
        consumer.close()
    return got


def test_local_registry_serves_the_confluent_api(registry: LocalRegistry) -> None:
    status = registry.status()
    assert status.running and status.ready and status.pid is not None
    assert registry.url.endswith("/apis/ccompat/v7")
    # A second start finds ours running and does not launch another.
    assert registry.start().pid == status.pid


def test_avro_versions_round_trip_through_the_broker(
    client: SchemaRegistryClient, stack_settings: Settings
) -> None:
    topic = _new_topic(stack_settings)
    subject = f"{topic}-value"
    # The client's annotation says str; it returns the registry's JSON answer.
    answer: Any = client.set_compatibility(subject, "BACKWARD")
    assert answer == {"compatibility": "BACKWARD"}
    assert client.get_compatibility(subject) == "BACKWARD"
    ids = [client.register_schema(subject, Schema(s, "AVRO")) for s in (V1, V2, V3)]
    assert len(set(ids)) == 3
    assert client.get_versions(subject) == [1, 2, 3]
    latest = client.get_latest_version(subject)
    assert (latest.version, latest.schema_id) == (3, ids[2])
    assert json.loads(str(client.get_schema(ids[0]).schema_str)) == json.loads(V1)
    # Registering the same schema again is idempotent: same id, no new version.
    assert client.register_schema(subject, Schema(V2, "AVRO")) == ids[1]
    # BACKWARD is enforced: a new field without a default is refused.
    assert not client.test_compatibility(subject, Schema(V4_BAD, "AVRO"))
    with pytest.raises(SchemaRegistryError):
        client.register_schema(subject, Schema(V4_BAD, "AVRO"))
    assert client.get_versions(subject) == [1, 2, 3]

    records = [
        (V1, {"id": 1, "amount": 10, "note": "first"}),
        (V2, {"id": 2, "amount": 20, "note": None, "currency": "USD"}),
        (V3, {"id": 3, "amount": 3_000_000_000, "currency": "GBP"}),
    ]
    ctx = SerializationContext(topic, MessageField.VALUE)
    # Each producer writes with its own version, already registered (no auto-registration).
    serialized = [
        AvroSerializer(client, schema, conf={"auto.register.schemas": False})(value, ctx)
        for schema, value in records
    ]
    assert [_frame_id(data) for data in serialized] == ids

    consumed = _produce_and_consume(stack_settings, topic, serialized)
    assert consumed == serialized
    # Each record decoded with its own writer schema, fetched from the registry by id.
    writer = AvroDeserializer(client)
    assert [writer(data, ctx) for data in consumed] == [value for _, value in records]
    # Each resolved against the latest version: defaults filled, removed field dropped, widened.
    reader = AvroDeserializer(client, schema_str=V3)
    assert [reader(data, ctx) for data in consumed] == [
        {"id": 1, "amount": 10, "currency": "EUR"},
        {"id": 2, "amount": 20, "currency": "USD"},
        {"id": 3, "amount": 3_000_000_000, "currency": "GBP"},
    ]


def test_unknown_schema_id_is_a_clear_deserializer_error(
    client: SchemaRegistryClient, stack_settings: Settings
) -> None:
    ctx = SerializationContext("registry-unknown", MessageField.VALUE)
    data = b"\x00" + struct.pack(">I", 987_654) + b"\x02"
    with pytest.raises(SchemaRegistryError) as info:
        AvroDeserializer(client)(data, ctx)
    # Confluent's "schema not found" (40403), naming the id: not a missing endpoint's 404.
    assert (info.value.http_status_code, info.value.error_code) == (404, 40403)
    assert "987654" in info.value.error_message
    # Not Confluent's wire format at all: refused before any registry call.
    with pytest.raises(SerializationError, match="magic byte"):
        AvroDeserializer(client)(b'{"id": 1}', ctx)


def _proto_message_class() -> Any:
    """A Protobuf message class built from a descriptor, as protoc's output would give."""
    file = descriptor_pb2.FileDescriptorProto(name="payment.proto", package="t", syntax="proto3")
    msg = file.message_type.add(name="Payment")
    label = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
    msg.field.add(
        name="id", number=1, label=label, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64
    )
    msg.field.add(
        name="method", number=2, label=label, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Payment"))


def test_protobuf_round_trip(client: SchemaRegistryClient, stack_settings: Settings) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer

    payment = _proto_message_class()
    topic = _new_topic(stack_settings)
    ctx = SerializationContext(topic, MessageField.VALUE)
    serializer = ProtobufSerializer(payment, client, conf={"use.deprecated.format": False})
    data = serializer(payment(id=7, method="card"), ctx)
    assert data is not None
    registered = client.get_latest_version(f"{topic}-value")
    assert (registered.version, registered.schema.schema_type) == (1, "PROTOBUF")
    assert _frame_id(data) == registered.schema_id

    (consumed,) = _produce_and_consume(stack_settings, topic, [data])
    # The writer schema comes back from the registry by id (a serialized FileDescriptorProto).
    deserializer = ProtobufDeserializer(payment, {"use.deprecated.format": False}, client)
    decoded = deserializer(consumed, ctx)
    assert (decoded.id, decoded.method) == (7, "card")
