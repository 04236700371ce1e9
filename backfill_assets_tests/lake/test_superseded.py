"""The publish records, per Kafka hour, the event hours a correction moves its event away from.

A raw run reads those hours (:func:`backfill_assets.lake.write.derived.other_version_hours`) from
its
branch unless no event id of its window can have another version there: none repeats in the
window and the branch holds no row outside it. Here the original and its moved correction are
in ONE run into an empty table, so only the first condition keeps the read. (A correction
published by a later run is covered by test_autopilot_hours.) Real broker, Spark, catalog and
Dagster.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.lake.offsets import ledger
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

START = datetime(2026, 7, 6, tzinfo=UTC)


def _hour(h: int) -> datetime:
    return START + timedelta(hours=h)


def _order(event_id: str, event_hour: int, amount: int) -> bytes:
    return json.dumps(
        {
            "schema_version": 2,
            "event_id": event_id,
            "order_id": f"o-{event_id}",
            "customer_id": "c-00001",
            "event_type": "created",
            "amount_minor": amount,
            "currency": "EUR",
            "status": "open",
            "event_time": int((_hour(event_hour) + timedelta(minutes=5)).timestamp()) * 1000,
            "channel": "web",
        }
    ).encode()


def test_a_correction_moved_inside_one_run_records_both_event_hours(
    stack_settings: Settings, iceberg_catalog: Catalog
) -> None:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    config = stack_settings.kafka.client_config()
    admin = AdminClient(config)
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer(config)
    # Kafka hour 0: event a (event hour 0) and b; Kafka hour 1: a corrected to event hour 3.
    for i, (event_id, event_hour, kafka_hour, amount) in enumerate(
        [("a", 0, 0, 1000), ("b", 0, 0, 1000), ("a", 3, 1, 2000), ("c", 1, 1, 1000)]
    ):
        producer.produce(
            topic,
            key=f"o-{event_id}".encode(),
            value=_order(event_id, event_hour, amount),
            partition=0,
            timestamp=int((_hour(kafka_hour) + timedelta(minutes=10, seconds=i)).timestamp())
            * 1000,
        )
    assert producer.flush(30) == 0
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    with dg.instance_for_test() as instance:
        result = materialize_range([build_raw_asset(spec)], instance, _hour(0), _hour(1))
    assert result.success
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    cover = ledger.coverage(iceberg_catalog, stack_settings.catalog.namespace, table)
    assert cover[_hour(0)].superseded_hours == frozenset({_hour(3)})
    assert cover[_hour(1)].superseded_hours == frozenset({_hour(0)})
