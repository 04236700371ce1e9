"""Which log a topic's raw table reads: the ledger's topic identity against Kafka's.

A topic deleted and recreated (or served by another cluster after a failover) is a new log
under the same name: its offsets restart at 0, so the ledger's offsets of the old log say
nothing about it (chained on, they would make windows wrong and the gap detection think
everything is published). Kafka's identity (:meth:`KafkaClient.topic_identity`) is compared
with the ledger's current log (:func:`backfill_assets.lake.offsets.ledger.current_log`): when they
differ, nothing of the topic is read or published until an operator adopts the new log
(``backfill-assets adopt``, an ``adopt`` ledger row). A ledger that knows no identity yet (rows
written before it was kept) adopts Kafka's silently on the next publish.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pyiceberg.catalog import Catalog

from backfill_assets.errors import TopicReplaced
from backfill_assets.lake.offsets import ledger
from backfill_assets.stack.kafka import KafkaClient, TopicIdentity


def compare(topic: str, log: ledger.Log, kafka: TopicIdentity) -> TopicReplaced | None:
    """The refusal when Kafka's log ``kafka`` is not the ledger's ``log`` (None when it is,
    or when the ledger knows no identity yet: the next publish records Kafka's)."""
    if log.identity is None or log.identity == kafka:
        return None
    return TopicReplaced(topic, log.identity, kafka)


def check(
    kafka: KafkaClient, catalog: Catalog, namespace: str, topic: str, raw_table: str
) -> TopicIdentity:
    """Kafka's identity of ``topic``, after checking it is the ledger's current log of
    ``raw_table`` (``catalog.namespace.table``); raises :class:`TopicReplaced` otherwise."""
    found = kafka.topic_identity(topic)
    refused = compare(topic, ledger.current_log(catalog, namespace, raw_table), found)
    if refused is not None:
        raise refused
    return found


def still_same(
    kafka: KafkaClient,
    catalog: Catalog,
    namespace: str,
    topic: str,
    raw_table: str,
    read: TopicIdentity,
) -> None:
    """Right before a publish: the log the run read (``read``) must still be Kafka's and the
    ledger's current one; raises :class:`TopicReplaced` otherwise."""
    found = check(kafka, catalog, namespace, topic, raw_table)
    if found != read:
        raise TopicReplaced(topic, read, found)


def shadowed_doc(topic: str, shadowed: dict[datetime, ledger.Entry]) -> list[dict[str, Any]]:
    """Per old-log publish run, the hours the current log holds records for that stay as the
    old log published them, in words with the command that re-reads them."""
    runs: dict[str, list[datetime]] = {}
    for hour, entry in sorted(shadowed.items()):
        runs.setdefault(entry.run_id, []).append(hour)
    out = []
    for run_id, hours in runs.items():
        named = ", ".join(h.isoformat() for h in hours)
        out.append(
            {
                "run_id": run_id,
                "hours": [h.isoformat() for h in hours],
                "rollback": f"backfill-assets rollback --run {run_id} --dry-run",
                "why": (
                    f"topic {topic!r}: the new log holds records for hour(s) {named}, which "
                    f"stay as run {run_id} published them from the old log; they are not "
                    "re-read. To re-read them from the new log, roll that run back (it undoes "
                    "every hour it published; hours the new log does not hold are then gone) "
                    "and the gap sensor requests them again: "
                    f"`backfill-assets rollback --run {run_id} --dry-run` shows what it undoes."
                ),
            }
        )
    return out
