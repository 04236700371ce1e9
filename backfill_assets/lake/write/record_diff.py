"""The records behind a failed ``decoded_content`` hour, by name.

The check compares per-hour sums; when an hour differs, this reads that hour's Kafka records
again (through Spark, from Kafka and the archive as the run did), decodes each with the
independent reference decode, and compares record by record with the branch's rows and
quarantine, so the failure names partition and offset and the operator can fix the cause or
``backfill-assets accept`` the record. Reads only.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.decode.content import QUARANTINED, ROW, RecordDecoder, Sample
from backfill_assets.lake.offsets.contract import hours_filter
from backfill_assets.lake.write.read import read_contract
from backfill_assets.lake.write.replay import ReplayOutcome
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

# At most this many hours are read again, and of each at most this many records decoded: an
# hour the check compared whole, or the 1-in-K sample it compared of a larger hour.
HOURS, RECORDS_PER_HOUR = 3, 50_000


def content_hash(spec: TopicSpec) -> Column:
    """The content hash of a raw table row, as the figures sum it and the reference decode
    computes it: ``xxhash64(kafka_partition, kafka_offset, is_tombstone, <columns>...)``."""
    from pyspark.sql import functions as F

    names = ["kafka_partition", "kafka_offset", "is_tombstone", *[c.name for c in spec.columns]]
    return F.xxhash64(*[F.col(n) for n in names])


def differing_records(
    spark: SparkSession, spec: TopicSpec, outcome: ReplayOutcome, hours: list[str], limit: int = 10
) -> list[dict[str, Any]]:
    """Up to ``limit`` records of the ``hours`` (ISO) that differ: each with ``partition``,
    ``offset``, ``hour`` and what each side made of it."""
    windows = outcome.contract.windows
    if windows is None:
        return []
    settings = Settings.from_env()
    decoder = RecordDecoder(spec, settings.schema_registry_url, settings.schema_registry_auth)
    accepted = windows.content_sample.accepted
    found: list[dict[str, Any]] = []
    for hour in hours[:HOURS]:
        start = datetime.fromisoformat(hour)
        ranges = windows.hour_offsets(start)
        k = _sample_k(windows.content_sample, start)
        if sum(e - s for s, e in ranges.values()) > RECORDS_PER_HOUR * k:
            continue
        hour_contract = replace(outcome.contract, start=start, end=start, ranges=ranges)
        records = read_contract(spark, settings, hour_contract).select(
            "partition", "offset", "key", "value"
        )
        residue = windows.content_sample.residue
        records = records.where(_sampled("partition", "offset", k, residue))
        table = _table_side(spark, spec, outcome, start, (k, residue))
        for r in records.collect():
            p, o = int(r["partition"]), int(r["offset"])
            if (p, o) in accepted:
                continue
            kind, detail = decoder(p, o, r["key"], r["value"])
            why = _differs(kind, detail, table.get((p, o)))
            if why is not None:
                found.append({"hour": hour, "partition": p, "offset": o, "why": why})
                if len(found) >= limit:
                    return found
    return found


def _sample_k(sample: Sample, hour: datetime) -> int:
    """The 1-in-K the check compared of ``hour`` (1: the whole hour)."""
    return sample.k if int(hour.timestamp() * 1000) in sample.hours else 1


def _sampled(partition: str, offset: str, k: int, residue: int) -> Column:
    """The records of a 1-in-``k`` sample (content.in_sample) by their position columns."""
    from pyspark.sql import functions as F

    if k == 1:
        return F.lit(True)
    position = F.xxhash64(F.col(partition).cast("int"), F.col(offset).cast("bigint"))
    return F.pmod(position, F.lit(k)) == residue


def _table_side(
    spark: SparkSession,
    spec: TopicSpec,
    outcome: ReplayOutcome,
    hour: datetime,
    sample: tuple[int, int],
) -> dict[tuple[int, int], tuple[str, Any]]:
    """(partition, offset) -> (ROW, content hash) or (QUARANTINED, reason) on the branch, for
    the records of the 1-in-K ``sample`` (K, residue) of the hour."""
    from datetime import timedelta

    window = hours_filter(hour, hour + timedelta(hours=1))
    window = window & _sampled("kafka_partition", "kafka_offset", *sample)
    rows = spark.table(outcome.branch.ident).where(window)
    out: dict[tuple[int, int], tuple[str, Any]] = {}
    for r in rows.select("kafka_partition", "kafka_offset", content_hash(spec)).collect():
        out[(int(r[0]), int(r[1]))] = (ROW, int(r[2]))
    quarantine = spark.table(outcome.quarantine_source).where(window)
    for r in quarantine.select("kafka_partition", "kafka_offset", "reason").collect():
        out.setdefault((int(r[0]), int(r[1])), (QUARANTINED, r[2]))
    return out


def _differs(kind: str, detail: Any, table: tuple[str, Any] | None) -> str | None:
    """Why the reference's ``(kind, detail)`` and the table's reading differ (None: alike)."""
    if kind not in (ROW, QUARANTINED):
        return None  # a version without a reference: not compared
    if table is None:
        return "the run wrote neither a row nor a quarantine row for it"
    if kind == ROW and table[0] == ROW:
        return None if table[1] == detail else "the typed values of its row differ"
    if kind == ROW:
        return f"a row for the reference decode, quarantined by the run ({table[1]})"
    if table[0] == ROW:
        return f"a row in the table, quarantined by the reference decode ({detail})"
    return None
