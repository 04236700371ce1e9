"""Write-audit-publish on Iceberg branches, shared by every table the project writes.

* :func:`open_branch` records main's snapshot and creates (or resets) a branch unique to the
  run. Nothing readers see changes.
* Writers commit to ``<table>.branch_<name>``; checks read the same identifier.
* :func:`publish` makes one empty commit on the branch whose snapshot summary carries the
  audit (run id, offsets, check outcomes), then fast-forwards main to it. The fast-forward is a
  single catalog commit: readers see the old main or the whole audited change, never a part.
* If main moved after :func:`open_branch`, :func:`publish` looks at what was published in
  between: when every intervening publish covered hours disjoint from this run's, it raises
  :class:`MainMoved` and the caller rebases (a new branch from main, the same rows re-applied,
  the checks re-run) and publishes again; when one overlaps, it raises :class:`PublishError`
  naming that run. Main is unchanged in both cases.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from pyiceberg.table.refs import SnapshotRefType
from pyiceberg.table.snapshots import ancestors_of

from backfill_assets.errors import MainMoved, PublishError
from backfill_assets.lake.offsets.ledger import SUMMARY_PREFIX
from backfill_assets.stack import catalog as catalog_mod
from backfill_assets.stack.catalog import lost_race, retry_commit
from backfill_assets.stack.faults import failpoint
from backfill_assets.stack.settings import CatalogSettings, Settings

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table
    from pyspark.sql import DataFrame, DataFrameWriterV2, SparkSession


@dataclass(frozen=True)
class Branch:
    table: str  # catalog.namespace.table
    name: str
    main_before: int | None

    @property
    def ident(self) -> str:
        """The Spark identifier that reads and writes the branch."""
        return f"{self.table}.branch_{self.name}"


def hour_writer(
    rows: DataFrame, ident: str, summary: Mapping[str, str] | None = None
) -> DataFrameWriterV2:
    """A writer of ``rows`` to the hour-partitioned table (or branch) ``ident``, with the run's
    ``summary`` as snapshot properties (``backfill.<key>``).

    Each task's rows are sorted by hour before they are written (Iceberg's clustered writer: one
    open data file at a time), not spread over one open Parquet writer per hour the task holds
    (the fanout writer, Iceberg's default): a small result is one task, and the buffers of a
    672-hour run's writers outgrew a 2 GB driver. The write is still one commit."""
    writer = rows.writeTo(ident).option("fanout-enabled", "false")
    for key, value in (summary or {}).items():
        writer = writer.option(f"snapshot-property.{SUMMARY_PREFIX}{key}", value)
    return writer


def branch_name(run_id: str, attempt: int = 0) -> str:
    name = "audit_" + run_id.replace("-", "_")
    return name if attempt == 0 else f"{name}_r{attempt}"


def open_branch(spark: SparkSession, table: str, run_id: str, attempt: int = 0) -> Branch:
    """Create (or reset) the run's branch from main's current snapshot.

    A table that has never been published first gets an empty snapshot on main, so every
    publish has a real "before" snapshot that a rollback can return to.
    """
    main_before = ref_snapshot_id(spark, table, "main")
    if main_before is None:
        _empty_commit(table, "main", {SUMMARY_PREFIX + "init": "true"}, only_if_absent=True)
        main_before = ref_snapshot_id(spark, table, "main")
    assert main_before is not None  # the init commit made one
    name = branch_name(run_id, attempt)
    set_branch(table, name, main_before)
    failpoint("branch_opened")
    return Branch(table, name, main_before)


def publish(
    spark: SparkSession,
    branch: Branch,
    summary: dict[str, str],
    window: tuple[datetime, datetime] | None = None,
) -> int:
    """Record ``summary`` (keys get the ``backfill.`` prefix) and fast-forward main.

    Returns the snapshot id main now points at. On :class:`PublishError` main is unchanged and
    the branch is kept for inspection; on success the branch is dropped (its snapshots stay in
    main's history).
    """
    props = {SUMMARY_PREFIX + key: value for key, value in summary.items()}
    props[SUMMARY_PREFIX + "published"] = "true"
    main_now = ref_snapshot_id(spark, branch.table, "main")
    if main_now != branch.main_before:
        _moved(spark, branch, main_now, window)
    _empty_commit(branch.table, branch.name, props)
    failpoint("branch_committed")
    try:
        fast_forward(branch.table, branch.name, main_now)
    except Exception as exc:  # the catalog commit did not happen
        # Another run may have fast-forwarded main between the check above and this commit
        # (the commit's precondition is main at main_now): judge that run's window.
        moved_to = ref_snapshot_id(spark, branch.table, "main")
        if moved_to not in (main_now, branch.main_before):
            _moved(spark, branch, moved_to, window)
        raise PublishError(
            f"could not fast-forward main of {branch.table} to branch {branch.name!r}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. "
            "Main is unchanged; re-run the backfill."
        ) from exc
    failpoint("main_fast_forwarded")
    published = ref_snapshot_id(spark, branch.table, "main")
    assert published is not None
    # Housekeeping must never fail a done publish: a branch left here is a published one, which
    # the next publish on the table drops (drop_published_leftovers).
    with contextlib.suppress(Exception):
        drop_branch(branch.table, branch.name)
    with contextlib.suppress(Exception):
        drop_published_leftovers(spark, branch.table)
    return published


def set_branch(table: str, name: str, snapshot_id: int) -> None:
    """Point branch ``name`` of ``table`` at ``snapshot_id``, creating it or moving it: one
    catalog commit through pyiceberg (no Spark request), whose precondition is the branch as
    loaded. A commit that lost a race with another writer is retried on fresh metadata."""

    def commit(_attempt: int) -> None:
        _iceberg_table(table).manage_snapshots().create_branch(snapshot_id, name).commit()

    retry_commit(commit, attempts=10, backoff_s=0.05)


def drop_branch(table: str, name: str) -> None:
    """Remove branch ``name`` of ``table`` if it exists: one catalog commit (pyiceberg), retried
    on fresh metadata when another writer committed first. Its snapshots that main holds stay."""

    def commit(_attempt: int) -> None:
        tbl = _iceberg_table(table)
        if name in tbl.metadata.refs:
            tbl.manage_snapshots().remove_branch(name).commit()

    retry_commit(commit, attempts=10, backoff_s=0.05)


def fast_forward(table: str, branch: str, main_expected: int | None) -> None:
    """Move main of ``table`` to the head of ``branch``: one catalog commit (pyiceberg) whose
    precondition is main at ``main_expected``, so it applies only to the main the caller
    judged. Raises :class:`MainMoved` if main is elsewhere, and :class:`PublishError` if the
    branch does not descend from main (a fast-forward it would not be); a commit that lost a
    race with a writer of another ref is retried while main is still ``main_expected``."""

    def commit(_attempt: int) -> None:
        tbl = _iceberg_table(table)
        meta = tbl.metadata
        main = meta.refs.get("main")
        if (None if main is None else main.snapshot_id) != main_expected:
            raise MainMoved(f"main of {table} is no longer snapshot {main_expected}")
        head_ref = meta.refs.get(branch)
        head = None if head_ref is None else meta.snapshot_by_id(head_ref.snapshot_id)
        if head is None:
            raise PublishError(f"{table} has no branch {branch!r} to publish")
        if main_expected is not None and main_expected not in {
            s.snapshot_id for s in ancestors_of(head, meta)
        }:
            raise PublishError(f"branch {branch!r} of {table} does not descend from main")
        tbl.manage_snapshots().set_current_snapshot(ref_name=branch).commit()

    retry_commit(commit, attempts=10, backoff_s=0.05)


def _moved(
    spark: SparkSession,
    branch: Branch,
    main_now: int | None,
    window: tuple[datetime, datetime] | None,
) -> None:
    """Raise :class:`MainMoved` if every publish since the branch was opened is disjoint from
    ``window``, else :class:`PublishError` naming the run that overlapped."""
    rows = spark.sql(
        f"SELECT snapshot_id, parent_id, summary FROM {branch.table}.snapshots"
    ).collect()
    parents = {int(r["snapshot_id"]): r["parent_id"] for r in rows}
    summaries = {int(r["snapshot_id"]): dict(r["summary"] or {}) for r in rows}
    between = []
    snap = main_now
    while snap is not None and snap != branch.main_before:
        between.append(snap)
        parent = parents.get(snap)
        snap = int(parent) if parent is not None else None
    if snap != branch.main_before:
        raise PublishError(
            f"main of {branch.table} moved from snapshot {branch.main_before} to {main_now}, "
            "which does not descend from it (a rollback ran while this run was auditing). "
            f"Nothing was published; branch {branch.name!r} is kept. Re-run the backfill."
        )
    others = []
    for snap_id in between:
        props = summaries.get(snap_id, {})
        if props.get(SUMMARY_PREFIX + "published") != "true":
            continue
        start_s, _, end_s = (props.get(SUMMARY_PREFIX + "window") or "").partition("/")
        run = props.get(SUMMARY_PREFIX + "run-id") or "?"
        if window is None or not start_s or not end_s:
            overlaps = True
        else:
            s0, e0 = datetime.fromisoformat(start_s), datetime.fromisoformat(end_s)
            overlaps = s0 < window[1] and window[0] < e0
        if overlaps:
            span = f"{start_s}..{end_s}" if start_s else "an unknown window"
            raise PublishError(
                f"main of {branch.table} moved while this run was auditing: run {run} "
                f"published {span}, which overlaps this run's window. Nothing was published; "
                f"branch {branch.name!r} is kept. Re-run the backfill once run {run} is "
                "what you want to replace."
            )
        others.append(run)
    raise MainMoved(
        f"main of {branch.table} moved from {branch.main_before} to {main_now} through "
        f"publishes of disjoint windows (runs {', '.join(others) or 'none'}); rebasing"
    )


def drop_published_leftovers(spark: SparkSession, table: str) -> list[str]:
    """Drop the branches of runs that died right after fast-forwarding main (before dropping
    their branch): the head is the run's own published snapshot, already in main's history,
    so the branch holds nothing main does not. Returns the names dropped.

    Every other leftover is kept: a branch whose run died before publishing looks exactly like
    the branch of a run still at work, and a failed run's branch is kept for inspection. The
    refs and summaries are read by pyiceberg from the catalog's current metadata (no Spark
    query: a Connect round trip per metadata table); each drop is its own ref commit.
    """
    meta = _iceberg_table(table).metadata
    main = meta.refs.get("main")
    if main is None:
        return []
    head = meta.snapshot_by_id(main.snapshot_id)
    on_main = {s.snapshot_id for s in ancestors_of(head, meta)}
    dropped = []
    for name, ref in meta.refs.items():
        if name == "main" or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            continue
        snap = meta.snapshot_by_id(ref.snapshot_id)
        summary = snap.summary if snap is not None else None
        run_id = summary[f"{SUMMARY_PREFIX}run-id"] if summary is not None else None
        published = summary[f"{SUMMARY_PREFIX}published"] if summary is not None else None
        own = run_id is not None and name.startswith(branch_name(run_id))
        if own and published == "true" and ref.snapshot_id in on_main:
            drop_branch(table, name)
            dropped.append(name)
    return dropped


def pending_quarantine(
    qtable: str, table: str
) -> list[tuple[Branch, str, tuple[datetime, datetime], dict[str, str]]]:
    """The branches of quarantine table ``qtable`` whose run published its rows on ``table``'s
    main but not its quarantine (the process died between the two commits): (branch, run id,
    window, the run's summary without the prefix). Read by pyiceberg from the catalog."""
    meta = _iceberg_table(table).metadata
    main = meta.refs.get("main")
    if main is None:
        return []
    head = meta.snapshot_by_id(main.snapshot_id)
    published = {
        s.summary[f"{SUMMARY_PREFIX}run-id"]
        for s in ancestors_of(head, meta)
        if s.summary is not None and s.summary[f"{SUMMARY_PREFIX}published"] == "true"
    }
    qmeta = _iceberg_table(qtable).metadata
    qmain = qmeta.refs.get("main")
    out = []
    for name, ref in qmeta.refs.items():
        if name == "main" or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            continue
        snap = qmeta.snapshot_by_id(ref.snapshot_id)
        props = dict(snap.summary.additional_properties) if snap and snap.summary else {}
        run_id = props.get(f"{SUMMARY_PREFIX}run-id")
        start_s, _, end_s = (props.get(f"{SUMMARY_PREFIX}window") or "").partition("/")
        if run_id is None or run_id not in published or not end_s:
            continue
        if not name.startswith(branch_name(run_id)):
            continue
        summary = {
            k.removeprefix(SUMMARY_PREFIX): v
            for k, v in props.items()
            if k.startswith(SUMMARY_PREFIX) and k != f"{SUMMARY_PREFIX}published"
        }
        window = (datetime.fromisoformat(start_s), datetime.fromisoformat(end_s))
        before = qmain.snapshot_id if qmain is not None else None
        out.append((Branch(qtable, name, before), run_id, window, summary))
    return out


def ref_snapshot_id(spark: SparkSession, table: str, ref: str) -> int | None:
    """The snapshot ``ref`` of ``table`` points at now (None if there is no such ref), from
    the table's current metadata in the catalog (read by pyiceberg: no Spark planning, which
    a query of the ``refs`` metadata table costs a fresh process, ~0.2 s, and no JVM call, so
    a Spark Connect session works as a classic one)."""
    found = _iceberg_table(table).metadata.refs.get(ref)
    return None if found is None else int(found.snapshot_id)


def ref_snapshot(spark: SparkSession, table: str, ref: str) -> tuple[int, int] | None:
    """(snapshot id, sequence number) of the snapshot ``ref`` of ``table`` points at now, None
    if there is no such table or the table has no such ref (pyiceberg: no Spark question)."""
    loaded = iceberg_table(table)
    if loaded is None:
        return None
    meta = loaded.metadata
    found = meta.refs.get(ref)
    if found is None:
        return None
    snap = meta.snapshot_by_id(found.snapshot_id)
    assert snap is not None
    return int(found.snapshot_id), int(snap.sequence_number or 0)


def ref_summary(table: str, ref: str) -> dict[str, str]:
    """The summary of the snapshot ``ref`` of ``table`` points at now, as Spark's
    ``snapshots`` metadata table shows it (without the operation; empty if there is no such
    ref), read by pyiceberg from the catalog's current metadata."""
    meta = _iceberg_table(table).metadata
    found = meta.refs.get(ref)
    snap = None if found is None else meta.snapshot_by_id(found.snapshot_id)
    if snap is None or snap.summary is None:
        return {}
    return {str(k): str(v) for k, v in snap.summary.additional_properties.items()}


def committed_by(table: str, ref: str, since: int | None, run_id: str) -> bool:
    """Whether a snapshot of ``ref``'s ancestry after snapshot ``since`` (None: all of it)
    records ``run_id`` in its summary (pyiceberg: the catalog's current metadata)."""
    meta = _iceberg_table(table).metadata
    found = meta.refs.get(ref)
    snap_id = None if found is None else found.snapshot_id
    key = f"{SUMMARY_PREFIX}run-id"
    while snap_id is not None and snap_id != since:
        snap = meta.snapshot_by_id(snap_id)
        if snap is None:  # expired: nothing older is known
            return False
        if snap.summary is not None and snap.summary.get(key) == run_id:
            return True
        snap_id = snap.parent_snapshot_id
    return False


def main_summary(spark: SparkSession, table: str) -> dict[str, str]:
    """The snapshot summary of main's current snapshot (empty if the table has none)."""
    snap = ref_snapshot_id(spark, table, "main")
    if snap is None:
        return {}
    row = spark.sql(f"SELECT summary FROM {table}.snapshots WHERE snapshot_id = {snap}").first()
    return dict(row[0]) if row is not None else {}


def _empty_commit(
    table: str, ref: str, properties: dict[str, str], only_if_absent: bool = False
) -> None:
    """One snapshot without data files on branch ``ref`` whose summary carries
    ``properties``: an atomic catalog commit through pyiceberg (the same catalog Spark
    writes through). A commit refused because another writer committed to the table first
    (its own branch, say) is retried on the fresh metadata; with ``only_if_absent`` nothing is
    committed once ``ref`` exists (another run made the init commit)."""

    def commit(_attempt: int) -> None:
        tbl = _iceberg_table(table)
        if only_if_absent and ref in tbl.metadata.refs:
            return
        empty = tbl.schema().as_arrow().empty_table()
        tbl.append(empty, snapshot_properties=properties, branch=ref)

    # pyiceberg's SQL catalog applies the snapshot to the catalog's current metadata: another
    # run's commit (to its own branch) since the load surfaces as a sequence number older than
    # the table's last one, refused before anything was written.
    retry_commit(
        commit,
        attempts=10,
        backoff_s=0.05,
        conflict=lambda exc: (
            lost_race(exc) or (isinstance(exc, ValueError) and "sequence number" in str(exc))
        ),
    )


def _iceberg_table(table: str) -> Table:
    """``catalog.namespace.table`` (Spark's name) loaded by pyiceberg from the catalog of the
    process's settings: always the catalog's current metadata."""
    settings = Settings.from_env()
    return _catalog(settings.catalog).load_table(table.split(".", 1)[1])


def iceberg_table(table: str) -> Table | None:
    """:func:`_iceberg_table`, None if the catalog has no such table: where Spark's
    ``catalog.tableExists`` would cost a Spark Connect round trip."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return _iceberg_table(table)
    except (NoSuchTableError, NoSuchNamespaceError):
        return None


@functools.lru_cache(maxsize=4)
def _catalog(cfg: CatalogSettings) -> Catalog:
    return catalog_mod.load(cfg)
