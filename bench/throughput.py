"""Benchmark: replay throughput of the raw asset (with write-audit-publish) and its driver memory.

Starts its own broker (free ports, temporary BACKFILL_HOME), writes generated history to a fresh
topic, then, in one run (ratios compare within a run only):

1. the full Dagster materialization of the raw asset over ``--hours`` hourly partitions (exact
   offsets, parse, dedupe, branch write, blocking checks, publish), each repetition into a fresh
   catalog namespace (fresh tables);
2. baseline (a): a bare Spark Kafka -> Parquet job over exactly the same offsets, in the same
   Spark session;
3. baseline (b): a librdkafka (confluent_kafka) consume-and-discard loop over the same offsets
   (partitions assigned at their start offsets, no group, no commits); and, for reference,
   (c): the asset's own read + parse + dedupe written to Parquet (no Iceberg, WAP or Dagster);
4. driver peak memory (VmHWM) of the Python driver and of the Spark driver JVM for a 1x and a
   ``--mem-factor``x range, each materialized in a fresh subprocess (this script with
   ``--child``).

``--format avro`` runs the same on an Avro history: a local schema registry
(``stack/registry.py``) is started next to the broker, the generated orders are produced in
Confluent's wire format (one writer schema, registered under ``<topic>-value``), the asset reads
them with a ``format: avro`` spec and the hand-written job (h) becomes ``from_avro`` with that
writer schema instead of ``from_json``. Bare Spark (a) and librdkafka (b) do not decode, so they
are unchanged.

``--home DIR`` keeps the broker's data and the topic: run again with the same sizes, the history
is reused (the scale benchmark generates its 10 M records once:
``--skip-throughput --hours 10 --events-per-hour 100000 --home /tmp/bench-scale``).

Every contender runs once on a one-hour warm-up range first, so JVM start-up, class loading and
JIT are not counted. ``--repeat N`` interleaves the contenders N times and reports the median.
``--profile`` also times every Spark action of one more asset run (labelled by its caller).

Run from the repository root (jars resolved by scripts/bootstrap.sh):
    .venv/bin/python bench/throughput.py
Timings on a shared 2-core machine are noisy: compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from backfill_assets.lake.offsets.contract import OffsetContract
    from backfill_assets.spec.model import TopicSpec
    from backfill_assets.stack.settings import Settings

HISTORY_START = datetime(2026, 9, 1, tzinfo=UTC)
CHILD_MARKER = "BENCH_CHILD_RESULT "
MEMORY_GOAL = 1.2  # driver peak RSS at 10x range <= 1.2x that at 1x
PHASE_CHECKS = "[phase] checks.run_checks, all of it"
PHASE_SCAN = "[phase] scan.scan (librdkafka count + hash), all of it"
PHASE_PUBLISH = "[phase] wap.publish, all of it"
PHASES = (PHASE_CHECKS, PHASE_SCAN, PHASE_PUBLISH)
AVRO_UNKNOWN_ID = 987_654  # --format avro: the id framing half of the malformed records
HAND_GOAL = 0.5  # issue 31: asset records/s >= 0.5x the hand-written Kafka -> Iceberg job
BARE_GOAL = 0.3  # asset records/s >= 0.3x the bare Kafka -> Parquet copy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def partition_key(hour: datetime) -> str:
    return hour.strftime("%Y-%m-%d-%H:%M")


def orders_spec(topic: str, fmt: str = "json") -> TopicSpec:
    """The demo's ``orders`` spec for ``topic``; with ``fmt`` avro, the same columns read from
    Confluent's wire format (subject ``<topic>-value``, no version field or upcasters)."""
    from backfill_assets.spec.declared import renamed
    from backfill_assets.spec.loader import load_specs
    from backfill_assets.spec.model import TopicSpec

    (orders,) = [s for s in load_specs() if s.topic == "orders"]
    if fmt == "json":
        return renamed(orders, topic=topic)
    avro = renamed(
        orders,
        topic=topic,
        format="avro",
        subject=f"{topic}-value",
        version_field=None,
        upcasters={},
        decoders={},
        latest_version=1,
    )
    # The spec's own checks of an avro topic; the bench builds only the raw asset (no tables).
    return TopicSpec.model_validate({**avro.model_dump(), "tables": ()})


# --- --format avro: the orders history in Confluent's wire format --------------------------


def avro_writer_schema() -> str:
    """The one writer schema of the Avro history: the orders columns (amount in minor units,
    event time as timestamp-millis)."""
    text = "string"
    fields = [
        {"name": n, "type": text}
        for n in ("event_id", "order_id", "customer_id", "event_type", "status")
    ]
    fields += [
        {"name": "amount_minor", "type": "long"},
        {"name": "currency", "type": text},
        {"name": "channel", "type": text},
        {"name": "event_time", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ]
    return json.dumps({"type": "record", "name": "Order", "namespace": "bench", "fields": fields})


def register_avro_schema(settings: Settings, topic: str) -> int:
    """Register the writer schema under ``<topic>-value``; its registry id."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    client = SchemaRegistryClient({"url": settings.schema_registry_url})
    return int(client.register_schema(f"{topic}-value", Schema(avro_writer_schema(), "AVRO")))


class AvroOrders:
    """Re-encodes the generator's planned JSON records as Avro, as a producer with
    confluent-kafka's AvroSerializer writes them. Valid records and their duplicates become the
    same record of the writer schema (a v1 record's amount in minor units, its channel
    ``unknown``, as the v1 upcaster reads it); tombstones stay NULL; the malformed ones become
    what goes wrong with Avro: a payload cut in half (``invalid_json``, ``missing_event_time``)
    or a valid payload framed with a schema id the registry does not know (``wrong_type``,
    ``unknown_schema_version``)."""

    def __init__(self, settings: Settings, topic: str) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient
        from confluent_kafka.schema_registry.avro import AvroSerializer
        from confluent_kafka.serialization import MessageField, SerializationContext

        client = SchemaRegistryClient({"url": settings.schema_registry_url})
        self.serialize = AvroSerializer(
            client, avro_writer_schema(), conf={"auto.register.schemas": False}
        )
        self.ctx = SerializationContext(topic, MessageField.VALUE)

    def encode(self, record: Any) -> bytes | None:
        if record.value is None:
            return None
        if record.kind == "malformed":
            body = self._bytes(
                {
                    "event_id": record.event_id or f"bad-{record.timestamp_ms}",
                    "order_id": record.order_id,
                    "customer_id": "c-00000",
                    "event_type": "updated",
                    "status": "open",
                    "amount_minor": 0,
                    "currency": "EUR",
                    "channel": "web",
                    "event_time": record.timestamp_ms,
                }
            )
            if record.malformed_reason in ("invalid_json", "missing_event_time"):
                return body[: 5 + (len(body) - 5) // 2]
            return b"\x00" + AVRO_UNKNOWN_ID.to_bytes(4, "big") + body[5:]
        payload = json.loads(record.value)
        return self._bytes(
            {
                "event_id": record.event_id,
                "order_id": record.order_id,
                "customer_id": payload["customer_id"],
                "event_type": record.event_type,
                "status": record.status,
                "amount_minor": record.amount_minor,
                "currency": record.currency,
                "channel": payload.get("channel", "unknown"),
                "event_time": record.event_time_ms,
            }
        )

    def _bytes(self, value: dict[str, Any]) -> bytes:
        data = self.serialize(value, self.ctx)
        assert isinstance(data, bytes)
        return data


def produce_avro_history(
    settings: Settings, config: Any, on_progress: Any, chunk_hours: int = 12
) -> int:
    """``produce_history`` of the generator (same plans, chunk by chunk, same seeds), each
    record's value re-encoded by :class:`AvroOrders`; the records produced."""
    from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

    from backfill_assets.demo import generator as gen

    encoder = AvroOrders(settings, config.topic)
    gen._prepare_topic(settings, AdminClient(dict(settings.kafka.client_config())), config)
    produced = 0
    for index, first in enumerate(range(0, config.hours, chunk_hours)):
        chunk = dataclasses.replace(
            config,
            start=config.start + timedelta(hours=first),
            hours=min(chunk_hours, config.hours - first),
            seed=config.seed + index,
        )
        plan = [dataclasses.replace(r, value=encoder.encode(r)) for r in gen.plan_events(chunk)]
        gen._produce(settings, config.topic, plan)
        produced += len(plan)
        del plan
        on_progress(first + chunk.hours, config.hours)
    return produced


def resources() -> dict[str, object]:
    """The raw asset's resources, as in definitions.RESOURCES (not imported: the bench needs
    only the raw asset, not every asset and sensor the definitions build)."""
    from backfill_assets.defs.resources import IcebergResource, KafkaResource, SparkResource

    return {"kafka": KafkaResource(), "spark": SparkResource(), "iceberg": IcebergResource()}


# Namespaces are unique to this process: a reused --home keeps the tables of earlier runs.
RUN_TAG = uuid.uuid4().hex[:6]


def use_namespace(name: str) -> None:
    """Point every later materialization at fresh tables (resources read the env per run)."""
    os.environ["BACKFILL_NAMESPACE"] = f"{name}_{RUN_TAG}"


def materialize(spec: TopicSpec, start: datetime, end: datetime) -> tuple[float, dict[str, Any]]:
    """The raw asset over the partitions in [start, end); wall seconds and its metadata."""
    import dagster as dg

    from backfill_assets.defs.assets import build_raw_asset

    began = time.monotonic()
    result = dg.materialize(
        [build_raw_asset(spec)],
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


def bare_spark(
    spark: SparkSession, settings: Settings, contract: OffsetContract, out: Path
) -> tuple[float, int]:
    """Kafka -> Parquet over the contract's offsets, nothing else; seconds and rows written."""
    from backfill_assets.lake.write.read import read_contract

    shutil.rmtree(out, ignore_errors=True)
    began = time.monotonic()
    read_contract(spark, settings, contract).write.mode("overwrite").parquet(str(out))
    seconds = time.monotonic() - began
    rows = spark.read.parquet(str(out)).count()  # not timed: proves the job read everything
    return seconds, rows


def hand_written(
    spark: SparkSession,
    settings: Settings,
    spec: TopicSpec,
    contract: OffsetContract,
    table: str,
    writer_schema: str | None = None,
    fresh: bool = True,
) -> tuple[float, int]:
    """What a user would write by hand: read the same offsets, ``from_json`` with the table's
    schema, append to a fresh Iceberg table partitioned by Kafka hour. No exactness, no
    quarantine, no checks (``from_json`` coerces and nulls what it cannot read). Seconds and
    rows appended.

    With ``writer_schema`` (an Avro topic's, as the user fetched it from the registry): the
    value without its 5-byte Confluent header (magic byte, schema id), ``from_avro`` with that
    schema (PERMISSIVE: a record it cannot read is NULL instead of failing the job), the
    columns selected by name. One writer schema for every record: the schema ids are not
    looked at."""
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    from backfill_assets.lake.write.read import read_contract
    from backfill_assets.spec.model import SPARK_TYPES

    schema = ", ".join(f"`{c.name}` {SPARK_TYPES[c.type]}" for c in spec.columns)
    if fresh:  # else append to the table an earlier call made
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {table.rsplit('.', 1)[0]}")
        spark.sql(f"DROP TABLE IF EXISTS {table} PURGE")
        spark.sql(
            f"CREATE TABLE {table} (kafka_partition int, kafka_offset bigint, "
            f"kafka_timestamp timestamp, {schema}) USING iceberg "
            "PARTITIONED BY (hours(kafka_timestamp))"
        )
    began = time.monotonic()
    if writer_schema is None:
        decoded = F.from_json(F.col("value").cast("string"), schema)
        values = [F.col("j.*")]
    else:
        payload = F.expr("substring(value, 6)")
        decoded = from_avro(payload, writer_schema, {"mode": "PERMISSIVE"})
        values = [F.col(f"j.{c.name}") for c in spec.columns]
    parsed = read_contract(spark, settings, contract).select(
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        decoded.alias("j"),
    )
    parsed.select("kafka_partition", "kafka_offset", "kafka_timestamp", *values).writeTo(
        table
    ).append()
    seconds = time.monotonic() - began
    rows = spark.table(table).count()  # not timed: proves the job wrote everything
    return seconds, rows


def spark_parse(
    spark: SparkSession, settings: Settings, spec: TopicSpec, contract: OffsetContract, out: Path
) -> float:
    """The asset's own read, window attribution and parse, written to Parquet: no Iceberg,
    branch, checks, publish or Dagster. Separates the cost of the transform from that of
    write-audit-publish. ``contract`` must come from ``offset_contract`` (it has windows)."""
    from backfill_assets.lake.decode import avro
    from backfill_assets.lake.decode.parse import parse
    from backfill_assets.lake.write.read import attribute, read_contract

    shutil.rmtree(out, ignore_errors=True)
    began = time.monotonic()
    source = attribute(spark, read_contract(spark, settings, contract), contract)
    writers = None
    if spec.format == "avro":  # as the asset does: the scan's schema ids, resolved
        assert contract.windows is not None
        writers = avro.resolve(spec, settings.schema_registry_url, contract.windows.schema_ids)
    rows, quarantine, *cached = parse(spec, source, "bench", writers)
    rows.write.parquet(str(out / "rows"))
    quarantine.write.parquet(str(out / "quarantine"))
    seconds = time.monotonic() - began
    for frame in cached:
        frame.unpersist()
    return seconds


def librdkafka(settings: Settings, contract: OffsetContract) -> tuple[float, int]:
    """Consume and discard the contract's offsets; seconds and records consumed."""
    from confluent_kafka import Consumer, TopicPartition

    began = time.monotonic()
    consumer = Consumer(
        {
            # The window scan's consumer settings (large fetches).
            **settings.kafka.range_reader_config(),
            "group.id": f"bench-discard-{uuid.uuid4().hex[:6]}",  # never joined: assign only
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
    )
    todo = {p: (s, e) for p, (s, e) in contract.ranges.items() if e > s}
    consumer.assign([TopicPartition(contract.topic, p, s) for p, (s, _) in todo.items()])
    got = 0
    deadline = time.monotonic() + 600
    while todo and time.monotonic() < deadline:
        # The scan's batch and poll (scan._BATCH, _POLL_S): a full batch or the timeout.
        for msg in consumer.consume(num_messages=10_000, timeout=0.05):
            if msg.error():
                continue
            p, offset = msg.partition(), msg.offset()
            rng = todo.get(p)  # type: ignore[arg-type]
            if rng is None or offset is None or offset >= rng[1]:
                continue
            got += 1
            if offset >= rng[1] - 1:
                del todo[p]  # type: ignore[arg-type]
    seconds = time.monotonic() - began
    consumer.close()
    assert not todo, f"partitions not drained: {todo}"
    return seconds, got


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def jvm_old_gen_peak_mib(spark: SparkSession) -> float:
    """Peak use of the JVM's old generation (what the heap retained: caches, not garbage)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    pools = jvm.java.lang.management.ManagementFactory.getMemoryPoolMXBeans()
    used = sum(int(p.getPeakUsage().getUsed()) for p in pools if "Old Gen" in str(p.getName()))
    return used / 2**20


def jvm_live_heap_mib(spark: SparkSession) -> float:
    """The JVM heap still in use after a full GC: what the run left reachable."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jvm.java.lang.System.gc()
    pools = jvm.java.lang.management.ManagementFactory.getMemoryPoolMXBeans()
    heap = jvm.java.lang.management.MemoryType.HEAP
    used = sum(int(p.getUsage().getUsed()) for p in pools if p.getType() == heap)
    return used / 2**20


def child(args: argparse.Namespace) -> None:
    """One materialization in this fresh process; print its peak memory as one JSON line."""
    from backfill_assets.stack import spark as spark_mod
    from backfill_assets.stack.settings import Settings

    start = datetime.fromisoformat(args.start)
    use_namespace(args.namespace)
    spec = orders_spec(args.topic, args.format)
    seconds, meta = materialize(spec, start, datetime.fromisoformat(args.end))
    session = spark_mod.get_session(Settings.from_env())  # the run's session (getOrCreate)
    jvm = session.sparkContext._jvm
    assert jvm is not None
    jvm_pid = int(jvm.java.lang.ProcessHandle.current().pid())
    result = {
        "seconds": seconds,
        "records": meta["run"]["records_read"],
        "python_kib": vm_hwm_kib(os.getpid()),
        "jvm_kib": vm_hwm_kib(jvm_pid),
        "jvm_old_gen_peak_mib": jvm_old_gen_peak_mib(session),
        "jvm_live_heap_mib": jvm_live_heap_mib(session),
    }
    print(CHILD_MARKER + json.dumps(result), flush=True)
    session.stop()


def run_child(
    topic: str, start: datetime, end: datetime, namespace: str, fmt: str
) -> dict[str, Any]:
    cmd = [
        *(sys.executable, os.path.abspath(__file__), "--child"),
        *("--topic", topic, "--start", start.isoformat(), "--end", end.isoformat()),
        *("--namespace", namespace, "--format", fmt),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_MARKER):
            out: dict[str, Any] = json.loads(line.removeprefix(CHILD_MARKER))
            return out
    raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


# --- --profile: time every Spark action of one asset run, labelled by its caller -------------


@contextmanager
def action_timer() -> Iterator[dict[str, list[float]]]:
    """Wrap DataFrame actions and V2 writes; record (outermost call only) seconds per caller."""
    from pyspark.sql import DataFrameWriterV2
    from pyspark.sql.classic.dataframe import DataFrame  # the class sessions hand out

    from backfill_assets.lake.offsets import contract
    from backfill_assets.lake.write import checks, wap
    from backfill_assets.stack import fetch

    timings: dict[str, list[float]] = defaultdict(list)
    depth = [0]
    originals: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str | None = None) -> None:
        """Time calls of ``owner.name``; with ``label``, a phase (its actions still count)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*a: Any, **kw: Any) -> Any:
            if depth[0] and label is None:
                return original(*a, **kw)
            frame = sys._getframe(1)
            key = label or f"{frame.f_code.co_name}:{frame.f_lineno} {name}"
            depth[0] += label is None
            began = time.monotonic()
            try:
                return original(*a, **kw)
            finally:
                depth[0] -= label is None
                timings[key].append(time.monotonic() - began)

        originals.append((owner, name, original))
        setattr(owner, name, timed)

    from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame
    from pyspark.sql.connect.readwriter import DataFrameWriterV2 as ConnectWriterV2

    for name in ("count", "collect", "first"):
        wrap(DataFrame, name)
        wrap(ConnectDataFrame, name)
    wrap(DataFrameWriterV2, "overwrite")
    wrap(ConnectWriterV2, "overwrite")
    wrap(checks, "run_checks", PHASE_CHECKS)
    for name in ("rows", "arrow", "to_pandas"):  # how the project collects (stack/fetch.py)
        wrap(fetch, name)
    wrap(contract, "scan", PHASE_SCAN)  # the offset scan, as contract.py calls it
    wrap(wap, "publish", PHASE_PUBLISH)
    try:
        yield timings
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


# --- the parent -------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    seconds: list[float] = dataclasses.field(default_factory=list)
    records: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        return self.records / self.median


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=4, help="hourly partitions in the 1x range")
    parser.add_argument("--events-per-hour", type=int, default=12_000)
    parser.add_argument("--mem-factor", type=int, default=10, help="the large memory range")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved runs; median")
    parser.add_argument("--mem-repeat", type=int, default=1, help="runs per range; median")
    parser.add_argument("--profile", action="store_true", help="time each Spark action too")
    parser.add_argument(
        "--profile-first",
        action="store_true",
        help="also time each Spark action of the warm-up run: the first run of the process "
        "(cold JVM code paths, first Kafka read, first Python worker), as a small backfill's run",
    )
    parser.add_argument(
        "--profile-runs",
        action="store_true",
        help="also time each Spark action of every measured asset run (the first one of a "
        "range pays for what a fresh run process pays: new generated code to compile, the "
        "first Python workers)",
    )
    parser.add_argument(
        "--connect",
        action="store_true",
        help="run every Spark contender as a thin client of a local Spark Connect server this "
        "script starts (the asset's runs and the baselines alike); implies --skip-memory",
    )
    parser.add_argument(
        "--format",
        choices=("json", "avro"),
        default="json",
        help="the history's encoding: json (the demo's orders), or avro (the same orders in "
        "Confluent's wire format, with a local schema registry; the hand-written job uses "
        "from_avro)",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--home",
        help="keep the broker's data and the generated topic in this directory and reuse them "
        "when run again with the same --hours, --events-per-hour and --mem-factor (generate "
        "once: the scale benchmark's 10 M records take minutes to produce); default: a "
        "temporary directory, deleted at the end",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("--end", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import
    if args.child:
        child(args)
        return

    keep = args.home is not None
    home = os.path.abspath(args.home) if keep else tempfile.mkdtemp(prefix="bench-throughput-")
    os.makedirs(home, exist_ok=True)
    # Hour 0 is the warm-up range; the measured ranges start at hour 1.
    hours = 1 + max(args.hours, 0 if args.skip_memory else args.hours * args.mem_factor)
    history = {"hours": hours, "events_per_hour": args.events_per_hour}
    state_path = Path(home) / "bench-history.json"
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
    if state and state["history"] != history:
        raise SystemExit(
            f"{home} holds another history ({state['history']}, this run needs {history}); "
            "pass another --home or delete that one"
        )
    if state and state.get("format", "json") != args.format:  # homes before --format: json
        raise SystemExit(
            f"{home} holds a {state.get('format', 'json')} history, this run asks for "
            f"--format {args.format}; pass another --home (one per format) or delete that one"
        )
    ports = state.get("ports") or {"kafka": free_port(), "controller": free_port()}
    if args.format == "avro":
        # The registry keeps its schemas in memory: a fresh one per run, on a free port.
        os.environ["BACKFILL_SCHEMA_REGISTRY_PORT"] = str(free_port())
        os.environ.pop("BACKFILL_SCHEMA_REGISTRY_URL", None)
    os.environ.update(
        {
            "BACKFILL_HOME": home,
            "BACKFILL_JAR_CACHE": os.environ.get("BACKFILL_JAR_CACHE")
            or os.path.abspath(".stack/jars"),
            "BACKFILL_KAFKA_PORT": str(ports["kafka"]),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(ports["controller"]),
            "BACKFILL_DAGSTER_STORAGE": os.path.join(home, "dagster"),
            "PYICEBERG_HOME": os.path.join(home, "pyiceberg-home"),
            "BACKFILL_SENSORS": "off",
        }
    )
    from backfill_assets.demo.generator import GeneratorConfig, produce_history
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    engine = "Spark Connect (local server)" if args.connect else f"Spark {settings.spark_master}"
    print(
        f"format {args.format}; {engine}, driver memory {settings.spark_driver_memory}, "
        f"shuffle partitions {settings.spark_shuffle_partitions}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    broker = LocalBroker(settings)
    broker.start()
    server: Any = None
    registry: Any = None
    try:
        if args.format == "avro":
            from backfill_assets.stack.registry import LocalRegistry

            registry = LocalRegistry(settings)
            print(registry.start().describe(), flush=True)
        if args.connect:
            server = connect_server()
            args.skip_memory = True  # the driver JVM is the server's: no per-run peak to read
            settings = Settings.from_env()  # the baselines' sessions: thin clients too
        if state:
            topic = str(state["topic"])
            print(f"reusing {state['records']:,} records over {hours} h in {topic} ({home})")
            if args.format == "avro":
                schema_id = register_avro_schema(settings, topic)
                if schema_id != state["schema_id"]:
                    raise SystemExit(
                        f"the fresh registry gave the writer schema id {schema_id}, the records "
                        f"in {home} carry {state['schema_id']}; delete that --home"
                    )
        else:
            topic = f"bench_{uuid.uuid4().hex[:6]}"
            began = time.monotonic()
            config = GeneratorConfig(
                topic=topic, start=HISTORY_START, hours=hours, events_per_hour=args.events_per_hour
            )

            def progress(done: int, total: int) -> None:
                print(f"  generated {done}/{total} h ({time.monotonic() - began:.0f}s)", flush=True)

            if args.format == "avro":
                schema_id = register_avro_schema(settings, topic)
                records = produce_avro_history(settings, config, progress)
            else:
                records = produce_history(settings, config, on_progress=progress)
            print(
                f"generated {records:,} {args.format} records over {hours} h into {topic} "
                f"in {time.monotonic() - began:.0f}s"
            )
            if keep:
                state = {"history": history, "ports": ports, "topic": topic, "records": records}
                state["format"] = args.format
                if args.format == "avro":
                    state["schema_id"] = schema_id
                state_path.write_text(json.dumps(state, indent=1))
        start = HISTORY_START + timedelta(hours=1)
        if not args.skip_throughput:
            throughput(args, settings, topic, start)
        if not args.skip_memory:
            memory(args, topic, start)
    finally:
        if server is not None:
            server.stop()
        if registry is not None:
            registry.stop()
        broker.stop()
        if not keep:
            shutil.rmtree(home, ignore_errors=True)


def connect_server() -> Any:
    """Start a local Spark Connect server on a free port; later sessions are its thin clients."""
    from backfill_assets.stack.connect import LocalConnectServer
    from backfill_assets.stack.settings import Settings

    os.environ["BACKFILL_SPARK_CONNECT_PORT"] = str(free_port())
    server = LocalConnectServer(Settings.from_env())
    print(server.start().describe(), flush=True)
    os.environ["BACKFILL_SPARK_CONNECT"] = server.url
    return server


def throughput(args: argparse.Namespace, settings: Settings, topic: str, start: datetime) -> None:
    from backfill_assets.lake.offsets.contract import offset_contract
    from backfill_assets.stack import spark as spark_mod
    from backfill_assets.stack.kafka import KafkaClient

    spec = orders_spec(topic, args.format)
    writer = None  # the hand-written job's from_avro schema, fetched as a user would
    if args.format == "avro":
        from confluent_kafka.schema_registry import SchemaRegistryClient

        registry = SchemaRegistryClient({"url": settings.schema_registry_url})
        writer = str(registry.get_latest_version(f"{topic}-value").schema.schema_str)
    kafka = KafkaClient()
    warm = (HISTORY_START, HISTORY_START + timedelta(hours=1))
    end = start + timedelta(hours=args.hours)
    contract = offset_contract(kafka, topic, start, end)
    warm_contract = offset_contract(kafka, topic, *warm)
    parquet = settings.home / "parquet"
    hand_table = f"{settings.catalog.name}.bench_hand.{topic}"

    spark = spark_mod.get_session(settings)
    began = time.monotonic()
    use_namespace("bench_warmup")
    if args.profile_first:
        with action_timer() as timings:
            total, _ = materialize(spec, *warm)
        print_profile("the warm-up run, first of this process", total, timings)
    else:
        materialize(spec, *warm)
    bare_spark(spark, settings, warm_contract, parquet)
    hand_written(spark, settings, spec, warm_contract, hand_table, writer)
    spark_parse(spark, settings, spec, warm_contract, parquet)
    librdkafka(settings, warm_contract)
    print(f"warm-up (1 h, {warm_contract.records:,} offsets): {time.monotonic() - began:.0f}s")

    asset, bare, hand, parsed, rdk = Sample(), Sample(), Sample(), Sample(), Sample()
    replay_s: list[float] = []
    audit_s: list[float] = []
    for i in range(args.repeat):
        use_namespace(f"bench_r{i}")
        with action_timer() as timings:
            seconds, meta = materialize(spec, start, end)
        if args.profile_runs:
            print_profile(f"measured asset run {i + 1}", seconds, timings)
        asset.seconds.append(seconds)
        audit_s.append(sum(sum(timings.get(p, [])) for p in (PHASE_SCAN, PHASE_CHECKS)))
        asset.records = int(meta["run"]["records_read"])
        replay_s.append(float(meta["run"]["duration_s"]))
        seconds, bare.records = bare_spark(spark, settings, contract, parquet)
        bare.seconds.append(seconds)
        seconds, hand.records = hand_written(spark, settings, spec, contract, hand_table, writer)
        hand.seconds.append(seconds)
        parsed.seconds.append(spark_parse(spark, settings, spec, contract, parquet))
        parsed.records = asset.records
        seconds, rdk.records = librdkafka(settings, contract)
        rdk.seconds.append(seconds)
        print(
            f"  run {i + 1}/{args.repeat}: asset {asset.seconds[-1]:.1f}s "
            f"(replay to branch {replay_s[-1]:.1f}s), bare Spark {bare.seconds[-1]:.1f}s, "
            f"hand-written {hand.seconds[-1]:.1f}s, "
            f"Spark parse {parsed.seconds[-1]:.1f}s, librdkafka {rdk.seconds[-1]:.1f}s"
        )
    assert asset.records == bare.records == rdk.records == hand.records, (
        f"contenders read different record counts: asset {asset.records}, "
        f"bare Spark {bare.records}, hand-written {hand.records}, librdkafka {rdk.records}"
    )

    stat = "median" if args.repeat > 1 else "single run"
    print()
    print(
        f"Throughput ({args.format} topic) over {args.hours} h x {args.events_per_hour:,} events/h "
        f"({contract.records:,} offsets in {len(contract.ranges)} partitions), {stat} "
        f"of {args.repeat}:"
    )
    print(f"  {'contender':<46} {'records':>9} {'seconds':>8} {'records/s':>10}")
    rows: list[tuple[str, Sample]] = [
        ("raw asset (materialize: WAP, checks, publish)", asset),
        ("(a) bare Spark Kafka -> Parquet", bare),
        (f"(h) hand-written Kafka -> from_{args.format} -> Iceberg", hand),
        ("(b) librdkafka consume-and-discard", rdk),
        ("(c) Spark parse + dedupe -> Parquet, no WAP", parsed),
    ]
    for name, sample in rows:
        print(f"  {name:<46} {sample.records:>9,} {sample.median:>8.2f} {sample.rate:>10,.0f}")
    replay = statistics.median(replay_s)
    print(
        f"  {'  of which replay_to_branch (its duration_s)':<46} {asset.records:>9,} "
        f"{replay:>8.2f} {asset.records / replay:>10,.0f}"
    )
    vs_bare = asset.rate / bare.rate
    vs_hand = asset.rate / hand.rate
    print()
    print(
        f"  asset / hand-written:    {vs_hand:.2f}x  "
        f"(goal >= {HAND_GOAL}x: {goal(vs_hand >= HAND_GOAL)})"
    )
    print(
        f"  asset / bare Spark:      {vs_bare:.2f}x  "
        f"(goal >= {BARE_GOAL}x: {goal(vs_bare >= BARE_GOAL)})"
    )
    audit = statistics.median(audit_s)
    print(
        f"  audit / hand-written:    {audit / hand.median:.2f}x  (audit = the librdkafka scan + "
        f"the checks, {audit:.2f}s median; hand-written {hand.median:.2f}s)"
    )
    print(f"  asset / librdkafka:      {asset.rate / rdk.rate:.2f}x")
    print(f"  bare Spark / librdkafka: {bare.rate / rdk.rate:.2f}x")
    print(f"  asset / (c) parse only:  {asset.rate / parsed.rate:.2f}x  (cost of WAP + Dagster)")

    if args.profile:
        use_namespace("bench_profile")
        with action_timer() as timings:
            total, _ = materialize(spec, start, end)
        print_profile("one more asset run", total, timings)
    spark.stop()


def print_profile(what: str, total: float, timings: dict[str, list[float]]) -> None:
    print()
    print(f"Profile of {what} ({total:.1f}s wall), outermost Spark actions:")
    timed = 0.0
    for label, secs in sorted(timings.items(), key=lambda kv: -sum(kv[1])):
        timed += sum(secs) if label not in (PHASE_CHECKS, PHASE_PUBLISH) else 0.0
        print(f"  {sum(secs):>7.2f}s  x{len(secs):<3} {label}")
    print(f"  {total - timed:>7.2f}s  rest (Dagster, DDL, catalog, audit table, publish)")


def memory(args: argparse.Namespace, topic: str, start: datetime) -> None:
    """Each range in a fresh process, ``--mem-repeat`` times (alternating); medians."""
    runs: dict[int, list[dict[str, Any]]] = {1: [], args.mem_factor: []}
    for _ in range(args.mem_repeat):
        for factor, done in runs.items():
            end = start + timedelta(hours=args.hours * factor)
            done.append(run_child(topic, start, end, f"bench_mem{factor}", args.format))
    results = [
        (f"{f}x", {k: statistics.median(r[k] for r in rs) for k in rs[0]}) for f, rs in runs.items()
    ]
    print()
    print(
        f"Driver peak RSS (VmHWM), a fresh process per range, median of {args.mem_repeat} "
        "(seconds include start-up):"
    )
    print(
        f"  {'range':<6} {'records':>10} {'seconds':>8} {'records/s':>9} {'python MiB':>11} "
        f"{'JVM MiB':>9} {'sum MiB':>9} {'JVM old gen peak MiB':>21} {'live heap MiB':>14}"
    )
    for label, m in results:
        py, jv = m["python_kib"] / 1024, m["jvm_kib"] / 1024
        print(
            f"  {label:<6} {int(m['records']):>10,} {m['seconds']:>8.1f} "
            f"{m['records'] / m['seconds']:>9,.0f} {py:>11.0f} {jv:>9.0f} "
            f"{py + jv:>9.0f} {m['jvm_old_gen_peak_mib']:>21.0f} "
            f"{m.get('jvm_live_heap_mib', float('nan')):>14.0f}"
        )
    (_, small), (big, large) = results[0], results[-1]
    for what, key in (
        ("python", "python_kib"),
        ("JVM   ", "jvm_kib"),
        ("live heap after GC", "jvm_live_heap_mib"),
    ):
        print(f"  {what} {big}/1x: {large[key] / small[key]:.2f}x")
    total = (large["python_kib"] + large["jvm_kib"]) / (small["python_kib"] + small["jvm_kib"])
    print(
        f"  sum    {big}/1x: {total:.2f}x  (goal <= {MEMORY_GOAL}x: {goal(total <= MEMORY_GOAL)})"
    )


def goal(met: bool) -> str:
    return "goal met" if met else "GOAL NOT MET"


if __name__ == "__main__":
    main()
