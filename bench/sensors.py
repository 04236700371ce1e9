"""Benchmark: one tick of the gap sensor and of the late-data sensor over a long, fully
published hourly history.

Starts its own broker (free ports, temporary BACKFILL_HOME), creates a topic with
``--partitions`` partitions and one record per partition per hour over ``--days`` days, and
records in the ledger that every hour of the raw table, the current-state table and the declared
tables is published (with the raw windows' offsets and event hours, as a real publish records
them). Then it times, for a short history (``--days-short``) and the full one, in the same
process:

* the gap sensor's tick (``build_gap_sensor(...).evaluate_tick``: ledger, Kafka metadata,
  retention, requests), which reads Kafka only for hours the ledger does not cover;
* baseline: the old way of finding which hours hold records, one ListOffsets request per hour
  boundary of the whole history (``detect.hours_with_records`` without the ledger's windows);
* the late-data sensor's tick (``build_late_data_sensor(...).evaluate_tick``:
  ``detect.late_event_hours`` and the requests), after every raw hour was published once more,
  after the declared tables (so every raw publish is examined), each Kafka hour's rows
  holding its own hour, the hour before (inside the allowed lateness) and, once a day, an
  event hour 6 h old (beyond it: due).

Both ticks must stay flat as the history grows: the ratio long / short is printed. Nothing of
the raw table's data is read (the raw table does not even exist here): the ledger and Kafka
metadata are all the sensors use.

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


def produce_history(
    settings: Any,
    topic: str,
    partitions: int,
    start: datetime,
    hours: int,
    transactional: bool = False,
) -> int:
    """One small record per partition per hour, at the hour's 30th minute (CreateTime); with
    ``transactional``, each hour's records in one transaction, so every partition's hours end
    on commit markers (stamped with the broker's clock, not the back-dated time)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import NewTopic

    from backfill_assets.stack.kafka import KafkaClient

    admin = KafkaClient().admin()
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
    conf: dict[str, Any] = {**settings.kafka.client_config(), "linger.ms": 50}
    if transactional:
        conf["transactional.id"] = f"{topic}.bench"
    producer = Producer(conf)
    if transactional:
        producer.init_transactions(30)
    n = 0
    for h in range(hours):
        if transactional:
            producer.begin_transaction()
        ts = int((start + h * HOUR + timedelta(minutes=30)).timestamp() * 1000)
        for p in range(partitions):
            producer.produce(topic, key=f"k{h}".encode(), value=b"{}", partition=p, timestamp=ts)
            n += 1
        if transactional:
            producer.commit_transaction(30)
        elif h % 200 == 0:
            producer.flush()
    producer.flush()
    return n


def publish_all(
    spec: Any, start: datetime, hours: int
) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Ledger rows for every hour of the raw, current and declared tables (one commit each).

    The raw windows are what a raw run would record (committed records, chained); they come
    from the detection's own reading of the log, which a transactional topic needs (its
    ListOffsets-by-timestamp answers point at commit markers)."""
    from backfill_assets.lake.coverage import detect
    from backfill_assets.lake.offsets import ledger
    from backfill_assets.stack.catalog import CatalogClient
    from backfill_assets.stack.kafka import KafkaClient

    iceberg = CatalogClient()
    catalog = iceberg.catalog()
    ns = iceberg.settings.catalog.namespace  # this size's (BACKFILL_NAMESPACE)
    all_hours = [start + i * HOUR for i in range(hours)]
    offsets = detect.kafka_hours(KafkaClient(), spec.topic, start, start + hours * HOUR)
    assert sorted(offsets) == all_hours, f"{len(offsets)} hours with records, expected {hours}"
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
            event_hours=event_hours(all_hours, late=False) if name == spec.raw_table else None,
        )
    return offsets


LATE_BY = 6 * HOUR  # beyond the spec's 3 h allowed lateness


def event_hours(hours: list[datetime], *, late: bool) -> dict[datetime, dict[datetime, int]]:
    """Per Kafka hour: its own hour and the one before; with ``late``, once a day (from the
    seventh hour on, so the event hour is published) an event hour ``LATE_BY`` old."""
    out: dict[datetime, dict[datetime, int]] = {}
    for i, hour in enumerate(hours):
        out[hour] = {hour - HOUR: 1, hour: 11}
        if late and i >= 6 and i % 24 == 6:
            out[hour][hour - LATE_BY] = 1
    return out


def republish_raw(
    spec: Any, hours: list[datetime], offsets: dict[datetime, dict[int, tuple[int, int]]]
) -> int:
    """Every raw hour published again, after the declared tables, with late event hours;
    returns how many event hours that makes due."""
    from backfill_assets.defs.resources import IcebergResource
    from backfill_assets.lake.offsets import ledger

    iceberg = IcebergResource()
    late = event_hours(hours, late=True)
    ledger.record_publish(
        iceberg.catalog(),
        iceberg.settings.catalog.namespace,
        iceberg.spark_name(spec.raw_table),
        run_id="bench-late",
        snapshot_id=100,
        sequence_number=100,
        hours=hours,
        offsets=offsets,
        event_hours=late,
    )
    return len({e for k, per in late.items() for e in per if k - e == LATE_BY})


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


def late_tick_seconds(spec: Any, repeat: int) -> tuple[float, list[str], int]:
    """Median seconds of one late-data-sensor tick, its run requests and the due event hours
    ``detect.late_event_hours`` found (one more call, untimed)."""
    import dagster as dg

    from backfill_assets.defs.assets import build_topic_assets
    from backfill_assets.defs.resources import IcebergResource, KafkaResource, SparkResource
    from backfill_assets.defs.sensors import build_late_data_sensor
    from backfill_assets.lake.coverage import detect

    sensor = build_late_data_sensor(spec, [spec])
    resources = {"iceberg": IcebergResource()}
    defs = dg.Definitions(
        assets=build_topic_assets(spec),
        sensors=[sensor],
        resources={**resources, "kafka": KafkaResource(), "spark": SparkResource()},
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
    iceberg = IcebergResource()
    due = detect.late_event_hours(iceberg.catalog(), iceberg.settings.catalog.namespace, spec)
    hours = {h for per in due.values() for h in per}
    return statistics.median(times), requests, len(hours)


def probe_seconds(
    spec: Any, start: datetime, hours: int, repeat: int, transactional: bool = False
) -> float:
    """Baseline: which hours hold records, from one ListOffsets per hour boundary (on a
    transactional topic its answers point at commit markers: the count is not checked)."""
    from backfill_assets.lake.coverage import detect
    from backfill_assets.stack.kafka import KafkaClient

    times = []
    for _ in range(repeat):
        began = time.monotonic()
        found = detect.hours_with_records(KafkaClient(), spec.topic, start, start + hours * HOUR)
        times.append(time.monotonic() - began)
        assert transactional or len(found) == hours, f"{len(found)} hours, expected {hours}"
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--days", type=int, default=60)
    parser.add_argument("--days-short", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--transactional",
        action="store_true",
        help="write the history with a transactional producer (every hour ends on markers)",
    )
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
    from backfill_assets.spec.declared import renamed
    from backfill_assets.spec.loader import load_specs
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
            made = produce_history(
                settings, topic, args.partitions, start, hours, args.transactional
            )
            offsets = publish_all(spec, start, hours)
            tick, requests = tick_seconds(spec, args.repeat)
            probe = probe_seconds(spec, start, hours, max(1, args.repeat // 2), args.transactional)
            all_hours = [start + i * HOUR for i in range(hours)]
            expected = republish_raw(spec, all_hours, offsets)
            late, late_requests, found = late_tick_seconds(spec, args.repeat)
            assert found == expected, f"{found} late event hours found, expected {expected}"
            results[days] = (tick, probe, late)
            print(
                f"{days} days x {args.partitions} partitions ({made:,} records"
                f"{', transactional' if args.transactional else ''}, {hours} hours "
                f"published): gap-sensor tick {tick:.2f}s (requests: {requests or 'none'}); "
                f"ListOffsets per hour (old way) {probe:.2f}s; late-data-sensor tick "
                f"{late:.2f}s ({found} late event hours, {len(late_requests)} requests)"
            )
    finally:
        broker.stop()
        shutil.rmtree(home, ignore_errors=True)
    (short_tick, _, short_late) = results[args.days_short]
    (long_tick, long_probe, long_late) = results[args.days]
    print()
    for what, short, long in (
        ("gap-sensor", short_tick, long_tick),
        ("late-data-sensor", short_late, long_late),
    ):
        print(
            f"{what} tick over {args.days} days: {long:.2f}s "
            f"(goal <= {TICK_GOAL_S}s: {'met' if long <= TICK_GOAL_S else 'NOT MET'})"
        )
        print(f"  {args.days} days / {args.days_short} days: {long / short:.2f}x")
    print(f"gap-sensor tick / old per-hour ListOffsets probe alone: {long_tick / long_probe:.2f}x")


if __name__ == "__main__":
    main()
