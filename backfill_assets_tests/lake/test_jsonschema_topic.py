"""A JSON Schema topic through the schema registry, backfilled by the raw asset (issue 28).

Records in Confluent's wire format (magic byte 0, the registry's 4-byte schema id, UTF-8 JSON)
are produced by confluent-kafka's JSONSerializer against a JSON schema registered in the real
registry. Spark strips the header, checks the id against the registry and parses the rest by
the plain JSON format's strict rules, so every row equals what was produced. A record with an
id the registry does not know, one whose id names an Avro schema, values not in the wire format
and payloads the strict JSON rules refuse are quarantined with their offsets, reasons and exact
bytes; every check (the independent decode, which never uses Spark, included) passes and
nothing is lost: rows + quarantine == offsets read.
"""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from backfill_assets.defs.assets import build_raw_asset
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

HOUR0 = datetime(2026, 2, 12, 5, tzinfo=UTC)
RANGE = ("2026-02-12-05:00", "2026-02-12-05:00")
ORDER = json.dumps(
    {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Order",
        "type": "object",
        "properties": {
            "event_id": {"type": "string"},
            "order_id": {"type": "string"},
            "amount": {"type": "integer"},
            "note": {"type": "string"},
            "event_time": {"type": "integer"},
        },
        "required": ["event_id", "order_id", "amount", "event_time"],
    }
)
# Registered under another subject as Avro: an id whose schema is not JSON Schema.
AVRO = json.dumps(
    {"type": "record", "name": "Order", "fields": [{"name": "event_id", "type": "string"}]}
)
UNKNOWN_ID = 987_653


def _spec(topic: str) -> TopicSpec:
    return TopicSpec.model_validate(
        {
            "topic": topic,
            "format": "json_schema",
            "key_field": "order_id",
            "event_id_field": "event_id",
            "event_time_field": "event_time",
            "partition_start": HOUR0.isoformat(),
            "allowed_lateness_hours": 0,
            # Most of this corpus is bad on purpose: the ratio check lets the run publish.
            "quarantine_max_ratio": 1.0,
            "columns": [
                {"name": "event_id", "type": "string", "nullable": False},
                {"name": "order_id", "type": "string", "nullable": False},
                {"name": "amount", "type": "bigint", "nullable": False},
                {"name": "note", "type": "string"},
                {"name": "event_time", "type": "timestamp", "nullable": False},
            ],
        }
    )


def _framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


def _records(client: SchemaRegistryClient, topic: str) -> list[tuple[bytes | None, Any]]:
    """(value bytes, expected row or "q:<reason>"), in produce order."""
    sid = client.register_schema(f"{topic}-value", Schema(ORDER, "JSON"))
    avro_id = client.register_schema(f"{topic}-legacy-value", Schema(AVRO, "AVRO"))
    assert sid != avro_id
    ctx = SerializationContext(topic, MessageField.VALUE)
    ms = int((HOUR0 + timedelta(minutes=3)).timestamp() * 1000)
    serializer = JSONSerializer(ORDER, client, conf={"auto.register.schemas": False})

    def ser(value: dict[str, Any]) -> bytes:
        data = serializer({**value, "event_time": ms}, ctx)
        assert isinstance(data, bytes) and data[:5] == _framed(sid, b"")
        return data

    def row(n: int, amount: int, note: str | None) -> dict[str, Any]:
        return {
            "event_id": f"e{n}",
            "order_id": f"o{n}",
            "amount": amount,
            "note": note,
            "event_time_ms": ms,
            "schema_version": 1,  # no version field: every record is the columns' version
        }

    good = ser({"event_id": "e1", "order_id": "o1", "amount": 10, "note": "first"})
    body = good[5:]
    return [
        (good, row(1, 10, "first")),
        (
            ser({"event_id": "e2", "order_id": "o2", "amount": 3_000_000_000}),
            row(2, 3_000_000_000, None),
        ),
        (_framed(UNKNOWN_ID, body), f"q:unknown_schema_id:{UNKNOWN_ID}"),
        (_framed(avro_id, body), f"q:incompatible_schema:{avro_id}"),
        # No magic byte: plain JSON on a JSON Schema topic.
        (b'{"event_id": "e5", "order_id": "o5", "amount": 5}', "q:not_json_schema_wire_format"),
        (b"\x00\x00\x01", "q:not_json_schema_wire_format"),  # shorter than the header
        # A known id, then what the plain JSON format's strict rules refuse.
        (_framed(sid, b'{"event_id": "e7", "event_id": "x"}'), "q:invalid_json"),
        (_framed(sid, b"[1, 2]"), "q:not_json_object"),
        (_framed(sid, b'{"event_id": "\xff"}'), "q:invalid_utf8"),
        (_framed(sid, b""), "q:invalid_json"),  # the header alone
        (
            _framed(sid, json.dumps({"event_id": "e11", "order_id": "o11"}).encode()),
            "q:missing_or_invalid:amount",
        ),
        # A tombstone (the 12th record, key o12): a row with its key field from the key.
        (None, {"order_id": "o12", "event_id": None, "amount": None, "is_tombstone": True}),
        # The key stands in for an absent key field, as for JSON topics.
        (
            _framed(sid, json.dumps({"event_id": "e13", "amount": 13, "event_time": ms}).encode()),
            row(13, 13, None),
        ),
    ]


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings, spark_session: SparkSession, registry: LocalRegistry
) -> Iterator[World]:
    topic = f"jsonschema_{uuid.uuid4().hex[:8]}"
    records = _records(SchemaRegistryClient({"url": registry.url}), topic)
    offsets = registry_topics.produce(stack_settings, topic, records, HOUR0)
    ns = stack_settings.catalog.namespace
    with dg.instance_for_test() as instance:
        spec = _spec(topic)
        result = materialize_range([build_raw_asset(spec)], instance, *RANGE, raise_on_error=False)
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        quarantine: dict[tuple[int, int], Any] = {}
        raw = f"lake.{ns}.{spec.raw_table}"
        if spark_session.catalog.tableExists(raw):
            rows = dicts_by_offset(spark_session, raw, *WITH_EVENT_TIME_MS)
            quarantine = rows_by_offset(spark_session, f"lake.{ns}.{spec.quarantine_table}")
    expected = {(0, o): want for o, (_, want) in zip(offsets, records, strict=True)}
    values = {(0, o): value for o, (value, _) in zip(offsets, records, strict=True)}
    yield World(spec, result, expected, values, rows, quarantine)


def test_run_publishes_with_every_check_green(world: World) -> None:
    registry_topics.assert_publishes_with_every_check_green(world)


def test_rows_equal_what_was_produced(world: World) -> None:
    registry_topics.assert_rows_equal_what_was_produced(world)


def test_bad_records_are_quarantined_with_reason_offsets_and_bytes(world: World) -> None:
    registry_topics.assert_bad_records_quarantined(world)


def test_the_independent_decode_agrees_without_spark(world: World, registry: LocalRegistry) -> None:
    """The decoded_content check's decode (no Spark) gives every record's disposition."""
    from backfill_assets.lake.decode import content

    decode = content.RecordDecoder(world.spec, registry.url)
    for (partition, offset), want in world.expected.items():
        key = f"o{offset + 1}".encode()
        kind, detail = decode(partition, offset, key, world.values[(partition, offset)])
        if isinstance(want, str):
            assert (kind, detail) == (content.QUARANTINED, want[2:]), offset
        else:
            assert kind == content.ROW, (offset, detail)


def test_each_id_is_judged_by_its_schema_type_and_an_outage_raises() -> None:
    """No stack: the Python judgement of an id (before any Spark expression), and a registry
    that does not answer fails the lookup (the run then publishes nothing)."""
    from backfill_assets.errors import RegistryUnavailable
    from backfill_assets.lake.decode import avro, json_schema
    from backfill_assets_tests.support.services import free_port

    assert json_schema.judge(3, ("JSON", ORDER)) == avro.Writer(3, writer=ORDER)
    assert json_schema.judge(4, None).reason == "unknown_schema_id:4"
    assert json_schema.judge(5, ("AVRO", AVRO)).reason == "incompatible_schema:5"
    assert json_schema.judge(6, ("PROTOBUF", "syntax")).reason == "incompatible_schema:6"
    check = json_schema.WireCheck("http://127.0.0.1:1")
    assert check(b'{"a": 1}') == check(b"\x00\x00") == "not_json_schema_wire_format"
    with pytest.raises(RegistryUnavailable, match="schema registry: schema id 7"):
        json_schema.resolve(f"http://127.0.0.1:{free_port()}", [7])
