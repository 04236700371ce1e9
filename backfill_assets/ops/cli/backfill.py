"""``materialize`` (in this process), ``plan`` and ``backfill`` (through the webserver): a range
of a topic's tables."""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
import dagster as dg

from backfill_assets.ops.cli import common, output
from backfill_assets.ops.cli.common import (
    PARTITION_FMT,
    Exit,
    backfill_concurrency,
    hours,
    parse_duration,
    range_options,
    ranges,
    topic_range,
    with_ui,
)
from backfill_assets.ops.cli.output import Table, Ui
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from backfill_assets.ops.launch import DagsterClient
    from backfill_assets.ops.launch import Progress as BackfillProgress


_ACCEPT_HELP = (
    "accept that re-run hours publish fewer records than the ledger counted for them (Kafka's "
    "compaction or a truncation removed records from their published offset windows): without "
    "it such a run is refused by the blocking check records_kept and main keeps its rows; with "
    "it the run is tagged backfill_assets/accept_fewer_records=true, publishes what Kafka holds "
    "and the loss is recorded with its counts (audit table, ledger, run metadata)"
)


def _accept_tags(accept: bool) -> dict[str, str]:
    from backfill_assets.lake.write.checks import ACCEPT_FEWER_RECORDS_TAG

    return {ACCEPT_FEWER_RECORDS_TAG: "true"} if accept else {}


@click.command("materialize", short_help="Materialize a range of a topic's tables in-process.")
@range_options
@click.option("--accept-fewer-records", "accept", is_flag=True, help=_ACCEPT_HELP)
@with_ui
def materialize_command(
    ui: Ui, settings: Settings, topic: str, start: str, end: str, accept: bool
) -> int:
    """Materialize a Kafka-time range of a topic's tables in this process.

    Runs on the Dagster instance of $DAGSTER_HOME (the runs show in the UI), in dependency
    order: raw and current-state tables cover [start, end); each declared table covers the
    event-time hours whose events have all arrived within the range. Exits 4 if a run fails.
    """
    spec, first_hour, end_hour = topic_range(topic, start, end)
    runs, failed = run_in_process(ui, spec, first_hour, end_hour, accept=accept)
    ui.emit({"topic": spec.topic, "succeeded": failed is None, "runs": runs})
    if failed is not None:
        ui.note(f"error: run {failed.run_id} failed: {_failure_of(failed)}")
        return Exit.FAILED
    return 0


def run_in_process(
    ui: Ui, spec: TopicSpec, first_hour: datetime, end_hour: datetime, *, accept: bool = False
) -> tuple[list[dict[str, Any]], dg.ExecuteInProcessResult | None]:
    """Materialize ``[first_hour, end_hour)`` of the topic's tables in this process, in
    dependency order, on the instance of $DAGSTER_HOME; the runs, and the first that failed
    (None: all succeeded; no run starts after a failure). The Definitions are those of the
    spec the commands read (:func:`common.specs`), the same the code location loads."""
    from backfill_assets.defs.definitions import build_defs

    plan = ranges(spec, first_hour, end_hour)
    instance = dg.DagsterInstance.get()
    job = build_defs(list(common.specs().values())).resolve_implicit_global_asset_job_def()
    total = sum(hours(first, stop) * len(keys) for keys, first, stop in plan)
    runs: list[dict[str, Any]] = []
    done = 0
    with ui.progress(f"materializing {spec.topic}", total, "partitions") as update:
        for keys, first, stop in plan:
            last = stop - timedelta(hours=1)
            names = ", ".join(k.to_user_string() for k in keys)
            ui.line(f"materializing {names} {first:{PARTITION_FMT}}...{last:{PARTITION_FMT}}")
            result = job.execute_in_process(
                instance=instance,
                asset_selection=keys,
                tags={
                    "dagster/asset_partition_range_start": f"{first:{PARTITION_FMT}}",
                    "dagster/asset_partition_range_end": f"{last:{PARTITION_FMT}}",
                    **_accept_tags(accept),
                },
                raise_on_error=False,
                # The console shows the runs' own messages; every event is in the instance
                # (the Dagster UI), not printed line by line.
                run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
            )
            runs.append(
                {
                    "assets": [k.to_user_string() for k in keys],
                    "first": f"{first:{PARTITION_FMT}}",
                    "last": f"{last:{PARTITION_FMT}}",
                    "run_id": result.run_id,
                    "success": result.success,
                }
            )
            if not result.success:
                return runs, result
            done += hours(first, stop) * len(keys)
            update(done, None)
            ui.line(f"run {result.run_id} succeeded")
    return runs, None


def _failure_of(result: dg.ExecuteInProcessResult) -> str:
    """The first failed step's error message, in one line, and where to see the rest."""
    for event in result.all_events:
        if event.event_type == dg.DagsterEventType.STEP_FAILURE:
            data = event.step_failure_data
            error = data.error if data is not None else None
            message = (error.message if error is not None else "").strip().splitlines()
            if message:
                return f"{event.step_key}: {message[0][:400]} (details in the Dagster UI)"
    return "see it in the Dagster UI"


@click.command("plan", short_help="Replay contract, duration, cost and readiness of a range.")
@range_options
@click.option("--window", help="time available, e.g. 90m, 6h, 2d")
@with_ui
def plan_command(
    ui: Ui, settings: Settings, topic: str, start: str, end: str, window: str | None
) -> int:
    """Replay contract, duration, cost and readiness of a range. Exits 1 when a score is red."""
    from backfill_assets.ops.planner import make_plan

    spec, first, stop = topic_range(topic, start, end)
    available = parse_duration(window) if window else None
    instance = dg.DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else None
    plan = make_plan(
        common.kafka(),
        spec,
        first,
        stop,
        instance=instance,
        concurrency=backfill_concurrency(),
        window=available,
    )
    ui.emit(json.loads(plan.to_json()))
    if not ui.json:
        title, facts = _plan_facts(plan.human())
        ui.line(title)
        ui.table(facts)
        scores = output.table("score", "dimension", "reason", title="readiness")
        for s in plan.scorecard:
            output.row(scores, s.color, s.dimension, s.reason)
        ui.table(scores)
    return Exit.OK if all(s.color != "red" for s in plan.scorecard) else Exit.NOT_OK


def _plan_facts(human: str) -> tuple[str, Table]:
    """The planner's report as a two-column table (its first line is the title; the
    readiness lines are left out: the scorecard has its own table)."""
    lines = human.splitlines()
    rows: list[list[str]] = []
    for line in lines[1:]:
        if line.strip() == "readiness":
            break
        if line.startswith("    ") and rows:
            rows[-1][1] += " " + line.strip()
        else:
            rows.append([line[:15].strip(), line[15:].strip()])
    facts = output.table("", "")
    facts.show_header = False
    for key, value in rows:
        output.row(facts, key, value)
    return lines[0], facts


@click.command("backfill", short_help="Launch a Dagster partition backfill (as the UI does).")
@range_options
@click.option("--wait", is_flag=True, help="show progress until it ends")
@click.option("--timeout", type=float, help="seconds to wait at most")
@click.option("--webserver", help="webserver URL (default from BACKFILL_WEBSERVER_*)")
@click.option(
    "--as-backfill",
    is_flag=True,
    help="a backfill object even for one hour (by default one hour is one run, as the UI's "
    "Materialize launches it: it skips the backfill daemon's pass of up to 30 s)",
)
@click.option("--accept-fewer-records", "accept", is_flag=True, help=_ACCEPT_HELP)
@with_ui
def backfill_command(
    ui: Ui,
    settings: Settings,
    topic: str,
    start: str,
    end: str,
    wait: bool,
    timeout: float | None,
    webserver: str | None,
    as_backfill: bool,
    accept: bool,
) -> int:
    """Launch a Dagster partition backfill (as the UI does); a single hour is launched as one run
    unless --as-backfill. With --wait, exits 4 unless every asset partition succeeded."""
    from backfill_assets.ops import launch

    if settings.spark_connect:
        # Runs would fail one by one on an endpoint that does not answer: refuse up front.
        from backfill_assets.stack import spark

        spark.check_connect(settings)
    client = launch.DagsterClient(
        webserver or f"http://{settings.webserver_host}:{settings.webserver_port}"
    )
    doc, kind, where, audit_flag = _launch(client, topic, start, end, as_backfill, accept)
    launched_id = doc[f"{kind}_id"]
    for r in doc["ranges"]:
        ui.line(f"launched {kind} {launched_id}: {r['asset']} {r['first']}...{r['last']}")
    if not wait:
        ui.line(f"follow it in the Dagster UI ({where}) or re-run with --wait")
        ui.emit(doc)
        return 0
    final = _watch_backfill(ui, client, kind, launched_id, len(doc["ranges"]), timeout)
    doc["progress"] = {**asdict(final), "succeeded": final.succeeded}
    ui.emit(doc)
    ui.line(f"{kind} {launched_id}: {_backfill_line(final)}")
    if not final.succeeded:
        ui.note(
            f"error: {kind} {launched_id} ended {final.status} with {final.failed} failed "
            f"asset partition(s); open it in the Dagster UI ({where}) for the failed checks and "
            f"runs, then `backfill-assets audit {audit_flag} {launched_id}`"
        )
        return Exit.FAILED
    return 0


def _launch(
    client: DagsterClient, topic: str, start: str, end: str, as_backfill: bool, accept: bool
) -> tuple[dict[str, Any], str, str, str]:
    """Launch the range as a backfill, or as one run if it is a single hour (unless
    ``as_backfill``): the command's document, the kind launched ("run" or "backfill"), where
    the UI lists it and the audit flag that finds it."""
    from backfill_assets.ops import launch

    spec, first_hour, end_hour = topic_range(topic, start, end)
    last = end_hour - timedelta(hours=1)
    keyed = [
        (key, f"{first:{PARTITION_FMT}}", f"{stop - timedelta(hours=1):{PARTITION_FMT}}")
        for keys, first, stop in ranges(spec, first_hour, end_hour)
        for key in keys
    ]
    title = f"{spec.topic} {first_hour:{PARTITION_FMT}}..{last:{PARTITION_FMT}}"
    tags = {"backfill_assets/launched_by": f"cli:{getpass.getuser()}", **_accept_tags(accept)}
    partition = None if as_backfill else launch.single_partition(keyed)
    if partition is not None:
        launched_id = launch.launch_run(client, [k for k, _, _ in keyed], partition, tags, title)
        kind, where, audit_flag = "run", "Runs", "--run"
    else:
        launched_id = launch.launch_backfill(client, keyed, tags, title=title)
        kind, where, audit_flag = "backfill", "Overview -> Backfills", "--backfill"
    doc: dict[str, Any] = {
        f"{kind}_id": launched_id,
        "title": title,
        "ranges": [
            {"asset": key.to_user_string(), "first": first, "last": stop}
            for key, first, stop in keyed
        ],
    }
    return doc, kind, where, audit_flag


def _backfill_line(p: BackfillProgress) -> str:
    eta = f"ETA {p.eta_s:,.0f}s" if p.eta_s is not None else "ETA -"
    return (
        f"{p.done}/{p.targeted} asset partitions ({p.failed} failed), {p.records:,} records, "
        f"{p.rate:,.0f} rec/s, {p.elapsed_s:,.0f}s elapsed, {eta}, {p.status}"
    )


def _watch_backfill(
    ui: Ui, client: Any, kind: str, launched_id: str, targeted: int, timeout: float | None
) -> BackfillProgress:
    """Poll the backfill (or single-partition run) until it ends: a live bar on a terminal, else
    a line per change."""
    from backfill_assets.ops import launch

    def follow(on_progress: Callable[[BackfillProgress], None]) -> BackfillProgress:
        if kind == "run":
            return launch.wait_run(
                client, launched_id, targeted, timeout_s=timeout, on_progress=on_progress
            )
        return launch.wait(client, launched_id, timeout_s=timeout, on_progress=on_progress)

    if not ui.err.is_terminal:
        last = [""]

        def log(p: BackfillProgress) -> None:
            # A line per change of partitions, records or status (not per poll).
            state = f"{p.done} {p.failed} {p.records} {p.status}"
            if state != last[0]:
                ui.note(f"{launched_id} {_backfill_line(p)}")
            last[0] = state

        return follow(log)
    with ui.tracker(launched_id, "partitions") as update:

        def show(p: BackfillProgress) -> None:
            detail = f"{p.failed} failed, {p.records:,} records, {p.rate:,.0f} rec/s, {p.status}"
            update(p.done, p.targeted, detail)

        return follow(show)
