"""Micro-benchmark: the independent decode behind ``decoded_content``, per record, in Python.

Generates ``--hours`` x ``--events-per-hour`` orders records (the demo generator's planned
records: valid, malformed, tombstones, both schema versions) and times
:class:`backfill_assets.lake.content.RecordDecoder` over them (best of ``--repeat``, in this
thread's CPU time, which the machine's load inflates less than the wall time also shown), with
the byte hash of the window scan (:func:`backfill_assets.lake.windows.record_hash`) as baseline,
the sample predicate (:func:`backfill_assets.lake.content.in_sample`) and the scan's decode of
a large window (1 record in K decoded) per record of the window. No Kafka, no
Spark. Prints the load average: these machines are shared.

With ``--format avro`` the same records are in Confluent's wire format (``throughput.py``'s
writer schema, a local schema registry started for the run) and the decode is the Avro one
(confluent-kafka's AvroDeserializer); its baseline is fastavro reading the same payloads with
the same writer and reader schemas, and it also times the deserializer called with a
serialization context (which runs the subject's rule machinery per record) against without
(what :class:`backfill_assets.lake.avro.IndependentDecode` does).

Run from the repository root:
    .venv/bin/python bench/decode.py
    .venv/bin/python bench/decode.py --format avro
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=4)
    parser.add_argument("--events-per-hour", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--format", choices=("json", "avro"), default="json")
    args = parser.parse_args()
    if args.format == "avro":
        avro_main(args)
        return

    from backfill_assets.demo.generator import GeneratorConfig, plan_events
    from backfill_assets.lake import content, windows
    from backfill_assets.spec.loader import load_specs

    planned = plan_events(
        GeneratorConfig(
            start=datetime(2026, 9, 1, tzinfo=UTC),
            hours=args.hours,
            events_per_hour=args.events_per_hour,
        )
    )
    records = [(r.partition, i, r.key, r.value) for i, r in enumerate(planned)]
    (spec,) = [s for s in load_specs() if s.topic == "orders"]
    decode = content.RecordDecoder(spec)
    n = len(records)

    def timed(label: str, fn: Callable[[int, int, bytes | None, bytes | None], object]) -> float:
        best = best_wall = float("inf")
        for _ in range(args.repeat):
            began, began_wall = time.thread_time(), time.perf_counter()
            for p, o, k, v in records:
                fn(p, o, k, v)
            best = min(best, time.thread_time() - began)
            best_wall = min(best_wall, time.perf_counter() - began_wall)
        print(
            f"  {label:<40} {best * 1e6 / n:8.2f} us/record CPU ({best_wall * 1e6 / n:.2f} wall)",
            flush=True,
        )
        return best

    print(f"{n:,} records, best of {args.repeat}, load average {os.getloadavg()[0]:.1f}:")
    base = timed("record_hash (the scan's byte hash)", windows.record_hash)
    cell = windows.Cell(0, 0)
    timed("the scan's count (Cell.add, with the hash)", lambda p, o, k, v: cell.add(o, k, v, p))
    whole = timed("RecordDecoder (decode + content hash)", decode)
    timed("in_sample(p, o, 16)", lambda p, o, k, v: content.in_sample(p, o, 16))
    for k in (16, 8):
        sampled = windows._Decoding(decode, k, 0)  # a "large" window: only the sample
        timed(
            f"the scan's count and decode, 1 in {k}",
            lambda p, o, key, v, d=sampled: d.add(cell, p, o, key, v, cell.add(o, key, v, p)),
        )
    print(f"  decode / byte hash: {whole / base:.1f}x; load average {os.getloadavg()[0]:.1f}")


def avro_main(args: argparse.Namespace) -> None:
    """The Avro decode per record, with its own local schema registry."""
    import io
    import json
    import socket
    import sys
    import tempfile

    os.environ["BACKFILL_HOME"] = tempfile.mkdtemp(prefix="bench-decode-")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["BACKFILL_SCHEMA_REGISTRY_PORT"] = str(sock.getsockname()[1])
    sys.path.insert(0, os.path.dirname(__file__))
    import throughput  # the Avro history's writer schema and encoder
    from confluent_kafka.serialization import MessageField, SerializationContext
    from fastavro import schemaless_reader

    from backfill_assets.demo.generator import GeneratorConfig, plan_events
    from backfill_assets.lake import content
    from backfill_assets.stack.registry import LocalRegistry
    from backfill_assets.stack.settings import Settings

    settings = Settings.from_env()
    registry = LocalRegistry(settings)
    print(registry.start().describe(), flush=True)
    try:
        topic = "decode"
        sid = throughput.register_avro_schema(settings, topic)
        encode = throughput.AvroOrders(settings, topic).encode
        planned = plan_events(
            GeneratorConfig(
                start=datetime(2026, 9, 1, tzinfo=UTC),
                hours=args.hours,
                events_per_hour=args.events_per_hour,
            )
        )
        records = [(r.partition, i, r.key, encode(r)) for i, r in enumerate(planned)]
        decode = content.RecordDecoder(throughput.orders_spec(topic, "avro"), registry.url)
        for record in records:
            decode(*record)  # fetches the schemas once
        deserializer = decode.decode._by_id[sid]  # type: ignore[union-attr]
        values = [v for _, _, _, v in records if v and v[1:5] == sid.to_bytes(4, "big")]
        values = [v for v in values if _decodes(deserializer, v)]
        writer = deserializer._get_parsed_schema(deserializer._registry.get_schema(sid))
        reader = deserializer._reader_schema
        ctx = SerializationContext(topic, MessageField.VALUE)

        def timed(label: str, items: list, fn: Callable[[object], object]) -> float:
            best = float("inf")
            for _ in range(args.repeat):
                began = time.thread_time()
                for item in items:
                    fn(item)
                best = min(best, time.thread_time() - began)
            print(f"  {label:<52} {best * 1e6 / len(items):8.2f} us/record CPU", flush=True)
            return best / len(items)

        print(f"{len(records):,} records ({len(values):,} valid Avro), best of {args.repeat}:")
        base = timed(
            "fastavro, writer + reader schema (baseline)",
            values,
            lambda v: schemaless_reader(io.BytesIO(v[5:]), writer, reader),
        )
        with_ctx = timed(
            "AvroDeserializer with a serialization context", values, lambda v: deserializer(v, ctx)
        )
        without = timed(
            "AvroDeserializer without (IndependentDecode's)",
            values,
            lambda v: deserializer(v, None),
        )
        whole = timed("RecordDecoder (decode + content hash)", records, lambda r: decode(*r))
        print(
            f"  with context / without: {with_ctx / without:.2f}x; without / fastavro: "
            f"{without / base:.2f}x; RecordDecoder / fastavro: {whole / base:.2f}x; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        assert json.dumps(deserializer(values[0], None), default=str) == json.dumps(
            deserializer(values[0], ctx), default=str
        )
    finally:
        registry.stop()


def _decodes(deserializer: Callable[[bytes, None], object], value: bytes) -> bool:
    try:
        deserializer(value, None)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    main()
