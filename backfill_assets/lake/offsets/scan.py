"""The independent reading of Kafka that fixes a run's windows and gives the checks their figures.

:func:`scan` finds the boundaries by reading the range once with librdkafka (read_committed,
``assign`` only: no consumer group is joined or committed), and on the way counts, per hour and
partition, the committed records, their bytes and an order-independent hash of every record's
partition, offset, key and value bytes. Those figures come from Kafka, not from Spark's read,
so the checks can compare the table with them. Offsets below Kafka's log start offset are read
from the archive the same way. The independent decode of the same records reads them again,
while Spark writes (:mod:`backfill_assets.lake.offsets.decode_pass`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from backfill_assets.errors import WindowError, WindowNotSealed
from backfill_assets.lake.offsets.windows import (
    HOUR,
    Cell,
    Windows,
    _ms,
    check_chain,
    fixed_bounds,
    hours_between,
)
from backfill_assets.stack.kafka import offsets_gone, through_failover

if TYPE_CHECKING:
    from confluent_kafka import Message

    from backfill_assets.lake.offsets.archive import Archive
    from backfill_assets.stack.kafka import KafkaClient

# librdkafka's consume() returns when it has a full batch or when the timeout ends: with a
# long timeout, every scan shorter than a batch (a small window's) waited for all of it.
_BATCH, _POLL_S = 10_000, 0.05


@dataclass
class _Cursor:
    """The scan's state for one partition."""

    partition: int
    bounds: list[datetime]  # bounds[i] is hour i's start; bounds[-1] the range's end
    fixed: dict[int, int]  # bound index -> offset known from the ledger
    found: dict[int, int] = field(default_factory=dict)
    index: int = -1  # the hour being filled; -1 before the first boundary
    position: int = 0  # next offset to read
    bounds_ms: list[int] = field(default_factory=list)  # bounds as epoch millis
    # cells[i]: hour i's figures in this partition (None until a record of it is fed)
    cells: list[Cell | None] = field(default_factory=list)

    # fixed_after[i]: the first boundary after i the ledger fixes (None: none). While records
    # are fed, no boundary after the next one is found yet, so this is cap(i + 1) then, in O(1)
    # per record instead of a walk over the remaining hours (a 7-day window has 168).
    fixed_after: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bounds_ms = [_ms(b) for b in self.bounds]
        self.cells = [None] * (len(self.bounds) - 1)
        after: list[int | None] = [None] * len(self.bounds)
        for i in range(len(self.bounds) - 2, -1, -1):
            after[i] = self.fixed.get(i + 1, after[i + 1])
        self.fixed_after = after

    def bound(self, i: int) -> int | None:
        return self.fixed.get(i, self.found.get(i))

    def cap(self, i: int) -> int | None:
        """The nearest known boundary after ``i``: boundary ``i`` cannot lie beyond it."""
        for j in range(i + 1, len(self.bounds)):
            known = self.bound(j)
            if known is not None:
                return known
        return None

    @property
    def done(self) -> bool:
        last = len(self.bounds) - 1
        end = self.bound(last)
        if end is None or self.position < end:  # the per-record answer, in O(1)
            return False
        return all(self.bound(i) is not None for i in range(last + 1))

    def feed(
        self,
        offset: int,
        ts_ms: int,
        key: bytes | None,
        value: bytes | None,
    ) -> bool:
        """Attribute one committed record (in offset order) and find the boundaries it makes.
        True when the range's end is known and reached: only then can :attr:`done` be."""
        self.position = offset + 1
        last = len(self.bounds) - 1
        fixed, found = self.fixed, self.found
        # Move past every boundary this record is at or beyond.
        while self.index < last:
            nxt = self.index + 1
            known = fixed.get(nxt)
            if known is None:
                known = found.get(nxt)
            if known is not None:
                if offset < known:
                    break
            elif ts_ms >= self.bounds_ms[nxt]:
                found[nxt] = offset
            else:
                # No record reached the bound before a later boundary the ledger fixes:
                # the boundary is that one (the hour between is empty in this partition).
                cap = self.fixed_after[nxt]
                if cap is None or offset < cap:
                    break
                found[nxt] = cap
            self.index = nxt
        if 0 <= self.index < last:
            cells = self.cells
            cell = cells[self.index]
            if cell is None:
                start = self.bound(self.index)
                assert start is not None
                cell = cells[self.index] = Cell(start, start)
            cell.add(offset, key, value, self.partition)
        end = fixed.get(last)
        if end is None:
            end = found.get(last)
        return end is not None and self.position >= end


def scan(
    kafka: KafkaClient,
    topic: str,
    start: datetime,
    end: datetime,
    *,
    published: Mapping[datetime, Mapping[int, tuple[int, int]]] | None = None,
    archive: Archive | None = None,
    seal_grace: timedelta = timedelta(minutes=5),
    now: datetime | None = None,
    timeout_s: float = 60.0,
) -> Windows:
    """The windows of hours ``[start, end)`` of ``topic`` and Kafka's figures for each.

    ``published`` holds the offsets of already published hours of the topic (the ledger):
    the hours inside the range and its two neighbours fix boundaries. Reads every committed
    record of the range once (plus, for a first window, from the broker's ListOffsets hint to
    the first boundary). Raises :class:`WindowNotSealed` or :class:`WindowError` naming the
    partition, hour and offsets, and never returns a guess.
    """
    now = now or datetime.now(UTC)
    if end > now:
        raise WindowNotSealed(
            f"topic {topic!r}: hour {(end - HOUR).isoformat()} has not ended yet (now "
            f"{now.isoformat(timespec='seconds')}); backfill only hours that have ended"
        )
    published = published or {}
    bounds = [*hours_between(start, end), end]
    ends = kafka.log_ends(topic)
    parts = sorted(ends)
    cursors = {p: _Cursor(p, bounds, fixed_bounds(p, bounds, published)) for p in parts}
    _start_positions(kafka, topic, start, end, bounds[0], cursors, ends, archive)
    _read_archived(topic, cursors, ends, archive)
    _seal_idle(
        topic, cursors, _read_to_end(kafka, topic, cursors, ends, timeout_s), now, seal_grace
    )
    out = _assemble(bounds, cursors)
    check_chain(topic, out, published)
    return Windows(topic, start, end, out, {p: ends[p][0] for p in parts if ends[p][0] > 0})


def _start_positions(
    kafka: KafkaClient,
    topic: str,
    start: datetime,
    end: datetime,
    first: datetime,
    cursors: dict[int, _Cursor],
    ends: dict[int, tuple[int, int, int]],
    archive: Archive | None,
) -> None:
    """Set where each partition's reading starts: the fixed first boundary, or the broker's
    hint for ``first`` (or the archive's, below Kafka's log start). Raises :class:`WindowError`
    before anything is read if some offsets the window may include are in neither."""
    parts = sorted(cursors)
    asked = [p for p in parts if 0 not in cursors[p].fixed]
    hints = _hints(kafka, topic, asked, first, ends)
    # The broker answered the hints from the log as it stands now: a log start that moved
    # since ``ends`` were read (retention, delete_records) must count, or the hint (the new
    # log start) would pass for the hour's first record.
    for p, (low, _ts) in kafka.list_offsets(topic, asked, "earliest").items():
        if low > ends[p][0]:
            ends[p] = (low, *ends[p][1:])
    missing: dict[int, tuple[int, int]] = {}
    for p in parts:
        low, lso, _hw = ends[p]
        cur = cursors[p]
        if 0 in cur.fixed:
            cur.position, cur.index = cur.fixed[0], 0
        else:
            hint = hints.get(p, -1)
            cur.position = hint if hint >= 0 else lso
            if low > 0 and cur.position <= low and archive is not None:
                # Kafka no longer holds what precedes its log start: apply the same rule to
                # the archive (committed records only, by the archiver's contract).
                found = archive.first_offset_at(topic, p, _ms(first), below=low)
                if found is not None:
                    cur.position = found
        hole = _unknown(cur.position, low, archive.coverage(topic, p) if archive else [])
        if hole is not None:
            missing[p] = hole
    if missing:
        gaps = "; ".join(
            f"partition {p} offsets [{s}, {e}) (Kafka log start {ends[p][0]})"
            for p, (s, e) in sorted(missing.items())
        )
        where = archive.uri if archive is not None else "(no archive configured)"
        raise WindowError(
            f"topic {topic!r} window {start.isoformat()}..{end.isoformat()}: {gaps} are "
            f"neither in Kafka nor in the archive at {where}, and the window may include them. "
            "Nothing was written or published. If they were archived elsewhere, point "
            "BACKFILL_ARCHIVE_URI there; otherwise they are gone: "
            f"`backfill-assets plan --topic {topic} --start ... --end ...` shows what is "
            "complete.",
            missing,
        )


def _read_archived(
    topic: str,
    cursors: dict[int, _Cursor],
    ends: dict[int, tuple[int, int, int]],
    archive: Archive | None,
) -> None:
    """Feed the archived part of each partition (offsets below Kafka's log start), in offset
    order; Kafka's part is read after it."""
    for p in sorted(cursors):
        low = ends[p][0]
        cur = cursors[p]
        if cur.position < low and archive is not None:
            for offset, ts_ms, key, value in _archived(archive, topic, p, cur.position, low):
                if cur.feed(offset, ts_ms, key, value) and cur.done:
                    break
            if not cur.done:
                cur.position = max(cur.position, low)


def _read_to_end(
    kafka: KafkaClient,
    topic: str,
    cursors: dict[int, _Cursor],
    ends: dict[int, tuple[int, int, int]],
    timeout_s: float,
    passes: int = 3,
) -> dict[int, tuple[int, int, int]]:
    """Read Kafka until every partition with a missing boundary has reached the log's end as
    it stands after the read; the log ends last seen. The ends seen at the start may be short
    of it: records arrived meanwhile, or a broker failed over and its partitions' new leader
    had not caught up yet. After ``passes`` reads :func:`_seal_idle` refuses what is left."""
    for _ in range(passes):
        _read_kafka(kafka, topic, cursors, ends, timeout_s)
        final = kafka.log_ends(topic)
        behind = [p for p, cur in cursors.items() if not cur.done and cur.position < final[p][1]]
        if not behind:
            break
        ends = final
    return final


def _seal_idle(
    topic: str,
    cursors: dict[int, _Cursor],
    final: dict[int, tuple[int, int, int]],
    now: datetime,
    seal_grace: timedelta,
) -> None:
    """Set the boundaries of partitions that reached the LSO without a record for them (the
    LSO, for an idle partition past the grace), or raise :class:`WindowNotSealed`."""
    for p in sorted(cursors):
        cur = cursors[p]
        bounds = cur.bounds
        grace_ok = [now - b >= seal_grace for b in bounds]
        last = len(bounds) - 1
        for i in range(last + 1):
            if cur.bound(i) is not None:
                continue
            _low, lso, hw = final[p]
            _check_idle(topic, p, cur, i, lso, hw, grace_ok[i], seal_grace)
            cap = cur.cap(i)
            cur.found[i] = lso if cap is None else min(lso, cap)


def _check_idle(
    topic: str,
    p: int,
    cur: _Cursor,
    i: int,
    lso: int,
    hw: int,
    grace_ok: bool,
    seal_grace: timedelta,
) -> None:
    """Raise :class:`WindowNotSealed` unless partition ``p``'s missing boundary ``i`` may be
    its LSO: read up to it, no open transaction, and the grace after the hour has passed."""
    bounds = cur.bounds
    if cur.position < lso:
        raise WindowNotSealed(
            f"topic {topic!r} partition {p}: new records arrived while reading; retry the run"
        )
    if lso < hw:
        raise WindowNotSealed(
            f"topic {topic!r} partition {p}: hour {bounds[max(i - 1, 0)].isoformat()} is "
            f"not sealed: no committed record at or after {bounds[i].isoformat()} yet, "
            f"and a transaction is open (last stable offset {lso} < high watermark "
            f"{hw}). The run wrote nothing; retry after the transaction ends."
        )
    if not grace_ok:
        raise WindowNotSealed(
            f"topic {topic!r} partition {p}: hour {bounds[max(i - 1, 0)].isoformat()} is "
            f"not sealed: no committed record at or after {bounds[i].isoformat()} yet "
            f"(partition ends at offset {lso}); it seals when one arrives, or "
            f"{int(seal_grace.total_seconds())} s after the hour ends if the partition "
            "stays idle (BACKFILL_SEAL_GRACE_S). The run wrote nothing; retry later."
        )


def _assemble(
    bounds: list[datetime], cursors: dict[int, _Cursor]
) -> dict[datetime, dict[int, Cell]]:
    """Per hour and partition, the cell with its final offset range (empty cells included)."""
    out: dict[datetime, dict[int, Cell]] = {}
    for i, hour in enumerate(bounds[:-1]):
        row: dict[int, Cell] = {}
        for p in sorted(cursors):
            s, e = cursors[p].bound(i), cursors[p].bound(i + 1)
            assert s is not None and e is not None
            cell = cursors[p].cells[i] or Cell(s, e)
            cell.start, cell.end = s, max(s, e)
            row[p] = cell
        out[hour] = row
    return out


def _read_kafka(
    kafka: KafkaClient,
    topic: str,
    cursors: dict[int, _Cursor],
    ends: dict[int, tuple[int, int, int]],
    timeout_s: float,
) -> None:
    from confluent_kafka import TopicPartition

    todo = {p for p, c in cursors.items() if not c.done and c.position < ends[p][1]}
    if not todo:
        return
    consumer = kafka.range_consumer("window-scan")
    try:
        consumer.assign([TopicPartition(topic, p, cursors[p].position) for p in sorted(todo)])
        idle_since = time.monotonic()
        while todo:
            msgs = consumer.consume(num_messages=_BATCH, timeout=_POLL_S)
            if not msgs:
                if time.monotonic() - idle_since > timeout_s:
                    raise WindowError(
                        f"topic {topic!r}: no answer from "
                        f"{kafka.settings.kafka.bootstrap_servers} for {timeout_s:.0f} s while "
                        f"reading partitions {sorted(todo)} (positions "
                        f"{ {p: cursors[p].position for p in sorted(todo)} }); retry the run"
                    )
                continue
            idle_since = time.monotonic()
            finished = set()
            for msg in msgs:
                p = msg.partition()
                assert p is not None
                if p not in todo:
                    continue
                cur = cursors[p]
                if msg.error() is not None:
                    if _at_end(kafka, topic, cur, msg, ends[p][1]):
                        finished.add(p)
                    continue
                offset = msg.offset()
                assert offset is not None
                ts_ms = msg.timestamp()[1]
                if cur.feed(offset, ts_ms, msg.key(), msg.value()) and cur.done:
                    finished.add(p)
            for p in finished:
                todo.discard(p)
                consumer.incremental_unassign([TopicPartition(topic, p)])
    finally:
        consumer.close()


def _at_end(kafka: KafkaClient, topic: str, cur: _Cursor, msg: Message, lso: int) -> bool:
    """Whether the error message ``msg`` says partition ``cur`` reached the LSO seen at the
    start; raises :class:`WindowError` for any other error."""
    from confluent_kafka import KafkaError

    err = msg.error()
    assert err is not None
    if offsets_gone(err):
        raise _overtaken(kafka, topic, cur.partition, cur.position)
    if err.code() != KafkaError._PARTITION_EOF:
        raise WindowError(
            f"topic {topic!r} partition {cur.partition}: Kafka error at offset "
            f"{cur.position}: {err.str()}"
        )
    cur.position = max(cur.position, int(msg.offset() or 0))
    # Short of the LSO seen at the start, the end is a new leader's that has not caught up
    # yet (a broker failed over): keep reading.
    return cur.position >= lso


def _overtaken(kafka: KafkaClient, topic: str, partition: int, position: int) -> WindowError:
    """The error for a read whose next offset Kafka deleted while the scan ran (retention or
    ``delete_records``): nothing was sealed past it."""
    low = kafka.log_ends(topic)[partition][0]
    return WindowError(
        f"topic {topic!r} partition {partition}: offsets [{position}, {low}) were deleted "
        f"from Kafka while this run read them (the log now starts at {low}); nothing was "
        "written or published. Rerun: the run then reads them from the archive "
        "(BACKFILL_ARCHIVE_URI) if it holds them, or names the hours they leave unknown.",
        {partition: (position, low)},
    )


def _hints(
    kafka: KafkaClient,
    topic: str,
    parts: list[int],
    at: datetime,
    ends: Mapping[int, tuple[int, int, int]],
) -> dict[int, int]:
    """The broker's ListOffsets answer for ``at`` (read_committed): a lower bound of the first
    committed record at or after it (-1 where none is below the LSO).

    Kafka's -1 is checked. The broker searches only the first segment whose largest timestamp
    reaches ``at``, and a segment the log cleaner emptied counts its file's modification time
    as its largest timestamp: a compacted partition then answers -1 for every earlier time
    while later segments hold records at or after it. Where -1 contradicts the partition's
    record with the largest timestamp (at or after ``at``, between the log start and the LSO),
    the hint is the log start, and reading from there finds the boundary."""
    if not parts:
        return {}
    from confluent_kafka import TopicPartition

    def ask() -> dict[int, int]:
        consumer = kafka.offsets_consumer()
        try:
            found = consumer.offsets_for_times(
                [TopicPartition(topic, p, _ms(at)) for p in parts], timeout=kafka.request_timeout_s
            )
            return {tp.partition: int(tp.offset) for tp in found}
        finally:
            consumer.close()

    hints = through_failover(f"ListOffsets by time of topic {topic!r}", ask)
    doubtful = [p for p, offset in hints.items() if offset < 0 and ends[p][0] < ends[p][1]]
    for p, (offset, ts_ms) in kafka.newest_records(topic, doubtful).items():
        if ts_ms >= _ms(at) and ends[p][0] <= offset < ends[p][1]:
            hints[p] = ends[p][0]
    return hints


def _unknown(position: int, low: int, covered: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The offsets below Kafka's log start ``low`` that a window read from ``position`` may
    include but neither Kafka nor the archive (``covered`` ranges) holds, or None.

    Reading from ``position`` needs every offset of ``[position, low)`` and the record just
    below ``position``: if that one is unknown, so is its timestamp, and the window may begin
    inside the unknown offsets.
    """
    if low == 0 or position > low:
        return None
    at = max(position - 1, 0)
    for s, e in sorted(r for r in covered if r[1] > r[0]):
        if s <= at < e:
            at = e
    if at >= low:
        return None
    start = max((e for _s, e in covered if e <= at), default=0)
    end = min([s for s, _e in covered if s > at] + [low])
    return (start, end)


def _archived(
    archive: Archive, topic: str, partition: int, start: int, end: int
) -> Iterator[tuple[int, int, bytes | None, bytes | None]]:
    table = archive.read_records(topic, partition, start, end)
    offsets = table.column("offset").to_pylist()
    stamps = table.column("timestamp").cast("int64").to_pylist()
    keys = table.column("key").to_pylist()
    values = table.column("value").to_pylist()
    yield from zip(offsets, stamps, keys, values, strict=True)
