"""``backfill-assets``: the operator's command line.

Every failure the project anticipates is a :class:`~backfill_assets.errors.BackfillError`
whose message says what to run next; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import warnings
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from backfill_assets.errors import BackfillError
from backfill_assets.lake.spec import TopicSpec
from backfill_assets.stack import catalog, jars
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.settings import Settings


def _cmd_jars(args: argparse.Namespace, settings: Settings) -> int:
    for jar_set, ran in jars.resolve_all(settings).items():
        state = "resolved" if ran else "already up to date"
        print(f"{jar_set}: {state} ({jars.jar_dir(settings, jar_set)})")
    return 0


def _cmd_kafka(args: argparse.Namespace, settings: Settings) -> int:
    broker = LocalBroker(settings)
    if args.action == "start":
        print(broker.start().describe())
    elif args.action == "stop":
        print("broker stopped" if broker.stop() else "broker was not running")
    else:
        status = broker.status()
        print(json.dumps(status.__dict__) if args.json else status.describe())
        return 0 if status.responding else 1
    return 0


def _cmd_catalog(args: argparse.Namespace, settings: Settings) -> int:
    cat = catalog.load(settings.catalog)
    namespace = settings.catalog.namespace
    cat.create_namespace_if_not_exists(namespace)
    tables = [".".join(t) for t in cat.list_tables(namespace)]
    print(f"catalog {settings.catalog.name!r} ({settings.catalog.kind}) namespace {namespace!r}")
    print(f"warehouse {settings.catalog.warehouse}")
    print("tables: " + (", ".join(tables) if tables else "(none yet)"))
    return 0


def _cmd_stack(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "up":
        _cmd_jars(args, settings)
        catalog.init_local_catalog(settings.catalog)
        print(LocalBroker(settings).start().describe())
    elif args.action == "down":
        print("broker stopped" if LocalBroker(settings).stop() else "broker was not running")
    else:
        print(LocalBroker(settings).status().describe())
    return 0


def _cmd_generate(args: argparse.Namespace, settings: Settings) -> int:
    from backfill_assets.demo.generator import GeneratorConfig, generate

    if args.start:
        start = _parse_hour(args.start, "--start")
    else:
        now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        start = now - timedelta(hours=args.hours)
    config = GeneratorConfig(
        topic=args.topic,
        partitions=args.partitions,
        start=start,
        hours=args.hours,
        events_per_hour=args.events_per_hour,
        seed=args.seed,
    )
    manifest = settings.home / "demo" / f"{args.topic}.ground-truth.json"
    truth = generate(settings, config, manifest_path=manifest)
    totals = truth.totals
    print(
        f"wrote {totals['records']} records to {args.topic!r} "
        f"({config.partitions} partitions, {config.hours} h from {start.isoformat()}): "
        + ", ".join(f"{k}={v}" for k, v in totals.items() if k != "records")
    )
    print(f"ground truth: {manifest}")
    return 0


def _ranges(
    spec: TopicSpec, start: datetime, end: datetime
) -> list[tuple[list[dg.AssetKey], datetime, datetime]]:
    """What a backfill of Kafka hours [start, end) materializes, in dependency order: the raw
    and current-state tables over [start, end); each declared table over the event-time hours
    whose inputs all arrived within the range: [start, end - lateness) for a table reading a
    topic, the hours its declared inputs cover for one reading declared tables."""
    from backfill_assets.defs.assets import current_asset_key, raw_asset_key, table_asset_key
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.lake import declared

    known = declared.relations(SPECS)
    settled: dict[str, datetime] = {}
    out = [([raw_asset_key(spec), current_asset_key(spec)], start, end)]
    for table in declared.ordered(SPECS):
        ends = [
            settled.get(ref, end)
            if known[ref].kind == "table"
            else end - timedelta(hours=table.lateness_hours)
            for ref in table.refs
        ]
        settled[table.name] = min(ends, default=end)
        if table.topic == spec.topic and settled[table.name] > start:
            out.append(([table_asset_key(table.name)], start, settled[table.name]))
    return out


def _cmd_materialize(args: argparse.Namespace, settings: Settings) -> int:
    """Materialize a Kafka-time range of one topic's tables in this process, on the Dagster
    instance of $DAGSTER_HOME (the run shows in the UI), in dependency order. Raw and
    current-state tables cover [start, end); each declared table covers the event-time hours
    whose events have all arrived within the range (see :func:`_ranges`)."""
    from backfill_assets.defs.definitions import defs

    spec, start, end = _topic_range(args)
    plan = _ranges(spec, start, end)
    instance = dg.DagsterInstance.get()
    job = defs.resolve_implicit_global_asset_job_def()
    for keys, first, stop in plan:
        last = stop - timedelta(hours=1)
        fmt = "%Y-%m-%d-%H:%M"
        print(
            f"materializing {', '.join(k.to_user_string() for k in keys)} "
            f"{first:{fmt}}...{last:{fmt}}"
        )
        result = job.execute_in_process(
            instance=instance,
            asset_selection=keys,
            tags={
                "dagster/asset_partition_range_start": f"{first:{fmt}}",
                "dagster/asset_partition_range_end": f"{last:{fmt}}",
            },
            raise_on_error=False,
        )
        if not result.success:
            print(f"error: run {result.run_id} failed; see it in the Dagster UI", file=sys.stderr)
            return 1
        print(f"run {result.run_id} succeeded")
    return 0


def _cmd_archive(args: argparse.Namespace, settings: Settings) -> int:
    """Copy new records of a topic to the archive now (``--status``: show what is archived)."""
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.defs.resources import IcebergResource, KafkaResource
    from backfill_assets.lake.archive import Archive
    from backfill_assets.lake.archiver import run_archiver

    spec = next((s for s in SPECS if s.topic == args.topic), None)
    if spec is None:
        raise BackfillError(
            f"unknown topic {args.topic!r}; topics.yaml defines: "
            + ", ".join(s.topic for s in SPECS)
        )
    kafka = KafkaResource()
    if args.status:
        store = Archive(settings)
        marks = kafka.watermarks(spec.topic)
        status: dict[str, dict[str, list[Any]]] = {
            str(p): {
                "archived": [list(c) for c in store.coverage(spec.topic, p)],
                "kafka": list(marks[p]),
            }
            for p in sorted(marks)
        }
        if args.json:
            print(json.dumps({"archive_uri": settings.archive_uri, "partitions": status}))
        else:
            print(f"archive {settings.archive_uri} of topic {spec.topic!r}")
            for p, st in status.items():
                cov = ", ".join(f"[{a}, {b})" for a, b in st["archived"]) or "nothing"
                low, high = st["kafka"]
                print(f"  p{p}: archived {cov}; Kafka holds [{low}, {high})")
        return 0
    runs, summary = run_archiver(kafka, IcebergResource(), spec, launched_by="cli")
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"archived {summary['records']:,} records of {spec.topic!r} in {summary['files']} "
        f"files to {summary['archive_uri']}"
    )
    for r in runs:
        line = f"  p{r.partition}: [{r.start}, {r.end}) {r.records:,} records"
        if r.lost is not None:
            line += f"; LOST before archiving: [{r.lost[0]}, {r.lost[1]})"
        print(line)
    return 0


def _topic_range(args: argparse.Namespace) -> tuple[TopicSpec, datetime, datetime]:
    from backfill_assets.defs.definitions import SPECS

    specs = {s.topic: s for s in SPECS}
    if args.topic not in specs:
        raise BackfillError(f"unknown topic {args.topic!r}; topics.yaml has: {', '.join(specs)}")
    spec = specs[args.topic]
    start, end = _parse_hour(args.start, "--start"), _parse_hour(args.end, "--end")
    if end <= start:
        raise BackfillError("--end must be after --start (the range is [start, end))")
    if start < spec.partition_start:
        raise BackfillError(
            f"--start {start.isoformat()} is before the first partition of {args.topic!r} "
            f"({spec.partition_start.isoformat()})"
        )
    if end > datetime.now(UTC).replace(minute=0, second=0, microsecond=0):
        raise BackfillError(
            f"--end {end.isoformat()} is in an hour that has not closed yet; "
            "backfill only hours that have ended"
        )
    return spec, start, end


def _cmd_plan(args: argparse.Namespace, settings: Settings) -> int:

    from backfill_assets.defs.resources import KafkaResource
    from backfill_assets.ops.planner import make_plan

    spec, start, end = _topic_range(args)
    instance = dg.DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else None
    plan = make_plan(
        KafkaResource(),
        spec,
        start,
        end,
        instance=instance,
        concurrency=_backfill_concurrency(),
        window=_parse_duration(args.window) if args.window else None,
    )
    print(plan.to_json() if args.json else plan.human())
    return 0 if all(s.color != "red" for s in plan.scorecard) else 1


def _cmd_backfill(args: argparse.Namespace, settings: Settings) -> int:
    from backfill_assets.ops import launch

    spec, start, end = _topic_range(args)
    fmt = "%Y-%m-%d-%H:%M"
    last = end - timedelta(hours=1)
    ranges = [
        (key, first, stop - timedelta(hours=1))
        for keys, first, stop in _ranges(spec, start, end)
        for key in keys
    ]
    client = launch.DagsterClient(
        args.webserver or f"http://{settings.webserver_host}:{settings.webserver_port}"
    )
    tags = {"backfill_assets/launched_by": f"cli:{getpass.getuser()}"}
    backfill_id = launch.launch_backfill(
        client,
        [(key, f"{first:{fmt}}", f"{stop:{fmt}}") for key, first, stop in ranges],
        tags,
        title=f"{spec.topic} {start:{fmt}}..{last:{fmt}}",
    )
    for key, first, stop in ranges:
        print(
            f"launched backfill {backfill_id}: {key.to_user_string()} {first:{fmt}}...{stop:{fmt}}"
        )
    if not args.wait:
        print("follow it in the Dagster UI (Overview -> Backfills) or re-run with --wait")
        return 0
    final = launch.wait(
        client, backfill_id, timeout_s=args.timeout, on_progress=_printer(backfill_id)
    )
    print()
    if not final.succeeded:
        print(
            f"error: backfill {backfill_id} ended {final.status} with {final.failed} failed "
            "asset partition(s); open it in the Dagster UI for the failed checks and runs, then "
            f"`backfill-assets audit --backfill {backfill_id}`",
            file=sys.stderr,
        )
        return 1
    return 0


def _printer(backfill_id: str) -> Callable[[Any], None]:
    tty = sys.stdout.isatty()
    last: list[str] = [""]

    def show(progress: Any) -> None:
        line = f"{backfill_id} {progress.line()}"
        if tty:
            print("\r" + line, end="", flush=True)
        elif line != last[0]:
            print(line, flush=True)
        last[0] = line

    return show


def _cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from backfill_assets.lake import audit

    rows = audit.query(
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        table_name=_full_table(args.table, settings) if args.table else None,
        run_id=args.run,
        backfill_id=args.backfill,
        limit=args.limit,
    )
    if args.json:
        print(json.dumps(rows, default=str, indent=2))
        return 0
    if not rows:
        print("no audit rows match")
        return 0
    for r in rows:
        window = (
            f"{r['window_start']:%Y-%m-%dT%H:%M}..{r['window_end']:%Y-%m-%dT%H:%MZ}"
            if r["window_start"]
            else "-"
        )
        print(
            f"{r['finished_at']:%Y-%m-%d %H:%M:%S} {r['event']:<15} {r['outcome']:<11} "
            f"{r['table_name']} {window} run={r['run_id'] or '-'} "
            f"backfill={r['backfill_id'] or '-'} by={r['launched_by'] or '-'} "
            f"snapshot {r['snapshot_before']} -> {r['snapshot_after']}"
            + (f"\n    {r['detail']}" if r["detail"] else "")
        )
    return 0


def _cmd_rollback(args: argparse.Namespace, settings: Settings) -> int:
    from backfill_assets.lake.rollback import rollback

    results = rollback(
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        run_id=args.run,
        backfill_id=args.backfill,
        table_name=_full_table(args.table, settings) if args.table else None,
        force=args.force,
        launched_by=f"cli:{getpass.getuser()}",
    )
    for r in results:
        print(
            f"rolled back {r.table_name}: main {r.snapshot_before} -> {r.restored_snapshot} "
            f"(undid {', '.join(r.undone_runs)}"
            + (f"; discarded {', '.join(r.discarded_later_runs)}" if r.discarded_later_runs else "")
            + ")"
        )
    return 0


def _cmd_gaps(args: argparse.Namespace, settings: Settings) -> int:
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.defs.resources import KafkaResource
    from backfill_assets.lake import detect

    specs = {s.topic: s for s in SPECS}
    if args.topic not in specs:
        raise BackfillError(f"unknown topic {args.topic!r}; topics.yaml has: {', '.join(specs)}")
    spec = specs[args.topic]
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    found = detect.find(
        KafkaResource(),
        cat,
        ns,
        spec,
        specs=SPECS,
        retention_horizon=timedelta(hours=args.horizon_hours),
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
    if args.json:
        report = {
            "topic": spec.topic,
            "raw_gaps": raw_gaps,
            "current_gaps": current_gaps,
            "tables_due": tables_due,
            "late_event_hours": late_hours,
            "retention_risks": found.retention_risks,
        }
        print(json.dumps(report, indent=2))
    else:
        print(f"topic {spec.topic!r}: Kafka hours checked up to {found.closed_until}")
        for name, gaps in (("raw_gaps", raw_gaps), ("current_gaps", current_gaps)):
            print(f"{name}: {len(gaps) or 'none'}")
            for r in gaps:
                print(f"  {r['start']} .. {r['end']}   fill: {r['fill']}")
        for title, per_table in (("tables_due", tables_due), ("late_event_hours", late_hours)):
            print(f"{title}: {sum(len(d) for d in per_table.values()) or 'none'}")
            for name, due in per_table.items():
                for h, why in due.items():
                    print(f"  {name} {h}  {why}")
        risks = found.retention_risks
        print(f"retention risks (within {args.horizon_hours} h): {len(risks) or 'none'}")
        for r in risks:
            archived = "archived" if r["archived"] else "NOT archived"
            print(
                f"  {r['hour']} leaves Kafka at {r['leaves_kafka_at']} offsets {r['offsets']} "
                f"({archived})"
            )
    empty = not (found.raw_gaps or found.current_gaps or tables_due or late)
    return 0 if empty else 1


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


def _range_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topic", default="orders")
    p.add_argument("--start", required=True, help="first hour, ISO-8601 UTC (inclusive)")
    p.add_argument("--end", required=True, help="end hour, ISO-8601 UTC (exclusive)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="backfill-assets", description="Safe Kafka -> Iceberg backfills with Dagster."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("jars", help="resolve JVM artifacts from Maven Central (idempotent)")
    p.add_argument("action", choices=["resolve"])
    p.set_defaults(func=_cmd_jars)

    p = sub.add_parser("kafka", help="manage the embedded local Kafka broker (KRaft)")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.set_defaults(func=_cmd_kafka)

    p = sub.add_parser("catalog", help="create/show the Iceberg catalog and namespace")
    p.add_argument("action", choices=["init"])
    p.set_defaults(func=_cmd_catalog)

    p = sub.add_parser("stack", help="the whole local stack: jars, catalog, broker")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(func=_cmd_stack)

    p = sub.add_parser("generate", help="write deterministic demo history into Kafka")
    p.add_argument("--topic", default="orders")
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--hours", type=int, default=48, help="hours of back-dated history")
    p.add_argument("--events-per-hour", type=int, default=600)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--start", help="first hour (ISO-8601, UTC); default: now minus --hours")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("plan", help="replay contract, duration, cost and readiness of a range")
    _range_args(p)
    p.add_argument("--window", help="time available, e.g. 90m, 6h, 2d")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("backfill", help="launch a Dagster partition backfill (as the UI does)")
    _range_args(p)
    p.add_argument("--wait", action="store_true", help="show progress until it ends")
    p.add_argument("--timeout", type=float, help="seconds to wait at most")
    p.add_argument("--webserver", help="webserver URL (default from BACKFILL_WEBSERVER_*)")
    p.set_defaults(func=_cmd_backfill)

    p = sub.add_parser("gaps", help="what the gap and late-data sensors see, with fill commands")
    p.add_argument("--topic", default="orders")
    p.add_argument("--horizon-hours", type=int, default=24, help="retention warning horizon")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_gaps)

    p = sub.add_parser("audit", help="query the audit table")
    p.add_argument("--table", help="table name, e.g. raw_orders")
    p.add_argument("--run", help="a Dagster run id")
    p.add_argument("--backfill", help="a Dagster backfill id")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser("rollback", help="restore tables to their snapshot before a run/backfill")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--run", help="a Dagster run id")
    who.add_argument("--backfill", help="a Dagster backfill id")
    p.add_argument("--table", help="only this table (default: every table it published to)")
    p.add_argument("--force", action="store_true", help="also discard later publishes")
    p.set_defaults(func=_cmd_rollback)

    p = sub.add_parser("archive", help="copy new records of a topic to the archive now")
    p.add_argument("--topic", default="orders")
    p.add_argument("--status", action="store_true", help="show what is archived; copy nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_archive)

    p = sub.add_parser(
        "materialize", help="materialize a Kafka-time range of a topic's tables in-process"
    )
    p.add_argument("--topic", default="orders")
    p.add_argument("--start", required=True, help="first hour, ISO-8601 UTC (inclusive)")
    p.add_argument("--end", required=True, help="end hour, ISO-8601 UTC (exclusive)")
    p.set_defaults(func=_cmd_materialize)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Dagster flags beta parameters (backfill_policy) on every load; operators need not see it.
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    warnings.filterwarnings("ignore", category=dg.PreviewWarning)
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        return int(args.func(args, settings))
    except BackfillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
