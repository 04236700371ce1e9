"""A Debezium topic's envelope (``envelope: debezium``) is decoded alike by the replay's Spark
parse and by the content check's independent Python decode, with and without the embedded
schema: every record a row with the same typed values (the content hash), or quarantined with
the same reason. The corpus is the real connector's messages as docs/cdc.md records them, plus
malformed envelopes, each quarantined with a reason, never dropped. The real connector's
topics are backfilled end to end by the ``cdc`` tier (test_cdc_lake.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pydantic
import pytest

from backfill_assets.lake.decode import content, debezium
from backfill_assets.lake.decode.parse import parse
from backfill_assets.lake.write.record_diff import content_hash
from backfill_assets.spec.model import CDC_NAMES, TopicSpec

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

COLUMNS: list[dict[str, Any]] = [
    {"name": "id", "type": "bigint", "nullable": False},
    {"name": "balance", "type": "decimal(12,2)", "nullable": False},
    {"name": "updated_at", "type": "timestamp", "nullable": False},
    {"name": "attrs", "type": "string"},
    {"name": "profile", "type": "string"},
    {"name": "notes", "type": "string"},
]
SOURCE = {
    "version": "3.6.1.Final", "connector": "postgresql", "name": "shop_p",
    "ts_ms": 1795857909828, "snapshot": "false", "db": "shop", "sequence": '[null,"26372280"]',
    "ts_us": 1795857909828302, "ts_ns": 1795857909828302000, "schema": "public",
    "table": "accounts", "txId": 732, "lsn": 26372280, "xmin": None, "origin": None,
    "origin_lsn": None,
}  # fmt: skip
ROW1 = {
    "id": 1, "balance": "1234.50", "updated_at": "2024-03-10T12:34:56.789012Z",
    "attrs": '{"tags": ["a"], "tier": "pro"}', "profile": '{"name":  "one"}', "notes": "hello",
}  # fmt: skip


def spec(schemas: str | None, **extra: Any) -> TopicSpec:
    return TopicSpec.model_validate(
        {
            "topic": f"shop_{schemas}.public.accounts",
            "format": "json",
            "envelope": "debezium",
            "schemas": schemas,
            "key_field": "id",
            "partition_start": "2026-01-01T00:00:00+00:00",
            "allowed_lateness_hours": 0,
            "quarantine_max_ratio": 1.0,
            "columns": COLUMNS,
            **extra,
        }
    )


def envelope(op: str, after: Any, before: Any = None, lsn: Any = 26372280, **more: Any) -> Any:
    return {
        "before": before, "after": after, "source": {**SOURCE, "lsn": lsn}, "transaction": None,
        "op": op, "ts_ms": 1795857909944, "ts_us": 1795857909944766, **more,
    }  # fmt: skip


def _wrapped(value: Any, schemas: bool) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    document = {"schema": {"type": "struct"}, "payload": value} if schemas else value
    return json.dumps(document).encode()


# (key, value, expected: a dict of typed values for a row, or "q:<reason>")
CORPUS: list[tuple[Any, Any, Any]] = [
    (
        {"id": 1},
        envelope("r", ROW1),
        {"id": 1, "balance": Decimal("1234.50"), "notes": "hello", "cdc_op": "r",
         "cdc_lsn": 26372280, "cdc_event_id": "26372280:r:1", "cdc_unavailable": None},
    ),
    (
        {"id": 2},
        envelope("c", {**ROW1, "id": 2, "balance": "-0.05", "attrs": "null", "notes": None},
                 lsn=26372320),
        {"id": 2, "balance": Decimal("-0.05"), "attrs": "null", "notes": None, "cdc_op": "c"},
    ),
    (   # An unchanged TOAST value: NULL in the row, named in cdc_unavailable (not missing).
        {"id": 1},
        envelope("u", {**ROW1, "balance": "99.99", "notes": debezium.PLACEHOLDER}, lsn=26372528),
        {"id": 1, "balance": Decimal("99.99"), "notes": None, "cdc_unavailable": "notes"},
    ),
    (   # A NOT NULL numeric left out too.
        {"id": 1},
        envelope("u", {**ROW1, "balance": debezium.PLACEHOLDER, "notes": debezium.PLACEHOLDER},
                 lsn=26372529),
        {"id": 1, "balance": None, "cdc_unavailable": "balance,notes"},
    ),
    (   # A delete: the key from before, never its filler.
        {"id": 2},
        envelope("d", None, before={**ROW1, "id": 2, "balance": "0.00",
                                    "updated_at": "1970-01-01T00:00:00Z"}, lsn=26372736),
        {"id": 2, "balance": None, "updated_at_ms": None, "attrs": None, "cdc_op": "d",
         "cdc_event_id": "26372736:d:2"},
    ),
    ({"id": 2}, None, {"id": 2, "is_tombstone": True, "cdc_op": None, "cdc_lsn": None}),
    (b"not json", None, "q:missing_or_invalid:id"),
    ({"id": "2"}, None, "q:missing_or_invalid:id"),
    ({"id": 5}, envelope("c", None), "q:missing_or_invalid:after"),
    ({"id": 5}, envelope("d", None, before=None), "q:missing_or_invalid:before"),
    ({"id": 5}, envelope("t", None), "q:unsupported_op:t"),
    ({"id": 5}, {"before": None, "after": ROW1}, f"q:{debezium.NOT_ENVELOPE}"),
    ({"id": 5}, envelope(1, ROW1), f"q:{debezium.NOT_ENVELOPE}"),  # type: ignore[arg-type]
    ({"id": 5}, b"{not json", "q:invalid_json"),
    ({"id": 5}, b'{"op": "c", "op": "c"}', "q:invalid_json"),
    ({"id": 5}, b"[1, 2]", "q:not_json_object"),
    ({"id": 5}, b"\xff\xfe", "q:invalid_utf8"),
    ({"id": 5}, envelope("c", {**ROW1, "balance": "12.345"}), "q:missing_or_invalid:balance"),
    ({"id": 5}, envelope("c", {**ROW1, "balance": 12.5}), "q:missing_or_invalid:balance"),
    ({"id": 5}, envelope("c", {**ROW1, "balance": "1e3"}), "q:missing_or_invalid:balance"),
    (   # A timestamp without zone arrives as epoch microseconds: not read as a timestamptz.
        {"id": 5},
        envelope("c", {**ROW1, "updated_at": 1710074096789012}),
        "q:missing_or_invalid:updated_at",
    ),
    ({"id": 5}, envelope("c", {**ROW1, "id": "5"}), "q:missing_or_invalid:id"),
    ({"id": 5}, envelope("c", ROW1, lsn=None), "q:missing_or_invalid:cdc_lsn"),
    ({"id": 5}, envelope("c", {**ROW1, "attrs": {"a": 1}}), {"id": 1, "attrs": None}),
]  # fmt: skip


@pytest.mark.parametrize("schemas", ["none", "embedded"])
def test_spark_and_the_reference_decode_every_record_alike(
    spark_session: SparkSession, schemas: str
) -> None:
    topic = spec(schemas)
    embedded = schemas == "embedded"
    hour = datetime(2026, 1, 1, tzinfo=UTC)
    records = [
        (
            key if isinstance(key, bytes) else _wrapped(key, embedded),
            _wrapped(value, embedded),
        )
        for key, value, _ in CORPUS
    ]
    source = spark_session.createDataFrame(
        [(topic.topic, 0, i, hour, hour, i, k, v) for i, (k, v) in enumerate(records)],
        "topic string, partition int, offset long, timestamp timestamp, kafka_hour timestamp, "
        "record_hash long, key binary, value binary",
    )
    from pyspark.sql import functions as F

    rows, quarantine, parsed = parse(topic, source, "run")
    try:
        got_rows = {
            r["kafka_offset"]: r.asDict()
            for r in rows.select(
                "*",
                content_hash(topic).alias("_hash"),
                F.unix_micros("updated_at").alias("updated_at_ms"),
            ).collect()
        }
        got_q = {r["kafka_offset"]: r["reason"] for r in quarantine.collect()}
    finally:
        parsed.unpersist()
    decode = content.RecordDecoder(topic)
    for offset, ((_, _, want), (key, value)) in enumerate(zip(CORPUS, records, strict=True)):
        kind, detail = decode(0, offset, key, value)
        if isinstance(want, str):
            assert (got_q.get(offset), kind, detail) == (want[2:], content.QUARANTINED, want[2:])
            continue
        assert offset not in got_q, (offset, got_q.get(offset))
        row = got_rows[offset]
        assert {name: row[name] for name in want} == want, offset
        assert (kind, detail) == (content.ROW, row["_hash"]), offset
    assert set(got_rows) | set(got_q) == set(range(len(CORPUS)))


def test_an_unavailable_value_is_named_and_a_delete_holds_the_key_only() -> None:
    """The reference alone, on the docs' messages: what each column holds."""
    ref = debezium.Reference(spec("none"))
    update = ref(envelope("u", {**ROW1, "notes": debezium.PLACEHOLDER}, lsn=7))
    assert isinstance(update, dict)
    assert (update["notes"], update["cdc_unavailable"], update["cdc_event_id"]) == (
        None,
        "notes",
        "7:u:1",
    )
    assert update["updated_at"] == int(
        datetime(2024, 3, 10, 12, 34, 56, 789012, tzinfo=UTC).timestamp() * 1_000_000
    )
    delete = ref(envelope("d", None, before={**ROW1, "balance": "0.00"}, lsn=8))
    assert isinstance(delete, dict)
    assert {k: v for k, v in delete.items() if v is not None and k not in CDC_NAMES} == {"id": 1}
    assert ref.tombstone_key('{"id": 3}') == 3
    assert debezium.Reference(spec("embedded")).tombstone_key('{"payload": {"id": 3}}') == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"format": "protobuf"}, "reads Kafka's JSON converter .* or Avro"),
        ({"format": "avro"}, "a Debezium avro topic's schemas are in the registry"),
        ({"envelope": "debezium"}, "schemas: a Debezium topic says how its converter writes"),
        ({"version_field": "v"}, "version_field: a Debezium topic"),
        ({"current": {"order_by": "updated_at"}}, "orders by the source's log position"),
        (
            {"columns": [*COLUMNS, {"name": "cdc_op", "type": "string"}]},
            "names starting with cdc_ are the envelope's own",
        ),
    ],
)
def test_a_debezium_spec_says_what_does_not_fit(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        spec(None if "envelope" in extra else "none", **extra)


def test_a_debezium_spec_adds_the_cdc_columns_and_its_rule() -> None:
    s = spec("embedded")
    assert [c.name for c in s.columns] == [c["name"] for c in COLUMNS] + list(CDC_NAMES)
    assert [c.name for c in s.source_columns] == [c["name"] for c in COLUMNS]
    assert (s.event_id_field, s.event_time_field) == ("cdc_event_id", "cdc_source_ts")
    assert s.current_rule.deleted_when == "cdc_op = 'd'"
    assert TopicSpec.model_validate(s.model_dump()) == s  # a dumped spec loads the same
    with pytest.raises(pydantic.ValidationError, match="only a topic with `envelope: debezium`"):
        TopicSpec.model_validate(
            {**s.model_dump(), "envelope": None, "columns": COLUMNS, "current": None}
        )


def test_the_current_state_picks_by_source_position_not_arrival(
    spark_session: SparkSession,
) -> None:
    """Each key's latest row by (LSN, a snapshot read before a change at the same LSN), then
    the Kafka offset; a tombstone stands where its delete does. The cdc tier saw the first
    case for real: a re-snapshot's read of row 4 reached Kafka after the update, at the same
    LSN, showing the row before it."""
    from backfill_assets.lake.write.derived import picked_by_position

    hour = datetime(2026, 1, 1, tzinfo=UTC)
    # (id, offset, op or None for a tombstone, lsn)
    log = [
        (4, 3, "r", 100), (4, 17, "u", 200), (4, 18, "r", 200),  # a stale read, tied
        (2, 1, "r", 100), (2, 5, "d", 150), (2, 6, None, None),
        (2, 20, "r", 120),  # a read older than the delete, arriving after it
        (7, 8, "c", 300), (7, 9, "u", 300),  # two changes at one LSN: the offset decides
        (9, 30, None, None),  # a tombstone whose delete was compacted away
        (5, 2, "r", 100), (5, 40, "r", 100),  # the same read delivered twice
        (6, 10, "u", 400), (6, 11, "r", 90),  # a read from an older snapshot
    ]  # fmt: skip
    raw = spark_session.createDataFrame(
        [(i, op is None, hour, hour, 0, o, op, lsn) for i, o, op, lsn in log],
        "id bigint, is_tombstone boolean, kafka_timestamp timestamp, kafka_hour timestamp, "
        "kafka_partition int, kafka_offset bigint, cdc_op string, cdc_lsn bigint",
    )
    touched = raw.select("id").distinct()
    picked = picked_by_position(spec("none"), raw, touched).collect()
    offsets = {r["kafka_offset"] for r in picked}
    assert offsets == {17, 6, 9, 30, 40, 10}
