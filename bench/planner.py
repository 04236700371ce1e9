"""Benchmark: the planner's predicted duration against the measured one, for 1 h, 6 h, 24 h and
7-day ranges on the demo stack.

Starts its own broker, Dagster webserver and daemon (as bench/latency.py does: free 127.0.0.1
ports, a temporary home), writes ``--days`` of demo ``orders`` history at the demo's rate,
launches ``--warmup`` small ranges the planner may learn from (an operator's stack has the demo's
first backfill behind it), then for each measured range, one after another on fresh hours:

1. ``backfill-assets plan``'s prediction (:func:`backfill_assets.ops.planner.make_plan` with the
   instance's history so far), its breakdown and its confidence;
2. the launch as ``backfill-assets backfill`` does it (one hour as one run, longer ranges as a
   backfill object), waited for;
3. the measured seconds from the click to the last materialization (``published``), split into
   phases from the Dagster event log (bench/latency.py's ``breakdown``).

The goal (issue 13) is every measured range within +-25% of its prediction.

Run from the repository root (jars resolved by scripts/bootstrap.sh):
    .venv/bin/python bench/planner.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import latency  # bench/latency.py: the services and the breakdown

HISTORY_START = datetime(2026, 6, 1, tzinfo=UTC)
PARTITION_FMT = "%Y-%m-%d-%H:%M"
GOAL = 0.25
RANGES = {"1h": 1, "6h": 6, "24h": 24, "7d": 168}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events-per-hour", type=int, default=300, help="the demo's rate")
    parser.add_argument(
        "--warmup",
        default="1,3",
        help="hours of the ranges launched first, not measured (comma-separated)",
    )
    parser.add_argument(
        "--ranges", default=",".join(RANGES), help=f"measured, of {', '.join(RANGES)}"
    )
    parser.add_argument(
        "--connect",
        action="store_true",
        help="runs are thin clients of a warm local Spark Connect server (as bench/latency.py)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary home")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import
    warm = [int(h) for h in args.warmup.split(",") if h]
    measured = [(name, RANGES[name]) for name in args.ranges.split(",")]

    home = Path(tempfile.mkdtemp(prefix="bench-planner-"))
    env = {
        "BACKFILL_HOME": str(home),
        "BACKFILL_JAR_CACHE": os.environ.get(
            "BACKFILL_JAR_CACHE", str(latency.REPO_ROOT / ".stack" / "jars")
        ),
        "BACKFILL_KAFKA_PORT": str(latency.free_port()),
        "BACKFILL_KAFKA_CONTROLLER_PORT": str(latency.free_port()),
        "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
        "PYICEBERG_HOME": str(home / "pyiceberg-home"),
        "BACKFILL_SENSORS": "off",
    }
    os.environ.update(env)
    import dagster as dg

    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.demo.generator import GeneratorConfig, generate
    from backfill_assets.ops import launch, planner
    from backfill_assets.stack import catalog, jars
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.kafka import KafkaClient
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    jars.resolve_all(settings)
    broker = LocalBroker(settings)
    broker.start()
    rows: list[dict[str, Any]] = []
    server = None
    try:
        if args.connect:
            from backfill_assets.stack.connect import LocalConnectServer

            os.environ["BACKFILL_SPARK_CONNECT_PORT"] = str(latency.free_port())
            server = LocalConnectServer(Settings.from_env())
            print(server.start().describe(), flush=True)
            os.environ["BACKFILL_SPARK_CONNECT"] = server.url
        spec = next(s for s in SPECS if s.topic == "orders")
        tables = [spec.raw_table, spec.current_table, *(t.name for t in spec.tables)]
        hours = sum(warm) + sum(h for _, h in measured) + 1
        began = time.monotonic()
        truth = generate(
            settings,
            GeneratorConfig(
                topic=spec.topic,
                start=HISTORY_START,
                hours=hours,
                events_per_hour=args.events_per_hour,
                seed=7,
            ),
        )
        print(
            f"generated {truth.totals['records']:,} records over {hours} h "
            f"in {time.monotonic() - began:.0f}s",
            flush=True,
        )
        catalog.init_local_catalog(settings.catalog)
        cat = catalog.load(settings.catalog)
        cat.create_namespace_if_not_exists(settings.catalog.namespace)
        dagster_home = home / "dagster-home"
        dagster_yaml = latency.REPO_ROOT / "dagster.yaml"
        with (
            latency.dagster_services(dagster_home, dict(os.environ), dagster_yaml) as url,
            dg.DagsterInstance.from_config(str(dagster_home)) as instance,
        ):
            os.environ["DAGSTER_HOME"] = str(dagster_home)  # the planner's concurrency
            client = launch.DagsterClient(url)
            first = HISTORY_START
            for name, length in [*((f"warm-up {h}h", h) for h in warm), *measured]:
                end = first + timedelta(hours=length)
                plan = planner.make_plan(
                    KafkaClient(),
                    spec,
                    first,
                    end,
                    instance=instance,
                    concurrency=_concurrency(),
                )
                row = _launch(launch, planner, instance, cat, client, spec, tables, first, end)
                row.update(
                    name=name,
                    records=plan.records,
                    predicted_s=plan.predicted_duration_s,
                    predicted=plan.predicted_breakdown,
                    confidence=f"{plan.confidence}: {plan.confidence_basis}",
                    launched_as=plan.launched_as,
                )
                row["error"] = plan.predicted_duration_s / row["published_s"] - 1
                print(
                    f"{name}: {plan.records:,} records as {plan.launched_as}; predicted "
                    f"{plan.predicted_duration_s:.1f} s "
                    f"({', '.join(f'{k} {v:.1f}' for k, v in plan.predicted_breakdown.items())}), "
                    f"measured {row['published_s']:.1f} s: {100 * row['error']:+.0f}%\n"
                    f"  confidence {row['confidence']}\n"
                    f"  measured phases: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in row["phases"].items() if v >= 0.05),
                    flush=True,
                )
                if not name.startswith("warm-up"):
                    rows.append(row)
                first = end
        print()
        print("| range | records | launched as | predicted s | measured s | error | confidence |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['name']} | {row['records']:,} | {row['launched_as']} | "
                f"{row['predicted_s']:.1f} | {row['published_s']:.1f} | "
                f"{100 * row['error']:+.0f}% | {row['confidence'].split(':')[0]} |"
            )
        inside = sum(abs(r["error"]) <= GOAL for r in rows)
        print(f"{inside}/{len(rows)} within +-{100 * GOAL:.0f}% (goal: all)")
        _print_history(planner, instance, spec)
    finally:
        if server is not None:
            server.stop()
        broker.stop()
        if args.keep:
            print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def _print_history(planner: Any, instance: Any, spec: Any) -> None:
    """The raw runs the planner learns from (records, RUN_START to end), oldest first: the
    data a model of run time has to fit."""
    from backfill_assets.defs.assets import raw_asset_key

    history = planner._history(instance, raw_asset_key(spec))
    print()
    print("raw runs the planner learned from (oldest first): records, wall s")
    for h in reversed(list(history.values())):
        print(f"  {h['records']:>9,.0f}  {h['wall_s']:>7.1f}")


def _concurrency() -> int:
    from backfill_assets.ops.cli import common

    return common.backfill_concurrency()


def _launch(
    launch: Any,
    planner: Any,
    instance: Any,
    cat: Any,
    client: Any,
    spec: Any,
    tables: list[str],
    first: datetime,
    end: datetime,
) -> dict[str, Any]:
    """Launch [first, end) as ``backfill-assets backfill`` does, wait, and break it down."""
    from backfill_assets.stack.settings import Settings

    ranges = [
        (key, f"{a:{PARTITION_FMT}}", f"{b - timedelta(hours=1):{PARTITION_FMT}}")
        for keys, a, b in planner.backfill_ranges(spec, first, end)
        for key in keys
    ]
    tags = {"backfill_assets/launched_by": "bench:planner"}
    partition = launch.single_partition(ranges)
    clicked = time.time()
    if partition is not None:
        keys = [key for key, _, _ in ranges]
        launched = launch.launch_run(client, keys, partition, tags, "bench")
        final = launch.wait_run(client, launched, len(keys), poll_s=1.0, timeout_s=3600)
    else:
        launched = launch.launch_backfill(client, ranges, tags, "bench")
        final = launch.wait(client, launched, poll_s=1.0, timeout_s=3600)
    if not final.succeeded:
        raise RuntimeError(f"{launched} ended {final.line()}")
    namespace = Settings.from_env().catalog.namespace
    return latency.breakdown(
        instance, cat, namespace, tables, launched, clicked, single_run=partition is not None
    )


if __name__ == "__main__":
    main()
