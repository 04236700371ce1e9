"""Benchmark: one tick of the gap sensor over a long, fully published hourly history.

Starts its own broker (free ports, temporary BACKFILL_HOME), creates a topic with
``--partitions`` partitions and one record per partition per hour over ``--days`` days, and
records in the ledger that every hour of the raw table, the current-state table and the declared
tables is published (with the raw windows' offsets, as a real publish records them). Then it
times, for a short history (``--days-short``) and the full one, in the same process:

* the gap sensor's tick (``build_gap_sensor(...).evaluate_tick``: ledger, Kafka metadata,
  retention, requests), which reads Kafka only for hours the ledger does not cover;
* baseline: the old way of finding which hours hold records, one ListOffsets request per hour
  boundary of the whole history (``detect.hours_with_records`` without the ledger's windows).

The tick must stay flat as the history grows: the ratio long / short is printed. Nothing of
the raw table's data is read (the ledger and Kafka metadata are all the gap sensor uses).

Run from the repository root (after scripts/bootstrap.sh):
    .venv/bin/python bench/sensors.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
import warnings
from datetime import UTC, datetime, timedelta
from typing import Any

HOUR = timedelta(hours=1)
TICK_GOAL_S = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def produce_history(settings: Any, topic: str, partitions: int, start: datetime, hours: int) -> int:
    """One small record per partition per hour, at the hour's 30th minute (CreateTime)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import NewTopic

    from backfill_assets.defs.resources import KafkaResource

    admin = KafkaResource().admin()
    admin.create_topics(
        [
            NewTopic(
                topic,
                num_partitions=partitions,
                replication_factor=1,
                config={"retention.ms": "-1"},
            )
        ]
    )[topic].result(timeout=30)
    producer = Producer({**settings.kafka.client_config(), "linger.ms": 50})
    n = 0
    for h in range(hours):
        ts = int((start + h * HOUR + timedelta(minutes=30)).timestamp() * 1000)
        for p in range(partitions):
            producer.produce(topic, key=f"k{h}".encode(), value=b"{}", partition=p, timestamp=ts)
            n += 1
        if h % 200 == 0:
            producer.flush()
    producer.flush()
    return n


def publish_all(spec: Any, start: datetime, hours: int) -> None:
    """Ledger rows for every hour of the raw, current and declared tables (one commit each)."""
    from backfill_assets.defs.resources import IcebergResource, KafkaResource
    from backfill_assets.lake import ledger

    iceberg = IcebergResource()
    catalog = iceberg.catalog()
    ns = iceberg.settings.catalog.namespace  # this size's (BACKFILL_NAMESPACE)
    all_hours = [start + i * HOUR for i in range(hours)]
    bounds = KafkaResource().offsets_for_many(
        spec.topic, [int((start + i * HOUR).timestamp() * 1000) for i in range(hours + 1)]
    )
    offsets = {}
    for i, hour in enumerate(all_hours):
        lo = bounds[int(hour.timestamp() * 1000)]
        hi = bounds[int((hour + HOUR).timestamp() * 1000)]
        offsets[hour] = {p: (lo[p], hi[p]) for p in lo}
        del i
    names = [spec.raw_table, spec.current_table, *(t.name for t in spec.tables)]
    for seq, name in enumerate(names, start=1):
        ledger.record_publish(
            catalog,
            ns,
            iceberg.spark_name(name),
            run_id=f"bench-{name}",
            snapshot_id=seq,
            sequence_number=seq,
            hours=all_hours,
            offsets=offsets if name == spec.raw_table else None,
        )


def tick_seconds(spec: Any, repeat: int) -> tuple[float, list[str]]:
    """Median seconds of one gap-sensor tick, and the run requests of the last one."""
    import dagster as dg

    from backfill_assets.defs.assets import build_topic_assets
    from backfill_assets.defs.resources import IcebergResource, KafkaResource, SparkResource
    from backfill_assets.defs.sensors import build_gap_sensor

    sensor = build_gap_sensor(spec, [spec])
    resources = {"kafka": KafkaResource(), "iceberg": IcebergResource()}
    defs = dg.Definitions(
        assets=build_topic_assets(spec),
        sensors=[sensor],
        resources={**resources, "spark": SparkResource()},  # never started: no run is launched
    )
    instance = dg.DagsterInstance.ephemeral()
    times = []
    requests: list[str] = []
    for _ in range(repeat):
        context = dg.build_sensor_context(instance=instance, resources=resources, definitions=defs)
        began = time.monotonic()
        data = sensor.evaluate_tick(context)
        times.append(time.monotonic() - began)
        requests = [r.tags.get("backfill_assets/request", "") for r in data.run_requests or []]
    return statistics.median(times), requests


def probe_seconds(spec: Any, start: datetime, hours: int, repeat: int) -> float:
    """Baseline: which hours hold records, from one ListOffsets per hour boundary."""
    from backfill_assets.defs.resources import KafkaResource
    from backfill_assets.lake import detect

    times = []
    for _ in range(repeat):
        began = time.monotonic()
        found = detect.hours_with_records(KafkaResource(), spec.topic, start, start + hours * HOUR)
        times.append(time.monotonic() - began)
        assert len(found) == hours, f"{len(found)} hours with records, expected {hours}"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--days", type=int, default=60)
    parser.add_argument("--days-short", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    home = tempfile.mkdtemp(prefix="bench-sensors-")
    os.environ.update(
        {
            "BACKFILL_HOME": home,
            "BACKFILL_JAR_CACHE": os.path.abspath(".stack/jars"),
            "BACKFILL_KAFKA_PORT": str(free_port()),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
            "BACKFILL_DAGSTER_STORAGE": os.path.join(home, "dagster"),
            "PYICEBERG_HOME": os.path.join(home, "pyiceberg-home"),
            "BACKFILL_SENSORS": "off",
        }
    )
    from backfill_assets.lake.declared import renamed
    from backfill_assets.lake.spec import load_specs
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    (orders,) = [s for s in load_specs() if s.topic == "orders"]
    broker = LocalBroker(settings)
    broker.start()
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    results = {}
    try:
        for days in (args.days_short, args.days):
            hours = days * 24
            start = now - hours * HOUR
            topic = f"sensors_{days}d_{uuid.uuid4().hex[:6]}"
            spec = renamed(orders, topic, partition_start=start)
            os.environ["BACKFILL_NAMESPACE"] = f"bench_{days}d"
            made = produce_history(settings, topic, args.partitions, start, hours)
            publish_all(spec, start, hours)
            tick, requests = tick_seconds(spec, args.repeat)
            probe = probe_seconds(spec, start, hours, max(1, args.repeat // 2))
            results[days] = (tick, probe)
            print(
                f"{days} days x {args.partitions} partitions ({made:,} records, {hours} hours "
                f"published): gap-sensor tick {tick:.2f}s (requests: {requests or 'none'}); "
                f"ListOffsets per hour (old way) {probe:.2f}s"
            )
    finally:
        broker.stop()
        shutil.rmtree(home, ignore_errors=True)
    (short_tick, _), (long_tick, long_probe) = results[args.days_short], results[args.days]
    print()
    print(
        f"gap-sensor tick over {args.days} days: {long_tick:.2f}s "
        f"(goal <= {TICK_GOAL_S}s: {'met' if long_tick <= TICK_GOAL_S else 'NOT MET'})"
    )
    print(f"  {args.days} days / {args.days_short} days: {long_tick / short_tick:.2f}x")
    print(f"  tick / old per-hour ListOffsets probe alone: {long_tick / long_probe:.2f}x")


if __name__ == "__main__":
    main()
