"""The raw parse reads payloads with one strict JVM pass (``StrictReader``, the Java class in
``backfill_assets/stack/java``). It must judge every value as the VARIANT reading it replaced
does (``json_field`` outside the parse): same ``whole``/object verdicts, same typed values, the
same NULL for every kind mismatch. Where the two differ, the JVM reader is the stricter one, and
each such case is asserted here by name. An upcaster that reads the payload some other way
still gets the VARIANT, and the parse stays correct."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.decode import json_payload
from backfill_assets.lake.decode.parse import parse
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.transforms import StrictReader, json_field, reading
from backfill_assets.spec.transforms import orders as orders_transforms

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

TYPES = ("string", "boolean", "bigint", "int", "double", "decimal(18,2)", "present")
VALUES = [
    '{"a":"x"}',
    '{"a":1}',
    '{"a":12.7}',
    '{"a":500.0}',
    '{"a":5e2}',
    '{"a":1e30}',
    '{"a":12.345}',
    '{"a":12.34}',
    '{"a":true}',
    '{"a":false}',
    '{"a":null}',
    "{}",
    '{"a":{"b":1}}',
    '{"a":[1]}',
    '{"a":"123"}',
    '{"a":9223372036854775807}',
    '{"a":9223372036854775808}',
    '{"a":2147483648}',
    '{"a":-0.0}',
    '{"a":' + "1" + "0" * 30 + "}",
    '{"a":"caf\\u00e9 \\"q\\""}',
    '{"n":{"b":3}}',
    '{"n":{"b":"3"}}',
    '{"n":[{"b":3}]}',
    # Not exactly one JSON value, or not an object.
    '{"a":1,"a":2}',
    '{"n":{"b":3,"b":4}}',
    '{"a":1} x',
    '{"a":1}{"b":2}',
    '{"a":1},',
    '{"a":1} \n\t',
    ' {"a":1}',
    "[1]",
    "1",
    '"s"',
    "null",
    "",
    "   ",
    '\ufeff{"a":1}',
    '{"a":NaN}',
    "{'a':1}",
    '{"a":01}',
    '{"a":"\u0001"}',
    '{"x":' + "[" * 500 + "]" * 500 + "}",
    '{"x":' + "[" * 5000 + "]" * 5000 + "}",
    None,
]
# Where the JVM reader is stricter than the VARIANT reading (value, type) -> its result.
STRICTER: dict[tuple[str, str], Any] = {
    # The VARIANT reading turns 1e400 into infinity: not a number a double column can hold.
    ('{"a":1e400}', "double"): None,
    # The VARIANT reading rounds 1e-400 to 0 and then finds the integer exact.
    ('{"a":1e-400}', "bigint"): None,
    ('{"a":1e-400}', "int"): None,
    ('{"a":1e-400}', "decimal(18,2)"): None,
}


def _readings(
    spark: SparkSession, values: Sequence[str | None]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per value: (JVM reader's verdicts, VARIANT reading's verdicts), as plain dicts."""
    from pyspark.sql import functions as F

    frame = spark.createDataFrame([(v,) for v in values], "v string")
    payload = F.col("_v")
    reader = StrictReader(payload, "_j")
    with reading(reader):
        strict = {t: json_field(payload, "$.a", t) for t in TYPES if t != "present"}
        nested = json_field(payload, "$.n.b", "bigint")
    present = reader.field("$.a", "present")
    assert present is not None
    end = json_payload._END
    w = F.try_parse_json(F.concat(F.lit("["), F.col("v"), F.lit(f',"{end}"]')))
    whole = (F.try_variant_get(w, "$[1]", "string") == F.lit(end)) & F.try_variant_get(
        w, "$[2]", "variant"
    ).isNull()
    frame = frame.select(
        "v",
        reader.call(spark, F.col("v")).alias("_j"),
        F.when(whole, F.try_variant_get(w, "$[0]", "variant")).alias("_v"),
    )

    def verdicts(whole: Column, is_object: Column, typed: dict[str, Column], n: Column) -> Column:
        return F.struct(
            F.coalesce(whole, F.lit(False)).alias("whole"),
            F.coalesce(is_object, F.lit(False)).alias("object"),
            *[c.alias(t) for t, c in typed.items()],
            n.alias("n.b"),
        )

    variant = {t: json_field(payload, "$.a", t) for t in TYPES if t != "present"}
    variant["present"] = F.try_variant_get(payload, "$.a", "variant").isNotNull()
    strict["present"] = F.coalesce(present, F.lit(False))
    out = frame.select(
        verdicts(reader.whole(), reader.is_object(), strict, nested).alias("strict"),
        verdicts(
            payload.isNotNull(),
            F.try_variant_get(payload, "$", "struct<_:variant>").isNotNull(),
            variant,
            json_field(payload, "$.n.b", "bigint"),
        ).alias("variant"),
    ).collect()
    return [(r["strict"].asDict(), r["variant"].asDict()) for r in out]


def test_the_jvm_reader_judges_every_value_as_the_variant_reading(
    spark_session: SparkSession,
) -> None:
    readings = _readings(spark_session, VALUES)
    for value, (strict, variant) in zip(VALUES, readings, strict=True):
        assert strict == variant, value
    by_value = dict(zip(VALUES, (s for s, _ in readings), strict=True))
    # The verdicts themselves, for the cases the quarantine reasons depend on.
    assert by_value['{"a":1}']["bigint"] == 1 and by_value['{"a":1}']["string"] is None
    assert by_value['{"a":5e2}']["bigint"] == 500
    assert by_value['{"a":12.7}']["bigint"] is None
    assert by_value['{"a":12.345}']["decimal(18,2)"] is None
    assert by_value['{"a":12.34}']["decimal(18,2)"] == Decimal("12.34")
    assert by_value['{"a":"123"}']["bigint"] is None
    assert by_value['{"a":2147483648}']["int"] is None
    assert by_value['{"a":null}']["present"] and not by_value["{}"]["present"]
    assert by_value['{"n":{"b":3}}']["n.b"] == 3
    for bad in ('{"a":1,"a":2}', '{"a":1} x', '{"a":1}{"b":2}', "   ", '\ufeff{"a":1}'):
        assert not by_value[bad]["whole"], bad
    assert by_value["[1]"]["whole"] and not by_value["[1]"]["object"]
    assert by_value[None] == {
        k: (False if k in ("whole", "object", "present") else None) for k in by_value[None]
    }


def test_where_the_jvm_reader_is_stricter(spark_session: SparkSession) -> None:
    values = sorted({v for v, _ in STRICTER})
    readings = dict(zip(values, _readings(spark_session, values), strict=True))
    for (value, kind), expected in STRICTER.items():
        strict, variant = readings[value]
        assert strict[kind] == expected, (value, kind)
        assert variant[kind] != expected, (value, kind, "no longer differs: drop from STRICTER")


def _custom_v2(v: Column) -> dict[str, Column]:
    """The orders v2 upcaster, but reading ``channel`` with a path the JVM reader does not take
    (so it falls back to the VARIANT) and ``status`` with a raw VARIANT expression."""
    from pyspark.sql import functions as F

    out = orders_transforms.upcast_v2(v)
    out["channel"] = json_field(v, "$['channel']", "string")
    out["status"] = F.try_variant_get(v, "$.status", "string")
    return out


def test_an_upcaster_that_reads_the_variant_itself_still_works(
    spark_session: SparkSession,
) -> None:
    (orders,) = [s for s in load_specs() if s.topic == "orders"]
    spec = renamed(
        orders,
        "orders_custom",
        upcasters={
            1: orders.upcasters[1],
            2: "backfill_assets_tests.lake.test_strict_json:_custom_v2",
        },
    )
    hour = datetime(2026, 7, 1, tzinfo=UTC)
    ok = {
        "schema_version": 2,
        "event_id": "e1",
        "order_id": "o1",
        "customer_id": "c1",
        "event_type": "created",
        "status": "open",
        "amount_minor": 100,
        "currency": "EUR",
        "channel": "web",
        "event_time": int(hour.timestamp() * 1000),
    }
    values = [
        json.dumps(ok),
        json.dumps({**ok, "event_id": "e2", "channel": 7}),
        json.dumps({**ok, "event_id": "e3", "status": 7}),  # the raw expression coerces: "7"
        json.dumps({**ok, "event_id": "e4", "amount_minor": "100"}),
        '{"schema_version": 2} junk',
    ]
    source = spark_session.createDataFrame(
        [("orders_custom", 0, i, hour, hour, i, b"k", v.encode()) for i, v in enumerate(values)],
        "topic string, partition int, offset long, timestamp timestamp, kafka_hour timestamp, "
        "record_hash long, key binary, value binary",
    )
    _rows, _quarantine, parsed = parse(spec, source, "run")
    try:
        got = {
            r["kafka_offset"]: r["_reason"]
            for r in parsed.select("kafka_offset", "_reason").collect()
        }
        assert got == {
            0: None,
            1: "missing_or_invalid:channel",
            2: "not_allowed:status",
            3: "missing_or_invalid:amount_minor",
            4: "invalid_json",
        }
        plan = parsed._jdf.queryExecution().executedPlan().toString()
        assert plan.count("backfill_strict_json_") == 1, plan
        assert plan.count("parseJson") == 1, plan
    finally:
        parsed.unpersist()


def test_the_stages_name_their_kafka_columns_as_spark_does(spark_session: SparkSession) -> None:
    """The JSON and wire-format stages name the Kafka columns they carry without asking Spark
    (over Spark Connect each ``.columns`` is a round trip): the names must be the ones Spark
    gives ``kafka_columns()``, in order, with ``_sid`` where the stage carries it."""
    from pyspark.sql import functions as F

    from backfill_assets.lake.decode.envelope import id_column, kafka_columns, wire_stage

    hour = datetime(2026, 7, 1, tzinfo=UTC)
    source = spark_session.createDataFrame(
        [("t", 0, 0, hour, hour, 0, b"k", b'{"a":1}')],
        "topic string, partition int, offset long, timestamp timestamp, kafka_hour timestamp, "
        "record_hash long, key binary, value binary",
    )
    spark_names = source.select(*kafka_columns()).columns
    with_id = source.select("*", id_column().alias("_sid"))
    reader = StrictReader(F.col("_v"), "_j")
    _df, names = json_payload.payload_stage(source, reader)
    assert names == spark_names
    df, names = json_payload.payload_stage(with_id, reader, sid=True)
    assert names == [*spark_names, "_sid"]
    assert df.columns == [*names, "_j", "_v"]
    df, names = wire_stage(source)
    assert names == spark_names and df.columns == [*spark_names, "_sid"]
