"""The archiver: a Dagster asset per topic that copies new Kafka records to the archive, and
an hourly schedule that runs it.

Each run archives the committed records of every partition from where its archive ends up to
the last stable offset seen when the run starts (see :mod:`backfill_assets.lake.archive` for the
layout and why each offset is archived exactly once), re-archives legacy files (written before
the archive read committed records only) that Kafka still holds, then appends one ``archive``
row to the audit table. Offsets that Kafka deleted before they were archived, offsets an open
transaction holds back, and legacy files that can no longer be re-archived are reported, never
hidden.

(No ``from __future__ import annotations`` here: Dagster inspects the asset function's
``context`` annotation at definition time.)
"""

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from backfill_assets.defs.resources import IcebergResource, KafkaResource
from backfill_assets.defs.topics import topic_asset_key
from backfill_assets.lake import audit
from backfill_assets.lake.archive import Archive, PartitionRun
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings


def archive_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return dg.AssetKey(["archive", spec.topic])


def archive_schedule_name(spec: TopicSpec) -> str:
    return f"{spec.topic}_archive_hourly"


def run_archiver(
    kafka: KafkaResource,
    iceberg: IcebergResource,
    spec: TopicSpec,
    *,
    run_id: str | None = None,
    launched_by: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[list[PartitionRun], dict[str, Any]]:
    """Archive ``spec.topic`` now; returns per-partition runs and a JSON-able summary.
    ``on_progress(partitions done, partitions)`` is called after each partition."""
    settings = kafka.settings
    store = Archive(settings)
    started = datetime.now(UTC)
    runs = store.archive_topic(kafka, spec.topic, on_progress=on_progress)
    summary: dict[str, Any] = {
        "archive_uri": settings.archive_uri,
        "records": sum(r.records for r in runs),
        "bytes": sum(r.bytes for r in runs),
        "files": sum(len(r.files) for r in runs),
        "partitions": {str(r.partition): r.to_json() for r in runs},
        "lost_before_archiving": {
            str(r.partition): list(r.lost) for r in runs if r.lost is not None
        },
        # [last stable offset, high watermark): archived by a later run, once the open
        # transaction holding the LSO back has ended.
        "waiting_for_transaction": {
            str(r.partition): list(r.waiting_for_transaction)
            for r in runs
            if r.waiting_for_transaction is not None
        },
        # Legacy files replaced by their committed rewrite in this run.
        "rearchived": {str(r.partition): r.rearchived for r in runs if r.rearchived},
        # Legacy files readers refuse and no run can fix: Kafka deleted (some of) their offsets
        # or holds other records there.
        "unverifiable_legacy": {
            str(r.partition): r.unverifiable_legacy for r in runs if r.unverifiable_legacy
        },
        # Legacy files reaching past the last stable offset: re-archived by a later run.
        "legacy_waiting_for_transaction": {
            str(r.partition): r.legacy_waiting for r in runs if r.legacy_waiting
        },
    }
    if summary["lost_before_archiving"]:
        outcome = "lost_offsets"
    elif summary["unverifiable_legacy"]:
        outcome = "unverifiable_legacy"
    else:
        outcome = "ok"
    audit.append(
        iceberg.catalog(),
        settings.catalog.namespace,
        audit.AuditRecord(
            event="archive",
            table_name=f"archive/{spec.topic}",
            outcome=outcome,
            run_id=run_id,
            launched_by=launched_by,
            offsets=json.dumps(
                {str(r.partition): [r.start, r.end] for r in runs}, separators=(",", ":")
            ),
            started_at=started,
            records_read=summary["records"],
            rows_written=summary["records"],
            detail=json.dumps(
                {
                    "files": summary["files"],
                    "lost": summary["lost_before_archiving"],
                    "waiting_for_transaction": summary["waiting_for_transaction"],
                    "rearchived": summary["rearchived"],
                    "unverifiable_legacy": summary["unverifiable_legacy"],
                    "legacy_waiting_for_transaction": summary["legacy_waiting_for_transaction"],
                }
            ),
        ),
    )
    return runs, summary


def build_archive_asset(spec: TopicSpec) -> dg.AssetsDefinition:
    @dg.asset(
        key=archive_asset_key(spec),
        description=(
            f"Kafka topic {spec.topic!r} copied to the archive (offset-addressed Parquet "
            "files), so backfills can replay history older than Kafka's retention."
        ),
        group_name="archive",
        kinds={"kafka", "parquet"},
        pool="archive",
        deps=[topic_asset_key(spec)],
    )
    def _archive(
        context: dg.AssetExecutionContext, kafka: KafkaResource, iceberg: IcebergResource
    ) -> dg.MaterializeResult:  # type: ignore[type-arg]
        runs, summary = run_archiver(
            kafka,
            iceberg,
            spec,
            run_id=context.run.run_id,
            launched_by=audit.launched_by(dict(context.run.tags)),
        )
        for r in runs:
            if r.lost is not None:
                context.log.warning(
                    f"{spec.topic} partition {r.partition}: offsets [{r.lost[0]}, {r.lost[1]}) "
                    "left Kafka before they were archived; they cannot be backfilled"
                )
            if r.waiting_for_transaction is not None:
                lso, high = r.waiting_for_transaction
                context.log.info(
                    f"{spec.topic} partition {r.partition}: offsets [{lso}, {high}) wait for an "
                    "open transaction; a later run archives them"
                )
            for legacy in r.rearchived:
                context.log.info(
                    f"{spec.topic} partition {r.partition}: re-archived legacy file "
                    f"{legacy['file']} with committed records only ({legacy['records_before']} "
                    f"-> {legacy['records_after']} records)"
                )
            for legacy in r.unverifiable_legacy:
                context.log.warning(
                    f"{spec.topic} partition {r.partition}: legacy file {legacy['file']} "
                    "(written before the archive read committed records only) cannot be "
                    "re-archived from Kafka; readers refuse it until an operator restores it "
                    "from elsewhere or deletes it"
                )
        context.log.info(
            f"archived {summary['records']} records in {summary['files']} files to "
            f"{summary['archive_uri']}"
        )
        return dg.MaterializeResult(
            metadata={
                "records": summary["records"],
                "bytes": summary["bytes"],
                "files": summary["files"],
                "partitions": dg.MetadataValue.json(summary["partitions"]),
                "lost_before_archiving": dg.MetadataValue.json(summary["lost_before_archiving"]),
                "waiting_for_transaction": dg.MetadataValue.json(
                    summary["waiting_for_transaction"]
                ),
                "rearchived": dg.MetadataValue.json(summary["rearchived"]),
                "unverifiable_legacy": dg.MetadataValue.json(summary["unverifiable_legacy"]),
                "archive_uri": summary["archive_uri"],
            }
        )

    return _archive


def build_archive_schedule(spec: TopicSpec) -> dg.ScheduleDefinition:
    running = Settings.from_env().sensors_running
    return dg.ScheduleDefinition(
        name=archive_schedule_name(spec),
        target=[archive_asset_key(spec)],
        cron_schedule="5 * * * *",
        default_status=(
            dg.DefaultScheduleStatus.RUNNING if running else dg.DefaultScheduleStatus.STOPPED
        ),
        description=f"Archive new records of {spec.topic!r} every hour.",
    )
