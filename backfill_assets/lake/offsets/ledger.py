"""The ledger: what each table has published, per hour, kept where table maintenance cannot
erase it (snapshots expire; these rows do not).

One Iceberg table, ``backfill_ledger``, appended with pyiceberg (one atomic commit per append,
retried when another writer committed first). A ``publish`` row per published hour records the
run, the snapshot main moved to (and its sequence number, the table's commit order) and, for raw
tables, the hour's offsets per partition and the event-time hours of its rows with their counts
(``event_hours``, what the late-data sensor reads instead of the rows) and the event-time hours
of the other versions of its rows' event ids (``superseded_hours``: a correction touches the
hour of the version it supersedes as well as its own); for derived tables, which publish of
each input it read (``reads``: the input's main snapshot and its sequence number), so freshness
is judged by lineage, never by clocks. A ``rollback`` row lists the runs a rollback undid.
What a table covers now is, per hour, the newest publish whose run was not undone.

Raw publishes also record which log they read: the topic id and the cluster id
(:class:`~backfill_assets.stack.kafka.TopicIdentity`). The ledger's current log is the one the
newest ``adopt`` row names (``backfill-assets adopt``), else the one its publishes name; its
offsets are the only ones windows and gap detection chain on (:func:`current_log`). Rows
without an identity (written before it was kept) count as the current log until an ``adopt``.

A ledger created by an older version lacks the newer (nullable) columns: the first append adds
them in place (a schema update, no data file rewritten), and its old rows read them as null.

The data commit is the source of truth at the moment of publishing: its snapshot summary
carries the same windows (``backfill.windows``). :func:`sync_from_history` copies any publish
still in main's history that has no ledger rows (a run killed between its fast-forward and its
ledger append); every publish calls it, and so does maintenance before expiring snapshots.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.table import Table

from backfill_assets.stack.catalog import retry_commit
from backfill_assets.stack.kafka import TopicIdentity

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
        # rollback, invalidate and rollback_committed/_aborted rows: the rollback they belong to
        pa.field("rollback_id", pa.string()),
        # invalidate rows: the table whose rollback made this table's hour stale
        pa.field("source_table", pa.string()),
        # raw tables: JSON [event-time hour (ISO, UTC)] of other versions of its event ids
        pa.field("superseded_hours", pa.string()),
        # derived tables: JSON {input table: {"snapshot_id": n, "sequence_number": n}}
        pa.field("reads", pa.string()),
        # raw publish, adopt and accept rows: the topic's log (Kafka topic id and cluster id)
        pa.field("topic_id", pa.string()),
        pa.field("cluster_id", pa.string()),
        # accept rows: why an operator accepted the record (``offsets`` names it)
        pa.field("reason", pa.string()),
    ]
)
# The table property a rollback sets in the same catalog commit that moves main back: the
# commit point of the rollback (see :func:`committed_rollbacks`).
ROLLBACK_PROPERTY = SUMMARY_PREFIX + "rollback."


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
    # Raw tables: the event-time hours of the other versions (in other Kafka hours) of the
    # hour's event ids; None when unknown.
    superseded_hours: frozenset[datetime] | None = None
    # Derived tables: input table (``catalog.namespace.table``) -> the sequence number of the
    # input's main snapshot the run read; None when unknown (rows written before it was kept).
    reads: dict[str, int] | None = None
    # Raw tables: the log the hour was read from; None when unknown (rows written before it
    # was kept, publishes recovered from a summary without it).
    topic_id: str | None = None
    cluster_id: str | None = None
    # Raw tables: the committed records Kafka held in the hour's window when it was published
    # (librdkafka's count); None when unknown.
    records: int | None = None

    @property
    def committed_ms(self) -> int:
        return int(self.recorded_at.timestamp() * 1000)

    @property
    def touched_hours(self) -> set[datetime] | None:
        """Every event-time hour whose content this hour's rows can change: their own and
        those of the versions they supersede (or that supersede them); None when unknown."""
        if self.event_hours is None:
            return None
        return set(self.event_hours) | set(self.superseded_hours or ())


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

    def commit(attempt: int) -> None:
        fresh = table if attempt == 0 else catalog.load_table(_ident(namespace))
        # Inside the retry: another writer may have evolved the schema first (our update then
        # fails its commit and the reloaded table already has the columns).
        _evolved(fresh).append(data)

    retry_commit(commit, attempts=attempts, backoff_s=0.2)


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
    superseded_hours: Mapping[datetime, Iterable[datetime]] | None = None,
    reads: Mapping[str, tuple[int, int]] | None = None,
    recorded_at: datetime | None = None,
    identity: TopicIdentity | None = None,
) -> None:
    """One ``publish`` row per hour, in one commit.

    ``event_hours`` (raw tables): per published hour, the event-time hours of its rows with
    their counts; an hour it does not name has no such rows. None: not known (the late-data
    sensor then reads the publish's rows). ``superseded_hours`` (raw tables): per published
    hour, the event-time hours of the other versions of its rows' event ids. ``reads``
    (derived tables): input table -> (snapshot id, sequence number) of the input's main the
    run read."""
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
                "superseded_hours": None
                if superseded_hours is None
                else _hours_json(superseded_hours.get(hour, ())),
                "reads": None if reads is None else reads_json(reads),
                "topic_id": identity.topic_id if identity else None,
                "cluster_id": identity.cluster_id if identity else None,
            }
        )
    _append(catalog, namespace, rows)


def record_adopt(
    catalog: Catalog, namespace: str, table_name: str, identity: TopicIdentity, *, by: str
) -> None:
    """An ``adopt`` row: from now on ``table_name`` (a raw table) reads the log ``identity``
    names; publishes of other logs keep covering their hours but fix no window any more."""
    _append(
        catalog,
        namespace,
        [
            _row(
                "adopt",
                table_name,
                datetime.now(UTC),
                run_id=by,
                topic_id=identity.topic_id,
                cluster_id=identity.cluster_id,
            )
        ],
    )


def record_accept(
    catalog: Catalog,
    namespace: str,
    table_name: str,
    identity: TopicIdentity,
    record: tuple[int, int],
    *,
    reason: str,
    by: str,
) -> None:
    """An ``accept`` row: the record at (partition, offset) ``record`` of the log ``identity``
    is left out of the ``decoded_content`` comparison of ``table_name`` (a raw table) from now
    on, because the reference decode and the replay read it differently and an operator
    judged the replay's row right (``reason`` says why)."""
    partition, offset = record
    _append(
        catalog,
        namespace,
        [
            _row(
                "accept",
                table_name,
                datetime.now(UTC),
                run_id=by,
                offsets=json.dumps({str(partition): [offset, offset + 1]}),
                topic_id=identity.topic_id,
                cluster_id=identity.cluster_id,
                reason=reason,
            )
        ],
    )


def accepted(
    catalog: Catalog, namespace: str, table_name: str, identity: TopicIdentity
) -> frozenset[tuple[int, int]]:
    """The (partition, offset) of every record of the log ``identity`` an ``accept`` row
    names for ``table_name``."""
    out = set()
    for row in _rows(catalog, namespace, table_name):
        if row["event"] != "accept" or row.get("topic_id") != identity.topic_id:
            continue
        for p, (start, _end) in json.loads(row["offsets"]).items():
            out.add((int(p), int(start)))
    return frozenset(out)


@dataclass(frozen=True)
class Log:
    """The log a raw table's ledger reads now: ``identity`` None when it knows none (no row
    recorded one); ``adopted`` when an ``adopt`` row named it (rows without an identity are
    then of an older log)."""

    identity: TopicIdentity | None
    adopted: bool = False

    def holds(self, entry: Entry) -> bool:
        """Whether ``entry`` was read from this log."""
        if entry.topic_id is None:
            return not self.adopted
        return self.identity == TopicIdentity(entry.topic_id, entry.cluster_id or "")


def log_of(rows: list[dict[str, Any]]) -> Log:
    """The current log (:class:`Log`) among a table's ledger ``rows``: the newest ``adopt``
    row's, else the newest publish's that recorded one."""
    adopts = [r for r in rows if r["event"] == "adopt" and r.get("topic_id")]
    if adopts:
        newest = max(adopts, key=lambda r: r["recorded_at"])
        return Log(TopicIdentity(newest["topic_id"], newest.get("cluster_id") or ""), True)
    known = [r for r in rows if r["event"] == "publish" and r.get("topic_id")]
    if not known:
        return Log(None)
    newest = max(known, key=lambda r: (r["sequence_number"] or 0, r["recorded_at"]))
    return Log(TopicIdentity(newest["topic_id"], newest.get("cluster_id") or ""))


def current_log(catalog: Catalog, namespace: str, table_name: str) -> Log:
    """The log ``table_name``'s ledger reads now (:func:`log_of`)."""
    return log_of(_rows(catalog, namespace, table_name))


def _hours_json(hours: Iterable[datetime]) -> str:
    return json.dumps(sorted({h.astimezone(UTC).isoformat() for h in hours}))


def _hours(value: str | None) -> frozenset[datetime] | None:
    if value is None:
        return None
    return frozenset(datetime.fromisoformat(h).astimezone(UTC) for h in json.loads(value))


def reads_json(reads: Mapping[str, tuple[int, int]]) -> str:
    """The ``reads`` value (ledger column and ``backfill.reads`` summary) of a derived
    publish: input table -> its main's snapshot id and sequence number the run read."""
    return json.dumps(
        {t: {"snapshot_id": s, "sequence_number": n} for t, (s, n) in sorted(reads.items())}
    )


def parse_reads(value: str | None) -> dict[str, int] | None:
    """Input table -> sequence number read, from a ``reads`` value (ledger or summary)."""
    if not value:
        return None
    return {t: int(v["sequence_number"]) for t, v in json.loads(value).items()}


def _event_hours_json(counts: Mapping[datetime, int]) -> str:
    return json.dumps({h.astimezone(UTC).isoformat(): int(n) for h, n in sorted(counts.items())})


def _event_hours(value: str | None) -> dict[datetime, int] | None:
    if value is None:
        return None
    return {datetime.fromisoformat(h).astimezone(UTC): int(n) for h, n in json.loads(value).items()}


def record_rollback(
    catalog: Catalog,
    namespace: str,
    table_name: str,
    *,
    runs: list[str],
    snapshot_id: int,
    rollback_id: str | None = None,
    invalidations: Iterable[Invalidation] = (),
) -> None:
    """The runs a rollback undid on ``table_name`` (their hours are no longer covered) and the
    hours of other tables it makes stale, in one commit.

    Without ``rollback_id`` the row takes effect at once (the table was rolled back already).
    With one it is the rollback's *intent*, written before the table's commit: it takes effect
    only once that rollback is committed (:func:`committed_rollbacks`), so a crash on either
    side of the table's commit never leaves the ledger and the table disagreeing."""
    now = datetime.now(UTC)
    rows = [
        _row(
            "rollback",
            table_name,
            now,
            snapshot_id=snapshot_id,
            undone_runs=json.dumps(sorted(runs)),
            rollback_id=rollback_id,
        )
    ]
    rows += _invalidate_rows(table_name, rollback_id, runs, invalidations, now)
    _append(catalog, namespace, rows)


@dataclass(frozen=True)
class Invalidation:
    """Hours of a table built from what a rollback of another table undoes: its publishes of
    these hours up to ``sequence_number`` (the table's commit order when the rollback was
    planned) are no longer live, so the hours are due again."""

    table_name: str
    hours: tuple[datetime, ...]
    sequence_number: int


def record_rollback_outcome(
    catalog: Catalog,
    namespace: str,
    table_name: str,
    *,
    rollback_id: str,
    committed: bool,
    tables: Iterable[str] = (),
    runs: Iterable[str] = (),
    invalidations: Iterable[Invalidation] = (),
) -> None:
    """Whether rollback ``rollback_id`` of ``table_name`` was committed, on ``table_name`` and
    the ``tables`` its intent invalidated, in one commit: after it, reading them needs no look
    at the table's properties. ``invalidations`` (committed only) repeat the intent's with the
    readers' commit order of now, so a reader publish committed while the rollback ran (it
    read the undone rows) is stale too."""
    now = datetime.now(UTC)
    event = "rollback_committed" if committed else "rollback_aborted"
    invalidations = list(invalidations)
    tables = dict.fromkeys([table_name, *tables, *(i.table_name for i in invalidations)])
    rows = [_row(event, name, now, rollback_id=rollback_id) for name in tables]
    if committed:
        rows += _invalidate_rows(table_name, rollback_id, runs, invalidations, now)
    _append(catalog, namespace, rows)


def _row(event: str, table_name: str, now: datetime, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(SCHEMA.names)
    row.update(event=event, table_name=table_name, recorded_at=now, **values)
    return row


def _invalidate_rows(
    source: str,
    rollback_id: str | None,
    runs: Iterable[str],
    invalidations: Iterable[Invalidation],
    now: datetime,
) -> list[dict[str, Any]]:
    return [
        _row(
            "invalidate",
            inv.table_name,
            now,
            hour=hour,
            sequence_number=inv.sequence_number,
            undone_runs=json.dumps(sorted(runs)),
            rollback_id=rollback_id,
            source_table=source,
        )
        for inv in invalidations
        for hour in sorted(inv.hours)
    ]


def rollback_property(rollback_id: str) -> str:
    """The table property that commits rollback ``rollback_id`` (set with main's move)."""
    return ROLLBACK_PROPERTY + rollback_id


def _properties(catalog: Catalog, table_name: str) -> dict[str, str]:
    ident = table_name.split(".", 1)[1] if table_name.count(".") >= 2 else table_name
    try:
        return dict(catalog.load_table(ident).properties)
    except NoSuchTableError:
        return {}


def committed_rollbacks(catalog: Catalog, rows: list[dict[str, Any]]) -> set[str]:
    """The rollback ids among ``rows`` that are committed.

    A rollback is committed when the catalog commit that moved its table's main back (and set
    :func:`rollback_property` in the same commit) succeeded: a ``rollback_committed`` row says
    so; without one (the process died after the table's commit), the table's properties do.
    Ids with a ``rollback_aborted`` row, or whose table has no such property, are not."""
    done = {r["rollback_id"] for r in rows if r["event"] == "rollback_committed"}
    aborted = {r["rollback_id"] for r in rows if r["event"] == "rollback_aborted"}
    pending: dict[str, str] = {}
    for r in rows:
        rid = r.get("rollback_id")
        if r["event"] in ("rollback", "invalidate") and rid and rid not in done | aborted:
            pending[rid] = r.get("source_table") or r["table_name"]
    for source in set(pending.values()):
        props = _properties(catalog, source)
        done |= {i for i, s in pending.items() if s == source and rollback_property(i) in props}
    return done


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


def undone_runs(rows: list[dict[str, Any]], committed: set[str] | None = None) -> set[str]:
    """Runs undone by the rollback rows among ``rows``: those written after their table's
    commit (no rollback id) and those whose rollback id is in ``committed``."""
    out: set[str] = set()
    for row in rows:
        rid = row.get("rollback_id")
        effective = rid is None or (committed is not None and rid in committed)
        if row["event"] == "rollback" and row["undone_runs"] and effective:
            out.update(json.loads(row["undone_runs"]))
    return out


def stale_hours(rows: list[dict[str, Any]], committed: set[str]) -> dict[datetime, tuple[int, str]]:
    """Hour -> (sequence number, reason) of the committed invalidations among ``rows``: a
    publish of that hour at or below that sequence number is no longer live."""
    out: dict[datetime, tuple[int, str]] = {}
    for row in rows:
        if row["event"] != "invalidate" or row.get("rollback_id") not in committed:
            continue
        hour = row["hour"].astimezone(UTC)
        seq = int(row["sequence_number"])
        if hour not in out or seq >= out[hour][0]:
            runs = ", ".join(json.loads(row["undone_runs"] or "[]"))
            out[hour] = (
                seq,
                f"rollback {row['rollback_id']} of table "
                f"{row['source_table'].rsplit('.', 1)[-1]} undid rows it read (run(s) {runs})",
            )
    return out


def stale(catalog: Catalog, namespace: str, table_name: str) -> dict[datetime, str]:
    """Hours of ``table_name`` a committed rollback of a table it reads made stale, and that
    no publish has rebuilt since, with the reason in words."""
    rows = _rows(catalog, namespace, table_name)
    marks = stale_hours(rows, committed_rollbacks(catalog, rows))
    live = {e.hour for e in _entries(rows, catalog)}
    return {h: reason for h, (_, reason) in marks.items() if h not in live}


def publishes(
    catalog: Catalog, namespace: str, table_name: str, *, include_stale: bool = False
) -> list[Entry]:
    """Every publish of ``table_name`` not undone by a rollback, nor made stale by the
    rollback of a table it reads, oldest commit first. ``include_stale``: the stale ones too,
    i.e. every publish whose rows are still on main (what a rollback of the table undoes)."""
    return _entries(_rows(catalog, namespace, table_name), catalog, include_stale)


def _entries(
    rows: list[dict[str, Any]], catalog: Catalog, include_stale: bool = False
) -> list[Entry]:
    committed = committed_rollbacks(catalog, rows)
    undone = undone_runs(rows, committed)
    marks = {} if include_stale else stale_hours(rows, committed)
    out = []
    for row in rows:
        if row["event"] != "publish" or row["run_id"] in undone or row["hour"] is None:
            continue
        hour = row["hour"].astimezone(UTC)
        if hour in marks and int(row["sequence_number"]) <= marks[hour][0]:
            continue
        offsets = None
        if row["offsets"]:
            offsets = {
                int(p): (int(v[0]), int(v[1])) for p, v in json.loads(row["offsets"]).items()
            }
        out.append(
            Entry(
                hour=hour,
                run_id=row["run_id"],
                snapshot_id=int(row["snapshot_id"]),
                sequence_number=int(row["sequence_number"]),
                recorded_at=row["recorded_at"].astimezone(UTC),
                offsets=offsets,
                # absent from a ledger not yet evolved (no append since the column was added)
                event_hours=_event_hours(row.get("event_hours")),
                superseded_hours=_hours(row.get("superseded_hours")),
                reads=parse_reads(row.get("reads")),
                topic_id=row.get("topic_id"),
                cluster_id=row.get("cluster_id"),
                records=None if row.get("records") is None else int(row["records"]),
            )
        )
    return sorted(out, key=lambda e: (e.sequence_number, e.recorded_at))


def coverage(catalog: Catalog, namespace: str, table_name: str) -> dict[datetime, Entry]:
    """Hour -> the newest live publish that covers it."""
    out: dict[datetime, Entry] = {}
    for entry in publishes(catalog, namespace, table_name):
        out[entry.hour] = entry
    return out


def log_coverage(
    catalog: Catalog, namespace: str, table_name: str
) -> tuple[dict[datetime, Entry], Log]:
    """:func:`coverage` and :func:`current_log` of ``table_name`` from one read of the ledger."""
    rows = _rows(catalog, namespace, table_name)
    out: dict[datetime, Entry] = {}
    for entry in _entries(rows, catalog):
        out[entry.hour] = entry
    return out, log_of(rows)


def published_offsets(
    catalog: Catalog, namespace: str, table_name: str
) -> dict[datetime, dict[int, tuple[int, int]]]:
    """Hour -> partition -> (start, end) of every covered hour of a raw table read from its
    current log (:func:`current_log`): offsets of another log fix no window of this one."""
    out, log = log_coverage(catalog, namespace, table_name)
    return {
        hour: dict(e.offsets) for hour, e in out.items() if e.offsets is not None and log.holds(e)
    }


def sync_from_history(catalog: Catalog, namespace: str, table_name: str) -> list[str]:
    """Add ledger rows for publishes in main's history that have none; return their run ids.

    ``table_name`` is ``catalog.namespace.table`` (Spark's name) or ``namespace.table``.
    """
    from backfill_assets.lake.offsets.windows import hours_between, parse_bounds

    ident = table_name.split(".", 1)[1] if table_name.count(".") >= 2 else table_name
    try:
        table = catalog.load_table(ident)
    except NoSuchTableError:
        return []
    rows = _rows(catalog, namespace, table_name)
    _sync_rollbacks(catalog, namespace, table_name, table, rows)
    rows = _rows(catalog, namespace, table_name)
    known = {r["snapshot_id"] for r in rows}
    undone = undone_runs(rows, committed_rollbacks(catalog, rows))
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
                    records=_summary_records(props.get(SUMMARY_PREFIX + "hour-records"), offsets),
                    reads=_summary_reads(props.get(SUMMARY_PREFIX + "reads")),
                    recorded_at=datetime.fromtimestamp(snap.timestamp_ms / 1000, UTC),
                    identity=_summary_identity(props),
                )
                added.append(run_id)
        parent = snap.parent_snapshot_id
        snap = table.metadata.snapshot_by_id(parent) if parent is not None else None
    return added


def _sync_rollbacks(
    catalog: Catalog, namespace: str, table_name: str, table: Table, rows: list[dict[str, Any]]
) -> None:
    """Record as committed every rollback the table's properties say was committed but the
    ledger does not (the process died between the table's commit and the ledger's), on every
    table its intent named; a rollback without an intent row gets its rollback row from the
    property. After this, reading these tables needs no look at the table's properties."""
    ids = {
        key.removeprefix(ROLLBACK_PROPERTY): value
        for key, value in table.properties.items()
        if key.startswith(ROLLBACK_PROPERTY)
    }
    done = {r["rollback_id"] for r in rows if r["event"] == "rollback_committed"}
    missing = {i: v for i, v in ids.items() if i not in done}
    if not missing:
        return
    ledger_table = catalog.load_table(_ident(namespace))
    quoted = ", ".join(f"'{i}'" for i in sorted(missing) if "'" not in i)
    named = ledger_table.scan(row_filter=f"rollback_id IN ({quoted})").to_arrow().to_pylist()
    now = datetime.now(UTC)
    out = []
    for rid, value in sorted(missing.items()):
        mine = [r for r in named if r["rollback_id"] == rid]
        if any(r["event"] == "rollback_committed" for r in mine):
            continue  # recorded for another table of the same rollback meanwhile
        if not any(r["event"] == "rollback" for r in mine):
            told = json.loads(value)
            out.append(
                _row(
                    "rollback",
                    table_name,
                    now,
                    snapshot_id=int(told["snapshot_id"]),
                    undone_runs=json.dumps(sorted(told["runs"])),
                    rollback_id=rid,
                )
            )
        tables = dict.fromkeys([table_name, *(r["table_name"] for r in mine)])
        out += [_row("rollback_committed", name, now, rollback_id=rid) for name in tables]
    _append(catalog, namespace, out)


def _summary_records(
    text: str | None, offsets: Mapping[datetime, Any] | None
) -> dict[datetime, int] | None:
    """Per hour, the committed records a raw publish's summary counted (``hour-records``, in
    the order of its windows' hours); None where the summary does not say (written before it
    was kept, or its hours do not match)."""
    if not text or not offsets:
        return None
    counts = json.loads(text)
    hours = sorted(offsets)
    if not isinstance(counts, list) or len(counts) != len(hours):
        return None
    return {h: int(n) for h, n in zip(hours, counts, strict=True)}


def _summary_identity(props: Any) -> TopicIdentity | None:
    """The log a raw publish read, from its snapshot summary (None: not recorded)."""
    topic_id = props.get(SUMMARY_PREFIX + "topic-id")
    if not topic_id:
        return None
    return TopicIdentity(topic_id, props.get(SUMMARY_PREFIX + "cluster-id") or "")


def _summary_reads(value: str | None) -> dict[str, tuple[int, int]] | None:
    """A derived publish's ``backfill.reads`` summary (the ledger's ``reads`` JSON) as
    :func:`record_publish` takes it."""
    if not value:
        return None
    return {
        t: (int(v["snapshot_id"]), int(v["sequence_number"])) for t, v in json.loads(value).items()
    }
