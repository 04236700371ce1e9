"""Table maintenance: one pass over one Iceberg table, each step optional.

Steps, in order (each is one or more atomic Iceberg commits; a step that fails leaves the table
as the previous step left it, and the pass goes on with the next step):

1. **Sync** the ledger (and audit rows of publishes older than the running grace) from main's
   history, so coverage never depends on snapshots that are about to expire.
2. **Drop branches** ``audit_*`` of runs that did not publish and have ended (a failure row in
   the audit table, or Dagster says the run finished), older than the branch retention; and
   leftovers of runs that did publish (their head is already on main). A branch whose run may
   still be running is kept; ``main`` and any non-``audit_*`` ref are never touched.
3. **Compact** small data files (``rewrite_data_files``, bin-pack) and manifests
   (``rewrite_manifests``) on main. Each is one ``replace`` commit that keeps the content; a
   run auditing on a branch meanwhile sees main moved through a commit that published nothing,
   so its publish rebases (:mod:`backfill_assets.lake.write.wap`) as for any other commit.
4. **Expire snapshots** older than the snapshot retention, keeping at least ``min_snapshots``
   of every branch, and always keeping main as it was before every publish finished within the
   retention (what :mod:`backfill_assets.lake.operations.rollback` restores) and the part of main
   every
   kept branch forked from (what a publish's rebase check walks). Rolling back an older
   publish fails with :class:`~backfill_assets.errors.RollbackError` naming the
   expired snapshot.
5. **Remove orphan files** older than the orphan retention (files of failed writes).

On a quarantine table, a step between 2 and 3 drops the raw key and value bytes of records
quarantined longer ago than ``BACKFILL_QUARANTINE_BYTES_DAYS`` (unset: kept for good), keeping
their record hash and byte lengths (one UPDATE commit; the bytes leave storage once the
snapshots still holding them expire in step 4).

The pass ends with one ``maintenance`` row in the audit table holding the report.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.table.refs import SnapshotRefType

from backfill_assets.errors import MaintenanceError
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.write import audit, wap
from backfill_assets.stack import catalog as catalog_mod
from backfill_assets.stack import spark as spark_mod
from backfill_assets.stack.settings import MaintenanceSettings, Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table
    from pyspark.sql import DataFrame, SparkSession

Progress = Callable[[str], None]
# run id -> True (still running), False (ended) or None (unknown to the caller)
RunActive = Callable[[str], bool | None]

STEPS = (
    "sync",
    "drop_branches",
    "quarantine_bytes",
    "compact",
    "expire_snapshots",
    "remove_orphans",
)
_FAILED_EVENTS = ("check_failed", "publish_refused", "run_failed")
# Bookkeeping tables hold the project's own records; nothing is published to them.
BOOKKEEPING = (audit.AUDIT_TABLE, ledger.LEDGER_TABLE)


@dataclass
class StepReport:
    """What one step did. ``skipped`` says why it did nothing on purpose."""

    ran: bool = False
    duration_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    items: list[str] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None


@dataclass
class MaintenanceReport:
    table: str
    started_at: datetime
    finished_at: datetime | None = None
    snapshot_before: int | None = None
    snapshot_after: int | None = None
    snapshots_before: int = 0
    snapshots_after: int = 0
    steps: dict[str, StepReport] = field(default_factory=lambda: {s: StepReport() for s in STEPS})

    @property
    def ok(self) -> bool:
        return not any(s.error for s in self.steps.values())

    def count(self, step: str, name: str) -> int:
        return self.steps[step].counts.get(name, 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: datetimes as ISO strings, snapshot ids as strings (JSON has no int64)."""
        return {
            "table": self.table,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "snapshot_before": str(self.snapshot_before) if self.snapshot_before else None,
            "snapshot_after": str(self.snapshot_after) if self.snapshot_after else None,
            "snapshots_before": self.snapshots_before,
            "snapshots_after": self.snapshots_after,
            "ok": self.ok,
            "steps": {name: asdict(step) for name, step in self.steps.items()},
        }

    def summary(self) -> str:
        """One line per step, for logs and the CLI."""
        lines = [f"maintenance of {self.table}:"]
        for name, step in self.steps.items():
            if step.error:
                state = f"FAILED: {step.error}"
            elif step.skipped:
                state = f"skipped ({step.skipped})"
            else:
                state = ", ".join(f"{k}={v}" for k, v in step.counts.items()) or "nothing to do"
            lines.append(f"  {name:<17} {step.duration_s:6.1f}s  {state}")
        return "\n".join(lines)


def maintain(
    spark: SparkSession,
    settings: Settings,
    table: str,
    *,
    options: MaintenanceSettings | None = None,
    run_active: RunActive | None = None,
    progress: Progress | None = None,
    run_id: str | None = None,
    launched_by: str | None = None,
    now: datetime | None = None,
) -> MaintenanceReport:
    """Run one maintenance pass over ``table`` (short or full name); see the module docstring.

    ``options`` default to ``settings.maintenance``. ``run_active(run_id)`` tells whether the
    run that owns an ``audit_*`` branch is still running (None: unknown); without it, a branch
    with no failure row is dropped only once its newest commit is older than both the branch
    retention and the running grace. Orphan retentions under 24 h are only safe when nothing
    writes to the table (the settings refuse them). Raises :class:`MaintenanceError` after the
    audit row is written if a step failed.
    """
    opts = options or settings.maintenance
    say = progress or (lambda _msg: None)
    name = catalog_mod.full_name(settings.catalog, table)
    namespace = settings.catalog.namespace
    cat = catalog_mod.load(settings.catalog)
    ident = name.split(".", 1)[1]
    try:
        tbl = cat.load_table(ident)
    except NoSuchTableError:
        raise MaintenanceError(
            f"table {name} does not exist; `backfill-assets audit` lists the tables the project "
            "has published"
        ) from None
    started = now or datetime.now(UTC)
    report = MaintenanceReport(name, started)
    report.snapshot_before = tbl.metadata.current_snapshot_id
    report.snapshots_before = len(tbl.metadata.snapshots)
    bookkeeping = name.rsplit(".", 1)[-1] in BOOKKEEPING
    ctx = _Pass(spark, cat, namespace, name, ident, opts, started, report, say, bookkeeping)
    try:
        with ctx.step("sync"):
            ctx.sync()
        with ctx.step("drop_branches", enabled=opts.drop_branches):
            ctx.drop_branches(run_active)
        with ctx.step("quarantine_bytes"):
            ctx.forget_quarantine_bytes()
        with ctx.step("compact", enabled=opts.compact):
            ctx.compact()
        with ctx.step("expire_snapshots", enabled=opts.expire_snapshots):
            ctx.expire()
        with ctx.step("remove_orphans", enabled=opts.remove_orphans):
            ctx.remove_orphans()
    finally:
        after = cat.load_table(ident)
        report.snapshot_after = after.metadata.current_snapshot_id
        report.snapshots_after = len(after.metadata.snapshots)
        report.finished_at = datetime.now(UTC)
        _audit(cat, namespace, report, run_id, launched_by)
    say(report.summary())
    if not report.ok:
        failed = [f"{n}: {s.error}" for n, s in report.steps.items() if s.error]
        raise MaintenanceError(
            f"maintenance of {name} failed in {len(failed)} step(s): {'; '.join(failed)}. The "
            "other steps ran; the table is consistent. Fix the cause and run maintenance again."
        )
    return report


@dataclass
class _Pass:
    spark: SparkSession
    catalog: Catalog
    namespace: str
    name: str  # catalog.namespace.table
    ident: str  # namespace.table
    opts: MaintenanceSettings
    now: datetime
    report: MaintenanceReport
    say: Progress
    bookkeeping: bool
    kept_branches: list[str] = field(default_factory=list)

    @contextmanager
    def step(self, name: str, enabled: bool = True) -> Iterator[None]:
        rep = self.report.steps[name]
        if not enabled:
            rep.skipped = "switched off in the settings"
            yield
            return
        self.say(f"{self.name}: {name} ...")
        t0 = time.monotonic()
        rep.ran = True
        try:
            yield
        except Exception as exc:
            rep.error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:400]}"
            self.say(f"{self.name}: {name} failed: {rep.error}")
        finally:
            rep.duration_s = round(time.monotonic() - t0, 3)

    def table(self) -> Table:
        return self.catalog.load_table(self.ident)

    def _rep(self, step: str) -> StepReport:
        return self.report.steps[step]

    def _procedure(self, procedure: str, older_than: int, *arguments: str) -> DataFrame:
        """``CALL <catalog>.system.<procedure>`` on this table for what is older than
        ``older_than`` (epoch ms), with the procedure's other ``arguments`` (``name => value``)."""
        cat_name = self.name.split(".", 1)[0]
        named = [
            f"table => '{self.name}'",
            f"older_than => TIMESTAMP '{_sql_timestamp(older_than)}'",
            *arguments,
        ]
        return self.spark.sql(f"CALL {cat_name}.system.{procedure}({', '.join(named)})")

    # 1. sync -------------------------------------------------------------------------------
    def sync(self) -> None:
        rep = self._rep("sync")
        if self.bookkeeping:
            rep.skipped = "bookkeeping table: nothing is published to it"
            return
        rep.counts["ledger_publishes_added"] = len(
            ledger.sync_from_history(self.catalog, self.namespace, self.name)
        )
        # A run writes its audit row right after its fast-forward: a publish older than the
        # running grace without one belongs to a run that died in between.
        tbl = self.table()
        horizon = _ms(self.now - self.opts.running_grace)
        since = next(
            (
                s.snapshot_id
                for s in _ancestors(tbl, tbl.metadata.current_snapshot_id)
                if s.timestamp_ms < horizon
            ),
            None,
        )
        added = (
            audit.record_unaudited_publishes(
                self.catalog, self.namespace, self.name, since=since, recorded_by="maintenance"
            )
            if since is not None
            else []
        )
        rep.counts["audit_publishes_added"] = len(added)

    # 2. branches ---------------------------------------------------------------------------
    def drop_branches(self, run_active: RunActive | None) -> None:
        rep = self._rep("drop_branches")
        tbl = self.table()
        refs = {
            n: r
            for n, r in tbl.metadata.refs.items()
            if r.snapshot_ref_type == SnapshotRefType.BRANCH
        }
        candidates = sorted(n for n in refs if n.startswith("audit_") and n != "main")
        self.kept_branches = sorted(n for n in refs if n != "main" and n not in candidates)
        if not candidates:
            return
        rows = audit.query(self.catalog, self.namespace, table_name=self.name)
        main_line = {s.snapshot_id for s in _ancestors(tbl, tbl.metadata.current_snapshot_id)}
        dropped: list[str] = []
        kept: dict[str, str] = {}
        for branch in candidates:
            head = refs[branch].snapshot_id
            mine = [r for r in rows if r["run_id"] and _owns(r["run_id"], branch)]
            run_id = mine[0]["run_id"] if mine else _run_id(branch)
            published = any(r["event"] == "publish" and r["outcome"] == "succeeded" for r in mine)
            failed = [r for r in mine if r["event"] in _FAILED_EVENTS]
            status = run_active(run_id) if run_active is not None else None
            own_commits = head not in main_line
            if status is True:
                reason = "its run is still running"
            elif published and not own_commits:
                reason = ""  # a published leftover: everything it holds is on main
            elif failed or status is False:
                # Age from the failure row, else from the branch's newest commit.
                ended = (
                    max(r["finished_at"] for r in failed) if failed else _snapshot_time(tbl, head)
                )
                old = self.now - ended >= self.opts.branch_retention
                reason = "" if old else "younger than the branch retention"
            elif not own_commits:
                reason = "its run may still be running (no commit on the branch yet)"
            else:
                age = self.now - _snapshot_time(tbl, head)
                old = age >= max(self.opts.branch_retention, self.opts.running_grace)
                reason = "" if old else "its run may still be running (no outcome recorded)"
            if reason:
                kept[branch] = reason
                continue
            wap.drop_branch(self.name, branch)
            dropped.append(branch)
            self.say(f"{self.name}: dropped branch {branch} (run {run_id})")
        self.kept_branches += sorted(kept)
        rep.counts["dropped"] = len(dropped)
        rep.counts["kept"] = len(kept)
        rep.items = dropped + [f"kept {b}: {why}" for b, why in sorted(kept.items())]

    # quarantine bytes ----------------------------------------------------------------------
    def forget_quarantine_bytes(self) -> None:
        """On a quarantine table: drop the raw key and value of records quarantined (by Kafka
        hour) longer ago than the retention, keeping their hash and lengths. One Iceberg
        commit (an UPDATE on main); older snapshots hold the bytes until they expire."""
        rep = self._rep("quarantine_bytes")
        keep = self.opts.quarantine_bytes_retention
        names = {f.name for f in self.table().schema().fields}
        if not {"reason", "kafka_value", "key_bytes", "value_bytes"} <= names:
            rep.skipped = "not a quarantine table"
            return
        if keep is None:
            rep.skipped = "BACKFILL_QUARANTINE_BYTES_DAYS is unset: raw bytes are kept"
            return
        cutoff = (self.now - keep).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        where = (
            f"kafka_hour < TIMESTAMP '{cutoff}' "
            "AND (kafka_key IS NOT NULL OR kafka_value IS NOT NULL)"
        )
        row = self.spark.sql(f"SELECT count(*) FROM {self.name} WHERE {where}").first()
        count = int(row[0]) if row is not None else 0
        if count:
            self.spark.sql(
                f"UPDATE {self.name} SET key_bytes = length(kafka_key), "
                "value_bytes = length(kafka_value), kafka_key = NULL, kafka_value = NULL "
                f"WHERE {where}"
            )
        rep.counts["records_bytes_dropped"] = count

    # 3. compaction -------------------------------------------------------------------------
    def compact(self) -> None:
        rep = self._rep("compact")
        if self.table().metadata.current_snapshot_id is None:
            rep.skipped = "no snapshot on main"
            return
        cat_name = self.name.split(".", 1)[0]
        target = self.opts.target_file_bytes
        try:
            row = self.spark.sql(
                f"CALL {cat_name}.system.rewrite_data_files(table => '{self.name}', "
                "strategy => 'binpack', options => map("
                f"'target-file-size-bytes', '{target}', 'min-input-files', '2', "
                "'partial-progress.enabled', 'false'))"
            ).first()
        except Exception as exc:
            if not _concurrent(exc):
                raise
            # A publish replaced some of the files being rewritten: nothing was committed.
            rep.skipped = "a concurrent commit replaced files being compacted; next pass"
            return
        if row is not None:
            rep.counts["data_files_rewritten"] = int(row["rewritten_data_files_count"])
            rep.counts["data_files_added"] = int(row["added_data_files_count"])
            rep.counts["bytes_rewritten"] = int(row["rewritten_bytes_count"])
        mrow = self.spark.sql(
            f"CALL {cat_name}.system.rewrite_manifests(table => '{self.name}')"
        ).first()
        if mrow is not None:
            rep.counts["manifests_rewritten"] = int(mrow["rewritten_manifests_count"])
            rep.counts["manifests_added"] = int(mrow["added_manifests_count"])

    # 4. snapshot expiry --------------------------------------------------------------------
    def expire(self) -> None:
        rep = self._rep("expire_snapshots")
        tbl = self.table()
        if not tbl.metadata.snapshots:
            rep.skipped = "no snapshots"
            return
        cutoff = _ms(self.now - self.opts.snapshot_retention)
        older_than = min(cutoff, _ms(datetime.now(UTC)))
        protected: dict[int, str] = {}
        # Rollback: main before every publish finished within the retention.
        if not self.bookkeeping:
            horizon = self.now - self.opts.snapshot_retention
            for row in audit.query(self.catalog, self.namespace, table_name=self.name):
                if (
                    row["event"] == "publish"
                    and row["outcome"] == "succeeded"
                    and row["finished_at"] >= horizon
                    and row["snapshot_before"] is not None
                ):
                    protected[int(row["snapshot_before"])] = f"rollback of run {row['run_id']}"
        # Kept branches: main from where each forked (a publish's rebase check walks it).
        main_line = {s.snapshot_id for s in _ancestors(tbl, tbl.metadata.current_snapshot_id)}
        for branch in self.kept_branches:
            ref = tbl.metadata.refs.get(branch)
            if ref is None:
                continue
            fork = next(
                (
                    s.snapshot_id
                    for s in _ancestors(tbl, ref.snapshot_id)
                    if s.snapshot_id in main_line
                ),
                None,
            )
            if fork is not None:
                protected[fork] = f"base of branch {branch}"
        for snap_id in protected:
            snap = tbl.metadata.snapshot_by_id(snap_id)
            if snap is not None and snap.snapshot_id in main_line:
                older_than = min(older_than, snap.timestamp_ms)
        before = {s.snapshot_id for s in tbl.metadata.snapshots}
        done = self._procedure(
            "expire_snapshots", older_than, f"retain_last => {max(1, self.opts.min_snapshots)}"
        ).first()
        after = {s.snapshot_id for s in self.table().metadata.snapshots}
        expired = sorted(before - after)
        rep.counts["snapshots_expired"] = len(expired)
        rep.counts["protected"] = len([p for p in protected if p in after])
        if done is not None:
            rep.counts["data_files_deleted"] = int(done["deleted_data_files_count"])
            rep.counts["manifest_files_deleted"] = int(done["deleted_manifest_files_count"])
            rep.counts["manifest_lists_deleted"] = int(done["deleted_manifest_lists_count"])
        rep.items = [f"expired older than {_sql_timestamp(older_than)} UTC"] + [
            f"kept {sid}: {why}" for sid, why in sorted(protected.items()) if sid in after
        ]

    # 5. orphan files -----------------------------------------------------------------------
    def remove_orphans(self) -> None:
        rep = self._rep("remove_orphans")
        older_than = _ms(min(self.now, datetime.now(UTC)) - self.opts.orphan_retention)
        if spark_mod.is_connect(self.spark):
            removed = self._remove_orphans_procedure(older_than)
        else:
            removed = self._remove_orphans_action(older_than)
        rep.counts["orphan_files_removed"] = len(removed)
        rep.items = removed[:50]

    def _remove_orphans_procedure(self, older_than: int) -> list[str]:
        """Over Spark Connect (no JVM handle in the client): the ``remove_orphan_files``
        procedure, which refuses retentions under 24 h (as the settings do; only a caller
        passing shorter options to a quiet table gets that error)."""
        rows = self._procedure("remove_orphan_files", older_than).collect()
        return [str(r["orphan_file_location"]) for r in rows]

    def _remove_orphans_action(self, older_than: int) -> list[str]:
        """In-process Spark: Iceberg's Action API, which takes any retention (tests with a
        quiet table use shorter ones than the procedure allows)."""
        jvm = self.spark.sparkContext._jvm
        assert jvm is not None
        jtable = jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(
            self.spark._jsparkSession, self.name
        )
        action = jvm.org.apache.iceberg.spark.actions.SparkActions.get(
            self.spark._jsparkSession
        ).deleteOrphanFiles(jtable)
        result = action.olderThan(older_than).execute()
        return [str(p) for p in result.orphanFileLocations()]


def _audit(
    cat: Catalog,
    namespace: str,
    report: MaintenanceReport,
    run_id: str | None,
    launched_by: str | None,
) -> None:
    steps = {
        name: (
            {"error": s.error}
            if s.error
            else {"skipped": s.skipped}
            if s.skipped
            else {**s.counts, "duration_s": s.duration_s}
        )
        for name, s in report.steps.items()
    }
    audit.append(
        cat,
        namespace,
        audit.AuditRecord(
            event="maintenance",
            outcome="succeeded" if report.ok else "failed",
            table_name=report.table,
            run_id=run_id,
            launched_by=launched_by,
            snapshot_before=report.snapshot_before,
            snapshot_after=report.snapshot_after,
            started_at=report.started_at,
            detail=json.dumps(steps, sort_keys=True, separators=(",", ":")),
        ),
    )


def _ancestors(tbl: Table, snapshot_id: int | None) -> Iterator[Any]:
    """``snapshot_id`` and its ancestors still in the table's metadata, newest first."""
    snap = tbl.metadata.snapshot_by_id(snapshot_id) if snapshot_id is not None else None
    while snap is not None:
        yield snap
        parent = snap.parent_snapshot_id
        snap = tbl.metadata.snapshot_by_id(parent) if parent is not None else None


def _snapshot_time(tbl: Table, snapshot_id: int) -> datetime:
    snap = tbl.metadata.snapshot_by_id(snapshot_id)
    ms = snap.timestamp_ms if snap is not None else 0
    return datetime.fromtimestamp(ms / 1000, UTC)


def _owns(run_id: str, branch: str) -> bool:
    """Whether ``branch`` is one of ``run_id``'s branches (any rebase attempt)."""
    base = wap.branch_name(run_id)
    return branch == base or re.fullmatch(re.escape(base) + r"_r\d+", branch) is not None


def _run_id(branch: str) -> str:
    """The run id a branch name was made from (Dagster run ids are UUIDs: ``-`` became ``_``)."""
    rest = re.sub(r"_r\d+$", "", branch.removeprefix("audit_"))
    return rest.replace("_", "-")


def _concurrent(exc: BaseException) -> bool:
    text = str(exc)
    return any(
        marker in text
        for marker in (
            "ValidationException",
            "CommitFailedException",
            "refresh is required",
            "Cannot commit",
            "found conflicting",
            "Missing required files",
        )
    )


def _ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def _sql_timestamp(epoch_ms: int) -> str:
    """``epoch_ms`` as the UTC text of a Spark SQL ``TIMESTAMP`` literal."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
