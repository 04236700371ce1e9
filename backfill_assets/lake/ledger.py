"""The ledger: what each table has published, per hour, kept where table maintenance cannot
erase it (snapshots expire; these rows do not).

One Iceberg table, ``backfill_ledger``, appended with pyiceberg (one atomic commit per append,
retried when another writer committed first). A ``publish`` row per published hour records the
run, the snapshot main moved to (and its sequence number, the table's commit order) and, for raw
tables, the hour's offsets per partition and the event-time hours of its rows with their counts
(``event_hours``, what the late-data sensor reads instead of the rows). A ``rollback`` row lists
the runs a rollback undid. What a table covers now is, per hour, the newest publish whose run was
not undone.

A ledger created by an older version lacks the newer (nullable) columns: the first append adds
them in place (a schema update, no data file rewritten), and its old rows read them as null.

The data commit is the source of truth at the moment of publishing: its snapshot summary
carries the same windows (``backfill.windows``). :func:`sync_from_history` copies any publish
still in main's history that has no ledger rows (a run killed between its fast-forward and its
ledger append); every publish calls it, and so does maintenance before expiring snapshots.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.table import Table

LEDGER_TABLE = "backfill_ledger"
SUMMARY_PREFIX = "backfill."
_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        pa.field("event", pa.string(), nullable=False),
        pa.field("table_name", pa.string(), nullable=False),
        pa.field("run_id", pa.string()),
        pa.field("hour", _TS),
        pa.field("offsets", pa.string()),
        pa.field("records", pa.int64()),
        pa.field("snapshot_id", pa.int64()),
        pa.field("sequence_number", pa.int64()),
        pa.field("undone_runs", pa.string()),
        pa.field("recorded_at", _TS, nullable=False),
        # raw tables: JSON {event-time hour (ISO, UTC): rows}; null where unknown
        pa.field("event_hours", pa.string()),
    ]
)


@dataclass(frozen=True)
class Entry:
    """One published hour of one table."""

    hour: datetime
    run_id: str
    snapshot_id: int
    sequence_number: int
    recorded_at: datetime
    offsets: dict[int, tuple[int, int]] | None
    # Raw tables: the event-time hours of the hour's rows (tombstones and quarantined records
    # excluded) with their counts; {} when it has none; None when unknown (rows appended before
    # the ledger kept it, publishes recovered by sync_from_history).
    event_hours: dict[datetime, int] | None = None

    @property
    def committed_ms(self) -> int:
        return int(self.recorded_at.timestamp() * 1000)


def _ident(namespace: str) -> str:
    return f"{namespace}.{LEDGER_TABLE}"


def _evolved(table: Table) -> Table:
    """``table`` with every column of :data:`SCHEMA`: a ledger created by an older version gets
    the columns it lacks (all nullable) by one schema update, in place. Data files are not
    rewritten, nothing is lost; its old rows read the new columns as null."""
    have = {f.name for f in table.schema().fields}
    if all(name in have for name in SCHEMA.names):
        return table
    with table.update_schema() as update:
        update.union_by_name(SCHEMA)
    return table


def _append(
    catalog: Catalog, namespace: str, rows: list[dict[str, Any]], attempts: int = 8
) -> None:
    if not rows:
        return
    catalog.create_namespace_if_not_exists(namespace)
    table = catalog.create_table_if_not_exists(_ident(namespace), schema=SCHEMA)
    data = pa.Table.from_pylist(rows, schema=SCHEMA)
    for attempt in range(attempts):
        try:
            # Inside the retry: another writer may have evolved the schema first (our update
            # then fails its commit and the reloaded table already has the columns).
            table = _evolved(table)
            table.append(data)
            return
        except CommitFailedException:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
            table = catalog.load_table(_ident(namespace))


def generation(catalog: Catalog, namespace: str) -> str:
    """An identifier of the ledger's current state ("none" before its first row).

    Every publish and every rollback of any table appends to the ledger, a new Iceberg commit
    with a new snapshot id, so the value changes with each of them and never returns to an
    earlier one, unlike main's snapshot of a table, which a rollback restores."""
    try:
        table = catalog.load_table(_ident(namespace))
    except NoSuchTableError:
        return "none"
    snap = table.metadata.current_snapshot_id
    return str(snap) if snap is not None else "none"


def record_publish(
    catalog: Catalog,
    namespace: str,
    table_name: str,
    *,
    run_id: str,
    snapshot_id: int,
    sequence_number: int,
    hours: Iterable[datetime],
    offsets: Mapping[datetime, Mapping[int, tuple[int, int]]] | None = None,
    records: Mapping[datetime, int] | None = None,
    event_hours: Mapping[datetime, Mapping[datetime, int]] | None = None,
    recorded_at: datetime | None = None,
) -> None:
    """One ``publish`` row per hour, in one commit.

    ``event_hours`` (raw tables): per published hour, the event-time hours of its rows with
    their counts; an hour it does not name has no such rows. None: not known (the late-data
    sensor then reads the publish's rows)."""
    now = recorded_at or datetime.now(UTC)
    rows = []
    for hour in sorted(hours):
        off = (offsets or {}).get(hour)
        late = None if event_hours is None else _event_hours_json(event_hours.get(hour, {}))
        rows.append(
            {
                "event": "publish",
                "table_name": table_name,
                "run_id": run_id,
                "hour": hour,
                "offsets": None
                if off is None
                else json.dumps({str(p): [s, e] for p, (s, e) in sorted(off.items())}),
                "records": (records or {}).get(hour),
                "snapshot_id": snapshot_id,
                "sequence_number": sequence_number,
                "undone_runs": None,
                "recorded_at": now,
                "event_hours": late,
            }
        )
    _append(catalog, namespace, rows)


def _event_hours_json(counts: Mapping[datetime, int]) -> str:
    return json.dumps({h.astimezone(UTC).isoformat(): int(n) for h, n in sorted(counts.items())})


def _event_hours(value: str | None) -> dict[datetime, int] | None:
    if value is None:
        return None
    return {datetime.fromisoformat(h).astimezone(UTC): int(n) for h, n in json.loads(value).items()}


def record_rollback(
    catalog: Catalog, namespace: str, table_name: str, *, runs: list[str], snapshot_id: int
) -> None:
    """The runs a rollback undid on ``table_name``: their hours are no longer covered."""
    _append(
        catalog,
        namespace,
        [
            {
                "event": "rollback",
                "table_name": table_name,
                "run_id": None,
                "hour": None,
                "offsets": None,
                "records": None,
                "snapshot_id": snapshot_id,
                "sequence_number": None,
                "undone_runs": json.dumps(sorted(runs)),
                "recorded_at": datetime.now(UTC),
                "event_hours": None,
            }
        ],
    )


def _rows(catalog: Catalog, namespace: str, table_name: str) -> list[dict[str, Any]]:
    try:
        table = catalog.load_table(_ident(namespace))
    except NoSuchTableError:
        return []
    if "'" in table_name:
        raise ValueError(f"table name must not contain a quote: {table_name!r}")
    rows: list[dict[str, Any]] = (
        table.scan(row_filter=f"table_name == '{table_name}'").to_arrow().to_pylist()
    )
    return rows


def undone_runs(rows: list[dict[str, Any]]) -> set[str]:
    out: set[str] = set()
    for row in rows:
        if row["event"] == "rollback" and row["undone_runs"]:
            out.update(json.loads(row["undone_runs"]))
    return out


def publishes(catalog: Catalog, namespace: str, table_name: str) -> list[Entry]:
    """Every publish of ``table_name`` not undone by a rollback, oldest commit first."""
    rows = _rows(catalog, namespace, table_name)
    undone = undone_runs(rows)
    out = []
    for row in rows:
        if row["event"] != "publish" or row["run_id"] in undone or row["hour"] is None:
            continue
        offsets = None
        if row["offsets"]:
            offsets = {
                int(p): (int(v[0]), int(v[1])) for p, v in json.loads(row["offsets"]).items()
            }
        out.append(
            Entry(
                hour=row["hour"].astimezone(UTC),
                run_id=row["run_id"],
                snapshot_id=int(row["snapshot_id"]),
                sequence_number=int(row["sequence_number"]),
                recorded_at=row["recorded_at"].astimezone(UTC),
                offsets=offsets,
                # absent from a ledger not yet evolved (no append since the column was added)
                event_hours=_event_hours(row.get("event_hours")),
            )
        )
    return sorted(out, key=lambda e: (e.sequence_number, e.recorded_at))


def coverage(catalog: Catalog, namespace: str, table_name: str) -> dict[datetime, Entry]:
    """Hour -> the newest live publish that covers it."""
    out: dict[datetime, Entry] = {}
    for entry in publishes(catalog, namespace, table_name):
        out[entry.hour] = entry
    return out


def published_offsets(
    catalog: Catalog, namespace: str, table_name: str
) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Hour -> partition -> (start, end) of every covered hour of a raw table."""
    return {
        hour: dict(e.offsets)
        for hour, e in coverage(catalog, namespace, table_name).items()
        if e.offsets is not None
    }


def sync_from_history(catalog: Catalog, namespace: str, table_name: str) -> list[str]:
    """Add ledger rows for publishes in main's history that have none; return their run ids.

    ``table_name`` is ``catalog.namespace.table`` (Spark's name) or ``namespace.table``.
    """
    from backfill_assets.lake.windows import hours_between, parse_bounds

    ident = table_name.split(".", 1)[1] if table_name.count(".") >= 2 else table_name
    try:
        table = catalog.load_table(ident)
    except NoSuchTableError:
        return []
    known = {r["snapshot_id"] for r in _rows(catalog, namespace, table_name)}
    undone = undone_runs(_rows(catalog, namespace, table_name))
    added = []
    snap = table.metadata.current_snapshot()
    while snap is not None:
        props: Any = snap.summary if snap.summary is not None else {}
        run_id = props.get(SUMMARY_PREFIX + "run-id")
        if (
            props.get(SUMMARY_PREFIX + "published") == "true"
            and snap.snapshot_id not in known
            and run_id is not None
            and run_id not in undone
        ):
            window = props.get(SUMMARY_PREFIX + "window", "")
            start_s, _, end_s = window.partition("/")
            offsets = None
            if props.get(SUMMARY_PREFIX + "windows"):
                offsets = parse_bounds(props[SUMMARY_PREFIX + "windows"])
            if start_s and end_s:
                record_publish(
                    catalog,
                    namespace,
                    table_name,
                    run_id=run_id,
                    snapshot_id=snap.snapshot_id,
                    sequence_number=int(snap.sequence_number or 0),
                    hours=hours_between(
                        datetime.fromisoformat(start_s), datetime.fromisoformat(end_s)
                    ),
                    offsets=offsets,
                    recorded_at=datetime.fromtimestamp(snap.timestamp_ms / 1000, UTC),
                )
                added.append(run_id)
        parent = snap.parent_snapshot_id
        snap = table.metadata.snapshot_by_id(parent) if parent is not None else None
    return added
