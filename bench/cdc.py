"""Benchmark: the raw asset's throughput over a Debezium topic next to a flat JSON topic's
(issue 48).

Starts its own broker (free ports, temporary BACKFILL_HOME) and the CDC source as the ``cdc``
test tier starts it (``backfill_assets_tests/support/cdc_source.running``: Debian's Postgres
with logical decoding and a Kafka Connect worker running Debezium's Postgres connector, on free
ports, stopped by PID at the end), then, in one run (ratios compare within a run only):

1. Table ``public.orders`` in Postgres, the columns of the shipped ``orders`` topic that a
   row holds (``order_id`` its primary key, ``customer_id``, ``status``, ``amount_minor``,
   ``currency``, ``channel``, ``updated_at``), captured by one connector per variant: Kafka's
   JSON converter without the schema (``schemas: none``, always) and, with ``--embedded``, with
   it (``schemas: embedded``), each into its own topic created ahead with ``--partitions``
   partitions. ``--rows`` changes are written through Postgres over ``--hours`` measured hours
   (plus one warm-up hour before them): about 65% inserts, 30% updates, 5% deletes (each
   delete is two records: Debezium's delete and its tombstone), committed 100 statements at a
   time.
2. The same number of records per hour of the shipped ``orders`` shape, flat JSON
   (``demo/generator.py``: no duplicates, no malformed records, every record of the latest
   schema version, tombstones in the share the Debezium topic has), into a plain topic with
   the same partitions over the same hours.
3. The raw asset of each topic materialized through Dagster over the measured hours (one
   partition-range run, as throughput.py does: exact offsets, parse, dedupe, branch write,
   blocking checks, publish), each repetition into a fresh catalog namespace, ``--repeat``
   times, the order of the topics rotated each repetition (with two topics: alternating which
   runs first); with ``--current`` the current-state asset of each topic after its raw one,
   timed apart. Every asset runs once over the warm-up hour first, so JVM start-up, class
   loading and JIT are not counted.

Kafka Connect stamps each record with its worker's clock, and a Kafka-time hour can be
backfilled only once it has ended (and sealed). The connectors therefore use the cdc tier's
test clock (``backfill_assets_tests/support/java/backfill_assets_tests/TestClock.java``, a
producer interceptor compiled and put on the worker's classpath by ``cdc_source.running``,
reused here as it is): each hour's changes are stamped in an hour of the past, as by a worker
whose clock runs behind; Debezium's envelopes are untouched (their event time, the commit time,
is now). The hours end at least an hour before the run starts.

Prints records/s of each topic's raw asset (median of ``--repeat``), the ratio Debezium / JSON
(of the medians, and per repetition) and the load average (1 min) at the start, before each
repetition and at the end.

Run from the repository root (jars resolved by scripts/bootstrap.sh; Debian's postgresql-15
and a JDK with javac, as the cdc tier needs):
    .venv/bin/python bench/cdc.py 2>/dev/null   # the runs' Dagster logs go to stderr
Timings on a shared 2-core machine are noisy: compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the checkout's test support (not part of the package)
from backfill_assets_tests.support import cdc_source  # noqa: E402
from backfill_assets_tests.support.services import free_port  # noqa: E402

if TYPE_CHECKING:
    from backfill_assets.spec.model import TopicSpec
    from backfill_assets.stack.cdc import CdcSource, PgSource
    from backfill_assets.stack.kafka import KafkaClient
    from backfill_assets.stack.postgres import PgServer
    from backfill_assets.stack.settings import Settings

DATABASE, ROLE = "bench_cdc", "benchcdc"
TABLE = "public.orders"
DDL = """
CREATE TABLE orders (
    order_id text PRIMARY KEY,
    customer_id text NOT NULL,
    status text NOT NULL,
    amount_minor bigint NOT NULL,
    currency text NOT NULL,
    channel text NOT NULL,
    updated_at timestamptz NOT NULL
)
"""
INSERT = "INSERT INTO orders VALUES (%s, %s, %s, %s, %s, %s, now())"
UPDATE = "UPDATE orders SET status = %s, amount_minor = %s, updated_at = now() WHERE order_id = %s"
DELETE = "DELETE FROM orders WHERE order_id = %s"
COMMIT_EVERY = 100  # statements per transaction
# The orders spec's columns the table shares (their types, nullability and allowed values).
SHARED = ("order_id", "customer_id", "status", "amount_minor", "currency", "channel")
# Debezium variants: the converter's schemas mode -> (connector, topic prefix and slot).
VARIANTS = {"none": ("bench-cdc-p", "bench_p"), "embedded": ("bench-cdc-s", "bench_s")}
JSON_TOPIC = "bench_orders"
FIRST_INSERTS = 1000  # an hour starts with inserts, so updates and deletes find rows
# Waiting for the connectors: at least this long per hour, or this many records/s at worst.
WAIT_MIN_S, WAIT_RATE = 120.0, 200.0


def loadavg() -> float:
    return os.getloadavg()[0]


def partition_key(hour: datetime) -> str:
    return hour.strftime("%Y-%m-%d-%H:%M")


# --- the specs ------------------------------------------------------------------------------


def orders_spec() -> TopicSpec:
    """The shipped ``orders`` spec, renamed to the JSON topic."""
    from backfill_assets.spec.declared import renamed
    from backfill_assets.spec.loader import load_specs

    (orders,) = [s for s in load_specs() if s.topic == "orders"]
    return renamed(orders, topic=JSON_TOPIC)


def debezium_spec(schemas: str, start: datetime) -> TopicSpec:
    """The entry docs/cdc.md gives to copy, for the table's topic of the ``schemas`` variant:
    the orders spec's columns the table shares, and ``updated_at``."""
    from backfill_assets.spec.model import TopicSpec

    orders = {c.name: c for c in orders_spec().columns}
    columns = [orders[n].model_dump(exclude_defaults=True) for n in SHARED]
    columns.append({"name": "updated_at", "type": "timestamp", "nullable": False})
    _, prefix = VARIANTS[schemas]
    return TopicSpec.model_validate(
        {
            "topic": f"{prefix}.{TABLE}",
            "format": "json",
            "envelope": "debezium",
            "schemas": schemas,
            "key_field": "order_id",
            "partition_start": start.isoformat(),
            "allowed_lateness_hours": 0,
            "quarantine_max_ratio": 0.0,
            "columns": columns,
        }
    )


# --- the source table's changes ---------------------------------------------------------------


@dataclass
class Workload:
    """The changes written through Postgres, hour by hour (deterministic for a seed)."""

    rng: random.Random = field(default_factory=lambda: random.Random(48))
    live: list[str] = field(default_factory=list)  # keys of the rows the table holds
    next_id: int = 1

    @staticmethod
    def mix(changes: int) -> tuple[int, int, int]:
        """(inserts, updates, deletes) of an hour of ``changes`` changes."""
        deletes = changes // 20
        updates = changes * 3 // 10
        return changes - updates - deletes, updates, deletes

    @classmethod
    def records(cls, changes: int) -> int:
        """The records Debezium writes for an hour of ``changes`` (a tombstone per delete)."""
        return changes + cls.mix(changes)[2]

    def hour(self, changes: int) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements of one hour, in order."""
        inserts, updates, deletes = self.mix(changes)
        first = min(inserts, FIRST_INSERTS)
        rest = ["i"] * (inserts - first) + ["u"] * updates + ["d"] * deletes
        self.rng.shuffle(rest)
        out: list[tuple[str, tuple[Any, ...]]] = []
        rng = self.rng
        for op in ["i"] * first + rest:
            if op == "i":
                key = f"o-{self.next_id:08d}"
                self.next_id += 1
                self.live.append(key)
                out.append(
                    (
                        INSERT,
                        (
                            key,
                            f"c-{rng.randint(1, 2000):05d}",
                            "open",
                            rng.randint(500, 50_000),
                            rng.choice(("EUR", "USD", "GBP")),
                            rng.choice(("web", "app", "store")),
                        ),
                    )
                )
            elif op == "u":
                key = self.live[rng.randrange(len(self.live))]
                status = rng.choice(("open", "paid", "cancelled"))
                out.append((UPDATE, (status, rng.randint(500, 50_000), key)))
            else:
                index = rng.randrange(len(self.live))
                key = self.live[index]
                self.live[index] = self.live[-1]
                self.live.pop()
                out.append((DELETE, (key,)))
        return out


def write(server: PgServer, db: PgSource, statements: list[tuple[str, tuple[Any, ...]]]) -> None:
    con = server.connect(db.dbname, db.user, db.password)
    con.autocommit = False
    try:
        with con.cursor() as cur:
            for i, (text, args) in enumerate(statements, 1):
                cur.execute(text, args)
                if i % COMMIT_EVERY == 0:
                    con.commit()
        con.commit()
    finally:
        con.close()


def total_records(client: KafkaClient, topic: str) -> int:
    return sum(high for _, _, high in client.log_ends(topic).values())


def wait_for(client: KafkaClient, topics: list[str], expected: int, what: str) -> None:
    """Wait until each topic holds ``expected`` records."""
    deadline = time.monotonic() + max(WAIT_MIN_S, expected / WAIT_RATE)
    while True:
        held = {t: total_records(client, t) for t in topics}
        if all(n >= expected for n in held.values()):
            over = {t: n for t, n in held.items() if n > expected}
            if over:
                print(f"  note: {what}: more records than changes written: {over}", flush=True)
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: the topics hold {held}, {expected:,} expected")
        time.sleep(0.25)


def highs(settings: Settings, variants: list[str]) -> dict[str, list[int]]:
    """Each Debezium topic's high watermarks, by partition."""
    from backfill_assets.stack.kafka import KafkaClient

    client = KafkaClient(settings)
    out = {}
    for v in variants:
        topic = debezium_spec(v, datetime(2026, 1, 1, tzinfo=UTC)).topic
        out[topic] = [high for _, (_, _, high) in sorted(client.log_ends(topic).items())]
    return out


def create_topic(settings: Settings, topic: str, partitions: int, start: datetime) -> None:
    """``topic`` with ``partitions`` partitions and CreateTime timestamps, as the generator
    creates its topics (Connect finds it there and does not create it)."""
    from backfill_assets.demo import generator as gen
    from backfill_assets.stack.kafka import KafkaClient

    config = gen.GeneratorConfig(topic=topic, start=start, partitions=partitions)
    gen._prepare_topic(settings, KafkaClient(settings).admin(), config)


def produce_cdc(
    settings: Settings,
    cdc: cdc_source.SharedCdc,
    clock: cdc_source.Clock,
    variants: list[str],
    start: datetime,
    hours: int,
    changes: int,
    partitions: int,
) -> int:
    """The table, its connectors and ``hours`` hours of ``changes`` changes each; the records
    per hour of each topic."""
    from backfill_assets.stack.kafka import KafkaClient

    source: CdcSource = cdc.source
    db = source.database(cdc.server, DATABASE, ROLE)
    write(cdc.server, db, [(DDL, ())])
    topics = [debezium_spec(v, start).topic for v in variants]
    for topic in topics:
        create_topic(settings, topic, partitions, start)
    clock.at(start + timedelta(minutes=1))
    for v in variants:
        name, prefix = VARIANTS[v]
        source.connector(
            name,
            db,
            overrides=clock.overrides(),
            topic_prefix=prefix,
            tables=[TABLE],
            slot=prefix,
            schemas=v == "embedded",
        )
    client = KafkaClient(settings)
    workload = Workload()
    per_hour = Workload.records(changes)
    for h in range(hours):
        began = time.monotonic()
        # This hour's records are stamped in its own hour, which ended hours ago.
        clock.at(start + timedelta(hours=h, minutes=1))
        write(cdc.server, db, workload.hour(changes))
        written = time.monotonic() - began
        wait_for(client, topics, per_hour * (h + 1), f"hour {h}")
        print(
            f"  hour {h}: {changes:,} changes written in {written:.1f}s, "
            f"{per_hour:,} records in each Debezium topic after {time.monotonic() - began:.1f}s",
            flush=True,
        )
    return per_hour


def produce_json(
    settings: Settings, start: datetime, hours: int, per_hour: int, partitions: int
) -> int:
    """``per_hour`` records of the orders shape per hour; the records produced."""
    from backfill_assets.demo.generator import GeneratorConfig, produce_history

    _, _, deletes = Workload.mix(per_hour)
    config = GeneratorConfig(
        topic=JSON_TOPIC,
        start=start,
        hours=hours,
        events_per_hour=per_hour,
        partitions=partitions,
        duplicate_share=0.0,
        malformed_share=0.0,
        tombstone_share=deletes / per_hour,
        schema_switch_fraction=0.0,  # every record of the latest version
    )
    return produce_history(settings, config)


# --- materializations --------------------------------------------------------------------------


def resources() -> dict[str, object]:
    """The raw and current assets' resources, as in definitions.RESOURCES."""
    from backfill_assets.defs.resources import IcebergResource, KafkaResource, SparkResource

    return {"kafka": KafkaResource(), "spark": SparkResource(), "iceberg": IcebergResource()}


RUN_TAG = uuid.uuid4().hex[:6]


def use_namespace(name: str) -> None:
    """Point every later materialization at fresh tables (resources read the env per run)."""
    os.environ["BACKFILL_NAMESPACE"] = f"{name}_{RUN_TAG}"


def materialize(
    spec: TopicSpec, start: datetime, end: datetime, current: bool = False
) -> tuple[float, dict[str, Any]]:
    """The raw asset (or, with ``current``, the current-state asset, its raw table already
    published) over the partitions in [start, end); wall seconds and the metadata."""
    import dagster as dg

    from backfill_assets.defs.assets import (
        build_current_asset,
        build_raw_asset,
        current_asset_key,
    )

    assets = [build_raw_asset(spec)]
    selection = None
    if current:
        assets.append(build_current_asset(spec))
        selection = [current_asset_key(spec)]
    began = time.monotonic()
    result = dg.materialize(
        assets,
        selection=selection,
        resources=resources(),
        instance=dg.DagsterInstance.ephemeral(),
        tags={
            "dagster/asset_partition_range_start": partition_key(start),
            "dagster/asset_partition_range_end": partition_key(end - timedelta(hours=1)),
        },
    )
    seconds = time.monotonic() - began
    assert result.success
    mats = [e.materialization for e in result.get_asset_materialization_events()]
    meta = {k: getattr(v, "value", v) for k, v in mats[-1].metadata.items()}
    return seconds, meta


@dataclass
class Sample:
    records: int = 0
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        return self.records / self.median


def measure(
    args: argparse.Namespace, specs: dict[str, TopicSpec], warm: datetime, start: datetime
) -> None:
    end = start + timedelta(hours=args.hours)
    kinds = ["raw", "current"] if args.current else ["raw"]
    began = time.monotonic()
    use_namespace("bench_cdc_warmup")
    for spec in specs.values():
        for kind in kinds:
            materialize(spec, warm, warm + timedelta(hours=1), kind == "current")
    print(f"warm-up (1 h of each topic): {time.monotonic() - began:.0f}s", flush=True)

    samples = {(label, kind): Sample() for label in specs for kind in kinds}
    labels = list(specs)
    loads = [loadavg()]
    for i in range(args.repeat):
        use_namespace(f"bench_cdc_r{i}")
        shift = i % len(labels)
        order = labels[shift:] + labels[:shift]
        line = []
        for label in order:
            for kind in kinds:
                seconds, meta = materialize(specs[label], start, end, kind == "current")
                sample = samples[(label, kind)]
                sample.seconds.append(seconds)
                if kind == "raw":
                    sample.records = int(meta["run"]["records_read"])
                line.append(f"{label} {kind} {seconds:.1f}s")
        print(f"  run {i + 1}/{args.repeat} (load {loads[-1]:.2f}): " + ", ".join(line), flush=True)
        loads.append(loadavg())
    for label in labels:  # the current state reads the raw table's records
        if args.current:
            samples[(label, "current")].records = samples[(label, "raw")].records

    stat = "median" if args.repeat > 1 else "single run"
    print()
    print(
        f"Throughput over {args.hours} h ({args.partitions} partition(s) per topic), {stat} of "
        f"{args.repeat}; load average (1 min) {loads[0]:.2f} before the first run, "
        f"{loads[-1]:.2f} after the last:"
    )
    print(f"  {'asset':<50} {'records':>9} {'seconds':>8} {'records/s':>10}")
    for (label, kind), sample in samples.items():
        name = f"{kind} {label} ({specs[label].topic})"
        print(f"  {name:<50} {sample.records:>9,} {sample.median:>8.2f} {sample.rate:>10,.0f}")
    counts = {label: samples[(label, "raw")].records for label in labels}
    if len(set(counts.values())) > 1:
        print(f"  note: the topics' raw runs read different record counts: {counts}")
    print()
    for kind in kinds:
        base = samples[("json", kind)]
        for label in labels[1:]:
            other = samples[(label, kind)]
            runs = [
                (other.records / o) / (base.records / b)
                for b, o in zip(base.seconds, other.seconds, strict=True)
            ]
            each = " ".join(f"{r:.2f}" for r in runs)
            print(
                f"  {kind} {label} / json: {other.rate / base.rate:.2f}x records/s "
                f"(per repetition: {each})"
            )


# --- main ------------------------------------------------------------------------------------


@contextlib.contextmanager
def cdc_running(settings: Settings) -> Iterator[cdc_source.SharedCdc]:
    """The cdc tier's source (support/cdc_source.running): Postgres in a temporary directory,
    the worker with the test clock on its classpath, free ports; stopped by PID at the end."""
    yield from cdc_source.running(settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        type=int,
        default=100_000,
        help="changes written through Postgres over the measured hours (default 100,000); "
        "each topic then holds these plus a tombstone per delete (5%%)",
    )
    parser.add_argument("--hours", type=int, default=4, help="measured hours (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--partitions", type=int, default=1, help="partitions of every topic (default 1, as "
        "Connect creates a connector's topic on the local broker)"
    )  # fmt: skip
    parser.add_argument(
        "--embedded", action="store_true", help="also a Debezium topic with the schema embedded"
    )
    parser.add_argument(
        "--current", action="store_true", help="also the current-state asset of each topic"
    )
    args = parser.parse_args()
    if args.rows < args.hours or args.hours < 1 or args.repeat < 1 or args.partitions < 1:
        parser.error("--hours, --repeat, --partitions >= 1 and --rows >= --hours")
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import

    home = tempfile.mkdtemp(prefix="bench-cdc-")
    os.environ.update(
        {
            "BACKFILL_HOME": home,
            "BACKFILL_JAR_CACHE": os.environ.get("BACKFILL_JAR_CACHE")
            or str(REPO_ROOT / ".stack" / "jars"),
            "BACKFILL_KAFKA_PORT": str(free_port()),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
            "BACKFILL_DAGSTER_STORAGE": os.path.join(home, "dagster"),
            "PYICEBERG_HOME": os.path.join(home, "pyiceberg-home"),
            "BACKFILL_SENSORS": "off",
        }
    )
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    changes = args.rows // args.hours
    variants = ["none", "embedded"] if args.embedded else ["none"]
    # Warm-up hour, then the measured hours; the last one ends an hour before now.
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    warm = now - timedelta(hours=args.hours + 2)
    start = warm + timedelta(hours=1)
    print(
        f"Spark {settings.spark_master}, driver memory {settings.spark_driver_memory}; "
        f"{changes:,} changes per hour over 1 warm-up + {args.hours} h from {warm.isoformat()}; "
        f"load average {loadavg():.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    broker = LocalBroker(settings)
    broker.start()
    try:
        began = time.monotonic()
        with cdc_running(settings) as cdc:
            print(f"CDC source up in {time.monotonic() - began:.0f}s", flush=True)
            clock = cdc_source.Clock(settings.home / "bench-cdc-clock")
            began = time.monotonic()
            per_hour = produce_cdc(
                settings, cdc, clock, variants, warm, args.hours + 1, changes, args.partitions
            )
            print(
                f"Debezium: {per_hour * (args.hours + 1):,} records per topic in "
                f"{time.monotonic() - began:.0f}s; per partition: {highs(settings, variants)}",
                flush=True,
            )
        # Postgres and the worker are stopped before anything is measured.
        began = time.monotonic()
        records = produce_json(settings, warm, args.hours + 1, per_hour, args.partitions)
        print(f"JSON: {records:,} orders records in {time.monotonic() - began:.0f}s", flush=True)
        specs = {"json": orders_spec()}
        specs.update({f"debezium-{v}": debezium_spec(v, warm) for v in variants})
        measure(args, specs, warm, start)
    finally:
        broker.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
