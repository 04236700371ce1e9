"""``quarantine``: a topic's quarantined records by reason and hour, and the re-run of exactly
the hours that hold them once their cause is fixed."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from backfill_assets.ops.cli.backfill import _failure_of, run_in_process
from backfill_assets.ops.cli.common import Exit, parse_hour, topic_option, with_ui
from backfill_assets.ops.cli.common import spec as spec_of
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings


@click.command("quarantine", short_help="List quarantined records; re-run the hours holding them.")
@topic_option
@click.option("--start", help="first Kafka hour, ISO-8601 UTC (inclusive)")
@click.option("--end", help="end Kafka hour, ISO-8601 UTC (exclusive)")
@click.option("--reason", help="only reasons that start with this, e.g. invalid_json")
@click.option(
    "--rerun",
    is_flag=True,
    help="re-run the hours holding the listed records (branch, checks, publish) and report "
    "what moved from quarantine into the table",
)
@with_ui
def quarantine_command(
    ui: Ui,
    settings: Settings,
    topic: str,
    start: str | None,
    end: str | None,
    reason: str | None,
    rerun: bool,
) -> int:
    """List a topic's quarantined records (main of its quarantine table) by Kafka hour and
    reason, with counts and each partition's first offset. With ``--rerun``, materialize
    exactly the hours that hold them, as a backfill does, after a fix (a new decoder or
    upcaster, a corrected spec), and report which records moved into the table, which are still
    quarantined, and whether every other row of those hours is exactly as it was. A refused
    re-run changes nothing (exit 4)."""
    from backfill_assets.lake.operations import quarantine

    spec = spec_of(topic)
    first = parse_hour(start, "--start") if start else None
    stop = parse_hour(end, "--end") if end else None
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    groups = quarantine.groups(cat, ns, spec, first, stop, reason)
    doc: dict[str, Any] = {"topic": spec.topic, "groups": [g.to_json() for g in groups]}
    _list(ui, spec.topic, groups)
    if not rerun or not groups:
        ui.emit(doc)
        return Exit.OK
    hours = sorted({g.hour for g in groups})
    before = quarantine.hours_state(cat, ns, spec, hours)
    doc["runs"] = []
    for run_start, run_end in quarantine.hour_runs(hours):
        runs, failed = run_in_process(ui, spec, run_start, run_end)
        doc["runs"] += runs
        if failed is not None:
            doc["moved"] = quarantine.moved(before, quarantine.hours_state(cat, ns, spec, hours))
            ui.emit(doc)
            ui.note(f"error: run {failed.run_id} failed: {_failure_of(failed)}")
            return Exit.FAILED
    doc["moved"] = result = quarantine.moved(before, quarantine.hours_state(cat, ns, spec, hours))
    ui.emit(doc)
    _report(ui, hours, result)
    return Exit.OK


def _list(ui: Ui, topic: str, groups: list[Any]) -> None:
    if not groups:
        ui.line(f"topic {topic!r}: nothing quarantined in the hours asked")
        return
    total = sum(g.records for g in groups)
    ui.line(f"topic {topic!r}: {total} quarantined record(s)")
    for g in groups:
        firsts = ", ".join(f"p{p}@{o}" for p, o in sorted(g.first_offsets.items()))
        ui.line(f"  {g.hour.isoformat()}  {g.reason}: {g.records} (first: {firsts})")


def _report(ui: Ui, hours: list[datetime], result: dict[str, Any]) -> None:
    ui.line(
        f"re-ran {len(hours)} hour(s): {len(result['moved_to_table'])} record(s) moved from "
        f"quarantine into the table; still quarantined: {result['still_quarantined'] or 'none'}"
    )
    if result["newly_quarantined"]:
        ui.line(f"newly quarantined: {', '.join(result['newly_quarantined'][:10])}")
    verdict = "exactly as they were" if result["other_rows_unchanged"] else "CHANGED"
    ui.line(f"the other {result['other_rows']} row(s) of those hours are {verdict}")
