"""Per-topic transforms: upcasters from each schema version to the latest schema."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column


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

    kind = F.schema_of_variant(F.try_variant_get(v, path, "variant"))
    value = F.try_variant_get(v, path, spark_type)
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
            exact = F.try_variant_get(v, path, "decimal(38,18)")
            ok = integer | (fraction & (value.cast("decimal(38,18)") == exact))
    return F.when(ok, value)
