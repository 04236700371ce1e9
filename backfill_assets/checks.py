"""Blocking audits of a run's branch, before anything is published.

Every check reads the branch (never main) restricted to the replayed window, and returns its
figures per Kafka-time hour in metadata: in a single-run partition range Dagster evaluates a
partitioned check once (partition=None), so the per-partition detail lives there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backfill_assets.replay import ReplayOutcome, cache, checksum_expr, window_filter
from backfill_assets.spec import ColumnSpec, TopicSpec

if TYPE_CHECKING:
    import pandas as pd
    import pandera.pandas as pa
    from pyspark.sql import DataFrame, SparkSession

CHECK_NAMES = (
    "count_reconciliation",
    "checksum",
    "schema_contract",
    "uniqueness",
    "quarantine_ratio",
)


@dataclass
class CheckOutcome:
    name: str
    passed: bool
    summary: str
    metadata: dict[str, Any] = field(default_factory=dict)


def run_checks(spark: SparkSession, spec: TopicSpec, outcome: ReplayOutcome) -> list[CheckOutcome]:
    """All blocking checks on ``table``'s run branch; none of them writes anything."""
    branch = spark.table(outcome.branch.ident).where(window_filter(outcome.contract))
    branch = cache(branch)
    try:
        return [
            _count_reconciliation(branch, outcome),
            _checksum(branch, spec, outcome),
            _schema_contract(branch, spec),
            _uniqueness(branch, spec),
            _quarantine_ratio(spec, outcome),
        ]
    finally:
        branch.unpersist()


def _count_reconciliation(branch: DataFrame, outcome: ReplayOutcome) -> CheckOutcome:
    on_branch = branch.count()
    expected = outcome.records_read - outcome.duplicates - outcome.quarantined
    offsets = outcome.contract.records
    # Kafka control records (transaction markers) occupy offsets but are never returned.
    passed = on_branch == expected == outcome.rows_written and outcome.records_read <= offsets
    bad_hours = [
        h
        for h, c in outcome.per_hour.items()
        if c["read"] != c["written"] + c["quarantined"] + c["duplicates"]
    ]
    return CheckOutcome(
        "count_reconciliation",
        passed and not bad_hours,
        (
            f"rows on branch {on_branch} = offsets read {outcome.records_read} - duplicates "
            f"{outcome.duplicates} - quarantined {outcome.quarantined} (expected {expected}); "
            f"offsets in contract {offsets}"
        ),
        {
            "rows_on_branch": on_branch,
            "offsets_in_contract": offsets,
            "records_read": outcome.records_read,
            "duplicates": outcome.duplicates,
            "quarantined": outcome.quarantined,
            "expected_rows": expected,
            "per_hour": outcome.per_hour,
        },
    )


def _checksum(branch: DataFrame, spec: TopicSpec, outcome: ReplayOutcome) -> CheckOutcome:
    on_branch = str(branch.agg(checksum_expr(spec)).first()[0])  # type: ignore[index]
    return CheckOutcome(
        "checksum",
        on_branch == outcome.checksum,
        f"branch checksum {on_branch} vs computed {outcome.checksum}",
        {"branch_checksum": on_branch, "computed_checksum": outcome.checksum},
    )


def _uniqueness(branch: DataFrame, spec: TopicSpec) -> CheckOutcome:
    from pyspark.sql import functions as F

    events = branch.where(~F.col("is_tombstone"))
    row = events.agg(
        F.count("*").alias("n"), F.countDistinct(spec.event_id_field).alias("ids")
    ).first()
    total = branch.count()
    offsets = branch.select("kafka_partition", "kafka_offset").distinct().count()
    assert row is not None
    dup_ids = int(row["n"]) - int(row["ids"])
    dup_offsets = total - offsets
    return CheckOutcome(
        "uniqueness",
        dup_ids == 0 and dup_offsets == 0,
        f"{dup_ids} repeated {spec.event_id_field}, {dup_offsets} repeated (partition, offset)",
        {"repeated_event_ids": dup_ids, "repeated_offsets": dup_offsets, "rows": total},
    )


def _quarantine_ratio(spec: TopicSpec, outcome: ReplayOutcome) -> CheckOutcome:
    ratio = outcome.quarantined / outcome.records_read if outcome.records_read else 0.0
    worst = {
        h: round(c["quarantined"] / c["read"], 4) for h, c in outcome.per_hour.items() if c["read"]
    }
    return CheckOutcome(
        "quarantine_ratio",
        ratio <= spec.quarantine_max_ratio,
        f"quarantined {outcome.quarantined}/{outcome.records_read} = {ratio:.4f} "
        f"(limit {spec.quarantine_max_ratio})",
        {
            "ratio": round(ratio, 6),
            "limit": spec.quarantine_max_ratio,
            "reasons": outcome.quarantine_reasons,
            "ratio_per_hour": worst,
        },
    )


def _schema_contract(branch: DataFrame, spec: TopicSpec) -> CheckOutcome:
    """pandera's contract, evaluated chunk by chunk inside Spark executors."""
    from pyspark.sql import functions as F

    events = branch.where(~F.col("is_tombstone")).select(*[c.name for c in spec.columns])
    columns = spec.columns

    def validate(chunks: Iterable[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd
        import pandera.errors

        schema = contract_schema(columns)
        for chunk in chunks:
            try:
                schema.validate(chunk, lazy=True)
                failures: list[tuple[str, str, int]] = []
            except pandera.errors.SchemaErrors as err:
                cases = err.failure_cases
                failures = [
                    (str(col), str(check), int(n))
                    for (col, check), n in cases.groupby(["column", "check"]).size().items()
                ]
            yield pd.DataFrame(failures or [("", "", 0)], columns=["column", "check", "failures"])

    result = events.mapInPandas(validate, "column string, check string, failures long")
    rows = result.groupBy("column", "check").agg(F.sum("failures").alias("n")).collect()
    failed = {f"{r['column']}: {r['check']}": int(r["n"]) for r in rows if r["n"]}
    return CheckOutcome(
        "schema_contract",
        not failed,
        "all rows satisfy the contract" if not failed else f"contract violations: {failed}",
        {"violations": failed, "columns": [c.name for c in spec.columns]},
    )


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
            # pandas may hand strings over as object or as its str dtype: check the values.
            checks.append(pa.Check(lambda v: isinstance(v, str), element_wise=True, name="is_str"))
        nullable_int = c.nullable and c.type in ("bigint", "int")
        dtype = None if c.type in ("timestamp", "string") or nullable_int else dtypes[c.type]
        cols[c.name] = pa.Column(dtype, checks=checks, nullable=c.nullable, coerce=False)
    return pa.DataFrameSchema(cols, strict=True)
