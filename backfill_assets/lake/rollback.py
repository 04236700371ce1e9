"""Roll a table back to the snapshot it had before a run or a backfill published.

Per table the rollback is one atomic catalog commit (main's ref is swapped with a check that
main has not moved since it was inspected). A backfill that published to several tables is
rolled back table by table; each table is either fully rolled back or untouched. A rollback that
would also discard later publishes by other runs is refused unless forced, and every rollback
is recorded in the audit table.

:func:`plan_rollback` computes the same plan without writing anything (a dry run), including
which partitions (hours) each table loses and which earlier publish, if any, covers them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

from backfill_assets.errors import BackfillError
from backfill_assets.lake import audit, ledger


def downstream_first(tables: list[str]) -> list[str]:
    """``tables`` (full names) with readers before what they read: declared tables (latest in
    dependency order first), then current-state and raw tables, so no table is ever left
    holding rows computed from a publish already undone upstream for longer than needed."""
    from backfill_assets.spec.declared import ordered
    from backfill_assets.spec.loader import load_specs

    specs = load_specs()
    rank = {t.name: i for i, t in enumerate(ordered(specs))}
    raw = {s.raw_table for s in specs}

    def key(full: str) -> tuple[int, int, str]:
        short = full.rsplit(".", 1)[-1]
        if short in rank:
            return (0, -rank[short], full)
        return (2 if short in raw or short.startswith("raw_") else 1, 0, full)

    return sorted(tables, key=key)


class RollbackError(BackfillError):
    """A rollback was refused or could not be applied; the table is unchanged."""


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
        }


def plan_rollback(
    catalog: Catalog,
    namespace: str,
    *,
    run_id: str | None = None,
    backfill_id: str | None = None,
    table_name: str | None = None,
    force: bool = False,
) -> list[RollbackResult]:
    """What :func:`rollback` would do, table by table, without writing anything (no table,
    ledger or audit commit). Raises the same :class:`RollbackError` the rollback would."""
    return [
        result
        for _, result in _plans(catalog, namespace, run_id, backfill_id, table_name, force, False)
    ]


def rollback(
    catalog: Catalog,
    namespace: str,
    *,
    run_id: str | None = None,
    backfill_id: str | None = None,
    table_name: str | None = None,
    force: bool = False,
    launched_by: str = "cli",
) -> list[RollbackResult]:
    """Undo the publishes of ``run_id`` or ``backfill_id`` (on ``table_name`` or all tables)."""
    plans = _plans(catalog, namespace, run_id, backfill_id, table_name, force, True)
    results = []
    for table, result in plans:
        try:
            table.manage_snapshots().rollback_to_snapshot(result.restored_snapshot).commit()
        except CommitFailedException as exc:
            raise RollbackError(
                f"{result.table_name} changed while rolling back ({exc}); nothing was changed "
                "on it. Run the rollback again."
            ) from exc
        ledger.record_rollback(
            catalog,
            namespace,
            result.table_name,
            runs=[*result.undone_runs, *result.discarded_later_runs],
            snapshot_id=result.restored_snapshot,
        )
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
                ),
            ),
        )
        results.append(result)
    return results


def _plans(
    catalog: Catalog,
    namespace: str,
    run_id: str | None,
    backfill_id: str | None,
    table_name: str | None,
    force: bool,
    sync: bool,
) -> list[tuple[Table, RollbackResult]]:
    """Per table the run or backfill published to (readers first), what rolling it back does."""
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
    return [
        _plan(catalog, namespace, name, by_table[name], force, sync)
        for name in downstream_first(list(by_table))
    ]


def _plan(
    catalog: Catalog,
    namespace: str,
    table_name: str,
    publishes: list[dict[str, Any]],
    force: bool,
    sync: bool = True,
) -> tuple[Table, RollbackResult]:
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
    if sync:
        ledger.sync_from_history(catalog, namespace, table_name)
        live = ledger.publishes(catalog, namespace, table_name)
    else:
        live = sorted(
            ledger.publishes(catalog, namespace, table_name)
            + _unrecorded(catalog, namespace, table_name, table),
            key=lambda e: (e.sequence_number, e.recorded_at),
        )
    earliest = min(publishes, key=lambda r: r["finished_at"])
    target = int(earliest["snapshot_before"])
    ours = {r["run_id"] for r in publishes}
    mine = [e for e in live if e.run_id in ours]
    if not mine:
        raise RollbackError(
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
    return table, RollbackResult(table_name, current, target, undone, later, hours)


def _unrecorded(
    catalog: Catalog, namespace: str, table_name: str, table: Table
) -> list[ledger.Entry]:
    """The publishes in main's history that the ledger has no rows for, as ledger entries,
    without recording them: what :func:`ledger.sync_from_history` would add (read-only)."""
    from backfill_assets.lake.windows import hours_between

    rows = ledger._rows(catalog, namespace, table_name)
    known = {r["snapshot_id"] for r in rows}
    undone = ledger.undone_runs(rows)
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
