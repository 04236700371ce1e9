"""Benchmark: the north star. A whole hostile history backfilled as ONE backfill, checked exact.

Starts its own broker (free 127.0.0.1 ports; the ports, the broker's data, the history and its
ground truth live in ``--home`` and are reused by later runs with the same sizes), writes
``--days`` x 24 hours of the ``orders`` topic with the hostile generator
(backfill_assets_tests/support/hostile.py: several producers with skewed clocks, transactions of
which a share is aborted, identical re-sends, corrections, tombstones, late events), grows the
topic from ``--partitions`` minus a quarter to ``--partitions`` halfway through (a partition
added mid-way) and puts a few bad records (not JSON, a missing field, a value outside the
contract) at that point, then keeps the ground truth (truth.parquet in ``--home``).
The hostile plan is produced asynchronously (each producer's records in plan order, producers
interleaved as the broker receives them; the truth from the delivery reports) in transactions
of 1..``--transaction-records``; ``--acked`` uses hostile.produce itself (a record
acknowledged before the next: ~150 records/s here). ``--generate-only`` stops after that.
The plan is Python objects while the history is generated (~0.9 KiB per record: ~9 GiB at 10 M
records); the truth is then kept as columns: truth.parquet is read a batch at a time into the
records' light columns (position, timestamp, event id, committed, hash; no key or value), and
every table's truth is computed and compared as Arrow tables
(backfill_assets_tests/support/columnar_truth.py, checked against hostile.py's rules by
backfill_assets_tests/lake/test_columnar_truth.py).

Each run then, on fresh tables (a new catalog namespace; the Dagster instance in ``--home`` is
kept, so a later run's planner has the earlier runs as history, as an operator's stack has):

1. the planner's prediction for the whole range (``backfill-assets plan``: make_plan), with its
   breakdown and confidence;
2. ONE backfill of the whole range through its own webserver + daemon
   (bench/latency.py's services), launched as ``backfill-assets backfill`` and the UI launch it
   (GraphQL ``launchPartitionBackfill``): raw + current state + every declared table of the
   topic, over the ranges ``planner.backfill_ranges`` lists; waited for;
3. wall end to end (click -> last materialization), records/s, seconds per asset from the runs'
   step events, refusals (failed runs, failed blocking checks), the prediction's error, and the
   peak RSS (VmHWM) of the run worker processes and their Spark JVMs, sampled from /proc;
4. every table compared with the ground truth (PASS/FAIL per table, naming the missing, extra,
   duplicated and differing keys; exit status 1 on a FAIL or a refusal), the benchmark's own
   peak RSS (VmHWM), and one markdown summary row for bench/README.md.

The issue 31 goals: <= 5 min wall, 0 refusals, every table exact, driver RSS 10x/1x <= 1.2x
(run ``--days 3`` and ``--days 30`` into two homes), prediction within +-25%.

The backfill's wall, command and load are kept in ``--home``'s state (bench-history.json).
``--hand-written`` runs instead the floor: the jobs a user would write by hand for the same
outputs (bench/hand_floor.py: the raw table by ``from_json``, the events' winners, the current
state and each declared table by Spark SQL, into Iceberg namespace ``bench_hand``) on the same
history, engine and driver memory, ``--floor-runs`` times; prints each output's seconds and
rows, checks every hand-written table against the same truth (PASS/FAIL) and prints the ratio
backfill / floor (goal: <= 2.5x) when the home holds a backfill's wall.

Run from the repository root (jars resolved by scripts/bootstrap.sh):
    .venv/bin/python bench/northstar.py --home /tmp/bench-northstar          # 30 d x 12 p
    .venv/bin/python bench/northstar.py --days 3 --home /tmp/bench-northstar-3d  # RSS 1x
    .venv/bin/python bench/northstar.py --days 1 --partitions 3 --events-per-hour 300 \\
        --home /tmp/bench-northstar-small
    .venv/bin/python bench/northstar.py --home /tmp/bench-northstar --hand-written  # the floor
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import threading
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hand_floor  # bench/hand_floor.py: the hand-written jobs of the floor
import latency  # bench/latency.py: the services and the phase breakdown
import numpy as np
import pyarrow as pa

from backfill_assets.demo.generator import HOUR_MS, _wait_for_topic, partition_for
from backfill_assets_tests.support import columnar_truth as ct
from backfill_assets_tests.support import hostile
from backfill_assets_tests.support.services import dagster_services, free_port

if TYPE_CHECKING:
    from backfill_assets.spec.model import TopicSpec
    from backfill_assets.stack.settings import Settings

HISTORY_START = datetime(2026, 6, 1, tzinfo=UTC)
PARTITION_FMT = "%Y-%m-%d-%H:%M"
WALL_GOAL_S = 300.0
PLAN_GOAL = 0.25
FLOOR_GOAL = 2.5  # the backfill's wall <= 2.5x the hand-written jobs' (the floor)
# 30 d x 24 h x 11,700 slots x ~1.2 (re-sends and corrections on top) ~= 10.1 M offsets.
DEFAULT_EVENTS_PER_HOUR = 11_700
BAD_PAYLOADS = (
    b"{not json",
    b'{"schema_version": 2, "event_id": "bad-missing-fields"}',
    b'{"schema_version": 2, "event_id": "bad-amount", "order_id": "o-bad", '
    b'"customer_id": "c-bad", "event_type": "created", "status": "open", '
    b'"amount_minor": -5, "currency": "EUR", "channel": "web", "event_time": 0}',
)


# --------------------------------------------------------------------------------------------
# History: generated once into --home, with its ground truth
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class History:
    truth: ct.Truth  # the records' light columns, read from truth.parquet
    bad: set[tuple[int, int]]  # positions of the bad records (quarantined, not in the raw table)
    records: int
    generated_s: float


class _Reports(list[tuple[Any, int]]):
    def append_delivery(self, err: Any, msg: Any) -> None:
        self.append((err, msg.offset()))


def _produce_bad(settings: Settings, topic: str, partitions: int, at_ms: int, n: int) -> list[Any]:
    """``n`` bad records, round-robin over the partitions, plain (non-transactional) producer,
    stamped ``at_ms``; acknowledged one by one so the truth has their offsets."""
    from confluent_kafka import Producer

    producer = Producer({**settings.kafka.client_config(), "linger.ms": 0})
    out = []
    for i in range(n):
        partition, value = i % partitions, BAD_PAYLOADS[i % len(BAD_PAYLOADS)]
        report = _Reports()
        producer.produce(
            topic,
            value=value,
            key=f"bad-{i}".encode(),
            partition=partition,
            timestamp=at_ms,
            on_delivery=report.append_delivery,
        )
        producer.flush(30)
        if not report or report[0][0] is not None:
            raise RuntimeError(f"bad record {i} to partition {partition} failed: {report}")
        out.append(
            hostile.HostileRecord(
                partition=partition,
                offset=report[0][1],
                timestamp_ms=at_ms,
                key=f"bad-{i}".encode(),
                value=value,
                event_id=None,  # not an event: no winner, no current state
                producer=-1,
                kind="event",
            )
        )
    return out


def _wait_stable(topic: str) -> None:
    """Transaction markers land just after commit returns: wait until LSO == HW everywhere."""
    from backfill_assets.stack.kafka import KafkaClient

    kafka = KafkaClient()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(lso == hw for _low, lso, hw in kafka.log_ends(topic).values()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{topic}: a transaction stayed open")


def produce_async(
    settings: Settings, config: hostile.HostileConfig, plan: list[Any], first: int, last: int
) -> hostile.HostileTruth:
    """hostile.produce's records of hours ``first..last`` (same plan, producers, transactions,
    aborts, partitioning and timestamps), sent without waiting for each acknowledgement: each
    producer's records stay in plan order (idempotent producers), but producers interleave
    freely within a partition. The truth still comes from the delivery reports (offsets)."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(dict(settings.kafka.client_config()))
    if not hostile._topic_exists(admin, config.topic):
        hostile.create_topic(settings, config)
    partitions = _wait_for_topic(admin, config.topic)
    producers = []
    for i in range(len(config.producer_skews_ms)):
        producer = Producer(
            {
                **settings.kafka.client_config(),
                "transactional.id": f"{config.topic}.hostile.{i}",
                "transaction.timeout.ms": config.transaction_timeout_ms,
                "linger.ms": 5,
                "retry.backoff.ms": 10,
            }
        )
        producer.init_transactions(30)
        producers.append(producer)
    records: list[hostile.HostileRecord] = []
    errors: list[str] = []

    def report(item: Any, partition: int) -> Any:
        def on_delivery(err: Any, msg: Any) -> None:
            if err is not None or msg.timestamp()[1] != item.timestamp_ms(config):
                errors.append(f"{item.index}: {err} {msg.timestamp()}")
                return
            records.append(
                hostile.HostileRecord(
                    partition=partition,
                    offset=msg.offset(),
                    timestamp_ms=msg.timestamp()[1],
                    key=item.key,
                    value=item.value,
                    event_id=item.event_id,
                    producer=item.producer,
                    kind=item.kind,
                    committed=item.commit,
                )
            )

        return on_delivery

    in_txn: set[int] = set()
    try:
        for item in plan:
            if not first <= item.hour_index(config) <= last:
                continue
            producer = producers[item.producer]
            if item.producer not in in_txn:
                producer.begin_transaction()
                in_txn.add(item.producer)
            partition = partition_for(item.order_id, partitions)
            while True:
                try:
                    producer.produce(
                        config.topic,
                        value=item.value,
                        key=item.key,
                        partition=partition,
                        timestamp=item.timestamp_ms(config),
                        headers=[(hostile.PRODUCER_HEADER, str(item.producer).encode())],
                        on_delivery=report(item, partition),
                    )
                    break
                except BufferError:
                    producer.poll(0.05)
            producer.poll(0)
            if item.ends_transaction:
                if item.commit:
                    producer.commit_transaction(30)  # flushes this producer's records first
                else:
                    producer.flush(30)  # their offsets, then the abort
                    producer.abort_transaction(30)
                in_txn.discard(item.producer)
    except KafkaException as exc:
        raise RuntimeError(f"producing to {config.topic!r} failed: {exc}") from exc
    finally:
        for index in sorted(in_txn):
            producers[index].abort_transaction(30)
        for producer in producers:
            producer.flush(30)
    if errors:
        raise RuntimeError(f"{len(errors)} records failed, e.g. {errors[:3]}")
    return hostile.HostileTruth(topic=config.topic, partitions=partitions, records=tuple(records))


def _produce(
    settings: Settings,
    args: argparse.Namespace,
    config: hostile.HostileConfig,
    plan: list[Any],
    first: int,
    last: int,
) -> hostile.HostileTruth:
    if args.acked:
        return hostile.produce(settings, config, first, last)
    return produce_async(settings, config, plan, first, last)


def generate_history(settings: Settings, args: argparse.Namespace, home: Path) -> History:
    hours = args.days * 24
    before = max(1, args.partitions - max(1, args.partitions // 4))
    config = hostile.HostileConfig(
        start=HISTORY_START,
        topic="orders",
        partitions=before,
        hours=hours,
        events_per_hour=args.events_per_hour,
        seed=args.seed,
        max_transaction_records=args.transaction_records,
    )
    plan = [] if args.acked else hostile.plan_hostile(config)
    mid = hours // 2 if hours > 1 and before < args.partitions else hours
    began = time.monotonic()
    phases = [_produce(settings, args, config, plan, 0, mid - 1)]
    print(f"  produced hours 0..{mid - 1} ({time.monotonic() - began:.0f}s)", flush=True)
    _wait_stable("orders")
    at_ms = config.start_ms + (mid - 1) * HOUR_MS + 30 * 60_000
    bad = _produce_bad(settings, "orders", before, at_ms, max(before, args.events_per_hour // 100))
    phases.append(hostile.HostileTruth(topic="orders", partitions=before, records=tuple(bad)))
    if mid < hours:
        hostile.add_partitions(settings, "orders", args.partitions)
        phases.append(_produce(settings, args, config, plan, mid, hours - 1))
        _wait_stable("orders")
    seconds = time.monotonic() - began
    records = ct.write(hostile.merge(*phases).records, home / "truth.parquet")
    del phases, plan  # the objects: from here on the truth is columns
    return History(ct.read(home / "truth.parquet"), {r.position for r in bad}, records, seconds)


# --------------------------------------------------------------------------------------------
# Peak RSS of the run workers, sampled from /proc
# --------------------------------------------------------------------------------------------


def _proc(pid: str, name: str) -> str:
    try:
        return (Path("/proc") / pid / name).read_text(errors="replace")
    except OSError:
        return ""


def _run_workers(home: str) -> tuple[dict[int, int], set[int]]:
    """(parent of every visible pid, the run workers of this bench's instance): a run worker is
    the code server's child that executes a run (``dagster api execute_run``, or the
    multiprocessing child the gRPC code server forks for it) with this ``BACKFILL_HOME``."""
    parents, workers = {}, set()
    marker = f"BACKFILL_HOME={home}\0"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _proc(pid, "stat")
        if not stat:
            continue
        parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
        cmdline = _proc(pid, "cmdline")
        if ("execute_run" in cmdline or "multiprocessing-fork" in cmdline) and marker in _proc(
            pid, "environ"
        ):
            workers.add(int(pid))
    return parents, workers


def _vm_hwm_kib(pid: int) -> int:
    for line in _proc(str(pid), "status").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


@contextmanager
def rss_sampler(home: str, every_s: float = 0.5) -> Iterator[dict[str, dict[int, int]]]:
    """Peak VmHWM (KiB) per pid of every run worker and of the Spark driver JVM below it:
    ``{"python": {pid: kib}, "jvm": {pid: kib}}`` (Spark's Python workers are not counted)."""
    peaks: dict[str, dict[int, int]] = {"python": {}, "jvm": {}}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            parents, workers = _run_workers(home)
            for pid in parents:
                p, depth = pid, 0
                while p not in workers and p in parents and depth < 20:
                    p, depth = parents[p], depth + 1
                if p not in workers:
                    continue
                if pid in workers:
                    kind = "python"
                elif _proc(str(pid), "comm").strip() == "java":
                    kind = "jvm"
                else:
                    continue
                peaks[kind][pid] = max(peaks[kind].get(pid, 0), _vm_hwm_kib(pid))
            stop.wait(every_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peaks
    finally:
        stop.set()
        thread.join()


# --------------------------------------------------------------------------------------------
# The backfill and its breakdown
# --------------------------------------------------------------------------------------------


def by_asset(
    instance: Any, backfill_id: str
) -> tuple[dict[str, dict[str, float]], list[str], dict[str, list[tuple[str, float]]]]:
    """Per asset: runs, step seconds (STEP_START -> STEP_SUCCESS/FAILURE of the step that
    materialized it), materializations; the refusals (failed runs, failed checks); and per
    asset, each run's (first partition, step seconds), in partition order."""
    import dagster as dg

    runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_run: dict[str, list[tuple[str, float]]] = defaultdict(list)
    refusals = []
    for run in runs:
        if run.status != dg.DagsterRunStatus.SUCCESS:
            refusals.append(f"run {run.run_id[:8]} {run.status.value}")
        started: dict[str, float] = {}
        ended: dict[str, float] = {}
        assets_of: dict[str, set[str]] = defaultdict(set)
        for entry in instance.all_logs(run.run_id):
            event = entry.dagster_event
            if event is None:
                continue
            kind, step = event.event_type_value, entry.step_key or ""
            if kind == "STEP_START":
                started[step] = entry.timestamp
            elif kind in ("STEP_SUCCESS", "STEP_FAILURE"):
                ended[step] = entry.timestamp
            elif kind == "ASSET_MATERIALIZATION":
                assets_of[step].add(event.asset_key.to_user_string())
            elif kind == "ASSET_CHECK_EVALUATION":
                check = event.event_specific_data
                if not check.passed and check.severity == dg.AssetCheckSeverity.ERROR:
                    refusals.append(f"check {check.asset_check_key.to_user_string()} failed")
        for step, names in assets_of.items():
            label = " + ".join(sorted(names))
            seconds = ended.get(step, 0.0) - started.get(step, 0.0)
            out[label]["runs"] += 1
            out[label]["seconds"] += seconds
            first = run.tags.get("dagster/asset_partition_range_start", "")
            per_run[label].append((first, seconds))
    return (
        {k: dict(v) for k, v in out.items()},
        refusals,
        {k: sorted(v) for k, v in per_run.items()},
    )


def _on_change() -> Any:
    """Print a progress line when it says something new (not every poll)."""
    seen: list[tuple[int, int, str]] = []

    def show(progress: Any) -> None:
        state = (progress.done, progress.failed, progress.status)
        if not seen or seen[-1] != state:
            seen.append(state)
            print(f"  {progress.elapsed_s:6.1f}s {progress.line()}", flush=True)

    return show


def launch_range(
    client: Any, spec: TopicSpec, first: datetime, end: datetime, timeout_s: float
) -> tuple[str, Any, float]:
    """The whole range as ONE backfill, as ``backfill-assets backfill`` launches it."""
    from backfill_assets.ops import launch, planner

    ranges = [
        (key, f"{a:{PARTITION_FMT}}", f"{b - timedelta(hours=1):{PARTITION_FMT}}")
        for keys, a, b in planner.backfill_ranges(spec, first, end)
        for key in keys
    ]
    tags = {"backfill_assets/launched_by": "bench:northstar"}
    clicked = time.time()
    backfill_id = launch.launch_backfill(client, ranges, tags, "bench northstar")
    final = launch.wait(
        client,
        backfill_id,
        poll_s=2.0,
        timeout_s=timeout_s,
        on_progress=_on_change(),
    )
    return backfill_id, final, clicked


# --------------------------------------------------------------------------------------------
# Every table against the ground truth
# --------------------------------------------------------------------------------------------


def _table(cat: Any, namespace: str, table: str, fields: list[str]) -> pa.Table:
    """Only ``fields`` of a table, timestamps as epoch millis (UTC), integers as int64."""
    scan = cat.load_table(f"{namespace}.{table}").scan(selected_fields=tuple(fields))
    return ct.epoch_ms(scan.to_arrow())


def _ms(value: datetime) -> int:
    return int(value.astimezone(UTC).timestamp() * 1000)


def verify(
    cat: Any,
    namespace: str,
    spec: TopicSpec,
    history: History,
    first: datetime,
    end: datetime,
    table_ends: dict[str, datetime],
) -> dict[str, str]:
    """PASS or FAIL (with what differs) per table, every table against its columnar truth."""
    truth = history.truth
    hours = int((end - first) / timedelta(hours=1))
    exp = ct.expected(truth, _ms(first), hours, history.bad)
    position = ["kafka_partition", "kafka_offset"]
    want = ct.raw(truth, exp)
    result = {
        spec.raw_table: ct.compare(
            _table(cat, namespace, spec.raw_table, want.column_names), want, position
        )
    }
    del want
    hit = (exp.hour >= 0) & np.isin(truth.keys(), ct.keys_of(history.bad))
    quarantined = pa.table(
        {
            "kafka_partition": pa.array(truth.column("partition")[hit], pa.int64()),
            "kafka_offset": pa.array(truth.column("offset")[hit], pa.int64()),
        }
    )
    result[spec.quarantine_table] = ct.compare(
        _table(cat, namespace, spec.quarantine_table, position), quarantined, position
    )
    want = ct.current(truth, exp)
    result[spec.current_table] = ct.compare(
        _table(cat, namespace, spec.current_table, want.column_names), want, ["order_id"]
    )
    for name, table_end in table_ends.items():
        result[name] = _declared(cat, namespace, name, exp, _ms(first), _ms(table_end))
    return result


def _declared(
    cat: Any, namespace: str, name: str, exp: ct.Expected, first_ms: int, end_ms: int
) -> str:
    """PASS or FAIL of a declared table of ``orders`` (their SQL is in spec/tables)."""
    if name == "orders_hourly":
        want, keys = ct.hourly(exp, first_ms, end_ms), ["event_hour", "currency"]
    elif name == "orders_large_paid":
        want = ct.large_paid(exp, first_ms, end_ms)
        keys = want.column_names  # compared as a set of rows
    else:
        raise SystemExit(
            f"no ground truth for declared table {name}: add one to bench/northstar.py"
        )
    return ct.compare(_table(cat, namespace, name, want.column_names), want, keys)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _setup(args: argparse.Namespace) -> tuple[Path, dict[str, Any], Path]:
    home = Path(args.home or f"/tmp/bench-northstar-{args.days}d-{args.partitions}p").resolve()
    home.mkdir(parents=True, exist_ok=True)
    sizes = {
        "days": args.days,
        "partitions": args.partitions,
        "events_per_hour": args.events_per_hour,
        "seed": args.seed,
        "transaction_records": args.transaction_records,
        "acked": args.acked,
    }
    state_path = home / "bench-history.json"
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
    if state and state["history"] != sizes:
        raise SystemExit(
            f"{home} holds another history ({state['history']}, this run needs {sizes}); "
            "pass another --home or delete that one"
        )
    state.setdefault("history", sizes)
    ports = state.setdefault("ports", {"kafka": free_port(), "controller": free_port()})
    os.environ.update(
        {
            "BACKFILL_HOME": str(home),
            "BACKFILL_JAR_CACHE": os.environ.get(
                "BACKFILL_JAR_CACHE", str(latency.REPO_ROOT / ".stack" / "jars")
            ),
            "BACKFILL_KAFKA_PORT": str(ports["kafka"]),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(ports["controller"]),
            "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
            "PYICEBERG_HOME": str(home / "pyiceberg-home"),
            "BACKFILL_SENSORS": "off",
            # fresh tables each run; the Kafka history and the Dagster instance are kept
            "BACKFILL_NAMESPACE": f"northstar_{uuid.uuid4().hex[:6]}",
        }
    )
    return home, state, state_path


def _history(
    settings: Settings, args: argparse.Namespace, home: Path, state: dict[str, Any], path: Path
) -> History:
    if "records" in state:
        truth = ct.read(home / "truth.parquet")
        bad = {(p, o) for p, o in state["bad"]}
        print(
            f"reusing {state['records']:,} records ({home}), generated in "
            f"{state['generated_s']:.0f}s at {state['records'] / state['generated_s']:,.0f} "
            "records/s",
            flush=True,
        )
        return History(truth, bad, state["records"], state["generated_s"])
    history = generate_history(settings, args, home)
    state.update(records=history.records, generated_s=history.generated_s, bad=sorted(history.bad))
    path.write_text(json.dumps(state, indent=1))
    full = 30 * 24 * DEFAULT_EVENTS_PER_HOUR * 1.2  # re-sends, corrections (aborted incl.)
    rate = history.records / history.generated_s
    print(
        f"generated {history.records:,} records (offsets, aborted included; "
        f"{len(history.bad)} bad) in {history.generated_s:.0f}s: {rate:,.0f} records/s; "
        f"the default size (~{full / 1e6:.1f} M) would take ~{full / rate / 3600:.1f} h",
        flush=True,
    )
    return history


def _table_ends(spec: TopicSpec, first: datetime, end: datetime) -> dict[str, datetime]:
    """Each declared table of ``spec`` and the end of the event-time hours a backfill of Kafka
    hours [first, end) gives it (``planner.backfill_ranges``)."""
    from backfill_assets.ops import planner

    return {
        key.path[-1]: b
        for keys, _a, b in planner.backfill_ranges(spec, first, end)[1:]
        for key in keys
    }


def hand_written_floor(
    settings: Settings, spec: TopicSpec, days: int, runs: int
) -> list[list[hand_floor.Output]]:
    """bench/hand_floor.py's jobs over the whole history (the raw table one append per day),
    ``runs`` times on the runs' engine and driver memory; every run's outputs, printed as they
    come. Each run replaces the tables of the one before."""
    from backfill_assets.lake.offsets.contract import offset_contract
    from backfill_assets.stack import catalog
    from backfill_assets.stack import spark as spark_mod
    from backfill_assets.stack.kafka import KafkaClient

    catalog.init_local_catalog(settings.catalog)
    kafka = KafkaClient()
    day = timedelta(days=1)
    contracts = [
        offset_contract(kafka, spec.topic, HISTORY_START + d * day, HISTORY_START + (d + 1) * day)
        for d in range(days)
    ]
    end = HISTORY_START + days * day
    ends = {name: (HISTORY_START, b) for name, b in _table_ends(spec, HISTORY_START, end).items()}
    spark = spark_mod.get_session(settings)
    print(
        f"hand-written jobs over {sum(c.offsets for c in contracts):,} offsets (raw in {days} "
        f"daily appends, then events, current, {', '.join(ends)}), Spark "
        f"{settings.spark_master}, driver {settings.spark_driver_memory}, load "
        f"{latency.loadavg()}",
        flush=True,
    )
    out = []
    for attempt in range(1, runs + 1):
        outputs = hand_floor.run(spark, settings, spec, contracts, ends)
        total = sum(o.seconds for o in outputs)
        print(
            f"  run {attempt}: "
            + ", ".join(f"{o.name} {o.seconds:.1f} s" for o in outputs)
            + f"; total {total:.1f} s (load {latency.loadavg()})",
            flush=True,
        )
        out.append(outputs)
    return out


def verify_hand(
    cat: Any, spec: TopicSpec, history: History, first: datetime, end: datetime
) -> dict[str, str]:
    """PASS or FAIL of each hand-written table against the truth the backfill's tables are
    compared with. The raw table is compared on what it holds: positions and Kafka timestamp
    (no ``kafka_hour``, ``record_hash``: a hand-written job has neither)."""
    truth, ns = history.truth, hand_floor.NAMESPACE
    hours = int((end - first) / timedelta(hours=1))
    exp = ct.expected(truth, _ms(first), hours, history.bad)
    position = ["kafka_partition", "kafka_offset"]
    want = ct.raw(truth, exp).select([*position, "kafka_timestamp"])
    result = {"raw": ct.compare(_table(cat, ns, spec.raw_table, want.column_names), want, position)}
    del want
    want = ct.current(truth, exp)
    result["current"] = ct.compare(
        _table(cat, ns, spec.current_table, want.column_names), want, [spec.current_rule.key]
    )
    for name, table_end in _table_ends(spec, first, end).items():
        result[name] = _declared(cat, ns, name, exp, _ms(first), _ms(table_end))
    return result


def report_floor(
    runs: list[list[hand_floor.Output]],
    checks: dict[str, str],
    backfill: dict[str, Any] | None,
    command: str,
) -> bool:
    """Print the floor (the best run's outputs), each table's verdict and the ratio to the
    home's last backfill; True when every hand-written table is exact."""
    best = min(runs, key=lambda outputs: sum(o.seconds for o in outputs))
    floor = sum(o.seconds for o in best)
    print(f"\nfloor (best of {len(runs)} run(s)): output, seconds, rows, against the truth")
    for o in best:
        verdict = checks.get(o.name, "not a table (cached for current and the declared tables)")
        print(f"  {o.name}: {o.seconds:.1f} s, {o.rows:,} rows, {verdict}")
    print(f"  total {floor:.1f} s (load {latency.loadavg()})")
    print(
        "  not written by hand: the quarantine table (the contract's refused records are "
        "dropped by a filter), the raw table's kafka_hour (offset windows), record_hash, "
        "Kafka key/value bytes and offset tags"
    )
    if backfill is None:
        print("no backfill recorded in this home: run it (without --hand-written) for the ratio")
    else:
        print(
            f"backfill {backfill['wall_s']:.1f} s / floor {floor:.1f} s = "
            f"{backfill['wall_s'] / floor:.2f}x (goal <= {FLOOR_GOAL}x); the backfill: "
            f"{backfill['at']}, load {backfill['load']}, {backfill['verdict']}\n"
            f"  {backfill['command']}"
        )
    print(f"\n{command}")
    return all(v.startswith("PASS") for v in checks.values())


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--partitions", type=int, default=12, help="after the mid-way growth")
    parser.add_argument(
        "--events-per-hour",
        type=int,
        default=DEFAULT_EVENTS_PER_HOUR,
        help="hostile slots per hour (re-sends and corrections come on top: ~1.2x records)",
    )
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument(
        "--transaction-records",
        type=int,
        default=200,
        help="the hostile producers' transactions hold 1..N records, a share of them aborted "
        "(hostile.py's default is 4: a commit per ~2.5 records, ~200 records/s here; 200 "
        "generates ~15x faster)",
    )
    parser.add_argument(
        "--acked",
        action="store_true",
        help="produce with hostile.produce (each record acknowledged before the next: the "
        "plan's exact interleaving, ~150 records/s here) instead of asynchronously",
    )
    parser.add_argument("--home", help="keeps the broker, the history and its truth for later runs")
    parser.add_argument(
        "--generate-only",
        action="store_true",
        help="generate (or reuse) the history in --home, print the generation rate, stop",
    )
    parser.add_argument(
        "--hand-written",
        action="store_true",
        help="instead of the backfill: the jobs a user would write by hand for the same "
        "outputs (bench/hand_floor.py: raw by from_json, current state and declared tables by "
        "Spark SQL, into Iceberg; no audit, no checks) over the whole history, each table "
        "checked against the truth, and the ratio to the home's last backfill: the floor",
    )
    parser.add_argument(
        "--floor-runs", type=int, default=2, help="--hand-written: runs, the best one counts"
    )
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds to wait")
    parser.add_argument(
        "--connect",
        action="store_true",
        help="every run (and with --hand-written the floor's jobs) is a thin client of one warm "
        "local Spark Connect server started here, as `stack up` starts it; without it each run "
        "worker starts its own classic local[2] Spark",
    )
    return parser.parse_args()


@dataclasses.dataclass
class Backfill:
    """One backfill of the whole range and what it is judged by."""

    plan: Any
    phases: dict[str, Any]
    assets: dict[str, dict[str, float]]
    refusals: list[str]
    per_run: dict[str, list[tuple[str, float]]]
    peaks: dict[str, dict[int, int]]
    load: tuple[str, str]


def run_backfill(
    settings: Settings, spec: TopicSpec, home: Path, first: datetime, end: datetime, timeout: float
) -> Backfill:
    """The plan, then ONE backfill of [first, end) through this home's webserver and daemon,
    waited for, with its phases, per-asset seconds, refusals and the run workers' peak RSS."""
    import dagster as dg

    from backfill_assets.ops import planner
    from backfill_assets.ops.cli import common
    from backfill_assets.ops.launch import DagsterClient
    from backfill_assets.stack import catalog
    from backfill_assets.stack.kafka import KafkaClient

    tables = [spec.raw_table, spec.current_table, *_table_ends(spec, first, end)]
    catalog.init_local_catalog(settings.catalog)
    cat = catalog.load(settings.catalog)
    cat.create_namespace_if_not_exists(settings.catalog.namespace)
    dagster_home = home / "dagster-home"
    with (
        dagster_services(
            dagster_home, dict(os.environ), latency.REPO_ROOT / "dagster.yaml", start_timeout_s=180
        ) as url,
        dg.DagsterInstance.from_config(str(dagster_home)) as instance,
    ):
        os.environ["DAGSTER_HOME"] = str(dagster_home)  # the planner's concurrency
        plan = planner.make_plan(
            KafkaClient(),
            spec,
            first,
            end,
            instance=instance,
            concurrency=common.backfill_concurrency(),
        )
        print(
            f"plan: {plan.records:,} records in {plan.runs} run(s) as {plan.launched_as}; "
            f"predicted {plan.predicted_duration_s:.1f} s ("
            + ", ".join(f"{k} {v:.1f}" for k, v in plan.predicted_breakdown.items())
            + f")\n  confidence {plan.confidence}: {plan.confidence_basis}"
            + (f"\n  BLOCKED: {plan.blocked}" if plan.blocked else ""),
            flush=True,
        )
        load_before = latency.loadavg()
        with rss_sampler(str(home)) as peaks:
            backfill_id, final, clicked = launch_range(
                DagsterClient(url), spec, first, end, timeout
            )
        load_after = latency.loadavg()
        print(f"backfill {backfill_id}: {final.line()}", flush=True)
        phases = latency.breakdown(
            instance, cat, settings.catalog.namespace, tables, backfill_id, clicked
        )
        assets, refusals, per_run = by_asset(instance, backfill_id)
    return Backfill(plan, phases, assets, refusals, per_run, peaks, (load_before, load_after))


def report_backfill(
    args: argparse.Namespace, run: Backfill, checks: dict[str, str], history: History, command: str
) -> None:
    """Print the backfill's figures, every table's verdict and the README's summary row."""
    plan, phases, peaks = run.plan, run.phases, run.peaks
    wall = phases["published_s"]
    error = plan.predicted_duration_s / wall - 1
    python_mib = max(peaks["python"].values(), default=0) / 1024
    jvm_mib = max(peaks["jvm"].values(), default=0) / 1024
    print(
        f"\nwall end to end (click -> last materialization): {wall:.1f} s "
        f"(goal <= {WALL_GOAL_S:.0f} s); backfill completed {phases['completed_s']:.1f} s"
    )
    print(f"records/s: {plan.records / wall:,.0f} ({plan.records:,} offsets planned)")
    print(
        f"prediction {plan.predicted_duration_s:.1f} s: {100 * error:+.0f}% "
        f"(goal +-{100 * PLAN_GOAL:.0f}%)"
    )
    print("phases: " + ", ".join(f"{k} {v:.1f}" for k, v in phases["phases"].items() if v >= 0.05))
    print("by asset (runs, step seconds):")
    for name, figures in sorted(run.assets.items()):
        print(f"  {name}: {figures['runs']:.0f} run(s), {figures['seconds']:.1f} s")
        print("    per run: " + ", ".join(f"{f} {s:.1f} s" for f, s in run.per_run[name]))
    print(
        f"peak RSS of run workers: python {python_mib:,.0f} MiB, Spark JVM {jvm_mib:,.0f} MiB "
        f"({len(peaks['python'])} worker(s), {len(peaks['jvm'])} child process(es))"
    )
    print(f"refusals: {len(run.refusals)}" + "".join(f"\n  {r}" for r in run.refusals))
    bench_mib = _vm_hwm_kib(os.getpid()) / 1024
    print(
        f"peak RSS of this benchmark's own process (VmHWM: truth, comparison): {bench_mib:,.0f} MiB"
    )
    print("tables against the ground truth:")
    for name, verdict in checks.items():
        print(f"  {name}: {verdict}")
    print(
        f"\n{command}\n(load {run.load[0]} -> {run.load[1]}; history generated in "
        f"{history.generated_s:.0f}s, {history.records / history.generated_s:,.0f} records/s)\n"
    )
    print(
        "| days x partitions | records | predicted s | wall s | error | records/s | runs | "
        "refusals | tables exact | python MiB | JVM MiB | bench MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.days} x {args.partitions} | {plan.records:,} | {plan.predicted_duration_s:.1f} "
        f"| **{wall:.1f}** | {100 * error:+.0f}% | {plan.records / wall:,.0f} | "
        f"{phases['runs']} | {len(run.refusals)} | {_exact(checks)}/{len(checks)} "
        f"| {python_mib:,.0f} | {jvm_mib:,.0f} | {bench_mib:,.0f} |"
    )


def _exact(checks: dict[str, str]) -> int:
    return sum(v.startswith("PASS") for v in checks.values())


def record_backfill(
    state: dict[str, Any], path: Path, run: Backfill, checks: dict[str, str], command: str
) -> None:
    """Keep the backfill's wall in the home's state: a later ``--hand-written`` run prints its
    ratio to the floor."""
    state["backfill"] = {
        "wall_s": round(run.phases["published_s"], 1),
        "command": command.removeprefix("$ "),
        "at": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "load": f"{run.load[0]} -> {run.load[1]}",
        "verdict": f"{len(run.refusals)} refusal(s), {_exact(checks)}/{len(checks)} tables exact",
    }
    path.write_text(json.dumps(state, indent=1))


def _connect_server() -> Any:
    """A warm local Spark Connect server on a free port, named in the environment the services
    and this process read (BACKFILL_SPARK_CONNECT)."""
    from backfill_assets.stack.connect import LocalConnectServer
    from backfill_assets.stack.settings import Settings

    os.environ["BACKFILL_SPARK_CONNECT_PORT"] = str(free_port())
    server = LocalConnectServer(Settings.from_env())
    began = time.monotonic()
    print(server.start().describe(), f"(started in {time.monotonic() - began:.1f} s)", flush=True)
    os.environ["BACKFILL_SPARK_CONNECT"] = server.url
    return server


def main() -> None:
    args = _parse_args()
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import
    command = "$ .venv/bin/python " + shlex.join(sys.argv)
    home, state, state_path = _setup(args)

    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.stack import catalog, jars
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    jars.resolve_all(settings)
    print(f"load {latency.loadavg()} on {os.cpu_count()} CPUs; home {home}", flush=True)
    spec = next(s for s in SPECS if s.topic == "orders")
    first = HISTORY_START
    end = first + timedelta(days=args.days)
    broker = LocalBroker(settings)
    broker.start()
    server = _connect_server() if args.connect else None
    if server is not None:
        settings = Settings.from_env()
    try:
        floor_runs = None
        if args.hand_written and "records" in state:  # timed before the truth is loaded
            floor_runs = hand_written_floor(settings, spec, args.days, args.floor_runs)
        history = _history(settings, args, home, state, state_path)
        if args.generate_only:
            return
        if args.hand_written:
            if floor_runs is None:  # the history was generated just now
                floor_runs = hand_written_floor(settings, spec, args.days, args.floor_runs)
            checks = verify_hand(catalog.load(settings.catalog), spec, history, first, end)
            if not report_floor(floor_runs, checks, state.get("backfill"), command):
                sys.exit(1)
            return
        run = run_backfill(settings, spec, home, first, end, args.timeout)
        declared = _table_ends(spec, first, end)
        cat = catalog.load(settings.catalog)
        checks = verify(cat, settings.catalog.namespace, spec, history, first, end, declared)
    finally:
        if server is not None:
            server.stop()
        broker.stop()
    report_backfill(args, run, checks, history, command)
    record_backfill(state, state_path, run, checks, command)
    if run.refusals or _exact(checks) < len(checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
