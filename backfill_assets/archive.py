"""The topic archive: Kafka history kept in object storage, addressed by offset.

Layout, under ``BACKFILL_ARCHIVE_URI`` (a local directory by default, ``s3://bucket/prefix``
in production, both through :mod:`pyarrow.fs`)::

    <topic>/<partition>/<start:020d>-<end:020d>.parquet

A file holds every record of that partition whose offset is in ``[start, end)``; offsets with
no record (transaction markers, compaction) are simply absent. Columns: ``topic``,
``partition``, ``offset``, ``timestamp`` (ms, UTC), ``timestampType`` (Kafka's id: 0 create,
1 log-append), ``key``, ``value``, ``headers`` (list of key/value), i.e. what Spark's Kafka
source returns, so an archived range reads exactly like the same range read from Kafka.

What is atomic, and why each offset is archived exactly once:

* a file appears whole or not at all: it is written under a hidden temporary name in the
  same directory and then moved to its final name;
* the next file of a partition always starts where the archived chain ends, and readers take
  the chain (longest file at each start offset), so a crash at any point leaves either no
  file for a range (the rerun writes it) or the complete file (the rerun continues after it);
* the archiver never commits consumer offsets: the archive itself is the checkpoint.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from backfill_assets.errors import BackfillError

if TYPE_CHECKING:
    from confluent_kafka import Message

    from backfill_assets.resources import KafkaResource
    from backfill_assets.settings import Settings

_NAME = re.compile(r"^(\d{20})-(\d{20})\.parquet$")
# Kafka's TimestampType ids, as Spark's Kafka source reports them.
_KAFKA_TS_TYPE = {0: -1, 1: 0, 2: 1}  # confluent-kafka constant -> Kafka id

SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("timestamp", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("timestampType", pa.int32(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field(
            "headers",
            pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])),
        ),
    ]
)


class ArchiveError(BackfillError):
    """The archive cannot provide what was asked, or could not be written."""


@dataclass(frozen=True)
class ArchiveFile:
    """One archived file: every record of ``partition`` with offset in ``[start, end)``."""

    partition: int
    start: int
    end: int
    path: str  # filesystem path (no scheme)


@dataclass
class PartitionRun:
    """What one archiver pass did for one partition."""

    partition: int
    start: int
    end: int
    records: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)
    lost: tuple[int, int] | None = None  # offsets deleted from Kafka before they were archived

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "offsets": [self.start, self.end],
            "records": self.records,
            "bytes": self.bytes,
            "files": len(self.files),
        }
        if self.lost is not None:
            out["lost_before_archiving"] = list(self.lost)
        return out


class Archive:
    """Read and write the archive of one settings' ``archive_uri``."""

    def __init__(self, settings: Settings) -> None:
        self.uri = settings.archive_uri.rstrip("/")
        self.fs, self.root = _filesystem(settings)
        self.file_records = settings.archive_file_records

    # -- reading ------------------------------------------------------------------------
    def _dir(self, topic: str, partition: int) -> str:
        return f"{self.root}/{topic}/{partition}"

    def files(self, topic: str, partition: int) -> list[ArchiveFile]:
        """All complete files of a partition, by start offset (temporary files excluded)."""
        selector = pafs.FileSelector(self._dir(topic, partition), allow_not_found=True)
        out = []
        for info in self.fs.get_file_info(selector):
            match = _NAME.match(info.base_name)
            if match and info.type == pafs.FileType.File:
                start, end = int(match.group(1)), int(match.group(2))
                out.append(ArchiveFile(partition, start, end, info.path))
        return sorted(out, key=lambda f: (f.start, -f.end))

    def chain(self, topic: str, partition: int) -> list[ArchiveFile]:
        """Files covering the archive without overlap: the longest file at each start, then
        the file starting where it ends. Segments separated by holes are all returned."""
        chosen: list[ArchiveFile] = []
        for f in self.files(topic, partition):
            if chosen and f.start < chosen[-1].end:
                continue  # covered by a longer file (a concurrent or repeated archiver pass)
            chosen.append(f)
        return chosen

    def coverage(self, topic: str, partition: int) -> list[tuple[int, int]]:
        """Archived offset intervals of a partition, merged."""
        merged: list[tuple[int, int]] = []
        for f in self.chain(topic, partition):
            if merged and merged[-1][1] == f.start:
                merged[-1] = (merged[-1][0], f.end)
            else:
                merged.append((f.start, f.end))
        return merged

    def archived_end(self, topic: str, partition: int) -> int | None:
        cov = self.coverage(topic, partition)
        return cov[-1][1] if cov else None

    def covers(self, topic: str, partition: int, start: int, end: int) -> bool:
        return start >= end or any(
            s <= start and end <= e for s, e in self.coverage(topic, partition)
        )

    def files_for(self, topic: str, partition: int, start: int, end: int) -> list[ArchiveFile]:
        """The files holding ``[start, end)``; raises naming the offsets that are missing."""
        if start >= end:
            return []
        need = start
        picked = []
        for f in self.chain(topic, partition):
            if f.end <= need or f.start > need:
                continue
            picked.append(f)
            need = f.end
            if need >= end:
                return picked
        raise ArchiveError(
            f"topic {topic!r} partition {partition}: offsets [{need}, {end}) are not in the "
            f"archive at {self.uri} (archived: {_intervals(self.coverage(topic, partition))})"
        )

    def first_offset_at(
        self, topic: str, partition: int, timestamp_ms: int, below: int
    ) -> int | None:
        """The first archived offset < ``below`` whose timestamp is >= ``timestamp_ms`` (Kafka's
        ListOffsets-by-timestamp rule), or None if no archived record below it qualifies."""
        for f in self.chain(topic, partition):
            if f.start >= below:
                break
            meta = self._file_meta(f)
            if meta.get("max_timestamp_ms", timestamp_ms) < timestamp_ms:
                continue
            table = self._read(f, ["offset", "timestamp"])
            offsets = table.column("offset").to_pylist()
            stamps = table.column("timestamp").cast(pa.int64()).to_pylist()
            for off, ts in zip(offsets, stamps, strict=True):
                if off >= below:
                    return None
                if ts >= timestamp_ms:
                    return int(off)
        return None

    def read_records(self, topic: str, partition: int, start: int, end: int) -> pa.Table:
        """Records of ``[start, end)`` as an Arrow table (for tests and small tools)."""
        tables = [self._read(f) for f in self.files_for(topic, partition, start, end)]
        if not tables:
            return SCHEMA.empty_table()
        table = pa.concat_tables(tables)
        offsets = table.column("offset")
        mask = pc.and_(pc.greater_equal(offsets, start), pc.less(offsets, end))
        return table.filter(mask)

    def spark_uri(self, path: str) -> str:
        """The URI Spark reads a file path by (``s3://`` becomes Hadoop's ``s3a://``)."""
        scheme = self.uri.split("://", 1)[0] if "://" in self.uri else "file"
        if scheme in ("s3", "s3a"):
            return f"s3a://{path}"
        return f"file://{path}"

    def _read(self, f: ArchiveFile, columns: list[str] | None = None) -> pa.Table:
        with self.fs.open_input_file(f.path) as handle:
            return pq.read_table(handle, columns=columns)

    def _file_meta(self, f: ArchiveFile) -> dict[str, int]:
        with self.fs.open_input_file(f.path) as handle:
            meta = pq.read_schema(handle).metadata or {}
        raw = meta.get(b"backfill.archive")
        return json.loads(raw) if raw else {}

    # -- writing ------------------------------------------------------------------------
    def archive_topic(
        self, kafka: KafkaResource, topic: str, *, partitions: list[int] | None = None
    ) -> list[PartitionRun]:
        """Archive every partition of ``topic`` from where its archive ends to the high
        watermark seen at the start. Offsets Kafka deleted before they were archived are
        reported as ``lost`` (they cannot be recovered from Kafka any more)."""
        marks = kafka.watermarks(topic)
        runs = []
        for p in sorted(partitions if partitions is not None else marks):
            low, high = marks[p]
            resume = self.archived_end(topic, p)
            start = low if resume is None else resume
            lost = None
            if resume is not None and resume < low:
                lost, start = (resume, low), low
            elif resume is None and low > 0:
                lost = (0, low)
            run = PartitionRun(p, start, max(start, high), lost=lost)
            if high > start:
                self._archive_range(kafka, topic, run)
            runs.append(run)
        return runs

    def _archive_range(self, kafka: KafkaResource, topic: str, run: PartitionRun) -> None:
        from confluent_kafka import Consumer, KafkaError, TopicPartition

        settings = kafka.settings
        consumer = Consumer(
            {
                **settings.kafka.client_config(),
                # Required by librdkafka; never joined (assign, not subscribe) or committed.
                "group.id": "backfill-assets-archiver",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": False,
                # Spark's Kafka source reads uncommitted too: an archived range must read
                # exactly like the same range read from Kafka.
                "isolation.level": "read_uncommitted",
            }
        )
        tp = TopicPartition(topic, run.partition, run.start)
        consumer.assign([tp])
        file_start = run.start
        batch: list[Message] = []
        idle_since = time.monotonic()
        try:
            while True:
                position = consumer.position([TopicPartition(topic, run.partition)])[0].offset
                if position >= run.end:
                    break
                msgs = consumer.consume(num_messages=5000, timeout=1.0)
                if not msgs:
                    if time.monotonic() - idle_since > kafka.request_timeout_s:
                        raise ArchiveError(
                            f"topic {topic!r} partition {run.partition}: no records after "
                            f"offset {max(position, file_start)} for "
                            f"{kafka.request_timeout_s:.0f} s while archiving up to {run.end} "
                            f"from {settings.kafka.bootstrap_servers}; nothing after "
                            f"{file_start} was archived; rerun the archiver"
                        )
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            continue
                        raise ArchiveError(
                            f"topic {topic!r} partition {run.partition}: Kafka error while "
                            f"archiving from offset {file_start}: {err.str()}"
                        )
                    offset = msg.offset()
                    if offset is None or offset >= run.end:
                        continue
                    batch.append(msg)
                    if len(batch) >= self.file_records:
                        file_start = self._write(topic, run, file_start, offset + 1, batch)
                        batch = []
            if batch or file_start < run.end:
                self._write(topic, run, file_start, run.end, batch)
        finally:
            consumer.close()

    def _write(
        self, topic: str, run: PartitionRun, start: int, end: int, msgs: list[Message]
    ) -> int:
        """Write one file for ``[start, end)`` atomically; returns ``end``."""
        columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
        size = 0
        for msg in msgs:
            ts_type, ts = msg.timestamp()
            key, value = msg.key(), msg.value()
            columns["topic"].append(topic)
            columns["partition"].append(run.partition)
            columns["offset"].append(msg.offset())
            columns["timestamp"].append(ts)
            columns["timestampType"].append(_KAFKA_TS_TYPE.get(ts_type, -1))
            columns["key"].append(key)
            columns["value"].append(value)
            headers: list[tuple[str, bytes | None]] | None = msg.headers()  # type: ignore[assignment]
            columns["headers"].append(
                None if headers is None else [{"key": k, "value": v} for k, v in headers]
            )
            size += len(key or b"") + len(value or b"")
        stamps: list[int] = columns["timestamp"]
        meta = {
            "topic": topic,
            "partition": run.partition,
            "start": start,
            "end": end,
            "records": len(msgs),
            "min_timestamp_ms": min(stamps) if stamps else None,
            "max_timestamp_ms": max(stamps) if stamps else None,
        }
        schema = SCHEMA.with_metadata({b"backfill.archive": json.dumps(meta).encode()})
        table = pa.Table.from_pydict(columns, schema=schema)
        directory = self._dir(topic, run.partition)
        self.fs.create_dir(directory, recursive=True)
        final = f"{directory}/{start:020d}-{end:020d}.parquet"
        tmp = f"{directory}/.tmp-{uuid.uuid4().hex}.parquet"
        with self.fs.open_output_stream(tmp) as out:
            pq.write_table(table, out, compression="zstd")
        self.fs.move(tmp, final)
        run.records += len(msgs)
        run.bytes += size
        run.files.append(final)
        return end


def _filesystem(settings: Settings) -> tuple[pafs.FileSystem, str]:
    uri = settings.archive_uri.rstrip("/")
    if uri.startswith(("s3://", "s3a://")):
        cfg = settings.catalog
        kwargs: dict[str, Any] = {}
        if cfg.s3_endpoint:
            endpoint = cfg.s3_endpoint
            kwargs["scheme"] = "https" if endpoint.startswith("https://") else "http"
            kwargs["endpoint_override"] = endpoint.split("://", 1)[-1]
        if cfg.s3_access_key_id and cfg.s3_secret_access_key:
            kwargs["access_key"] = cfg.s3_access_key_id
            kwargs["secret_key"] = cfg.s3_secret_access_key
        if cfg.s3_region:
            kwargs["region"] = cfg.s3_region
        return pafs.S3FileSystem(**kwargs), uri.split("://", 1)[1]
    if "://" not in uri:
        raise ArchiveError(
            f"BACKFILL_ARCHIVE_URI={uri!r} is not a URI: use file:///ABS/PATH or s3://BUCKET/PREFIX"
        )
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def _intervals(cov: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{s}, {e})" for s, e in cov) or "nothing"
