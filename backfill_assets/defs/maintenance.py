"""Table maintenance jobs: one Dagster job per table the spec declares (raw, quarantine,
current state, declared tables) plus one for the audit and ledger tables, each with a schedule
(``BACKFILL_MAINTENANCE_CRON``, on or off by ``BACKFILL_MAINTENANCE_SCHEDULES``) and runnable
from the UI. Each run makes one pass of
:func:`backfill_assets.lake.operations.maintenance.maintain` per
table; the report lands on the run (output metadata), on the table's asset (an observation)
and in the audit table.

(No ``from __future__ import annotations`` here: Dagster inspects the op function's
``context`` annotation at definition time.)
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from backfill_assets.defs.assets import current_asset_key, raw_asset_key, table_asset_key
from backfill_assets.defs.resources import IcebergResource, SparkResource
from backfill_assets.errors import MaintenanceError
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.operations import maintenance
from backfill_assets.lake.write import audit
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

POOL = "maintenance"


@dataclass(frozen=True)
class Target:
    """The tables one maintenance job covers, and the asset each one backs (if any)."""

    name: str
    tables: tuple[str, ...]
    asset_keys: tuple[dg.AssetKey | None, ...]


def maintenance_targets(specs: Sequence[TopicSpec]) -> list[Target]:
    """One target per table the spec declares, then the bookkeeping tables together."""
    out: dict[str, Target] = {}

    def add(table: str, key: dg.AssetKey | None) -> None:
        out.setdefault(table, Target(table, (table,), (key,)))

    for spec in specs:
        add(spec.raw_table, raw_asset_key(spec))
        add(spec.quarantine_table, None)
        add(spec.current_table, current_asset_key(spec))
        for table in spec.tables:
            add(table.name, table_asset_key(table.name))
    targets = list(out.values())
    targets.append(Target("bookkeeping", (audit.AUDIT_TABLE, ledger.LEDGER_TABLE), (None, None)))
    return targets


def job_name(target: Target) -> str:
    return f"maintain_{target.name}"


def _build_job(target: Target) -> dg.JobDefinition:
    @dg.op(
        name=f"{job_name(target)}_pass",
        description=f"One maintenance pass over {', '.join(target.tables)}.",
        pool=POOL,
    )
    def _pass(
        context: dg.OpExecutionContext, spark: SparkResource, iceberg: IcebergResource
    ) -> dict[str, Any]:
        settings = iceberg.settings
        instance = context.instance

        def run_active(run_id: str) -> bool | None:
            run = instance.get_run_by_id(run_id)
            return None if run is None else not run.is_finished

        reports: dict[str, Any] = {}
        failures: list[str] = []
        cat = iceberg.catalog()
        for table, key in zip(target.tables, target.asset_keys, strict=True):
            if not cat.table_exists(iceberg.identifier(table)):
                context.log.info(f"{table} does not exist yet; nothing to maintain")
                continue
            try:
                report = maintenance.maintain(
                    spark.spark_session,
                    settings,
                    table,
                    run_active=run_active,
                    progress=context.log.info,
                    run_id=context.run.run_id,
                    launched_by=audit.launched_by(dict(context.run.tags)),
                )
            except MaintenanceError as exc:
                failures.append(str(exc))
                continue
            reports[table] = report.as_dict()
            if key is not None:
                context.log_event(dg.AssetObservation(asset_key=key, metadata=_metadata(report)))
            if len(target.tables) == 1:
                context.add_output_metadata(_metadata(report))
        context.add_output_metadata({"tables": dg.MetadataValue.json(reports)})
        if failures:
            raise dg.Failure(
                description=" | ".join(failures),
                metadata={"reports": dg.MetadataValue.json(reports)},
            )
        return reports

    @dg.job(
        name=job_name(target),
        description=(
            f"Maintain {', '.join(target.tables)}: drop abandoned audit branches, compact, "
            "expire old snapshots, remove orphan files (BACKFILL_MAINTENANCE_* settings)."
        ),
        tags={"backfill_assets/kind": "maintenance"},
    )
    def _job() -> None:
        _pass()

    return _job


def _metadata(report: maintenance.MaintenanceReport) -> dict[str, Any]:
    return {
        "maintenance": dg.MetadataValue.json(report.as_dict()),
        "snapshots_expired": report.count("expire_snapshots", "snapshots_expired"),
        "data_files_rewritten": report.count("compact", "data_files_rewritten"),
        "orphan_files_removed": report.count("remove_orphans", "orphan_files_removed"),
        "branches_dropped": report.count("drop_branches", "dropped"),
        "snapshots_after": report.snapshots_after,
    }


def build_maintenance_defs(
    specs: Sequence[TopicSpec],
) -> tuple[list[dg.JobDefinition], list[dg.ScheduleDefinition]]:
    """A maintenance job per table and a schedule per job."""
    opts = Settings.from_env().maintenance
    status = (
        dg.DefaultScheduleStatus.RUNNING
        if opts.schedules_running
        else dg.DefaultScheduleStatus.STOPPED
    )
    jobs = [_build_job(t) for t in maintenance_targets(specs)]
    schedules = [
        dg.ScheduleDefinition(
            name=f"{job.name}_schedule",
            job=job,
            cron_schedule=opts.cron,
            execution_timezone="UTC",
            default_status=status,
            description=f"Run {job.name} on {opts.cron!r} (UTC; BACKFILL_MAINTENANCE_CRON).",
        )
        for job in jobs
    ]
    return jobs, schedules
