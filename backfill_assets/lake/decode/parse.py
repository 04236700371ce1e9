"""A window's Kafka records split into table rows and quarantine rows, every format through one
set of rules (:data:`QUARANTINE_RULES`, first match wins): nothing is dropped. Builds and
caches Spark frames; writes nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.decode import avro, debezium, debezium_avro, json_schema, protobuf
from backfill_assets.lake.decode.envelope import KAFKA_COLUMNS, KAFKA_STAGE_COLUMNS, WIRE_HEADER
from backfill_assets.lake.decode.json_payload import json_rules, json_stage
from backfill_assets.spec.model import CDC_NAMES, ColumnSpec, TopicSpec
from backfill_assets.stack.spark import cache_on_disk

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# Every timestamp column must fall in [start, end) UTC: a year 1234 or 33658 is a bad value,
# and pandas (the contract check) cannot hold timestamps beyond 1677..2262.
TIMESTAMP_RANGE = ("1900-01-01 00:00:00", "2200-01-01 00:00:00")


# How parse disposes of each kind of input, in the order the rules are tried (first match wins).
QUARANTINE_RULES = (
    ("record_too_large:<bytes>", "key + value longer than the topic's max_record_bytes"),
    ("missing_or_invalid:<key field>", "tombstone without a key, or with a non-UTF-8 key"),
    ("(table row)", "any other tombstone (NULL value): is_tombstone, payload columns NULL"),
    ("empty_value", "a zero-length value (not a tombstone: Kafka deletes only on NULL)"),
    ("not_avro_wire_format", "avro: shorter than 5 bytes or not starting with magic byte 0"),
    (
        "not_protobuf_wire_format",
        "protobuf: shorter than 5 bytes or not starting with magic byte 0",
    ),
    (
        "not_json_schema_wire_format",
        "json_schema: shorter than 5 bytes or not starting with magic byte 0",
    ),
    (
        "unknown_schema_id:<id>",
        "avro, protobuf, json_schema: the schema registry has no schema with that id",
    ),
    (
        "incompatible_schema:<id>",
        "avro: the writer schema does not resolve to the columns; protobuf: a field cannot be "
        "read as its column, the schema imports files or lacks the message, or the record names "
        "another message; json_schema: the id's schema is not a JSON Schema",
    ),
    ("invalid_utf8", "a value (json_schema: the payload after its header) that is not UTF-8"),
    (
        "invalid_json",
        "not exactly one JSON value: cut, trailing data, duplicate names, NaN, "
        "nesting deeper than the parser's limit (1000)",
    ),
    ("not_json_object", "a JSON array, string, number, boolean or null"),
    *debezium.REASONS,
    ("invalid_avro:<id>", "avro: the bytes do not decode with their writer schema"),
    ("invalid_protobuf:<id>", "protobuf: the bytes do not parse as the writer schema's message"),
    ("unknown_schema_version:<n|?>", "version not an upcaster's; ? if absent or not an integer"),
    (
        "missing_or_invalid:<column>",
        "a non-nullable column absent, null or of the wrong JSON kind (debezium: the key and "
        "cdc columns first; a column Debezium marks unavailable (TOAST) is not missing)",
    ),
    ("(table row)", "debezium: a delete (op d) whose key and cdc columns are valid"),
    ("not_allowed:<column>", "a value outside the column's allowed list"),
    ("below_min:<column> / above_max:<column>", "a number outside the column's min / max"),
    ("out_of_range:<column>", "a timestamp outside TIMESTAMP_RANGE"),
)


def parse(
    spec: TopicSpec,
    raw: DataFrame,
    run_id: str,
    writers: Mapping[int, Any] | debezium_avro.Writers | None = None,
) -> tuple[DataFrame, DataFrame, DataFrame]:
    """Split Kafka records into (table rows, quarantine rows), upcast to the latest schema;
    the third frame is the cached parse both are read from (the caller unpersists it last).

    ``raw`` is the Kafka source's frame after :func:`attribute`. Nothing is deduplicated. The
    rule for every kind of bad input, first match wins, is in :data:`QUARANTINE_RULES`; a
    tombstone (NULL value) is a row. An avro topic's values are decoded by
    :func:`backfill_assets.lake.decode.avro.decode_stage` with ``writers`` (every schema id of the
    window, :func:`backfill_assets.lake.decode.avro.resolve`), a protobuf topic's by
    :func:`backfill_assets.lake.decode.protobuf.decode_stage`, a Debezium avro topic's by
    :mod:`backfill_assets.lake.decode.debezium_avro`'s. A json_schema topic's header is
    checked
    against ``writers`` (:func:`backfill_assets.lake.decode.json_schema.resolve`), then the payload
    after it is read by the json rules.

    The JSON is read once per record by the strict JVM reader
    (:class:`~backfill_assets.spec.transforms.StrictReader`), which returns every field the
    upcasters ask for; the projection is built in stages, each a column the next one reads (the
    typed columns read the reader's struct, the reason reads the typed columns): Spark keeps a
    stage whose columns are read more than once instead of inlining it, and the disk cache at
    the end keeps the filters on ``_reason`` from being pushed below the stages with every
    expression inlined (``test_raw_asset`` asserts the JSON is parsed once).
    """
    from pyspark.sql import functions as F

    col_names = [c.name for c in spec.columns]
    if spec.format == "avro" and spec.envelope == "debezium":
        assert isinstance(writers, debezium_avro.Writers)
        df, kafka_cols = debezium_avro.decode_stage(spec, raw, writers)
        reason = _reason(spec, debezium_avro.rules())
    elif spec.format in ("avro", "protobuf"):
        kind = avro if spec.format == "avro" else protobuf
        assert not isinstance(writers, debezium_avro.Writers)
        df, kafka_cols = kind.decode_stage(spec, raw, writers or {})
        key_str = F.col("kafka_key").cast("string")
        # A tombstone's key field is its key, if that is UTF-8 text (as for JSON topics).
        key_text = F.when(F.col("is_tombstone") & F.is_valid_utf8(key_str), key_str)
        df = df.select(
            *kafka_cols,
            "schema_version",
            "_wire",
            *[
                F.coalesce(F.col(name), key_text).alias(name) if name == spec.key_field else name
                for name in col_names
            ],
        )
        reason = _reason(spec, _avro_rules())
    elif spec.envelope == "debezium":
        df, kafka_cols = debezium.decode_stage(spec, raw)
        reason = _reason(spec, debezium.rules())
    elif spec.format == "json_schema":
        # The header's id, carried through the JSON stages; the JSON is what follows it.
        payload = F.expr(f"substring(value, {WIRE_HEADER + 1})")
        df, kafka_cols = json_stage(spec, raw, payload, sid=True)
        body = F.expr(f"substring(kafka_value, {WIRE_HEADER + 1})")
        assert not isinstance(writers, debezium_avro.Writers)
        rules = json_schema.wire_rules(writers or {})
        reason = _reason(spec, rules + json_rules(spec, F.col("schema_version"), body))
    else:
        df, kafka_cols = json_stage(spec, raw)
        reason = _reason(spec, json_rules(spec, F.col("schema_version")))
    df = df.select(*kafka_cols, "schema_version", *col_names, reason.alias("_reason")).select(
        *[
            # Only quarantine rows keep the value bytes (the table does not store them): the
            # cache holds what the two writes need, no more.
            F.when(F.col("_reason").isNotNull(), F.col(c)).alias(c) if c == "kafka_value" else c
            for c in kafka_cols
        ],
        "schema_version",
        *col_names,
        "_reason",
        F.lit(run_id).alias("ingest_run_id"),
    )
    parsed = cache_on_disk(df)
    return _rows(parsed, col_names), _quarantine(parsed), parsed


def _reason(spec: TopicSpec, payload_rules: list[tuple[Column, Column]]) -> Column:
    """The quarantine reason of a record (NULL for a row): :data:`QUARANTINE_RULES`, first
    match wins (``payload_rules``: the format's own, as (condition, reason)), then each
    column's contract."""
    from pyspark.sql import functions as F

    size = F.coalesce(F.length("kafka_key"), F.lit(0)) + F.coalesce(
        F.length("kafka_value"), F.lit(0)
    )
    reason: Column = F.when(
        size > spec.max_record_bytes, F.concat(F.lit("record_too_large:"), size.cast("string"))
    )
    reason = reason.when(
        F.col("is_tombstone") & F.col(spec.key_field).isNull(),
        F.lit(f"missing_or_invalid:{spec.key_field}"),
    )
    reason = reason.when(F.col("is_tombstone"), F.lit(None).cast("string"))
    reason = reason.when(F.length("kafka_value") == 0, F.lit("empty_value"))
    for condition, why in payload_rules:
        reason = reason.when(condition, why)
    if spec.envelope != "debezium":
        for col in spec.columns:
            reason = _column_rules(reason, col)
        return reason
    # A change event: its key and cdc columns; a delete has no other (its before is filler);
    # a column Debezium marks unavailable (an unchanged TOAST value) is not missing.
    first = [c for c in spec.columns if c.name == spec.key_field] + [
        c for c in spec.columns if c.name in CDC_NAMES
    ]
    for col in first:
        reason = _column_rules(reason, col)
    reason = reason.when(F.col("cdc_op") == F.lit(debezium.DELETE), F.lit(None).cast("string"))
    for col in spec.columns:
        if col not in first:
            reason = _column_rules(reason, col, debezium.unavailable(col.name))
    return reason


def _avro_rules() -> list[tuple[Column, Column]]:
    """An avro value's wire-format reason
    (:func:`backfill_assets.lake.decode.avro.decode_stage`)."""
    from pyspark.sql import functions as F

    return [(F.col("_wire").isNotNull(), F.col("_wire"))]


def _column_rules(reason: Column, col: ColumnSpec, excused: Column | None = None) -> Column:
    """``reason`` with the column's contract; ``excused``: where a NULL is not missing."""
    from pyspark.sql import functions as F

    c = F.col(col.name)
    if not col.nullable:
        missing = c.isNull() if excused is None else c.isNull() & ~excused
        reason = reason.when(missing, F.lit(f"missing_or_invalid:{col.name}"))
    if col.allowed is not None:
        reason = reason.when(~c.isin(list(col.allowed)), F.lit(f"not_allowed:{col.name}"))
    if col.min is not None:
        reason = reason.when(c < F.lit(col.min), F.lit(f"below_min:{col.name}"))
    if col.max is not None:
        reason = reason.when(c > F.lit(col.max), F.lit(f"above_max:{col.name}"))
    if col.type == "timestamp":
        lo, hi = (F.to_timestamp(F.lit(t)) for t in TIMESTAMP_RANGE)
        reason = reason.when((c < lo) | (c >= hi), F.lit(f"out_of_range:{col.name}"))
    return reason


def _quarantine(parsed: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    return parsed.where(F.col("_reason").isNotNull()).select(
        *(c for c in KAFKA_STAGE_COLUMNS if c != "is_tombstone"),
        F.col("_reason").alias("reason"),
        "ingest_run_id",
        F.length("kafka_key").alias("key_bytes"),
        F.length("kafka_value").alias("value_bytes"),
    )


def _rows(parsed: DataFrame, col_names: list[str]) -> DataFrame:
    """The table's rows; tombstones carry only the key (their payload columns stay NULL)."""
    from pyspark.sql import functions as F

    table_cols = [name for name, _ in KAFKA_COLUMNS] + col_names
    return parsed.where(F.col("_reason").isNull()).select(*table_cols, "ingest_run_id")
