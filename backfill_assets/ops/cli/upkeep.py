"""The lake's upkeep: ``archive`` (copy Kafka records to the archive), ``maintain`` (one
maintenance pass per table) and ``gaps`` (what the gap and late-data sensors see)."""

from __future__ import annotations

import getpass
import os
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
import dagster as dg

from backfill_assets.errors import ArgumentError, MaintenanceError
from backfill_assets.ops.cli import common, output
from backfill_assets.ops.cli.common import Exit, topic_option, with_ui
from backfill_assets.ops.cli.common import spec as spec_of
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from backfill_assets.lake.coverage.detect import Findings
    from backfill_assets.spec.model import TopicSpec


@click.command("archive", short_help="Copy new records of a topic to the archive now.")
@topic_option
@click.option("--status", is_flag=True, help="show what is archived; copy nothing")
@with_ui
def archive_command(ui: Ui, settings: Settings, topic: str, status: bool) -> int:
    """Copy new records of a topic to the archive now (--status: show what is archived)."""
    from backfill_assets.lake.operations.archiver import run_archiver
    from backfill_assets.stack.catalog import CatalogClient

    known = common.specs()
    spec = known.get(topic)
    if spec is None:
        raise ArgumentError(f"unknown topic {topic!r}; topics.yaml defines: {', '.join(known)}")
    kafka = common.kafka()
    if status:
        _archive_status(ui, settings, spec, kafka)
        return 0
    with ui.progress(f"archiving {spec.topic}", None, "partitions") as update:
        runs, summary = run_archiver(
            kafka,
            CatalogClient(),
            spec,
            launched_by="cli",
            on_progress=update,
        )
    ui.emit(summary)
    ui.line(
        f"archived {summary['records']:,} records of {spec.topic!r} in {summary['files']} "
        f"files to {summary['archive_uri']}"
    )
    table = output.table("partition", "offsets", "records", "lost before archiving")
    for r in runs:
        lost = f"[{r.lost[0]}, {r.lost[1]})" if r.lost is not None else ""
        output.row(table, f"p{r.partition}", f"[{r.start}, {r.end})", f"{r.records:,}", lost)
    ui.table(table)
    return 0


def _archive_status(ui: Ui, settings: Settings, spec: TopicSpec, kafka: Any) -> None:
    """``archive --status``: per partition, the offsets archived and those Kafka holds."""
    from backfill_assets.lake.offsets.archive import Archive

    store = Archive(settings)
    marks = kafka.watermarks(spec.topic)
    parts: dict[str, dict[str, list[Any]]] = {
        str(p): {
            "archived": [list(c) for c in store.coverage(spec.topic, p)],
            "kafka": list(marks[p]),
        }
        for p in sorted(marks)
    }
    ui.emit({"archive_uri": settings.archive_uri, "partitions": parts})
    table = output.table(
        "partition",
        "archived offsets",
        "Kafka holds",
        title=f"archive {settings.archive_uri} of topic {spec.topic!r}",
    )
    for p, st in parts.items():
        low, high = st["kafka"]
        cov = ", ".join(f"[{a}, {b})" for a, b in st["archived"]) or "nothing"
        output.row(table, f"p{p}", cov, f"[{low}, {high})")
    ui.table(table)


@click.command(
    "maintain",
    short_help="Drop failed runs' branches, compact, expire snapshots, remove orphan files.",
)
@click.option(
    "--table",
    "tables",
    multiple=True,
    help="a table of the spec, or 'bookkeeping' (repeatable; default: every table)",
)
@with_ui
def maintain_command(ui: Ui, settings: Settings, tables: tuple[str, ...]) -> int:
    """One maintenance pass per table, as the scheduled maintain_* jobs run it (retentions:
    BACKFILL_MAINTENANCE_*; infra/README.md). Each pass is appended to the audit table.
    Exits 4 if a step failed (the others still ran)."""
    from backfill_assets.lake.operations import maintenance
    from backfill_assets.stack import spark as spark_mod

    names = _maintained_tables(tables)
    cat = catalog.load(settings.catalog)
    instance = dg.DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else None

    def run_active(run_id: str) -> bool | None:
        run = instance.get_run_by_id(run_id) if instance is not None else None
        return None if run is None else not run.is_finished

    session = spark_mod.get_session(settings)
    reports: dict[str, Any] = {}
    failures: list[str] = []
    with ui.progress("maintaining", len(names), "tables") as update:
        for done, table in enumerate(names):
            if not cat.table_exists(f"{settings.catalog.namespace}.{table}"):
                ui.line(f"{table}: does not exist yet; nothing to maintain")
                reports[table] = None
                continue
            try:
                report = maintenance.maintain(
                    session,
                    settings,
                    table,
                    run_active=run_active,
                    progress=ui.note if not ui.json else None,
                    launched_by=f"cli:{getpass.getuser()}",
                )
            except MaintenanceError as exc:
                failures.append(str(exc))
                ui.note(f"error: {exc}")
                continue
            finally:
                update(done + 1, None)
            reports[table] = report.as_dict()
            ui.line(report.summary())
    ui.emit({"tables": reports, "failed": failures})
    return Exit.FAILED if failures else Exit.OK


def _maintained_tables(tables: tuple[str, ...]) -> list[str]:
    """The tables ``--table`` names (a table or a maintenance target), or every table."""
    from backfill_assets.defs.maintenance import maintenance_targets

    targets = maintenance_targets(list(common.specs().values()))
    known = {name: target for target in targets for name in (target.name, *target.tables)}
    unknown = [t for t in tables if t not in known]
    if unknown:
        raise ArgumentError(
            f"unknown table(s) {', '.join(map(repr, unknown))}; maintainable: "
            + ", ".join(sorted(known))
        )
    chosen = [known[t] for t in dict.fromkeys(tables)] if tables else targets
    return list(dict.fromkeys(table for target in chosen for table in target.tables))


@click.command("gaps", short_help="What the gap and late-data sensors see, with fill commands.")
@topic_option
@click.option(
    "--horizon-hours", type=int, default=24, show_default=True, help="retention warning horizon"
)
@with_ui
def gaps_command(ui: Ui, settings: Settings, topic: str, horizon_hours: int) -> int:
    """What the gap and late-data sensors see, each finding with what to run. Exits 1 if
    anything is due, 4 if the topic is refused (deleted and recreated, or failed over: run
    `backfill-assets adopt`)."""
    from backfill_assets.lake.coverage import detect
    from backfill_assets.lake.offsets import identity, ledger

    spec = spec_of(topic)
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    found = detect.find(
        common.kafka(),
        cat,
        ns,
        spec,
        specs=list(common.specs().values()),
        retention_horizon=timedelta(hours=horizon_hours),
        read_budget=settings.gap_read_budget,
    )
    late = detect.late_event_hours(cat, ns, spec, specs=list(common.specs().values()))
    stale = {t.name: ledger.stale(cat, ns, f"{cat.name}.{ns}.{t.name}") for t in spec.tables}
    doc = _gaps_doc(spec, found, late, stale, settings.max_hours_per_run)
    doc["topic_replaced"] = str(found.replaced) if found.replaced is not None else None
    doc["not_re_read"] = identity.shadowed_doc(spec.topic, found.shadowed)
    ui.emit(doc)
    if found.replaced is not None:
        ui.line(f"REFUSED: {found.replaced}")
    for item in doc["not_re_read"]:
        ui.line(f"NOT RE-READ: {item['why']}")
    counts = {
        "raw_gaps": len(doc["raw_gaps"]),
        "current_gaps": len(doc["current_gaps"]),
        "tables_due": sum(len(d) for d in doc["tables_due"].values()),
        "late_event_hours": sum(len(d) for d in doc["late_event_hours"].values()),
        f"retention risks (within {horizon_hours} h)": len(doc["retention_risks"]),
    }
    ui.line(f"topic {spec.topic!r}: Kafka hours checked up to {found.closed_until}")
    ui.line(", ".join(f"{k}: {v or 'none'}" for k, v in counts.items()))
    table = _gaps_table(spec, doc)
    if table.rows:
        ui.table(table)
    if found.replaced is not None:
        return Exit.FAILED
    empty = not (
        found.raw_gaps or found.current_gaps or doc["tables_due"] or late or found.shadowed
    )
    return Exit.OK if empty else Exit.NOT_OK


def _rebuild(spec: TopicSpec, table: str, hour: str) -> str:
    """What rebuilds one hour of a declared table now (the sensors do it by themselves)."""
    key = f"{datetime.fromisoformat(hour):%Y-%m-%d-%H:%M}"
    return (
        f"the gap sensor {spec.name}_offset_gaps rebuilds it, or run: dagster asset "
        f"materialize -m backfill_assets.defs.definitions --select 'lakehouse/{table}' "
        f"--partition '{key}'"
    )


def _gaps_doc(
    spec: TopicSpec,
    found: Findings,
    late: dict[str, dict[datetime, str]],
    stale: dict[str, dict[datetime, str]],
    max_hours: int,
) -> dict[str, Any]:
    """The ``gaps`` document: gaps as ranges of at most ``max_hours`` hours (a run's, as the
    sensors request them) with the command that fills each, the hours due per table, late
    event hours and retention risks."""
    from backfill_assets.lake.coverage import detect

    hour = timedelta(hours=1)

    def ranges(hours: list[datetime]) -> list[dict[str, str]]:
        out = []
        for first, last in detect.contiguous(hours, max_hours):
            end = last + hour
            out.append(
                {
                    "start": first.isoformat(),
                    "end": end.isoformat(),
                    "fill": f"backfill-assets backfill --topic {spec.topic} "
                    f"--start {first:%Y-%m-%dT%H:%MZ} --end {end:%Y-%m-%dT%H:%MZ} --wait",
                }
            )
        return out

    return {
        "topic": spec.topic,
        "raw_gaps": ranges(found.raw_gaps),
        "current_gaps": ranges(found.current_gaps),
        "tables_due": {
            name: {h.isoformat(): stale.get(name, {}).get(h, why) for h, why in sorted(due.items())}
            for name, due in found.tables_due.items()
            if due
        },
        "late_event_hours": {
            name: {h.isoformat(): why for h, why in sorted(due.items())}
            for name, due in late.items()
        },
        "retention_risks": found.retention_risks,
    }


def _gaps_table(spec: TopicSpec, doc: dict[str, Any]) -> output.Table:
    table = output.table("finding", "table", "hours (UTC)", "why / fill command")
    for kind, name, gaps, what in (
        ("raw gap", spec.raw_table, doc["raw_gaps"], "Kafka holds records not published"),
        ("current gap", spec.current_table, doc["current_gaps"], "current state not built"),
    ):
        for g in gaps:
            output.row(
                table,
                kind,
                name,
                f"{g['start']} .. {g['end']}",
                f"{what}; the gap sensor {spec.name}_offset_gaps requests it, or run: {g['fill']}",
            )
    for kind, per_table in (
        ("table due", doc["tables_due"]),
        ("late events", doc["late_event_hours"]),
    ):
        for name, due in per_table.items():
            for h, why in due.items():
                output.row(table, kind, name, h, f"{why}; {_rebuild(spec, name, h)}")
    for r in doc["retention_risks"]:
        archived = "archived" if r["archived"] else "NOT archived"
        output.row(
            table,
            "retention risk",
            spec.raw_table,
            r["hour"],
            f"not published, leaves Kafka at {r['leaves_kafka_at']}, offsets {r['offsets']} "
            + (
                f"({archived}: it can still be backfilled after that)"
                if r["archived"]
                else f"({archived}): run `backfill-assets archive --topic {spec.topic}` now"
            ),
        )
    return table


@click.command(
    "report-empty",
    short_help="Mark every hour with nothing to hold as done in the Dagster instance now.",
)
@topic_option
@with_ui
def report_empty_command(ui: Ui, settings: Settings, topic: str) -> int:
    """Report to the Dagster instance of $DAGSTER_HOME every hour of the topic's assets that
    provably holds nothing (sealed, no records) and has no materialization yet, as the gap
    sensor does a share per tick. Afterwards the partition bar's "Missing" means only hours
    whose records are not published. Each report is one event in the instance; nothing is
    written to the tables."""
    from backfill_assets.defs.sensors import empty_reports

    spec = spec_of(topic)
    with dg.DagsterInstance.get() as instance:
        events = empty_reports(
            instance,
            common.kafka(),
            catalog.load(settings.catalog),
            settings.catalog.namespace,
            spec,
            list(common.specs().values()),
        )
        with ui.progress(
            f"reporting known-empty hours of {spec.topic}", len(events), "hours"
        ) as update:
            for i, event in enumerate(events, 1):
                instance.report_runless_asset_event(event)
                update(i, None)
    per_asset: dict[str, int] = {}
    for event in events:
        name = event.asset_key.to_user_string()
        per_asset[name] = per_asset.get(name, 0) + 1
    ui.emit({"topic": spec.topic, "reported": len(events), "per_asset": per_asset})
    ui.line(f"topic {spec.topic!r}: {len(events)} known-empty hour(s) reported as done")
    for name, n in sorted(per_asset.items()):
        ui.line(f"  {name}: {n}")
    return Exit.OK
