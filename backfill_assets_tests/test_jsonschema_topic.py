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
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import RESOURCES
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import Settings

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


@dataclass
class World:
    spec: TopicSpec
    result: dg.ExecuteInProcessResult
    # (partition, offset) -> what was produced: a row's expected values, or "q:<reason>"
    expected: dict[tuple[int, int], Any]
    values: dict[tuple[int, int], bytes | None]
    rows: dict[tuple[int, int], dict[str, Any]]
    quarantine: dict[tuple[int, int], Any]


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


def _produce(settings: Settings, topic: str, records: list[tuple[bytes | None, Any]]) -> list[int]:
    admin = AdminClient(dict(settings.kafka.client_config()))
    futures = admin.create_topics([NewTopic(topic, 1, 1, config={"retention.ms": "-1"})])
    futures[topic].result(timeout=30)
    producer = Producer({**settings.kafka.client_config(), "enable.idempotence": True})
    offsets: list[int] = []
    for i, (value, _) in enumerate(records):
        ts = int((HOUR0 + timedelta(minutes=2, seconds=i)).timestamp() * 1000)
        producer.produce(
            topic,
            value=value,
            key=f"o{i + 1}".encode(),
            timestamp=ts,
            on_delivery=lambda err, msg: offsets.append(-1 if err else msg.offset() or 0),
        )
    assert producer.flush(30) == 0
    assert sorted(offsets) == list(range(len(records)))
    return sorted(offsets)


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings, spark_session: SparkSession, registry: LocalRegistry
) -> Iterator[World]:
    topic = f"jsonschema_{uuid.uuid4().hex[:8]}"
    records = _records(SchemaRegistryClient({"url": registry.url}), topic)
    offsets = _produce(stack_settings, topic, records)
    ns = stack_settings.catalog.namespace
    with dg.instance_for_test() as instance:
        spec = _spec(topic)
        result = dg.materialize(
            [build_raw_asset(spec)],
            resources=RESOURCES,
            instance=instance,
            tags={
                "dagster/asset_partition_range_start": RANGE[0],
                "dagster/asset_partition_range_end": RANGE[1],
            },
            raise_on_error=False,
        )
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        quarantine: dict[tuple[int, int], Any] = {}
        if spark_session.catalog.tableExists(f"lake.{ns}.{spec.raw_table}"):
            table = spark_session.table(f"lake.{ns}.{spec.raw_table}")
            rows = {
                (r["kafka_partition"], r["kafka_offset"]): r.asDict()
                for r in table.selectExpr("*", "unix_millis(event_time) AS event_time_ms").collect()
            }
            quarantine = {
                (r["kafka_partition"], r["kafka_offset"]): r
                for r in spark_session.table(f"lake.{ns}.{spec.quarantine_table}").collect()
            }
    expected = {(0, o): want for o, (_, want) in zip(offsets, records, strict=True)}
    values = {(0, o): value for o, (value, _) in zip(offsets, records, strict=True)}
    yield World(spec, result, expected, values, rows, quarantine)


def test_run_publishes_with_every_check_green(world: World) -> None:
    assert world.result.success, [
        e.event_specific_data for e in world.result.all_events if e.is_failure
    ]
    checks = {e.check_name: e.passed for e in world.result.get_asset_check_evaluations()}
    assert checks and all(checks.values()), checks
    assert "decoded_content" in checks


def test_rows_equal_what_was_produced(world: World) -> None:
    want_rows = {k: v for k, v in world.expected.items() if isinstance(v, dict)}
    assert set(world.rows) == set(want_rows)
    for key, values in want_rows.items():
        got, want = world.rows[key], {"is_tombstone": False, **values}
        assert {name: got[name] for name in want} == want, key


def test_bad_records_are_quarantined_with_reason_offsets_and_bytes(world: World) -> None:
    want_q = {k: v[2:] for k, v in world.expected.items() if isinstance(v, str)}
    assert {k: r["reason"] for k, r in world.quarantine.items()} == want_q
    for key, r in world.quarantine.items():
        assert bytes(r["kafka_value"]) == world.values[key]
    # Nothing lost: every offset read is a row or a quarantine row, never both.
    assert set(world.rows) | set(world.quarantine) == set(world.expected)
    assert not set(world.rows) & set(world.quarantine)


def test_the_independent_decode_agrees_without_spark(world: World, registry: LocalRegistry) -> None:
    """The decoded_content check's decode (no Spark) gives every record's disposition."""
    from backfill_assets.lake import content

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
    from backfill_assets.lake import avro, json_schema
    from backfill_assets_tests.support.services import free_port

    assert json_schema.judge(3, ("JSON", ORDER)) == avro.Writer(3, writer=ORDER)
    assert json_schema.judge(4, None).reason == "unknown_schema_id:4"
    assert json_schema.judge(5, ("AVRO", AVRO)).reason == "incompatible_schema:5"
    assert json_schema.judge(6, ("PROTOBUF", "syntax")).reason == "incompatible_schema:6"
    check = json_schema.WireCheck("http://127.0.0.1:1")
    assert check(b'{"a": 1}') == check(b"\x00\x00") == "not_json_schema_wire_format"
    with pytest.raises(avro.RegistryUnavailable, match="schema registry: schema id 7"):
        json_schema.resolve(f"http://127.0.0.1:{free_port()}", [7])
