"""``accept``: leave one named record out of the ``decoded_content`` comparison, on record."""

from __future__ import annotations

import getpass
from typing import Any

import click

from backfill_assets.errors import ArgumentError
from backfill_assets.ops.cli import common
from backfill_assets.ops.cli.common import Exit, topic_option, with_ui
from backfill_assets.ops.cli.common import spec as spec_of
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings


@click.command("accept", short_help="Accept a record the content check's two decodes disagree on.")
@topic_option
@click.option("--partition", type=int, required=True, help="the record's Kafka partition")
@click.option("--offset", type=int, required=True, help="the record's offset")
@click.option("--reason", required=True, help="why the replay's row is right (kept in the ledger)")
@with_ui
def accept_command(
    ui: Ui, settings: Settings, topic: str, partition: int, offset: int, reason: str
) -> int:
    """Record that the replay's row of one Kafka record is right although the independent
    reference decode reads the record differently, so ``decoded_content`` leaves the record
    out on both sides from now on (other records of its hour are still compared).

    Appends an ``accept`` row to the ledger naming the topic's log (topic id and cluster id),
    the partition and offset, who accepted it and why. Re-run the hour afterwards (the gap
    sensor requests it again on its next tick). Exits 0 once recorded."""
    from backfill_assets.lake.offsets import identity, ledger

    spec = spec_of(topic)
    if not reason.strip():
        raise ArgumentError("--reason must say why the replay's row is right")
    kafka = common.kafka()
    ends = kafka.log_ends(spec.topic)
    if partition not in ends or not 0 <= offset < ends[partition][2]:
        held = ", ".join(f"{p}: [0, {e[2]})" for p, e in sorted(ends.items()))
        raise ArgumentError(
            f"topic {spec.topic!r} has no record at partition {partition} offset {offset}; "
            f"its partitions' offsets: {held}"
        )
    cat = catalog.load(settings.catalog)
    ns = settings.catalog.namespace
    raw = f"{cat.name}.{ns}.{spec.raw_table}"
    log = identity.check(kafka, cat, ns, spec.topic, raw)
    by = f"cli:{getpass.getuser()}"
    ledger.record_accept(cat, ns, raw, log, (partition, offset), reason=reason, by=by)
    doc: dict[str, Any] = {
        "topic": spec.topic,
        "partition": partition,
        "offset": offset,
        "topic_id": log.topic_id,
        "reason": reason,
        "by": by,
    }
    ui.emit(doc)
    ui.line(
        f"topic {spec.topic!r}: record {partition}:{offset} accepted ({reason}); decoded_content "
        "leaves it out from now on. Re-run its hour (the gap sensor requests it on its next "
        f"tick, or `backfill-assets backfill --topic {spec.topic} --start HOUR --end HOUR+1`)."
    )
    return Exit.OK
