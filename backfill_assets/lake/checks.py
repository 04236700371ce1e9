"""Blocking audits of a run's branch, before anything is published.

Every check reads the branch (never main) restricted to the replayed window's hours, plus the
quarantine rows this run wrote for them, and compares with a second, independent reading of
Kafka: the librdkafka pass that fixed the windows (:mod:`backfill_assets.lake.windows`) counted the
committed records of every hour and summed a hash of their partition, offset, key and value
bytes. A dropped row, an extra (aborted) record, a shifted window or a repeated offset changes
those figures for some hour, so the checks can fail. In a single-run partition range Dagster
evaluates a partitioned check once (partition=None), so per-hour detail lives in metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.replay import ReplayOutcome, hour_key, window_filter
from backfill_assets.lake.spec import ColumnSpec, TopicSpec

if TYPE_CHECKING:
    import pandas as pd
    import pandera.pandas as pa
    from pyspark.sql import Column, DataFrame, SparkSession

CHECK_NAMES = (
    "count_reconciliation",
    "checksum",
    "schema_contract",
    "uniqueness",
    "quarantine_ratio",
)
DESCRIPTIONS = {
    "count_reconciliation": (
        "Per window hour, rows on the run's branch plus quarantined records equal the committed "
        "records librdkafka counted in the hour's offset range."
    ),
    "checksum": (
        "Per window hour, the sum of the rows' and quarantined records' hashes of Kafka bytes "
        "equals the sum librdkafka computed from the same offsets."
    ),
    "schema_contract": "Every row satisfies the topic's pandera contract (types, ranges, values).",
    "uniqueness": "No (partition, offset) appears twice among the window's rows and quarantine.",
    "quarantine_ratio": "Quarantined / read stays at or below the topic's quarantine_max_ratio.",
}


_ARROW_BATCH = "spark.sql.execution.arrow.maxRecordsPerBatch"
CONTRACT_BATCH_ROWS = 100_000  # rows per pandera call in the contract check
_ARROW_TO_PANDAS = "spark.sql.execution.arrow.pyspark.enabled"
# At most this many rows are validated in the driver process (see schema_contract).
CONTRACT_DRIVER_ROWS = 50_000


@dataclass
class CheckOutcome:
    name: str
    passed: bool
    summary: str
    metadata: dict[str, Any] = field(default_factory=dict)


def run_checks(spark: SparkSession, spec: TopicSpec, outcome: ReplayOutcome) -> list[CheckOutcome]:
    """All blocking checks on the run's branch; none of them writes anything.

    The branch and the quarantine rows are read back from the table (only the columns each
    figure needs): one aggregation gives every per-hour figure of the checks and the run's own
    figures, which are set on ``outcome`` (what the metadata reports is what was written); one
    grouping by event id counts repeated ids; pandera validates the rows.
    """
    from pyspark.sql import functions as F

    branch = spark.table(outcome.branch.ident).where(window_filter(outcome.contract))
    # The quarantine table is written on main (it is evidence, kept when a run fails), one
    # atomic overwrite of the run's hours. An overlapping run may have overwritten some of
    # those hours since: with the same windows its rows are the same records, so they are
    # counted whichever run wrote them (filtering on this run's id made an overlapping run
    # fail its count check instead of being refused at publish).
    quarantine = spark.table(outcome.quarantine_table).where(window_filter(outcome.contract))
    table_side = _table_figures(branch, quarantine, spec)
    _set_figures(outcome, table_side)
    # An id's copies differ when their content hashes do: min != max says so without the
    # second shuffle a count of distinct hashes costs (0.77 s instead of 1.40 s, 475k rows).
    content = F.xxhash64(*[F.col(c.name) for c in spec.columns])
    ids = (
        branch.where(~F.col("is_tombstone"))
        .select(F.col(spec.event_id_field), content.alias("content"))
        .groupBy(spec.event_id_field)
        .agg(
            F.count("*").alias("n"),
            F.min("content").alias("low"),
            F.max("content").alias("high"),
        )
        .where(F.col("n") > 1)
        .agg(
            F.coalesce(F.sum(F.col("n") - 1), F.lit(0)).alias("resent"),
            F.coalesce(F.count_if(F.col("low") != F.col("high")), F.lit(0)).alias("conflicting"),
        )
        .first()
    )
    assert ids is not None
    outcome.resent, outcome.conflicting_ids = int(ids["resent"]), int(ids["conflicting"])
    return [
        _count_reconciliation(table_side, outcome),
        _checksum(table_side, outcome),
        _schema_contract(branch, spec, outcome.rows_written),
        _uniqueness(table_side),
        _quarantine_ratio(spec, outcome),
    ]


def _table_figures(branch: DataFrame, quarantine: DataFrame, spec: TopicSpec) -> dict[str, Any]:
    """Per hour: rows, quarantined, hash sums of Kafka bytes and of parsed content, rows per
    event-time hour, quarantined per reason; and repeated offsets. One action: rows and
    quarantine are grouped by (partition, offset), then by (hour, reason, event hour),
    counting the offsets seen more than once on the way (copies of an offset in different
    hours count under the earliest: uniqueness fails then, and so does the count of some
    hour). Hours are collected as epoch millis (see :func:`replay.hour_key`)."""
    from pyspark.sql import functions as F

    content_cols = ["kafka_partition", "kafka_offset", "is_tombstone"]
    content_cols += [c.name for c in spec.columns]
    event_hour = F.when(
        ~F.col("is_tombstone"), F.unix_millis(F.date_trunc("hour", F.col(spec.event_time_field)))
    )
    content = F.xxhash64(*[F.col(c) for c in content_cols])
    both = branch.select(
        F.unix_millis("kafka_hour").alias("h"),
        "kafka_partition",
        "kafka_offset",
        *_halves(F.col("record_hash"), "hash"),
        F.lit(1).alias("is_row"),
        *_halves(content, "content"),
        F.lit(None).cast("string").alias("reason"),
        event_hour.alias("e"),
    ).unionByName(
        quarantine.select(
            F.unix_millis("kafka_hour").alias("h"),
            "kafka_partition",
            "kafka_offset",
            *_halves(F.col("record_hash"), "hash"),
            F.lit(0).alias("is_row"),
            *_halves(F.lit(None).cast("bigint"), "content"),
            F.col("reason"),
            F.lit(None).cast("bigint").alias("e"),
        )
    )
    sums = [f"{name}_{half}" for name in ("hash", "content") for half in ("high", "low")]
    per_offset = both.groupBy("kafka_partition", "kafka_offset").agg(
        F.min("h").alias("h"),
        F.count("*").alias("n"),
        F.sum("is_row").alias("rows"),
        *[F.sum(c).alias(c) for c in sums],
        F.min("reason").alias("reason"),
        F.min("e").alias("e"),
    )
    groups = per_offset.groupBy("h", "reason", "e").agg(
        F.sum("rows").alias("rows"),
        F.sum(F.col("n") - F.col("rows")).alias("quarantined"),
        *[F.sum(c).alias(c) for c in sums],
        F.sum(F.col("n") - 1).alias("repeated"),
    )
    per_hour: dict[str, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    event_hours: dict[str, dict[str, int]] = {}
    repeated = content_sum = 0
    for r in groups.collect():
        hour = hour_key(r["h"])
        figures = per_hour.setdefault(hour, {"rows": 0, "quarantined": 0, "hash_sum": 0})
        figures["rows"] += int(r["rows"])
        figures["quarantined"] += int(r["quarantined"])
        figures["hash_sum"] += _whole(r, "hash")
        content_sum += _whole(r, "content")
        repeated += int(r["repeated"])
        if r["reason"] is not None:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + int(r["quarantined"])
        if r["e"] is not None:
            late = event_hours.setdefault(hour, {})
            late[hour_key(r["e"])] = late.get(hour_key(r["e"]), 0) + int(r["rows"])
    return {
        "per_hour": per_hour,
        "repeated_offsets": repeated,
        "reasons": reasons,
        "event_hours": event_hours,
        "content_checksum": str(content_sum),
    }


def _halves(hash64: Column, name: str) -> list[Column]:
    """A signed 64-bit hash as its high (signed) and low (unsigned) 32 bits, so sums of
    billions of them stay exact in bigint (a decimal(38,0) sum cost twice the aggregation's
    time: 1.34 s against 0.72 s on 475k rows); :func:`_whole` puts a sum back together."""
    from pyspark.sql import functions as F

    return [
        F.shiftright(hash64, 32).alias(f"{name}_high"),
        hash64.bitwiseAND(F.lit(0xFFFFFFFF)).alias(f"{name}_low"),
    ]


def _whole(row: Any, name: str) -> int:
    """The exact sum of the hashes whose halves ``row`` sums (NULL sums count 0)."""
    return (int(row[f"{name}_high"] or 0) << 32) + int(row[f"{name}_low"] or 0)


def _set_figures(outcome: ReplayOutcome, table_side: dict[str, Any]) -> None:
    """The run's figures, as measured on its branch and quarantine rows."""
    assert outcome.contract.windows is not None
    mine = table_side["per_hour"]
    outcome.per_hour = {
        hour: {
            "read": k["records"],
            "written": mine.get(hour, {}).get("rows", 0),
            "quarantined": mine.get(hour, {}).get("quarantined", 0),
        }
        for hour, k in outcome.contract.windows.hour_figures().items()
    }
    outcome.rows_written = sum(f["rows"] for f in mine.values())
    outcome.quarantined = sum(f["quarantined"] for f in mine.values())
    outcome.quarantine_reasons = table_side["reasons"]
    outcome.event_hours = table_side["event_hours"]
    outcome.checksum = table_side["content_checksum"]


def _count_reconciliation(table_side: dict[str, Any], outcome: ReplayOutcome) -> CheckOutcome:
    assert outcome.contract.windows is not None
    kafka = outcome.contract.windows.hour_figures()
    mine = table_side["per_hour"]
    hours = sorted(set(kafka) | set(mine))
    per_hour = {}
    bad = []
    for hour in hours:
        k = kafka.get(hour, {}).get("records", 0)
        t = mine.get(hour, {"rows": 0, "quarantined": 0})
        per_hour[hour] = {
            "kafka_committed": k,
            "rows": t["rows"],
            "quarantined": t["quarantined"],
        }
        if t["rows"] + t["quarantined"] != k:
            bad.append(hour)
    rows = sum(v["rows"] for v in per_hour.values())
    quarantined = sum(v["quarantined"] for v in per_hour.values())
    committed = sum(v["kafka_committed"] for v in per_hour.values())
    summary = (
        f"rows {rows} + quarantined {quarantined} = {rows + quarantined} vs committed records in "
        f"the windows {committed} (librdkafka, read_committed)"
    )
    if bad:
        summary += "; hours that differ: " + ", ".join(
            f"{h} ({per_hour[h]['rows']}+{per_hour[h]['quarantined']} vs "
            f"{per_hour[h]['kafka_committed']})"
            for h in bad[:10]
        )
    return CheckOutcome(
        "count_reconciliation",
        not bad,
        summary,
        {
            "rows_on_branch": rows,
            "quarantined": quarantined,
            "kafka_committed_records": committed,
            "offsets_in_windows": outcome.contract.windows.offsets,
            "hours_that_differ": bad,
            "per_hour": per_hour,
        },
    )


def _checksum(table_side: dict[str, Any], outcome: ReplayOutcome) -> CheckOutcome:
    assert outcome.contract.windows is not None
    kafka = outcome.contract.windows.hour_figures()
    mine = table_side["per_hour"]
    bad = [
        h
        for h in sorted(set(kafka) | set(mine))
        if kafka.get(h, {}).get("hash_sum", 0) != mine.get(h, {}).get("hash_sum", 0)
    ]
    k_total = sum(v["hash_sum"] for v in kafka.values())
    t_total = sum(v["hash_sum"] for v in mine.values())
    return CheckOutcome(
        "checksum",
        not bad,
        f"hash of Kafka bytes: table {t_total} vs Kafka {k_total}"
        + (f"; hours that differ: {', '.join(bad[:10])}" if bad else ""),
        {
            "table_bytes_hash": str(t_total),
            "kafka_bytes_hash": str(k_total),
            "hours_that_differ": bad,
            "content_checksum": outcome.checksum,
        },
    )


def _uniqueness(table_side: dict[str, Any]) -> CheckOutcome:
    repeated = table_side["repeated_offsets"]
    return CheckOutcome(
        "uniqueness",
        repeated == 0,
        f"{repeated} repeated (partition, offset) among rows and quarantine",
        {"repeated_offsets": repeated},
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


def _schema_contract(branch: DataFrame, spec: TopicSpec, rows: int) -> CheckOutcome:
    """The topic's contract over the window's events (tombstones carry no payload)."""
    from pyspark.sql import functions as F

    events = branch.where(~F.col("is_tombstone")).select(*[c.name for c in spec.columns])
    return schema_contract(events, spec.columns, at_most=rows)


def schema_contract(
    events: DataFrame, columns: tuple[ColumnSpec, ...], *, at_most: int | None = None
) -> CheckOutcome:
    """pandera's contract for ``columns`` (generated from the spec) over ``events`` (which
    holds exactly those columns).

    ``at_most`` is an upper bound of the rows, when the caller knows one. Up to
    :data:`CONTRACT_DRIVER_ROWS` rows are validated here, in the driver process (Arrow to
    pandas, so the driver holds at most that many rows): a small window then does not start
    Spark's Python workers, whose start and pandas/pandera imports cost a fresh run process
    about 2 s. More rows (or an unknown count) are validated chunk by chunk inside Spark
    executors. Both ways report the same violations."""
    failed = None
    if at_most is not None and at_most <= CONTRACT_DRIVER_ROWS:
        failed = _violations_here(events, columns)
    if failed is None:
        failed = _violations_in_executors(events, columns)
    return CheckOutcome(
        "schema_contract",
        not failed,
        "all rows satisfy the contract" if not failed else f"contract violations: {failed}",
        {"violations": failed, "columns": [c.name for c in columns]},
    )


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
    conf = events.sparkSession.conf
    before = conf.get(_ARROW_TO_PANDAS, None)
    conf.set(_ARROW_TO_PANDAS, "true")  # the conversion mapInPandas uses, for this call only
    try:
        frame = events.limit(CONTRACT_DRIVER_ROWS + 1).toPandas()
    finally:
        if before is None:
            conf.unset(_ARROW_TO_PANDAS)
        else:
            conf.set(_ARROW_TO_PANDAS, before)
    if len(frame) > CONTRACT_DRIVER_ROWS:
        return None
    return {
        f"{col}: {check}": n for col, check, n in _failures(contract_schema(columns), frame) if n
    }


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
        dtype = None if c.type in ("timestamp", "string") or nullable_int else dtypes[c.type]
        cols[c.name] = pa.Column(dtype, checks=checks, nullable=c.nullable, coerce=False)
    return pa.DataFrameSchema(cols, strict=True)


def _all_strings(values: pd.Series) -> bool:
    """Every non-null value is a ``str`` (pandas' own inference, in C)."""
    import pandas as pd

    return pd.api.types.infer_dtype(values, skipna=True) in ("string", "empty")
