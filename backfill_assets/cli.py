"""``backfill-assets``: the operator's command line.

Every failure the project anticipates is a :class:`~backfill_assets.errors.BackfillError`
whose message says what to run next; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime, timedelta

from backfill_assets import catalog, jars
from backfill_assets.broker import LocalBroker
from backfill_assets.errors import BackfillError
from backfill_assets.settings import Settings


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
    from backfill_assets.generator import GeneratorConfig, generate

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


def _cmd_materialize(args: argparse.Namespace, settings: Settings) -> int:
    """Materialize a Kafka-time range of one topic's tables in this process, on the Dagster
    instance of $DAGSTER_HOME (the run shows in the UI). Raw and current-state tables cover
    [start, end); the event-time table covers [start, end - allowed lateness), the hours whose
    events have all arrived within the range."""
    import dagster as dg

    from backfill_assets.assets import (
        current_asset_key,
        hourly_asset_key,
        raw_asset_key,
    )
    from backfill_assets.definitions import SPECS, defs

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
    lateness = timedelta(hours=spec.allowed_lateness_hours)
    plan = [([raw_asset_key(spec), current_asset_key(spec)], start, end)]
    if end - lateness > start:
        plan.append(([hourly_asset_key(spec)], start, end - lateness))
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

    p = sub.add_parser(
        "materialize", help="materialize a Kafka-time range of a topic's tables in-process"
    )
    p.add_argument("--topic", default="orders")
    p.add_argument("--start", required=True, help="first hour, ISO-8601 UTC (inclusive)")
    p.add_argument("--end", required=True, help="end hour, ISO-8601 UTC (exclusive)")
    p.set_defaults(func=_cmd_materialize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        return int(args.func(args, settings))
    except BackfillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
