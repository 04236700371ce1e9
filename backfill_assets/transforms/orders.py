"""Upcasters for the ``orders`` topic. Each takes the parsed payload (a Spark VARIANT column)
and returns the latest schema's columns; a value that cannot be read as its type becomes NULL,
which the replay then quarantines with the column's name as the reason."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column


def _common(v: Column) -> dict[str, Column]:
    from pyspark.sql import functions as F

    return {
        name: F.try_variant_get(v, f"$.{name}", "string")
        for name in ("event_id", "order_id", "customer_id", "event_type", "status", "currency")
    }


def upcast_v1(v: Column) -> dict[str, Column]:
    """v1: ``amount`` in major units (float), ``event_time`` an ISO-8601 string, no channel."""
    from pyspark.sql import functions as F

    amount = F.try_variant_get(v, "$.amount", "decimal(18,2)")
    return {
        **_common(v),
        "amount_minor": (amount * 100).cast("bigint"),
        "channel": F.lit("unknown"),
        "event_time": F.try_to_timestamp(F.try_variant_get(v, "$.event_time", "string")),
    }


def upcast_v2(v: Column) -> dict[str, Column]:
    """v2: ``amount_minor`` in minor units, ``event_time`` epoch milliseconds, ``channel``."""
    from pyspark.sql import functions as F

    return {
        **_common(v),
        "amount_minor": F.try_variant_get(v, "$.amount_minor", "bigint"),
        "channel": F.try_variant_get(v, "$.channel", "string"),
        "event_time": F.timestamp_millis(F.try_variant_get(v, "$.event_time", "bigint")),
    }
