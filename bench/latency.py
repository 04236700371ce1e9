"""Benchmark: launch-to-published latency of small (1-hour) backfills through the webserver.

Starts its own broker, Dagster webserver and daemon (free 127.0.0.1 ports, temporary
``BACKFILL_HOME`` and ``DAGSTER_HOME``; the services are started exactly as the test suite's
``dagster_services`` fixture starts them), writes a few hours of demo ``orders`` history, then
launches ``--runs`` 1-hour backfills one after another (after ``--warmup`` ones that create the
tables and are not counted) the way an operator does: ``backfill-assets backfill``'s ranges
(raw, current state, declared tables whose hours settled), launched as the CLI launches them
(:mod:`backfill_assets.ops.launch`): one hour as one run (GraphQL ``launchPipelineExecution``,
as the UI's Materialize of one partition), or with ``--as-backfill`` as a backfill object
(``launchPartitionBackfill``, which waits for the backfill daemon's next pass).

Each backfill is broken down from recorded timestamps only: the backfill's own timestamps,
the Dagster event log of its runs (RUN_ENQUEUED, RUN_DEQUEUED, RUN_STARTING, the run worker's
"Started process" event, RUN_START, step events, resource init, log messages,
ASSET_MATERIALIZATION, RUN_SUCCESS) and, inside a step, the Iceberg commits the run made (its
branch writes and its published commit, from the table's snapshot log). Also measured once,
before the services start: a Spark session started alone in a fresh process (import, session).

With ``--floor`` (needs ``--connect``) each measured hour also gets its floor, in the same
script on the same warm engine: an empty Dagster run launched as the hour's run was (the
partitioned no-op asset of bench/floor_location.py, a second code location that imports the
project's Definitions module: the queue, the run process and the same code load), plus the
hand-written jobs for the same hour's outputs (bench/hand_floor.py: raw by ``from_json``, the
events' winners, the current state, the declared tables the hour's backfill wrote) run by this
process on the same Spark Connect server. Goal: launch -> published <= 2x that floor.

Run from the repository root (jars resolved by scripts/bootstrap.sh):
    .venv/bin/python bench/latency.py                      # the repository's dagster.yaml
    .venv/bin/python bench/latency.py --dagster-yaml OTHER.yaml
    .venv/bin/python bench/latency.py --connect            # runs as Spark Connect thin clients
    .venv/bin/python bench/latency.py --connect --floor    # and each hour's floor
Timings on a shared 2-core machine are noisy: compare runs of the same invocation or load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout's test support (not part of the package)
from backfill_assets_tests.support.services import dagster_services, free_port  # noqa: E402

HISTORY_START = datetime(2026, 6, 1, tzinfo=UTC)
PARTITION_FMT = "%Y-%m-%d-%H:%M"
GOAL_S = 30.0
FLOOR_GOAL = 2.0  # launch -> published <= 2x the floor (issue 49)
FLOOR_ASSET = "bench_floor_noop"  # bench/floor_location.py

# The project's code location and the floor's (bench/floor_location.py), for --floor.
FLOOR_WORKSPACE = """load_from:
  - python_module:
      module_name: backfill_assets.defs.definitions
      location_name: backfill_assets
  - python_file:
      relative_path: {path}
      location_name: bench_floor
      working_directory: {root}
"""

SPARK_ALONE = """
import json, sys, time
t0 = time.time()
from backfill_assets.stack import spark
from backfill_assets.stack.settings import Settings
import pyspark.sql
t1 = time.time()
session = spark.get_session(Settings.from_env())
t2 = time.time()
session.range(1).count()
t3 = time.time()
session.stop()
print(json.dumps({"import_s": t1 - t0, "session_s": t2 - t1, "first_job_s": t3 - t2}))
"""


def loadavg() -> str:
    """The 1-minute load average (``/proc/loadavg``); this machine has 2 cores."""
    return Path("/proc/loadavg").read_text().split()[0]


def spark_alone(env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", SPARK_ALONE],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# Milestones of a backfill, in the order they happen; the time from one milestone to the next
# is attributed to the phase of the later one. Events not listed here are not milestones.
PHASES = (
    ("launch", "GraphQL mutation: click -> backfill stored"),
    ("backfill_tick", "backfill stored -> its run is created and queued (backfill daemon)"),
    ("run_queue", "queued -> dequeued and RUN_STARTING (run queue daemon)"),
    ("run_launch", "RUN_STARTING -> run worker process started (code server spawns it)"),
    ("run_code_load", "run worker started -> RUN_START (code location loaded in the run)"),
    ("step_launch", "RUN_START / previous step -> step worker subprocess started"),
    ("step_code_load", "step worker started -> resource init starts (code loaded again)"),
    ("spark_start", "resource init (the Spark session) -> STEP_START"),
    ("work", "STEP_START -> the run's rows committed on its branch (Iceberg snapshot)"),
    ("checks", "branch write -> audited commit on the branch (Iceberg snapshot)"),
    ("publish", "audited commit -> fast-forward, audit + ledger rows -> ASSET_MATERIALIZATION"),
    ("dagster_other", "step and run bookkeeping between the milestones above"),
)
PHASE_OF_EVENT = {
    "LAUNCHED": "launch",  # a single run's RUN_ENQUEUED (the mutation enqueues it)
    "PIPELINE_ENQUEUED": "backfill_tick",
    "PIPELINE_DEQUEUED": "run_queue",
    "PIPELINE_STARTING": "run_queue",
    "PIPELINE_START": "run_code_load",
    "STEP_WORKER_STARTED": "step_launch",
    "RESOURCE_INIT_STARTED": "step_code_load",
    "RESOURCE_INIT_SUCCESS": "spark_start",
    "STEP_START": "dagster_other",
    "ASSET_MATERIALIZATION": "publish",
    "STEP_SUCCESS": "dagster_other",
    "PIPELINE_SUCCESS": "dagster_other",
}
BRANCH_WRITE, AUDITED = "branch write", "audited commit"


def _milestones(instance: Any, run_id: str) -> list[tuple[float, str, str]]:
    """(timestamp, event, step) of a run's milestone events, from the event log."""
    out = []
    for entry in instance.all_logs(run_id):
        event = entry.dagster_event
        if event is None:
            continue
        kind = event.event_type_value
        if kind == "ENGINE_EVENT" and (event.message or "").startswith("Started process for run"):
            out.append((entry.timestamp, "RUN_WORKER_STARTED", ""))
        elif kind in PHASE_OF_EVENT:
            out.append((entry.timestamp, kind, entry.step_key or ""))
    return out


def _commits(cat: Any, namespace: str, run_id: str, tables: list[str]) -> list[tuple[float, str]]:
    """Per table the run published: its rows' commit on the run branch (the audited commit's
    parent) and the audited commit (summary backfill.run-id = the run, backfill.published)."""
    out = []
    from pyiceberg.exceptions import NoSuchTableError

    for name in tables:
        try:
            table = cat.load_table(f"{namespace}.{name}")
        except NoSuchTableError:
            continue  # not materialized by a 1-hour backfill (declared tables' hours unsettled)
        snaps = {s.snapshot_id: s for s in table.snapshots()}
        for snap in snaps.values():
            summary = dict(snap.summary.additional_properties) if snap.summary else {}
            if (
                summary.get("backfill.run-id") != run_id
                or summary.get("backfill.published") != "true"
            ):
                continue
            out.append((snap.timestamp_ms / 1000, AUDITED))
            parent = snaps.get(snap.parent_snapshot_id or -1)
            if parent is not None:
                out.append((parent.timestamp_ms / 1000, BRANCH_WRITE))
    return out


def breakdown(
    instance: Any,
    cat: Any,
    namespace: str,
    tables: list[str],
    launched_id: str,
    clicked: float,
    *,
    single_run: bool = False,
) -> dict[str, Any]:
    """Seconds per phase from click to the last ASSET_MATERIALIZATION ("published"), then to
    the backfill's end (the next backfill daemon tick marks it completed) or the run's end.
    A single run has no backfill object: click -> RUN_ENQUEUED is its launch."""
    import dagster as dg

    if single_run:
        backfill = None
        runs = [instance.get_run_by_id(launched_id)]
        marks: list[tuple[float, str]] = []
    else:
        backfill = instance.get_backfill(launched_id)
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": launched_id}))
        marks = [(backfill.backfill_timestamp, "launch")]
    for run in runs:
        events = _milestones(instance, run.run_id)
        if single_run:
            events = [(ts, "LAUNCHED" if k == "PIPELINE_ENQUEUED" else k, s) for ts, k, s in events]
        # a step's branch write and audited commit fall between its STEP_START and its
        # ASSET_MATERIALIZATION; a step that wrote nothing has neither.
        for ts, label in _commits(cat, namespace, run.run_id, tables):
            marks.append((ts, "work" if label == BRANCH_WRITE else "checks"))
        for ts, kind, _step in events:
            phase = PHASE_OF_EVENT.get(kind, "run_launch")
            marks.append((ts, phase))
    marks.sort()
    published = max(ts for ts, kind in marks if kind == "publish")
    phases = dict.fromkeys([name for name, _ in PHASES], 0.0)
    previous = clicked
    for ts, phase in marks:
        if ts > published:
            break
        phases[phase] += max(0.0, ts - previous)
        previous = max(previous, ts)
    # within a multiprocess run, the step worker's own start splits step_launch/step_code_load
    # exactly as above; in-process runs have no step worker: their step_code_load is ~0.
    if backfill is not None:
        end, status = backfill.backfill_end_timestamp, backfill.status.value
    else:
        record = instance.get_run_record_by_id(launched_id)
        end, status = record.end_time, record.dagster_run.status.value
    return {
        "backfill_id": launched_id,
        "runs": len(runs),
        "status": status,
        "published_s": published - clicked,
        "completed_s": (end - clicked) if end else float("nan"),
        "phases": phases,
    }


def dump_events(instance: Any, backfill_id: str, origin: float) -> None:
    import dagster as dg

    runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
    for run in runs or [instance.get_run_by_id(backfill_id)]:
        for entry in instance.all_logs(run.run_id):
            event = entry.dagster_event
            kind = event.event_type_value if event else "LOG"
            text = (event.message if event else entry.user_message) or ""
            print(
                f"    {entry.timestamp - origin:8.3f} {run.run_id[:8]} {kind} "
                f"{entry.step_key or ''} {text[:90]}"
            )


def empty_run(client: Any, instance: Any, partition: str) -> float:
    """Seconds from launching the floor's no-op asset for ``partition`` (as the hour's run was
    launched: one run through the webserver, the run queue) to its RUN_SUCCESS."""
    import dagster as dg

    from backfill_assets.ops import launch

    tags = {"backfill_assets/launched_by": "bench:latency-floor"}
    clicked = time.time()
    run_id = launch.launch_run(client, [dg.AssetKey(FLOOR_ASSET)], partition, tags, "floor")
    final = launch.wait_run(client, run_id, 1, poll_s=0.5, timeout_s=600)
    if not final.succeeded:
        raise RuntimeError(f"the floor's empty run {run_id} ended {final.line()}")
    record = instance.get_run_record_by_id(run_id)
    return float(record.end_time - clicked)


def hand_hour(
    session: Any,
    settings: Any,
    spec: Any,
    first: datetime,
    ranges: list[tuple[Any, str, str]],
) -> list[Any]:
    """bench/hand_floor.py's jobs for Kafka hour ``first``: its offsets read and parsed into the
    raw table, the events' winners, the current state, and each declared table the hour's
    backfill wrote, over that table's range; each output timed."""
    import hand_floor

    from backfill_assets.lake.offsets.contract import offset_contract
    from backfill_assets.stack.kafka import KafkaClient

    contract = offset_contract(KafkaClient(), spec.topic, first, first + timedelta(hours=1))
    declared = {t.name for t in spec.tables}
    ends = {
        key.path[-1]: (
            datetime.strptime(a, PARTITION_FMT).replace(tzinfo=UTC),
            datetime.strptime(b, PARTITION_FMT).replace(tzinfo=UTC) + timedelta(hours=1),
        )
        for key, a, b in ranges
        if key.path[-1] in declared
    }
    return list(hand_floor.run(session, settings, spec, [contract], ends))


def report_floor(rows: list[dict[str, Any]]) -> None:
    """Per measured hour: launch -> published against its floor (the empty run + the
    hand-written jobs), and the median ratio."""
    print("\nfloor per hour: empty Dagster run + hand-written jobs (same Connect server)")
    print("| run | PUBLISHED | empty run | hand-written (outputs) | floor | ratio | load |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        hand = sum(o.seconds for o in row["hand"])
        floor = row["empty_run_s"] + hand
        parts = ", ".join(f"{o.name} {o.seconds:.1f}" for o in row["hand"])
        print(
            f"| {row['backfill_id'][:8]} | {row['published_s']:.1f} | {row['empty_run_s']:.1f} | "
            f"{hand:.1f} ({parts}) | {floor:.1f} | **{row['published_s'] / floor:.2f}x** | "
            f"{row['floor_load']} |"
        )
    ratios = [
        r["published_s"] / (r["empty_run_s"] + sum(o.seconds for o in r["hand"])) for r in rows
    ]
    print(f"median ratio {statistics.median(ratios):.2f}x (goal <= {FLOOR_GOAL:.0f}x)")


def report(rows: list[dict[str, Any]], title: str) -> None:
    names = [name for name, _ in PHASES]
    short = {
        "launch": "launch",
        "backfill_tick": "bf tick",
        "run_queue": "queue",
        "run_launch": "run proc",
        "run_code_load": "run code",
        "step_launch": "step proc",
        "step_code_load": "step code",
        "spark_start": "spark",
        "work": "work",
        "checks": "checks",
        "publish": "publish",
        "dagster_other": "other",
    }
    print(f"\n{title}")
    head = ["backfill", *[short[n] for n in names], "PUBLISHED", "completed", "load"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [row["backfill_id"], *[f"{row['phases'][n]:.1f}" for n in names]]
        cells += [f"**{row['published_s']:.1f}**", f"{row['completed_s']:.1f}", row["load"]]
        print("| " + " | ".join(cells) + " |")
    if len(rows) > 1:
        med = [statistics.median(r["phases"][n] for r in rows) for n in names]
        pub = statistics.median(r["published_s"] for r in rows)
        done = statistics.median(r["completed_s"] for r in rows)
        cells = ["median", *[f"{m:.1f}" for m in med], f"**{pub:.1f}**", f"{done:.1f}", ""]
        print("| " + " | ".join(cells) + " |")
        print(f"median launch-to-published {pub:.1f} s (goal <= {GOAL_S:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="1-hour backfills measured")
    parser.add_argument("--warmup", type=int, default=1, help="1-hour backfills not counted")
    parser.add_argument("--events-per-hour", type=int, default=600)
    parser.add_argument("--dagster-yaml", type=Path, default=REPO_ROOT / "dagster.yaml")
    parser.add_argument(
        "--stagger",
        type=float,
        default=30.0,
        help="wait a random 0..S s (seeded) before each launch, so the launch falls anywhere "
        "in the backfill daemon's 30 s loop as an operator's would; 0 launches right after the "
        "previous backfill completed (just after a daemon tick: its worst case)",
    )
    parser.add_argument(
        "--as-backfill",
        action="store_true",
        help="launch each hour as a backfill object (backfill-assets backfill --as-backfill), "
        "not as one run",
    )
    parser.add_argument(
        "--connect",
        action="store_true",
        help="runs are thin clients of a warm local Spark Connect server (started here, as "
        "`stack up` does, before the services; BACKFILL_SPARK_CONNECT in their environment)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="after each measured hour, its floor: an empty run launched the same way plus the "
        "hand-written jobs for the hour on the same Connect server (needs --connect)",
    )
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--keep", action="store_true", help="keep the temporary home")
    parser.add_argument("--dump", action="store_true", help="print every event of each run")
    args = parser.parse_args()
    if args.floor and not args.connect:
        parser.error("--floor needs --connect (the floor's jobs run on the same warm server)")
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import

    home = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    env = {
        "BACKFILL_HOME": str(home),
        "BACKFILL_JAR_CACHE": os.environ.get(
            "BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars")
        ),
        "BACKFILL_KAFKA_PORT": str(free_port()),
        "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
        "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
        "PYICEBERG_HOME": str(home / "pyiceberg-home"),
        "BACKFILL_SENSORS": "off",
    }
    os.environ.update(env)
    import dagster as dg

    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.demo.generator import GeneratorConfig, generate
    from backfill_assets.ops import launch
    from backfill_assets.ops.cli import common
    from backfill_assets.stack import catalog, jars
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    rng = random.Random(args.seed)
    settings = Settings.from_env()
    jars.resolve_all(settings)
    broker = LocalBroker(settings)
    broker.start()
    server = None
    session = None
    rows: list[dict[str, Any]] = []
    try:
        if args.connect:
            from backfill_assets.stack.connect import LocalConnectServer

            os.environ["BACKFILL_SPARK_CONNECT_PORT"] = str(free_port())
            server = LocalConnectServer(Settings.from_env())
            began = time.monotonic()
            print(server.start().describe(), f"(started in {time.monotonic() - began:.1f} s)")
            os.environ["BACKFILL_SPARK_CONNECT"] = server.url
        spec = next(s for s in SPECS if s.topic == "orders")
        tables = [spec.raw_table, spec.current_table, *(t.name for t in spec.tables)]
        generate(
            settings,
            GeneratorConfig(
                topic=spec.topic,
                start=HISTORY_START,
                hours=args.warmup + args.runs + 1,
                events_per_hour=args.events_per_hour,
                seed=7,
            ),
        )
        catalog.init_local_catalog(settings.catalog)
        cat = catalog.load(settings.catalog)
        cat.create_namespace_if_not_exists(settings.catalog.namespace)
        print(f"load {loadavg()}: a Spark session alone, in a fresh process", flush=True)
        for _ in range(2):
            alone = spark_alone(dict(os.environ))
            print("  " + ", ".join(f"{k} {v:.1f} s" for k, v in alone.items()), flush=True)
        dagster_home = home / "dagster-home"
        workspace = None
        if args.floor:
            from backfill_assets.stack import spark as spark_mod

            workspace = home / "workspace.yaml"
            workspace.write_text(
                FLOOR_WORKSPACE.format(
                    path=REPO_ROOT / "bench" / "floor_location.py", root=REPO_ROOT
                )
            )
            session = spark_mod.get_session(Settings.from_env())
        with (
            dagster_services(
                dagster_home,
                dict(os.environ),
                args.dagster_yaml,
                start_timeout_s=180,
                workspace=workspace,
            ) as url,
            dg.DagsterInstance.from_config(str(dagster_home)) as instance,
        ):
            client = launch.DagsterClient(url)
            for i in range(args.warmup + args.runs):
                first = HISTORY_START + timedelta(hours=i)
                ranges = [
                    (key, f"{a:{PARTITION_FMT}}", f"{b - timedelta(hours=1):{PARTITION_FMT}}")
                    for keys, a, b in common.ranges(spec, first, first + timedelta(hours=1))
                    for key in keys
                ]
                time.sleep(rng.uniform(0, args.stagger))
                load = loadavg()
                clicked = time.time()
                tags = {"backfill_assets/launched_by": "bench:latency"}
                partition = None if args.as_backfill else launch.single_partition(ranges)
                if partition is not None:
                    keys = [key for key, _, _ in ranges]
                    backfill_id = launch.launch_run(client, keys, partition, tags, "bench")
                    final = launch.wait_run(
                        client, backfill_id, len(keys), poll_s=1.0, timeout_s=1200
                    )
                else:
                    backfill_id = launch.launch_backfill(client, ranges, tags, "bench")
                    final = launch.wait(client, backfill_id, poll_s=1.0, timeout_s=1200)
                if not final.succeeded:
                    raise RuntimeError(f"{backfill_id} ended {final.line()}")
                row = breakdown(
                    instance,
                    cat,
                    settings.catalog.namespace,
                    tables,
                    backfill_id,
                    clicked,
                    single_run=partition is not None,
                )
                row["load"] = f"{load} -> {loadavg()}"
                warm = i < args.warmup
                print(
                    f"{'warm-up ' if warm else ''}{'run' if partition else 'backfill'} "
                    f"{backfill_id} "
                    f"{first:{PARTITION_FMT}}: published {row['published_s']:.1f} s, "
                    f"completed {row['completed_s']:.1f} s, {row['runs']} run(s), "
                    f"load {row['load']}",
                    flush=True,
                )
                if args.dump:
                    dump_events(instance, backfill_id, clicked)
                if args.floor and partition is not None:
                    row["floor_load"] = loadavg()
                    row["empty_run_s"] = empty_run(client, instance, partition)
                    row["hand"] = hand_hour(session, Settings.from_env(), spec, first, ranges)
                    print(
                        f"  floor: empty run {row['empty_run_s']:.1f} s, hand-written "
                        + ", ".join(f"{o.name} {o.seconds:.1f} s" for o in row["hand"]),
                        flush=True,
                    )
                if not warm:
                    rows.append(row)
        print(f"\ndagster.yaml: {args.dagster_yaml}")
        print(f"load at the end {loadavg()}")
        report(rows, "seconds per phase, click -> last ASSET_MATERIALIZATION (PUBLISHED)")
        for name, what in PHASES:
            print(f"  {name}: {what}")
        if args.floor and rows and "hand" in rows[0]:
            report_floor(rows)
    finally:
        if session is not None:  # its client threads would keep this process from exiting
            session.stop()
        if server is not None:
            server.stop()
        broker.stop()
        if args.keep:
            print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
