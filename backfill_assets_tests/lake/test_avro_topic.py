"""An Avro topic through the schema registry, backfilled by the raw asset (issue 28).

Records in Confluent's wire format (magic byte 0, the registry's schema id, Avro binary) are
produced with three versions of the subject's schema: v2 adds ``currency`` with a default, v3
removes the optional ``note`` and widens ``amount`` from int to long. Spark decodes each record
with its writer schema, resolved to a reader schema built from the spec's columns, so every row
equals what was produced. A record with an id the registry does not know, one whose writer
schema cannot be resolved to the columns and one not in the wire format are quarantined with
their offsets and exact bytes; every check (the independent decode with confluent-kafka's
AvroDeserializer included) passes and nothing else is lost.
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
from confluent_kafka.schema_registry.avro import AvroSerializer
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

HOUR0 = datetime(2026, 2, 11, 5, tzinfo=UTC)
RANGE = ("2026-02-11-05:00", "2026-02-11-05:00")


def _order(fields: list[dict[str, Any]], name: str = "Order") -> str:
    return json.dumps({"type": "record", "name": name, "namespace": "shop", "fields": fields})


_EVENT = {"name": "event_id", "type": "string"}
_ORDER = {"name": "order_id", "type": "string"}
_TIME = {"name": "event_time", "type": {"type": "long", "logicalType": "timestamp-millis"}}
_NOTE = {"name": "note", "type": ["null", "string"], "default": None}
_CURRENCY = {"name": "currency", "type": "string", "default": "EUR"}
V1 = _order([_EVENT, _ORDER, {"name": "amount", "type": "int"}, _NOTE, _TIME])
V2 = _order([_EVENT, _ORDER, {"name": "amount", "type": "int"}, _NOTE, _CURRENCY, _TIME])
V3 = _order([_EVENT, _ORDER, {"name": "amount", "type": "long"}, _CURRENCY, _TIME])
# Registered under another subject: its amount is a string, which no Avro resolution reads as
# the bigint column.
BAD = _order([_EVENT, _ORDER, {"name": "amount", "type": "string"}, _TIME])
UNKNOWN_ID = 987_654


def _spec(topic: str) -> TopicSpec:
    return TopicSpec.model_validate(
        {
            "topic": topic,
            "format": "avro",
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


def _framed(schema_id: int, schema: str, value: dict[str, Any]) -> bytes:
    """``value`` in Confluent's wire format with ``schema_id``, written by fastavro."""
    import io

    import fastavro

    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(json.loads(schema)), value)
    return b"\x00" + struct.pack(">I", schema_id) + out.getvalue()


def _records(client: SchemaRegistryClient, topic: str) -> list[tuple[bytes | None, Any]]:
    """(value bytes, expected row or "q:<reason>"), in produce order."""
    subject = f"{topic}-value"
    ids = [client.register_schema(subject, Schema(V1, "AVRO"))]
    client.set_compatibility(subject, "BACKWARD")  # v2 and v3 are BACKWARD-compatible
    ids += [client.register_schema(subject, Schema(s, "AVRO")) for s in (V2, V3)]
    bad_id = client.register_schema(f"{topic}-legacy-value", Schema(BAD, "AVRO"))
    ctx = SerializationContext(topic, MessageField.VALUE)
    ms = int((HOUR0 + timedelta(minutes=3)).timestamp() * 1000)

    def ser(schema: str, value: dict[str, Any]) -> bytes:
        serializer = AvroSerializer(client, schema, conf={"auto.register.schemas": False})
        data = serializer({**value, "event_time": datetime.fromtimestamp(ms / 1000, UTC)}, ctx)
        assert isinstance(data, bytes)
        return data

    def row(n: int, amount: int, note: str | None, currency: str, sid: int) -> dict[str, Any]:
        return {
            "event_id": f"e{n}",
            "order_id": f"o{n}",
            "amount": amount,
            "note": note,
            "currency": currency,
            "event_time_ms": ms,
            "schema_version": sid,  # the raw table keeps the writer schema's registry id
        }

    v1 = ser(V1, {"event_id": "e1", "order_id": "o1", "amount": 10, "note": "first"})
    out: list[tuple[bytes | None, Any]] = [
        # v1: currency comes from the latest schema's default
        (v1, row(1, 10, "first", "EUR", ids[0])),
        (
            ser(V2, {"event_id": "e2", "order_id": "o2", "amount": 20, "currency": "USD"}),
            row(2, 20, None, "USD", ids[1]),
        ),
        # v3: note removed (NULL), amount beyond int
        (
            ser(V3, {"event_id": "e3", "order_id": "o3", "amount": 3_000_000_000, "currency": "G"}),
            row(3, 3_000_000_000, None, "G", ids[2]),
        ),
        (b"\x00" + struct.pack(">I", UNKNOWN_ID) + v1[5:], f"q:unknown_schema_id:{UNKNOWN_ID}"),
        (
            _framed(
                bad_id, BAD, {"event_id": "e5", "order_id": "o5", "amount": "x", "event_time": ms}
            ),
            f"q:incompatible_schema:{bad_id}",
        ),
        (b'{"event_id": "e6"}', "q:not_avro_wire_format"),
        (b"\x00\x00\x01", "q:not_avro_wire_format"),
        (
            ser(V2, {"event_id": "e8", "order_id": "o8", "amount": 80, "note": "n"}),
            row(8, 80, "n", "EUR", ids[1]),
        ),
        # A tombstone (the 9th record, key o9): a row with its key field from the key.
        (None, {"order_id": "o9", "event_id": None, "amount": None, "is_tombstone": True}),
        # A known id whose payload is cut short: Spark's PERMISSIVE from_avro gives a struct of
        # NULLs there, not a NULL struct; the reason must still be the decode's.
        (v1[:9], f"q:invalid_avro:{ids[0]}"),
    ]
    assert len(set(ids)) == 3 and bad_id not in ids
    return out


def _produce(settings: Settings, topic: str, records: list[tuple[bytes | None, Any]]) -> list[int]:
    """The records produced at this module's hour (test_connect reuses it)."""
    return registry_topics.produce(settings, topic, records, HOUR0)


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings, spark_session: SparkSession, registry: LocalRegistry
) -> Iterator[World]:
    topic = f"avro_{uuid.uuid4().hex[:8]}"
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


def test_each_writer_is_judged_against_the_columns_reader_schema() -> None:
    """No stack: the Python judgement that decides, before any Spark expression, which ids
    decode and which are quarantined (the avro package's resolution rules)."""
    from backfill_assets.lake.decode import avro, envelope

    spec = _spec("judged")
    latest = {f["name"]: f for f in json.loads(V3)["fields"]}
    for sid, writer in enumerate((V1, V2, V3), start=1):
        verdict = avro.judge(spec, sid, writer, latest)
        assert verdict.reason is None and verdict.reader is not None, sid
        reader = json.loads(verdict.reader)
        assert (reader["name"], reader["namespace"]) == ("Order", "shop")
        fields = {f["name"]: f for f in reader["fields"]}
        # The latest schema's default for currency; NULL for the others.
        assert fields["currency"] == {
            "name": "currency",
            "type": ["string", "null"],
            "default": "EUR",
        }
        assert fields["amount"]["type"] == ["null", "long"]
    assert avro.judge(spec, 9, BAD, latest).reason == "incompatible_schema:9"
    assert avro.judge(spec, 8, None, latest).reason == "unknown_schema_id:8"
    # Not a record at all: never decoded.
    assert avro.judge(spec, 7, '"string"', latest).reason == "incompatible_schema:7"
    # A writer whose column type cannot be resolved (a boolean event_time) is refused too.
    odd = _order(
        [
            _EVENT,
            _ORDER,
            {"name": "amount", "type": "int"},
            {"name": "event_time", "type": "boolean"},
        ]
    )
    assert avro.judge(spec, 6, odd, latest).reason == "incompatible_schema:6"
    assert envelope.schema_id(b"\x00\x00\x00\x01\x00") == 256
    assert envelope.schema_id(b"\x00\x00\x01") is None and envelope.schema_id(b"{}") is None


def test_registry_outage_fails_the_run_and_the_retry_publishes(
    stack_settings: Settings,
    spark_session: SparkSession,
    registry: LocalRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from backfill_assets_tests.support.services import free_port

    topic = f"avro_outage_{uuid.uuid4().hex[:8]}"
    spec = _spec(topic)
    records = _records(SchemaRegistryClient({"url": registry.url}), topic)[:3]
    _produce(stack_settings, topic, records)
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    with dg.instance_for_test() as instance:
        # Nothing answers there: the run fails, naming the registry, and publishes nothing.
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
        retried = materialize_range([build_raw_asset(spec)], instance, *RANGE)
        assert retried.success
        assert spark_session.table(table).count() == 3


def test_the_window_scan_collects_every_schema_id_of_the_wire_format() -> None:
    """No stack: the librdkafka scan's cells note each value's schema id (the writers the
    parse resolves) and nothing for other values, so no second read of Kafka is needed."""
    from backfill_assets.lake.offsets.windows import Cell, Windows

    first, second = Cell(0, 0), Cell(10, 10)
    values = [
        (first, _framed(7, V1, {"event_id": "e", "order_id": "o", "amount": 1, "event_time": 0})),
        (first, b"\x00" + struct.pack(">I", 4_000_000_000) + b"payload"),  # unsigned id
        (second, b"\x00\x00\x00\x00\x05"),  # header only: id 5
        (second, b"\x00\x00\x01"),  # too short for the wire format
        (second, b'{"event_id": "e"}'),
        (second, None),  # a tombstone
    ]
    for i, (cell, value) in enumerate(values):
        cell.add(i, b"k", value, 0)
    assert (first.schema_ids, second.schema_ids) == ({7, 4_000_000_000}, {5})
    windows = Windows(
        "t",
        HOUR0,
        HOUR0 + timedelta(hours=2),
        {HOUR0: {0: first}, HOUR0 + timedelta(hours=1): {0: second}},
    )
    assert windows.schema_ids == [5, 7, 4_000_000_000]


@pytest.mark.slow
def test_a_wrong_reader_default_in_spark_fails_decoded_content_and_main_is_unchanged(
    stack_settings: Settings,
    spark_session: SparkSession,
    registry: LocalRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fault decoded_content exists to catch in an Avro topic: Spark decodes with a reader
    schema that differs from the one the registry's schemas give (here the default of a field
    the v1 writer lacks), so the bytes and the counts are right and only the values are wrong.
    The independent decode (AvroDeserializer, its own registry client) sees it; nothing is
    published."""
    import dataclasses

    from backfill_assets.lake.decode import avro

    topic = f"avro_default_{uuid.uuid4().hex[:8]}"
    spec = _spec(topic)
    _produce(
        stack_settings, topic, _records(SchemaRegistryClient({"url": registry.url}), topic)[:3]
    )
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    real_resolve = avro.resolve

    def wrong_default(
        spec: TopicSpec, url: str, ids: Any, auth: Any = None
    ) -> dict[int, avro.Writer]:
        writers = real_resolve(spec, url, ids, auth)
        for sid, w in writers.items():
            if w.reader is not None:
                reader = json.loads(w.reader)
                for f in reader["fields"]:
                    if f["name"] == "currency":
                        f["default"] = "XXX"
                writers[sid] = dataclasses.replace(w, reader=json.dumps(reader))
        return writers

    with dg.instance_for_test() as instance:
        assert materialize_range([build_raw_asset(spec)], instance, *RANGE).success
        snapshot = f"SELECT snapshot_id FROM {table}.refs WHERE name = 'main'"
        before = spark_session.sql(snapshot).collect()
        rows_before = sorted(map(tuple, spark_session.table(table).drop("ingest_run_id").collect()))
        with monkeypatch.context() as mp:
            mp.setattr(avro, "resolve", wrong_default)
            wrong = materialize_range(
                [build_raw_asset(spec)], instance, *RANGE, raise_on_error=False
            )
    assert not wrong.success
    checks = {e.check_name: e for e in wrong.get_asset_check_evaluations()}
    assert {name for name, e in checks.items() if not e.passed} == {"decoded_content"}
    assert "content differs" in str(checks["decoded_content"].description)
    assert spark_session.sql(snapshot).collect() == before
    rows_after = sorted(map(tuple, spark_session.table(table).drop("ingest_run_id").collect()))
    assert rows_after == rows_before
    assert checks["decoded_content"].metadata["hours_that_differ"].value == [HOUR0.isoformat()]
