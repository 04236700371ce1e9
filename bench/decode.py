"""Micro-benchmark: the independent decode behind ``decoded_content``, per record, in Python.

Generates ``--hours`` x ``--events-per-hour`` orders records (the demo generator's planned
records: valid, malformed, tombstones, both schema versions) and times
:class:`backfill_assets.lake.decode.content.RecordDecoder` over them (best of ``--repeat``, in this
thread's CPU time, which the machine's load inflates less than the wall time also shown), with
the byte hash of the window scan (:func:`backfill_assets.lake.offsets.windows.record_hash`) as
baseline, the sample predicate (:func:`backfill_assets.lake.decode.content.in_sample`) and the
decode pass's step (:class:`backfill_assets.lake.offsets.decode_pass.Decoding`) in a large hour
(1 record in K decoded), per record of the window. No Kafka, no Spark. Prints the load
average: these machines are shared.

With ``--format avro`` the same records are in Confluent's wire format (``throughput.py``'s
writer schema, a local schema registry started for the run) and the decode is the Avro one
(confluent-kafka's AvroDeserializer); its baseline is fastavro reading the same payloads with
the same writer and reader schemas, and it also times the deserializer called with a
serialization context (which runs the subject's rule machinery per record) against without
(what :class:`backfill_assets.lake.decode.avro.IndependentDecode` does).

With ``--format protobuf`` it also re-encodes the valid Avro orders as Protobuf (event time a
``google.protobuf.Timestamp``) and times Python's protobuf parse of the payload (baseline)
against :class:`backfill_assets.lake.decode.protobuf.IndependentDecode` and the whole RecordDecoder.

Run from the repository root:
    .venv/bin/python bench/decode.py
    .venv/bin/python bench/decode.py --format avro
    .venv/bin/python bench/decode.py --format protobuf
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=4)
    parser.add_argument("--events-per-hour", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--format", choices=("json", "avro", "protobuf"), default="json")
    args = parser.parse_args()
    if args.format in ("avro", "protobuf"):
        avro_main(args)
        return

    from backfill_assets.demo.generator import GeneratorConfig, plan_events
    from backfill_assets.lake.decode import content
    from backfill_assets.lake.offsets import decode_pass, windows
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
        sampled = decode_pass.Decoding(decode, content.Sample(k, 0, frozenset({0})))
        timed(
            f"the decode pass's count and decode, 1 in {k}",
            lambda p, o, key, v, d=sampled: d.add(cell, True, p, o, key, v),
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
    from backfill_assets.lake.decode import content
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
        if args.format == "protobuf":
            rows = [deserializer(v, None) for v in values]
            rows = [{k: v for k, v in r.items() if not k.startswith("__")} for r in rows]
            _protobuf(args, settings, rows, timed)
    finally:
        registry.stop()


def _protobuf(args: argparse.Namespace, settings: object, rows: list, timed: Callable) -> None:
    """The same valid orders as Protobuf (``bench.Order``, event_time a Timestamp), registered
    under ``decode_pb-value``: Python's protobuf parse of the payload (baseline) against
    :class:`backfill_assets.lake.decode.protobuf.IndependentDecode` and the whole RecordDecoder."""
    import base64

    import throughput
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

    from backfill_assets.lake.decode import content, protobuf

    file = descriptor_pb2.FileDescriptorProto(name="o.proto", package="bench", syntax="proto3")
    file.dependency.append("google/protobuf/timestamp.proto")
    msg = file.message_type.add(name="Order")
    F = descriptor_pb2.FieldDescriptorProto
    for i, name in enumerate(rows[0]):
        kind = F.TYPE_INT64 if name == "amount_minor" else F.TYPE_STRING
        field = msg.field.add(name=name, number=i + 1, label=F.LABEL_OPTIONAL, type=kind)
        if name == "event_time":
            field.type, field.type_name = F.TYPE_MESSAGE, ".google.protobuf.Timestamp"
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(file)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Order"))
    client = SchemaRegistryClient({"url": settings.schema_registry_url})  # type: ignore[attr-defined]
    text = base64.b64encode(file.SerializeToString()).decode()
    sid = client.register_schema("decode_pb-value", Schema(text, "PROTOBUF"))
    values = []
    for row in rows:
        m = cls(**{k: v for k, v in row.items() if k != "event_time" and v is not None})
        m.event_time.FromDatetime(row["event_time"])
        values.append(b"\x00" + sid.to_bytes(4, "big") + b"\x00" + m.SerializeToString())
    spec = throughput.orders_spec("decode_pb", "avro").model_copy(
        update={"format": "protobuf", "subject": "decode_pb-value"}
    )
    independent = protobuf.IndependentDecode(spec, settings.schema_registry_url)  # type: ignore[attr-defined]
    assert independent(values[0]) == content_row(rows[0])
    decoder = content.RecordDecoder(spec, settings.schema_registry_url)  # type: ignore[attr-defined]
    records = [(0, i, b"k", v) for i, v in enumerate(values)]
    print(f"{len(values):,} Protobuf records, best of {args.repeat}:")
    base = timed(
        "protobuf FromString of the payload (baseline)", values, lambda v: cls.FromString(v[6:])
    )
    mine = timed("IndependentDecode (ProtobufDeserializer + columns)", values, independent)
    whole = timed("RecordDecoder (decode + content hash)", records, lambda r: decoder(*r))
    print(
        f"  IndependentDecode / FromString: {mine / base:.2f}x; RecordDecoder / FromString: "
        f"{whole / base:.2f}x; load average {os.getloadavg()[0]:.1f}"
    )


def content_row(row: dict) -> dict:
    """An Avro-decoded order as IndependentDecode gives it (event time in epoch micros)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return {**row, "event_time": (row["event_time"] - epoch) // timedelta(microseconds=1)}


def _decodes(deserializer: Callable[[bytes, None], object], value: bytes) -> bool:
    try:
        deserializer(value, None)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    main()
