"""The archiver in Dagster: an asset per topic that runs
:func:`backfill_assets.lake.operations.archiver.run_archiver`, and an hourly schedule for it.

(No ``from __future__ import annotations`` here: Dagster inspects the asset function's
``context`` annotation at definition time.)
"""

import dagster as dg

from backfill_assets.defs.resources import IcebergResource, KafkaResource
from backfill_assets.defs.topics import topic_asset_key
from backfill_assets.lake.offsets.archive import layout_version
from backfill_assets.lake.operations.archiver import run_archiver
from backfill_assets.lake.write import audit
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings


def archive_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return dg.AssetKey(["archive", spec.name])


def archive_schedule_name(spec: TopicSpec) -> str:
    return f"{spec.name}_archive_hourly"


def build_archive_asset(spec: TopicSpec) -> dg.AssetsDefinition:
    @dg.asset(
        key=archive_asset_key(spec),
        description=(
            f"Kafka topic {spec.topic!r} copied to the archive (offset-addressed Parquet "
            "files), so backfills can replay history older than Kafka's retention."
        ),
        group_name="archive",
        kinds={"kafka", "parquet"},
        code_version=layout_version(spec.topic),
        pool="archive",
        deps=[topic_asset_key(spec)],
    )
    def _archive(
        context: dg.AssetExecutionContext, kafka: KafkaResource, iceberg: IcebergResource
    ) -> dg.MaterializeResult:  # type: ignore[type-arg]
        runs, summary = run_archiver(
            kafka.client(),
            iceberg.client(),
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
