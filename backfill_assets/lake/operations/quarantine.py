"""Working off a topic's quarantine: what it holds by reason and hour, and what a re-run of
those hours moved from quarantine into the table (and that nothing else changed).

Reads main of the raw and quarantine tables through pyiceberg (no Spark); writes nothing. A
re-run itself is an ordinary backfill of the hours (branch, checks, publish): quarantine rows
are published with their rows, so a refused re-run leaves both as they were.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError

from backfill_assets.lake.coverage.detect import contiguous
from backfill_assets.spec.model import TopicSpec

HOUR = timedelta(hours=1)
Record = tuple[int, int]  # (partition, offset)


@dataclass
class Group:
    """The quarantined records of one reason in one Kafka hour."""

    hour: datetime
    reason: str
    records: int = 0
    first_offsets: dict[int, int] = field(default_factory=dict)  # partition -> lowest offset

    def to_json(self) -> dict[str, Any]:
        return {
            "hour": self.hour.isoformat(),
            "reason": self.reason,
            "records": self.records,
            "first_offsets": {str(p): o for p, o in sorted(self.first_offsets.items())},
        }


def _scan(
    catalog: Catalog,
    table: str,
    columns: tuple[str, ...],
    start: datetime | None,
    end: datetime | None,
) -> pa.Table | None:
    """Main's rows of ``namespace.table`` in Kafka hours ``[start, end)`` (None: the table
    does not exist)."""
    try:
        loaded = catalog.load_table(table)
    except NoSuchTableError:
        return None
    # The hours' bounds prune the tables' kafka_hour partitions (epoch microseconds).
    bounds = []
    if start is not None:
        bounds.append(f"kafka_hour >= {int(start.timestamp() * 1_000_000)}")
    if end is not None:
        bounds.append(f"kafka_hour < {int(end.timestamp() * 1_000_000)}")
    if not bounds:
        return loaded.scan(selected_fields=columns).to_arrow()
    return loaded.scan(row_filter=" AND ".join(bounds), selected_fields=columns).to_arrow()


def groups(
    catalog: Catalog,
    namespace: str,
    spec: TopicSpec,
    start: datetime | None = None,
    end: datetime | None = None,
    reason: str | None = None,
) -> list[Group]:
    """The quarantine's records by (hour, reason), oldest hour first; ``reason`` keeps the
    reasons that start with it (``record_too_large`` matches ``record_too_large:<bytes>``)."""
    cols = ("kafka_hour", "reason", "kafka_partition", "kafka_offset")
    rows = _scan(catalog, f"{namespace}.{spec.quarantine_table}", cols, start, end)
    out: dict[tuple[datetime, str], Group] = {}
    for row in rows.to_pylist() if rows is not None else []:
        why = str(row["reason"])
        if reason is not None and not why.startswith(reason):
            continue
        hour = _utc(row["kafka_hour"])
        group = out.setdefault((hour, why), Group(hour, why))
        group.records += 1
        p, o = int(row["kafka_partition"]), int(row["kafka_offset"])
        group.first_offsets[p] = min(o, group.first_offsets.get(p, o))
    return [out[k] for k in sorted(out)]


def hour_runs(hours: Iterable[datetime]) -> list[tuple[datetime, datetime]]:
    """Consecutive hours as ``[start, end)`` ranges, oldest first."""
    return [(a, b + HOUR) for a, b in contiguous(sorted(set(hours)), max_len=1 << 30)]


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@dataclass(frozen=True)
class HoursState:
    """Main's quarantined records (with reason) and rows of some hours of a topic."""

    quarantined: dict[Record, str]
    rows: pa.Table  # every raw column but the run id, sorted by partition and offset


def hours_state(
    catalog: Catalog, namespace: str, spec: TopicSpec, hours: Iterable[datetime]
) -> HoursState:
    """What main holds now for ``hours`` (read before and after a re-run to compare)."""
    quarantined: dict[Record, str] = {}
    tables = []
    for start, end in hour_runs(hours):
        q = _scan(
            catalog,
            f"{namespace}.{spec.quarantine_table}",
            ("kafka_partition", "kafka_offset", "reason"),
            start,
            end,
        )
        for row in q.to_pylist() if q is not None else []:
            quarantined[(int(row["kafka_partition"]), int(row["kafka_offset"]))] = row["reason"]
        raw = _raw_rows(catalog, f"{namespace}.{spec.raw_table}", start, end)
        if raw is not None:
            tables.append(raw)
    rows = pa.concat_tables(tables) if tables else pa.table({})
    if rows.num_columns:
        rows = rows.sort_by([("kafka_partition", "ascending"), ("kafka_offset", "ascending")])
    return HoursState(quarantined, rows)


def _raw_rows(catalog: Catalog, table: str, start: datetime, end: datetime) -> pa.Table | None:
    try:
        names = [f.name for f in catalog.load_table(table).schema().fields]
    except NoSuchTableError:
        return None
    return _scan(catalog, table, tuple(n for n in names if n != "ingest_run_id"), start, end)


def moved(before: HoursState, after: HoursState) -> dict[str, Any]:
    """What a re-run changed: the records that left quarantine and are rows now, those still
    quarantined (by reason), records that newly went to quarantine, and whether every other
    row is exactly as it was."""
    left = sorted(set(before.quarantined) - set(after.quarantined))
    now_rows = _keys(after.rows)
    new_quarantine = sorted(set(after.quarantined) - set(before.quarantined))
    others_before = _without(before.rows, set(left))
    others_after = _without(after.rows, set(left) | set(new_quarantine))
    unchanged = others_after.equals(_without(others_before, set(new_quarantine)))
    still: dict[str, int] = {}
    for reason in after.quarantined.values():
        still[reason] = still.get(reason, 0) + 1
    return {
        "moved_to_table": [f"{p}:{o}" for p, o in left if (p, o) in now_rows],
        "left_quarantine_without_a_row": [f"{p}:{o}" for p, o in left if (p, o) not in now_rows],
        "newly_quarantined": [f"{p}:{o}" for p, o in new_quarantine],
        "still_quarantined": still,
        "other_rows_unchanged": bool(unchanged),
        "other_rows": others_after.num_rows,
    }


def _keys(rows: pa.Table) -> set[Record]:
    if not rows.num_columns:
        return set()
    parts, offsets = rows.column("kafka_partition"), rows.column("kafka_offset")
    return set(zip(parts.to_pylist(), offsets.to_pylist(), strict=True))


def _without(rows: pa.Table, records: set[Record]) -> pa.Table:
    """``rows`` but those of ``records``."""
    if not rows.num_columns or not records:
        return rows
    keys = pc.binary_join_element_wise(
        pc.cast(rows.column("kafka_partition"), pa.string()),
        pc.cast(rows.column("kafka_offset"), pa.string()),
        ":",
    )
    drop = pa.array([f"{p}:{o}" for p, o in records])
    return rows.filter(pc.invert(pc.is_in(keys, value_set=drop)))
