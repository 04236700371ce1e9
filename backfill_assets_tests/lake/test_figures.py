"""The checks' figures (counts, hash sums, repeated offsets and ids, reasons, event hours) are
the same whether a window is aggregated in the driver process (small windows) or by Spark
(large ones), on a branch with every fault the checks exist to catch; an understated size
falls back to Spark instead of aggregating part of the rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.lake.decode import content
from backfill_assets.lake.offsets.windows import hour_key
from backfill_assets.lake.write import checks
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import TopicSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

H0 = datetime(2026, 3, 1, 1, tzinfo=UTC)
H1 = H0 + timedelta(hours=1)


def _orders() -> TopicSpec:
    (spec,) = [s for s in load_specs() if s.topic == "orders"]
    return spec


def _event(i: int, **changes: Any) -> dict[str, Any]:
    row = {
        "event_id": f"e{i}",
        "order_id": f"o{i}",
        "customer_id": f"c{i}",
        "event_type": "created",
        "status": "open",
        "amount_minor": 100 * i,
        "currency": "EUR",
        "channel": "web",
        "event_time": H0 + timedelta(minutes=i),
    }
    row.update(changes)
    return row


def _branch(
    spark: SparkSession, rows: list[tuple[datetime, int, int, int, dict[str, Any] | None]]
) -> DataFrame:
    """(kafka hour, partition, offset, record hash, event or None for a tombstone)."""
    spec = _orders()
    names = [c.name for c in spec.columns]
    ddl = "kafka_hour timestamp, kafka_partition int, kafka_offset bigint, record_hash bigint, "
    ddl += "is_tombstone boolean, " + ", ".join(f"{c.name} {c.type}" for c in spec.columns)
    data = [
        (hour, p, o, h, event is None, *[(event or {}).get(n) for n in names])
        for hour, p, o, h, event in rows
    ]
    return spark.createDataFrame(data, ddl)


def _quarantine(spark: SparkSession, rows: list[tuple[datetime, int, int, int, str]]) -> DataFrame:
    ddl = "kafka_hour timestamp, kafka_partition int, kafka_offset bigint, record_hash bigint, "
    return spark.createDataFrame(rows, ddl + "reason string")


def _hostile(spark: SparkSession) -> tuple[DataFrame, DataFrame]:
    big = 2**63 - 1  # hash sums overflow 64 bits: both ways must stay exact
    branch = _branch(
        spark,
        [
            (H0, 0, 0, big, _event(1)),
            (H0, 0, 1, big, _event(2)),
            (H0, 0, 2, -(2**63), _event(3)),
            # offset 0/2 again, in the next hour: a repeated offset, counted under H0
            (H1, 0, 2, 7, _event(3)),
            # an event id sent twice with the same content (resent), and once more with
            # different content (conflicting)
            (H1, 1, 0, 11, _event(4)),
            (H1, 1, 1, 12, _event(4)),
            (H1, 1, 2, 13, _event(4, amount_minor=1)),
            # a late event (event time two hours before its Kafka hour), and a tombstone
            (H1, 1, 3, 14, _event(5, event_time=H0 - timedelta(hours=1))),
            (H1, 1, 4, 15, None),
            # two events without an id: one key for the grouping, as in Spark
            (H1, 1, 5, 16, _event(6, event_id=None)),
            (H1, 1, 6, 17, _event(7, event_id=None)),
            # an offset that is both a row and quarantined
            (H1, 1, 7, 18, _event(8)),
        ],
    )
    quarantine = _quarantine(
        spark,
        [
            (H0, 0, 3, -5, "invalid_json"),
            (H0, 0, 4, -6, "invalid_json"),
            (H1, 1, 7, 19, "missing_field:amount_minor"),
            (H1, 1, 8, big, "schema_version"),
        ],
    )
    return branch, quarantine


def test_driver_and_spark_give_the_same_figures(spark_session: SparkSession) -> None:
    spec = _orders()
    branch, quarantine = _hostile(spark_session)
    here = checks.table_figures(branch, quarantine, spec, at_most=16)
    there = checks.table_figures(branch, quarantine, spec)  # no bound: Spark aggregates
    assert here == there
    h0, h1 = hour_key(int(H0.timestamp() * 1000)), hour_key(int(H1.timestamp() * 1000))
    big = 2**63 - 1
    assert here["per_hour"][h0] == {
        "rows": 4,  # offsets 0/0, 0/1 and both copies of 0/2 (the earliest hour holds them)
        "quarantined": 2,
        "hash_sum": big + big - (2**63) + 7 - 5 - 6,
    }
    assert here["per_hour"][h1] == {
        "rows": 8,
        "quarantined": 2,
        "hash_sum": sum(range(11, 20)) + big,
    }
    assert here["repeated_offsets"] == 2  # 0/2 twice, 1/7 as a row and quarantined
    assert here["reasons"] == {
        "invalid_json": 2,
        "missing_field:amount_minor": 1,
        "schema_version": 1,
    }
    # e3 twice (the repeated offset: 1 resent), e4 three times (2 resent, conflicting), the
    # two id-less events (1 resent, conflicting)
    assert here["resent"] == 4
    assert here["conflicting"] == 2
    late = hour_key(int((H0 - timedelta(hours=1)).timestamp() * 1000))
    assert here["event_hours"][h1][late] == 1


def test_an_understated_size_falls_back_to_spark(
    spark_session: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bound that lies must not make the driver aggregate only the first rows."""
    spec = _orders()
    branch, quarantine = _hostile(spark_session)
    expected = checks.table_figures(branch, quarantine, spec)
    monkeypatch.setattr(checks, "FIGURES_DRIVER_ROWS", 5)
    assert checks.table_figures(branch, quarantine, spec, at_most=3) == expected


def test_both_ways_agree_when_no_offset_repeats(spark_session: SparkSession) -> None:
    """Without a repeated offset Spark skips the per-offset grouping (one aggregation that
    combines before its shuffle); the figures must still be the driver's, resent and
    conflicting ids included, and one repeat brought back must be counted again."""
    spec = _orders()
    branch, quarantine = _hostile(spark_session)
    # Drop the copies that repeat an offset: 0/2 in H1 and the quarantined 1/7.
    branch = branch.where("NOT (kafka_partition = 0 AND kafka_offset = 2 AND record_hash = 7)")
    quarantine = quarantine.where("NOT (kafka_partition = 1 AND kafka_offset = 7)")
    here = checks.table_figures(branch, quarantine, spec, at_most=16)
    there = checks.table_figures(branch, quarantine, spec)
    assert here == there
    assert there["repeated_offsets"] == 0
    assert there["resent"] == 3  # e4 twice more, one id-less event more
    assert there["conflicting"] == 2
    h1 = hour_key(int(H1.timestamp() * 1000))
    assert there["per_hour"][h1] == {
        "rows": 8,  # 1/0 .. 1/7 (the copy of 0/2 that was in H1 is gone)
        "quarantined": 1,
        "hash_sum": sum(range(11, 19)) + 2**63 - 1,
    }
    again = checks.table_figures(branch.unionByName(branch.limit(1)), quarantine, spec)
    assert again["repeated_offsets"] == 1


def test_the_contract_counted_with_the_figures_is_pandera_s_report(
    spark_session: SparkSession,
) -> None:
    """A large window without repeated offsets counts the contract in the figures'
    aggregation: the report must be the one schema_contract gives for the same events
    (tombstones and quarantined records excluded); with a repeated offset it is not counted
    there and the check runs on its own."""
    from pyspark.sql import functions as F

    spec = _orders()
    branch, quarantine = _hostile(spark_session)
    branch = branch.where("NOT (kafka_partition = 0 AND kafka_offset = 2 AND record_hash = 7)")
    quarantine = quarantine.where("NOT (kafka_partition = 1 AND kafka_offset = 7)")
    # Break two more rules: a status outside the allowed list, a negative amount.
    bad = F.col("kafka_partition") == 1
    branch = branch.withColumn(
        "status", F.when(bad & (F.col("kafka_offset") == 0), "bogus").otherwise(F.col("status"))
    ).withColumn(
        "amount_minor",
        F.when(bad & (F.col("kafka_offset") == 1), -5).otherwise(F.col("amount_minor")),
    )
    figures = checks.table_figures(branch, quarantine, spec, contract=True)
    events = branch.where(~F.col("is_tombstone")).select(*[c.name for c in spec.columns])
    alone = checks.schema_contract(events, spec.columns)
    assert figures["contract"] == alone.metadata["violations"]
    assert len(figures["contract"]) >= 3  # the two broken rules and the id-less events
    assert checks.contract_outcome(figures["contract"], spec.columns) == alone
    # Without repeated offsets the figures are the same with or without the contract.
    plain = checks.table_figures(branch, quarantine, spec)
    assert {k: v for k, v in figures.items() if k != "contract"} == plain
    repeated = checks.table_figures(
        branch.unionByName(branch.limit(1)), quarantine, spec, contract=True
    )
    assert "contract" not in repeated
    # A small window reads its rows once into the driver: the figures and the report on the
    # events of that same read, equal to the above (repeated offsets or not).
    for rows in (branch, branch.unionByName(branch.limit(1))):
        here = checks.table_figures(rows, quarantine, spec, at_most=100, contract=True)
        events = rows.where(~F.col("is_tombstone")).select(*[c.name for c in spec.columns])
        report = checks.schema_contract(events, spec.contract_columns).metadata["violations"]
        assert here["contract"] == report
        assert {k: v for k, v in here.items() if k != "contract"} == checks.table_figures(
            rows, quarantine, spec, at_most=100
        )
    assert here["contract"] == figures["contract"] != {}


def test_the_content_sample_is_summed_alike_both_ways(spark_session: SparkSession) -> None:
    """decoded_content's table side over a 1-in-K sample: the driver and Spark sum the same
    rows (those content.in_sample picks), with and without a repeated offset, and the other
    figures do not change; without a sample the compared rows are all the rows."""
    from pyspark.sql import functions as F

    spec = _orders()
    branch, quarantine = _hostile(spark_session)
    whole = checks.table_figures(branch, quarantine, spec, at_most=16)
    assert {h: f["rows"] for h, f in whole["per_hour"].items()} == whole["content_rows_per_hour"]
    unique = branch.where("NOT (kafka_partition = 0 AND kafka_offset = 2 AND record_hash = 7)")
    content_cols = ["kafka_partition", "kafka_offset", "is_tombstone"]
    content_cols += [c.name for c in spec.columns]
    every_hour = branch.select(F.unix_millis("kafka_hour")).distinct().collect()
    hours = frozenset(int(r[0]) for r in every_hour)
    for rows in (branch, unique):
        for k in (2, 3):
            sample = content.Sample(k, 0, hours)
            here = checks.table_figures(rows, quarantine, spec, at_most=16, content_sample=sample)
            there = checks.table_figures(rows, quarantine, spec, content_sample=sample)
            assert here == there
            plain = checks.table_figures(rows, quarantine, spec, at_most=16)
            drop = ("content_per_hour", "content_rows_per_hour")
            assert {n: v for n, v in here.items() if n not in drop} == {
                n: v for n, v in plain.items() if n not in drop
            }
            picked = [
                r
                for r in rows.select(
                    F.unix_millis("kafka_hour").alias("h"),
                    "kafka_partition",
                    "kafka_offset",
                    F.xxhash64(*content_cols).alias("c"),
                ).collect()
                if content.in_sample(r["kafka_partition"], r["kafka_offset"], k)
            ]
            assert 0 < len(picked) < rows.count()
            expect_rows: dict[str, int] = {}
            expect_sums: dict[str, int] = {}
            for r in picked:
                expect_rows[hour_key(r["h"])] = expect_rows.get(hour_key(r["h"]), 0) + 1
                expect_sums[hour_key(r["h"])] = expect_sums.get(hour_key(r["h"]), 0) + r["c"]
            if rows is unique:  # (with the repeat, its copies count under the earliest hour)
                got_rows = {h: n for h, n in here["content_rows_per_hour"].items() if n}
                assert got_rows == expect_rows
                got_sums = {h: here["content_per_hour"][h] for h in expect_sums}
                assert got_sums == expect_sums
