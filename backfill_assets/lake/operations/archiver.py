"""The archiver's run: copy new Kafka records of one topic to the archive, then audit it
(the Dagster asset and hourly schedule that run it are in :mod:`backfill_assets.defs.archiver`).

Each run archives the committed records of every partition from where its archive ends up to
the last stable offset seen when the run starts (see :mod:`backfill_assets.lake.offsets.archive`
for the
layout and why each offset is archived exactly once), re-archives legacy files (written before
the archive read committed records only) that Kafka still holds, then appends one ``archive``
row to the audit table. Offsets that Kafka deleted before they were archived, offsets an open
transaction holds back, and legacy files that can no longer be re-archived are reported, never
hidden.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from backfill_assets.lake.offsets.archive import Archive, PartitionRun
from backfill_assets.lake.write import audit
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.kafka import KafkaClient


def run_archiver(
    kafka: KafkaClient,
    iceberg: CatalogClient,
    spec: TopicSpec,
    *,
    run_id: str | None = None,
    launched_by: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[list[PartitionRun], dict[str, Any]]:
    """Archive ``spec.topic`` now; returns per-partition runs and a JSON-able summary.
    ``on_progress(partitions done, partitions)`` is called after each partition."""
    settings = kafka.settings
    store = Archive(settings)
    started = datetime.now(UTC)
    runs = store.archive_topic(kafka, spec.topic, on_progress=on_progress)
    summary: dict[str, Any] = {
        "archive_uri": settings.archive_uri,
        "records": sum(r.records for r in runs),
        "bytes": sum(r.bytes for r in runs),
        "files": sum(len(r.files) for r in runs),
        "partitions": {str(r.partition): r.to_json() for r in runs},
        "lost_before_archiving": {
            str(r.partition): list(r.lost) for r in runs if r.lost is not None
        },
        # [last stable offset, high watermark): archived by a later run, once the open
        # transaction holding the LSO back has ended.
        "waiting_for_transaction": {
            str(r.partition): list(r.waiting_for_transaction)
            for r in runs
            if r.waiting_for_transaction is not None
        },
        # Legacy files replaced by their committed rewrite in this run.
        "rearchived": {str(r.partition): r.rearchived for r in runs if r.rearchived},
        # Legacy files readers refuse and no run can fix: Kafka deleted (some of) their offsets
        # or holds other records there.
        "unverifiable_legacy": {
            str(r.partition): r.unverifiable_legacy for r in runs if r.unverifiable_legacy
        },
        # Legacy files reaching past the last stable offset: re-archived by a later run.
        "legacy_waiting_for_transaction": {
            str(r.partition): r.legacy_waiting for r in runs if r.legacy_waiting
        },
    }
    if summary["lost_before_archiving"]:
        outcome = "lost_offsets"
    elif summary["unverifiable_legacy"]:
        outcome = "unverifiable_legacy"
    else:
        outcome = "ok"
    audit.append(
        iceberg.catalog(),
        settings.catalog.namespace,
        audit.AuditRecord(
            event="archive",
            table_name=f"archive/{spec.topic}",
            outcome=outcome,
            run_id=run_id,
            launched_by=launched_by,
            offsets=json.dumps(
                {str(r.partition): [r.start, r.end] for r in runs}, separators=(",", ":")
            ),
            started_at=started,
            records_read=summary["records"],
            rows_written=summary["records"],
            detail=json.dumps(
                {
                    "files": summary["files"],
                    "lost": summary["lost_before_archiving"],
                    "waiting_for_transaction": summary["waiting_for_transaction"],
                    "rearchived": summary["rearchived"],
                    "unverifiable_legacy": summary["unverifiable_legacy"],
                    "legacy_waiting_for_transaction": summary["legacy_waiting_for_transaction"],
                }
            ),
        ),
    )
    return runs, summary
