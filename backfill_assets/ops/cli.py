"""``backfill-assets``: the operator's command line (click for arguments, rich for output).

Every failure the project anticipates (a :class:`~backfill_assets.errors.BackfillError`, or a
``dg.Failure`` raised by the Kafka resource) prints ``error: <message>`` on stderr, saying what
to run next, and exits with status 2; so do wrong arguments (click's usage message names what is
allowed). ``--json`` on every command prints exactly one JSON document on stdout and nothing
else there; progress bars and notes always go to stderr. Without a terminal rich prints plain
text: no colours, no live bars, no line wrapping.

All click and rich code of the project is in this module; the library reports progress through
plain callbacks.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click
import dagster as dg
import yaml
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from backfill_assets.errors import BackfillError
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog, jars
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from backfill_assets.lake.rollback import RollbackResult
    from backfill_assets.ops.launch import Progress as BackfillProgress
    from backfill_assets.stack.kafka import KafkaClient

PARTITION_FMT = "%Y-%m-%d-%H:%M"  # Dagster's hourly partition keys

# -- output ------------------------------------------------------------------------------------


def _console(stream: IO[str]) -> Console:
    """A rich console on ``stream``; when it is not a terminal: plain text, no wrapping at 80."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    width = None if tty else int(os.environ.get("COLUMNS") or 0) or 200
    return Console(file=stream, width=width, highlight=False, emoji=False)


class Ui:
    """Where one command's output goes: rich text and tables on stdout for people, or one JSON
    document on stdout for machines (``--json``); progress and notes on stderr in both modes."""

    def __init__(self, as_json: bool) -> None:
        self.json = as_json
        self.stdout = sys.stdout
        self.out = _console(sys.stdout)
        self.err = _console(sys.stderr)

    def line(self, text: str = "") -> None:
        """A line of the human report (nothing in --json mode)."""
        if not self.json:
            self.out.print(text, markup=False, highlight=False, soft_wrap=True)

    def table(self, table: Table) -> None:
        if not self.json:
            self.out.print(table)

    def note(self, text: str) -> None:
        """A warning or a progress line for people: stderr, in every mode."""
        self.err.print(text, markup=False, highlight=False, soft_wrap=True)

    def emit(self, doc: Any) -> None:
        """The one JSON document of --json mode (nothing otherwise)."""
        if self.json:
            self.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
            self.stdout.flush()

    @contextlib.contextmanager
    def progress(
        self, description: str, total: float | None, unit: str
    ) -> Iterator[Callable[[float, float | None], None]]:
        """A live bar on stderr (done/total, rate per second, elapsed, ETA) while the block
        runs, if stderr is a terminal; yields ``update(completed, total)``. Off otherwise."""
        if not self.err.is_terminal:

            def ignore(completed: float, new_total: float | None = None) -> None:
                pass

            yield ignore
            return
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _Rate(unit),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[detail]}"),
            console=self.err,
        ) as bar:
            task = bar.add_task(description, total=total, detail="")

            def update(completed: float, new_total: float | None = None) -> None:
                bar.update(task, completed=completed, total=new_total or total)

            yield update

    @contextlib.contextmanager
    def spinner(self, text: str) -> Iterator[None]:
        """A spinner on stderr for work without a known total (terminal only)."""
        if not self.err.is_terminal:
            yield
            return
        with self.err.status(text):
            yield


class _Rate(ProgressColumn):
    """Completed units per second, e.g. ``812.5 records/s``."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-" if speed is None else f"{speed:,.1f} {self.unit}/s")


def _table(*columns: str, title: str | None = None) -> Table:
    """A table whose cells never lose characters (ids must stay copyable): long cells fold."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def _row(table: Table, *cells: object) -> None:
    """Add a row of plain text: no rich markup is interpreted in data (``[a, b)`` stays)."""
    table.add_row(*(Text("-" if c is None else str(c)) for c in cells))


# -- errors and the command group --------------------------------------------------------------


class AnticipatedError(click.ClickException):
    """A BackfillError or a Kafka resource failure: ``error: <message>``, exit status 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _message(exc: BaseException) -> str:
    if isinstance(exc, dg.Failure) and exc.description:
        return exc.description
    return str(exc)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (BackfillError, dg.Failure) as exc:
            raise AnticipatedError(_message(exc)) from None


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
def cli() -> None:
    """Safe Kafka -> Iceberg backfills with Dagster."""


def _with_ui(fn: Callable[..., int]) -> Callable[..., int]:
    """Give a command ``--json``, a :class:`Ui` and the settings. In --json mode anything
    printed to stdout while the command runs goes to stderr, so stdout holds one document."""

    @functools.wraps(fn)
    def run(*args: Any, as_json: bool, **kwargs: Any) -> int:
        ui = Ui(as_json)
        settings = Settings.from_env()
        if not as_json:
            return fn(ui, settings, *args, **kwargs)
        with contextlib.redirect_stdout(sys.stderr):
            return fn(ui, settings, *args, **kwargs)

    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print one JSON document on stdout and nothing else (progress goes to stderr).",
    )(run)


def _topic_option(fn: Callable[..., int]) -> Callable[..., int]:
    return click.option("--topic", default="orders", show_default=True, help="topic in the spec")(
        fn
    )


def _range_options(fn: Callable[..., int]) -> Callable[..., int]:
    fn = click.option(
        "--end", required=True, help="end hour, ISO-8601 UTC (exclusive), e.g. 2026-06-01T05:00Z"
    )(fn)
    fn = click.option(
        "--start",
        required=True,
        help="first hour, ISO-8601 UTC (inclusive), e.g. 2026-06-01T01:00Z",
    )(fn)
    return _topic_option(fn)


# -- stack -------------------------------------------------------------------------------------


@cli.command("jars")
@click.argument("action", type=click.Choice(["resolve", "cds"]))
@_with_ui
def jars_command(ui: Ui, settings: Settings, action: str) -> int:
    """Resolve JVM artifacts from Maven Central (idempotent); ``cds`` builds the Spark driver's
    class-data-sharing archive from them (idempotent; exits 1 if it cannot, and Spark then
    starts without it)."""
    if action == "cds":
        from backfill_assets.stack import cds

        began = time.monotonic()
        try:
            with ui.spinner("building the Spark CDS archive (a small Spark workload, once)"):
                path, built = cds.build(settings)
        except cds.CdsError as err:
            ui.note(f"error: {err}")
            return 1
        state = f"built in {time.monotonic() - began:.0f}s" if built else "already built"
        ui.line(f"Spark driver CDS archive: {state} ({path})")
        ui.emit({"path": str(path), "built": built})
        return 0
    with ui.spinner("resolving jars"):
        resolved = _resolve_jars(settings)
    for jar_set, info in resolved.items():
        state = "resolved" if info["resolved"] else "already up to date"
        ui.line(f"{jar_set}: {state} ({info['dir']})")
    ui.emit(resolved)
    return 0


def _resolve_jars(settings: Settings) -> dict[str, dict[str, Any]]:
    resolved = {
        jar_set: {"resolved": ran, "dir": str(jars.jar_dir(settings, jar_set))}
        for jar_set, ran in jars.resolve_all(settings).items()
    }
    built = not jars.udf_jar_path(settings).is_file()
    resolved["udf"] = {"resolved": built, "dir": str(jars.udf_jar(settings).parent)}
    return resolved


@cli.command("kafka", short_help="Manage the embedded local Kafka broker (KRaft).")
@click.argument("action", type=click.Choice(["start", "stop", "status"]))
@_with_ui
def kafka_command(ui: Ui, settings: Settings, action: str) -> int:
    """Manage the embedded local Kafka broker (KRaft). ``status`` exits 1 when the broker does
    not answer."""
    broker = LocalBroker(settings)
    if action == "stop":
        stopped = broker.stop()
        ui.line("broker stopped" if stopped else "broker was not running")
        ui.emit({"stopped": stopped})
        return 0
    if action == "start":
        with ui.spinner("starting the broker"):
            status = broker.start()
    else:
        status = broker.status()
    ui.line(status.describe())
    ui.emit(asdict(status))
    return 0 if action == "start" or status.responding else 1


@cli.command("catalog")
@click.argument("action", type=click.Choice(["init"]))
@_with_ui
def catalog_command(ui: Ui, settings: Settings, action: str) -> int:
    """Create/show the Iceberg catalog and namespace."""
    cat = catalog.load(settings.catalog)
    namespace = settings.catalog.namespace
    cat.create_namespace_if_not_exists(namespace)
    tables = [".".join(t) for t in cat.list_tables(namespace)]
    ui.line(f"catalog {settings.catalog.name!r} ({settings.catalog.kind}) namespace {namespace!r}")
    ui.line(f"warehouse {settings.catalog.warehouse}")
    ui.line("tables: " + (", ".join(tables) if tables else "(none yet)"))
    ui.emit(
        {
            "catalog": settings.catalog.name,
            "kind": settings.catalog.kind,
            "namespace": namespace,
            "warehouse": settings.catalog.warehouse,
            "tables": tables,
        }
    )
    return 0


@cli.command("stack")
@click.argument("action", type=click.Choice(["up", "down", "status"]))
@_with_ui
def stack_command(ui: Ui, settings: Settings, action: str) -> int:
    """The whole local stack: jars, catalog, broker."""
    broker = LocalBroker(settings)
    if action == "down":
        stopped = broker.stop()
        ui.line("broker stopped" if stopped else "broker was not running")
        ui.emit({"stopped": stopped})
        return 0
    doc: dict[str, Any] = {}
    if action == "up":
        with ui.spinner("resolving jars"):
            doc["jars"] = _resolve_jars(settings)
        for jar_set, info in doc["jars"].items():
            state = "resolved" if info["resolved"] else "already up to date"
            ui.line(f"{jar_set}: {state} ({info['dir']})")
        catalog.init_local_catalog(settings.catalog)
        with ui.spinner("starting the broker"):
            status = broker.start()
    else:
        status = broker.status()
    ui.line(status.describe())
    doc["broker"] = asdict(status)
    ui.emit(doc)
    return 0


# -- demo data ---------------------------------------------------------------------------------


@cli.command("generate")
@_topic_option
@click.option("--partitions", type=int, default=6, show_default=True)
@click.option(
    "--hours", type=int, default=48, show_default=True, help="hours of back-dated history"
)
@click.option("--events-per-hour", type=int, default=600, show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--start",
    help="first hour (ISO-8601, UTC); default: the --hours hours that ended an hour before the "
    "current one",
)
@_with_ui
def generate_command(
    ui: Ui,
    settings: Settings,
    topic: str,
    partitions: int,
    hours: int,
    events_per_hour: int,
    seed: int,
    start: str | None,
) -> int:
    """Write deterministic demo history into Kafka."""
    from backfill_assets.demo.generator import GeneratorConfig, generate

    if start:
        first = _parse_hour(start, "--start")
    else:
        # The history ends an hour before the current hour: its last hour is then sealed at
        # once (an hour that ended less than BACKFILL_SEAL_GRACE_S ago, with no record after it,
        # is not), so a demo started at 10:02 can backfill all of it.
        now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        first = now - timedelta(hours=hours + 1)
    config = GeneratorConfig(
        topic=topic,
        partitions=partitions,
        start=first,
        hours=hours,
        events_per_hour=events_per_hour,
        seed=seed,
    )
    manifest = settings.home / "demo" / f"{topic}.ground-truth.json"
    with ui.progress(f"writing {topic}", None, "records") as update:
        truth = generate(settings, config, manifest_path=manifest, on_progress=update)
    totals = truth.totals
    ui.line(
        f"wrote {totals['records']} records to {topic!r} "
        f"({config.partitions} partitions, {config.hours} h from {first.isoformat()}): "
        + ", ".join(f"{k}={v}" for k, v in totals.items() if k != "records")
    )
    ui.line(f"ground truth: {manifest}")
    ui.emit(
        {
            "topic": topic,
            "partitions": config.partitions,
            "start": first.isoformat(),
            "hours": config.hours,
            "totals": totals,
            "ground_truth": str(manifest),
        }
    )
    return 0


# -- ranges ------------------------------------------------------------------------------------


def _specs() -> dict[str, TopicSpec]:
    """The topics of the spec Definitions load (read without building the Definitions)."""
    from backfill_assets.spec.loader import load_specs

    return {s.topic: s for s in load_specs()}


def _spec(topic: str) -> TopicSpec:
    specs = _specs()
    if topic not in specs:
        raise BackfillError(f"unknown topic {topic!r}; topics.yaml has: {', '.join(specs)}")
    return specs[topic]


def _kafka() -> KafkaClient:
    """The Kafka client the commands use (one place, so tests can shorten its timeout)."""
    from backfill_assets.stack.kafka import KafkaClient

    return KafkaClient()


def _ranges(
    spec: TopicSpec, start: datetime, end: datetime
) -> list[tuple[list[dg.AssetKey], datetime, datetime]]:
    """What a backfill of [start, end) materializes (:func:`planner.backfill_ranges`)."""
    from backfill_assets.ops.planner import backfill_ranges

    return backfill_ranges(spec, start, end)


def _topic_range(topic: str, start: str, end: str) -> tuple[TopicSpec, datetime, datetime]:
    first, stop = _parse_hour(start, "--start"), _parse_hour(end, "--end")
    spec = _spec(topic)
    if stop <= first:
        raise BackfillError("--end must be after --start (the range is [start, end))")
    if first < spec.partition_start:
        raise BackfillError(
            f"--start {first.isoformat()} is before the first partition of {topic!r} "
            f"({spec.partition_start.isoformat()})"
        )
    if stop > datetime.now(UTC).replace(minute=0, second=0, microsecond=0):
        raise BackfillError(
            f"--end {stop.isoformat()} is in an hour that has not closed yet; "
            "backfill only hours that have ended"
        )
    return spec, first, stop


def _hours(first: datetime, stop: datetime) -> int:
    return int((stop - first) / timedelta(hours=1))


@cli.command("materialize", short_help="Materialize a range of a topic's tables in-process.")
@_range_options
@_with_ui
def materialize_command(ui: Ui, settings: Settings, topic: str, start: str, end: str) -> int:
    """Materialize a Kafka-time range of a topic's tables in this process.

    Runs on the Dagster instance of $DAGSTER_HOME (the runs show in the UI), in dependency
    order: raw and current-state tables cover [start, end); each declared table covers the
    event-time hours whose events have all arrived within the range. Exits 1 if a run fails.
    """
    from backfill_assets.defs.definitions import defs

    spec, first_hour, end_hour = _topic_range(topic, start, end)
    plan = _ranges(spec, first_hour, end_hour)
    instance = dg.DagsterInstance.get()
    job = defs.resolve_implicit_global_asset_job_def()
    total = sum(_hours(first, stop) * len(keys) for keys, first, stop in plan)
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
                },
                raise_on_error=False,
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
                ui.emit({"topic": spec.topic, "succeeded": False, "runs": runs})
                ui.note(f"error: run {result.run_id} failed; see it in the Dagster UI")
                return 1
            done += _hours(first, stop) * len(keys)
            update(done, None)
            ui.line(f"run {result.run_id} succeeded")
    ui.emit({"topic": spec.topic, "succeeded": True, "runs": runs})
    return 0


# -- archive -----------------------------------------------------------------------------------


@cli.command("archive", short_help="Copy new records of a topic to the archive now.")
@_topic_option
@click.option("--status", is_flag=True, help="show what is archived; copy nothing")
@_with_ui
def archive_command(ui: Ui, settings: Settings, topic: str, status: bool) -> int:
    """Copy new records of a topic to the archive now (--status: show what is archived)."""
    from backfill_assets.lake.archive import Archive
    from backfill_assets.lake.archiver import run_archiver
    from backfill_assets.stack.catalog import CatalogClient

    specs = _specs()
    spec = specs.get(topic)
    if spec is None:
        raise BackfillError(f"unknown topic {topic!r}; topics.yaml defines: {', '.join(specs)}")
    kafka = _kafka()
    if status:
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
        table = _table(
            "partition",
            "archived offsets",
            "Kafka holds",
            title=f"archive {settings.archive_uri} of topic {spec.topic!r}",
        )
        for p, st in parts.items():
            low, high = st["kafka"]
            cov = ", ".join(f"[{a}, {b})" for a, b in st["archived"]) or "nothing"
            _row(table, f"p{p}", cov, f"[{low}, {high})")
        ui.table(table)
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
    table = _table("partition", "offsets", "records", "lost before archiving")
    for r in runs:
        lost = f"[{r.lost[0]}, {r.lost[1]})" if r.lost is not None else ""
        _row(table, f"p{r.partition}", f"[{r.start}, {r.end})", f"{r.records:,}", lost)
    ui.table(table)
    return 0


# -- maintenance -------------------------------------------------------------------------------


@cli.command(
    "maintain",
    short_help="Drop failed runs' branches, compact, expire snapshots, remove orphan files.",
)
@click.option(
    "--table",
    "tables",
    multiple=True,
    help="a table of the spec, or 'bookkeeping' (repeatable; default: every table)",
)
@_with_ui
def maintain_command(ui: Ui, settings: Settings, tables: tuple[str, ...]) -> int:
    """One maintenance pass per table, as the scheduled maintain_* jobs run it (retentions:
    BACKFILL_MAINTENANCE_*; infra/README.md). Each pass is appended to the audit table.
    Exits 1 if a step failed (the others still ran)."""
    from backfill_assets.defs.maintenance import maintenance_targets
    from backfill_assets.lake import maintenance
    from backfill_assets.stack import spark as spark_mod

    targets = maintenance_targets(list(_specs().values()))
    known = {name: target for target in targets for name in (target.name, *target.tables)}
    unknown = [t for t in tables if t not in known]
    if unknown:
        raise BackfillError(
            f"unknown table(s) {', '.join(map(repr, unknown))}; maintainable: "
            + ", ".join(sorted(known))
        )
    chosen = [known[t] for t in dict.fromkeys(tables)] if tables else targets
    names = list(dict.fromkeys(table for target in chosen for table in target.tables))
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
            except maintenance.MaintenanceError as exc:
                failures.append(str(exc))
                ui.note(f"error: {exc}")
                continue
            finally:
                update(done + 1, None)
            reports[table] = report.as_dict()
            ui.line(report.summary())
    ui.emit({"tables": reports, "failed": failures})
    return 1 if failures else 0


# -- plan, backfill ----------------------------------------------------------------------------


@cli.command("plan", short_help="Replay contract, duration, cost and readiness of a range.")
@_range_options
@click.option("--window", help="time available, e.g. 90m, 6h, 2d")
@_with_ui
def plan_command(
    ui: Ui, settings: Settings, topic: str, start: str, end: str, window: str | None
) -> int:
    """Replay contract, duration, cost and readiness of a range. Exits 1 when a score is red."""
    from backfill_assets.ops.planner import make_plan

    spec, first, stop = _topic_range(topic, start, end)
    available = _parse_duration(window) if window else None
    instance = dg.DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else None
    plan = make_plan(
        _kafka(),
        spec,
        first,
        stop,
        instance=instance,
        concurrency=_backfill_concurrency(),
        window=available,
    )
    ui.emit(json.loads(plan.to_json()))
    if not ui.json:
        title, facts = _plan_facts(plan.human())
        ui.line(title)
        ui.table(facts)
        scores = _table("score", "dimension", "reason", title="readiness")
        for s in plan.scorecard:
            _row(scores, s.color, s.dimension, s.reason)
        ui.table(scores)
    return 0 if all(s.color != "red" for s in plan.scorecard) else 1


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
    table = _table("", "")
    table.show_header = False
    for key, value in rows:
        _row(table, key, value)
    return lines[0], table


@cli.command("backfill", short_help="Launch a Dagster partition backfill (as the UI does).")
@_range_options
@click.option("--wait", is_flag=True, help="show progress until it ends")
@click.option("--timeout", type=float, help="seconds to wait at most")
@click.option("--webserver", help="webserver URL (default from BACKFILL_WEBSERVER_*)")
@click.option(
    "--as-backfill",
    is_flag=True,
    help="a backfill object even for one hour (by default one hour is one run, as the UI's "
    "Materialize launches it: it skips the backfill daemon's pass of up to 30 s)",
)
@_with_ui
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
) -> int:
    """Launch a Dagster partition backfill (as the UI does); a single hour is launched as one run
    unless --as-backfill. With --wait, exits 1 unless every asset partition succeeded."""
    from backfill_assets.ops import launch

    spec, first_hour, end_hour = _topic_range(topic, start, end)
    last = end_hour - timedelta(hours=1)
    ranges = [
        (key, first, stop - timedelta(hours=1))
        for keys, first, stop in _ranges(spec, first_hour, end_hour)
        for key in keys
    ]
    client = launch.DagsterClient(
        webserver or f"http://{settings.webserver_host}:{settings.webserver_port}"
    )
    title = f"{spec.topic} {first_hour:{PARTITION_FMT}}..{last:{PARTITION_FMT}}"
    keyed = [
        (key, f"{first:{PARTITION_FMT}}", f"{stop:{PARTITION_FMT}}") for key, first, stop in ranges
    ]
    tags = {"backfill_assets/launched_by": f"cli:{getpass.getuser()}"}
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
    for r in doc["ranges"]:
        ui.line(f"launched {kind} {launched_id}: {r['asset']} {r['first']}...{r['last']}")
    if not wait:
        ui.line(f"follow it in the Dagster UI ({where}) or re-run with --wait")
        ui.emit(doc)
        return 0
    final = _watch_backfill(ui, client, kind, launched_id, len(keyed), timeout)
    doc["progress"] = {**asdict(final), "succeeded": final.succeeded}
    ui.emit(doc)
    ui.line(f"{kind} {launched_id}: {_backfill_line(final)}")
    if not final.succeeded:
        ui.note(
            f"error: {kind} {launched_id} ended {final.status} with {final.failed} failed "
            f"asset partition(s); open it in the Dagster UI ({where}) for the failed checks and "
            f"runs, then `backfill-assets audit {audit_flag} {launched_id}`"
        )
        return 1
    return 0


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
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("partitions"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[detail]}"),
        console=ui.err,
    ) as bar:
        task = bar.add_task(launched_id, total=None, detail="")

        def show(p: BackfillProgress) -> None:
            bar.update(
                task,
                total=p.targeted or None,
                completed=p.done,
                detail=f"{p.failed} failed, {p.records:,} records, {p.rate:,.0f} rec/s, {p.status}",
            )

        return follow(show)


# -- audit, rollback ---------------------------------------------------------------------------


@cli.command("audit")
@click.option("--table", help="table name, e.g. raw_orders")
@click.option("--run", help="a Dagster run id")
@click.option("--backfill", help="a Dagster backfill id")
@click.option("--limit", type=int, default=50, show_default=True)
@_with_ui
def audit_command(
    ui: Ui,
    settings: Settings,
    table: str | None,
    run: str | None,
    backfill: str | None,
    limit: int,
) -> int:
    """Query the audit table, newest first."""
    from backfill_assets.lake import audit

    rows = audit.query(
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        table_name=_full_table(table, settings) if table else None,
        run_id=run,
        backfill_id=backfill,
        limit=limit,
    )
    ui.emit(rows)
    if not rows:
        ui.line("no audit rows match")
        return 0
    out = _table(
        "finished (UTC)",
        "event",
        "outcome",
        "table",
        "window",
        "run",
        "backfill",
        "by",
        "snapshot before -> after",
        "detail",
    )
    for r in rows:
        window = (
            f"{r['window_start']:%Y-%m-%dT%H:%M}..{r['window_end']:%Y-%m-%dT%H:%MZ}"
            if r["window_start"]
            else None
        )
        _row(
            out,
            f"{r['finished_at']:%Y-%m-%d %H:%M:%S}",
            r["event"],
            r["outcome"],
            r["table_name"],
            window,
            r["run_id"],
            r["backfill_id"],
            r["launched_by"],
            f"{r['snapshot_before']} -> {r['snapshot_after']}",
            r["detail"] or "",
        )
    ui.table(out)
    return 0


@cli.command("rollback", short_help="Restore tables to their snapshot before a run/backfill.")
@click.option("--run", help="a Dagster run id")
@click.option("--backfill", help="a Dagster backfill id")
@click.option("--table", help="only this table (default: every table it published to)")
@click.option("--force", is_flag=True, help="also discard later publishes")
@click.option(
    "--dry-run", is_flag=True, help="show what would be restored; change nothing, anywhere"
)
@_with_ui
def rollback_command(
    ui: Ui,
    settings: Settings,
    run: str | None,
    backfill: str | None,
    table: str | None,
    force: bool,
    dry_run: bool,
) -> int:
    """Restore tables to their snapshot before a run or a backfill (give --run or --backfill).

    One atomic commit per table; refused if later publishes by other runs would be lost,
    unless --force. What was undone is then recorded in the Dagster instance of $DAGSTER_HOME,
    per asset partition.
    """
    from backfill_assets.lake.rollback import plan_rollback, rollback

    if (run is None) == (backfill is None):
        raise click.UsageError("give exactly one of --run RUN_ID or --backfill BACKFILL_ID")
    full = _full_table(table, settings) if table else None
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    what = f"run {run}" if run else f"backfill {backfill}"
    if dry_run:
        results = plan_rollback(
            cat, ns, run_id=run, backfill_id=backfill, table_name=full, force=force
        )
        ui.emit({"dry_run": True, "rollback_of": what, "tables": [r.to_json() for r in results]})
        ui.line(f"dry run: nothing was changed. Rolling back {what} would:")
        _show_rollback(ui, results)
        return 0
    results = rollback(
        cat,
        ns,
        run_id=run,
        backfill_id=backfill,
        table_name=full,
        force=force,
        launched_by=f"cli:{getpass.getuser()}",
    )
    dagster = _report_rollback(results, what=what, backfill_id=backfill)
    ui.emit(
        {
            "dry_run": False,
            "rollback_of": what,
            "tables": [r.to_json() for r in results],
            "dagster": dagster,
        }
    )
    for r in results:
        ui.line(
            f"rolled back {r.table_name}: main {r.snapshot_before} -> {r.restored_snapshot} "
            f"(undid {', '.join(r.undone_runs)}"
            + (f"; discarded {', '.join(r.discarded_later_runs)}" if r.discarded_later_runs else "")
            + ")"
        )
    _show_stale_readers(ui, results)
    if dagster["recorded"]:
        ui.line(
            f"Dagster ({dagster['dagster_home']}): recorded {dagster['materializations']} "
            f"partition(s) restored to an earlier run as materializations and "
            f"{dagster['observations']} partition(s) left without rows as observations"
        )
    else:
        ui.note(f"warning: {dagster['reason']}")
    return 0


def _show_rollback(ui: Ui, results: list[RollbackResult]) -> None:
    """Per table: main's snapshot now and after, the runs undone; then per range of hours what
    the table holds for them afterwards."""
    tables = _table(
        "table", "main now", "restored snapshot", "undoes runs", "also discards", "partitions"
    )
    parts = _table("table", "partitions (hours, UTC)", "afterwards")
    for r in results:
        _row(
            tables,
            r.table_name,
            r.snapshot_before,
            r.restored_snapshot,
            ", ".join(r.undone_runs),
            ", ".join(r.discarded_later_runs),
            len(r.partitions),
        )
        for first, last, run, snap in _hour_ranges(r):
            span = f"{first:%Y-%m-%dT%H:%MZ}" + (
                f"..{last:%Y-%m-%dT%H:%MZ}" if last > first else ""
            )
            after = (
                f"rows of run {run} (snapshot {snap})" if run else "no rows (no earlier publish)"
            )
            _row(parts, r.table_name, span, after)
    ui.table(tables)
    ui.table(parts)
    _show_stale_readers(ui, results)


def _show_stale_readers(ui: Ui, results: list[RollbackResult]) -> None:
    """The hours of other tables built from what the rollback undoes: due again after it."""
    readers = _table("rolled back", "table that read it", "hours due again (UTC)")
    for r in results:
        for stale in r.stale_readers:
            spans = [
                f"{first:%Y-%m-%dT%H:%MZ}" + (f"..{last:%Y-%m-%dT%H:%MZ}" if last > first else "")
                for first, last in _consecutive(stale.hours)
            ]
            _row(readers, r.table_name, stale.table_name, ", ".join(spans))
    if readers.row_count:
        ui.table(readers)


def _consecutive(hours: list[datetime]) -> list[tuple[datetime, datetime]]:
    out: list[tuple[datetime, datetime]] = []
    for h in sorted(hours):
        if out and out[-1][1] + timedelta(hours=1) == h:
            out[-1] = (out[-1][0], h)
        else:
            out.append((h, h))
    return out


def _hour_ranges(r: RollbackResult) -> list[tuple[datetime, datetime, str | None, int | None]]:
    """Consecutive hours restored to the same earlier publish (or to none), as ranges."""
    out: list[tuple[datetime, datetime, str | None, int | None]] = []
    for h in r.partitions:
        if (
            out
            and out[-1][1] + timedelta(hours=1) == h.hour
            and (out[-1][2], out[-1][3]) == (h.restored_run, h.restored_snapshot)
        ):
            out[-1] = (out[-1][0], h.hour, h.restored_run, h.restored_snapshot)
        else:
            out.append((h.hour, h.hour, h.restored_run, h.restored_snapshot))
    return out


def _asset_keys() -> dict[str, dg.AssetKey]:
    """Table (short name) -> the asset that materializes it."""
    from backfill_assets.defs.assets import current_asset_key, raw_asset_key, table_asset_key
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.spec import declared

    keys = {}
    for spec in SPECS:
        keys[spec.raw_table] = raw_asset_key(spec)
        keys[spec.current_table] = current_asset_key(spec)
    for t in declared.ordered(SPECS):
        keys[t.name] = table_asset_key(t.name)
    return keys


def _report_rollback(
    results: list[RollbackResult], *, what: str, backfill_id: str | None
) -> dict[str, Any]:
    """Record in the Dagster instance ($DAGSTER_HOME) what a rollback undid, per asset
    partition, so the UI stops presenting the undone materializations as the current data.

    * A partition an earlier publish covers again gets a runless ``AssetMaterialization``: the
      partition stays materialized (it has rows) and its latest materialization, the one the
      UI shows, now names the rollback, the run whose rows the table holds again and its
      snapshot, instead of the undone run. No asset here has an automation condition, so the
      event starts no run; downstream assets show as changed upstream, which they are.
    * A partition no publish covers any more gets an ``AssetObservation`` naming the rollback.
      Marking it missing would need ``DagsterInstance.wipe_asset_partitions``, which exists in
      dagster 1.13.27 but raises NotImplementedError on the SQL event log storages (SQLite,
      Postgres) this project runs on; a whole-asset wipe would erase every other partition's
      history. The gap sensor and ``backfill-assets gaps`` read the ledger, so they do list it.

    Never raises: the rollback has happened; a failure here is reported, not fatal.
    """
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return {
            "recorded": False,
            "reason": "DAGSTER_HOME is not set, so the rollback was not recorded in Dagster: "
            "its UI still shows the undone materializations as current. Set DAGSTER_HOME to "
            "the instance the runs used (the repository root for the demo) next time.",
        }
    counts = {"materializations": 0, "observations": 0}
    try:
        keys = _asset_keys()
        with dg.DagsterInstance.get() as instance:
            for r in results:
                key = keys.get(r.table_name.rsplit(".", 1)[-1])
                if key is None:
                    continue
                base: dict[str, Any] = {
                    "rollback_of": what,
                    "table": r.table_name,
                    "restored_snapshot": r.restored_snapshot,
                    "snapshot_before_rollback": r.snapshot_before,
                    "undone_runs": ", ".join([*r.undone_runs, *r.discarded_later_runs]),
                }
                if backfill_id:
                    base["undone_backfill"] = backfill_id
                for h in r.partitions:
                    partition = f"{h.hour:{PARTITION_FMT}}"
                    if h.restored_run is not None:
                        instance.report_runless_asset_event(
                            dg.AssetMaterialization(
                                asset_key=key,
                                partition=partition,
                                description=f"rolled back ({what}): the table holds the rows "
                                f"of run {h.restored_run} again",
                                metadata={
                                    **base,
                                    "restored_run": dg.MetadataValue.dagster_run(h.restored_run),
                                    "published_snapshot": h.restored_snapshot,
                                },
                            )
                        )
                        counts["materializations"] += 1
                    else:
                        instance.report_runless_asset_event(
                            dg.AssetObservation(
                                asset_key=key,
                                partition=partition,
                                description=f"rolled back ({what}): no rows for this hour any "
                                "more; no earlier publish covered it",
                                metadata={**base, "rows": "none since the rollback"},
                            )
                        )
                        counts["observations"] += 1
    except Exception as exc:
        return {
            "recorded": False,
            "reason": f"the rollback is done, but recording it in the Dagster instance at "
            f"{home} failed ({type(exc).__name__}: {exc}); the UI still shows the undone "
            "materializations as current",
            **counts,
        }
    return {"recorded": True, "dagster_home": home, **counts}


# -- gaps --------------------------------------------------------------------------------------


@cli.command("gaps", short_help="What the gap and late-data sensors see, with fill commands.")
@_topic_option
@click.option(
    "--horizon-hours", type=int, default=24, show_default=True, help="retention warning horizon"
)
@_with_ui
def gaps_command(ui: Ui, settings: Settings, topic: str, horizon_hours: int) -> int:
    """What the gap and late-data sensors see, with fill commands. Exits 1 if anything is due."""
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.lake import detect

    spec = _spec(topic)
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    found = detect.find(
        _kafka(),
        cat,
        ns,
        spec,
        specs=SPECS,
        retention_horizon=timedelta(hours=horizon_hours),
    )
    late = detect.late_event_hours(cat, ns, spec)
    hour = timedelta(hours=1)

    def ranges(hours: list[datetime]) -> list[dict[str, str]]:
        out = []
        for first, last in detect.contiguous(hours, 168):
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

    raw_gaps, current_gaps = ranges(found.raw_gaps), ranges(found.current_gaps)
    tables_due = {
        name: {h.isoformat(): why for h, why in sorted(due.items())}
        for name, due in found.tables_due.items()
        if due
    }
    late_hours = {
        name: {h.isoformat(): why for h, why in sorted(due.items())} for name, due in late.items()
    }
    risks = found.retention_risks
    ui.emit(
        {
            "topic": spec.topic,
            "raw_gaps": raw_gaps,
            "current_gaps": current_gaps,
            "tables_due": tables_due,
            "late_event_hours": late_hours,
            "retention_risks": risks,
        }
    )
    counts = {
        "raw_gaps": len(raw_gaps),
        "current_gaps": len(current_gaps),
        "tables_due": sum(len(d) for d in tables_due.values()),
        "late_event_hours": sum(len(d) for d in late_hours.values()),
        f"retention risks (within {horizon_hours} h)": len(risks),
    }
    ui.line(f"topic {spec.topic!r}: Kafka hours checked up to {found.closed_until}")
    ui.line(", ".join(f"{k}: {v or 'none'}" for k, v in counts.items()))
    table = _table("finding", "table", "hours (UTC)", "why / fill command")
    for kind, name, gaps in (
        ("raw gap", spec.raw_table, raw_gaps),
        ("current gap", spec.current_table, current_gaps),
    ):
        for g in gaps:
            _row(table, kind, name, f"{g['start']} .. {g['end']}", g["fill"])
    for kind, per_table in (("table due", tables_due), ("late events", late_hours)):
        for name, due in per_table.items():
            for h, why in due.items():
                _row(table, kind, name, h, why)
    for r in risks:
        archived = "archived" if r["archived"] else "NOT archived"
        _row(
            table,
            "retention risk",
            spec.raw_table,
            r["hour"],
            f"leaves Kafka at {r['leaves_kafka_at']}, offsets {r['offsets']} ({archived})",
        )
    if table.rows:
        ui.table(table)
    empty = not (found.raw_gaps or found.current_gaps or tables_due or late)
    return 0 if empty else 1


# -- helpers -----------------------------------------------------------------------------------


def _full_table(name: str, settings: Settings) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return f"{settings.catalog.name}.{settings.catalog.namespace}.{name}"
    if len(parts) == 2:
        return f"{settings.catalog.name}.{name}"
    return name


def _backfill_concurrency() -> int:
    """The run-queue limit for backfill runs, from the instance's dagster.yaml."""
    home = os.environ.get("DAGSTER_HOME")
    path = Path(home) / "dagster.yaml" if home else None
    if path is None or not path.is_file():
        return 1
    doc = yaml.safe_load(path.read_text()) or {}
    limits = doc.get("concurrency", {}).get("runs", {}).get("tag_concurrency_limits", [])
    for limit in limits:
        if limit.get("key") == "dagster/backfill":
            return int(limit.get("limit", 1))
    return int(doc.get("concurrency", {}).get("runs", {}).get("max_concurrent_runs", 1))


def _parse_duration(text: str) -> timedelta:
    units = {"m": 60, "h": 3600, "d": 86400}
    if len(text) < 2 or text[-1] not in units or not text[:-1].isdigit():
        raise BackfillError(f"--window {text!r} is not a duration; use e.g. 90m, 6h or 2d")
    return timedelta(seconds=int(text[:-1]) * units[text[-1]])


def _parse_hour(text: str, flag: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise BackfillError(
            f"{flag} {text!r} is not an ISO-8601 time; use e.g. 2026-01-01T00:00:00+00:00"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    if value.minute or value.second or value.microsecond:
        raise BackfillError(f"{flag} {text!r} must be on a whole hour, e.g. 2026-01-01T05:00Z")
    return value.astimezone(UTC)


def main(argv: list[str] | None = None) -> int:
    """The console script: run one command, return its exit status (2: anticipated failure or
    wrong arguments; 1: the command's own "not OK", e.g. a red plan or a failed backfill)."""
    # Dagster flags beta parameters (backfill_policy) on every load; operators need not see it.
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    warnings.filterwarnings("ignore", category=dg.PreviewWarning)
    try:
        result = cli.main(args=argv, prog_name="backfill-assets", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
