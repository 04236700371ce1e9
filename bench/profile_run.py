"""Profile: where one 1-hour backfill's run spends its time, by the project's functions.

Starts its own broker (and, unless ``--classic``, a warm local Spark Connect server, as
``stack up`` does) in a temporary ``BACKFILL_HOME``, writes a few hours of demo ``orders``
history, then materializes what ``backfill-assets backfill`` materializes for one hour (raw,
current state, declared tables whose hours settled) in this process, with Dagster's
``materialize``: hour 0 (creates the tables) and hour 1 unprofiled, hour 2 under cProfile.
Prints each run's seconds, then the project's functions by cumulative time and the Spark
calls each one made (Connect mode: time waiting on the server). Over Connect it also counts the
profiled hour's Spark round trips (each ExecutePlan, AnalyzePlan and Config request the client
sends: an action, a schema or metadata question, a session setting) per asset and per calling
function of the project. No webserver or daemon: the launch, queue and run-process phases are
bench/latency.py's. ``--hours N`` profiles an N-hour backfill instead (raw and current state
as one ranged run each, as a backfill's runs are: up to 720 hours by default), after the
same two 1-hour runs.

Run from the repository root (jars resolved by scripts/bootstrap.sh):
    .venv/bin/python bench/profile_run.py              # runs as Spark Connect thin clients
    .venv/bin/python bench/profile_run.py --classic    # classic in-process Spark
    .venv/bin/python bench/profile_run.py --hours 168 --events-per-hour 1500 --top 25
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout's test support (not part of the package)
from backfill_assets_tests.support.services import free_port  # noqa: E402

START = datetime(2026, 6, 1, tzinfo=UTC)
SPARK_CALLS = (
    "collect",
    "count",
    "first",
    "sql",
    "localCheckpoint",
    "overwrite",
    "append",
    "toPandas",
    "columns",
    "createOrReplaceTempView",
)


# The requests of one Spark Connect round trip each (a reattach or release belongs to the
# execution it continues and is counted apart).
ROUND_TRIPS = ("ExecutePlan", "AnalyzePlan", "Config")
ASSET_STEPS = {"_raw": "raw", "_current": "current", "_declared": "declared"}


class RoundTrips:
    """Counts the Spark Connect requests the client sends, by asset step and by the project's
    innermost function on the stack, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.by_asset: collections.Counter[str] = collections.Counter()
        self.by_caller: collections.Counter[str] = collections.Counter()
        self.other: collections.Counter[str] = collections.Counter()

    def install(self) -> None:
        """Wrap every stub the Connect client makes from now on."""
        from pyspark.sql.connect.client import core

        base = core.grpc_lib.SparkConnectServiceStub
        counter = self

        class Counting(base):  # type: ignore[misc,valid-type]
            def __init__(self, channel: Any) -> None:
                super().__init__(channel)
                for name in (*ROUND_TRIPS, "ReattachExecute", "ReleaseExecute"):
                    setattr(self, name, counter.wrap(name, getattr(self, name)))

        core.grpc_lib.SparkConnectServiceStub = Counting

    def wrap(self, name: str, call: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.record(name)
            return call(*args, **kwargs)

        return counted

    def record(self, name: str) -> None:
        if name not in ROUND_TRIPS:
            self.other[name] += 1
            return
        frame: Any = sys._getframe(2)
        caller, asset = None, "other"
        while frame is not None:
            path = frame.f_code.co_filename
            if "backfill_assets/" in path and "/bench/" not in path:
                # stack/fetch.py is how the project collects: name the function that asked.
                if caller is None and not path.endswith("stack/fetch.py"):
                    caller = f"{path.split('backfill_assets/')[-1]}:{frame.f_code.co_name}"
                if path.endswith("defs/assets.py") and frame.f_code.co_name in ASSET_STEPS:
                    asset = ASSET_STEPS[frame.f_code.co_name]
                    break
            frame = frame.f_back
        self.by_asset[asset] += 1
        self.by_caller[f"{asset:8s} {name:11s} {caller or '(outside the package)'}"] += 1

    def report(self) -> None:
        total = sum(self.by_asset.values())
        print(f"Spark Connect round trips of the profiled hour: {total}")
        for asset, n in sorted(self.by_asset.items()):
            print(f"  {asset:8s} {n:4d}")
        print("  by asset, request and the project's innermost function:")
        for label, n in self.by_caller.most_common():
            print(f"    {n:4d}  {label}")
        if self.other:
            print(f"  not counted above: {dict(self.other)}")


def spark_calls(stats: pstats.Stats, top: int) -> list[tuple[float, int, str]]:
    """(seconds, calls, 'caller -> Spark method') for Spark DataFrame/session calls made
    directly from the project's code, largest first."""
    rows = []
    for func, (_cc, _nc, _tt, _ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "pyspark/sql" not in func[0] or func[2] not in SPARK_CALLS:
            continue
        for caller, (calls, _p, _t, cumulative) in callers.items():
            if "backfill_assets/" in caller[0]:
                where = caller[0].split("backfill_assets/")[-1]
                rows.append((cumulative, calls, f"{where}:{caller[1]} {caller[2]} -> {func[2]}"))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--classic", action="store_true", help="classic in-process Spark")
    parser.add_argument("--events-per-hour", type=int, default=600)
    parser.add_argument("--hours", type=int, default=1, help="hours of the profiled backfill")
    parser.add_argument("--top", type=int, default=30, help="rows of each table")
    parser.add_argument("--save", type=Path, help="write the cProfile stats here")
    parser.add_argument("--keep-home", action="store_true", help="keep BACKFILL_HOME (logs)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import

    home = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    os.environ.update(
        {
            "BACKFILL_HOME": str(home),
            "BACKFILL_JAR_CACHE": os.environ.get(
                "BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars")
            ),
            "BACKFILL_KAFKA_PORT": str(free_port()),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
            "BACKFILL_SPARK_CONNECT_PORT": str(free_port()),
            "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
            "PYICEBERG_HOME": str(home / "pyiceberg-home"),
            "BACKFILL_SENSORS": "off",
        }
    )
    import dagster as dg

    from backfill_assets.defs.definitions import SPECS, build_defs, build_resources
    from backfill_assets.demo.generator import GeneratorConfig, generate
    from backfill_assets.ops.cli import common
    from backfill_assets.stack import catalog, jars
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    jars.resolve_all(settings)
    broker = LocalBroker(settings)
    broker.start()
    server: Any = None
    trips = RoundTrips()
    try:
        if not args.classic:
            trips.install()
            from backfill_assets.stack.connect import LocalConnectServer

            server = LocalConnectServer(Settings.from_env())
            print(server.start().describe(), flush=True)
            os.environ["BACKFILL_SPARK_CONNECT"] = server.url
        spec = next(s for s in SPECS if s.topic == "orders")
        config = GeneratorConfig(
            topic="orders",
            start=START,
            hours=3 + args.hours,
            events_per_hour=args.events_per_hour,
            seed=7,
        )
        generate(settings, config)
        catalog.init_local_catalog(settings.catalog)
        cat = catalog.load(settings.catalog)
        cat.create_namespace_if_not_exists(settings.catalog.namespace)
        defs = build_defs(SPECS)
        resources = build_resources()
        instance = dg.DagsterInstance.ephemeral()

        def one(hour: int, hours: int = 1) -> float:
            first = START + timedelta(hours=hour)
            began = time.monotonic()
            for keys, start, end in common.ranges(spec, first, first + timedelta(hours=hours)):
                last = end - timedelta(hours=1)
                result = dg.materialize(
                    list(defs.assets or []),  # type: ignore[arg-type]
                    selection=keys,
                    partition_key=f"{start:%Y-%m-%d-%H:%M}" if start == last else None,
                    tags=(
                        {}
                        if start == last
                        else {
                            "dagster/asset_partition_range_start": f"{start:%Y-%m-%d-%H:%M}",
                            "dagster/asset_partition_range_end": f"{last:%Y-%m-%d-%H:%M}",
                        }
                    ),
                    resources=resources,
                    instance=instance,
                    raise_on_error=True,
                )
                assert result.success
            return time.monotonic() - began

        print(f"hour 0 (creates the tables): {one(0):.1f} s", flush=True)
        print(f"hour 1: {one(1):.1f} s", flush=True)
        profile = cProfile.Profile()
        trips.on = True
        profile.enable()
        seconds = one(2, args.hours)
        profile.disable()
        trips.on = False
        label = "hour 2" if args.hours == 1 else f"hours 2..{1 + args.hours}"
        print(f"{label} (profiled): {seconds:.1f} s, load {os.getloadavg()[0]:.1f}\n")
        if args.save:
            profile.dump_stats(str(args.save))
        stats = pstats.Stats(profile, stream=sys.stdout)
        stats.sort_stats("cumulative").print_stats(r"backfill_assets/(lake|defs)/", args.top)
        print("Spark calls made by the project's code (seconds, calls):")
        for cumulative, calls, label in spark_calls(stats, args.top):
            print(f"  {cumulative:7.2f} {calls:3d}  {label}")
        if not args.classic:
            trips.report()
    finally:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()  # a Connect client's threads would keep the process alive
        if server is not None:
            server.stop()
        broker.stop()
        if args.keep_home:
            print(f"kept {home}", flush=True)
        else:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
    # Some non-daemon thread of the Connect client or Dagster keeps the interpreter from
    # exiting once everything above has been stopped; the figures are printed, so leave.
    sys.stdout.flush()
    os._exit(0)
