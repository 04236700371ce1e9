"""Debezium change events (``envelope: debezium``; what the real connector writes is in
docs/cdc.md): a topic whose values are Debezium's envelope in Kafka's JSON converter, with
(``schemas: embedded``: ``{"schema": ..., "payload": <envelope>}``) or without the schema.

A value's row:

* ops ``r`` (snapshot read), ``c`` (create), ``u`` (update): the source columns from ``after``
  (a numeric as its decimal string, a timestamptz as its ISO-8601 text, json/jsonb as text);
* op ``d`` (delete): the key from ``before``, every other source column NULL (``before`` holds
  the key only; the rest is filler, never data);
* a tombstone (NULL value): the key from the Kafka key (its field ``key_field``), the rest NULL;
* every row: ``cdc_op``, ``cdc_lsn`` (``source.lsn``), ``cdc_ts_ms`` (``ts_ms``),
  ``cdc_source_ts`` (``source.ts_ms``), ``cdc_event_id`` (``<lsn>:<op>:<key>``) and
  ``cdc_unavailable``: the string and decimal columns whose value was Debezium's placeholder for
  an unchanged out-of-line (TOAST) value, which are NULL in the row (the current state keeps
  their previous value, :mod:`backfill_assets.lake.write.derived`).

A value that is not such an envelope is quarantined (:data:`REASONS`, in
:data:`backfill_assets.lake.decode.parse.QUARANTINE_RULES`). :func:`decode_stage` and
:func:`rules` build the replay's Spark expressions (the strict JVM reader reads every field);
:class:`Reference` is the content check's independent decode of the same envelope in plain
Python (:mod:`backfill_assets.lake.decode.content`), written apart from them.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from backfill_assets.spec.model import ColumnSpec, TopicSpec, decimal_of
from backfill_assets.spec.transforms import MAX_EPOCH_MS, MIN_EPOCH_MS, reference

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# Debezium's value for an unchanged TOASTed column (REPLICA IDENTITY DEFAULT).
PLACEHOLDER = "__debezium_unavailable_value"
EVENT_OPS = ("r", "c", "u")
DELETE = "d"
OPS = (*EVENT_OPS, DELETE)
NOT_ENVELOPE = "not_debezium_envelope"
# (reason, record), in the order they are tried after the JSON rules.
REASONS = (
    (NOT_ENVELOPE, "debezium: no string `op` where the envelope should be (schemas mode wrong?)"),
    ("unsupported_op:<op>", "debezium: an op other than r, c, u, d (t truncate, m message)"),
    ("missing_or_invalid:after", "debezium: an r, c or u whose `after` lacks the key field"),
    ("missing_or_invalid:before", "debezium: a d whose `before` lacks the key field"),
)


def root(spec: TopicSpec) -> str:
    """Where the envelope sits in a value (and the key's fields in a key), as a path prefix."""
    return "payload." if spec.schemas == "embedded" else ""


def key_column(spec: TopicSpec) -> ColumnSpec:
    return next(c for c in spec.columns if c.name == spec.key_field)


def toastable(column: ColumnSpec) -> bool:
    """Whether Debezium can write :data:`PLACEHOLDER` for the column: the types read from a
    JSON string that Postgres can store out of line (text, json, jsonb, numeric)."""
    return column.type == "string" or decimal_of(column.type) is not None


def decimal_text(precision: int, scale: int) -> str:
    """The regex of a ``decimal(precision, scale)`` written as Debezium's decimal string
    (``decimal.handling.mode=string``): plain notation, at most the column's digits."""
    whole = precision - scale
    integer = "0" if whole == 0 else rf"(?:0|[1-9][0-9]{{0,{whole - 1}}})"
    fraction = rf"(?:\.[0-9]{{1,{scale}}})?" if scale else ""
    return rf"-?{integer}{fraction}"


# ----------------------------------------------------------------------------- Spark


def _typed(v: Column, path: str, column_type: str) -> Column:
    """The value at ``path`` of the payload ``v`` as ``column_type``, or NULL."""
    from pyspark.sql import functions as F

    from backfill_assets.spec.transforms import json_field, text_timestamp

    if column_type == "timestamp":
        return text_timestamp(json_field(v, path, "string"))
    decimal = decimal_of(column_type)
    if decimal is not None:
        text = json_field(v, path, "string")
        return F.when(text.rlike(rf"^{decimal_text(*decimal)}\z"), text.try_cast(column_type))
    return json_field(v, path, column_type)


def _reads(spec: TopicSpec, v: Column) -> dict[str, Column]:
    """The fields read from each value (inside ``reading``: by the strict JVM reader)."""
    from backfill_assets.spec.transforms import json_field

    at = "$." + root(spec)
    key = key_column(spec)
    read = {
        "_op": json_field(v, f"{at}op", "string"),
        "_lsn": json_field(v, f"{at}source.lsn", "bigint"),
        "_ts_ms": json_field(v, f"{at}ts_ms", "bigint"),
        "_source_ms": json_field(v, f"{at}source.ts_ms", "bigint"),
        "_before_key": _typed(v, f"{at}before.{key.name}", key.type),
    }
    for c in spec.source_columns:
        read[f"_a_{c.name}"] = _typed(v, f"{at}after.{c.name}", c.type)
        if toastable(c):
            read[f"_t_{c.name}"] = json_field(v, f"{at}after.{c.name}", "string") == PLACEHOLDER
    return read


def decode_stage(spec: TopicSpec, raw: DataFrame) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, ``schema_version``, the spec's columns (source and CDC) and what
    :func:`rules` reads (``_invalid_json``, ``_object``, ``_op``, ``_has_after``,
    ``_has_before``); and the names of the Kafka columns. Each value is read once by the strict
    JVM reader; a tombstone's key once more, as JSON."""
    from pyspark.sql import functions as F

    from backfill_assets.lake.decode.json_payload import payload_stage
    from backfill_assets.spec.transforms import StrictReader, reading

    at, key = "$." + root(spec), key_column(spec)
    v = F.col("_v")
    reader = StrictReader(v, "_j")
    with reading(reader):
        read = _reads(spec, v)  # the very column object: the reader reads its fields
        has_after = reader.field(f"{at}after.{key.name}", "present")
        has_before = reader.field(f"{at}before.{key.name}", "present")
    keys = StrictReader(F.col("_kv"), "_k")
    tombstone_key = keys.field(f"{at}{key.name}", key.type)
    assert has_after is not None and has_before is not None and tombstone_key is not None
    df, kafka_cols = payload_stage(raw, reader)
    key_text = F.col("kafka_key").cast("string")
    df = df.select(
        *kafka_cols,
        "_j",
        F.when(
            F.col("is_tombstone") & F.is_valid_utf8(key_text),
            keys.call(raw.sparkSession, key_text),
        ).alias("_k"),
    ).select(
        *kafka_cols,
        (~F.coalesce(reader.whole(), F.lit(False))).alias("_invalid_json"),
        F.coalesce(reader.is_object(), F.lit(False)).alias("_object"),
        *[expr.alias(name) for name, expr in read.items()],
        F.coalesce(has_after, F.lit(False)).alias("_has_after"),
        F.coalesce(has_before, F.lit(False)).alias("_has_before"),
        tombstone_key.alias("_tombstone_key"),
    )
    version = F.lit(spec.latest_version).cast("int")
    return rows(spec, df, kafka_cols, version, ["_invalid_json", "_object"]), kafka_cols


def rows(
    spec: TopicSpec, df: DataFrame, kafka_cols: list[str], version: Column, keep: list[str]
) -> DataFrame:
    """The spec's columns from the fields :func:`_reads` read (``_op``, ``_lsn``, ``_ts_ms``,
    ``_source_ms``, ``_before_key``, ``_tombstone_key``, ``_a_<column>``, ``_t_<column>``),
    with ``version`` as ``schema_version``, the ``keep`` columns and what :func:`rules` reads.
    The JSON envelope's and the Avro one's (:mod:`.debezium_avro`) alike."""
    from pyspark.sql import functions as F

    from backfill_assets.spec.model import SPARK_TYPES

    op, key = F.col("_op"), spec.key_field
    events = op.isin(*EVENT_OPS)
    key_value = (
        F.when(F.col("is_tombstone"), F.col("_tombstone_key"))
        .when(op == DELETE, F.col("_before_key"))
        .when(events, F.col(f"_a_{key}"))
    )
    values: dict[str, Column] = {}
    for c in spec.source_columns:
        kept = events & ~F.col(f"_t_{c.name}") if toastable(c) else events
        values[c.name] = key_value if c.name == key else F.when(kept, F.col(f"_a_{c.name}"))
    listed = F.concat_ws(
        ",",
        *[
            F.when(F.col(f"_t_{c.name}"), F.lit(c.name))
            for c in spec.source_columns
            if toastable(c)
        ],
    )
    source_ms = F.col("_source_ms")
    values.update(
        cdc_op=op,
        cdc_lsn=F.col("_lsn"),
        cdc_ts_ms=F.col("_ts_ms"),
        cdc_source_ts=F.when(
            source_ms.between(MIN_EPOCH_MS, MAX_EPOCH_MS), F.timestamp_millis(source_ms)
        ),
        cdc_event_id=F.concat(
            F.col("_lsn").cast("string"), F.lit(":"), op, F.lit(":"), key_value.cast("string")
        ),
        cdc_unavailable=F.when(events & (listed != F.lit("")), listed),
    )
    return df.select(
        *kafka_cols,
        version.alias("schema_version"),
        *[values[c.name].cast(SPARK_TYPES[c.type]).alias(c.name) for c in spec.columns],
        *keep,
        "_op",
        "_has_after",
        "_has_before",
    )


def rules() -> list[tuple[Column, Column]]:
    """A value's reasons (conditions over :func:`decode_stage`'s frame), first match wins:
    the JSON rules, then :data:`REASONS`."""
    from pyspark.sql import functions as F

    return [
        (~F.is_valid_utf8(F.col("kafka_value").cast("string")), F.lit("invalid_utf8")),
        (F.col("_invalid_json"), F.lit("invalid_json")),
        (~F.col("_object"), F.lit("not_json_object")),
        *envelope_rules(),
    ]


def envelope_rules() -> list[tuple[Column, Column]]:
    """:data:`REASONS` as conditions over :func:`rows`' frame."""
    from pyspark.sql import functions as F

    op = F.col("_op")
    return [
        (op.isNull(), F.lit(NOT_ENVELOPE)),
        (~op.isin(*OPS), F.concat(F.lit("unsupported_op:"), op)),
        (op.isin(*EVENT_OPS) & ~F.col("_has_after"), F.lit("missing_or_invalid:after")),
        ((op == DELETE) & ~F.col("_has_before"), F.lit("missing_or_invalid:before")),
    ]


def unavailable(name: str) -> Column:
    """Whether a row's column ``name`` was Debezium's placeholder (``cdc_unavailable``)."""
    from pyspark.sql import functions as F

    return F.coalesce(
        F.array_contains(F.split(F.col("cdc_unavailable"), ","), F.lit(name)), F.lit(False)
    )


# ----------------------------------------------------------------------------- Python


class Reference:
    """The envelope decoded in plain Python (the content check's side): a tombstone's key, and
    a value's row or quarantine reason, by the rules above, never by Spark's expressions."""

    def __init__(self, spec: TopicSpec) -> None:
        self.spec = spec
        self.at = root(spec)
        self.key = key_column(spec)

    def tombstone_key(self, key_text: str | None) -> Any:
        """The key field's value in a tombstone's Kafka key, or None."""
        if key_text is None:
            return None
        try:
            document = reference.loads(key_text)
        except reference.InvalidJson:
            return None
        if not isinstance(document, dict):
            return None
        return self.typed(document, self.at + self.key.name, self.key.type)

    def __call__(self, payload: dict[str, Any]) -> dict[str, Any] | str:
        """The row a JSON object's envelope gives, or the reason it is quarantined."""
        at = self.at
        op = reference.field(payload, f"{at}op", "string")
        if op is None:
            return NOT_ENVELOPE
        if op not in OPS:
            return f"unsupported_op:{op}"
        side = "before" if op == DELETE else "after"
        if not reference.present(payload, f"{at}{side}.{self.key.name}"):
            return f"missing_or_invalid:{side}"
        row: dict[str, Any] = {}
        missing: list[str] = []
        for c in self.spec.source_columns:
            path = f"{at}after.{c.name}"
            if op == DELETE:
                row[c.name] = None
            elif toastable(c) and reference.field(payload, path, "string") == PLACEHOLDER:
                row[c.name] = None
                missing.append(c.name)
            else:
                row[c.name] = self.typed(payload, path, c.type)
        if op == DELETE:
            row[self.key.name] = self.typed(payload, f"{at}before.{self.key.name}", self.key.type)
        lsn = reference.field(payload, f"{at}source.lsn", "bigint")
        key = row[self.key.name]
        row.update(
            cdc_op=op,
            cdc_lsn=lsn,
            cdc_ts_ms=reference.field(payload, f"{at}ts_ms", "bigint"),
            cdc_source_ts=reference.millis_timestamp(
                reference.field(payload, f"{at}source.ts_ms", "bigint")
            ),
            cdc_event_id=None if lsn is None or key is None else f"{lsn}:{op}:{key}",
            cdc_unavailable=",".join(missing) or None,
        )
        return row

    @staticmethod
    def typed(document: dict[str, Any], path: str, column_type: str) -> Any:
        if column_type == "timestamp":
            return reference.text_timestamp(reference.field(document, path, "string"))
        decimal = decimal_of(column_type)
        if decimal is not None:
            text = reference.field(document, path, "string")
            if text is None or not re.fullmatch(decimal_text(*decimal), text, re.ASCII):
                return None
            return Decimal(text)
        return reference.field(document, path, column_type)
