"""Upcasters for the ``orders`` topic. Each takes the parsed payload (a Spark VARIANT column)
and returns the latest schema's columns; a value that cannot be read as its type becomes NULL,
which the replay then quarantines with the column's name as the reason. Every field is read with
:func:`~backfill_assets.spec.transforms.json_field`: a value of the wrong JSON kind (``"123"`` for a
number, ``{...}`` for a string, ``12.7`` for an integer) is NULL, never coerced."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from backfill_assets.spec.transforms import (
    MAX_EPOCH_MS,
    MIN_EPOCH_MS,
    json_field,
    reference,
    text_timestamp,
)
from backfill_assets.spec.transforms.reference import Payload

if TYPE_CHECKING:
    from pyspark.sql import Column


def _common(v: Column) -> dict[str, Column]:
    return {
        name: json_field(v, f"$.{name}", "string")
        for name in ("event_id", "order_id", "customer_id", "event_type", "status", "currency")
    }


def upcast_v1(v: Column) -> dict[str, Column]:
    """v1: ``amount`` in major units (float), ``event_time`` an ISO-8601 string, no channel."""
    from pyspark.sql import functions as F

    amount = json_field(v, "$.amount", "decimal(18,2)")
    return {
        **_common(v),
        "amount_minor": (amount * 100).cast("bigint"),
        "channel": F.lit("unknown"),
        "event_time": text_timestamp(json_field(v, "$.event_time", "string")),
    }


def upcast_v2(v: Column) -> dict[str, Column]:
    """v2: ``amount_minor`` in minor units, ``event_time`` epoch milliseconds, ``channel``."""
    from pyspark.sql import functions as F

    millis = json_field(v, "$.event_time", "bigint")
    return {
        **_common(v),
        "amount_minor": json_field(v, "$.amount_minor", "bigint"),
        "channel": json_field(v, "$.channel", "string"),
        "event_time": F.when(
            millis.between(MIN_EPOCH_MS, MAX_EPOCH_MS), F.timestamp_millis(millis)
        ),
    }


# The Python references of the upcasters above (see backfill_assets.spec.transforms.reference):
# written apart from them, so a wrong upcaster (or a wrong parse) disagrees with its reference
# and the raw table's decoded_content check blocks the publish.


def _common_reference(payload: Payload) -> dict[str, Any]:
    return {
        name: reference.field(payload, name, "string")
        for name in ("event_id", "order_id", "customer_id", "event_type", "status", "currency")
    }


def decode_v1(payload: Payload) -> dict[str, Any]:
    """v1 in Python: ``amount`` (two decimals at most) times 100, ISO ``event_time``, channel
    ``unknown``."""
    amount = reference.field(payload, "amount", "decimal(18,2)")
    return {
        **_common_reference(payload),
        "amount_minor": None if amount is None else int(amount * 100),
        "channel": "unknown",
        "event_time": reference.text_timestamp(reference.field(payload, "event_time", "string")),
    }


def decode_v2(payload: Payload) -> dict[str, Any]:
    """v2 in Python: ``amount_minor`` and ``channel`` as they are, epoch-ms ``event_time``."""
    return {
        **_common_reference(payload),
        "amount_minor": reference.field(payload, "amount_minor", "bigint"),
        "channel": reference.field(payload, "channel", "string"),
        "event_time": reference.millis_timestamp(reference.field(payload, "event_time", "bigint")),
    }
