"""The hostile ground truth as columns: what hostile.py computes from Python objects, from a
Parquet file of the records (pyarrow + numpy), for histories of millions of records.

hostile.py's rules, unchanged: an hour's records are its offset window (``hostile.windows``), an
event's winner and an order's current row follow the version rule (``versions.newest``), the
hourly figures group the winners by event hour and currency. ``compare`` judges a table against
its truth by key: PASS, or FAIL naming missing, extra, duplicated and differing keys.
backfill_assets_tests/test_columnar_truth.py checks every function against hostile.py's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from backfill_assets.demo.generator import HOUR_MS
from backfill_assets_tests.support import hostile

Ints = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
PAYLOAD_FIELDS = (
    "event_id",
    "order_id",
    "customer_id",
    "event_type",
    "status",
    "amount_minor",
    "currency",
    "event_time",
)
_LIGHT = ("partition", "offset", "timestamp_ms", "event_id", "committed")
_BATCH = 65_536


def write(records: Iterable[hostile.HostileRecord], path: Path) -> int:
    """The records as a Parquet file (one row per record, hostile.HostileRecord's fields),
    written a batch at a time; returns the rows written."""
    names = [f.name for f in dataclasses.fields(hostile.HostileRecord)]
    writer, rows = None, 0
    batch: list[hostile.HostileRecord] = []

    def flush() -> None:
        nonlocal writer
        table = pa.table({n: [getattr(r, n) for r in batch] for n in names})
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table.cast(writer.schema))
        batch.clear()

    for record in records:
        batch.append(record)
        rows += 1
        if len(batch) == _BATCH:
            flush()
    if batch or writer is None:
        flush()
    assert writer is not None
    writer.close()
    return rows


@dataclasses.dataclass
class Truth:
    """The records' light columns (no key, no value), one row per record in file order, with
    ``hash`` (hostile.record_hash) and ``tombstone_key`` (the key of a committed tombstone)."""

    path: Path
    table: pa.Table

    def column(self, name: str) -> Any:
        return self.table.column(name).to_numpy(zero_copy_only=False)

    def keys(self) -> Ints:
        """One int64 per row: partition << 40 | offset."""
        return position_keys(self.column("partition"), self.column("offset"))


def position_keys(partitions: Any, offsets: Any) -> Ints:
    """(partition, offset) as one sortable int64 (offsets stay below 2**40)."""
    return (np.asarray(partitions, np.int64) << 40) | np.asarray(offsets, np.int64)


def keys_of(positions: Iterable[tuple[int, int]]) -> Ints:
    """``position_keys`` of (partition, offset) pairs."""
    pairs = np.array(sorted(positions), np.int64).reshape(-1, 2)
    return position_keys(pairs[:, 0], pairs[:, 1])


def read(path: Path) -> Truth:
    """The truth of ``path`` (written by ``write``) a batch at a time: key and value are read
    only to hash them and to keep a committed tombstone's key."""
    parts = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH):
        columns = {n: batch.column(n) for n in _LIGHT}
        keys, values = batch.column("key").to_pylist(), batch.column("value").to_pylist()
        p, o = columns["partition"].to_pylist(), columns["offset"].to_pylist()
        columns["hash"] = pa.array(
            [hostile.record_hash(*row) for row in zip(p, o, keys, values, strict=True)],
            pa.int64(),
        )
        columns["tombstone_key"] = pa.array(
            [
                k.decode("utf-8") if v is None and k is not None and c else None
                for k, v, c in zip(keys, values, columns["committed"].to_pylist(), strict=True)
            ],
            pa.string(),
        )
        columns["has_value"] = pc.is_valid(batch.column("value"))
        parts.append(pa.table(columns))
    return Truth(path, pa.concat_tables(parts).combine_chunks())


# --------------------------------------------------------------------------------------------
# Offset windows: the hour of every committed record
# --------------------------------------------------------------------------------------------


def _boundary(offsets: Ints, stamps: Ints, after: int, t_ms: int) -> int:
    """hostile._boundary on arrays: searched in growing chunks from ``after``."""
    j = int(np.searchsorted(offsets, after, "left"))
    chunk = 4_096
    while j < len(offsets):
        hits = np.flatnonzero(stamps[j : j + chunk] >= t_ms)
        if len(hits):
            return int(offsets[j + hits[0]])
        j, chunk = j + chunk, chunk * 2
    return max(after, int(offsets[-1]) + 1 if len(offsets) else 0)


def hours_of(truth: Truth, first_ms: int, hours: int) -> Ints:
    """Per row, the start (epoch ms) of the hour whose offset window holds it under
    ``hostile.windows`` over ``hours`` consecutive hours from ``first_ms`` (no partition joins
    later, no chain continued); -1 for aborted records and those outside every window."""
    partition, offset = truth.column("partition"), truth.column("offset").astype(np.int64)
    stamps, committed = truth.column("timestamp_ms").astype(np.int64), truth.column("committed")
    out = np.full(len(offset), -1, np.int64)
    for p in np.unique(partition[committed]):
        rows = np.flatnonzero(committed & (partition == p))
        rows = rows[np.argsort(offset[rows], kind="stable")]
        o, s = offset[rows], stamps[rows]
        b = _boundary(o, s, 0, first_ms)
        for i in range(hours):
            e = _boundary(o, s, b, first_ms + (i + 1) * HOUR_MS)
            lo, hi = np.searchsorted(o, b, "left"), np.searchsorted(o, e, "left")
            out[rows[lo:hi]] = first_ms + i * HOUR_MS
            b = e
    return out


# --------------------------------------------------------------------------------------------
# The version rule
# --------------------------------------------------------------------------------------------


def _last_of_runs(*sorted_keys: npt.NDArray[Any]) -> Mask:
    """True on the last row of every run of equal keys (arrays already sorted by them)."""
    n = len(sorted_keys[0])
    last = np.zeros(n, bool)
    if n:
        last[-1] = True
        for k in sorted_keys:
            last[:-1] |= k[1:] != k[:-1]
    return last


def newest(ids: Ints, stamps: Ints, partitions: Ints, offsets: Ints, first: Ints | None) -> Ints:
    """Per id (a dense int code), the index of the version ``versions.newest`` picks: the
    largest ``first`` (when given), then per partition the latest offset, then across
    partitions the latest Kafka timestamp, then the higher partition."""
    rows = np.arange(len(ids))
    if first is not None:
        order = np.lexsort((first, ids))
        top = np.full(int(ids.max()) + 1 if len(ids) else 0, np.iinfo(np.int64).min)
        top[ids[order][_last_of_runs(ids[order])]] = first[order][_last_of_runs(ids[order])]
        rows = rows[first == top[ids]]
    order = rows[np.lexsort((offsets[rows], partitions[rows], ids[rows]))]
    picks = order[_last_of_runs(ids[order], partitions[order])]
    order = picks[np.lexsort((partitions[picks], stamps[picks], ids[picks]))]
    return order[_last_of_runs(ids[order])]


def _codes(values: pa.Array | pa.ChunkedArray) -> Ints:
    encoded = pc.dictionary_encode(values)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    return np.asarray(encoded.indices.to_numpy(zero_copy_only=False), np.int64)


def _payloads(path: Path, rows: Ints, total: int) -> pa.Table:
    """PAYLOAD_FIELDS of the JSON values of ``rows`` (file rows), ``event_time`` as epoch ms,
    read and kept as columns a batch at a time."""
    wanted = np.zeros(total, bool)
    wanted[rows] = True
    types = {"amount_minor": pa.int64(), "event_time": pa.int64()}
    parts, start = [], 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH, columns=["value"]):
        take = np.flatnonzero(wanted[start : start + batch.num_rows])
        start += batch.num_rows
        out: dict[str, list[Any]] = {f: [] for f in PAYLOAD_FIELDS}
        for value in batch.column("value").take(pa.array(take)).to_pylist():
            payload = json.loads(value)
            for f in PAYLOAD_FIELDS:
                out[f].append(payload[f])
        out["amount_minor"] = [int(a) for a in out["amount_minor"]]
        out["event_time"] = [int(t) for t in out["event_time"]]
        parts.append(pa.table({f: pa.array(v, types.get(f, pa.string())) for f, v in out.items()}))
    return pa.concat_tables(parts).combine_chunks()


@dataclasses.dataclass
class Expected:
    """The truth's published records (committed, in a window, not bad) and what they make."""

    hour: Ints  # per truth row, hours_of's answer
    published: Mask
    winners: pa.Table  # per event: its record's row, partition, offset, timestamp + payload


def expected(truth: Truth, first_ms: int, hours: int, bad: Iterable[tuple[int, int]]) -> Expected:
    """Everything the tables are compared with, for the hours ``first_ms`` + 0..hours-1."""
    hour = hours_of(truth, first_ms, hours)
    published = (hour >= 0) & ~np.isin(truth.keys(), keys_of(bad))
    has_event = (
        published
        & truth.column("has_value")
        & pc.is_valid(truth.table.column("event_id")).to_numpy(zero_copy_only=False)
    )
    rows = np.flatnonzero(has_event)
    ids = _codes(truth.table.column("event_id").take(pa.array(rows)))
    picked = np.sort(rows[newest(ids, *_positions(truth, rows), None)])
    winners = _payloads(truth.path, picked, truth.table.num_rows)
    for name in ("partition", "offset", "timestamp_ms"):
        winners = winners.append_column(name, pa.array(truth.column(name)[picked], pa.int64()))
    return Expected(hour, published, winners)


def _positions(truth: Truth, rows: Ints) -> tuple[Ints, Ints, Ints]:
    return (
        truth.column("timestamp_ms")[rows].astype(np.int64),
        truth.column("partition")[rows].astype(np.int64),
        truth.column("offset")[rows].astype(np.int64),
    )


# --------------------------------------------------------------------------------------------
# The tables' truths
# --------------------------------------------------------------------------------------------


def raw(truth: Truth, exp: Expected) -> pa.Table:
    """(kafka_partition, kafka_offset) -> kafka_hour (ms), kafka_timestamp (ms), record_hash."""
    rows = np.flatnonzero(exp.published)
    return pa.table(
        {
            "kafka_partition": pa.array(truth.column("partition")[rows], pa.int64()),
            "kafka_offset": pa.array(truth.column("offset")[rows], pa.int64()),
            "kafka_hour": pa.array(exp.hour[rows], pa.int64()),
            "kafka_timestamp": pa.array(truth.column("timestamp_ms")[rows], pa.int64()),
            "record_hash": pa.array(truth.column("hash")[rows], pa.int64()),
        }
    )


def current(truth: Truth, exp: Expected) -> pa.Table:
    """order_id -> deleted, kafka_partition, kafka_offset (hostile.expected_current)."""
    w = exp.winners
    tomb = np.flatnonzero(exp.published & pc.is_valid(truth.table.column("tombstone_key")))
    order_ids = pa.concat_arrays(
        [
            w.column("order_id").combine_chunks(),
            truth.table.column("tombstone_key").take(pa.array(tomb)).combine_chunks(),
        ]
    )
    stamps, partitions, offsets = _positions(truth, tomb)

    def cat(name: str, extra: Ints) -> Ints:
        return np.concatenate([w.column(name).to_numpy().astype(np.int64), extra])

    first = cat("event_time", stamps)
    ranked = (cat("timestamp_ms", stamps), cat("partition", partitions), cat("offset", offsets))
    picks = newest(_codes(order_ids), *ranked, first)
    return pa.table(
        {
            "order_id": order_ids.take(pa.array(picks)),
            "deleted": pa.array(picks >= len(w)),
            "kafka_partition": pa.array(ranked[1][picks], pa.int64()),
            "kafka_offset": pa.array(ranked[2][picks], pa.int64()),
        }
    )


def hourly(exp: Expected, first_ms: int, end_ms: int) -> pa.Table:
    """(event_hour ms, currency) -> events, orders, amount_minor, cancelled over the winners
    (hostile.expected_hourly), hours in [first_ms, end_ms)."""
    w = exp.winners
    t = w.column("event_time").to_numpy()
    w = w.append_column("event_hour", pa.array(t - t % HOUR_MS, pa.int64()))
    w = w.append_column(
        "is_cancelled", pc.cast(pc.equal(w.column("event_type"), "cancelled"), pa.int64())
    )
    grouped = w.group_by(["event_hour", "currency"]).aggregate(
        [
            ("event_id", "count"),
            ("order_id", "count_distinct"),
            ("amount_minor", "sum"),
            ("is_cancelled", "sum"),
        ]
    )
    hours = grouped.column("event_hour")
    inside = pc.and_(pc.greater_equal(hours, first_ms), pc.less(hours, end_ms))
    names = {
        "event_hour": "event_hour",
        "currency": "currency",
        "event_id_count": "events",
        "order_id_count_distinct": "orders",
        "amount_minor_sum": "amount_minor",
        "is_cancelled_sum": "cancelled",
    }
    picked = grouped.filter(inside).select(list(names))
    return _int64(picked.rename_columns(list(names.values())))


def large_paid(exp: Expected, first_ms: int, end_ms: int, least: int = 50_000) -> pa.Table:
    """The winners paid with amount_minor >= ``least`` (spec/tables: 50,000) and event time in
    [first_ms, end_ms)."""
    w = exp.winners
    t = w.column("event_time")
    keep = pc.and_(
        pc.and_(pc.equal(w.column("status"), "paid"), pc.greater_equal(w["amount_minor"], least)),
        pc.and_(pc.greater_equal(t, first_ms), pc.less(t, end_ms)),
    )
    cols = ["event_id", "order_id", "customer_id", "amount_minor", "currency", "event_time"]
    return w.filter(keep).select(cols)


def _int64(table: pa.Table) -> pa.Table:
    """Every integer column as int64 (Iceberg int, long and Arrow's count as one type), large
    strings as strings."""
    fields = []
    for f in table.schema:
        if pa.types.is_integer(f.type):
            fields.append(pa.field(f.name, pa.int64()))
        elif pa.types.is_large_string(f.type):
            fields.append(pa.field(f.name, pa.string()))
        else:
            fields.append(f)
    return table.cast(pa.schema(fields))


def epoch_ms(table: pa.Table) -> pa.Table:
    """Timestamp columns as int64 epoch millis (Iceberg ``timestamp`` holds UTC), integers as
    int64: a table read from Iceberg, ready for ``compare``."""
    for i, f in enumerate(table.schema):
        if pa.types.is_timestamp(f.type):
            ms = pc.cast(pc.cast(table.column(i), pa.timestamp("ms"), safe=False), pa.int64())
            table = table.set_column(i, f.name, ms)
    return _int64(table)


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def _duplicates(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    counts = table.group_by(list(keys)).aggregate([([], "count_all")])
    return counts.filter(pc.greater(counts.column("count_all"), 1)).select(list(keys))


def _examples(table: pa.Table, keys: Sequence[str], mask: Any) -> tuple[int, list[Any]]:
    picked = table.filter(mask).select(list(keys))
    first = picked.sort_by([(k, "ascending") for k in keys]).slice(0, 3).to_pylist()
    return picked.num_rows, [tuple(r.values()) if len(r) > 1 else r[keys[0]] for r in first]


def compare(got: pa.Table, want: pa.Table, keys: Sequence[str]) -> str:
    """``PASS (n rows)`` when ``got`` holds exactly ``want``'s rows (every column of ``want``,
    matched by ``keys``, each key once); else ``FAIL`` with the count and the first three keys
    of the missing, extra, duplicated and differing rows."""
    keys = list(keys)
    values = [c for c in want.column_names if c not in keys]
    got = got.select(keys + values)
    got = got.append_column("__got", pa.array(np.ones(got.num_rows, bool)))
    want = want.append_column("__want", pa.array(np.ones(want.num_rows, bool)))
    joined = got.join(want, keys, join_type="full outer", left_suffix="_g", right_suffix="_w")
    present = pc.and_(pc.is_valid(joined["__got"]), pc.is_valid(joined["__want"]))
    differ = pa.array(np.zeros(joined.num_rows, bool))
    for c in values:
        g, w = joined[f"{c}_g"], joined[f"{c}_w"]
        same = pc.or_kleene(pc.equal(g, w), pc.and_(pc.is_null(g), pc.is_null(w)))
        differ = pc.or_(differ, pc.invert(pc.fill_null(same, False)))
    dups = _duplicates(got, keys)
    problems = {
        "missing": _examples(joined, keys, pc.is_null(joined["__got"])),
        "extra": _examples(joined, keys, pc.is_null(joined["__want"])),
        "duplicated": _examples(dups, keys, pa.array(np.ones(dups.num_rows, bool))),
        "differ": _examples(joined, keys, pc.and_(present, differ)),
    }
    if not any(n for n, _ in problems.values()):
        return f"PASS ({want.num_rows:,} rows)"
    return "FAIL: " + ", ".join(f"{k} {n:,} {ex}" for k, (n, ex) in problems.items() if n)
