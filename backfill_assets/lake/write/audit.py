"""The audit trail: one Iceberg table recording every publish, refusal, failure and rollback.

Rows are appended with pyiceberg (no Spark needed, so the CLI can write and read it quickly).
Each append is one atomic Iceberg commit; a commit that loses a race with another writer is
retried on the refreshed table, so concurrent runs never overwrite each other's rows. Nothing
secret is ever written here: only table names, run ids, offsets, snapshot ids and check names.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog

from backfill_assets.errors import BackfillError
from backfill_assets.stack.catalog import CatalogClient, retry_commit

AUDIT_TABLE = "backfill_audit"
EVENTS = (
    "publish",
    "check_failed",
    "publish_refused",
    "run_failed",
    "rollback",
    "archive",
    "maintenance",
)

_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        pa.field("audit_id", pa.string(), nullable=False),
        pa.field("event", pa.string(), nullable=False),
        pa.field("table_name", pa.string(), nullable=False),
        pa.field("run_id", pa.string()),
        pa.field("backfill_id", pa.string()),
        pa.field("launched_by", pa.string()),
        pa.field("window_start", _TS),
        pa.field("window_end", _TS),
        pa.field("offsets", pa.string()),
        pa.field("snapshot_before", pa.int64()),
        pa.field("snapshot_after", pa.int64()),
        pa.field("checks", pa.string()),
        pa.field("outcome", pa.string(), nullable=False),
        pa.field("started_at", _TS),
        pa.field("finished_at", _TS, nullable=False),
        pa.field("records_read", pa.int64()),
        pa.field("rows_written", pa.int64()),
        pa.field("detail", pa.string()),
    ]
)


@dataclass
class AuditRecord:
    event: str
    table_name: str
    outcome: str
    run_id: str | None = None
    backfill_id: str | None = None
    launched_by: str | None = None
    window_start: datetime | None = None
    window_end: datetime | None = None
    offsets: str | None = None
    snapshot_before: int | None = None
    snapshot_after: int | None = None
    checks: str | None = None
    started_at: datetime | None = None
    finished_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    records_read: int | None = None
    rows_written: int | None = None
    detail: str | None = None
    audit_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise BackfillError(f"unknown audit event {self.event!r}; allowed: {', '.join(EVENTS)}")


def launched_by(tags: dict[str, str]) -> str:
    """Who or what started a run, from its Dagster tags."""
    if "backfill_assets/launched_by" in tags:
        return tags["backfill_assets/launched_by"]
    if "dagster/sensor_name" in tags:
        return f"sensor:{tags['dagster/sensor_name']}"
    if "dagster/schedule_name" in tags:
        return f"schedule:{tags['dagster/schedule_name']}"
    if "dagster/backfill" in tags:
        return "backfill (Dagster UI or API)"
    return "manual run"


def append(catalog: Catalog, namespace: str, record: AuditRecord, attempts: int = 5) -> None:
    """Append one row (one atomic commit), retrying when another writer committed first."""
    ident = f"{namespace}.{AUDIT_TABLE}"
    catalog.create_namespace_if_not_exists(namespace)
    table = catalog.create_table_if_not_exists(ident, schema=SCHEMA)
    row = pa.Table.from_pylist([asdict(record)], schema=SCHEMA)
    retry_commit(
        lambda attempt: (table if attempt == 0 else catalog.load_table(ident)).append(row),
        attempts=attempts,
        backoff_s=0.2,
    )


def record(
    tables: CatalogClient, event: str, outcome: str, fields: dict[str, Any], **extra: Any
) -> None:
    """Append one row of ``event`` with ``outcome`` to the audit table of ``tables``' catalog:
    ``fields`` are the run's columns (table, run, window, ...), ``extra`` the event's own."""
    append(
        tables.catalog(),
        tables.settings.catalog.namespace,
        AuditRecord(event=event, outcome=outcome, **fields, **extra),
    )


def query(
    catalog: Catalog,
    namespace: str,
    *,
    table_name: str | None = None,
    run_id: str | None = None,
    backfill_id: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Audit rows matching the filters, newest first."""
    ident = f"{namespace}.{AUDIT_TABLE}"
    if not catalog.table_exists(ident):
        return []
    clauses = []
    for column, value in (
        ("table_name", table_name),
        ("run_id", run_id),
        ("backfill_id", backfill_id),
    ):
        if value:
            if "'" in value:
                raise BackfillError(f"{column} must not contain a quote: {value!r}")
            clauses.append(f"{column} == '{value}'")
    table = catalog.load_table(ident)
    scan = table.scan(row_filter=" AND ".join(clauses)) if clauses else table.scan()
    rows = sorted(scan.to_arrow().to_pylist(), key=lambda r: r["finished_at"], reverse=True)
    return rows[:limit] if limit else rows


def checks_json(results: dict[str, bool]) -> str:
    return json.dumps(
        {name: "passed" if ok else "failed" for name, ok in results.items()}, sort_keys=True
    )


def record_unaudited_publishes(
    catalog: Catalog, namespace: str, table_name: str, *, since: int | None, recorded_by: str
) -> list[str]:
    """Append a ``publish`` row for every publish in main's history up to snapshot ``since``
    that has none; return the run ids recorded.

    A run killed between its fast-forward and its audit row (kill -9, a lost node) published
    with no row, so ``rollback --run`` could not find it. The next run to publish on the table
    calls this with its own branch's base snapshot: publishes that old finished long before
    (a live run writes its row right after its fast-forward), so a row still missing means the
    run died. Main's snapshot summaries carry everything the row needs.
    """
    from backfill_assets.lake.offsets.ledger import SUMMARY_PREFIX

    ident = table_name.split(".", 1)[1] if table_name.count(".") >= 2 else table_name
    table = catalog.load_table(ident)
    chain = []
    snap = table.metadata.snapshot_by_id(since) if since is not None else None
    while snap is not None:
        chain.append(snap)
        parent = snap.parent_snapshot_id
        snap = table.metadata.snapshot_by_id(parent) if parent is not None else None
    rows = query(catalog, namespace, table_name=table_name)
    audited = {r["snapshot_after"] for r in rows if r["snapshot_after"] is not None}
    recorded = []
    for i, snap in enumerate(chain):
        props = snap.summary if snap.summary is not None else {}
        if props.get(SUMMARY_PREFIX + "published") != "true" or snap.snapshot_id in audited:
            continue
        run_id = props.get(SUMMARY_PREFIX + "run-id")
        # main before the run: the first ancestor not committed by the same run.
        before = next(
            (s.snapshot_id for s in chain[i + 1 :] if _summary_run_id(s, SUMMARY_PREFIX) != run_id),
            None,
        )
        window = (props.get(SUMMARY_PREFIX + "window") or "").split("/")
        start, end = (
            (datetime.fromisoformat(window[0]), datetime.fromisoformat(window[1]))
            if len(window) == 2
            else (None, None)
        )
        append(
            catalog,
            namespace,
            AuditRecord(
                event="publish",
                outcome="succeeded",
                table_name=table_name,
                run_id=run_id,
                window_start=start,
                window_end=end,
                offsets=props.get(SUMMARY_PREFIX + "offsets"),
                snapshot_before=before,
                snapshot_after=snap.snapshot_id,
                checks=props.get(SUMMARY_PREFIX + "checks"),
                finished_at=datetime.fromtimestamp(snap.timestamp_ms / 1000, UTC),
                detail=(
                    f"recorded late by run {recorded_by} from main's history: the publishing "
                    "run ended between its fast-forward and its audit row"
                ),
            ),
        )
        recorded.append(run_id or "?")
    return recorded


def _summary_run_id(snapshot: Any, prefix: str) -> str | None:
    props = snapshot.summary if snapshot.summary is not None else {}
    value = props.get(prefix + "run-id")
    return str(value) if value is not None else None
