"""Offset-owned Kafka-time windows: the rule that maps hours to offsets, and the windows' data.

Hour H of a topic is, per partition, a fixed offset range ``[start, end)``. The rule:

* **Chained.** H starts exactly where H-1 ended: when H-1 is published, its end offsets (from
  the ledger) are H's start; when H+1 is published, its start offsets are H's end. A partition
  missing from a published H-1 did not exist when H-1 was sealed: it starts at offset 0 in H.
* **Boundaries.** Where no published neighbour fixes it, the boundary for time T is the offset
  of the first *committed* record at or after the previous boundary whose Kafka timestamp is
  >= T (Kafka's ListOffsets-by-timestamp rule, applied to committed data records only: the
  broker's own answer is used as a starting hint, since it may point at a transaction marker,
  which carries the broker's wall-clock time; its "none" is checked against the partition's
  newest timestamp, since a segment the log cleaner emptied makes it say "none" wrongly).
* **Sealed.** A boundary exists only when such a record is below the last stable offset (LSO).
  A partition without one is *idle* if no transaction is open (LSO == high watermark) and T
  ended at least ``seal_grace_s`` ago: the boundary is then the LSO. Otherwise the hour is not
  sealed and :class:`WindowNotSealed` says which partition holds it back; nothing is guessed.
* **Timestamps are data.** A record belongs to the window whose offset range holds it, whatever
  its own timestamp (producers' clocks differ; CreateTime is not monotonic in a partition).

The reader that applies the rule to Kafka (and the archive) is
:mod:`backfill_assets.lake.offsets.scan`.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any, Protocol

import xxhash

from backfill_assets.errors import WindowError
from backfill_assets.lake.decode.content import Sample, partition_seed, position_hash
from backfill_assets.lake.decode.envelope import WIRE_HEADER

HOUR = timedelta(hours=1)


class PendingDecode(Protocol):
    """A decode of the windows' records still running (lake.offsets.decode_pass)."""

    def start(self) -> Any: ...

    def join(self) -> None: ...

    def cancel(self) -> None: ...


_INT = struct.Struct("<i")
_PACK_LONG = struct.Struct("<q").pack
_XXH64 = xxhash.xxh64_intdigest
# An independent decode of one record (partition, offset, key, value) -> (kind, detail): see
# :class:`backfill_assets.lake.decode.content.RecordDecoder`.
Decode = Callable[[int, int, "bytes | None", "bytes | None"], tuple[str, Any]]


def record_hash(partition: int, offset: int, key: bytes | None, value: bytes | None) -> int:
    """A 64-bit hash of one record as Kafka holds it; sums of it are order-independent.

    It is Spark's ``xxhash64(partition int, offset bigint, key, value, key IS NULL, value IS
    NULL)`` (:func:`backfill_assets.lake.write.read.record_hash_expr`): XXH64 chained from seed
    42,
    each input hashed with the previous hash as seed (ints as 4 and longs as 8 little-endian
    bytes, booleans as the int 0/1, binary as its bytes, a NULL skipped), as a signed long.
    """
    return _record_hash(position_hash(partition, offset), key, value)


def _record_hash(position: int, key: bytes | None, value: bytes | None) -> int:
    """:func:`record_hash` from the record's position hash (content.position_hash)."""
    h = position
    if key is not None:
        h = _XXH64(key, h)
    if value is not None:
        h = _XXH64(value, h)
    h = _XXH64(_BOOL[value is None], _XXH64(_BOOL[key is None], h))
    return h - _TWO_64 if h >= _TWO_63 else h


_BOOL = {False: _INT.pack(0), True: _INT.pack(1)}
_TWO_63, _TWO_64 = 1 << 63, 1 << 64


@dataclass
class Cell:
    """One hour of one partition: its offsets and what Kafka holds there (committed only)."""

    start: int
    end: int
    records: int = 0
    size: int = 0
    hash_sum: int = 0
    first_offset: int | None = None
    last_offset: int | None = None
    # With the independent decode (lake.offsets.decode_pass): the rows it expects, the sum of
    # their content hashes, and the records of a version it has no reference for.
    decoded_rows: int = 0
    decoded_sum: int = 0
    unverified: int = 0
    # The schema ids of its values in Confluent's wire format (0x00 + a 4-byte big-endian id):
    # the writer schemas an avro topic's parse needs, known without another read of Kafka.
    schema_ids: set[int] = field(default_factory=set)

    def add(self, offset: int, key: bytes | None, value: bytes | None, partition: int) -> int:
        """Count one record; its position hash (content.position_hash), which the decode's
        sample reuses. The scan's per-record path: :func:`_record_hash` is inlined here."""
        self.records += 1
        position = h = _XXH64(_PACK_LONG(offset), partition_seed(partition))
        if key is not None:
            self.size += len(key)
            h = _XXH64(key, h)
        if value is not None:
            self.size += len(value)
            h = _XXH64(value, h)
        h = _XXH64(_BOOL[value is None], _XXH64(_BOOL[key is None], h))
        self.hash_sum += h - _TWO_64 if h >= _TWO_63 else h
        if value and value[0] == 0 and len(value) >= WIRE_HEADER:
            self.schema_ids.add(int.from_bytes(value[1:WIRE_HEADER], "big"))
        if self.first_offset is None:
            self.first_offset = offset
        self.last_offset = offset
        return position

    def add_decoded(self, kind: str, detail: Any) -> None:
        if kind == "row":
            self.decoded_rows += 1
            self.decoded_sum += detail
        elif kind == "unverified":
            self.unverified += 1


@dataclass
class Windows:
    """The offset windows of consecutive hours ``[start, end)`` of one topic, with Kafka's
    figures for each (hour, partition)."""

    topic: str
    start: datetime
    end: datetime
    cells: dict[datetime, dict[int, Cell]]
    # Per partition, Kafka's log start offset: offsets below it were read from the archive.
    kafka_start: dict[int, int] = field(default_factory=dict)
    # Whether the records were also decoded (lake.offsets.decode_pass): the cells' decoded
    # figures. Read them after wait_decode (hour_figures waits).
    decoded: bool = False
    decode_s: float = 0.0  # seconds the decode's pass took (its second read and the decode)
    decode_wait_s: float = 0.0  # seconds the run waited for it after its writes
    # The records the decode's figures cover (every record of an hour it decoded whole, the
    # sample of the others), and how many records it decoded.
    content_sample: Sample = field(default_factory=Sample)
    decoded_records: int = 0
    # The decode still running in its thread (None: none, or it finished and was joined).
    pending: PendingDecode | None = None

    def wait_decode(self) -> None:
        """Wait for the decode's pass, if one runs; raises what it raised (the decoded
        figures are then not set)."""
        pending = self.pending
        if pending is None:
            return
        began = time.monotonic()
        try:
            pending.join()
        finally:
            self.decode_wait_s += time.monotonic() - began
        self.pending = None

    def start_decode(self) -> None:
        """Start the decode's pass, if one is attached and not started: when the caller is
        about to wait on Spark (its thread then has the driver's interpreter to itself)."""
        if self.pending is not None:
            self.pending.start()

    def cancel_decode(self) -> None:
        """Stop the decode's pass (the run failed before its checks)."""
        if self.pending is not None:
            self.pending.cancel()

    @property
    def hours(self) -> list[datetime]:
        return sorted(self.cells)

    @property
    def ranges(self) -> dict[int, tuple[int, int]]:
        """Per partition, the whole range's offsets (the hours are contiguous)."""
        out: dict[int, tuple[int, int]] = {}
        for hour in self.hours:
            for p, c in self.cells[hour].items():
                s, e = out.get(p, (c.start, c.end))
                out[p] = (min(s, c.start), max(e, c.end))
        return out

    @property
    def records(self) -> int:
        return sum(c.records for cells in self.cells.values() for c in cells.values())

    @property
    def offsets(self) -> int:
        return sum(e - s for s, e in self.ranges.values())

    @property
    def size(self) -> int:
        """Bytes of the committed records' keys and values."""
        return sum(c.size for cells in self.cells.values() for c in cells.values())

    @property
    def schema_ids(self) -> list[int]:
        """Every schema id the windows' values carry in Confluent's wire format."""
        ids = {i for row in self.cells.values() for cell in row.values() for i in cell.schema_ids}
        return sorted(ids)

    def hour_figures(self) -> dict[str, dict[str, int]]:
        """Per hour (ISO, UTC): committed records, bytes and hash sum over all partitions; with
        a decode also the rows it expects (``decoded_rows``), their content hash sum
        (``decoded_sum``) and the records it could not verify (``unverified``), after waiting
        for it."""
        self.wait_decode()
        out = {}
        for hour in self.hours:
            cells = self.cells[hour].values()
            figures = out[hour.isoformat()] = {
                "records": sum(c.records for c in cells),
                "bytes": sum(c.size for c in cells),
                "hash_sum": sum(c.hash_sum for c in cells),
            }
            if self.decoded:
                figures["decoded_rows"] = sum(c.decoded_rows for c in cells)
                figures["decoded_sum"] = sum(c.decoded_sum for c in cells)
                figures["unverified"] = sum(c.unverified for c in cells)
        return out

    def bounds_json(self) -> str:
        """The chain, compactly: per partition the boundary offsets of consecutive hours."""
        hours = self.hours
        bounds: dict[str, list[int]] = {}
        for p in sorted({p for cells in self.cells.values() for p in cells}):
            seq: list[int] = []
            for hour in hours:
                cell = self.cells[hour].get(p)
                if cell is None:
                    continue
                if not seq:
                    seq.append(cell.start)
                seq.append(cell.end)
            bounds[str(p)] = seq
        first = hours[0].isoformat() if hours else self.start.isoformat()
        return json.dumps({"first": first, "hours": len(hours), "bounds": bounds}, sort_keys=True)

    def hour_offsets(self, hour: datetime) -> dict[int, tuple[int, int]]:
        return {p: (c.start, c.end) for p, c in self.cells[hour].items()}


def parse_bounds(text: str) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Inverse of :meth:`Windows.bounds_json`: hour -> partition -> (start, end)."""
    doc = json.loads(text)
    first = datetime.fromisoformat(doc["first"])
    out: dict[datetime, dict[int, tuple[int, int]]] = {}
    for p_text, seq in doc["bounds"].items():
        # A partition that joined later has a shorter chain that ends with the others.
        offset = doc["hours"] - (len(seq) - 1)
        for i in range(len(seq) - 1):
            hour = first + (offset + i) * HOUR
            out.setdefault(hour, {})[int(p_text)] = (int(seq[i]), int(seq[i + 1]))
    return out


def hour_key(epoch_ms: int) -> str:
    """An hour collected from Spark as epoch millis (never as a datetime, which PySpark would
    convert with the machine's local zone), as an ISO string in UTC."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat()


def hour_of_ms(epoch_ms: int) -> datetime:
    """The UTC hour that holds the epoch-millisecond timestamp ``epoch_ms`` (a Kafka
    record's)."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).replace(minute=0, second=0, microsecond=0)


def hours_between(start: datetime, end: datetime) -> list[datetime]:
    out, hour = [], start
    while hour < end:
        out.append(hour)
        hour += HOUR
    return out


def fixed_bounds(
    p: int, bounds: list[datetime], published: Mapping[datetime, Mapping[int, tuple[int, int]]]
) -> dict[int, int]:
    """Partition ``p``'s boundaries the ledger fixes (bound index -> offset)."""
    fixed: dict[int, int] = {}
    for i, t in enumerate(bounds):
        here = published.get(t)
        before = published.get(t - HOUR)
        if here is not None and p in here:
            fixed[i] = here[p][0]
        elif before is not None and p in before:
            fixed[i] = before[p][1]
        elif here is not None or before is not None:
            # Absent from a published hour: the partition did not exist when that hour
            # was sealed, so all its records come after it (its chain starts at 0).
            fixed[i] = 0
    return fixed


def check_chain(
    topic: str,
    cells: Mapping[datetime, Mapping[int, Cell]],
    published: Mapping[datetime, Mapping[int, tuple[int, int]]],
) -> None:
    """Every hour starts where the previous ended, and agrees with published neighbours."""
    hours = sorted(cells)
    for prev, hour in pairwise(hours):
        for p, cell in cells[hour].items():
            if p in cells[prev] and cells[prev][p].end != cell.start:
                raise WindowError(
                    f"topic {topic!r} partition {p}: hour {hour.isoformat()} starts at "
                    f"{cell.start} but {prev.isoformat()} ends at {cells[prev][p].end}"
                )
    for hour in hours:
        mine = {p: (c.start, c.end) for p, c in cells[hour].items()}
        theirs = published.get(hour)
        if theirs is not None and any(mine.get(p, v) != v for p, v in theirs.items()):
            raise WindowError(
                f"topic {topic!r}: hour {hour.isoformat()} maps to offsets {mine}, but its "
                f"published window is {dict(theirs)}; the chain of published windows is broken "
                "(see `backfill-assets audit`)"
            )


def neighbour_mismatches(
    mine: Mapping[datetime, Mapping[int, tuple[int, int]]],
    published: Mapping[datetime, Mapping[int, tuple[int, int]]],
) -> list[str]:
    """Where windows ``mine`` (hour -> partition -> offsets) no longer chain on the windows
    ``published`` now: an hour of ``mine`` that another run published with other offsets, or
    whose published neighbour (the hour before or after the range) ends or starts elsewhere.
    A partition absent from a published neighbour did not exist when it was sealed: its chain
    starts at 0 after it, and holds nothing before it. Empty when everything chains."""
    out = []
    for hour, cells in sorted(mine.items()):
        theirs = published.get(hour)
        if theirs is not None and any(cells.get(p, v) != v for p, v in theirs.items()):
            out.append(f"hour {hour.isoformat()} is published as {dict(theirs)}, not {dict(cells)}")
        before, after = published.get(hour - HOUR), published.get(hour + HOUR)
        for p, (start, end) in sorted(cells.items()):
            if hour - HOUR not in mine and before is not None:
                chained = before[p][1] if p in before else 0
                if start != chained:
                    out.append(
                        f"partition {p}: hour {hour.isoformat()} starts at offset {start}, but "
                        f"the published hour before it ends at {chained}"
                    )
            if hour + HOUR not in mine and after is not None:
                chained = after[p][0] if p in after else 0
                if end != chained:
                    out.append(
                        f"partition {p}: hour {hour.isoformat()} ends at offset {end}, but the "
                        f"published hour after it starts at {chained}"
                    )
    return out


def _ms(moment: datetime) -> int:
    if moment.tzinfo is None:
        raise ValueError(f"{moment!r} has no time zone; pass aware UTC datetimes")
    return int(moment.timestamp() * 1000)


def as_spark_rows(windows: Windows) -> Iterable[tuple[int, int, int, int]]:
    """(partition, start, end, hour as epoch millis) for every non-empty cell, for the join
    that gives each row its window hour."""
    for hour, cells in windows.cells.items():
        for p, c in cells.items():
            if c.end > c.start:
                yield p, c.start, c.end, _ms(hour)
