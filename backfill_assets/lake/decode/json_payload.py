"""JSON topics: the payload read once by the strict JVM reader and upcast per schema version
(and the reasons a JSON payload is quarantined). A json_schema topic's payload is the same
JSON after its wire-format header. Builds Spark expressions only; runs and writes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backfill_assets.lake.decode.envelope import KAFKA_STAGE_COLUMNS, id_column, kafka_columns
from backfill_assets.spec.model import SPARK_TYPES, TopicSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from backfill_assets.spec.transforms import StrictReader

# Closes the array a record is parsed in (see :func:`parse`); no real payload ends with it.
_END = "backfill-assets:end-of-record"


def json_stage(
    spec: TopicSpec, raw: DataFrame, payload: Column | None = None, *, sid: bool = False
) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, ``_invalid_json``, ``schema_version``, ``_object`` and the spec's
    columns read from the JSON payload (``payload``, default the Kafka value); and the names of
    the Kafka columns. With ``sid``, the value's schema id (``id_column()``) is carried along
    as ``_sid``, one of those names."""
    from pyspark.sql import functions as F

    from backfill_assets.spec.transforms import StrictReader, json_field, reading

    v = F.col("_v")
    # The upcasters' fields are read by one strict JVM pass over the text (StrictReader); it
    # also says whether the text is exactly one JSON value and whether that is an object.
    reader = StrictReader(v, "_j")
    with reading(reader):
        if spec.version_field is None:  # no version field: every record is the latest version
            version_expr = F.lit(spec.latest_version).cast("int")
        else:
            version_expr = json_field(v, f"$.{spec.version_field}", "int")
        upcast = {ver: spec.upcaster(ver)(v) for ver in spec.versions}
        present = reader.field(f"$.{spec.key_field}", "present")
    if sid:
        raw = raw.select("*", id_column().alias("_sid"))
    df, kafka_cols = payload_stage(raw, reader, payload, sid=sid)
    df = df.select(
        *kafka_cols,
        "_j",
        "_v",
        version_expr.alias("schema_version"),
        F.coalesce(reader.is_object(), F.lit(False)).alias("_object"),
    )
    version = F.col("schema_version")
    typed = _typed_columns(spec, upcast, version)
    col_names = [c.name for c in spec.columns]
    df = df.select(*kafka_cols, "_j", "_v", "schema_version", "_object", *typed)
    # The key stands in for a key field the payload lacks (tombstones), if it is UTF-8 text.
    key_str = F.col("kafka_key").cast("string")
    if present is None:
        absent = F.try_variant_get(v, f"$.{spec.key_field}", "variant").isNull()
    else:
        absent = ~F.coalesce(present, F.lit(False))
    key_text = F.when(absent & F.is_valid_utf8(key_str), key_str)
    df = df.select(
        *kafka_cols,
        (~F.coalesce(reader.whole(), F.lit(False))).alias("_invalid_json"),
        "schema_version",
        "_object",
        *[
            F.coalesce(F.col(name), key_text).alias(name) if name == spec.key_field else name
            for name in col_names
        ],
    )
    return df, kafka_cols


def payload_stage(
    raw: DataFrame, reader: StrictReader, payload: Column | None = None, *, sid: bool = False
) -> tuple[DataFrame, list[str]]:
    """The Kafka columns (with ``_sid``, which ``raw`` then has, if ``sid``), the strict
    reader's struct ``_j`` and the payload as VARIANT ``_v`` (NULL unless the text is exactly
    one JSON value); and the names of the Kafka columns, known without asking Spark."""
    from pyspark.sql import functions as F

    value_str = (F.col("value") if payload is None else payload).cast("string")
    carried = [F.col("_sid")] if sid else []
    # A field the JVM reader cannot read (an upcaster's own VARIANT expression) reads ``_v``,
    # the payload as VARIANT; unused, Spark prunes it and the text is parsed once.
    # Spark's JSON parser stops after the first value, so '{...} junk' or '{...}{...}' would
    # parse as the first object and silently lose the rest. Parsed as the first element of an
    # array closed by a sentinel, only a record holding exactly one JSON value parses whole.
    df = raw.select(
        *kafka_columns(),
        *carried,
        reader.call(raw.sparkSession, value_str).alias("_j"),
        F.try_parse_json(F.concat(F.lit("["), value_str, F.lit(f',"{_END}"]'))).alias("_w"),
    )
    kafka_cols = [*KAFKA_STAGE_COLUMNS, *(["_sid"] if sid else [])]
    w = F.col("_w")
    whole = (F.try_variant_get(w, "$[1]", "string") == F.lit(_END)) & F.try_variant_get(
        w, "$[2]", "variant"
    ).isNull()
    df = df.select(
        *kafka_cols, "_j", F.when(whole, F.try_variant_get(w, "$[0]", "variant")).alias("_v")
    )
    return df, kafka_cols


def _typed_columns(
    spec: TopicSpec, upcast: dict[int, dict[str, Column]], version: Column
) -> list[Column]:
    """Each spec column as its type, read by the upcaster of the record's schema version."""
    from pyspark.sql import functions as F

    versions = spec.versions
    typed: list[Column] = []
    for col in spec.columns:
        branches = [upcast[ver].get(col.name, F.lit(None)) for ver in versions]
        if len({str(b) for b in branches}) == 1:
            # Every version reads the column the same way: no per-version dispatch (a record
            # of an unknown version is quarantined before its columns matter).
            expr = branches[0]
        else:
            case: Column | None = None
            for ver, branch in zip(versions, branches, strict=True):
                case = (
                    F.when(version == ver, branch)
                    if case is None
                    else case.when(version == ver, branch)
                )
            assert case is not None
            expr = case
        typed.append(expr.cast(SPARK_TYPES[col.type]).alias(col.name))
    return typed


def json_rules(
    spec: TopicSpec, version: Column, value: Column | None = None
) -> list[tuple[Column, Column]]:
    """The json payload's reasons; ``value``: the payload's bytes (default the Kafka value)."""
    from pyspark.sql import functions as F

    value = F.col("kafka_value") if value is None else value
    return [
        (~F.is_valid_utf8(value.cast("string")), F.lit("invalid_utf8")),
        (F.col("_invalid_json"), F.lit("invalid_json")),
        (~F.col("_object"), F.lit("not_json_object")),
        (
            version.isNull() | ~version.isin(spec.versions),
            F.concat(
                F.lit("unknown_schema_version:"), F.coalesce(version.cast("string"), F.lit("?"))
            ),
        ),
    ]
