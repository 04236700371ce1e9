"""Paired benchmark: the current-state table's source (``lake/write/derived._current_source``: per
key touched by a window of Kafka hours, its latest winning row, checkpointed) of a baseline
commit against the working tree's, alternating in one process over the raw and current-state
tables a north-star run left in ``--home`` (bench/northstar.py).

The baseline's ``backfill_assets/lake/write/derived.py`` is read with ``git show`` and loaded beside
the tree's; everything else (settings, Spark session, tables) is shared. Both must return the
same rows for every window (asserted, both ways, with ``exceptAll``). Nothing is written to the
tables. After ``--warmup`` rounds (not counted), ``--rounds`` rounds alternate which form runs
first; prints each form's seconds per round, the median ratio tree / baseline per window, and
the load average (shared machines). Classic local[2], as the north star's run workers.

Run from the repository root, after a 30-day north star has left its tables in --home:
    .venv/bin/python bench/current_source.py --home /tmp/bench-northstar --baseline a592986
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
WINDOWS = ("2026-06-29T00:00/2026-07-01T00:00", "2026-06-22T00:00/2026-06-29T00:00")


def _baseline(commit: str) -> ModuleType:
    """``backfill_assets/lake/write/derived.py`` as of ``commit``, loaded as its own module."""
    source = subprocess.run(
        ["git", "show", f"{commit}:backfill_assets/lake/write/derived.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_derived.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_derived", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_derived"] = module
    spec.loader.exec_module(module)
    return module


def _newest_namespace(home: Path) -> str:
    """The namespace of the newest north-star run in the home's catalog."""
    with sqlite3.connect(home / "catalog" / "catalog.db") as db:
        rows = db.execute(
            "SELECT table_namespace, metadata_location FROM iceberg_tables "
            "WHERE table_name = 'orders_current'"
        ).fetchall()
    if not rows:
        raise SystemExit(f"no orders_current table in {home}: run bench/northstar.py first")
    return max(rows, key=lambda r: Path(r[1].split(":", 1)[1]).stat().st_mtime)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path("/tmp/bench-northstar"))
    parser.add_argument("--namespace", help="default: the newest north-star run's")
    parser.add_argument("--baseline", default="HEAD", help="commit to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first, not counted")
    parser.add_argument("--window", action="append", help="START/END, ISO hours (UTC)")
    parser.add_argument(
        "--relation",
        choices=["current", "events"],
        default="current",
        help="current: the current-state source; events: the events relation a declared "
        "table reads (events_in, checkpointed), over event-time windows",
    )
    args = parser.parse_args()
    os.environ["BACKFILL_HOME"] = str(args.home)
    os.environ["BACKFILL_NAMESPACE"] = args.namespace or _newest_namespace(args.home)
    os.environ.setdefault("BACKFILL_JAR_CACHE", str(REPO / ".stack" / "jars"))

    from backfill_assets.lake.write import derived
    from backfill_assets.spec.loader import load_specs
    from backfill_assets.stack.catalog import CatalogClient
    from backfill_assets.stack.settings import Settings
    from backfill_assets.stack.spark import get_session

    forms = {"baseline": _baseline(args.baseline), "tree": derived}
    settings = Settings.from_env()
    spark = get_session(settings)
    spec = next(s for s in load_specs() if s.topic == "orders")
    catalog = CatalogClient(settings)
    raw, table = catalog.spark_name(spec.raw_table), catalog.spark_name(spec.current_table)
    print(f"tables {os.environ['BACKFILL_NAMESPACE']}; baseline {args.baseline}")
    for window in args.window or WINDOWS:
        start, end = (datetime.fromisoformat(t).replace(tzinfo=UTC) for t in window.split("/"))
        times: dict[str, list[float]] = {name: [] for name in forms}
        kept = {}
        for round_ in range(args.warmup + args.rounds):
            # Alternate which form runs first: the first action of a round warms the JVM.
            for name in sorted(forms, reverse=bool(round_ % 2)):
                began = time.perf_counter()
                if args.relation == "events":
                    frame = (
                        forms[name]
                        .events_in(spark, spec, raw, start, end)
                        .localCheckpoint(eager=True)
                    )
                else:
                    frame = forms[name]._current_source(
                        spark, spec, raw, spark.table(raw), table, start, end
                    )
                if round_ >= args.warmup:
                    times[name].append(time.perf_counter() - began)
                kept.setdefault(name, frame)
        keys = kept["tree"].count()
        differ = kept["baseline"].exceptAll(kept["tree"]).count()
        differ += kept["tree"].exceptAll(kept["baseline"]).count()
        assert differ == 0, f"{window}: {differ} rows differ between baseline and tree"
        ratio = statistics.median(times["tree"]) / statistics.median(times["baseline"])
        rounds = ", ".join(
            f"{name} " + " / ".join(f"{t:.1f}" for t in ts) + " s" for name, ts in times.items()
        )
        print(
            f"{window} ({args.relation}): {keys:,} rows, same rows; {rounds}; tree/baseline "
            f"{ratio:.2f}x (median); load {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
