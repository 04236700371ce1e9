"""``audit`` (what was published, by whom) and ``rollback`` (restore tables to their snapshot
before a run or a backfill, and record it in the Dagster instance)."""

from __future__ import annotations

import getpass
import os
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
import dagster as dg

from backfill_assets.ops.cli import output
from backfill_assets.ops.cli.common import PARTITION_FMT, with_ui
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from backfill_assets.lake.operations.rollback import RollbackResult

AUDIT_COLUMNS = (
    "finished (UTC)",
    "event",
    "outcome",
    "table",
    "window",
    "run",
    "backfill",
    "by",
    "snapshot before -> after",
    "detail",
)


@click.command("audit")
@click.option("--table", help="table name, e.g. raw_orders")
@click.option("--run", help="a Dagster run id")
@click.option("--backfill", help="a Dagster backfill id")
@click.option("--limit", type=int, default=50, show_default=True)
@with_ui
def audit_command(
    ui: Ui,
    settings: Settings,
    table: str | None,
    run: str | None,
    backfill: str | None,
    limit: int,
) -> int:
    """Query the audit table, newest first."""
    from backfill_assets.lake.write import audit

    rows = audit.query(
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        table_name=catalog.full_name(settings.catalog, table) if table else None,
        run_id=run,
        backfill_id=backfill,
        limit=limit,
    )
    ui.emit(rows)
    if not rows:
        ui.line("no audit rows match")
        return 0
    out = output.table(*AUDIT_COLUMNS)
    for r in rows:
        window = (
            f"{r['window_start']:%Y-%m-%dT%H:%M}..{r['window_end']:%Y-%m-%dT%H:%MZ}"
            if r["window_start"]
            else None
        )
        output.row(
            out,
            f"{r['finished_at']:%Y-%m-%d %H:%M:%S}",
            r["event"],
            r["outcome"],
            r["table_name"],
            window,
            r["run_id"],
            r["backfill_id"],
            r["launched_by"],
            f"{r['snapshot_before']} -> {r['snapshot_after']}",
            r["detail"] or "",
        )
    ui.table(out)
    return 0


@click.command("rollback", short_help="Restore tables to their snapshot before a run/backfill.")
@click.option("--run", help="a Dagster run id")
@click.option("--backfill", help="a Dagster backfill id")
@click.option("--table", help="only this table (default: every table it published to)")
@click.option("--force", is_flag=True, help="also discard later publishes")
@click.option(
    "--dry-run", is_flag=True, help="show what would be restored; change nothing, anywhere"
)
@with_ui
def rollback_command(
    ui: Ui,
    settings: Settings,
    run: str | None,
    backfill: str | None,
    table: str | None,
    force: bool,
    dry_run: bool,
) -> int:
    """Restore tables to their snapshot before a run or a backfill (give --run or --backfill).

    One atomic commit per table; refused if later publishes by other runs would be lost,
    unless --force. What was undone is then recorded in the Dagster instance of $DAGSTER_HOME,
    per asset partition.
    """
    from backfill_assets.lake.operations.rollback import plan_rollback, rollback

    if (run is None) == (backfill is None):
        raise click.UsageError("give exactly one of --run RUN_ID or --backfill BACKFILL_ID")
    full = catalog.full_name(settings.catalog, table) if table else None
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    what = f"run {run}" if run else f"backfill {backfill}"
    if dry_run:
        results = plan_rollback(
            cat, ns, run_id=run, backfill_id=backfill, table_name=full, force=force
        )
        ui.emit({"dry_run": True, "rollback_of": what, "tables": [r.to_json() for r in results]})
        ui.line(f"dry run: nothing was changed. Rolling back {what} would:")
        _show_rollback(ui, results)
        return 0
    results = rollback(
        cat,
        ns,
        run_id=run,
        backfill_id=backfill,
        table_name=full,
        force=force,
        launched_by=f"cli:{getpass.getuser()}",
    )
    dagster = _report_rollback(results, what=what, backfill_id=backfill)
    ui.emit(
        {
            "dry_run": False,
            "rollback_of": what,
            "tables": [r.to_json() for r in results],
            "dagster": dagster,
        }
    )
    _show_rolled_back(ui, results, dagster)
    return 0


def _show_rolled_back(ui: Ui, results: list[RollbackResult], dagster: dict[str, Any]) -> None:
    """What a rollback did: per table, main's move and the runs undone; then what Dagster
    recorded of it."""
    for r in results:
        ui.line(
            f"rolled back {r.table_name}: main {r.snapshot_before} -> {r.restored_snapshot} "
            f"(undid {', '.join(r.undone_runs)}"
            + (f"; discarded {', '.join(r.discarded_later_runs)}" if r.discarded_later_runs else "")
            + ")"
        )
    _show_stale_readers(ui, results)
    if dagster["recorded"]:
        ui.line(
            f"Dagster ({dagster['dagster_home']}): recorded {dagster['materializations']} "
            f"partition(s) restored to an earlier run as materializations and "
            f"{dagster['observations']} partition(s) left without rows as observations"
        )
    else:
        ui.note(f"warning: {dagster['reason']}")


def _show_rollback(ui: Ui, results: list[RollbackResult]) -> None:
    """Per table: main's snapshot now and after, the runs undone; then per range of hours what
    the table holds for them afterwards."""
    tables = output.table(
        "table", "main now", "restored snapshot", "undoes runs", "also discards", "partitions"
    )
    parts = output.table("table", "partitions (hours, UTC)", "afterwards")
    for r in results:
        output.row(
            tables,
            r.table_name,
            r.snapshot_before,
            r.restored_snapshot,
            ", ".join(r.undone_runs),
            ", ".join(r.discarded_later_runs),
            len(r.partitions),
        )
        for first, last, run, snap in _hour_ranges(r):
            span = f"{first:%Y-%m-%dT%H:%MZ}" + (
                f"..{last:%Y-%m-%dT%H:%MZ}" if last > first else ""
            )
            after = (
                f"rows of run {run} (snapshot {snap})" if run else "no rows (no earlier publish)"
            )
            output.row(parts, r.table_name, span, after)
    ui.table(tables)
    ui.table(parts)
    _show_stale_readers(ui, results)


def _show_stale_readers(ui: Ui, results: list[RollbackResult]) -> None:
    """The hours of other tables built from what the rollback undoes: due again after it."""
    readers = output.table("rolled back", "table that read it", "hours due again (UTC)")
    for r in results:
        for stale in r.stale_readers:
            spans = [
                f"{first:%Y-%m-%dT%H:%MZ}" + (f"..{last:%Y-%m-%dT%H:%MZ}" if last > first else "")
                for first, last in _consecutive(stale.hours)
            ]
            output.row(readers, r.table_name, stale.table_name, ", ".join(spans))
    if readers.row_count:
        ui.table(readers)


def _consecutive(hours: list[datetime]) -> list[tuple[datetime, datetime]]:
    out: list[tuple[datetime, datetime]] = []
    for h in sorted(hours):
        if out and out[-1][1] + timedelta(hours=1) == h:
            out[-1] = (out[-1][0], h)
        else:
            out.append((h, h))
    return out


def _hour_ranges(r: RollbackResult) -> list[tuple[datetime, datetime, str | None, int | None]]:
    """Consecutive hours restored to the same earlier publish (or to none), as ranges."""
    out: list[tuple[datetime, datetime, str | None, int | None]] = []
    for h in r.partitions:
        if (
            out
            and out[-1][1] + timedelta(hours=1) == h.hour
            and (out[-1][2], out[-1][3]) == (h.restored_run, h.restored_snapshot)
        ):
            out[-1] = (out[-1][0], h.hour, h.restored_run, h.restored_snapshot)
        else:
            out.append((h.hour, h.hour, h.restored_run, h.restored_snapshot))
    return out


def _asset_keys() -> dict[str, dg.AssetKey]:
    """Table (short name) -> the asset that materializes it."""
    from backfill_assets.defs.assets import current_asset_key, raw_asset_key, table_asset_key
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.spec import declared

    keys = {}
    for spec in SPECS:
        keys[spec.raw_table] = raw_asset_key(spec)
        keys[spec.current_table] = current_asset_key(spec)
    for t in declared.ordered(SPECS):
        keys[t.name] = table_asset_key(t.name)
    return keys


def _report_rollback(
    results: list[RollbackResult], *, what: str, backfill_id: str | None
) -> dict[str, Any]:
    """Record in the Dagster instance ($DAGSTER_HOME) what a rollback undid, per asset
    partition, so the UI stops presenting the undone materializations as the current data.

    * A partition an earlier publish covers again gets a runless ``AssetMaterialization``: the
      partition stays materialized (it has rows) and its latest materialization, the one the
      UI shows, now names the rollback, the run whose rows the table holds again and its
      snapshot, instead of the undone run. No asset here has an automation condition, so the
      event starts no run; downstream assets show as changed upstream, which they are.
    * A partition no publish covers any more gets an ``AssetObservation`` naming the rollback.
      Marking it missing would need ``DagsterInstance.wipe_asset_partitions``, which exists in
      dagster 1.13.27 but raises NotImplementedError on the SQL event log storages (SQLite,
      Postgres) this project runs on; a whole-asset wipe would erase every other partition's
      history. The gap sensor and ``backfill-assets gaps`` read the ledger, so they do list it.

    Never raises: the rollback has happened; a failure here is reported, not fatal.
    """
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return {
            "recorded": False,
            "reason": "DAGSTER_HOME is not set, so the rollback was not recorded in Dagster: "
            "its UI still shows the undone materializations as current. Set DAGSTER_HOME to "
            "the instance the runs used (the repository root for the demo) next time.",
        }
    counts = {"materializations": 0, "observations": 0}
    try:
        keys = _asset_keys()
        with dg.DagsterInstance.get() as instance:
            for r in results:
                key = keys.get(r.table_name.rsplit(".", 1)[-1])
                if key is not None:
                    _record_table(instance, key, r, what, backfill_id, counts)
    except Exception as exc:
        return {
            "recorded": False,
            "reason": f"the rollback is done, but recording it in the Dagster instance at "
            f"{home} failed ({type(exc).__name__}: {exc}); the UI still shows the undone "
            "materializations as current",
            **counts,
        }
    return {"recorded": True, "dagster_home": home, **counts}


def _record_table(
    instance: dg.DagsterInstance,
    key: dg.AssetKey,
    r: RollbackResult,
    what: str,
    backfill_id: str | None,
    counts: dict[str, int],
) -> None:
    """One table's part of :func:`_report_rollback`: an event per restored hour, counted in
    ``counts``."""
    base: dict[str, Any] = {
        "rollback_of": what,
        "table": r.table_name,
        "restored_snapshot": r.restored_snapshot,
        "snapshot_before_rollback": r.snapshot_before,
        "undone_runs": ", ".join([*r.undone_runs, *r.discarded_later_runs]),
    }
    if backfill_id:
        base["undone_backfill"] = backfill_id
    for h in r.partitions:
        partition = f"{h.hour:{PARTITION_FMT}}"
        if h.restored_run is not None:
            instance.report_runless_asset_event(
                dg.AssetMaterialization(
                    asset_key=key,
                    partition=partition,
                    description=f"rolled back ({what}): the table holds the rows "
                    f"of run {h.restored_run} again",
                    metadata={
                        **base,
                        "restored_run": dg.MetadataValue.dagster_run(h.restored_run),
                        "published_snapshot": h.restored_snapshot,
                    },
                )
            )
            counts["materializations"] += 1
        else:
            instance.report_runless_asset_event(
                dg.AssetObservation(
                    asset_key=key,
                    partition=partition,
                    description=f"rolled back ({what}): no rows for this hour any "
                    "more; no earlier publish covered it",
                    metadata={**base, "rows": "none since the rollback"},
                )
            )
            counts["observations"] += 1
