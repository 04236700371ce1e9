"""The Kafka envelope every format shares: the Kafka columns of the raw table (projected once
from Spark's Kafka source), and Confluent's wire format in front of a registry-described value
(magic byte 0, then the registry's schema id, 4 bytes big-endian). Each format's decoding sits
beside this module (avro.py, protobuf.py, json_schema.py, json_payload.py)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

KAFKA_COLUMNS = (
    ("topic", "string"),
    ("kafka_partition", "int"),
    ("kafka_offset", "bigint"),
    ("kafka_timestamp", "timestamp"),
    # The Kafka-time hour whose offset range the record was read for (the table's partition).
    ("kafka_hour", "timestamp"),
    # A hash of the record's partition, offset, key and value bytes as Kafka held them.
    ("record_hash", "bigint"),
    ("kafka_key", "binary"),
    ("is_tombstone", "boolean"),
    ("schema_version", "int"),
)
WIRE_HEADER = 5  # Confluent's wire format: magic byte 0, then the schema id


def schema_id(value: bytes | None) -> int | None:
    """The schema id of a value in Confluent's wire format, or None if it is not one."""
    if value is None or len(value) < WIRE_HEADER or value[0] != 0:
        return None
    return int(struct.unpack(">I", value[1:WIRE_HEADER])[0])


def kafka_columns() -> list[Column]:
    """Spark's Kafka source columns (after the replay has tagged each record with its
    ``kafka_hour`` and ``record_hash``) as the raw table's Kafka columns, with the value kept as
    ``kafka_value`` for the quarantine."""
    from pyspark.sql import functions as F

    return [
        F.col("topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        F.col("kafka_hour"),
        F.col("record_hash"),
        F.col("key").alias("kafka_key"),
        F.col("value").alias("kafka_value"),
        F.col("value").isNull().alias("is_tombstone"),
    ]


# The names of kafka_columns(), in order: known here, so no stage asks Spark for a frame's
# columns (over Spark Connect, a round trip each time).
KAFKA_STAGE_COLUMNS = (
    "topic",
    "kafka_partition",
    "kafka_offset",
    "kafka_timestamp",
    "kafka_hour",
    "record_hash",
    "kafka_key",
    "kafka_value",
    "is_tombstone",
)


def id_column() -> Column:
    """The schema id of the Kafka ``value`` column (NULL unless in the wire format)."""
    from pyspark.sql import functions as F

    value = F.col("value")
    wire = (F.length(value) >= WIRE_HEADER) & (F.hex(F.substring(value, 1, 1)) == F.lit("00"))
    return F.when(wire, F.conv(F.hex(F.substring(value, 2, 4)), 16, 10).cast("bigint"))


def wire_stage(raw: DataFrame) -> tuple[DataFrame, list[str]]:
    """The Kafka columns of a wire-format topic's parse and ``_sid`` (:func:`id_column`); and
    the names of the Kafka columns."""

    df = raw.select(*kafka_columns(), id_column().alias("_sid"))
    return df, list(KAFKA_STAGE_COLUMNS)
