"""Benchmark: the raw asset side by side with Apache Iceberg's Kafka Connect sink, on one
hostile history, both compared with its ground truth.

Starts its own broker (free ports, temporary BACKFILL_HOME), writes ``--hours`` hours of the
``orders`` topic with the hostile generator (backfill_assets_tests/support/hostile.py, produced
as bench/northstar.py does: three producers with skewed clocks, transactions of
1..``--transaction-records`` of which ~15% are aborted, identical re-sends, corrections,
tombstones) plus a few bad records (northstar's: not JSON, a missing field, a value outside the
contract), and keeps the ground truth from the delivery reports. Then, in the same run:

(a) the raw asset over the whole history (one partition-range run through Dagster, as
    bench/throughput.py times it: exact offsets, parse, dedupe, branch write, blocking checks,
    publish), after a warm-up run over the first hour into other tables;
(b) Apache Iceberg's sink (``org.apache.iceberg:iceberg-kafka-connect``, jar set
    ``iceberg-sink``: maven/iceberg-sink/pom.xml, resolved on the first run) installed as an
    isolated plugin (``plugin.path``) of a Kafka Connect worker started like the CDC source's
    (stack/cdc.py, jar set ``kafka-connect``), writing to the same SQL catalog (Iceberg's
    JdbcCatalog on the SQLite file, schema V1, as Spark reaches it): JsonConverter without
    schemas, ``iceberg.tables.auto-create-enabled``, a ``--commit-interval-ms`` commit interval,
    ``errors.tolerance=all`` with a dead-letter topic (without it the first record that is not
    JSON fails the task), everything else its defaults. Timed from the connector's creation
    until a table snapshot committed after its consumer group's offsets reached the end of
    every partition (the sink commits source offsets when its workers hand their files to the
    coordinator; the coordinator's next commit holds them);
(c), (d) the sink again, each into its own table, its worker killed (SIGKILL by PID) and
    restarted (on another REST port): (c) as soon as its task's consumer has its start
    positions (reading, nothing committed), (d) once the table's first snapshot is in (with a
    ``--kill-commit-interval-ms`` commit interval); each waited for as in (b). Here the sink
    reads the whole topic before its first table commit (5 s for 78 k offsets), so (d) lands
    after the last read: only (c) interrupts a stream in flight (files written, none committed).

Every table is then compared with the truth: rows, rows without an event id (tombstones), rows
beyond one per event id (the raw table keeps every committed record, re-sends and corrections
included, so its figure is exactly committed records - event ids), rows whose event id only
aborted transactions carry, bad JSON records present, committed events missing; (c) and (d)
also against (b): rows lost or added after the kill. Prints a table, the records/s of (a) and
(b) over the topic's offsets and their ratio, and the load average (1 min).

What the sink does with this history, as measured: Kafka Connect's sink consumer reads with
``isolation.level=read_uncommitted`` (Connect's default; ``--read-committed`` overrides it), so
every record of an aborted transaction lands in the table; tombstones (null values) are dropped
without a trace; records that are not JSON go to the dead-letter topic (with the default
``errors.tolerance=none`` they fail the task); JSON records outside the contract are written as
they are; re-sends and corrections are appended like any record, with no Kafka position to tell
them apart (the sink writes none). Its offsets are committed to group ``connect-<name>`` only
up to the last record it wrote, so a partition that ends in records sent to the dead-letter
topic never shows the group at its end.

Run from the repository root (jars resolved by scripts/bootstrap.sh; the iceberg-sink set is
resolved by the first run, ~60 MB from Maven Central):
    .venv/bin/python bench/iceberg_sink.py 2>/dev/null   # the runs' Dagster logs go to stderr
Timings on a shared 2-core machine are noisy: compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: northstar, throughput
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's test support
import northstar
import throughput

from backfill_assets.demo.generator import HOUR_MS
from backfill_assets.stack.cdc import ConnectWorker
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets_tests.support import hostile
from backfill_assets_tests.support.services import free_port

if TYPE_CHECKING:
    from backfill_assets.stack.settings import Settings

TOPIC = "orders"
SINK_CONNECTOR = "org.apache.iceberg.connect.IcebergSinkConnector"
DLQ_TOPIC = "iceberg_sink_dlq"


def loadavg() -> str:
    return f"{os.getloadavg()[0]:.1f}"


# --- the history ------------------------------------------------------------------------------


@dataclass
class History:
    truth: hostile.HostileTruth
    bad_ids: set[str]  # event ids of the bad records that are JSON
    ends: dict[int, int]  # per partition, the offset after the last JSON record the sink reads
    offsets: int  # the topic's offsets (markers included)


def generate(settings: Settings, args: argparse.Namespace) -> History:
    """The hostile history, produced as northstar.py does (asynchronously), bad records last."""
    config = hostile.HostileConfig(
        start=northstar.HISTORY_START,
        topic=TOPIC,
        partitions=args.partitions,
        hours=args.hours,
        events_per_hour=args.events_per_hour,
        seed=args.seed,
        max_transaction_records=args.transaction_records,
    )
    plan = hostile.plan_hostile(config)
    truth = northstar.produce_async(settings, config, plan, 0, args.hours - 1)
    northstar._wait_stable(TOPIC)
    at_ms = config.start_ms + (args.hours - 1) * HOUR_MS + 30 * 60_000
    bad = northstar._produce_bad(settings, TOPIC, args.partitions, at_ms, args.partitions * 3)
    merged = hostile.merge(truth, hostile.HostileTruth(TOPIC, args.partitions, tuple(bad)))
    ends: dict[int, int] = collections.defaultdict(int)
    for r in merged.records:  # the sink commits offsets after the records it writes
        if r.value is not None and _is_json(r.value) and (r.committed or not args.read_committed):
            ends[r.partition] = max(ends[r.partition], r.offset + 1)
    bad_ids = {r.payload().get("event_id") for r in bad if _is_json(r.value)}
    offsets = sum(hw for _low, _lso, hw in KafkaClient(settings).log_ends(TOPIC).values())
    return History(merged, bad_ids, dict(ends), offsets)


def _is_json(value: bytes | None) -> bool:
    import json

    try:
        json.loads(value or b"")
    except ValueError:
        return False
    return True


# --- (a) the raw asset ------------------------------------------------------------------------


def raw_asset(args: argparse.Namespace) -> tuple[float, str]:
    """Warm up on the first hour, then the whole history (every Kafka-time hour that holds a
    record) into fresh tables; seconds, table."""
    from backfill_assets.spec.loader import load_specs

    (spec,) = [s for s in load_specs() if s.topic == TOPIC]
    first = northstar.HISTORY_START
    throughput.use_namespace("warmup")
    throughput.materialize(spec, first, first + timedelta(hours=1))
    throughput.use_namespace("raw")
    # One hour more on each side: skewed producer clocks stamp records outside the true hours.
    hour = timedelta(hours=1)
    seconds, _meta = throughput.materialize(spec, first - hour, first + (args.hours + 1) * hour)
    return seconds, f"{os.environ['BACKFILL_NAMESPACE']}.{spec.raw_table}"


# --- (b), (c) the Iceberg sink ------------------------------------------------------------------


class SinkWorker(ConnectWorker):
    """The CDC source's worker with Iceberg's sink as an isolated plugin in ``plugins``."""

    def __init__(self, settings: Settings, port: int, plugins: Path) -> None:
        super().__init__(settings, port)
        self.plugins = plugins

    def _write_config(self) -> None:
        super()._write_config()
        with self.config_path.open("a") as out:
            out.write(f"plugin.path={self.plugins}\n")

    def on_ready(self) -> None:
        plugins = {p.get("class") for p in self.request("GET", "/connector-plugins")}
        if SINK_CONNECTOR not in plugins:
            raise RuntimeError(f"the worker does not list {SINK_CONNECTOR}: {sorted(plugins)}")


def plugin_dir(settings: Settings) -> Path:
    """The iceberg-sink jar set (resolved if needed) as one plugin directory of links."""
    from backfill_assets.stack import jars

    jars.resolve(settings, "iceberg-sink")
    target = settings.home / "connect-plugins" / "iceberg-sink"
    target.mkdir(parents=True, exist_ok=True)
    for jar in jars.jars(settings, "iceberg-sink"):
        link = target / jar.name
        if not link.exists():
            link.symlink_to(jar)
    return target.parent


def sink_config(
    settings: Settings, name: str, table: str, args: argparse.Namespace
) -> dict[str, str]:
    from backfill_assets.stack import catalog

    cfg = settings.catalog
    return {
        "connector.class": SINK_CONNECTOR,
        "tasks.max": "1",
        "topics": TOPIC,
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        "value.converter": "org.apache.kafka.connect.json.JsonConverter",
        "value.converter.schemas.enable": "false",
        "iceberg.tables": table,
        "iceberg.tables.auto-create-enabled": "true",
        "iceberg.control.topic": f"control-{name}",
        "iceberg.control.commit.interval-ms": str(args.commit_interval_ms),
        "iceberg.catalog": cfg.name,
        "iceberg.catalog.catalog-impl": "org.apache.iceberg.jdbc.JdbcCatalog",
        "iceberg.catalog.uri": catalog._jdbc_url(cfg.uri),
        "iceberg.catalog.jdbc.schema-version": "V1",
        "iceberg.catalog.warehouse": cfg.warehouse,
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": DLQ_TOPIC,
        "errors.deadletterqueue.topic.replication.factor": "1",
        "errors.deadletterqueue.context.headers.enable": "true",
        # A killed worker's consumers leave their groups after 10 s, not 45 s.
        "consumer.override.session.timeout.ms": "10000",
        # Kafka Connect's sink consumers read uncommitted records unless told otherwise.
        **({"consumer.override.isolation.level": "read_committed"} if args.read_committed else {}),
    }


def create_topics(settings: Settings, names: list[str]) -> None:
    """The sink's control topics and the dead-letter topic (the broker creates none itself)."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient(dict(settings.kafka.client_config()))
    for future in admin.create_topics([NewTopic(n, 1, 1) for n in names]).values():
        future.result(30)


def group_offsets(settings: Settings, group: str, ends: dict[int, int]) -> dict[int, int]:
    """Consumer group ``group``'s committed offsets of the topic (-1: none yet)."""
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(dict(settings.kafka.client_config()))
    asked = ConsumerGroupTopicPartitions(group, [TopicPartition(TOPIC, p) for p in ends])
    found = admin.list_consumer_group_offsets([asked])[group].result(30)
    return {tp.partition: tp.offset for tp in found.topic_partitions}


def group_at_end(settings: Settings, group: str, ends: dict[int, int]) -> bool:
    """Whether consumer group ``group`` committed every partition's end offset."""
    got = group_offsets(settings, group, ends)
    return all(got.get(p, -1) >= end for p, end in ends.items())


def snapshot_ms(settings: Settings, table: str) -> int | None:
    """The commit time of the table's current snapshot, None before the first (or table)."""
    from pyiceberg.exceptions import NoSuchTableError

    from backfill_assets.stack import catalog

    try:
        snap = catalog.load(settings.catalog).load_table(table).current_snapshot()
    except NoSuchTableError:
        return None
    return None if snap is None else snap.timestamp_ms


def wait_done(
    settings: Settings,
    worker: SinkWorker,
    name: str,
    table: str,
    ends: dict[int, int],
    args: argparse.Namespace,
) -> float:
    """Wait until the group is at the end, then for five commit intervals (at least 10 s) more:
    the commit time (epoch s) of the table's last snapshot. The sink commits source offsets
    when a worker hands its files to the coordinator, whose next table commit holds them."""
    deadline = time.monotonic() + args.timeout
    settle_s = max(10.0, 5 * args.commit_interval_ms / 1000)
    reached: float | None = None
    while time.monotonic() < deadline:
        status = worker.connector_status(name) or {}
        failed = [t for t in status.get("tasks", []) if t.get("state") == "FAILED"]
        if failed:
            raise RuntimeError(f"{name}: task failed:\n{str(failed[0].get('trace'))[:3000]}")
        if reached is None and group_at_end(settings, f"connect-{name}", ends):
            reached = time.monotonic()
        if reached is not None and time.monotonic() > reached + settle_s:
            snap = snapshot_ms(settings, table)
            if snap is not None:
                return snap / 1000
        time.sleep(0.5)
    raise RuntimeError(
        f"{name}: not done within {args.timeout:.0f}s (group at end: {reached is not None}). "
        f"Last lines of {worker.log_path}:\n{worker.log_tail(30)}"
    )


@contextmanager
def sink_worker(settings: Settings) -> Iterator[SinkWorker]:
    worker = SinkWorker(settings, free_port(), plugin_dir(settings))
    worker.start(240)
    try:
        yield worker
    finally:
        worker.stop()


def run_sink(
    settings: Settings,
    worker: SinkWorker,
    name: str,
    table: str,
    args: argparse.Namespace,
    ends: dict[int, int],
) -> float:
    """(b): the connector from the topic's start until its table holds what it will write."""
    began = time.time()
    worker.put_connector(name, sink_config(settings, name, table, args), 120)
    return wait_done(settings, worker, name, table, ends, args) - began


def run_killed(
    settings: Settings,
    worker: SinkWorker,
    name: str,
    table: str,
    args: argparse.Namespace,
    ends: dict[int, int],
    at: str,
) -> str:
    """(c), (d): as (b), the worker SIGKILLed once its task reads the topic (``reading``: the
    consumer has its start positions, nothing is committed yet) or once the table's first
    snapshot is in (``first-commit``), then restarted; what the kill interrupted."""
    args = argparse.Namespace(**{**vars(args), "commit_interval_ms": args.kill_commit_interval_ms})
    mark = worker.log_path.stat().st_size
    worker.put_connector(name, sink_config(settings, name, table, args), 120)
    deadline = time.monotonic() + args.timeout
    started = f"connector-consumer-{name}-0, groupId=connect-{name}] Resetting offset"
    while time.monotonic() < deadline:
        if at == "reading" and started in _log_since(worker.log_path, mark):
            break
        if at == "first-commit" and snapshot_ms(settings, table) is not None:
            break
        time.sleep(0.05)
    pid = worker.running_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    while worker.running_pid() is not None:
        time.sleep(0.1)
    committed = sum(max(0, o) for o in group_offsets(settings, f"connect-{name}", ends).values())
    rows = table_rows(settings, table) if snapshot_ms(settings, table) is not None else 0
    worker.port = free_port()  # the killed JVM's REST port may linger a while
    worker.start(240)
    wait_done(settings, worker, name, table, ends, args)
    return f"{rows:,} rows in the table, group at {committed:,} of {sum(ends.values()):,} offsets"


def _log_since(path: Path, mark: int) -> str:
    with path.open("rb") as log:
        log.seek(mark)
        return log.read().decode(errors="replace")


def table_rows(settings: Settings, table: str) -> int:
    from backfill_assets.stack import catalog

    return len(
        catalog.load(settings.catalog)
        .load_table(table)
        .scan(selected_fields=("event_id",))
        .to_arrow()
    )


# --- against the truth ------------------------------------------------------------------------


def event_ids(settings: Settings, table: str) -> collections.Counter[str | None]:
    from backfill_assets.stack import catalog

    scan = catalog.load(settings.catalog).load_table(table).scan(selected_fields=("event_id",))
    return collections.Counter(scan.to_arrow().column("event_id").to_pylist())


def compare(found: collections.Counter[str | None], history: History) -> dict[str, int]:
    """One table's figures against the truth."""
    truth = history.truth
    committed = [r for r in truth.committed() if r.value is not None and r.event_id is not None]
    committed = [r for r in committed if r.event_id not in history.bad_ids]
    committed_ids = {r.event_id for r in committed}
    aborted_ids = {r.event_id for r in truth.aborted() if r.value is not None} - committed_ids
    return {
        "rows": sum(found.values()),
        "committed records (truth)": len(committed),
        "event ids (truth)": len(committed_ids),
        "rows without an event id (tombstones)": found[None],
        "rows beyond one per event id": sum(n - 1 for i, n in found.items() if i is not None),
        "rows of aborted transactions": sum(found[i] for i in aborted_ids),
        "bad JSON records present (of 2/3 of the bad ones)": sum(found[i] for i in history.bad_ids),
        "committed event ids missing": len(committed_ids - set(found)),
        "records of aborted transactions (truth)": sum(
            r.value is not None for r in truth.aborted()
        ),
        "tombstones (truth, committed)": sum(r.value is None for r in truth.committed()),
    }


def kill_effect(
    before: collections.Counter[str | None], after: collections.Counter[str | None]
) -> dict[str, int]:
    lost = sum(max(0, n - after[i]) for i, n in before.items())
    more = sum(max(0, n - before[i]) for i, n in after.items())
    return {"rows lost vs (b)": lost, "rows added vs (b)": more}


def dlq_records(settings: Settings) -> int:
    return sum(hw for _low, _lso, hw in KafkaClient(settings).log_ends(DLQ_TOPIC).values())


def show(figures: dict[str, dict[str, int]]) -> None:
    names = list(figures)
    print("| figure | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    keys = list(dict.fromkeys(k for f in figures.values() for k in f))
    for key in keys:
        print(
            f"| {key} | "
            + " | ".join(f"{figures[n].get(key, ''):,}" if key in figures[n] else "" for n in names)
            + " |"
        )


def setup(args: argparse.Namespace) -> Path:
    home = Path(tempfile.mkdtemp(prefix="bench-iceberg-sink-"))
    os.environ.update(
        {
            "BACKFILL_HOME": str(home),
            "BACKFILL_JAR_CACHE": os.environ.get(
                "BACKFILL_JAR_CACHE", str(Path(__file__).resolve().parents[1] / ".stack" / "jars")
            ),
            "BACKFILL_KAFKA_PORT": str(free_port()),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
            "BACKFILL_KAFKA_CONNECT_PORT": str(free_port()),
            "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
            "PYICEBERG_HOME": str(home / "pyiceberg-home"),
            "BACKFILL_SENSORS": "off",
        }
    )
    return home


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--events-per-hour", type=int, default=6000)
    parser.add_argument("--transaction-records", type=int, default=50)
    parser.add_argument("--seed", type=int, default=49)
    parser.add_argument("--commit-interval-ms", type=int, default=2000)
    parser.add_argument(
        "--kill-commit-interval-ms",
        type=int,
        default=500,
        help="(c)'s commit interval: short, so the kill lands between two table commits",
    )
    parser.add_argument(
        "--read-committed",
        action="store_true",
        help="give the sink's consumer isolation.level=read_committed (its default, Kafka "
        "Connect's, is read_uncommitted: aborted records are written)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per sink run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    home = setup(args)
    from backfill_assets.stack import catalog
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    print(f"load {loadavg()} on {os.cpu_count()} CPUs; home {settings.home}", flush=True)
    broker = LocalBroker(settings)
    broker.start()
    try:
        catalog.init_local_catalog(settings.catalog)
        history = generate(settings, args)
        offsets = history.offsets
        print(f"history: {offsets:,} offsets in {args.partitions} partitions", flush=True)
        figures, seconds = measure(settings, args, history)
    finally:
        broker.stop()
        shutil.rmtree(home, ignore_errors=True)
    show(figures)
    raw_s, sink_s = seconds["raw"], seconds["sink"]
    print(
        f"\nrecords/s over {offsets:,} offsets: raw asset {offsets / raw_s:,.0f} ({raw_s:.1f} s), "
        f"Iceberg sink {offsets / sink_s:,.0f} ({sink_s:.1f} s, commit interval "
        f"{args.commit_interval_ms} ms); raw / sink {sink_s / raw_s:.2f}x; load {loadavg()}"
    )


def measure(
    settings: Settings, args: argparse.Namespace, history: History
) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """(a), (b) and (c); each table's figures and the seconds of (a) and (b)."""
    print(f"(a) raw asset, load {loadavg()}", flush=True)
    raw_s, raw_table = raw_asset(args)
    namespace = f"sink_{os.getpid()}"
    from backfill_assets.stack import catalog

    catalog.load(settings.catalog).create_namespace_if_not_exists(namespace)
    create_topics(settings, ["control-sink-b", "control-sink-c", "control-sink-d", DLQ_TOPIC])
    with sink_worker(settings) as worker:
        print(f"(b) Iceberg sink, load {loadavg()}", flush=True)
        sink_s = run_sink(settings, worker, "sink-b", f"{namespace}.orders_b", args, history.ends)
        dlq = dlq_records(settings)
        worker.delete_connector("sink-b")
        kills = {}
        for run, at in (("c", "reading"), ("d", "first-commit")):
            print(f"({run}) Iceberg sink, worker killed at {at}, load {loadavg()}", flush=True)
            where = run_killed(
                settings, worker, f"sink-{run}", f"{namespace}.orders_{run}", args, history.ends, at
            )
            print(f"  killed with {where}", flush=True)
            kills[f"sink ({run}) killed at {at}"] = f"{namespace}.orders_{run}"
    found = {
        "raw asset": event_ids(settings, raw_table),
        "sink (b)": event_ids(settings, f"{namespace}.orders_b"),
        **{label: event_ids(settings, table) for label, table in kills.items()},
    }
    figures = {name: compare(ids, history) for name, ids in found.items()}
    figures["sink (b)"]["dead-letter records"] = dlq
    for label in kills:
        figures[label].update(kill_effect(found["sink (b)"], found[label]))
    return figures, {"raw": raw_s, "sink": sink_s}


if __name__ == "__main__":
    main()
