"""Roll a table back to the snapshot it had before a run or a backfill published.

Per table the rollback is one atomic catalog commit (main's ref is swapped with a check that
main has not moved since it was inspected). A backfill that published to several tables is
rolled back table by table; each table is either fully rolled back or untouched. A rollback that
would also discard later publishes by other runs is refused unless forced, and every rollback
is recorded in the audit table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    from backfill_assets.lake.declared import ordered
    from backfill_assets.lake.spec import load_specs

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
class RollbackResult:
    table_name: str
    snapshot_before: int
    restored_snapshot: int
    undone_runs: list[str]
    discarded_later_runs: list[str] = field(default_factory=list)


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
    plans = [
        _plan(catalog, namespace, name, by_table[name], force)
        for name in downstream_first(list(by_table))
    ]
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


def _plan(
    catalog: Catalog, namespace: str, table_name: str, publishes: list[dict[str, Any]], force: bool
) -> tuple[Table, RollbackResult]:
    """What rolling ``table_name`` back before ``publishes`` undoes, from the ledger (which
    survives snapshot expiry): the live publishes committed after the earliest of them."""
    ident = table_name.split(".", 1)[1] if table_name.count(".") >= 2 else table_name
    table = catalog.load_table(ident)
    current = table.metadata.current_snapshot_id
    if current is None:
        raise RollbackError(f"{table_name} has no snapshot on main; nothing to roll back")
    ledger.sync_from_history(catalog, namespace, table_name)
    earliest = min(publishes, key=lambda r: r["finished_at"])
    target = int(earliest["snapshot_before"])
    ours = {r["run_id"] for r in publishes}
    live = ledger.publishes(catalog, namespace, table_name)
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
    return table, RollbackResult(table_name, current, target, undone, later)
