"""Blocking audits of a run's branch, before anything is published.

Every check reads the branch (never main) restricted to the replayed window's hours, plus the
quarantine rows this run wrote for them, and compares with a second, independent reading of
Kafka: the librdkafka pass that fixed the windows (:mod:`backfill_assets.lake.offsets.windows`)
counted the
committed records of every hour and summed a hash of their partition, offset, key and value
bytes. A dropped row, an extra (aborted) record, a shifted window or a repeated offset changes
those figures for some hour, so the checks can fail. In a single-run partition range Dagster
evaluates a partitioned check once (partition=None), so per-hour detail lives in metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.decode.content import Sample, miss_bound, sample_condition
from backfill_assets.lake.offsets.contract import window_filter
from backfill_assets.lake.offsets.windows import hour_key
from backfill_assets.lake.write import record_diff
from backfill_assets.lake.write.replay import ReplayOutcome
from backfill_assets.lake.write.schema_contract import (
    contract_failures,
    contract_schema,
    contract_violations,
    frame_violations,
    violations,
)
from backfill_assets.spec.model import SPARK_TYPES, ColumnSpec, TopicSpec
from backfill_assets.stack import fetch

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

CHECK_NAMES = (
    "count_reconciliation",
    "checksum",
    "schema_contract",
    "uniqueness",
    "quarantine_ratio",
    "decoded_content",
    "records_kept",
)
# The run tag (and CLI flag --accept-fewer-records) with which an operator accepts that a
# re-run publishes fewer records than the ledger counted for an hour.
ACCEPT_FEWER_RECORDS_TAG = "backfill_assets/accept_fewer_records"
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
    "quarantine_ratio": (
        "In every window hour, quarantined / read stays at or below the topic's "
        "quarantine_max_ratio."
    ),
    "decoded_content": (
        "Per window hour, the typed values of the rows on the run's branch equal an independent "
        "Python decode of the Kafka records (the spec's reference decoders, not Spark's parse "
        "or the upcasters): same rows, same sum of content hashes. Every record of a window of "
        "at most BACKFILL_CONTENT_SAMPLE_ABOVE records; of a larger one, 1 in "
        "BACKFILL_CONTENT_SAMPLE picked by a hash of (partition, offset), on both sides."
    ),
    "records_kept": (
        "Per window hour the ledger already has a publish for, Kafka (or the archive) still "
        "holds as many committed records in the published offset window as the ledger counted "
        "then: a re-run of an hour whose records compaction or truncation removed is refused, "
        "unless the run is tagged backfill_assets/accept_fewer_records=true."
    ),
}


# At most this many rows and quarantined records are aggregated in the driver process (see
# table_figures): a window's worth of narrow rows (hashes, offsets, hours).
FIGURES_DRIVER_ROWS = 50_000


@dataclass
class CheckOutcome:
    name: str
    passed: bool
    summary: str
    metadata: dict[str, Any] = field(default_factory=dict)


def run_checks(spark: SparkSession, spec: TopicSpec, outcome: ReplayOutcome) -> list[CheckOutcome]:
    """All blocking checks on the run's branch; none of them writes anything.

    The branch and the quarantine rows are read back from the table (only the columns each
    figure needs) and aggregated into every per-hour figure of the checks, the run's own
    figures (set on ``outcome``: what the metadata reports is what was written) and the
    repeated event ids; the rows are checked against the topic's pandera contract (see
    :func:`schema_contract`; a large window's contract is counted in the figures' own
    aggregation when no offset repeats). A window of at most
    :data:`FIGURES_DRIVER_ROWS` rows is aggregated in this process from one read (no shuffle
    to plan, compile and run, which a fresh run process pays seconds for); a larger one by
    Spark. Both ways give the same figures.
    """
    branch = spark.table(outcome.branch.ident).where(window_filter(outcome.contract))
    # The run's quarantine rows are on its branch of the quarantine table (published with the
    # rows; kept as evidence when the run fails): what is checked is what would be published.
    quarantine = spark.table(outcome.quarantine_source).where(window_filter(outcome.contract))
    windows = outcome.contract.windows
    table_side = table_figures(
        branch,
        quarantine,
        spec,
        at_most=outcome.records_read,
        contract=True,
        content_sample=windows.content_sample if windows is not None else Sample(),
    )
    _set_figures(outcome, table_side)
    outcome.resent, outcome.conflicting_ids = table_side["resent"], table_side["conflicting"]
    counted = table_side.pop("contract", None)
    return [
        _count_reconciliation(table_side, outcome),
        _checksum(table_side, outcome),
        _schema_contract(branch, spec, outcome.rows_written)
        if counted is None
        else contract_outcome(counted, spec.contract_columns),
        _uniqueness(table_side),
        _quarantine_ratio(spec, outcome),
        _named(spark, spec, outcome, _decoded_content(table_side, outcome)),
        records_kept(spark, outcome),
    ]


def _named(
    spark: SparkSession, spec: TopicSpec, outcome: ReplayOutcome, check: CheckOutcome
) -> CheckOutcome:
    """A failed ``decoded_content`` with the records that differ, by partition and offset,
    and the command that accepts one (:mod:`~backfill_assets.lake.write.record_diff`)."""
    hours = check.metadata.get("hours_that_differ")
    if check.passed or not hours:
        return check
    found = record_diff.differing_records(spark, spec, outcome, hours)
    check.metadata["differing_records"] = found
    if found:
        first = found[0]
        named = ", ".join(f"{f['partition']}:{f['offset']} ({f['why']})" for f in found[:3])
        check.summary += (
            f". Records that differ: {named}. Fix the transform or decoder and re-run; if the "
            f"run's row is right, `backfill-assets accept --topic {spec.topic} --partition "
            f'{first["partition"]} --offset {first["offset"]} --reason "..."` leaves that '
            "record out of the comparison"
        )
    return check


def table_figures(
    branch: DataFrame,
    quarantine: DataFrame,
    spec: TopicSpec,
    *,
    at_most: int | None = None,
    contract: bool = False,
    content_sample: Sample | None = None,
) -> dict[str, Any]:
    """Per hour: rows, quarantined, hash sums of Kafka bytes and of parsed content
    (``content_per_hour`` and its rows ``content_rows_per_hour``: over the rows
    ``content_sample`` compares, see :class:`backfill_assets.lake.decode.content.Sample`; every
    row without one: what the window's decode covered), rows per
    event-time hour, quarantined per reason; repeated offsets; repeated and conflicting event
    ids. Rows and quarantine are grouped by (partition, offset), then by (hour, reason, event
    hour), counting the offsets seen more than once on the way (copies of an offset in
    different hours count under the earliest: uniqueness fails then, and so does the count of
    some hour). Hours are epoch millis (see :func:`backfill_assets.lake.offsets.windows.hour_key`).

    ``at_most`` bounds the rows when the caller knows one: up to :data:`FIGURES_DRIVER_ROWS`
    rows are read once into this process and aggregated here; more (also when the bound was
    understated) are aggregated by Spark, in two actions (:func:`_figures_in_spark`).

    With ``contract``, the Spark way also counts the violations of the topic's contract by the
    window's events (:func:`contract_violations`) in its figures' aggregation, when no offset
    repeats and every check has a translation: ``figures["contract"]`` is then pandera's
    report (what :func:`schema_contract` would say, without reading the branch again);
    otherwise the key is absent and the contract must be checked on its own."""
    if at_most is not None and at_most <= FIGURES_DRIVER_ROWS:
        carried = spec.columns if contract else ()
        both = _figure_inputs(branch, quarantine, spec, None, content_sample, carried)
        here = _figures_here(both, spec.contract_columns if contract else None)
        if here is not None:
            return here
    counters = None
    if contract:
        events = branch.select(*[c.name for c in spec.columns])
        counters = contract_violations(contract_schema(spec.contract_columns), events)
    return _figures_in_spark(
        _figure_inputs(branch, quarantine, spec, counters, content_sample), counters
    )


def _figure_inputs(
    branch: DataFrame,
    quarantine: DataFrame,
    spec: TopicSpec,
    counters: dict[str, Column] | None = None,
    content_sample: Sample | None = None,
    carried: tuple[ColumnSpec, ...] = (),
) -> DataFrame:
    """One row per branch row and per quarantined record: hour (h), partition, offset, Kafka
    bytes hash, is_row, content hash, reason, event hour (e), and for events (not tombstones)
    their event id and a hash of their payload columns (id_content); with ``counters`` (the
    contract's, see :func:`contract_violations`) also ``_c0``, ``_c1``...: each counter for
    events, 0 for tombstones and quarantined records; with a ``content_sample`` that is not
    whole also ``s_row`` (1 for a row it compares, else 0) and ``s_content`` (its content
    hash, else NULL); each column of ``carried`` as ``_e_<name>``: an event's value, NULL for
    tombstones and quarantined records (what the contract is checked on)."""
    from pyspark.sql import functions as F

    event = ~F.col("is_tombstone")
    event_hour = F.when(event, F.unix_millis(F.date_trunc("hour", F.col(spec.event_time_field))))
    (id_type,) = [c.type for c in spec.columns if c.name == spec.event_id_field]
    payload = F.xxhash64(*[F.col(c.name) for c in spec.columns])
    content = record_diff.content_hash(spec)
    sampled: list[Column] = []
    unsampled: list[Column] = []
    chosen = sample_condition(content_sample or Sample())
    if chosen is not None:
        sampled = [
            F.when(chosen, 1).otherwise(0).alias("s_row"),
            F.when(chosen, content).alias("s_content"),
        ]
        unsampled = [F.lit(0).alias("s_row"), F.lit(None).cast("bigint").alias("s_content")]
    return branch.select(
        F.unix_millis("kafka_hour").alias("h"),
        "kafka_partition",
        "kafka_offset",
        F.col("record_hash").alias("hash"),
        F.lit(1).alias("is_row"),
        content.alias("content"),
        F.lit(None).cast("string").alias("reason"),
        event_hour.alias("e"),
        F.when(event, F.col(spec.event_id_field)).alias("id"),
        F.when(event, payload).alias("id_content"),
        *[
            F.when(event, counter).otherwise(0).alias(f"_c{i}")
            for i, counter in enumerate((counters or {}).values())
        ],
        *sampled,
        *[F.when(event, F.col(c.name)).alias(f"_e_{c.name}") for c in carried],
    ).unionByName(
        quarantine.select(
            F.unix_millis("kafka_hour").alias("h"),
            "kafka_partition",
            "kafka_offset",
            F.col("record_hash").alias("hash"),
            F.lit(0).alias("is_row"),
            F.lit(None).cast("bigint").alias("content"),
            F.col("reason"),
            F.lit(None).cast("bigint").alias("e"),
            F.lit(None).cast(id_type).alias("id"),
            F.lit(None).cast("bigint").alias("id_content"),
            *[F.lit(0).alias(f"_c{i}") for i in range(len(counters or {}))],
            *unsampled,
            *[F.lit(None).cast(SPARK_TYPES[c.type]).alias(f"_e_{c.name}") for c in carried],
        )
    )


# (h, reason, e, rows, quarantined, hash sum, content sum, repeated offsets, rows in the
# content sample, their content sum)
_Group = tuple[int, str | None, int | None, int, int, int, int, int, int, int]


def _figures_here(
    both: DataFrame, contract: tuple[ColumnSpec, ...] | None = None
) -> dict[str, Any] | None:
    """:func:`table_figures` from one read of ``both`` into this process (Arrow); None if it
    holds more than :data:`FIGURES_DRIVER_ROWS` rows after all. Python's integers keep every
    sum exact. The grouping follows Spark's: MIN skips NULLs, a NULL key is a key. With
    ``contract`` (``both`` carries the events' columns), ``figures["contract"]`` is pandera's
    report on the events of the same read."""
    table, schema = fetch.arrow_and_schema(both.limit(FIGURES_DRIVER_ROWS + 1))
    if table.num_rows > FIGURES_DRIVER_ROWS:
        return None
    carried = [name for name in table.column_names if name.startswith(_CARRIED)]
    failed = None if contract is None else _contract_here(table, schema, carried, contract)
    cols = table.drop_columns(carried).to_pydict()
    # Without a content sample every row is in it.
    s_rows, s_contents = cols.get("s_row", cols["is_row"]), cols.get("s_content", cols["content"])
    offsets: dict[tuple[int, int], list[Any]] = {}
    for h, p, o, hashed, is_row, content, reason, e, s_row, s_content in zip(
        cols["h"],
        cols["kafka_partition"],
        cols["kafka_offset"],
        cols["hash"],
        cols["is_row"],
        cols["content"],
        cols["reason"],
        cols["e"],
        s_rows,
        s_contents,
        strict=True,
    ):
        seen = offsets.get((p, o))
        if seen is None:
            offsets[(p, o)] = [h, 1, is_row, hashed, content or 0, reason, e, s_row, s_content or 0]
            continue
        seen[0] = _least(seen[0], h)
        seen[1] += 1
        seen[2] += is_row
        seen[3] += hashed
        seen[4] += content or 0
        seen[5] = _least(seen[5], reason)
        seen[6] = _least(seen[6], e)
        seen[7] += s_row
        seen[8] += s_content or 0
    groups: dict[tuple[Any, ...], list[int]] = {}
    for h, n, rows, hashed, content, reason, e, s_row, s_content in offsets.values():
        group = groups.setdefault((h, reason, e), [0, 0, 0, 0, 0, 0, 0])
        group[0] += rows
        group[1] += n - rows
        group[2] += hashed
        group[3] += content
        group[4] += n - 1
        group[5] += s_row
        group[6] += s_content
    ids: dict[Any, list[int]] = {}
    for ident, content in zip(cols["id"], cols["id_content"], strict=True):
        if content is None:  # a tombstone or a quarantined record
            continue
        seen = ids.get(ident)
        if seen is None:
            ids[ident] = [1, content, content]
        else:
            seen[0] += 1
            seen[1] = min(seen[1], content)
            seen[2] = max(seen[2], content)
    figures = _summarise((*key, *g) for key, g in groups.items())
    figures["resent"] = sum(n - 1 for n, _, _ in ids.values())
    figures["conflicting"] = sum(1 for n, low, high in ids.values() if n > 1 and low != high)
    if failed is not None:
        figures["contract"] = failed
    return figures


# The prefix of the events' columns _figure_inputs carries for the contract.
_CARRIED = "_e_"


def _contract_here(
    table: pa.Table, schema: StructType, carried: list[str], columns: tuple[ColumnSpec, ...]
) -> dict[str, int]:
    """pandera's report on the events among ``table``'s rows (rows kept, not tombstones: their
    ``id_content`` is set), from their ``carried`` columns, as :func:`schema_contract` would
    give it reading them on their own."""
    import pyarrow.compute as pc
    from pyspark.sql.types import StructField, StructType

    events = pc.and_(pc.equal(table["is_row"], 1), pc.is_valid(table["id_content"]))
    names = [name.removeprefix(_CARRIED) for name in carried]
    fields = [StructField(name, schema[f"{_CARRIED}{name}"].dataType, True) for name in names]
    rows = table.filter(events).select(carried).rename_columns(names)
    return frame_violations(fetch.pandas_of(rows, StructType(fields)), columns)


def _least(a: Any, b: Any) -> Any:
    """SQL's MIN of two values: NULL only if both are."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _figures_in_spark(both: DataFrame, counters: dict[str, Column] | None = None) -> dict[str, Any]:
    """:func:`table_figures` aggregated by Spark, so the driver receives one row per (hour,
    reason, event hour), not per row. Two actions: the repeats (offsets seen more than once,
    event ids seen more than once and those whose copies differ), then the figures.

    When no offset repeats, grouping by offset first changes nothing, so the figures are one
    aggregation by (hour, reason, event hour), which Spark combines before its shuffle. Only
    when an offset repeats are they grouped by offset first (the rule in
    :func:`table_figures`), which shuffles every row. ``counters`` (columns ``_c0``... of
    ``both``) are summed in the first case only: ``figures["contract"]``."""
    from pyspark.sql import functions as F

    repeats = _repeats(both)
    counted = counters is not None and repeats["offsets"] == 0
    names = list(counters or {}) if counted else []
    # Without a content sample every row is in it: its figures are the rows' own.
    sampled = "s_content" in both.columns
    hashes = ["hash", "content", "s_content"] if sampled else ["hash", "content"]
    both = both.select("*", *[half for name in hashes for half in _halves(F.col(name), name)])
    sums = [f"{name}_{half}" for name in hashes for half in ("high", "low")]
    s_row = [F.sum("s_row").alias("s_row")] if sampled else []
    if repeats["offsets"] == 0:
        groups = both.groupBy("h", "reason", "e").agg(
            F.sum("is_row").alias("rows"),
            *s_row,
            F.sum(1 - F.col("is_row")).alias("quarantined"),
            *[F.sum(c).alias(c) for c in sums],
            F.lit(0).alias("repeated"),
            *[F.sum(f"_c{i}").alias(f"_c{i}") for i in range(len(names))],
        )
    else:
        per_offset = both.groupBy("kafka_partition", "kafka_offset").agg(
            F.min("h").alias("h"),
            F.count("*").alias("n"),
            F.sum("is_row").alias("rows"),
            *s_row,
            *[F.sum(c).alias(c) for c in sums],
            F.min("reason").alias("reason"),
            F.min("e").alias("e"),
        )
        groups = per_offset.groupBy("h", "reason", "e").agg(
            F.sum("rows").alias("rows"),
            *[F.sum("s_row").alias("s_row")] if sampled else [],
            F.sum(F.col("n") - F.col("rows")).alias("quarantined"),
            *[F.sum(c).alias(c) for c in sums],
            F.sum(F.col("n") - 1).alias("repeated"),
        )
    collected = fetch.rows(groups)
    figures = _summarise(
        (
            r["h"],
            r["reason"],
            r["e"],
            int(r["rows"]),
            int(r["quarantined"]),
            _whole(r, "hash"),
            _whole(r, "content"),
            int(r["repeated"]),
            int(r["s_row"]) if sampled else int(r["rows"]),
            _whole(r, "s_content" if sampled else "content"),
        )
        for r in collected
    )
    figures["resent"], figures["conflicting"] = repeats["resent"], repeats["conflicting"]
    if counted:
        figures["contract"] = contract_failures(
            {name: sum(int(r[f"_c{i}"] or 0) for r in collected) for i, name in enumerate(names)}
        )
    return figures


def _repeats(both: DataFrame) -> dict[str, int]:
    """In one aggregation (one read, one shuffle of narrow keys): copies beyond the first of
    every (partition, offset) (``offsets``) and of every event id (``resent``), and the ids
    whose copies differ (``conflicting``: their content hashes' min != max, without the second
    shuffle a count of distinct hashes costs)."""
    from pyspark.sql import functions as F

    id_type = both.schema["id"].dataType.simpleString()
    keys = F.array(
        F.struct(
            F.lit(0).alias("kind"),
            F.col("kafka_partition").alias("p"),
            F.col("kafka_offset").alias("o"),
            F.lit(None).cast(id_type).alias("id"),
            F.lit(None).cast("bigint").alias("c"),
        ),
        F.when(
            F.col("id_content").isNotNull(),
            F.struct(
                F.lit(1).alias("kind"),
                F.lit(None).cast("int").alias("p"),
                F.lit(None).cast("bigint").alias("o"),
                F.col("id").alias("id"),
                F.col("id_content").alias("c"),
            ),
        ),
    )
    row = (
        both.select(F.explode(keys).alias("k"))
        .where(F.col("k").isNotNull())
        .select("k.*")
        .groupBy("kind", "p", "o", "id")
        .agg(F.count("*").alias("n"), F.min("c").alias("low"), F.max("c").alias("high"))
        .where(F.col("n") > 1)
        .agg(
            F.coalesce(F.sum(F.when(F.col("kind") == 0, F.col("n") - 1)), F.lit(0)).alias("o"),
            F.coalesce(F.sum(F.when(F.col("kind") == 1, F.col("n") - 1)), F.lit(0)).alias("r"),
            F.count_if((F.col("kind") == 1) & (F.col("low") != F.col("high"))).alias("c"),
        )
        .first()
    )
    assert row is not None
    return {"offsets": int(row["o"]), "resent": int(row["r"]), "conflicting": int(row["c"])}


def _summarise(groups: Iterable[_Group]) -> dict[str, Any]:
    """The figures of :func:`table_figures` from its (hour, reason, event hour) groups."""
    per_hour: dict[str, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    event_hours: dict[str, dict[str, int]] = {}
    # The content sample's rows and content hash sums (decoded_content)
    content_per_hour: dict[str, int] = {}
    content_rows_per_hour: dict[str, int] = {}
    repeated = content_sum = 0
    for h, reason, e, rows, quarantined, hash_sum, content, repeats, s_rows, s_sum in groups:
        hour = hour_key(h)
        figures = per_hour.setdefault(hour, {"rows": 0, "quarantined": 0, "hash_sum": 0})
        figures["rows"] += rows
        figures["quarantined"] += quarantined
        figures["hash_sum"] += hash_sum
        content_per_hour[hour] = content_per_hour.get(hour, 0) + s_sum
        content_rows_per_hour[hour] = content_rows_per_hour.get(hour, 0) + s_rows
        content_sum += content
        repeated += repeats
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + quarantined
        if e is not None:
            late = event_hours.setdefault(hour, {})
            late[hour_key(e)] = late.get(hour_key(e), 0) + rows
    return {
        "per_hour": per_hour,
        "repeated_offsets": repeated,
        "reasons": reasons,
        "event_hours": event_hours,
        "content_checksum": str(content_sum),
        "content_per_hour": content_per_hour,
        "content_rows_per_hour": content_rows_per_hour,
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
    """Judged per Kafka hour, so one bad hour cannot hide inside a long window: every hour's
    quarantined / read (librdkafka's count) must stay at or below the limit. The whole run's
    ratio is reported too."""
    limit = spec.quarantine_max_ratio
    ratio = outcome.quarantined / outcome.records_read if outcome.records_read else 0.0
    per_hour = {
        h: c["quarantined"] / c["read"] for h, c in sorted(outcome.per_hour.items()) if c["read"]
    }
    over = [h for h, r in per_hour.items() if r > limit]
    summary = (
        f"quarantined {outcome.quarantined}/{outcome.records_read} = {ratio:.4f} over the run "
        f"(limit {limit}, per hour)"
    )
    worst = max(per_hour, key=lambda h: (per_hour[h], h), default=None)
    if worst is not None:
        c = outcome.per_hour[worst]
        summary += f"; worst hour {worst}: {c['quarantined']}/{c['read']} = {per_hour[worst]:.4f}"
    if over:
        summary += f"; {len(over)} hour(s) above the limit: " + ", ".join(over[:10])
    return CheckOutcome(
        "quarantine_ratio",
        not over,
        summary,
        {
            "ratio": round(ratio, 6),
            "limit": limit,
            "worst_hour": worst,
            "worst_hour_ratio": round(per_hour[worst], 6) if worst is not None else 0.0,
            "hours_over_limit": over,
            "reasons": outcome.quarantine_reasons,
            "ratio_per_hour": {h: round(r, 4) for h, r in per_hour.items()},
        },
    )


def _decoded_content(table_side: dict[str, Any], outcome: ReplayOutcome) -> CheckOutcome:
    """Per hour, the branch's rows against the independent decode of the same Kafka records
    (:mod:`backfill_assets.lake.decode.content`): the rows it expects and the sum of their content
    hashes (Spark's ``xxhash64`` of partition, offset, tombstone flag and every typed column,
    the same expression the figures sum over the branch). An hour of at most
    ``BACKFILL_CONTENT_SAMPLE_ABOVE`` records is decoded whole, whatever the run's length: one
    altered value changes its hour's sum (a miss needs a 64-bit hash collision). A larger hour
    compares the run's 1-in-K sample (``Windows.content_sample``; the table side sums the same
    rows): a fault touching m of its records escapes with probability (1 - 1/K)^m, stated in
    the metadata. Hours holding records of a schema version without a reference decode cannot
    be compared; they are listed, and pass. Records an operator accepted are left out."""
    windows = outcome.contract.windows
    assert windows is not None
    windows.wait_decode()
    if not windows.decoded:
        return CheckOutcome(
            "decoded_content",
            False,
            "no independent decode was made for this window (contract.window_contract makes it)",
            {},
        )
    bad, unverified, per_hour = _content_hours(windows.hour_figures(), table_side)
    decoded = sum(v["decoded_rows"] for v in per_hour.values())
    rows = sum(v["rows"] for v in per_hour.values())
    sample = windows.content_sample
    sampled_hours = sorted(hour_key(h) for h in sample.hours)
    sampled = sample.k > 1 and bool(sample.hours)
    what = "rows on the branch"
    if sampled:
        what += (
            f" (every row of {len(per_hour) - len(sampled_hours)} hour(s); the 1-in-{sample.k}"
            f" sample of residue {sample.residue} in {len(sampled_hours)} larger hour(s))"
        )
    summary = (
        f"{rows} {what} vs {decoded} decoded independently from Kafka's bytes; "
        f"{len(bad)} hour(s) whose typed values differ"
    )
    if bad:
        summary += ": " + ", ".join(
            f"{h} ({per_hour[h]['rows']} rows vs {per_hour[h]['decoded_rows']} decoded"
            f"{'' if per_hour[h]['same_content'] else ', content differs'})"
            for h in bad[:10]
        )
    if unverified:
        summary += f"; {len(unverified)} hour(s) not compared (a version without a decoder)"
    ranges = windows.ranges
    accepted = sorted(
        f"{p}:{o}" for p, o in sample.accepted if p in ranges and ranges[p][0] <= o < ranges[p][1]
    )
    if accepted:
        summary += f"; {len(accepted)} record(s) accepted by an operator, not compared"
    return CheckOutcome(
        "decoded_content",
        not bad,
        summary,
        {
            "rows_on_branch": sum(h["rows"] for h in table_side["per_hour"].values()),
            "rows_compared": rows,
            "decoded_rows": decoded,
            "hours_that_differ": bad,
            "hours_not_compared": unverified,
            # The decode's own pass (its read and decode, in a thread while Spark wrote) and
            # how long the checks waited for it.
            "decode_seconds": round(windows.decode_s, 3),
            "decode_wait_seconds": round(windows.decode_wait_s, 3),
            "decoded_records": windows.decoded_records,
            "sampled": sampled,
            # Decided per hour: the hours compared on their sample, the others whole.
            "sampled_hours": sampled_hours,
            "sample_fraction": 1 / sample.k if sampled else 1,
            "sample_residue": sample.residue,
            # Records (partition:offset) an operator's `backfill-assets accept` left out.
            "accepted_records": accepted,
            "miss_rate": _miss_rate(sample.k if sampled else 1),
            "per_hour": per_hour,
        },
    )


def _content_hours(
    kafka: dict[str, dict[str, int]], table_side: dict[str, Any]
) -> tuple[list[str], list[str], dict[str, dict[str, Any]]]:
    """Per hour, the decode's rows and sum (``kafka``) against the table's: the hours that
    differ, the hours not compared (a version without a decoder) and every hour's figures."""
    mine = table_side["content_rows_per_hour"]
    bad, unverified, per_hour = [], [], {}
    for hour in sorted(set(kafka) | set(mine)):
        k = kafka.get(hour, {})
        figures = {
            "decoded_rows": k.get("decoded_rows", 0),
            "rows": mine.get(hour, 0),
            "same_content": k.get("decoded_sum", 0) == table_side["content_per_hour"].get(hour, 0),
        }
        per_hour[hour] = figures
        if k.get("unverified", 0):
            unverified.append(hour)
        elif figures["decoded_rows"] != figures["rows"] or not figures["same_content"]:
            bad.append(hour)
    return bad, unverified, per_hour


def records_kept(spark: SparkSession, outcome: ReplayOutcome) -> CheckOutcome:
    """Re-run hours must not silently hold fewer records than their publish did.

    For every hour of the window the ledger has a publish for (its window is then that
    publish's offsets), the committed records the scan counts in it now (Kafka, plus the
    archive below Kafka's log start) against the ``records`` the ledger counted then. Fewer
    now means the log cleaner (``cleanup.policy=compact``) or a truncation (delete-records,
    retention without an archive) removed records: publishing would drop rows main holds.
    Fails naming topic, hours, partitions (main's rows whose offsets Kafka no longer holds)
    and both counts, unless the operator accepted the loss for this run
    (``outcome.accept_fewer_records``); then it passes and says what was accepted."""
    contract = outcome.contract
    assert contract.windows is not None
    kafka = contract.windows.hour_figures()
    short: dict[str, dict[str, Any]] = {}
    uncounted = sorted(
        h.isoformat() for h, (n, _r) in contract.published_records.items() if n is None
    )
    for hour, (held, run_id) in sorted(contract.published_records.items()):
        now = kafka.get(hour.isoformat(), {}).get("records", 0)
        if held is not None and now < held:
            short[hour.isoformat()] = {
                "ledger_records": held,
                "kafka_records_now": now,
                "removed": held - now,
                "published_by_run": run_id,
            }
    checked = len(contract.published_records) - len(uncounted)
    if not short:
        return CheckOutcome(
            "records_kept",
            True,
            (
                f"{checked} hour(s) of the window were published before; Kafka still holds "
                "every record the ledger counted for them"
                if checked
                else "no hour of the window was published before (first ingest)"
                if not uncounted
                else "no hour of the window has a ledger count to compare"
            )
            + _uncounted_text(uncounted),
            {
                "republished_hours": checked,
                "hours_with_fewer_records": [],
                "hours_not_compared": uncounted,
            },
        )
    gone = _gone_from_kafka(spark, outcome, list(short))
    for key, figures in short.items():
        figures["main_rows_gone_by_partition"] = gone.get(key, {})
    return _fewer_records(outcome, short, checked)


def _uncounted_text(hours: list[str]) -> str:
    """What records_kept says of published hours whose ledger row has no record count."""
    if not hours:
        return ""
    return (
        f". NOT COMPARED: {len(hours)} published hour(s) ({', '.join(hours[:5])}"
        f"{', ...' if len(hours) > 5 else ''}) have no record count in the ledger (a row "
        "recovered from a publish written before counts were kept): this check cannot say "
        "whether Kafka still holds what main was published with for them"
    )


def _fewer_records(
    outcome: ReplayOutcome, short: dict[str, dict[str, Any]], checked: int
) -> CheckOutcome:
    """The records_kept outcome for hours with fewer records now: refused, or accepted."""
    topic, contract = outcome.contract.topic, outcome.contract
    removed = sum(f["removed"] for f in short.values())
    hours = "; ".join(
        f"hour {h}: the ledger counted {f['ledger_records']} committed records when run "
        f"{f['published_by_run']} published it, Kafka holds {f['kafka_records_now']} now"
        + _partitions_text(f["main_rows_gone_by_partition"])
        for h, f in short.items()
    )
    cause = (
        f"compaction (cleanup.policy=compact) or truncation (delete-records, retention without "
        f"an archive) removed {removed} record(s) from the published offset window(s)"
    )
    metadata: dict[str, Any] = {
        "topic": topic,
        "republished_hours": checked,
        "hours_with_fewer_records": list(short),
        "records_removed": removed,
        "per_hour": short,
        "accepted": outcome.accept_fewer_records,
    }
    if outcome.accept_fewer_records:
        metadata["accepted_loss"] = (
            f"topic {topic!r}: {hours}; {cause}; accepted by {ACCEPT_FEWER_RECORDS_TAG}=true"
        )
        return CheckOutcome(
            "records_kept",
            True,
            f"ACCEPTED LOSS of {removed} record(s) on topic {topic!r} ({hours}); {cause}. "
            f"The run carries {ACCEPT_FEWER_RECORDS_TAG}=true: published with fewer rows, "
            "recorded in the audit table and the ledger.",
            metadata,
        )
    first, end = (f"{t:%Y-%m-%dT%H:%MZ}" for t in (contract.start, contract.end))
    return CheckOutcome(
        "records_kept",
        False,
        f"topic {topic!r}: Kafka no longer holds every record main was published with ("
        f"{hours}). Likely cause: {cause}. Nothing was published: main and the ledger are "
        f"unchanged and keep those rows; the run's branch is left for inspection. Next: keep "
        f"main as it is (nothing to do; do not re-run these hours), or accept the loss "
        f"explicitly: `backfill-assets backfill --topic {topic} --start {first} --end {end} "
        f"--accept-fewer-records` (or a run tagged {ACCEPT_FEWER_RECORDS_TAG}=true); the "
        "sensors never accept it",
        metadata,
    )


def _partitions_text(gone: dict[str, int]) -> str:
    if not gone:
        return ""
    ordered = sorted(gone.items(), key=lambda item: int(item[0]))
    parts = ", ".join(f"partition {p}: {n}" for p, n in ordered)
    return f" (rows of main whose offsets Kafka no longer holds: {parts})"


def _gone_from_kafka(
    spark: SparkSession, outcome: ReplayOutcome, hours: list[str]
) -> dict[str, dict[str, int]]:
    """Per hour (of ``hours``) and partition, main's rows whose (partition, offset) is neither
    on the run's branch nor in its quarantine rows: what publishing would drop."""
    from pyspark.sql import functions as F

    keys = ["kafka_partition", "kafka_offset"]
    window = window_filter(outcome.contract)
    here = (
        spark.table(outcome.branch.ident)
        .where(window)
        .select(*keys)
        .unionByName(spark.table(outcome.quarantine_source).where(window).select(*keys))
    )
    gone = (
        spark.table(outcome.branch.table)
        .where(window)
        .select("kafka_hour", *keys)
        .join(here, keys, "left_anti")
        .groupBy(F.unix_millis("kafka_hour").alias("hour_ms"), "kafka_partition")
        .count()
    )
    out: dict[str, dict[str, int]] = {}
    for row in gone.collect():
        hour = hour_key(int(row["hour_ms"]))
        if hour in hours:
            out.setdefault(hour, {})[str(row["kafka_partition"])] = int(row["count"])
    return out


def _miss_rate(k: int) -> str:
    """What a 1-in-``k`` content sample can miss, in words."""
    if k == 1:
        return "every record decoded; a miss needs a 64-bit hash collision"
    bounds = ", ".join(f"m={m}: {miss_bound(k, m):.2g}" for m in (10, 100, 1000))
    return (
        f"1 record in {k} decoded (its (partition, offset) hash picks it, the table side sums "
        f"the same rows): a fault touching m records of the window escapes with probability "
        f"(1 - 1/{k})^m ({bounds}); a wrong upcaster or parse touching every record of a "
        f"version is caught all but certainly once the version has {16 * k} records in the "
        f"window (miss {miss_bound(k, 16 * k):.1g})"
    )


def _schema_contract(branch: DataFrame, spec: TopicSpec, rows: int) -> CheckOutcome:
    """The topic's contract over the window's events (tombstones carry no payload)."""
    from pyspark.sql import functions as F

    events = branch.where(~F.col("is_tombstone")).select(*[c.name for c in spec.columns])
    return schema_contract(events, spec.contract_columns, at_most=rows)


def schema_contract(
    events: DataFrame, columns: tuple[ColumnSpec, ...], *, at_most: int | None = None
) -> CheckOutcome:
    """The ``schema_contract`` check: pandera's contract for ``columns`` (generated from the
    spec) over ``events`` (which holds exactly those columns); ``at_most`` is an upper bound of
    the rows, when the caller knows one (see
    :func:`backfill_assets.lake.write.schema_contract.violations`)."""
    return contract_outcome(violations(events, columns, at_most=at_most), columns)


def contract_outcome(failed: dict[str, int], columns: tuple[ColumnSpec, ...]) -> CheckOutcome:
    """The ``schema_contract`` check from pandera's report (``"<column>: <check>"`` ->
    failures; empty when every row satisfies the contract)."""
    return CheckOutcome(
        "schema_contract",
        not failed,
        "all rows satisfy the contract" if not failed else f"contract violations: {failed}",
        {"violations": failed, "columns": [c.name for c in columns]},
    )
