"""Roll a table back to the snapshot it had before a run or a backfill published.

Per table the rollback is one atomic catalog commit (main's ref is swapped with a check that
main has not moved since it was inspected). A backfill that published to several tables is
rolled back table by table; each table is either fully rolled back or untouched. A rollback that
would also discard later publishes by other runs is refused unless forced, and every rollback
is recorded in the audit table.

**Undo propagates.** The hours a rollback takes out of a table were read by other tables: the
current state (the same Kafka hours of a raw table) and every declared table whose event hours
map to them (``lateness``/``lookback``, and the event hours the undone raw rows held), through
declared tables that read declared tables. Those hours of those readers are *invalidated* in the
ledger: their publishes up to now are no longer live, so the gap sensor and ``gaps`` find them
due and rebuild them once what they read is published again.

**Atomic with the ledger.** Per table: (1) one ledger commit writes the rollback's intent (its
rollback row and its readers' invalidations, under a fresh rollback id); (2) one catalog commit
moves main back and sets the table property ``backfill.rollback.<id>``: the commit point; (3) one
ledger commit records the outcome. Ledger rows of a rollback id take effect only once it is
committed (:func:`backfill_assets.lake.offsets.ledger.committed_rollbacks`: the outcome row, else
the
table's property), so a crash before (2) leaves table and ledger as they were, and a crash after
it leaves both rolled back (``sync_from_history``, run by every publish and rollback, writes the
missing outcome). Failpoints ``rollback_intent_recorded``, ``rollback_table_committed`` and
``rollback_ledger_committed`` kill a rollback at each step (``test_rollback_faults.py``).

:func:`plan_rollback` computes the same plan without writing anything (a dry run), including
which partitions (hours) each table loses and which earlier publish, if any, covers them again,
and which hours of which readers it makes due.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.table import Table
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.table.update.snapshot import ManageSnapshots

from backfill_assets.errors import AlreadyRolledBack, RollbackError
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.write import audit
from backfill_assets.stack.faults import failpoint

if TYPE_CHECKING:
    from backfill_assets.spec.model import TopicSpec

HOUR = timedelta(hours=1)


def downstream_first(tables: list[str], specs: list[TopicSpec] | None = None) -> list[str]:
    """``tables`` (full names) with readers before what they read: declared tables (latest in
    dependency order first), then current-state and raw tables, so no table is ever left
    holding rows computed from a publish already undone upstream for longer than needed."""
    from backfill_assets.spec.declared import ordered

    specs = _specs(specs)
    rank = {t.name: i for i, t in enumerate(ordered(specs))}
    raw = {s.raw_table for s in specs}

    def key(full: str) -> tuple[int, int, str]:
        short = full.rsplit(".", 1)[-1]
        if short in rank:
            return (0, -rank[short], full)
        return (2 if short in raw or short.startswith("raw_") else 1, 0, full)

    return sorted(tables, key=key)


def _specs(specs: list[TopicSpec] | None) -> list[TopicSpec]:
    from backfill_assets.spec.loader import load_specs

    return list(specs) if specs is not None else load_specs()


@dataclass
class StaleReader:
    """Hours of a table that read what a rollback undoes: due again after it."""

    table_name: str
    hours: list[datetime]


@dataclass
class HourRestore:
    """One partition (hour) a rollback takes out of a table, and what covers it afterwards."""

    hour: datetime
    # The run whose earlier publish covers the hour again, and the snapshot that publish
    # committed; both None when no earlier publish did (the hour holds no rows afterwards).
    restored_run: str | None = None
    restored_snapshot: int | None = None


@dataclass
class RollbackResult:
    """What a rollback does (or did) to one table."""

    table_name: str
    snapshot_before: int
    restored_snapshot: int
    undone_runs: list[str]
    discarded_later_runs: list[str] = field(default_factory=list)
    partitions: list[HourRestore] = field(default_factory=list)
    # every table whose covered hours read the hours this rollback takes out (transitively)
    stale_readers: list[StaleReader] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "table_name": self.table_name,
            "snapshot_before": self.snapshot_before,
            "restored_snapshot": self.restored_snapshot,
            "undone_runs": self.undone_runs,
            "discarded_later_runs": self.discarded_later_runs,
            "partitions": [
                {
                    "hour": h.hour.isoformat(),
                    "restored_run": h.restored_run,
                    "restored_snapshot": h.restored_snapshot,
                }
                for h in self.partitions
            ],
            "stale_readers": [
                {"table_name": r.table_name, "hours": [h.isoformat() for h in r.hours]}
                for r in self.stale_readers
            ],
        }


def plan_rollback(
    catalog: Catalog,
    namespace: str,
    *,
    run_id: str | None = None,
    backfill_id: str | None = None,
    table_name: str | None = None,
    force: bool = False,
    specs: list[TopicSpec] | None = None,
) -> list[RollbackResult]:
    """What :func:`rollback` would do, table by table, without writing anything (no table,
    ledger or audit commit). Raises the same :class:`RollbackError` the rollback would.
    ``specs``: the topics whose tables read what is undone (default: the loaded spec)."""
    specs = _specs(specs)
    plans = _plans(catalog, namespace, run_id, backfill_id, table_name, force, False, specs)
    # What the readers in the plan still cover once their own rollback is done.
    emptied = {
        result.table_name: {h.hour for h in result.partitions if h.restored_run is None}
        for _, result, _ in plans
    }
    for _, result, undone in plans:
        result.stale_readers = [
            StaleReader(inv.table_name, list(inv.hours))
            for inv in _invalidations(catalog, namespace, specs, result.table_name, undone, emptied)
        ]
    return [result for _, result, _ in plans]


def rollback(
    catalog: Catalog,
    namespace: str,
    *,
    run_id: str | None = None,
    backfill_id: str | None = None,
    table_name: str | None = None,
    force: bool = False,
    launched_by: str = "cli",
    specs: list[TopicSpec] | None = None,
) -> list[RollbackResult]:
    """Undo the publishes of ``run_id`` or ``backfill_id`` (on ``table_name`` or all tables),
    and invalidate every hour of every table that read them (see the module's docstring for
    the order of commits that keeps the ledger and the tables in agreement)."""
    specs = _specs(specs)
    plans = _plans(catalog, namespace, run_id, backfill_id, table_name, force, True, specs)
    results = []
    for table, result, undone in plans:
        runs = [*result.undone_runs, *result.discarded_later_runs]
        rid = uuid.uuid4().hex
        # Readers first in the plan: those rolled back already are read as they are now.
        stale = _invalidations(catalog, namespace, specs, result.table_name, undone, {})
        result.stale_readers = [StaleReader(i.table_name, list(i.hours)) for i in stale]
        ledger.record_rollback(
            catalog,
            namespace,
            result.table_name,
            runs=runs,
            snapshot_id=result.restored_snapshot,
            rollback_id=rid,
            invalidations=stale,
        )
        failpoint("rollback_intent_recorded")
        _commit_rollback(catalog, namespace, table, result, runs, rid, stale)
        _restore_quarantine(catalog, namespace, specs, result.table_name, set(runs))
        failpoint("rollback_table_committed")
        ledger.record_rollback_outcome(
            catalog,
            namespace,
            result.table_name,
            rollback_id=rid,
            committed=True,
            tables=[i.table_name for i in stale],
            runs=runs,
            # again, with the readers' commit order of now: a reader publish committed while
            # the table was rolled back read the undone rows too
            invalidations=_invalidations(catalog, namespace, specs, result.table_name, undone, {}),
        )
        failpoint("rollback_ledger_committed")
        _audit_rollback(catalog, namespace, result, run_id, backfill_id, launched_by)
        results.append(result)
    return results


def _commit_rollback(
    catalog: Catalog,
    namespace: str,
    table: Table,
    result: RollbackResult,
    runs: list[str],
    rid: str,
    stale: list[ledger.Invalidation],
) -> None:
    """One atomic catalog commit: main moves back (only if it is still where it was when
    planned) and the property that commits the rollback's ledger rows is set. If the table
    changed meanwhile, records the rollback as not committed and raises :class:`RollbackError`."""
    try:
        with table.transaction() as tx:
            ManageSnapshots(tx).rollback_to_snapshot(result.restored_snapshot).commit()
            tx.set_properties(
                {
                    ledger.rollback_property(rid): json.dumps(
                        {
                            "runs": sorted(runs),
                            "snapshot_id": result.restored_snapshot,
                            "snapshot_before": result.snapshot_before,
                        }
                    )
                }
            )
    except CommitFailedException as exc:
        ledger.record_rollback_outcome(
            catalog,
            namespace,
            result.table_name,
            rollback_id=rid,
            committed=False,
            tables=[i.table_name for i in stale],
        )
        raise RollbackError(
            f"{result.table_name} changed while rolling back ({exc}); nothing was changed "
            "on it. Run the rollback again."
        ) from exc


def _restore_quarantine(
    catalog: Catalog, namespace: str, specs: list[TopicSpec], table_name: str, runs: set[str]
) -> int | None:
    """A raw table rolled back takes its quarantine table back with it: the quarantine's main
    returns to the snapshot before the first quarantine write of the undone ``runs`` in its
    history (one catalog commit; the same runs, since only the topic's raw runs write there).
    Returns that snapshot; None if no undone run wrote quarantine rows (or no such table)."""
    short = table_name.rsplit(".", 1)[-1]
    spec = next((s for s in specs if s.raw_table == short), None)
    if spec is None:
        return None
    try:
        table = catalog.load_table(f"{namespace}.{spec.quarantine_table}")
    except NoSuchTableError:
        return None
    meta = table.metadata
    main = meta.refs.get("main")
    head = meta.snapshot_by_id(main.snapshot_id) if main is not None else None
    target = None
    for snap in ancestors_of(head, meta) if head is not None else []:
        run = snap.summary[ledger.SUMMARY_PREFIX + "run-id"] if snap.summary else None
        if run in runs:
            target = snap.parent_snapshot_id
    if target is not None:
        with table.transaction() as tx:
            ManageSnapshots(tx).rollback_to_snapshot(target).commit()
    return target


def _audit_rollback(
    catalog: Catalog,
    namespace: str,
    result: RollbackResult,
    run_id: str | None,
    backfill_id: str | None,
    launched_by: str,
) -> None:
    """Append the audit record of one table's committed rollback."""
    audit.append(
        catalog,
        namespace,
        audit.AuditRecord(
            event="rollback",
            outcome="rolled_back",
            table_name=result.table_name,
            run_id=run_id,
            backfill_id=backfill_id,
            launched_by=launched_by,
            snapshot_before=result.snapshot_before,
            snapshot_after=result.restored_snapshot,
            detail=(
                f"undid runs {', '.join(result.undone_runs)}"
                + (
                    f"; forced, also discarded {', '.join(result.discarded_later_runs)}"
                    if result.discarded_later_runs
                    else ""
                )
                + "".join(
                    f"; {r.table_name.rsplit('.', 1)[-1]}: {len(r.hours)} hour(s) due again"
                    for r in result.stale_readers
                )
            ),
        ),
    )


def _plans(
    catalog: Catalog,
    namespace: str,
    run_id: str | None,
    backfill_id: str | None,
    table_name: str | None,
    force: bool,
    sync: bool,
    specs: list[TopicSpec],
) -> list[tuple[Table, RollbackResult, list[ledger.Entry]]]:
    """Per table the run or backfill published to (readers first), what rolling it back does
    and the live publishes it undoes. Tables where they are undone already (a rollback that
    died part way through its tables) are left out; if every table is, that is an error."""
    if (run_id is None) == (backfill_id is None):
        raise RollbackError("give exactly one of --run RUN_ID or --backfill BACKFILL_ID")
    rows = [
        r
        for r in audit.query(
            catalog, namespace, table_name=table_name, run_id=run_id, backfill_id=backfill_id
        )
        if r["event"] == "publish" and r["outcome"] == "succeeded"
    ]
    what = f"run {run_id}" if run_id else f"backfill {backfill_id}"
    if not rows:
        raise RollbackError(
            f"no successful publish of {what}"
            + (f" on {table_name}" if table_name else "")
            + " in the audit table; `backfill-assets audit` lists what was published"
        )
    by_table: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_table.setdefault(row["table_name"], []).append(row)
    out, done = [], []
    for name in downstream_first(list(by_table), specs):
        try:
            out.append(_plan(catalog, namespace, name, by_table[name], force, sync))
        except AlreadyRolledBack as exc:
            done.append(exc)
    if not out:
        raise done[0]
    return out


def _invalidations(
    catalog: Catalog,
    namespace: str,
    specs: list[TopicSpec],
    table_name: str,
    undone: list[ledger.Entry],
    emptied: dict[str, set[datetime]],
) -> list[ledger.Invalidation]:
    """The hours of every table that reads ``table_name``'s ``undone`` publishes (directly or
    through other declared tables) and that the ledger says are covered: with each reader's
    commit order now, the invalidation of those hours. ``emptied``: hours a reader's own
    rollback (in the same plan, not applied yet: a dry run) leaves without rows."""
    short = table_name.rsplit(".", 1)[-1]
    prefix = table_name[: -len(short)]
    hours = {e.hour for e in undone}
    out = []
    for reader, wanted in stale_readers(
        specs, short, hours, _event_hours(catalog, namespace, specs, short, undone)
    ).items():
        full = prefix + reader
        try:
            table = catalog.load_table(f"{namespace}.{reader}")
        except NoSuchTableError:
            continue  # never created: nothing to invalidate
        covered = set(ledger.coverage(catalog, namespace, full)) - emptied.get(full, set())
        stale = sorted(wanted & covered)
        if stale:
            seq = int(getattr(table.metadata, "last_sequence_number", 0) or 0)
            out.append(ledger.Invalidation(full, tuple(stale), seq))
    return out


def stale_readers(
    specs: list[TopicSpec],
    table: str,
    hours: set[datetime],
    event_hours: set[datetime] | None = None,
) -> dict[str, set[datetime]]:
    """Table (short name) -> the hours of it built from ``hours`` of ``table`` (a raw,
    current-state or declared table, short name), transitively, readers in dependency order.

    A raw table's Kafka hour K is read by the current state's hour K and by every declared
    table reading the topic's events whose event hours map to it (E - lookback <= K <= E +
    lateness), and by the event hours its rows hold (``event_hours``, late beyond lateness);
    the current state's hours likewise by its readers; a declared table's hour A by the event
    hours E of its readers with E - lookback <= A <= E."""
    from backfill_assets.spec import declared

    known = declared.relations(specs)
    affected: dict[str, set[datetime]] = {table: set(hours)}
    raw = {s.raw_table: s for s in specs}
    if table in raw:
        affected[raw[table].current_table] = set(hours)
    for reader in declared.ordered(specs):
        for ref in reader.refs:
            rel = known[ref]
            source = raw_table_of(specs, rel.topic) if rel.kind == "events" else rel.name
            src = affected.get(source)
            if not src:
                continue
            later = reader.lateness_hours if rel.kind != "table" else 0
            got = affected.setdefault(reader.name, set())
            got |= {k + i * HOUR for k in src for i in range(-later, reader.lookback_hours + 1)}
            if rel.kind == "events" and source == table and event_hours:
                got |= event_hours
    del affected[table]
    return {name: h for name, h in affected.items() if h}


def raw_table_of(specs: list[TopicSpec], topic: str) -> str:
    return next(s.raw_table for s in specs if s.topic == topic)


def _event_hours(
    catalog: Catalog,
    namespace: str,
    specs: list[TopicSpec],
    table: str,
    undone: list[ledger.Entry],
) -> set[datetime]:
    """The event hours the rows of a raw table's ``undone`` publishes hold: from the ledger,
    else (publishes recorded before the ledger kept them) from the rows themselves."""
    spec = next((s for s in specs if s.raw_table == table), None)
    if spec is None:
        return set()
    out: set[datetime] = set()
    unknown = {}
    for e in undone:
        if e.event_hours is None:
            unknown[e.hour] = e
        else:
            out |= set(e.event_hours)
    if unknown:
        from backfill_assets.lake.coverage.detect import _event_hours_from_rows

        for counts in _event_hours_from_rows(catalog, namespace, spec, unknown).values():
            out |= set(counts)
    return out


def _plan(
    catalog: Catalog,
    namespace: str,
    table_name: str,
    publishes: list[dict[str, Any]],
    force: bool,
    sync: bool = True,
) -> tuple[Table, RollbackResult, list[ledger.Entry]]:
    """What rolling ``table_name`` back before ``publishes`` undoes, from the ledger (which
    survives snapshot expiry): the live publishes committed after the earliest of them.

    ``sync`` first copies publishes in main's history that the ledger lacks into the ledger
    (a write); without it (a dry run) they are read from the history and nothing is written.
    """
    ident = table_name.split(".", 1)[1] if table_name.count(".") >= 2 else table_name
    table = catalog.load_table(ident)
    current = table.metadata.current_snapshot_id
    if current is None:
        raise RollbackError(f"{table_name} has no snapshot on main; nothing to roll back")
    # What is on main: a publish a reader's invalidation made stale still has its rows there.
    if sync:
        ledger.sync_from_history(catalog, namespace, table_name)
        live = ledger.publishes(catalog, namespace, table_name, include_stale=True)
    else:
        live = sorted(
            ledger.publishes(catalog, namespace, table_name, include_stale=True)
            + _unrecorded(catalog, namespace, table_name, table),
            key=lambda e: (e.sequence_number, e.recorded_at),
        )
    earliest = min(publishes, key=lambda r: r["finished_at"])
    target = int(earliest["snapshot_before"])
    ours = {r["run_id"] for r in publishes}
    mine = [e for e in live if e.run_id in ours]
    if not mine:
        raise AlreadyRolledBack(
            f"{table_name}: the publishes of {sorted(ours)} are not live any more (already "
            "rolled back?); nothing to do"
        )
    if table.metadata.snapshot_by_id(target) is None:
        raise RollbackError(
            f"{table_name}: snapshot {target}, main before {sorted(ours)}, has been expired by "
            "table maintenance, so main cannot be restored to it. Re-run the backfill over "
            "the same range instead (windows are fixed, so it republishes the same rows)."
        )
    first_seq = min(e.sequence_number for e in mine)
    after = [e for e in live if e.sequence_number >= first_seq]
    later = [r for r in dict.fromkeys(e.run_id for e in after) if r not in ours]
    if later and not force:
        raise RollbackError(
            f"rolling back {table_name} to snapshot {target} would also discard later publishes "
            f"by run(s) {', '.join(later)}. Roll those back first, or pass --force to discard "
            "them too."
        )
    undone = [r for r in dict.fromkeys(e.run_id for e in after) if r in ours]
    # Publishes committed before the first undone one stay on main: per hour, the newest of
    # them is what the table holds for that hour after the rollback.
    kept: dict[datetime, ledger.Entry] = {}
    for e in live:
        if e.sequence_number < first_seq:
            kept[e.hour] = e
    hours = [
        HourRestore(h, kept[h].run_id, kept[h].snapshot_id) if h in kept else HourRestore(h)
        for h in sorted({e.hour for e in after})
    ]
    return table, RollbackResult(table_name, current, target, undone, later, hours), after


def _unrecorded(
    catalog: Catalog, namespace: str, table_name: str, table: Table
) -> list[ledger.Entry]:
    """The publishes in main's history that the ledger has no rows for, as ledger entries,
    without recording them: what :func:`ledger.sync_from_history` would add (read-only)."""
    from backfill_assets.lake.offsets.windows import hours_between

    rows = ledger._rows(catalog, namespace, table_name)
    known = {r["snapshot_id"] for r in rows}
    undone = ledger.undone_runs(rows, ledger.committed_rollbacks(catalog, rows))
    out = []
    snap = table.metadata.current_snapshot()
    while snap is not None:
        props: Any = snap.summary if snap.summary is not None else {}
        run_id = props.get(ledger.SUMMARY_PREFIX + "run-id")
        window = props.get(ledger.SUMMARY_PREFIX + "window") or ""
        start_s, _, end_s = window.partition("/")
        if (
            props.get(ledger.SUMMARY_PREFIX + "published") == "true"
            and snap.snapshot_id not in known
            and run_id is not None
            and run_id not in undone
            and start_s
            and end_s
        ):
            at = datetime.fromtimestamp(snap.timestamp_ms / 1000, UTC)
            out += [
                ledger.Entry(h, run_id, snap.snapshot_id, int(snap.sequence_number or 0), at, None)
                for h in hours_between(
                    datetime.fromisoformat(start_s), datetime.fromisoformat(end_s)
                )
            ]
        parent = snap.parent_snapshot_id
        snap = table.metadata.snapshot_by_id(parent) if parent is not None else None
    return out
