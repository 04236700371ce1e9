"""A frame's rows brought to the driver, or the driver's rows made a frame, without the
session-setting questions pyspark's Spark Connect client adds.

Over Spark Connect, ``DataFrame.collect`` and ``toPandas`` each ask the server for a session
setting besides the rows (``collect``: how to return binary; ``toPandas``: whether to free
columns as it converts, and the time zone of timestamps): two round trips where one would do.
:func:`rows` and :func:`to_pandas` ask for the rows only, as Arrow batches, and convert them
here with pyspark's own conversions and the settings the project gives every session (the
session time zone is UTC, the others are Spark's defaults). A classic session has no round
trip to save and keeps pyspark's own methods.

:func:`local_frame` is ``createDataFrame`` of an Arrow table with its schema: over Connect,
pyspark asks for twelve settings first (one Config round trip) before it sends the rows inside
the plan; this sends them inside the plan directly, as pyspark does for tables under the
server's cache threshold (larger ones take pyspark's path, which uploads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backfill_assets.stack.spark import is_connect

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    from pyspark.sql import DataFrame, Row, SparkSession
    from pyspark.sql.types import StructType

# The session time zone spark_config gives every session, classic or Connect.
SESSION_TIME_ZONE = "UTC"


def arrow(frame: DataFrame) -> pa.Table:
    """``frame.toArrow()``, without its schema question over Connect (an AnalyzePlan)."""
    if not is_connect(frame.sparkSession):
        return frame.toArrow()
    return _arrow(frame)[0]


def rows(frame: DataFrame) -> list[Row]:
    """``frame.collect()``: the same rows, converted by pyspark's own code."""
    if not is_connect(frame.sparkSession):
        return frame.collect()
    from pyspark.sql.conversion import ArrowTableToRowsConversion

    table, schema = _arrow(frame)
    # binaryAsBytes: Spark's default, which the project never changes.
    return ArrowTableToRowsConversion.convert(table, schema, binary_as_bytes=True)


def to_pandas(frame: DataFrame) -> pd.DataFrame:
    """``frame.toPandas()``: the same columns, dtypes and values, in one request over Connect.
    A classic session converts as its settings say (Arrow or not: the caller's choice)."""
    if not is_connect(frame.sparkSession):
        return frame.toPandas()
    return pandas_of(*_arrow(frame))


def arrow_and_schema(frame: DataFrame) -> tuple[pa.Table, StructType]:
    """The rows as Arrow and their Spark schema: one request over Connect (classic: the
    schema is the frame's own, no request)."""
    if not is_connect(frame.sparkSession):
        return frame.toArrow(), frame.schema
    return _arrow(frame)


def pandas_of(table: pa.Table, schema: StructType) -> pd.DataFrame:
    """Rows read as Arrow (with their Spark ``schema``) as ``toPandas`` with Arrow gives them:
    pyspark's own conversion per column, timestamps in the session's zone."""
    import pandas as pd
    from pyspark.sql.pandas.types import _create_converter_to_pandas

    if table.num_rows == 0:  # as pyspark: pyarrow's conversion of no rows can crash (SPARK-51112)
        pdf = pd.DataFrame(columns=schema.names, index=range(0))
    else:
        renamed = table.rename_columns([f"col_{i}" for i in range(table.num_columns)])
        pdf = renamed.to_pandas(coerce_temporal_nanoseconds=True)
        pdf.columns = schema.names
    if not schema.fields:
        return pdf
    return pd.concat(
        [
            _create_converter_to_pandas(
                field.dataType,
                field.nullable,
                timezone=SESSION_TIME_ZONE,
                struct_in_pandas="dict",
                error_on_duplicated_field_names=True,
            )(series)
            for (_, series), field in zip(pdf.items(), schema.fields, strict=True)
        ],
        axis="columns",
    )


# Below spark.sql.session.localRelationCacheThreshold's default (64 MiB): pyspark inlines such
# a table in the plan, as local_frame does.
INLINE_BYTES = 16 << 20


def local_frame(spark: SparkSession, table: pa.Table, schema: StructType) -> DataFrame:
    """``spark.createDataFrame(table, schema)`` for a table of plain values (no timestamps:
    their zone would be the session's)."""
    if not is_connect(spark) or table.nbytes >= INLINE_BYTES:
        return spark.createDataFrame(table.to_pylist(), schema)
    from pyspark.sql.connect.dataframe import DataFrame as RemoteFrame
    from pyspark.sql.connect.plan import LocalRelation
    from pyspark.sql.pandas.types import to_arrow_schema

    # The Arrow fields as the schema declares them (a non-nullable one is refused otherwise).
    typed = table.rename_columns(schema.names).cast(to_arrow_schema(schema))
    return RemoteFrame(LocalRelation(typed, schema=schema.json()), spark)  # type: ignore[arg-type]


def _arrow(frame: DataFrame) -> tuple[pa.Table, StructType]:
    """The rows of a Spark Connect frame as Arrow, and their Spark schema as the server sent it
    with them: one ExecutePlan, no schema question (pyspark's private ``_to_table``, which
    ``collect`` itself calls; pinned with pyspark 4.1 and covered by stack/test_connect.py)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    table, schema = frame._to_table()  # type: ignore[operator]
    return table, schema or from_arrow_schema(table.schema, prefer_timestamp_ntz=True)
