"""A Debezium topic in Avro through the schema registry (``format: avro``, ``envelope:
debezium``) is decoded alike by the replay's Spark parse and by the content check's own decode
(confluent-kafka's AvroDeserializer, then the JSON envelope's reference rules): every record a
row with the same typed values, or quarantined with the same reason. The writer schemas are the
ones the real connector registered through Apicurio's converter (the ``cdc`` tier,
test_cdc_avro.py, backfills such a topic end to end); the records are written here with
fastavro in Confluent's wire format."""

from __future__ import annotations

import io
import json
import struct
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import fastavro
import pydantic
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from backfill_assets.lake.decode import content, debezium, debezium_avro
from backfill_assets.lake.decode.parse import parse
from backfill_assets.lake.write.record_diff import content_hash
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.registry import LocalRegistry

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TOPIC = "avro_u.public.accounts"
COLUMNS: list[dict[str, Any]] = [
    {"name": "id", "type": "bigint", "nullable": False},
    {"name": "balance", "type": "decimal(12,2)", "nullable": False},
    {"name": "updated_at", "type": "timestamp", "nullable": False},
    {"name": "attrs", "type": "string"},
    {"name": "profile", "type": "string"},
    {"name": "notes", "type": "string"},
]
_JSON = {"type": "string", "connect.version": 1, "connect.name": "io.debezium.data.Json"}
_ZONED = {"type": "string", "connect.version": 1, "connect.name": "io.debezium.time.ZonedTimestamp"}
_LONGS = ("ts_us", "ts_ns", "txId", "lsn", "xmin", "origin_lsn")
SOURCE_SCHEMA = {
    "type": "record", "name": "Source", "namespace": "io.debezium.connector.postgresql",
    "fields": [
        {"name": "version", "type": "string"}, {"name": "connector", "type": "string"},
        {"name": "name", "type": "string"}, {"name": "ts_ms", "type": "long"},
        {"name": "snapshot", "type": [{"type": "string", "connect.name": "io.debezium.data.Enum"},
                                      "null"], "default": "false"},
        {"name": "db", "type": "string"},
        {"name": "sequence", "type": ["null", "string"], "default": None},
        {"name": "schema", "type": "string"}, {"name": "table", "type": "string"},
        *({"name": n, "type": ["null", "long"], "default": None} for n in _LONGS),
        {"name": "origin", "type": ["null", "string"], "default": None},
    ],
    "connect.name": "io.debezium.connector.postgresql.Source",
}  # fmt: skip


def value_fields(extra: bool = True) -> list[dict[str, Any]]:
    """The table's Value record fields as the converter writes them (``extra``: with notes)."""
    fields: list[dict[str, Any]] = [
        {"name": "id", "type": "long"},
        {"name": "balance", "type": "string"},
        {"name": "updated_at", "type": _ZONED},
        {"name": "attrs", "type": ["null", _JSON], "default": None},
        {"name": "profile", "type": ["null", _JSON], "default": None},
    ]
    if extra:
        fields.append({"name": "notes", "type": ["null", "string"], "default": None})
    return fields


def envelope_schema(source: Any = SOURCE_SCHEMA, extra: bool = True) -> dict[str, Any]:
    """Debezium's Envelope as Apicurio's converter registers it (dereference-schema)."""
    value = {"type": "record", "name": "Value", "fields": value_fields(extra),
             "connect.name": "avro_u.public.accounts.Value"}  # fmt: skip
    return {
        "type": "record", "name": "Envelope", "namespace": "avro_u.public.accounts",
        "fields": [
            {"name": "before", "type": ["null", value], "default": None},
            {"name": "after", "type": ["null", "Value"], "default": None},
            {"name": "source", "type": source},
            {"name": "op", "type": "string"},
            {"name": "ts_ms", "type": ["null", "long"], "default": None},
        ],
        "connect.version": 2, "connect.name": "avro_u.public.accounts.Envelope",
    }  # fmt: skip


KEY_SCHEMA = {"type": "record", "name": "Key", "namespace": "avro_u.public.accounts",
              "fields": [{"name": "id", "type": "long"}]}  # fmt: skip
SOURCE = {
    "version": "3.6.1.Final", "connector": "postgresql", "name": "avro_u", "ts_ms": 1795857909828,
    "snapshot": "false", "db": "shop", "sequence": None, "schema": "public", "table": "accounts",
    **dict.fromkeys(_LONGS), "origin": None,
}  # fmt: skip
ROW1 = {
    "id": 1, "balance": "1234.50", "updated_at": "2024-03-10T12:34:56.789012Z",
    "attrs": '{"tags": ["a"], "tier": "pro"}', "profile": '{"name":  "one"}', "notes": "hello",
}  # fmt: skip


def spec(**extra: Any) -> TopicSpec:
    return TopicSpec.model_validate(
        {
            "topic": TOPIC, "format": "avro", "envelope": "debezium", "key_field": "id",
            "partition_start": "2026-01-01T00:00:00+00:00", "allowed_lateness_hours": 0,
            "quarantine_max_ratio": 1.0, "columns": COLUMNS, **extra,
        }
    )  # fmt: skip


def envelope(op: str, after: Any, before: Any = None, lsn: Any = 26372280) -> dict[str, Any]:
    return {"before": before, "after": after, "source": {**SOURCE, "lsn": lsn}, "op": op,
            "ts_ms": 1795857909944}  # fmt: skip


def wire(sid: int, schema: Any, record: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return b"\x00" + struct.pack(">I", sid) + out.getvalue()


@pytest.fixture(scope="module")
def ids(registry: LocalRegistry) -> dict[str, int]:
    """The schemas registered as the converter does (subjects <topic>-key and -value), an
    older envelope without a column, another key schema and an envelope the columns cannot
    read."""
    client = SchemaRegistryClient({"url": registry.url})

    def register(subject: str, schema: Any) -> int:
        return int(client.register_schema(subject, Schema(json.dumps(schema), "AVRO")))

    # A key column written as a string: it does not resolve to the bigint column's long.
    string_id = envelope_schema()
    string_id["fields"][0]["type"][1]["fields"][0]["type"] = "string"

    return {
        "value": register(f"{TOPIC}-value", envelope_schema()),
        "key": register(f"{TOPIC}-key", KEY_SCHEMA),
        "old": register("avro_u-old", envelope_schema(extra=False)),
        "other_key": register("avro_u-other-key", {**KEY_SCHEMA, "name": "OtherKey"}),
        "string_id": register("avro_u-bad", string_id),
    }


def corpus(ids: dict[str, int]) -> list[tuple[bytes | None, bytes | None, Any]]:
    """(key, value, expected: typed values of a row, or "q:<reason>")."""
    env, old = envelope_schema(), envelope_schema(extra=False)
    bad = envelope_schema()
    bad["fields"][0]["type"][1]["fields"][0]["type"] = "string"

    def key(i: int, sid: int = ids["key"]) -> bytes:
        return wire(sid, KEY_SCHEMA, {"id": i})

    def value(record: Any, sid: int = ids["value"], schema: Any = env) -> bytes:
        return wire(sid, schema, record)

    q = "q:"
    return [
        (key(1), value(envelope("r", ROW1)),
         {"id": 1, "balance": Decimal("1234.50"), "notes": "hello", "cdc_op": "r",
          "cdc_lsn": 26372280, "cdc_event_id": "26372280:r:1", "cdc_unavailable": None}),
        (key(1), value(envelope("u", {**ROW1, "notes": debezium.PLACEHOLDER}, lsn=26372528)),
         {"id": 1, "notes": None, "cdc_unavailable": "notes"}),
        (key(2), value(envelope("d", None, before={**ROW1, "id": 2, "balance": "0.00"})),
         {"id": 2, "balance": None, "cdc_op": "d"}),
        (key(2), None, {"id": 2, "is_tombstone": True, "cdc_op": None}),
        (key(3, ids["other_key"]), None, f"{q}missing_or_invalid:id"),
        (b"3", None, f"{q}missing_or_invalid:id"),
        # A writer without a column: NULL there (a column the source did not have yet).
        (key(4), value(envelope("c", {k: v for k, v in ROW1.items() if k != "notes"}),
                       ids["old"], old),
         {"id": 1, "notes": None}),
        (key(5), value(envelope("c", {**ROW1, "balance": "12.345"})),
         f"{q}missing_or_invalid:balance"),
        (key(5), value(envelope("c", {**ROW1, "updated_at": "yesterday"})),
         f"{q}missing_or_invalid:updated_at"),
        (key(5), value(envelope("t", None)), f"{q}unsupported_op:t"),
        (key(5), value(envelope("c", None)), f"{q}missing_or_invalid:after"),
        (key(5), value(envelope("d", None)), f"{q}missing_or_invalid:before"),
        (key(5), value(envelope("c", ROW1, lsn=None)), f"{q}missing_or_invalid:cdc_lsn"),
        (key(5), b"\x00" + struct.pack(">I", ids["value"]) + b"\xff\xff",
         f"{q}invalid_avro:{ids['value']}"),
        (key(5), value(envelope("c", ROW1), 99999), f"{q}unknown_schema_id:99999"),
        (key(5), b'{"op": "c"}', f"{q}not_avro_wire_format"),
        (key(5), value(envelope("c", {**ROW1, "id": "5"}), ids["string_id"], bad),
         f"{q}incompatible_schema:{ids['string_id']}"),
    ]  # fmt: skip


def test_spark_and_the_reference_decode_every_record_alike(
    spark_session: SparkSession, registry: LocalRegistry, ids: dict[str, int]
) -> None:

    topic = spec()
    records = corpus(ids)
    hour = datetime(2026, 1, 1, tzinfo=UTC)
    source = spark_session.createDataFrame(
        [(TOPIC, 0, i, hour, hour, i, k, v) for i, (k, v, _) in enumerate(records)],
        "topic string, partition int, offset long, timestamp timestamp, kafka_hour timestamp, "
        "record_hash long, key binary, value binary",
    )
    value_ids = {struct.unpack(">I", v[1:5])[0] for _, v, _ in records if v and v[0] == 0}
    writers = debezium_avro.resolve(topic, registry.url, value_ids)
    assert set(writers.keys) == {ids["key"]}  # the key subject's versions only
    rows, quarantine, parsed = parse(topic, source, "run", writers)
    try:
        got_rows = {
            r["kafka_offset"]: r.asDict()
            for r in rows.select("*", content_hash(topic).alias("_hash")).collect()
        }
        got_q = {r["kafka_offset"]: r["reason"] for r in quarantine.collect()}
    finally:
        parsed.unpersist()
    decode = content.RecordDecoder(topic, registry.url)
    for offset, (key, value, want) in enumerate(records):
        kind, detail = decode(0, offset, key, value)
        if isinstance(want, str):
            assert (got_q.get(offset), kind, detail) == (want[2:], content.QUARANTINED, want[2:])
            continue
        assert offset not in got_q, (offset, got_q.get(offset))
        row = got_rows[offset]
        assert {name: row[name] for name in want} == want, offset
        assert (kind, detail) == (content.ROW, row["_hash"]), offset
        assert row["schema_version"] == (
            None if value is None else struct.unpack(">I", value[1:5])[0]
        )
    assert set(got_rows) | set(got_q) == set(range(len(records)))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"schemas": "none"}, "a Debezium avro topic's schemas are in the registry"),
        (
            {"columns": [*COLUMNS, {"name": "score", "type": "double"}]},
            "a Debezium avro topic reads string, bigint",
        ),
    ],
)
def test_a_debezium_avro_spec_says_what_does_not_fit(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        spec(**extra)
