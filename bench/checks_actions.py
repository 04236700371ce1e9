"""Paired micro-benchmark: the checks' figures aggregated by Spark in ONE action (a candidate:
the repeats and the figures as three grouping sets of one aggregation, Spark's Expand) against
the package's two actions (the repeats, then the figures), alternating in one process over the
same synthetic branch and quarantine in Parquet.

``checks.table_figures(..., contract=True)`` over ``--rows`` branch rows (24 Kafka hours, 6
partitions, 1 in 50 a tombstone, 1 in 50 an event id sent twice) and 1% quarantined records,
read from Parquet as the checks read the branch. Classic local[2] by default, or a Spark
Connect server with ``--connect URL``. Both forms must return the same figures (asserted).
Prints each form's median and the ratio one / two, with the load average (shared machines).
The candidate was rejected (bench/README, eighth pass): it is kept here to be measured again.

Run from the repository root:
    .venv/bin/python bench/checks_actions.py
    .venv/bin/python bench/checks_actions.py --rows 489000 --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from backfill_assets.lake.write import checks, schema_contract
from backfill_assets.spec.loader import load_specs


# The candidate: one action unless an offset repeats (then the per-offset grouping).
def _one_action_form(both: DataFrame, counters: dict[str, Column] | None = None) -> dict[str, Any]:
    """:func:`table_figures` aggregated by Spark, so the driver receives one row per (hour,
    reason, event hour), not per row.

    One action when no offset repeats (:func:`_one_action`): the figures by (hour, reason,
    event hour) and the repeats (offsets and event ids seen more than once, ids whose copies
    differ) come out of one read. When an offset repeats, grouping by (hour, reason, event
    hour) is not the rule of :func:`table_figures`: a second action groups by offset first,
    which shuffles every row. ``counters`` (columns ``_c0``... of ``both``) are summed in the
    first case only: ``figures["contract"]``."""
    from pyspark.sql import functions as F

    names = list(counters or {})
    # Without a content sample every row is in it: its figures are the rows' own.
    sampled = "s_content" in both.columns
    hashes = ["hash", "content", "s_content"] if sampled else ["hash", "content"]
    both = both.select(
        "*", *[half for name in hashes for half in checks._halves(F.col(name), name)]
    )
    sums = [f"{name}_{half}" for name in hashes for half in ("high", "low")]
    groups, repeats = _one_action(both, sums, sampled, len(names))
    counted = counters is not None and repeats["offsets"] == 0
    if repeats["offsets"] > 0:
        groups = _per_offset(both, sums, sampled).collect()
    figures = checks._summarise(
        (
            r["h"],
            r["reason"],
            r["e"],
            int(r["rows"]),
            int(r["quarantined"]),
            checks._whole(r, "hash"),
            checks._whole(r, "content"),
            int(r["repeated"]),
            int(r["s_row"]) if sampled else int(r["rows"]),
            checks._whole(r, "s_content" if sampled else "content"),
        )
        for r in groups
    )
    figures["resent"], figures["conflicting"] = repeats["resent"], repeats["conflicting"]
    if counted:
        figures["contract"] = schema_contract.contract_failures(
            {name: sum(int(r[f"_c{i}"] or 0) for r in groups) for i, name in enumerate(names)}
        )
    return figures


def _one_action(
    both: DataFrame, sums: list[str], sampled: bool, counters: int
) -> tuple[list[Any], dict[str, int]]:
    """One read of ``both``, three grouping sets (Spark's Expand): by (hour, reason, event
    hour) the figures as if no offset repeated, which Spark combines before its shuffle; by
    (partition, offset) and by event id (events only) the copies. A second, tiny aggregation
    folds the copies into three totals, so the driver receives the figure groups plus two
    rows: copies beyond the first of every offset (``offsets``) and of every event id
    (``resent``), and the ids whose copies differ (``conflicting``: min != max of their
    content hashes)."""
    from pyspark.sql import functions as F

    keys = ["h", "reason", "e", "kafka_partition", "kafka_offset", "id", "event"]
    first = (
        both.withColumn("event", F.col("id_content").isNotNull())
        .groupingSets(
            [("h", "reason", "e"), ("kafka_partition", "kafka_offset"), ("id", "event")], *keys
        )
        .agg(
            F.grouping("h").alias("gh"),
            F.grouping("id").alias("gi"),
            F.count("*").alias("n"),
            F.min("id_content").alias("low"),
            F.max("id_content").alias("high"),
            F.sum("is_row").alias("rows"),
            *([F.sum("s_row").alias("s_row")] if sampled else []),
            *[F.sum(c).alias(c) for c in sums],
            *[F.sum(f"_c{i}").alias(f"_c{i}") for i in range(counters)],
        )
    )
    kind = F.when(F.col("gh") == 0, 2).when(F.col("gi") == 0, 1).otherwise(0)
    figure = kind == 2
    copies = (
        first.where(figure | ((F.col("n") > 1) & ((kind == 0) | F.col("event"))))
        .select(
            kind.alias("kind"),
            "h",
            "reason",
            "e",
            F.when(figure, F.col("rows")).alias("rows"),
            F.when(figure, F.col("n") - F.col("rows")).alias("quarantined"),
            *([F.when(figure, F.col("s_row")).alias("s_row")] if sampled else []),
            *[F.when(figure, F.col(c)).alias(c) for c in sums],
            *[F.when(figure, F.col(f"_c{i}")).alias(f"_c{i}") for i in range(counters)],
            F.when(~figure, F.col("n") - 1).alias("extra"),
            F.when(~figure & (F.col("low") != F.col("high")), 1).alias("differ"),
        )
        .groupBy("kind", "h", "reason", "e")
        .agg(
            *[
                F.sum(c).alias(c)
                for c in ["rows", "quarantined", *(["s_row"] if sampled else []), *sums]
            ],
            *[F.sum(f"_c{i}").alias(f"_c{i}") for i in range(counters)],
            F.lit(0).alias("repeated"),
            F.coalesce(F.sum("extra"), F.lit(0)).alias("extra"),
            F.coalesce(F.sum("differ"), F.lit(0)).alias("differ"),
        )
        .collect()
    )
    totals = {r["kind"]: r for r in copies if r["kind"] != 2}
    repeats = {
        "offsets": int(totals[0]["extra"]) if 0 in totals else 0,
        "resent": int(totals[1]["extra"]) if 1 in totals else 0,
        "conflicting": int(totals[1]["differ"]) if 1 in totals else 0,
    }
    return [r for r in copies if r["kind"] == 2], repeats


def _per_offset(both: DataFrame, sums: list[str], sampled: bool) -> DataFrame:
    """The figures' groups by (hour, reason, event hour) when an offset repeats: every
    (partition, offset) first, under its earliest hour, reason and event hour (the rule in
    :func:`table_figures`); this shuffles every row."""
    from pyspark.sql import functions as F

    s_row = [F.sum("s_row").alias("s_row")] if sampled else []
    per_offset = both.groupBy("kafka_partition", "kafka_offset").agg(
        F.min("h").alias("h"),
        F.count("*").alias("n"),
        F.sum("is_row").alias("rows"),
        *s_row,
        *[F.sum(c).alias(c) for c in sums],
        F.min("reason").alias("reason"),
        F.min("e").alias("e"),
    )
    return per_offset.groupBy("h", "reason", "e").agg(
        F.sum("rows").alias("rows"),
        *s_row,
        F.sum(F.col("n") - F.col("rows")).alias("quarantined"),
        *[F.sum(c).alias(c) for c in sums],
        F.sum(F.col("n") - 1).alias("repeated"),
    )


def _data(spark: SparkSession, rows: int, where: str) -> tuple[DataFrame, DataFrame]:
    ids = spark.range(rows)
    branch = ids.select(
        F.expr("timestamp_seconds(1767225600 + (id % 24) * 3600)").alias("kafka_hour"),
        (F.col("id") % 6).cast("int").alias("kafka_partition"),
        F.col("id").alias("kafka_offset"),
        F.xxhash64("id").alias("record_hash"),
        (F.col("id") % 50 == 0).alias("is_tombstone"),
        F.concat(
            F.lit("e-"), (F.col("id") - (F.col("id") % 50 == 1).cast("long")).cast("string")
        ).alias("event_id"),
        F.concat(F.lit("o-"), (F.col("id") % 9000).cast("string")).alias("order_id"),
        F.concat(F.lit("c-"), (F.col("id") % 700).cast("string")).alias("customer_id"),
        F.lit("updated").alias("event_type"),
        F.lit("open").alias("status"),
        (F.col("id") % 10000).alias("amount_minor"),
        F.lit("EUR").alias("currency"),
        F.lit("web").alias("channel"),
        F.expr("timestamp_seconds(1767225600 + (id % 24) * 3600 + id % 3000)").alias("event_time"),
    )
    branch.write.parquet(f"{where}/branch")
    spark.range(rows // 100).select(
        F.expr("timestamp_seconds(1767225600 + (id % 24) * 3600)").alias("kafka_hour"),
        (F.col("id") % 6).cast("int").alias("kafka_partition"),
        (F.col("id") + rows).alias("kafka_offset"),
        F.xxhash64("id").alias("record_hash"),
        F.lit("invalid_json").alias("reason"),
    ).write.parquet(f"{where}/quarantine")
    return spark.read.parquet(f"{where}/branch"), spark.read.parquet(f"{where}/quarantine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=489_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--connect", help="a Spark Connect URL (sc://host:port)")
    args = parser.parse_args()
    builder = SparkSession.builder
    if args.connect:
        spark = builder.remote(args.connect).getOrCreate()
    else:
        spark = (
            builder.master("local[2]")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.ui.enabled", "false")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
    (spec,) = [s for s in load_specs() if s.topic == "orders"]
    branch, quarantine = _data(spark, args.rows, tempfile.mkdtemp(prefix="checks-actions-"))
    two = checks._figures_in_spark
    forms = {"one action": _one_action_form, "two actions": two}
    runs: dict[str, list[float]] = {name: [] for name in forms}
    reference = None
    for i in range(args.runs):
        order = list(forms) if i % 2 == 0 else list(reversed(forms))
        for name in order:
            checks._figures_in_spark = forms[name]  # type: ignore[assignment]
            started = time.perf_counter()
            figures = checks.table_figures(branch, quarantine, spec, contract=True)
            runs[name].append(time.perf_counter() - started)
            reference = reference or figures
            assert figures == reference, f"{name} disagrees with the other form"
    checks._figures_in_spark = two  # type: ignore[assignment]
    for name, seconds in runs.items():
        listed = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"{name:12} median {statistics.median(seconds):.2f} s  (runs {listed})")
    ratio = statistics.median(runs["one action"]) / statistics.median(runs["two actions"])
    print(f"one / two actions: {ratio:.2f}x; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
