"""Every kind of bad input has one exact, documented disposition; nothing is dropped silently.

A corpus of valid and bad records is produced to a fresh topic (two partitions, two hours of
2026-02-10, explicit CreateTime timestamps) and backfilled through Dagster. Each record, found by
(partition, offset), must end up exactly where the rule below says: a table row, a quarantine row
with that exact reason (holding the record's exact key and value bytes). Nothing is read and
then left out: read == written + quarantined must hold per hour and in total, in the asset's
metadata and in the checks' metadata, where "read" is Kafka's own count of committed records.

The rules (first match wins; :data:`backfill_assets.lake.decode.parse.QUARANTINE_RULES`):

* **too large**: key + value above the topic's ``max_record_bytes`` (topics.yaml, default
  1 MiB, Kafka's own default limit) -> ``record_too_large:<bytes>``, even if the JSON is valid.
  Below the limit a big record is judged like any other (a 300 kB valid record is a row).
* **tombstone** (NULL value): a row (``is_tombstone``, payload columns NULL, key field from the
  key), unless the key is missing or not UTF-8 -> ``missing_or_invalid:order_id`` (a delete
  that names no order cannot be applied). Repeated tombstones are all kept.
* **empty value** (zero bytes, not NULL): ``empty_value``. Kafka deletes only on NULL.
* **non-UTF-8 value**: ``invalid_utf8`` (before, bytes inside a JSON string were silently
  replaced by U+FFFD and the record accepted).
* **malformed JSON** -> ``invalid_json``: cut, single quotes, NaN, duplicate field names,
  whitespace only, nesting deeper than the parser's limit (1000), and trailing data after the
  object (``{...} junk``, ``{...}{...}``), which Spark's parser used to ignore, keeping the first
  object and silently losing the rest. Trailing whitespace is fine.
* **JSON that is not an object** (array, number, string, boolean, null) -> ``not_json_object``
  (was ``unknown_schema_version:?``).
* **schema version** not an upcaster's -> ``unknown_schema_version:<n>``; absent or not a JSON
  integer (``"2"``, ``2.5``) -> ``unknown_schema_version:?`` (``"2"`` and ``2.5`` used to be
  coerced to version 2).
* **wrong types** -> ``missing_or_invalid:<column>``: a value is read only from the JSON kind of
  its column; numbers only when they convert without loss. ``"1234"``, ``true`` or ``12.7`` for
  a bigint, ``123`` or ``{...}`` or ``[...]`` for a string, ``12.345`` for a v1 amount (two
  decimals) are quarantined; Spark's variant casts used to coerce, truncate or round them
  (``12.7`` -> 12, ``{"id":1}`` -> the string ``{"id":1}``). ``500.0`` and ``5e2`` are 500.
* **missing or null event time** -> ``missing_or_invalid:event_time``; an epoch-ms value that
  overflows Spark's timestamp (``1e16``) is also missing (it used to fail the whole run with
  "long overflow"); a timestamp outside 1900..2200 -> ``out_of_range:event_time``.
* **huge numbers**: beyond bigint (or ``1e400``) -> ``missing_or_invalid:amount_minor``; within
  bigint but beyond the column's max -> ``above_max:amount_minor``; below min -> ``below_min``.
* **deep nesting** in a field nobody reads (500 levels) is ignored: a row. Unknown fields are
  ignored.
* **binary (non-UTF-8) keys** are stored as their exact bytes in ``kafka_key``; the order id
  comes from the payload. The key stands in only for an order id the payload lacks, and only
  if it is UTF-8 text; otherwise ``missing_or_invalid:order_id`` (it used to become a garbage
  string).
* **headers** (binary values, non-UTF-8 bytes, repeated names, empty names, NULL values) are
  not read and never change a record's disposition.
* **duplicates** (same event id): the raw table is the committed log, so every copy is a row
  (re-running any sub-range must give the same rows); the asset counts repeated ids in
  ``resent_event_ids`` (and ids whose copies differ in ``conflicting_event_ids``). The derived
  tables apply the duplicates rule (:mod:`backfill_assets.lake.write.derived`). A quarantined copy
  is
  not a row: a valid later copy of a quarantined event is.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range, rows_by_offset

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HOUR0 = datetime(2026, 2, 10, 5, tzinfo=UTC)
HOURS = [HOUR0.isoformat(), HOUR0.replace(hour=6).isoformat()]
RANGE = ("2026-02-10-05:00", "2026-02-10-06:00")  # inclusive: both hours, one run
MAX_BYTES = 4 * 1024 * 1024  # topic max.message.bytes and producer message.max.bytes
ROW, DUP = "row", "row (repeated event id)"
BIG_KEY = b"\xff\xfe\x00\x01binary-key"


@dataclasses.dataclass
class Rec:
    label: str
    hour: int
    partition: int
    key: bytes | None
    value: bytes | None
    expect: str  # ROW, DUP or "q:<reason>"
    headers: list[tuple[str, bytes | str | None]] | None = None
    offset: int = -1


def _payload(n: str, version: int = 2, hour: int = 0, **over: Any) -> dict[str, Any]:
    """A valid payload of ``version`` for event ``ev-<n>``, with ``over`` fields replaced."""
    ts = HOUR0.replace(hour=5 + hour, minute=1)
    p: dict[str, Any] = {
        "schema_version": version,
        "event_id": f"ev-{n}",
        "order_id": f"o-{n}",
        "customer_id": "c-00001",
        "event_type": "created",
        "status": "open",
        "currency": "EUR",
    }
    if version == 1:
        p["amount"] = 12.34
        p["event_time"] = ts.strftime("%Y-%m-%dT%H:%M:%S.000Z")
    else:
        p["amount_minor"] = 1234
        p["channel"] = "web"
        p["event_time"] = int(ts.timestamp() * 1000)
    for k, v in over.items():
        if v is _DROP:
            p.pop(k)
        else:
            p[k] = v
    return p


_DROP = object()


def _enc(payload: dict[str, Any], **literals: str) -> bytes:
    """JSON bytes; ``literals`` replace the string ``"@name@"`` with raw JSON text."""
    text = json.dumps(payload, separators=(",", ":"))
    for name, literal in literals.items():
        text = text.replace(f'"@{name}@"', literal)
    return text.encode()


def _corpus() -> list[Rec]:
    recs: list[Rec] = []

    def add(label: str, value: bytes | None, expect: str, **kw: Any) -> None:
        kw.setdefault("hour", 0)
        kw.setdefault("partition", len(recs) % 2)
        kw.setdefault("key", f"o-{label}".encode())
        recs.append(Rec(label, value=value, expect=expect, **kw))

    def field(label: str, expect: str, version: int = 2, lit: str = "", **over: Any) -> None:
        """A payload with fields overridden (``"@x@"`` stands for the raw JSON ``lit``)."""
        add(label, _enc(_payload(label, version, **over), x=lit), expect)

    bad = "q:missing_or_invalid:"
    # Valid records, both versions, both hours.
    for i in range(6):
        add(f"ok{i}", _enc(_payload(f"ok{i}", hour=i % 2)), ROW, hour=i % 2)
    field("v1ok", ROW, version=1)
    add("ws", _enc(_payload("ws")) + b" \n\t", ROW)
    # Malformed JSON.
    full = _enc(_payload("cut"))
    add("cut", full[: len(full) // 2], "q:invalid_json")
    add("trailing", _enc(_payload("trailing")) + b" junk", "q:invalid_json")
    add("two_objects", _enc(_payload("two_a")) + _enc(_payload("two_b")), "q:invalid_json")
    add("trailing_comma", _enc(_payload("tc")) + b",", "q:invalid_json")
    add("single_quotes", b"{'schema_version': 2, 'event_id': 'x'}", "q:invalid_json")
    field("nan", "q:invalid_json", amount_minor=float("nan"))
    add("dup_names", _enc(_payload("dupname"))[:-1] + b',"order_id":"o-x"}', "q:invalid_json")
    add("blank", b"   ", "q:invalid_json")
    # Wrong types.
    field("amt_str", bad + "amount_minor", amount_minor="1234")
    field("amt_frac", bad + "amount_minor", amount_minor=12.7)
    field("amt_bool", bad + "amount_minor", amount_minor=True)
    field("amt_int_dec", ROW, amount_minor="@x@", lit="500.0")
    field("amt_exp", ROW, amount_minor="@x@", lit="5e2")
    field("cust_obj", bad + "customer_id", customer_id={"id": 1})
    field("cust_num", bad + "customer_id", customer_id=123)
    field("cur_arr", bad + "currency", currency=["EUR"])
    field("et_str", bad + "event_time", event_time="1770699660000")
    field("v1_et_num", bad + "event_time", version=1, event_time=1234)
    field("v1_amt_str", bad + "amount_minor", version=1, amount="12.34")
    field("v1_amt_3dp", bad + "amount_minor", version=1, amount=12.345)
    # Schema versions.
    field("ver9", "q:unknown_schema_version:9", schema_version=9)
    field("ver0", "q:unknown_schema_version:0", schema_version=0)
    field("ver_missing", "q:unknown_schema_version:?", schema_version=_DROP)
    field("ver_str", "q:unknown_schema_version:?", schema_version="2")
    field("ver_frac", "q:unknown_schema_version:?", schema_version=2.5)
    # Missing and null event time.
    field("et_missing", bad + "event_time", event_time=_DROP)
    field("v1_et_missing", bad + "event_time", version=1, event_time=_DROP)
    field("et_null", bad + "event_time", event_time=None)
    # Huge numbers and ranges.
    field("amt_huge", bad + "amount_minor", amount_minor="@x@", lit="1" + "0" * 30)
    field("amt_inf", bad + "amount_minor", amount_minor="@x@", lit="1e400")
    field("amt_maxlong", "q:above_max:amount_minor", amount_minor=2**63 - 1)
    field("amt_neg", "q:below_min:amount_minor", amount_minor=-5)
    field("et_overflow", bad + "event_time", event_time=10**16)
    field("et_far", "q:out_of_range:event_time", event_time=99_999_999_999_999)
    field("v1_et_old", "q:out_of_range:event_time", version=1, event_time="1234-01-01T00:00:00Z")
    field("cur_xxx", "q:not_allowed:currency", currency="XXX")
    # Deep nesting, in a field nobody reads.
    field("deep_ok", ROW, extra="@x@", lit="[" * 500 + "]" * 500)
    field("deep_bad", "q:invalid_json", extra="@x@", lit="[" * 5000 + "]" * 5000)
    # Not an object.
    for label, text in [
        ("arr", b"[1,2]"),
        ("num", b"42"),
        ("str", b'"text"'),
        ("null", b"null"),
        ("bool", b"true"),
        ("arr_of_obj", b"[" + _enc(_payload("arr_of_obj")) + b"]"),
    ]:
        add(f"json_{label}", text, "q:not_json_object")
    # Encodings.
    add(
        "latin1",
        _enc(_payload("latin1", customer_id="c-@")).replace(b"@", b"\xe9"),
        "q:invalid_utf8",
    )
    add("bom_junk", b"\xff\xfe" + _enc(_payload("bom")), "q:invalid_utf8")
    # Empty value vs tombstone.
    add("empty", b"", "q:empty_value")
    add("tomb", None, ROW, key=b"o-tomb")
    add("tomb_again", None, ROW, key=b"o-tomb", hour=1)
    add("tomb_nokey", None, bad + "order_id", key=None)
    add("tomb_binkey", None, bad + "order_id", key=BIG_KEY)
    # Keys.
    add("binkey", _enc(_payload("binkey")), ROW, key=BIG_KEY)
    add("nullkey", _enc(_payload("nullkey")), ROW, key=None)
    add("no_oid_textkey", _enc(_payload("nooid", order_id=_DROP)), ROW, key=b"o-from-key")
    add("no_oid_binkey", _enc(_payload("nooid2", order_id=_DROP)), bad + "order_id", key=BIG_KEY)
    field("null_oid_textkey", bad + "order_id", order_id=None)
    # Odd headers never change the disposition.
    odd: list[tuple[str, bytes | str | None]] = [
        ("bin", b"\x00\xff\xfe\x80"),
        ("", b"empty-name"),
        ("dup", b"1"),
        ("dup", b"2"),
        ("n\u00e4me", "v\u00e4lue"),
        ("nul", None),
    ]
    add("headers_ok", _enc(_payload("hdr")), ROW, headers=odd)
    add("headers_bad", b"{oops", "q:invalid_json", headers=odd)
    # Size: judged like any record below the topic's limit, quarantined above it.
    add("big_ok", _enc(_payload("big_ok", padding="x" * 300_000)), ROW)
    big = _enc(_payload("big", padding="x" * 1_100_000))
    add("big", big, f"q:record_too_large:{len(b'o-big') + len(big)}")
    # Duplicates: same event id; the lowest (partition, offset) row wins.
    dup = _enc(_payload("dup"))
    add("dup_first", dup, ROW, partition=0)
    add("dup_again", dup, DUP, partition=0)
    add("dup_next_hour", dup, DUP, partition=0, hour=1)
    add("dup_other_partition", dup, DUP, partition=1, hour=1)
    field("quarantined_first", bad + "amount_minor", amount_minor="oops")
    add("valid_after_quarantined", _enc(_payload("quarantined_first")), ROW, hour=1)
    return recs


def _produce(settings: Settings, topic: str, recs: list[Rec]) -> None:
    admin = AdminClient(settings.kafka.client_config())
    config = {
        "retention.ms": "-1",
        "message.timestamp.type": "CreateTime",
        "max.message.bytes": str(MAX_BYTES),
    }
    futures = admin.create_topics([NewTopic(topic, 2, 1, config=config)], operation_timeout=30)
    futures[topic].result()
    producer = Producer(
        {
            **settings.kafka.client_config(),
            "enable.idempotence": True,
            "message.max.bytes": MAX_BYTES + 1024,
            "linger.ms": 5,
        }
    )
    errors: list[str] = []
    ordered = sorted(recs, key=lambda r: r.hour)  # timestamps never go back in a partition
    for i, rec in enumerate(ordered):
        ts = HOUR0.replace(hour=5 + rec.hour, minute=2, second=i % 60)

        def done(err: KafkaError | None, msg: Message[Any, Any], rec: Rec = rec) -> None:
            if err is not None:
                errors.append(f"{rec.label}: {err.str()}")
            else:
                rec.offset = int(msg.offset())  # type: ignore[arg-type]

        producer.produce(
            topic,
            value=rec.value,
            key=rec.key,
            partition=rec.partition,
            timestamp=int(ts.timestamp() * 1000),
            headers=rec.headers,
            on_delivery=done,
        )
        producer.poll(0)
    assert producer.flush(60) == 0
    assert not errors, errors
    assert all(r.offset >= 0 for r in recs)


@dataclasses.dataclass
class World:
    spec: TopicSpec
    recs: list[Rec]
    result: dg.ExecuteInProcessResult
    rows: dict[tuple[int, int], Any]
    quarantine: dict[tuple[int, int], Any]


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"badinput_{uuid.uuid4().hex[:8]}"
    # Most of this corpus is bad on purpose: let the ratio check pass so the run publishes.
    spec = renamed(SPECS[0], topic=topic, quarantine_max_ratio=1.0)
    recs = _corpus()
    _produce(stack_settings, topic, recs)
    ns = stack_settings.catalog.namespace
    with dg.instance_for_test() as instance:
        result = materialize_range([build_raw_asset(spec)], instance, *RANGE, raise_on_error=False)
        rows = rows_by_offset(spark_session, f"lake.{ns}.{spec.raw_table}")
        quarantine = rows_by_offset(spark_session, f"lake.{ns}.{spec.quarantine_table}")
        yield World(spec, recs, result, rows, quarantine)


def test_run_publishes(world: World) -> None:
    assert world.result.success, [
        e.event_specific_data for e in world.result.all_events if e.is_failure
    ]
    checks = {e.check_name: e.passed for e in world.result.get_asset_check_evaluations()}
    assert checks and all(checks.values()), checks


def test_every_record_has_its_exact_disposition(world: World) -> None:
    got: dict[str, str] = {}
    for rec in world.recs:
        where = (rec.partition, rec.offset)
        assert not (where in world.rows and where in world.quarantine), rec.label
        if where in world.rows:
            got[rec.label] = ROW
        elif where in world.quarantine:
            got[rec.label] = "q:" + world.quarantine[where]["reason"]
        else:
            got[rec.label] = "lost"
    assert got == {r.label: ROW if r.expect == DUP else r.expect for r in world.recs}
    produced = {(r.partition, r.offset) for r in world.recs}
    assert set(world.rows) <= produced and set(world.quarantine) <= produced


def test_quarantine_keeps_exact_bytes_and_rows_keep_binary_keys(world: World) -> None:
    by_label = {r.label: r for r in world.recs}
    for rec in world.recs:
        row = world.quarantine.get((rec.partition, rec.offset))
        if row is not None:
            assert row["kafka_value"] == rec.value, rec.label
            assert row["kafka_key"] == rec.key, rec.label
    binkey = world.rows[(by_label["binkey"].partition, by_label["binkey"].offset)]
    assert bytes(binkey["kafka_key"]) == BIG_KEY and binkey["order_id"] == "o-binkey"
    fallback = by_label["no_oid_textkey"]
    assert world.rows[(fallback.partition, fallback.offset)]["order_id"] == "o-from-key"
    tomb = world.rows[(by_label["tomb"].partition, by_label["tomb"].offset)]
    assert tomb["is_tombstone"] and tomb["order_id"] == "o-tomb" and tomb["event_id"] is None
    for label in ("amt_int_dec", "amt_exp"):
        rec = by_label[label]
        assert world.rows[(rec.partition, rec.offset)]["amount_minor"] == 500, label
    v1 = world.rows[(by_label["v1ok"].partition, by_label["v1ok"].offset)]
    assert (v1["amount_minor"], v1["channel"], v1["schema_version"]) == (1234, "unknown", 1)
    # Every copy of a repeated event is a row, with its own offset.
    for label in ("dup_first", "dup_again", "dup_next_hour", "dup_other_partition"):
        rec = by_label[label]
        assert world.rows[(rec.partition, rec.offset)]["event_id"] == "ev-dup", label


def test_odd_headers_reached_kafka(world: World, stack_settings: Settings) -> None:
    """The header corpus is real: the broker stored the odd headers as produced."""
    rec = next(r for r in world.recs if r.label == "headers_ok")
    consumer = Consumer(
        {**stack_settings.kafka.client_config(), "group.id": f"hdr-{uuid.uuid4().hex[:6]}"}
    )
    try:
        consumer.assign([TopicPartition(world.spec.topic, rec.partition, rec.offset)])
        msg = consumer.poll(15)
        assert msg is not None and msg.error() is None
        want = [(k, v.encode() if isinstance(v, str) else v) for k, v in rec.headers or []]
        assert msg.headers() == want
    finally:
        consumer.close()


def test_counts_reconcile_per_hour_and_in_total(world: World) -> None:
    expected: dict[str, dict[str, int]] = {
        h: {"read": 0, "written": 0, "quarantined": 0} for h in HOURS
    }
    for rec in world.recs:
        hour = expected[HOURS[rec.hour]]
        hour["read"] += 1
        hour["written" if rec.expect in (ROW, DUP) else "quarantined"] += 1
    total = {k: sum(h[k] for h in expected.values()) for k in expected[HOURS[0]]}
    assert total["read"] == len(world.recs) == total["written"] + total["quarantined"]
    repeated = sum(1 for r in world.recs if r.expect == DUP)

    (mat,) = [e.materialization for e in world.result.get_asset_materialization_events()][-1:]
    # Run totals (each partition's own figures are checked in test_raw_asset).
    meta = mat.metadata["run"].value
    assert isinstance(meta, dict)
    assert (
        meta["records_read"],
        meta["rows_written"],
        meta["quarantined"],
        meta["resent_event_ids"],
        meta["conflicting_event_ids"],
    ) == (total["read"], total["written"], total["quarantined"], repeated, 0)

    evaluations = {e.check_name: e for e in world.result.get_asset_check_evaluations()}
    recon: dict[str, Any] = {
        k: v.value for k, v in evaluations["count_reconciliation"].metadata.items()
    }
    assert recon["per_hour"] == {
        h: {"kafka_committed": v["read"], "rows": v["written"], "quarantined": v["quarantined"]}
        for h, v in expected.items()
    }
    assert (recon["kafka_committed_records"], recon["quarantined"], recon["rows_on_branch"]) == (
        total["read"],
        total["quarantined"],
        total["written"],
    )
    assert len(world.rows) == total["written"]
    assert len(world.quarantine) == total["quarantined"]
    reasons = evaluations["quarantine_ratio"].metadata["reasons"].value
    want = Counter(r.expect[2:] for r in world.recs if r.expect.startswith("q:"))
    assert reasons == dict(want)
