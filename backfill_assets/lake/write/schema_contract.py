"""The schema contract: pandera's schema generated from a topic's (or table's) columns, and its
violations counted where it is cheapest (in the driver, as Spark expressions, or by pandera in
Spark's executors), each way reporting what pandera would. Reads only; writes nothing."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from backfill_assets.spec.model import ColumnSpec

if TYPE_CHECKING:
    import pandas as pd
    import pandera.pandas as pa
    from pyspark.sql import Column, DataFrame

_ARROW_BATCH = "spark.sql.execution.arrow.maxRecordsPerBatch"
CONTRACT_BATCH_ROWS = 100_000  # rows per pandera call in the contract check
_ARROW_TO_PANDAS = "spark.sql.execution.arrow.pyspark.enabled"
# At most this many rows are validated in the driver process (see violations).
CONTRACT_DRIVER_ROWS = 50_000


def violations(
    events: DataFrame, columns: tuple[ColumnSpec, ...], *, at_most: int | None = None
) -> dict[str, int]:
    """Violations of pandera's contract for ``columns`` (generated from the spec) by ``events``
    (which holds exactly those columns), as pandera reports them (``"<column>: <check>"`` ->
    failures; empty when every row satisfies the contract).

    ``at_most`` is an upper bound of the rows, when the caller knows one. Up to
    :data:`CONTRACT_DRIVER_ROWS` rows are validated here, in the driver process (Arrow to
    pandas, so the driver holds at most that many rows): a small window then does not start
    Spark's Python workers, whose start and pandas/pandera imports cost a fresh run process
    about 2 s. More rows (or an unknown count) are counted by Spark with the pandera schema's
    checks translated to Spark expressions (:func:`contract_violations`, one aggregation, no
    Python workers); a schema with a check that has no translation is validated by pandera
    chunk by chunk inside Spark executors. Every way reports the same violations."""
    failed = None
    if at_most is not None and at_most <= CONTRACT_DRIVER_ROWS:
        failed = _violations_here(events, columns)
    if failed is None:
        failed = _violations_in_spark(events, columns)
    if failed is None:
        failed = _violations_in_executors(events, columns)
    return failed


def _failures(schema: pa.DataFrameSchema, frame: pd.DataFrame) -> list[tuple[str, str, int]]:
    """(column, check, failing values) of one frame; empty when it satisfies the contract."""
    import pandera.errors

    try:
        schema.validate(frame, lazy=True)
    except pandera.errors.SchemaErrors as err:
        cases = err.failure_cases
        return [
            (str(col), str(check), int(n))
            for (col, check), n in cases.groupby(["column", "check"]).size().items()
        ]
    return []


def _violations_here(events: DataFrame, columns: tuple[ColumnSpec, ...]) -> dict[str, int] | None:
    """The violations, validated in this process; None if ``events`` holds more rows than
    :data:`CONTRACT_DRIVER_ROWS` after all (then the executors validate them)."""
    frame = _to_pandas(events.limit(CONTRACT_DRIVER_ROWS + 1))
    if len(frame) > CONTRACT_DRIVER_ROWS:
        return None
    return frame_violations(frame, columns)


def frame_violations(frame: pd.DataFrame, columns: tuple[ColumnSpec, ...]) -> dict[str, int]:
    """The violations of events already in this process (as ``toPandas`` gives them)."""
    return {
        f"{col}: {check}": n for col, check, n in _failures(contract_schema(columns), frame) if n
    }


def _to_pandas(events: DataFrame) -> pd.DataFrame:
    """``events`` as pandas, converted through Arrow as mapInPandas converts them. A Spark
    Connect client always converts through Arrow (and ignores the setting), so only a classic
    session has it switched on, for this call only: over Connect that would cost three round
    trips (read, set and restore the setting)."""
    from backfill_assets.stack import fetch
    from backfill_assets.stack.spark import is_connect

    if is_connect(events.sparkSession):
        return fetch.to_pandas(events)
    conf = events.sparkSession.conf
    before = conf.get(_ARROW_TO_PANDAS, None)
    conf.set(_ARROW_TO_PANDAS, "true")
    try:
        return events.toPandas()
    finally:
        if before is None:
            conf.unset(_ARROW_TO_PANDAS)
        else:
            conf.set(_ARROW_TO_PANDAS, before)


def _violations_in_spark(
    events: DataFrame, columns: tuple[ColumnSpec, ...]
) -> dict[str, int] | None:
    """The violations counted by Spark in one aggregation; None if the schema has a check
    :func:`contract_violations` cannot translate."""
    from pyspark.sql import functions as F

    counts = contract_violations(contract_schema(columns), events)
    if counts is None:
        return None
    if not counts:
        return {}
    row = events.agg(*[F.sum(c).alias(f"_v{i}") for i, c in enumerate(counts.values())]).first()
    assert row is not None
    return contract_failures({name: row[f"_v{i}"] for i, name in enumerate(counts)})


# pandera checks with a Spark translation (contract_violations).
_TRANSLATED = (
    "isin",
    "greater_than_or_equal_to",
    "less_than_or_equal_to",
    "is_str",
    "is_datetime",
)
# A counter named with this suffix is a column-level failure, which pandera reports once.
_ONCE = " (once)"
# pandera dtypes and the Spark types whose values pandas receives with that dtype.
_PANDAS_DTYPES = {"int64": "bigint", "int32": "int", "float64": "double", "bool": "boolean"}


def contract_violations(
    schema: pa.DataFrameSchema, events: DataFrame, types: Mapping[str, str] | None = None
) -> dict[str, Column] | None:
    """The pandera ``schema``'s checks as Spark expressions over ``events``: per counter, a
    0/1 column to sum; :func:`contract_failures` turns the sums into pandera's report
    (``"<column>: <check>"`` -> failures). None if a check has no translation (then pandera
    itself must run).

    As in pandera: value checks skip NULLs; a NULL in a non-nullable column fails
    ``not_nullable``, and in an integer column also its dtype, once (pandas holds it as
    float); a type check (dtype, ``is_str``, ``is_datetime``) holds when the Spark column has
    the type whose values pandas receives as that type, else it fails once, and so does every
    value check of the column. ``types`` (column -> Spark type) when the caller knows the
    frame's types without asking Spark (over Connect, ``dtypes`` is a round trip)."""
    from pyspark.sql import functions as F

    types = dict(events.dtypes) if types is None else dict(types)
    if set(types) != set(schema.columns):
        return None  # strict: pandera names the missing or extra columns
    out: dict[str, Column] = {}
    for name, column in schema.columns.items():
        fail = _column_violations(column, F.col(name), types[name])
        if fail is None:
            return None
        for check_name, bad in fail.items():
            out[f"{name}: {check_name}"] = F.when(bad, 1).otherwise(0)
    return out


def _column_violations(column: pa.Column, c: Column, spark_type: str) -> dict[str, Column] | None:
    """One column's counters for :func:`contract_violations` (check -> failing-row
    expression), or None if one of its checks has no translation."""
    fail: dict[str, Column] = {}
    wrong_type = _dtype_violation(column, c, spark_type, fail)
    for check in column.checks:
        if check.name in ("is_str", "is_datetime"):
            wanted = "string" if check.name == "is_str" else "timestamp"
            wrong_type = wrong_type or spark_type != wanted
    if not column.nullable:
        fail["not_nullable"] = c.isNull()
    for check in column.checks:
        key = str(check.error or check.name)
        if check.name not in _TRANSLATED:
            return None
        counter, bad = _check_violation(check, key, c, spark_type, wrong_type)
        fail[counter] = bad
    return fail


def _dtype_violation(
    column: pa.Column, c: Column, spark_type: str, fail: dict[str, Column]
) -> bool:
    """Add the column's dtype counter to ``fail``; True if the Spark type is not the one
    whose values pandas receives with that dtype."""
    from pyspark.sql import functions as F

    if column.dtype is None:
        return False
    dtype = str(column.dtype)
    if _PANDAS_DTYPES.get(dtype) != spark_type:
        fail[f"dtype('{dtype}')" + _ONCE] = F.lit(True)
        return True
    if dtype.startswith("int"):
        fail[f"dtype('{dtype}')" + _ONCE] = c.isNull()
    return False


def _check_violation(
    check: pa.Check, key: str, c: Column, spark_type: str, wrong_type: bool
) -> tuple[str, Column]:
    """The counter name and failing-row expression of one translated value or type check."""
    from pyspark.sql import functions as F

    stats: Any = check.statistics
    if wrong_type and check.name not in ("is_str", "is_datetime"):
        # pandera cannot compare values of another type: the check fails, once.
        return key + _ONCE, F.lit(True)
    if check.name == "isin":
        return key, c.isNotNull() & ~c.isin(list(stats["allowed_values"]))
    if check.name == "greater_than_or_equal_to":
        return key, c < F.lit(stats["min_value"])
    if check.name == "less_than_or_equal_to":
        return key, c > F.lit(stats["max_value"])
    wanted = "string" if check.name == "is_str" else "timestamp"
    return key + _ONCE, F.lit(spark_type != wanted)


def contract_failures(sums: dict[str, Any]) -> dict[str, int]:
    """pandera's report (``"<column>: <check>"`` -> failures) from the sums of
    :func:`contract_violations`' counters."""
    failed: dict[str, int] = {}
    for counter, total in sums.items():
        name, n = counter, int(total or 0)
        if counter.endswith(_ONCE):
            name, n = counter[: -len(_ONCE)], min(n, 1)
        if n:
            failed[name] = failed.get(name, 0) + n
    return failed


def _violations_in_executors(events: DataFrame, columns: tuple[ColumnSpec, ...]) -> dict[str, int]:
    from pyspark.sql import functions as F

    def validate(chunks: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd

        schema = contract_schema(columns)
        for chunk in chunks:
            failures = _failures(schema, chunk)
            yield pd.DataFrame(failures or [("", "", 0)], columns=["column", "check", "failures"])

    result = events.mapInPandas(validate, "column string, check string, failures long")
    conf = events.sparkSession.conf
    before = conf.get(_ARROW_BATCH, None)
    # pandera has a fixed cost per call: hand it fewer, larger chunks (Spark's default is
    # 10,000 rows), for this job only.
    conf.set(_ARROW_BATCH, str(CONTRACT_BATCH_ROWS))
    try:
        rows = result.groupBy("column", "check").agg(F.sum("failures").alias("n")).collect()
    finally:
        if before is None:
            conf.unset(_ARROW_BATCH)
        else:
            conf.set(_ARROW_BATCH, before)
    return {f"{r['column']}: {r['check']}": int(r["n"]) for r in rows if r["n"]}


def contract_schema(columns: tuple[ColumnSpec, ...]) -> pa.DataFrameSchema:
    """The pandera schema for a topic's columns (types, nullability, ranges, allowed values)."""
    import pandera.pandas as pa

    dtypes = {
        "bigint": "int64",
        "int": "int32",
        "double": "float64",
        "boolean": "bool",
    }
    cols = {}
    for c in columns:
        checks = []
        if c.allowed is not None:
            checks.append(pa.Check.isin(list(c.allowed)))
        if c.min is not None:
            checks.append(pa.Check.ge(c.min))
        if c.max is not None:
            checks.append(pa.Check.le(c.max))
        if c.type == "timestamp":
            # Spark hands timestamps to pandas as naive datetime64 of some unit: check the kind.
            checks.append(
                pa.Check(lambda s: s.dtype.kind == "M", element_wise=False, name="is_datetime")
            )
        if c.type == "string":
            # pandas may hand strings over as object or as its str dtype: check the values,
            # vectorized (an element-wise Python check cost more than the rest of pandera).
            checks.append(pa.Check(_all_strings, element_wise=False, name="is_str"))
        nullable_int = c.nullable and c.type in ("bigint", "int")
        dtype = None if nullable_int else dtypes.get(c.type)
        cols[c.name] = pa.Column(dtype, checks=checks, nullable=c.nullable, coerce=False)
    return pa.DataFrameSchema(cols, strict=True)


def _all_strings(values: pd.Series) -> bool:
    """Every non-null value is a ``str`` (pandas' own inference, in C)."""
    import pandas as pd

    return pd.api.types.infer_dtype(values, skipna=True) in ("string", "empty")
