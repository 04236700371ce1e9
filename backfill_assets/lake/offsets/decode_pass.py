"""The independent decode of a window's records, read again from Kafka while Spark writes.

The window scan (:func:`backfill_assets.lake.offsets.scan.scan`) fixes each hour's offsets and
counts, hashes and sizes its committed records in one librdkafka pass. The raw table's
``decoded_content`` check also needs every record (or, in a large hour, a sample) decoded by
the Python reference (:class:`backfill_assets.lake.decode.content.RecordDecoder`), about 20 times
the cost of the count. Nothing the run's Spark job does waits for that decode: only the checks
read it. So :class:`DecodePass` reads the same offsets a second time in a thread, started when
the replay hands its first write to Spark (not before: the driver's own Python work, building
branches and plans, would share the interpreter with it), and the decode runs while Spark
reads, parses and writes the window. The checks wait for it
(:meth:`~backfill_assets.lake.offsets.windows.Windows.wait_decode`, which starts it if nothing
did).

The second read must be the records the scan counted: each cell's record count and hash sum
are computed again and compared with the scan's before any decoded figure is kept. A log that
changed in between (retention or the log cleaner removed records) fails the run with the
partition, hour and offsets; nothing is published. Whole or sampled is decided per hour from
the scan's counts before the pass starts (:func:`content_sample`), so the table side can be
summed over the same records whichever finishes first.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from backfill_assets.errors import WindowError
from backfill_assets.lake.decode.content import Sample, in_sample
from backfill_assets.lake.offsets.scan import _archived, _overtaken
from backfill_assets.lake.offsets.windows import Cell, Decode, Windows, _ms
from backfill_assets.stack.kafka import offsets_gone

if TYPE_CHECKING:
    from confluent_kafka import Message

    from backfill_assets.lake.offsets.archive import Archive
    from backfill_assets.stack.kafka import KafkaClient

_BATCH, _POLL_S = 10_000, 0.05


def content_sample(
    windows: Windows, k: int, whole_up_to: int, residue: int, accepted: frozenset[tuple[int, int]]
) -> Sample:
    """Which records the content check compares: every record of an hour holding at most
    ``whole_up_to`` committed records (the scan's count over all partitions), the 1 in ``k``
    of ``residue`` in a larger one, never the ``accepted`` ones."""
    sampled = frozenset(
        _ms(hour)
        for hour, cells in windows.cells.items()
        if sum(c.records for c in cells.values()) > whole_up_to
    )
    if not sampled:
        return Sample(accepted=accepted)
    return Sample(k, residue, sampled, accepted)


@dataclass
class Decoding:
    """The per-record step: count and hash the record again into this pass's own cell, and
    decode it when the sample compares it."""

    decode: Decode
    sample: Sample
    decoded: int = 0

    def add(
        self,
        mine: Cell,
        sampled: bool,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
    ) -> None:
        position = mine.add(offset, key, value, partition)
        sample = self.sample
        if sample.accepted and (partition, offset) in sample.accepted:
            return
        if sampled and not in_sample(partition, offset, sample.k, position, sample.residue):
            return
        mine.add_decoded(*self.decode(partition, offset, key, value))
        self.decoded += 1


@dataclass
class _Walk:
    """One partition's cells in offset order: the scan's, this pass's own, whether sampled."""

    partition: int
    hours: list[datetime]
    theirs: list[Cell]
    mine: list[Cell]
    sampled: list[bool]
    position: int
    end: int
    at: int = 0

    def feed(self, decoding: Decoding, offset: int, key: bytes | None, value: bytes | None) -> bool:
        """Attribute one committed record (in offset order); True once the range is read."""
        if offset >= self.end:
            return True
        while offset >= self.theirs[self.at].end:
            self.at += 1
        at = self.at
        decoding.add(self.mine[at], self.sampled[at], self.partition, offset, key, value)
        self.position = offset + 1
        return self.position >= self.end


@dataclass
class DecodePass:
    """The decode of ``windows``' records in a thread (:meth:`start`); :meth:`join` waits for
    it and raises what it raised. The decoded figures are set on the windows' cells only after
    every cell's second read matched the scan's, all at once."""

    kafka: KafkaClient
    windows: Windows
    decode: Decode
    sample: Sample
    archive: Archive | None = None
    timeout_s: float = 60.0
    seconds: float = 0.0
    _began: float = 0.0
    _error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def attach(self) -> DecodePass:
        """Give the windows their content sample and this pending decode (not started yet:
        :meth:`start`, or :meth:`join` does it)."""
        self.windows.content_sample = self.sample
        self.windows.pending = self
        return self

    def start(self) -> DecodePass:
        """Start reading in a thread, once (the caller goes on to Spark's write)."""
        if self._thread is None:
            self.attach()
            topic = self.windows.topic
            self._thread = threading.Thread(target=self._run, name=f"decode {topic}", daemon=True)
            self._thread.start()
        return self

    def join(self) -> None:
        """Wait for the decode (started now if it was not); raises what it raised."""
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop reading (the run failed before its checks): nothing is set on the windows."""
        self._stop.set()

    def _run(self) -> None:
        self._began = time.monotonic()
        try:
            decoding = Decoding(self.decode, self.sample)
            walks = self._walks()
            self._read_archived(decoding, walks)
            self._read_kafka(decoding, walks)
            if not self._stop.is_set():
                self._settle(decoding, walks)
        except BaseException as exc:  # re-raised by join, in the run's thread
            self._error = exc
        finally:
            self.seconds = time.monotonic() - self._began

    def _walks(self) -> dict[int, _Walk]:
        windows = self.windows
        out: dict[int, _Walk] = {}
        for hour in windows.hours:
            for p, cell in sorted(windows.cells[hour].items()):
                if cell.end <= cell.start:
                    continue
                walk = out.get(p)
                if walk is None:
                    walk = out[p] = _Walk(p, [], [], [], [], cell.start, cell.end)
                walk.hours.append(hour)
                walk.theirs.append(cell)
                walk.mine.append(Cell(cell.start, cell.end))
                walk.sampled.append(_ms(hour) in self.sample.hours)
                walk.end = cell.end
        return out

    def _read_archived(self, decoding: Decoding, walks: dict[int, _Walk]) -> None:
        """Offsets below Kafka's log start (as the scan found it) come from the archive."""
        for p, walk in sorted(walks.items()):
            low = self.windows.kafka_start.get(p, 0)
            if walk.position >= low or self.archive is None:
                continue
            records = _archived(self.archive, self.windows.topic, p, walk.position, low)
            for offset, _ts, key, value in records:
                if walk.feed(decoding, offset, key, value):
                    break
            walk.position = max(walk.position, low)

    def _read_kafka(self, decoding: Decoding, walks: dict[int, _Walk]) -> None:
        from confluent_kafka import TopicPartition

        topic = self.windows.topic
        todo = {p: w for p, w in walks.items() if w.position < w.end}
        if not todo:
            return
        consumer = self.kafka.range_consumer("content-decode")
        try:
            consumer.assign([TopicPartition(topic, p, w.position) for p, w in sorted(todo.items())])
            idle_since = time.monotonic()
            while todo and not self._stop.is_set():
                msgs = consumer.consume(num_messages=_BATCH, timeout=_POLL_S)
                if not msgs:
                    if time.monotonic() - idle_since > self.timeout_s:
                        raise WindowError(
                            f"topic {topic!r}: the independent decode got no records for "
                            f"{self.timeout_s:.0f} s reading partitions {sorted(todo)} again "
                            f"(positions { {p: w.position for p, w in sorted(todo.items())} }); "
                            "nothing was published; retry the run"
                        )
                    continue
                idle_since = time.monotonic()
                done = []
                for msg in msgs:
                    p = msg.partition()
                    walk = todo.get(p) if p is not None else None
                    if walk is not None and self._take(decoding, walk, msg):
                        done.append(walk.partition)
                for p in done:
                    if todo.pop(p, None) is not None:
                        consumer.incremental_unassign([TopicPartition(topic, p)])
        finally:
            consumer.close()

    def _take(self, decoding: Decoding, walk: _Walk, msg: Message) -> bool:
        """Feed one message to its partition's walk; True once that partition is read."""
        from confluent_kafka import KafkaError

        topic = self.windows.topic
        err = msg.error()
        if err is None:
            offset = msg.offset()
            assert offset is not None
            return walk.feed(decoding, offset, msg.key(), msg.value())
        if offsets_gone(err):
            raise _overtaken(self.kafka, topic, walk.partition, walk.position)
        if err.code() != KafkaError._PARTITION_EOF:
            raise WindowError(
                f"topic {topic!r} partition {walk.partition}: Kafka error at offset "
                f"{walk.position} while decoding the window again: {err.str()}"
            )
        return int(msg.offset() or 0) >= walk.end

    def _settle(self, decoding: Decoding, walks: dict[int, _Walk]) -> None:
        """Compare every cell's second read with the scan's, then set the decoded figures."""
        topic = self.windows.topic
        for p, walk in sorted(walks.items()):
            for hour, theirs, mine in zip(walk.hours, walk.theirs, walk.mine, strict=True):
                if (mine.records, mine.hash_sum) != (theirs.records, theirs.hash_sum):
                    raise WindowError(
                        f"topic {topic!r} partition {p} hour {hour.isoformat()}: offsets "
                        f"[{theirs.start}, {theirs.end}) read again for the independent decode "
                        f"hold {mine.records} committed records, the window scan counted "
                        f"{theirs.records} (or their bytes differ): the log changed while the "
                        "run read it (retention or the log cleaner). Nothing was published; "
                        "rerun the partition",
                        {p: (theirs.start, theirs.end)},
                    )
        for walk in walks.values():
            for theirs, mine in zip(walk.theirs, walk.mine, strict=True):
                theirs.decoded_rows = mine.decoded_rows
                theirs.decoded_sum = mine.decoded_sum
                theirs.unverified = mine.unverified
        windows = self.windows
        windows.decoded, windows.decoded_records = True, decoding.decoded
        windows.decode_s = time.monotonic() - self._began
