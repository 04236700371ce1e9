"""Per-topic transforms: upcasters from each schema version to the latest schema."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column

    from backfill_assets.lake.spec import ColumnSpec


def json_field(v: Column, path: str, spark_type: str) -> Column:
    """The JSON value at ``path`` as ``spark_type``, or NULL when it is absent, JSON ``null``,
    or of another JSON kind, or would change in the conversion.

    Strings come only from JSON strings, booleans only from ``true``/``false``, and numeric
    types only from JSON numbers that convert without loss: ``12.7`` is not a ``bigint``,
    ``12.345`` not a ``decimal(18,2)``, ``1e30`` not a ``bigint`` (Spark's own variant casts
    would silently truncate, round or turn ``"123"``, ``true`` or ``{"a":1}`` into values).
    Objects and arrays never convert. Upcasters use it for every field they read, so a value
    of the wrong kind is quarantined as ``missing_or_invalid:<column>``.
    """
    from pyspark.sql import functions as F

    # The field is looked up once; its kind and typed value are read from that one value (Spark
    # evaluates a subexpression shared by the condition and the result once per row).
    field = F.try_variant_get(v, path, "variant")
    kind = F.schema_of_variant(field)
    value = F.try_variant_get(field, "$", spark_type)
    if spark_type == "string":
        ok = kind == F.lit("STRING")
    elif spark_type == "boolean":
        ok = kind == F.lit("BOOLEAN")
    else:
        integer = kind == F.lit("BIGINT")  # how the variant stores every JSON integer
        fraction = kind.isin("DOUBLE", "FLOAT") | kind.startswith("DECIMAL")
        if spark_type in ("double", "float"):
            ok = integer | fraction
        else:
            # Only a number written with a fraction or exponent can lose anything.
            exact = F.try_variant_get(field, "$", "decimal(38,18)")
            ok = integer | (fraction & (value.cast("decimal(38,18)") == exact))
    return F.when(ok, value)


# Epoch milliseconds Spark's timestamp_millis accepts without overflow (years 0001..9999); a
# value outside stays NULL instead of failing the whole run.
MIN_EPOCH_MS, MAX_EPOCH_MS = -62_135_596_800_000, 253_402_300_799_999


def json_timestamp(v: Column, path: str) -> Column:
    """A timestamp from a JSON integer (epoch milliseconds) or a JSON string (ISO-8601; without
    an offset it is read as UTC, the session's zone); NULL for any other kind or value."""
    from pyspark.sql import functions as F

    millis = json_field(v, path, "bigint")
    text = json_field(v, path, "string")
    return F.coalesce(
        F.when(millis.between(MIN_EPOCH_MS, MAX_EPOCH_MS), F.timestamp_millis(millis)),
        F.try_to_timestamp(text),
    )


def identity(columns: Sequence[ColumnSpec]) -> Callable[[Column], dict[str, Column]]:
    """The upcaster of a version whose fields are the columns: each column read from the field
    of the same name with :func:`json_field`'s strict typing (timestamps with
    :func:`json_timestamp`)."""

    def upcast(v: Column) -> dict[str, Column]:
        return {
            c.name: json_timestamp(v, f"$.{c.name}")
            if c.type == "timestamp"
            else json_field(v, f"$.{c.name}", c.type)
            for c in columns
        }

    return upcast
