"""Checks that see content (issue 30).

* ``decoded_content``: an independent Python decode of the Kafka records (the spec's reference
  decoders, :mod:`backfill_assets.lake.decode.content`) is compared per hour with the typed values
  stored on the run's branch. Proven with a real transform bug: a spec whose v2 upcaster
  multiplies the amount by 10 (the bytes and every other check stay right) is backfilled
  through Dagster; the check fails and main keeps its snapshot.
* ``quarantine_ratio`` is judged per Kafka hour: one bad hour fails the run although the whole
  run's ratio is under the limit, and the failure names that hour.
* The Python decode agrees with Spark where they must: the row hash is Spark's ``xxhash64``
  and ISO timestamps parse as Spark's cast does (the other rules are exercised against the JVM
  reader by ``test_bad_input``, whose run must pass this check too).
* An hour larger than ``BACKFILL_CONTENT_SAMPLE_ABOVE`` decodes a 1-in-K sample picked by a
  hash of (partition, offset) and the run's residue, and the table side sums the same rows: the
  predicate agrees bit for bit between Python and Spark, a clean sampled run passes and the
  wrong upcaster is still blocked through the sampled path; a small hour is decoded whole,
  whatever else the run holds.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.decode import content
from backfill_assets.lake.decode.parse import TIMESTAMP_RANGE
from backfill_assets.spec import transforms
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.spec.transforms import reference
from backfill_assets.spec.transforms.orders import upcast_v2
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

ORDERS = SPECS[0]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def upcast_v2_amount_times_ten(v: Column) -> dict[str, Column]:
    """The injected transform bug: v2's amount read ten times too large. Every value stays
    inside the contract and the Kafka bytes are untouched."""
    out = upcast_v2(v)
    out["amount_minor"] = out["amount_minor"] * 10
    return out


def _materialize(
    spec: TopicSpec, instance: dg.DagsterInstance, first: datetime, last: datetime
) -> dg.ExecuteInProcessResult:
    return materialize_range([build_raw_asset(spec)], instance, first, last, raise_on_error=False)


def _checks(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def _main_snapshot(spark: SparkSession, table: str) -> int | None:
    row = spark.sql(f"SELECT snapshot_id FROM {table}.refs WHERE name = 'main'").first()
    return None if row is None else int(row[0])


# ---------------------------------------------------------------------------------------------
# The decode itself (no broker, no Spark)
# ---------------------------------------------------------------------------------------------


def _v2(**over: Any) -> bytes:
    payload: dict[str, Any] = {
        "schema_version": 2,
        "event_id": "e1",
        "order_id": "o1",
        "customer_id": "c1",
        "event_type": "created",
        "status": "open",
        "currency": "EUR",
        "amount_minor": 1234,
        "channel": "web",
        "event_time": 1_775_000_000_000,
    }
    payload.update(over)
    return json.dumps({k: v for k, v in payload.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        (_v2(), "row"),
        (_v2(amount_minor=5e2), "row"),  # 500.0 is 500
        (_v2(amount_minor=12.7), "missing_or_invalid:amount_minor"),
        (_v2(amount_minor="1234"), "missing_or_invalid:amount_minor"),
        (_v2(amount_minor=10**30), "missing_or_invalid:amount_minor"),
        (_v2(amount_minor=-1), "below_min:amount_minor"),
        (_v2(currency="XXX"), "not_allowed:currency"),
        (_v2(event_time=10**16), "missing_or_invalid:event_time"),
        (_v2(event_time=-3_000_000_000_000), "out_of_range:event_time"),
        (_v2(schema_version=9), "unknown_schema_version:9"),
        (_v2(schema_version="2"), "unknown_schema_version:?"),
        (_v2(order_id=...), "row"),  # the key stands in
        (_v2(order_id=None), "missing_or_invalid:order_id"),
        (b'{"a":1,"a":2}', "invalid_json"),
        (_v2()[:-1] + b', "x": NaN}', "invalid_json"),
        (_v2() + b" junk", "invalid_json"),
        (_v2() + b"  \n", "row"),
        (b"[1]", "not_json_object"),
        (b"", "empty_value"),
        (b"\xff{}", "invalid_utf8"),
        (None, "row"),  # a tombstone with a UTF-8 key
    ],
)
def test_the_decode_applies_the_quarantine_rules(value: bytes | None, expect: str) -> None:
    decode = content.RecordDecoder(ORDERS)
    kind, detail = decode(0, 7, b"o1", value)
    assert (kind if kind == content.ROW else detail) == expect


def test_v1_reference_reads_major_units_and_iso_times() -> None:
    payload = reference.loads(
        '{"amount": 12.3, "event_time": "2026-01-02T03:04:05.678Z", "event_id": "e"}'
    )
    row = ORDERS.decoder(1)(payload)  # type: ignore[misc]
    assert row["amount_minor"] == 1230 and row["channel"] == "unknown"
    assert row["event_time"] == int(datetime(2026, 1, 2, 3, 4, 5, 678000, UTC).timestamp() * 1e6)
    assert reference.field(reference.loads('{"a": 12.345}'), "a", "decimal(18,2)") is None
    assert reference.field({"a": Decimal("1E+2")}, "a", "decimal(18,2)") == 100


@pytest.mark.parametrize(
    "number",
    ["0", "-0", "7", "2147483648", "-9223372036854775808", "9223372036854775808", "1" * 400],
)
@pytest.mark.parametrize(
    "spark_type", ["int", "bigint", "double", "decimal(18,2)", "decimal(5,0)", "string"]
)
def test_an_integer_reads_as_the_same_number_as_a_decimal(number: str, spark_type: str) -> None:
    # loads keeps JSON integers as int (faster); field reads them as it reads the Decimal.
    payload = reference.loads(f'{{"a": {number}}}')
    assert type(payload["a"]) is int
    expect = reference.field({"a": Decimal(number)}, "a", spark_type)
    got = reference.field(payload, "a", spark_type)
    assert got == expect and type(got) is type(expect)


def test_whole_or_sampled_is_decided_per_hour_and_each_run_draws_its_sample() -> None:
    """Issue 51 item 7: an hour of at most the threshold is decoded whole in a run that also
    holds a larger hour (before, the run's total made every hour of it sampled), the larger
    hour keeps only its sample, and another residue compares other records. The decision is
    made from the scan's counts before the decode's pass reads anything, so nothing beyond
    the sample is decoded."""
    from backfill_assets.lake.offsets.decode_pass import Decoding, content_sample
    from backfill_assets.lake.offsets.windows import Cell, Windows, _ms

    def decode(p: int, o: int, key: bytes | None, value: bytes | None) -> tuple[str, Any]:
        return content.ROW, 1

    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    bounds = [t0, t0 + timedelta(hours=1), t0 + timedelta(hours=2)]
    small = [(p, o) for p in range(3) for o in range(10)]  # hour 0: 30 records
    large = [(p, o) for p in range(3) for o in range(100, 140)]  # hour 1: 120 records
    scanned = {bounds[i]: {p: Cell(0, 0) for p in range(3)} for i in (0, 1)}
    for i, records in enumerate((small, large)):
        for p, o in records:
            scanned[bounds[i]][p].add(o, None, b"{}", p)
    windows = Windows("t", bounds[0], bounds[2], scanned)
    picks = []
    for residue in (0, 1):
        sample = content_sample(windows, 4, 30, residue, frozenset())
        assert sample == content.Sample(4, residue, frozenset({_ms(bounds[1])}))
        decoding = Decoding(decode, sample)
        cells = {bounds[i]: {p: Cell(0, 0) for p in range(3)} for i in (0, 1)}
        for i, records in enumerate((small, large)):
            sampled = _ms(bounds[i]) in sample.hours
            for p, o in records:
                decoding.add(cells[bounds[i]][p], sampled, p, o, None, b"{}")
        assert sum(c.decoded_rows for c in cells[bounds[0]].values()) == len(small)
        picked = [r for r in large if content.in_sample(*r, 4, residue=residue)]
        assert sum(c.decoded_rows for c in cells[bounds[1]].values()) == len(picked)
        assert 0 < len(picked) < len(large) / 2
        # Every record is counted and hashed again; only the compared ones are decoded.
        assert sum(c.records for row in cells.values() for c in row.values()) == 150
        assert decoding.decoded == len(small) + len(picked)
        picks.append(set(picked))
    assert picks[0].isdisjoint(picks[1])
    assert content_sample(windows, 4, 120, 0, frozenset()) == content.Sample()
    assert content.miss_bound(16, 100) == pytest.approx(0.0016, abs=1e-4)


def test_the_timestamp_range_is_the_replays() -> None:
    low, high = (
        int(datetime.fromisoformat(t + "+00:00").timestamp()) * 1_000_000 for t in TIMESTAMP_RANGE
    )
    assert (low, high) == content.TIMESTAMP_RANGE_US


# ---------------------------------------------------------------------------------------------
# Agreement with Spark
# ---------------------------------------------------------------------------------------------


def test_row_hash_and_iso_timestamps_agree_with_spark(spark_session: SparkSession) -> None:
    from pyspark.sql import functions as F

    texts = [
        "2026-01-02T03:04:05.678Z",
        "2026-01-02 03:04:05",
        "2026-01-02T03:04:05.123456789Z",
        "2026-01-02T03:04:05+02:00",
        "2026-01-02T03:04:05-0130",
        "2026-01-02T03:04",
        "2026-01-02",
        " 2026-01-02T03:04:05Z ",
        "2026-02-30T00:00:00Z",
        "2026-01-02T03:04:05+19:00",
        "2026-01-02T03:04:05+05:60",
        "2026-01-02T03:04:05 UTC",
        "\t2026-01-02T03:04:05Z\r\n",
    ]
    # Spellings Spark's cast reads and the reference cannot repeat (before the one grammar,
    # each was a disagreement that failed its hour on every run): NULL on both sides now.
    outside = [
        "2026-03-29T02:30:00 Europe/Paris",  # a region zone, and a time in its DST gap
        "2026-11-01T01:30:00 America/New_York",  # an ambiguous time (the DST overlap)
        "2026-01-02T03:04:05 UTC+01:00",
        "2026-01-02T03:04:05 CET",
        "\u00a02026-01-02T03:04:05Z",
        "2026-01-02T03:04:05Z\x0b",
        "+2026-01-02",
    ]
    rows = spark_session.createDataFrame([(t,) for t in texts + outside], "t string").select(
        "t",
        F.unix_micros(transforms.text_timestamp(F.col("t"))).alias("us"),
        F.unix_micros(F.try_to_timestamp("t")).alias("cast"),
    )
    spark = {r["t"]: r["us"] for r in rows.collect()}
    assert {t: reference.text_timestamp(t) for t in texts + outside} == spark
    assert all(spark[t] is None for t in outside)
    cast = {r["t"]: r["cast"] for r in rows.collect()}
    assert cast["2026-03-29T02:30:00 Europe/Paris"] is not None  # what Spark alone would read

    columns = ORDERS.columns
    values: dict[str, Any] = {
        "event_id": "é-\U0001f600",
        "order_id": "o",
        "customer_id": None,
        "amount_minor": -5,
        "event_time": 1_775_000_000_123_000,
    }
    ddl = "p int, o bigint, t boolean, " + ", ".join(f"{c.name} {c.type}" for c in columns)
    data = [
        (
            3,
            42,
            False,
            *[
                EPOCH + timedelta(microseconds=values[c.name])
                if c.type == "timestamp" and values.get(c.name) is not None
                else values.get(c.name)
                for c in columns
            ],
        )
    ]
    frame = spark_session.createDataFrame(data, ddl)
    got = frame.select(F.xxhash64("p", "o", "t", *[c.name for c in columns])).first()
    assert got is not None
    assert got[0] == content.row_hash(3, 42, False, columns, values)


def test_the_sample_predicate_agrees_with_spark(spark_session: SparkSession) -> None:
    from pyspark.sql import functions as F

    pairs = [(p, o) for p in (0, 1, 5, 2**31 - 1) for o in range(300)]
    pairs += [(3, 2**62 + i) for i in range(100)] + [(7, 2**63 - 1), (0, 0)]
    hour = datetime(2026, 1, 1, tzinfo=UTC)
    frame = spark_session.createDataFrame(
        [(p, o, hour) for p, o in pairs],
        "kafka_partition int, kafka_offset bigint, kafka_hour timestamp",
    )
    hours = frozenset({int(hour.timestamp() * 1000)})
    for k in (2, 3, 16, 1024):
        for residue in (0, k - 1):
            chosen = content.sample_condition(content.Sample(k, residue, hours))
            assert chosen is not None
            got = frame.where(chosen).collect()
            spark_picked = sorted((r["kafka_partition"], r["kafka_offset"]) for r in got)
            expect = sorted(r for r in pairs if content.in_sample(*r, k, residue=residue))
            assert spark_picked == expect, (k, residue)
            assert spark_picked, k
    # An hour outside the sampled ones is compared whole.
    other = content.sample_condition(content.Sample(16, 0, frozenset({0})))
    assert other is not None and frame.where(other).count() == len(pairs)
    assert content.sample_condition(content.Sample(16, 0, frozenset())) is None
    # The hash spans negative and positive longs: pmod, not %, on Spark's side.
    signs = frame.select(F.xxhash64("kafka_partition", "kafka_offset") < 0).distinct().count()
    assert signs == 2
    assert all(content.in_sample(p, o, 1) for p, o in pairs)


# ---------------------------------------------------------------------------------------------
# Through Dagster: a wrong upcaster is blocked
# ---------------------------------------------------------------------------------------------

UPCAST_START = datetime(2026, 4, 6, tzinfo=UTC)


@pytest.fixture(scope="module")
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def test_a_wrong_upcaster_fails_decoded_content_and_main_is_unchanged(
    stack_settings: Settings, spark_session: SparkSession, instance: dg.DagsterInstance
) -> None:
    topic = f"upcast_{uuid.uuid4().hex[:8]}"
    spec = renamed(ORDERS, topic=topic)
    # Four hours, schema v1 in the first two and v2 after; hours 1-2 are backfilled.
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=UPCAST_START, hours=4, events_per_hour=60, seed=3),
    )
    first, last = UPCAST_START + timedelta(hours=1), UPCAST_START + timedelta(hours=2)
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"

    clean = _materialize(spec, instance, first, last)
    assert clean.success
    checks = _checks(clean)
    assert checks["decoded_content"].passed, checks["decoded_content"].description
    assert checks["decoded_content"].metadata["decode_seconds"].value >= 0
    assert checks["decoded_content"].metadata["sampled"].value is False  # a small window
    before = _main_snapshot(spark_session, table)
    rows_before = sorted(map(tuple, spark_session.table(table).drop("ingest_run_id").collect()))

    wrong = renamed(
        ORDERS,
        topic=topic,
        upcasters={
            1: ORDERS.upcasters[1],
            2: f"{__name__}:upcast_v2_amount_times_ten",
        },
    )
    result = _materialize(wrong, instance, first, last)
    assert not result.success
    checks = _checks(result)
    failed = {name for name, e in checks.items() if not e.passed}
    assert failed == {"decoded_content"}, failed
    meta = checks["decoded_content"].metadata
    # Only the v2 hour differs; the v1 hour read by the right upcaster matches.
    assert meta["hours_that_differ"].value == [last.isoformat()]
    assert "content differs" in str(checks["decoded_content"].description)
    assert _main_snapshot(spark_session, table) == before
    rows_after = sorted(map(tuple, spark_session.table(table).drop("ingest_run_id").collect()))
    assert rows_after == rows_before


SAMPLE_START = datetime(2026, 4, 10, tzinfo=UTC)


def test_a_large_window_is_sampled_and_a_wrong_upcaster_is_still_blocked(
    stack_settings: Settings,
    spark_session: SparkSession,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The threshold lowered to 50 records makes the test's window "large": 1 record in 4 is
    decoded, the branch's rows are summed over the same 1 in 4, and the sums agree on a clean
    run; with the v2 upcaster wrong the v2 hour differs."""
    monkeypatch.setenv("BACKFILL_CONTENT_SAMPLE_ABOVE", "50")
    monkeypatch.setenv("BACKFILL_CONTENT_SAMPLE", "4")
    topic = f"sample_{uuid.uuid4().hex[:8]}"
    spec = renamed(ORDERS, topic=topic)
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=SAMPLE_START, hours=4, events_per_hour=60, seed=5),
    )
    first, last = SAMPLE_START + timedelta(hours=1), SAMPLE_START + timedelta(hours=2)
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"

    clean = _materialize(spec, instance, first, last)
    assert clean.success
    check = _checks(clean)["decoded_content"]
    assert check.passed, check.description
    meta = {k: v.value for k, v in check.metadata.items()}
    assert meta["sampled"] is True and meta["sample_fraction"] == 0.25
    assert "(1 - 1/4)^m" in meta["miss_rate"]
    assert 0 < meta["rows_compared"] < meta["rows_on_branch"] / 2
    # Beyond the sample, at most the threshold's 50 records per hour were decoded.
    assert meta["decoded_records"] <= 2 * 50 + meta["rows_compared"] + 2
    assert meta["decoded_records"] < meta["rows_on_branch"]
    assert "the 1-in-4 sample of residue" in str(check.description)
    assert meta["sampled_hours"] == [first.isoformat(), last.isoformat()]
    before = _main_snapshot(spark_session, table)

    wrong = renamed(
        ORDERS,
        topic=topic,
        upcasters={1: ORDERS.upcasters[1], 2: f"{__name__}:upcast_v2_amount_times_ten"},
    )
    result = _materialize(wrong, instance, first, last)
    assert not result.success
    checks = _checks(result)
    assert {name for name, e in checks.items() if not e.passed} == {"decoded_content"}
    assert checks["decoded_content"].metadata["hours_that_differ"].value == [last.isoformat()]
    assert _main_snapshot(spark_session, table) == before


# ---------------------------------------------------------------------------------------------
# Through Dagster: the quarantine ratio is judged per hour
# ---------------------------------------------------------------------------------------------

RATIO_START = datetime(2026, 4, 8, tzinfo=UTC)


def _produce_hours(settings: Settings, topic: str, bad_in_hour: dict[int, int]) -> None:
    """40 valid v2 events per hour for hours 0-3 of RATIO_START, plus ``bad_in_hour[h]``
    invalid JSON records in hour h, one partition."""
    admin = AdminClient(dict(settings.kafka.client_config()))
    for future in admin.create_topics([NewTopic(topic, num_partitions=1)]).values():
        future.result(30)
    producer = Producer(dict(settings.kafka.client_config()))
    for hour in range(4):
        base = RATIO_START + timedelta(hours=hour)
        values = [
            _v2(
                event_id=f"e{hour}-{i}",
                order_id=f"o{i}",
                event_time=int((base + timedelta(minutes=i)).timestamp() * 1000),
            )
            for i in range(40)
        ]
        values += [b'{"schema_version": 2, "event_id": '] * bad_in_hour.get(hour, 0)
        for i, value in enumerate(values):
            ts = base + timedelta(seconds=30 + i)
            producer.produce(
                topic, value=value, key=b"k", partition=0, timestamp=int(ts.timestamp() * 1000)
            )
    assert producer.flush(60) == 0


def test_one_bad_hour_fails_the_quarantine_ratio_although_the_run_is_under_it(
    stack_settings: Settings, spark_session: SparkSession, instance: dg.DagsterInstance
) -> None:
    topic = f"qratio_{uuid.uuid4().hex[:8]}"
    spec = renamed(ORDERS, topic=topic, quarantine_max_ratio=0.05)
    # Hour 2: 6 of 46 records quarantined (0.13); the run: 6 of 166 (0.036, under 0.05).
    _produce_hours(stack_settings, topic, {2: 6})
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"

    result = _materialize(spec, instance, RATIO_START, RATIO_START + timedelta(hours=3))
    assert not result.success
    checks = _checks(result)
    failed = {name for name, e in checks.items() if not e.passed}
    assert failed == {"quarantine_ratio"}, failed
    meta = checks["quarantine_ratio"].metadata
    bad_hour = (RATIO_START + timedelta(hours=2)).isoformat()
    assert meta["ratio"].value < 0.05
    assert meta["worst_hour"].value == bad_hour
    assert meta["hours_over_limit"].value == [bad_hour]
    assert bad_hour in str(checks["quarantine_ratio"].description)
    # Nothing was published: main has no snapshot (or no rows) for this fresh table.
    main = _main_snapshot(spark_session, table)
    assert main is None or spark_session.table(table).count() == 0
