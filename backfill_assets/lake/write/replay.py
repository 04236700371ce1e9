"""Replay an exact Kafka-time window into a raw Iceberg table, write-audit-publish.

Steps, and what is atomic:

1. **Contract**: the window ``[start, end)`` becomes, per hour and partition, a fixed offset
   range (:mod:`backfill_assets.lake.offsets.windows`: chained on the ledger's published windows,
   sealed only when Kafka can no longer add to it). The same librdkafka pass counts and hashes
   what Kafka holds there, for the checks. No consumer group is joined or committed.
2. **Read**: Spark's Kafka batch source reads exactly those offsets, committed records only,
   in executors; every record is tagged with the hour whose range holds it (``kafka_hour``),
   whatever its own timestamp, and with a hash of its Kafka bytes (``record_hash``).
3. **Parse**: payloads are read by one strict JSON pass in the JVM and upcast per schema
   version; a record that fails (invalid JSON, unknown version, a contract column NULL or out
   of range) is quarantined with its offsets, raw bytes and reason. Nothing else is dropped:
   the raw table is the committed log, one row per record (re-sends and corrections included;
   derived tables apply the duplicates rule). Tombstones stay as rows with ``is_tombstone``.
4. **Write**: quarantine rows overwrite the window's hours in the quarantine table (one atomic
   commit, kept even if the run fails, as evidence). Table rows overwrite the window's hours on
   a branch unique to the run (one atomic commit on the branch; main is not touched).
5. **Audit**: the checks read the branch (see :mod:`backfill_assets.lake.write.checks`).
6. **Publish**: :func:`backfill_assets.lake.write.wap.publish` (one catalog commit, or nothing).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from backfill_assets.lake.decode import avro, debezium_avro, json_schema, protobuf
from backfill_assets.lake.decode.parse import parse
from backfill_assets.lake.offsets.contract import OffsetContract, hours_filter, window_filter
from backfill_assets.lake.write.read import attribute, read_contract, read_throttled
from backfill_assets.lake.write.tables import ensure_tables
from backfill_assets.lake.write.wap import (
    Branch,
    committed_by,
    drop_branch,
    fast_forward,
    hour_writer,
    open_branch,
    pending_quarantine,
    ref_snapshot_id,
    ref_summary,
)
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import faults
from backfill_assets.stack.spark import cache_on_disk

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from backfill_assets.stack.catalog import CatalogClient
    from backfill_assets.stack.settings import Settings


@dataclass
class ReplayOutcome:
    """What one replay wrote, with the figures the checks and the UI need.

    The figures from ``rows_written`` on describe the run's branch and quarantine rows as
    written: :func:`backfill_assets.lake.write.checks.run_checks` measures them when it audits the
    branch (one aggregation for checks and figures) and sets them here."""

    contract: OffsetContract
    branch: Branch
    run_id: str
    records_read: int  # committed records in the windows, counted by librdkafka
    quarantine_table: str
    bytes_read: int
    bytes_written: int
    files_written: int
    duration_s: float
    rows_written: int = 0
    quarantined: int = 0
    checksum: str = "0"  # order-independent checksum of the rows' parsed content
    # Per Kafka hour (ISO, UTC): read (librdkafka), written and quarantined.
    per_hour: dict[str, dict[str, int]] = field(default_factory=dict)
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    # Event ids seen more than once in the window: identical re-sends, and ids whose copies
    # differ (corrections). Both stay rows; derived tables apply the duplicates rule.
    resent: int = 0
    conflicting_ids: int = 0
    # Per Kafka hour (ISO, UTC): the event-time hours (ISO, UTC) of its table rows with their
    # counts (tombstones excluded). The ledger keeps it so the late-data sensor never reads rows.
    event_hours: dict[str, dict[str, int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # An operator accepted that re-run hours publish fewer records than the ledger counted
    # (Kafka's compaction or truncation removed them): checks.records_kept passes, naming the
    # loss. Never set by the sensors.
    accept_fewer_records: bool = False
    # The run's branch of the quarantine table, holding its quarantine rows for the window,
    # published with the rows (:func:`publish_quarantine`); None for ad-hoc outcomes.
    quarantine_branch: Branch | None = None

    @property
    def quarantine_source(self) -> str:
        """Where the checks read the run's quarantine rows: its branch when it has one."""
        return self.quarantine_branch.ident if self.quarantine_branch else self.quarantine_table


def audit_summary(contract: OffsetContract, run_id: str) -> dict[str, str]:
    """What every snapshot a replay commits records about itself (without the prefix)."""
    out = {
        "run-id": run_id,
        "topic": contract.topic,
        "window": f"{contract.start.isoformat()}/{contract.end.isoformat()}",
        "offsets": contract.to_json(),
    }
    if contract.windows is not None:
        out["windows"] = contract.windows.bounds_json()
        # The committed records of each hour, in hour order: a ledger row recovered from this
        # summary (ledger.sync_from_history) carries them for checks.records_kept.
        windows = contract.windows
        out["hour-records"] = json.dumps(
            [sum(c.records for c in windows.cells[h].values()) for h in windows.hours],
            separators=(",", ":"),
        )
    if contract.identity is not None:
        out["topic-id"] = contract.identity.topic_id
        out["cluster-id"] = contract.identity.cluster_id
    if contract.archive_ranges:
        out["archive-offsets"] = json.dumps(
            {str(p): [s, e] for p, (s, e) in sorted(contract.archive_ranges.items())},
            separators=(",", ":"),
        )
    return out


def branch_write_stats(spark: SparkSession, branch: Branch) -> dict[str, int]:
    """Numeric figures of the snapshot at the head of ``branch`` (files and bytes added...),
    from the catalog's current metadata (:func:`ref_summary`: no Spark query, which over Spark
    Connect costs three round trips)."""
    summary = ref_summary(branch.table, branch.name)
    return {k: int(v) for k, v in summary.items() if v.isdigit()}


def checksum_expr(spec: TopicSpec) -> Column:
    """Order-independent checksum: the sum of a 64-bit hash of every row's key columns."""
    from pyspark.sql import functions as F

    cols = ["kafka_partition", "kafka_offset", "is_tombstone", *[c.name for c in spec.columns]]
    return F.coalesce(
        F.sum(F.xxhash64(*[F.col(c) for c in cols]).cast("decimal(38,0)")), F.lit(0)
    ).cast("string")


def replay_to_branch(
    spark: SparkSession,
    contract: OffsetContract,
    *,
    settings: Settings,
    iceberg: CatalogClient,
    spec: TopicSpec,
    run_id: str,
    began: float | None = None,
) -> ReplayOutcome:
    """Steps 2-4: read the contract's offsets, parse, write the window's rows to a run branch
    of the raw table and its quarantine rows to a branch of the same name of the quarantine
    table (both mains untouched: a run that fails or is refused leaves the published
    quarantine as it was). ``began`` (``time.monotonic()``) is when step 1 began, for the
    outcome's duration."""

    began = time.monotonic() if began is None else began
    table = iceberg.spark_name(spec.raw_table)
    qtable = iceberg.spark_name(spec.quarantine_table)
    ensure_tables(spark, settings, spec, table, qtable, iceberg.catalog())
    assert contract.windows is not None
    chunks: list[DataFrame] = []
    if settings.replay_max_records_per_s:
        source, chunks = read_throttled(
            spark, settings, contract, settings.replay_max_records_per_s
        )
    else:
        source = read_contract(spark, settings, contract)
    raw = attribute(spark, source, contract)
    # One cache: the parse (on local disk). Rows and quarantine are filters of it; the first
    # write fills it, the second reads it back. The run's figures are measured on the branch
    # as written, by the checks (checks.run_checks).
    writers: Mapping[int, Any] | debezium_avro.Writers | None = None
    url, auth, ids = (
        settings.schema_registry_url,
        settings.schema_registry_auth,
        contract.windows.schema_ids,
    )
    if spec.format == "avro" and spec.envelope == "debezium":
        writers = debezium_avro.resolve(spec, url, ids, auth)
    elif spec.format == "avro":
        writers = avro.resolve(spec, url, ids, auth)
    elif spec.format == "protobuf":
        writers = protobuf.resolve(spec, url, ids, auth)
    elif spec.format == "json_schema":
        writers = json_schema.resolve(url, ids, auth)
    rows, quarantine, parsed = parse(spec, raw, run_id, writers)
    try:
        props = audit_summary(contract, run_id)
        finish_quarantine(spark, iceberg, spec)
        branch = open_branch(spark, table, run_id)
        qbranch = open_branch(spark, qtable, run_id)
        # From here the driver waits on Spark: the independent decode reads Kafka meanwhile.
        contract.windows.start_decode()
        hour_writer(quarantine, qbranch.ident, props).overwrite(window_filter(contract))
        hour_writer(rows, branch.ident, props).overwrite(window_filter(contract))
        written = branch_write_stats(spark, branch)
        faults.after_branch_write(spark, branch.ident, qbranch.ident, contract)
    finally:
        parsed.unpersist()
        for chunk in chunks:
            chunk.unpersist()
    return ReplayOutcome(
        contract=contract,
        branch=branch,
        run_id=run_id,
        records_read=contract.windows.records,
        quarantine_table=qtable,
        bytes_read=contract.windows.size,
        bytes_written=written.get("added-files-size", 0),
        files_written=written.get("added-data-files", 0),
        duration_s=time.monotonic() - began,
        quarantine_branch=qbranch,
    )


def publish_quarantine(
    spark: SparkSession, qbranch: Branch, window: tuple[datetime, datetime], summary: dict[str, str]
) -> int:
    """Put a run's quarantine rows for ``window`` (on its branch ``qbranch`` of the quarantine
    table) on the quarantine table's main, right after its rows were published: a fast-forward
    when main has not moved since the branch was made, else one overwrite of the window's
    hours with the branch's rows. One commit either way; the branch is dropped. ``summary``
    is the run's (:func:`audit_summary`). The quarantine's snapshots never say
    ``published``: the ledger and the audit table record the raw publish, not this one.
    Returns main's new snapshot."""
    table = qbranch.table
    if ref_snapshot_id(spark, table, "main") == qbranch.main_before:
        with contextlib.suppress(Exception):  # main moved meanwhile: copy instead
            fast_forward(table, qbranch.name, qbranch.main_before)
            return _published_quarantine(spark, qbranch)
    rows = spark.table(qbranch.ident).where(hours_filter(*window))
    props = {k: v for k, v in summary.items() if k != "published"}
    hour_writer(rows, table, props).overwrite(hours_filter(*window))
    return _published_quarantine(spark, qbranch)


def _published_quarantine(spark: SparkSession, qbranch: Branch) -> int:
    """Drop the published quarantine branch; main's snapshot now."""
    with contextlib.suppress(Exception):  # housekeeping never fails a done publish
        _drop(spark, qbranch.table, qbranch.name)
    published = ref_snapshot_id(spark, qbranch.table, "main")
    assert published is not None
    return published


def quarantine_finished(spark: SparkSession, qbranch: Branch, run_id: str) -> bool:
    """Whether run ``run_id``'s quarantine reached main although its own publish of it failed:
    its branch is gone and a commit of main since the branch was made is the run's. Another
    run of the topic, starting between this run's two commits, finished it
    (:func:`finish_quarantine`)."""
    if ref_snapshot_id(spark, qbranch.table, qbranch.name) is not None:
        return False
    return committed_by(qbranch.table, "main", qbranch.main_before, run_id)


def finish_quarantine(spark: SparkSession, iceberg: CatalogClient, spec: TopicSpec) -> list[str]:
    """Publish the quarantine of runs whose rows were published but whose quarantine was not
    (the process died between the two commits) where that run is still the live publish of
    every hour of its window; drop such a branch otherwise. Branches of runs not published are
    kept (a run at work, or a failed run's evidence). Returns the runs finished."""
    from backfill_assets.lake.offsets import ledger

    qtable = iceberg.spark_name(spec.quarantine_table)
    table = iceberg.spark_name(spec.raw_table)
    pending = pending_quarantine(qtable, table)
    if not pending:
        return []
    cat, namespace = iceberg.catalog(), iceberg.settings.catalog.namespace
    ledger.sync_from_history(cat, namespace, table)  # the run may have died before its rows
    cover = ledger.coverage(cat, namespace, table)
    done = []
    for qbranch, run_id, window, summary in pending:
        hours = [h for h in cover if window[0] <= h < window[1]]
        if hours and all(cover[h].run_id == run_id for h in hours):
            publish_quarantine(spark, qbranch, window, summary)
            done.append(run_id)
        else:
            _drop(spark, qtable, qbranch.name)
    return done


def _drop(spark: SparkSession, table: str, name: str) -> None:
    drop_branch(table, name)


def reapply(spark: SparkSession, outcome: ReplayOutcome, attempt: int) -> Branch:
    """Rebase: open a new branch from main's current snapshot and copy the run's rows for its
    window there from the old branch (nothing is read from Kafka again). One commit on the new
    branch; main is not touched. The old branch is dropped."""
    old = outcome.branch
    rows = cache_on_disk(spark.table(old.ident).where(window_filter(outcome.contract)))
    try:
        rows.count()
        props = audit_summary(outcome.contract, outcome.run_id)
        branch = open_branch(spark, old.table, outcome.run_id, attempt)
        hour_writer(rows, branch.ident, props).overwrite(window_filter(outcome.contract))
    finally:
        rows.unpersist()
    drop_branch(old.table, old.name)
    return branch
