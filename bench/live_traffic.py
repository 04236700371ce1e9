"""Benchmark: does a throttled backfill keep its cap, and what does it do to live consumers?

Starts its own broker (free ports, temporary BACKFILL_HOME), writes history to a topic, then:

A. replays the history through the full raw asset path (read, parse, branch write, checks are
   not run here) with the throttle at --cap records/s and reports the achieved read rate;
B. runs a live producer (--live-rate msg/s) and a live consumer in a consumer group, measuring
   end-to-end latency (consume time - CreateTime) for --seconds without a backfill and again
   while a throttled replay runs, and prints p50/p99 and the ratio (with / without).

Run from the repository root (jars resolved by scripts/bootstrap.sh):
    .venv/bin/python bench/live_traffic.py --cap 2000 --seconds 30
Timings on a shared 2-core machine are noisy: compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from datetime import UTC, datetime, timedelta

from confluent_kafka import Consumer, Producer

HISTORY_START = datetime(2026, 8, 1, tzinfo=UTC)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def live_latency(conf: dict[str, object], topic: str, rate: int, seconds: float) -> list[float]:
    """Produce at ``rate`` msg/s and consume in a group; latencies in milliseconds."""
    stop = threading.Event()
    latencies: list[float] = []

    def produce() -> None:
        producer = Producer({**conf, "linger.ms": 0})
        interval = 1.0 / rate
        next_at = time.monotonic()
        while not stop.is_set():
            producer.produce(topic, value=b"x" * 200, timestamp=int(time.time() * 1000))
            producer.poll(0)
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        producer.flush(10)

    consumer = Consumer(
        {
            **conf,
            "group.id": f"live-app-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "latest",
            "fetch.wait.max.ms": 10,
        }
    )
    consumer.subscribe([topic])
    # Join the group before measuring.
    deadline = time.monotonic() + 20
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(0.2)
    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        msg = consumer.poll(0.5)
        if msg is None or msg.error():
            continue
        latencies.append(time.time() * 1000 - msg.timestamp()[1])
    stop.set()
    thread.join()
    consumer.close()
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, default=2000, help="throttle, records/s")
    parser.add_argument("--history-hours", type=int, default=12)
    parser.add_argument("--events-per-hour", type=int, default=5000)
    parser.add_argument("--live-rate", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument(
        "--connect",
        action="store_true",
        help="replay as a thin client of a local Spark Connect server this script starts with "
        "the default settings (the shared engine): the server's Spark, not the run's, competes "
        "with the live consumer",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Dagster's beta notices on import

    home = tempfile.mkdtemp(prefix="bench-live-")
    os.environ.update(
        {
            "BACKFILL_HOME": home,
            "BACKFILL_JAR_CACHE": os.path.abspath(".stack/jars"),
            "BACKFILL_KAFKA_PORT": str(free_port()),
            "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
            "BACKFILL_SENSORS": "off",
            # What a throttled run's process sees: with the default settings its local Spark
            # gets half the cores (stack/settings.py::default_master).
            "BACKFILL_REPLAY_MAX_RECORDS_PER_S": str(args.cap),
        }
    )
    from backfill_assets.demo.generator import GeneratorConfig, generate
    from backfill_assets.lake.offsets.contract import offset_contract
    from backfill_assets.lake.write.read import read_contract, read_throttled
    from backfill_assets.stack import spark as spark_mod
    from backfill_assets.stack.broker import LocalBroker
    from backfill_assets.stack.kafka import KafkaClient
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    broker = LocalBroker(settings)
    broker.start()
    server = None
    try:
        if args.connect:
            from backfill_assets.stack.connect import LocalConnectServer

            os.environ["BACKFILL_SPARK_CONNECT_PORT"] = str(free_port())
            server = LocalConnectServer(Settings.from_env())
            print(server.start().describe(), flush=True)
            os.environ["BACKFILL_SPARK_CONNECT"] = server.url
            settings = Settings.from_env()
        history = f"history_{uuid.uuid4().hex[:6]}"
        truth = generate(
            settings,
            GeneratorConfig(
                topic=history,
                start=HISTORY_START,
                hours=args.history_hours,
                events_per_hour=args.events_per_hour,
            ),
        )
        live = f"live_{uuid.uuid4().hex[:6]}"
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient(settings.kafka.client_config())
        admin.create_topics([NewTopic(live, 3, 1)])[live].result(30)
        spark = spark_mod.get_session(settings)
        contract = offset_contract(
            KafkaClient(),
            history,
            HISTORY_START,
            HISTORY_START + timedelta(hours=args.history_hours),
        )
        print(f"history: {contract.records:,} records ({truth.totals['records']:,} generated)")
        engine = "a local Spark Connect server" if args.connect else settings.spark_master
        print(f"Spark: {engine}; load average {os.getloadavg()[0]:.1f}")

        # A. Throttle accuracy (and the unthrottled read as a baseline in the same process).
        began = time.monotonic()
        read_contract(spark, settings, contract).count()
        free_s = time.monotonic() - began
        began = time.monotonic()
        union, pieces = read_throttled(spark, settings, contract, args.cap)
        union.count()
        capped_s = time.monotonic() - began
        for piece in pieces:
            piece.unpersist()
        achieved = contract.records / capped_s
        print(f"unthrottled read: {contract.records / free_s:,.0f} records/s ({free_s:.1f}s)")
        print(
            f"throttled read:   {achieved:,.0f} records/s against a cap of {args.cap:,} "
            f"({achieved / args.cap:.2f}x of cap, {len(pieces)} chunks, {capped_s:.1f}s)"
        )

        # B. Live consumer latency without and with a throttled replay running.
        conf = settings.kafka.client_config()
        quiet = live_latency(conf, live, args.live_rate, args.seconds)

        def replay() -> None:
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                union, pieces = read_throttled(spark, settings, contract, args.cap)
                # The raw asset parses and writes what it read; do the same amount of work.
                union.selectExpr("count(*)", "sum(length(value))").collect()
                for piece in pieces:
                    piece.unpersist()

        worker = threading.Thread(target=replay, daemon=True)
        worker.start()
        busy = live_latency(conf, live, args.live_rate, args.seconds)
        worker.join()
        print(f"live consumer, {args.live_rate} msg/s, {args.seconds:.0f}s per phase:")
        for name, vals in (("no backfill:       ", quiet), ("throttled backfill:", busy)):
            print(f"  {name} n={len(vals)} p50={pct(vals, 50):.1f}ms p99={pct(vals, 99):.1f}ms")
        print(f"  p99 ratio (with / without): {pct(busy, 99) / pct(quiet, 99):.2f}x (goal <= 1.2x)")
        spark.stop()
    finally:
        if server is not None:
            server.stop()
        broker.stop()


if __name__ == "__main__":
    main()
