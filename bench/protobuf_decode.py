"""Micro-benchmark: the raw parse's Protobuf decode in Spark (the udf jar's ProtobufRow), per
record, against writing the same cached values without decoding.

N values of an orders message (8 strings, an int64, a google.protobuf.Timestamp) in Confluent's
wire format are cached in 2 partitions of the local Spark session; each pass writes them to
Spark's ``noop`` sink, once as they are ("read", the baseline) and once with every column
decoded ("decode"), four times alternating. Compare two commits by running each from its own
worktree with ``PYTHONPATH`` set to it (the udf jar is named by the hash of its sources, so both
jars stay in the cache).

Run from the repository root:
    .venv/bin/python bench/protobuf_decode.py [N]      # default 400000
"""

import base64
import sys
import time
from datetime import UTC, datetime

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2
from pyspark.sql import functions as F

from backfill_assets.lake.decode import protobuf
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import spark as stack_spark
from backfill_assets.stack.settings import Settings

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400_000
F_ = descriptor_pb2.FieldDescriptorProto
file = descriptor_pb2.FileDescriptorProto(name="o.proto", package="bench", syntax="proto3")
file.dependency.append("google/protobuf/timestamp.proto")
msg = file.message_type.add(name="Order")
names = [
    "event_id",
    "order_id",
    "customer_id",
    "event_type",
    "status",
    "amount_minor",
    "currency",
    "channel",
    "event_time",
]
for i, n in enumerate(names):
    f = msg.field.add(
        name=n,
        number=i + 1,
        label=F_.LABEL_OPTIONAL,
        type=F_.TYPE_INT64 if n == "amount_minor" else F_.TYPE_STRING,
    )
    if n == "event_time":
        f.type, f.type_name = F_.TYPE_MESSAGE, ".google.protobuf.Timestamp"
pool = descriptor_pool.DescriptorPool()
pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
pool.Add(file)
cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Order"))
values = []
for i in range(2000):
    m = cls(
        event_id=f"e-{i:08d}",
        order_id=f"o-{i % 700:06d}",
        customer_id=f"c-{i % 91:05d}",
        event_type="updated",
        status="open",
        amount_minor=1000 + i,
        currency="EUR",
        channel="web",
    )
    m.event_time.FromDatetime(datetime(2026, 9, 1, tzinfo=UTC))
    values.append((b"\x00\x00\x00\x00\x07\x00" + m.SerializeToString(),))
spec = TopicSpec.model_validate(
    {
        "topic": "pb",
        "format": "protobuf",
        "key_field": "order_id",
        "event_id_field": "event_id",
        "event_time_field": "event_time",
        "partition_start": "2026-09-01T00:00:00+00:00",
        "allowed_lateness_hours": 0,
        "quarantine_max_ratio": 1.0,
        "columns": [
            {
                "name": n,
                "type": "bigint"
                if n == "amount_minor"
                else ("timestamp" if n == "event_time" else "string"),
            }
            for n in names
        ],
    }
)
w = protobuf.judge(spec, 7, ("PROTOBUF", base64.b64encode(file.SerializeToString()).decode()))
assert w.reason is None, w
s = stack_spark.get_session(Settings.from_env())
small = s.createDataFrame(values, "value binary")
df = s.range(N // 2000).crossJoin(small).select("value").repartition(2).cache()
print("rows", df.count(), flush=True)
fn = protobuf._row_function(s, spec)
call = F.call_function(
    fn, F.col("value"), F.lit(w.descriptor), F.lit(protobuf._request(spec, w.message))
)
decode = df.select(call.alias("r")).agg(
    F.sum(F.length(F.col("r").getField("c0"))),
    F.sum(F.col("r").getField("c5")),
    F.max(F.col("r").getField("status")),
)
base = df.agg(F.sum(F.length("value")))
print(decode.collect())
full = df.select(call.alias("r"), "value")
for label, q in [("read", df), ("decode", full)] * 4:
    t = time.perf_counter()
    q.write.format("noop").mode("overwrite").save()
    print(label, f"{time.perf_counter() - t:.3f}", flush=True)
