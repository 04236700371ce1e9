"""``adopt``: make a recreated (or failed-over) topic's new log the one its raw table reads."""

from __future__ import annotations

import getpass
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from backfill_assets.ops.cli import common
from backfill_assets.ops.cli.common import Exit, topic_option, with_ui
from backfill_assets.ops.cli.common import spec as spec_of
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings

HOUR = timedelta(hours=1)


@click.command("adopt", short_help="Read a recreated (or failed-over) topic's new log from now on.")
@topic_option
@click.option("--dry-run", is_flag=True, help="show what it would do; record nothing")
@with_ui
def adopt_command(ui: Ui, settings: Settings, topic: str, dry_run: bool) -> int:
    """Adopt Kafka's new log of a topic deleted and recreated, or served by another cluster
    after a failover (runs and the gap sensor refuse it until then).

    Records an ``adopt`` row in the ledger with the new topic id and cluster id. Hours
    published from the old log keep their rows and stay covered; the new log's hours not yet
    published are read from the new log (the gap sensor requests them). Hours the new log
    holds records for that were published from the old log are NOT re-read: they are listed
    with the rollback command that re-reads them. Exits 0 (also when there is nothing to adopt).
    """
    from backfill_assets.lake.offsets import ledger

    spec = spec_of(topic)
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    raw = f"{cat.name}.{ns}.{spec.raw_table}"
    kafka = common.kafka()
    entries, log = ledger.log_coverage(cat, ns, raw)
    new = kafka.topic_identity(spec.topic)
    doc: dict[str, Any] = {
        "topic": spec.topic,
        "old": vars(log.identity) if log.identity else None,
        "new": vars(new),
        "dry_run": dry_run,
    }
    if log.identity == new:
        doc["adopted"] = False
        ui.emit(doc)
        ui.line(f"topic {spec.topic!r}: the ledger already reads this log ({_name(new)})")
        return Exit.OK
    doc.update(_after(kafka, spec, entries, ledger.Log(new, True)))
    if not dry_run:
        ledger.record_adopt(cat, ns, raw, new, by=f"cli:{getpass.getuser()}")
    doc["adopted"] = not dry_run
    ui.emit(doc)
    _report(ui, spec.topic, log.identity, new, doc, dry_run)
    return Exit.OK


def _name(identity: Any) -> str:
    return f"topic id {identity.topic_id} on cluster {identity.cluster_id}"


def _after(kafka: Any, spec: Any, entries: dict[datetime, Any], log: Any) -> dict[str, Any]:
    """What adopting ``log`` means: the old log's published hours, the new log's hours still
    to read, and the new log's hours covered by old publishes (not re-read)."""
    from backfill_assets.lake.coverage import detect
    from backfill_assets.lake.offsets import identity

    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    mine = {h: dict(e.offsets) for h, e in entries.items() if log.holds(e) and e.offsets}
    in_kafka = detect.kafka_hours(kafka, spec.topic, spec.partition_start, now, mine)
    shadowed = {h: e for h, e in entries.items() if h in in_kafka and not log.holds(e)}
    return {
        "old_log_hours": [h.isoformat() for h in sorted(entries) if not log.holds(entries[h])],
        "to_read": [h.isoformat() for h in sorted(in_kafka) if h not in entries],
        "not_re_read": identity.shadowed_doc(spec.topic, shadowed),
    }


def _report(ui: Ui, topic: str, old: Any, new: Any, doc: dict[str, Any], dry_run: bool) -> None:
    verb = "would adopt" if dry_run else "adopted"
    was = _name(old) if old else "no recorded log"
    ui.line(f"topic {topic!r}: {verb} the new log ({_name(new)}) in place of {was}.")
    kept = doc["old_log_hours"]
    if kept:
        ui.line(
            f"{len(kept)} hour(s) published from the old log ({kept[0]} .. {kept[-1]}) keep "
            "their rows and stay covered; their offsets no longer fix any window."
        )
    read = doc["to_read"]
    if read:
        ui.line(
            f"the new log's {len(read)} unpublished hour(s) ({read[0]} .. {read[-1]}) are "
            "read from the new log: the gap sensor requests them"
            + (" once adopted." if dry_run else ".")
        )
    for item in doc["not_re_read"]:
        ui.line(f"NOT RE-READ: {item['why']}")
    ui.line(
        "Lost with the old log: its records never published (unless archived), which the "
        "ledger cannot list."
    )
    if dry_run:
        ui.line(f"run `backfill-assets adopt --topic {topic}` to adopt it.")
