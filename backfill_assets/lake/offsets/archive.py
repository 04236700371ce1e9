"""The topic archive: Kafka history kept in object storage, addressed by offset.

Layout, under ``BACKFILL_ARCHIVE_URI`` (a local directory by default, ``s3://bucket/prefix``
in production, both through :mod:`pyarrow.fs`)::

    <topic>/log-<topic id>/<partition>/<start:020d>-<end:020d>.parquet

The archive belongs to one log: ``<topic id>`` is the id Kafka gave the topic when it was
created (a topic deleted and recreated, or served by another cluster after a failover, is a
new log whose offsets restart), spelt as Kafka spells it (URL-safe base64: ``-`` and ``_``,
never a ``/``), and each file records the topic id and cluster id it was read from.
A reader is bound to one log: a run to the log its contract read, everything else to Kafka's
current log of the topic, so no run, scan or retention warning ever takes one log's archived
offsets for another's. Files of the first layout (``<topic>/<partition>/...``, no log) are
*unattributed*: never read, never deleted; each archiver pass re-archives from Kafka what Kafka
still holds and lists them with the folder an operator who knows their log moves them to.

A file holds every committed record of that partition whose offset is in ``[start, end)``;
offsets with no committed record (records of aborted transactions, transaction markers,
compaction) are simply absent. Columns: ``topic``,
``partition``, ``offset``, ``timestamp`` (ms, UTC), ``timestampType`` (Kafka's id: 0 create,
1 log-append), ``key``, ``value``, ``headers`` (list of key/value), i.e. what Spark's Kafka
source returns, so an archived range reads exactly like the same range read from Kafka with
``isolation.level=read_committed``.

Committed records only: the archiver reads with ``read_committed`` and so archives each
partition only up to its last stable offset (LSO); offsets at and after an open transaction's
first record wait for the next pass. Each file records ``"isolation": "read_committed"`` in its
Parquet schema metadata (key ``backfill.archive``). A file without it is *legacy*: it was
written by a reader that also returned records of aborted transactions. Readers refuse legacy
files (:class:`ArchiveError` naming the file and what to do); the archiver re-archives every
legacy file whose offsets Kafka still holds (the committed file for the same ``[start, end)``
replaces it atomically) and reports the ones it cannot (Kafka deleted some of their offsets).

What is atomic, and why each offset is archived exactly once:

* a file appears whole or not at all: it is written under a hidden temporary name in the
  same directory and then moved to its final name;
* the next file of a partition always starts where the archived chain ends, and readers take
  the chain (longest file at each start offset), so a crash at any point leaves either no
  file for a range (the rerun writes it) or the complete file (the rerun continues after it);
* a legacy file is replaced by moving its committed rewrite over it (an atomic rename on local
  disks, an atomic object overwrite on S3): there is never a moment with neither;
* the archiver never commits consumer offsets: the archive itself is the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from backfill_assets.errors import ArchiveError
from backfill_assets.spec import versions
from backfill_assets.stack import catalog

if TYPE_CHECKING:
    from confluent_kafka import Message

    from backfill_assets.stack.kafka import KafkaClient, TopicIdentity
    from backfill_assets.stack.settings import Settings

_NAME = re.compile(r"^(\d{20})-(\d{20})\.parquet$")
# The only isolation level the archive is read and written with; recorded in every file.
ISOLATION = "read_committed"
_META_KEY = b"backfill.archive"
# The folder of one log of a topic: ``log-<topic id>`` (see the module docstring).
_LOG_DIR = "log-{topic_id}"
# How long a reader that refuses a legacy file waits for Kafka's log start offset (to say
# whether the file can still be re-archived).
_LOOKUP_TIMEOUT_S = 10.0
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


def layout_version(topic: str) -> str:
    """The version of what defines the archive of ``topic`` (its file schema and isolation),
    shown by Dagster as the archive asset's ``code_version``."""
    return versions.digest("archive", [topic, SCHEMA.to_string(), ISOLATION, _LOG_DIR])


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
    # [last stable offset, high watermark) when an open transaction holds the LSO back: those
    # offsets are archived by a later pass, once the transaction has ended.
    waiting_for_transaction: tuple[int, int] | None = None
    # Legacy files (written without read_committed) this pass replaced by committed ones.
    rearchived: list[dict[str, Any]] = field(default_factory=list)
    # Legacy files that cannot be re-archived (Kafka deleted some of their offsets, or holds
    # other records there): readers keep refusing them.
    unverifiable_legacy: list[dict[str, Any]] = field(default_factory=list)
    # Legacy files reaching past the LSO: re-archived by a pass after the transaction ends.
    legacy_waiting: list[dict[str, Any]] = field(default_factory=list)
    # Files of the first layout (no log): never read; an operator who knows their log moves
    # them into its folder.
    unattributed: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "offsets": [self.start, self.end],
            "records": self.records,
            "bytes": self.bytes,
            "files": len(self.files),
        }
        if self.lost is not None:
            out["lost_before_archiving"] = list(self.lost)
        if self.waiting_for_transaction is not None:
            out["waiting_for_transaction"] = list(self.waiting_for_transaction)
        if self.rearchived:
            out["rearchived"] = self.rearchived
        if self.unverifiable_legacy:
            out["unverifiable_legacy"] = self.unverifiable_legacy
        if self.legacy_waiting:
            out["legacy_waiting_for_transaction"] = self.legacy_waiting
        if self.unattributed:
            out["unattributed"] = self.unattributed
        return out


class Archive:
    """Read and write the archive of one settings' ``archive_uri``, one log per topic: the log
    ``logs`` names for it, else Kafka's current log of the topic (asked once)."""

    def __init__(self, settings: Settings, logs: Mapping[str, TopicIdentity] | None = None) -> None:
        self.settings = settings
        self._logs = dict(logs or {})
        self.uri = settings.archive_uri.rstrip("/")
        self.fs, self.root = _filesystem(settings)
        self.file_records = settings.archive_file_records
        self._folders: dict[str, str] = {}  # topic -> the folder of its log (asked once)
        # Paths verified committed. Safe to remember: a committed file is never replaced (only
        # legacy files are), and any file at a name holds that range's committed records.
        self._committed: set[str] = set()

    # -- reading ------------------------------------------------------------------------
    def log(self, topic: str) -> TopicIdentity:
        """The log of ``topic`` this archive reads and writes."""
        if topic not in self._logs:
            from backfill_assets.stack.kafka import KafkaClient

            self._logs[topic] = KafkaClient(self.settings).topic_identity(topic)
        return self._logs[topic]

    def directory(self, topic: str, partition: int) -> str:
        """The folder of a partition's files in this archive's log of ``topic``."""
        if topic not in self._folders:
            self._folders[topic] = self._log_folder(topic, self.log(topic).topic_id)
        return f"{self._folders[topic]}/{partition}"

    def _log_folder(self, topic: str, topic_id: str) -> str:
        """``<root>/<topic>/log-<topic id>``, the id spelt as Kafka spells it (URL-safe
        base64, as ``kafka-topics.sh --describe`` prints it). confluent-kafka spells ids in
        standard base64, whose ``/`` split the folder (and ``//`` made it unreadable): a log
        archived under that first spelling keeps its folder, so nothing archived is lost."""
        folder = f"{self.root}/{topic}/{_LOG_DIR.format(topic_id=_url_safe(topic_id))}"
        first = f"{self.root}/{topic}/{_LOG_DIR.format(topic_id=topic_id)}"
        if first == folder or "//" in first or first.endswith("/"):
            return folder
        if self.fs.get_file_info(first).type == pafs.FileType.Directory:
            return first
        return folder

    def files(self, topic: str, partition: int) -> list[ArchiveFile]:
        """All complete files of a partition, by start offset (temporary files excluded)."""
        return self._listed(self.directory(topic, partition), partition)

    def _listed(self, directory: str, partition: int) -> list[ArchiveFile]:
        selector = pafs.FileSelector(directory, allow_not_found=True)
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
                self._require_committed(topic, picked)
                return picked
        raise ArchiveError(
            f"topic {topic!r} partition {partition}: offsets [{need}, {end}) are not in the "
            f"archive at {self.uri} of the topic's log {self.log(topic).topic_id} (archived: "
            f"{_intervals(self.coverage(topic, partition))})"
        )

    def first_offset_at(
        self, topic: str, partition: int, timestamp_ms: int, below: int
    ) -> int | None:
        """The first archived offset < ``below`` whose timestamp is >= ``timestamp_ms`` (Kafka's
        ListOffsets-by-timestamp rule), or None if no archived record below it qualifies.
        Raises if a file it has to consult is legacy."""
        for f in self.chain(topic, partition):
            if f.start >= below:
                break
            meta = self._file_meta(f)
            if not _is_committed(meta):
                raise self._legacy_error(topic, [f])
            self._committed.add(f.path)
            newest = meta.get("max_timestamp_ms")
            if newest is None or newest < timestamp_ms:
                continue  # empty, or every record is older
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

    def _file_meta(self, f: ArchiveFile) -> dict[str, Any]:
        with self.fs.open_input_file(f.path) as handle:
            meta = pq.read_schema(handle).metadata or {}
        raw = meta.get(_META_KEY)
        return dict(json.loads(raw)) if raw else {}

    def is_legacy(self, f: ArchiveFile) -> bool:
        """Whether ``f`` was written without ``read_committed`` (it may hold records of aborted
        transactions)."""
        if f.path in self._committed:
            return False
        if _is_committed(self._file_meta(f)):
            self._committed.add(f.path)
            return False
        return True

    def _require_committed(self, topic: str, files: list[ArchiveFile]) -> None:
        legacy = [f for f in files if self.is_legacy(f)]
        if legacy:
            raise self._legacy_error(topic, legacy)

    def _legacy_error(self, topic: str, legacy: list[ArchiveFile]) -> ArchiveError:
        """The refusal of legacy files, saying for each whether the archiver can still replace
        it (Kafka holds its offsets) or an operator has to act (Kafka deleted some)."""
        low = self._log_start(topic, legacy[0].partition)
        command = f"`backfill-assets archive --topic {topic}`"
        parts = []
        for f in legacy:
            what = (
                f"archive file {f.path} (topic {topic!r} partition {f.partition} offsets "
                f"[{f.start}, {f.end}))"
            )
            if low is not None and f.start < low:
                parts.append(
                    f"{what} cannot be re-archived because Kafka deleted offsets "
                    f"[{f.start}, {min(low, f.end)}) (log start offset {low}): restore a "
                    f"committed copy of it from elsewhere, or have an operator delete {f.path} "
                    "(its offsets are then missing from the archive)"
                )
            elif low is not None:
                parts.append(f"{what}: run {command} to re-archive it from Kafka")
            else:
                parts.append(
                    f"{what}: run {command} to re-archive it from Kafka; if Kafka no longer "
                    f"holds all of [{f.start}, {f.end}) it cannot be re-archived and must be "
                    f"restored from elsewhere or deleted by an operator"
                )
        return ArchiveError(
            "refusing archive files written before the archive read committed records only "
            "(they may hold records of aborted transactions): " + "; ".join(parts)
        )

    def _log_start(self, topic: str, partition: int) -> int | None:
        """Kafka's log start offset of a partition, or None if Kafka cannot say."""
        from backfill_assets.stack.kafka import KafkaClient

        try:
            kafka = KafkaClient(self.settings, request_timeout_s=_LOOKUP_TIMEOUT_S)
            return kafka.list_offsets(topic, [partition], "earliest")[partition][0]
        except Exception:  # the refusal stands either way; only its advice is less precise
            return None

    # -- writing ------------------------------------------------------------------------
    def archive_topic(
        self,
        kafka: KafkaClient,
        topic: str,
        *,
        partitions: list[int] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[PartitionRun]:
        """Archive every partition of ``topic`` from where its archive ends to the last stable
        offset (LSO) seen at the start, and re-archive its legacy files that Kafka still holds.

        Offsets Kafka deleted before they were archived are reported as ``lost`` (they cannot
        be recovered from Kafka any more); offsets an open transaction holds back (between the
        LSO and the high watermark) as ``waiting_for_transaction``. ``on_progress(partitions
        done, partitions)`` is called after each partition."""
        bounds = log_bounds(kafka, topic)
        runs: list[PartitionRun] = []
        todo = sorted(partitions if partitions is not None else bounds)
        for p in todo:
            low, lso, high = bounds[p]
            resume = self.archived_end(topic, p)
            start = low if resume is None else resume
            lost = None
            if resume is not None and resume < low:
                lost, start = (resume, low), low
            elif resume is None and low > 0:
                lost = (0, low)
            run = PartitionRun(p, start, max(start, lso), lost=lost)
            if high > max(start, lso):
                run.waiting_for_transaction = (max(start, lso), high)
            run.unattributed = self._unattributed(topic, p)
            self._rearchive_legacy(kafka, topic, run, low, lso)
            if lso > start:
                self._archive_range(kafka, topic, run)
            runs.append(run)
            if on_progress is not None:
                on_progress(len(runs), len(todo))
        return runs

    def _unattributed(self, topic: str, partition: int) -> list[dict[str, Any]]:
        """The partition's files of the first layout (no log), each with where to move it."""
        folder = self.directory(topic, partition)
        return [
            {
                "file": f.path,
                "offsets": [f.start, f.end],
                "why": (
                    f"archived before the archive kept one folder per log, so no run reads it: "
                    f"if it was read from the topic's current log (topic id "
                    f"{self.log(topic).topic_id}), move it into {folder}/; otherwise keep it "
                    "apart (it is another log's history)"
                ),
            }
            for f in self._listed(f"{self.root}/{topic}/{partition}", partition)
        ]

    def _rearchive_legacy(
        self, kafka: KafkaClient, topic: str, run: PartitionRun, low: int, lso: int
    ) -> None:
        """Replace each legacy file of the partition whose offsets Kafka holds (all of them at
        or after ``low``, all of them below ``lso``) by the committed file of the same range."""
        for f in self.files(topic, run.partition):
            if not self.is_legacy(f):
                continue
            entry: dict[str, Any] = {"file": f.path, "offsets": [f.start, f.end]}
            if f.start < low:
                run.unverifiable_legacy.append(
                    {**entry, "kafka_deleted": [f.start, min(low, f.end)]}
                )
                continue
            if f.end > lso:
                run.legacy_waiting.append({**entry, "last_stable_offset": lso})
                continue
            with contextlib.closing(
                self._committed_records(kafka, topic, f.partition, f.start, f.end)
            ) as it:
                msgs = list(it)
            table, _ = _table(self.log(topic), topic, f.partition, f.start, f.end, msgs)
            legacy = self._read(f)
            if not _is_subset(table, legacy):
                # Kafka's committed records differ from what the file holds (the topic was
                # deleted and recreated?): replacing it would swap history for other records.
                run.unverifiable_legacy.append(
                    {**entry, "reason": "Kafka holds records that differ from the file's"}
                )
                continue
            self._put(topic, f.partition, f.start, f.end, table)
            self._committed.add(f.path)
            run.rearchived.append(
                {**entry, "records_before": legacy.num_rows, "records_after": table.num_rows}
            )

    def _archive_range(self, kafka: KafkaClient, topic: str, run: PartitionRun) -> None:
        file_start = run.start
        batch: list[Message] = []
        try:
            with contextlib.closing(
                self._committed_records(kafka, topic, run.partition, run.start, run.end)
            ) as records:
                for msg in records:
                    batch.append(msg)
                    if len(batch) >= self.file_records:
                        offset = int(msg.offset())  # type: ignore[arg-type]
                        file_start = self._write(topic, run, file_start, offset + 1, batch)
                        batch = []
        except ArchiveError as exc:
            raise ArchiveError(
                f"{exc} (nothing at or after offset {file_start} was archived)"
            ) from None
        if batch or file_start < run.end:
            self._write(topic, run, file_start, run.end, batch)

    def _committed_records(
        self, kafka: KafkaClient, topic: str, partition: int, start: int, end: int
    ) -> Generator[Message, None, None]:
        """Every committed record of ``[start, end)``, in offset order; ``end`` must not be
        above the partition's last stable offset.

        librdkafka (read_committed) drops records of aborted transactions and transaction
        markers and moves the consumer position past them, so the position reaches ``end``
        even when the last offsets before it hold no committed record."""
        from confluent_kafka import KafkaError, TopicPartition

        settings = kafka.settings
        # Committed records only, as Spark's Kafka source reads them (ISOLATION): an archived
        # range reads exactly like the same range read from Kafka. Offsets deleted while we
        # read are an error, never a silent jump to the end (which would archive the range as
        # empty).
        consumer = kafka.range_consumer("archiver", eof=False)
        consumer.assign([TopicPartition(topic, partition, start)])
        idle_since = time.monotonic()
        try:
            while True:
                position = consumer.position([TopicPartition(topic, partition)])[0].offset
                if position >= end:
                    return
                msgs = consumer.consume(num_messages=5000, timeout=1.0)
                if not msgs:
                    if time.monotonic() - idle_since > kafka.request_timeout_s:
                        raise ArchiveError(
                            f"topic {topic!r} partition {partition}: no committed records after "
                            f"offset {max(position, start)} for {kafka.request_timeout_s:.0f} s "
                            f"while archiving up to {end} from "
                            f"{settings.kafka.bootstrap_servers}; rerun the archiver"
                        )
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            continue
                        raise ArchiveError(
                            f"topic {topic!r} partition {partition}: Kafka error while "
                            f"archiving [{start}, {end}): {err.str()}"
                        )
                    offset = msg.offset()
                    if offset is None or offset < start or offset >= end:
                        continue
                    yield msg
        finally:
            consumer.close()

    def _write(
        self, topic: str, run: PartitionRun, start: int, end: int, msgs: list[Message]
    ) -> int:
        """Write one new file for ``[start, end)`` atomically; returns ``end``."""
        table, size = _table(self.log(topic), topic, run.partition, start, end, msgs)
        final = self._put(topic, run.partition, start, end, table)
        self._committed.add(final)
        run.records += len(msgs)
        run.bytes += size
        run.files.append(final)
        return end

    def _put(self, topic: str, partition: int, start: int, end: int, table: pa.Table) -> str:
        """Write ``table`` as the file of ``[start, end)``: under a hidden temporary name, then
        moved to its final name (replacing a file already there, atomically)."""
        directory = self.directory(topic, partition)
        self.fs.create_dir(directory, recursive=True)
        final = f"{directory}/{start:020d}-{end:020d}.parquet"
        tmp = f"{directory}/.tmp-{uuid.uuid4().hex}.parquet"
        with self.fs.open_output_stream(tmp) as out:
            pq.write_table(table, out, compression="zstd")
        self.fs.move(tmp, final)
        return final


def _url_safe(topic_id: str) -> str:
    """A topic id in Kafka's own spelling: URL-safe base64 (``-`` and ``_`` for ``+``, ``/``)."""
    return topic_id.replace("+", "-").replace("/", "_")


def log_bounds(kafka: KafkaClient, topic: str) -> dict[int, tuple[int, int, int]]:
    """Per partition: (log start offset, last stable offset, high watermark), from ListOffsets
    (see :meth:`backfill_assets.stack.kafka.KafkaClient.log_ends`)."""
    return kafka.log_ends(topic)


def _is_committed(meta: dict[str, Any]) -> bool:
    return meta.get("isolation") == ISOLATION


def _table(
    log: TopicIdentity, topic: str, partition: int, start: int, end: int, msgs: list[Message]
) -> tuple[pa.Table, int]:
    """The file contents of ``[start, end)`` of the log ``log`` (schema metadata included) and
    its payload bytes."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    size = 0
    for msg in msgs:
        ts_type, ts = msg.timestamp()
        key, value = msg.key(), msg.value()
        columns["topic"].append(topic)
        columns["partition"].append(partition)
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
        "topic_id": log.topic_id,
        "cluster_id": log.cluster_id,
        "partition": partition,
        "start": start,
        "end": end,
        "records": len(msgs),
        "min_timestamp_ms": min(stamps) if stamps else None,
        "max_timestamp_ms": max(stamps) if stamps else None,
        "isolation": ISOLATION,
    }
    schema = SCHEMA.with_metadata({_META_KEY: json.dumps(meta).encode()})
    return pa.Table.from_pydict(columns, schema=schema), size


def _is_subset(committed: pa.Table, legacy: pa.Table) -> bool:
    """Whether every committed record is in the legacy file, identical (a read of every record
    returned a superset of the committed ones: the legacy file may only hold more)."""
    try:
        legacy = legacy.select(SCHEMA.names).cast(SCHEMA)
    except (KeyError, ValueError, pa.ArrowInvalid):
        return False
    keep = pc.is_in(legacy.column("offset"), value_set=committed.column("offset").combine_chunks())
    kept = legacy.filter(keep).sort_by("offset")
    return bool(kept.equals(committed.cast(SCHEMA).sort_by("offset")))


def _filesystem(settings: Settings) -> tuple[pafs.FileSystem, str]:
    uri = settings.archive_uri.rstrip("/")
    if uri.startswith(("s3://", "s3a://")):
        return catalog.s3_filesystem(settings.catalog), uri.split("://", 1)[1]
    if "://" not in uri:
        raise ArchiveError(
            f"BACKFILL_ARCHIVE_URI={uri!r} is not a URI: use file:///ABS/PATH or s3://BUCKET/PREFIX"
        )
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def _intervals(cov: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{s}, {e})" for s, e in cov) or "nothing"
