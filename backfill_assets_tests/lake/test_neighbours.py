"""Neighbours are re-checked at the last moment (DESIGN.md, Autopilot rules).

A run fixes its offset windows when it starts. If the hour beside it is published meanwhile by
another run, that run fixed the shared boundary on its own, and a producer whose clock is
behind can put an offset on either side: published anyway, the offset would be lost or counted
twice, and the chain of windows would refuse every later run. So a publish re-validates its
windows against the ledger's neighbours right before it commits (and after any rebase).

Real broker, real Spark, real catalog; the second run is driven through the lake's publish
protocol directly, because the race needs it to pause between fixing its windows and
publishing (the protocol is the one every Dagster run uses).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.errors import PublishRefused
from backfill_assets.lake.offsets import ledger, windows
from backfill_assets.lake.offsets.contract import window_contract
from backfill_assets.lake.write import checks, publish, replay
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HOUR0 = datetime(2026, 3, 3, 0, tzinfo=UTC)
HOUR1 = HOUR0 + timedelta(hours=1)


def _payload(n: int, at: datetime) -> bytes:
    return json.dumps(
        {
            "schema_version": 2,
            "event_id": f"ev-{n}",
            "order_id": f"o-{n}",
            "customer_id": "c-00001",
            "event_type": "created",
            "status": "open",
            "currency": "EUR",
            "amount_minor": 1234,
            "channel": "web",
            "event_time": int(at.timestamp() * 1000),
        }
    ).encode()


def _produce(settings: Settings, topic: str, stamps: list[tuple[int, datetime]]) -> None:
    producer = Producer({**settings.kafka.client_config(), "enable.idempotence": True})
    for n, at in stamps:
        producer.produce(
            topic,
            key=f"o-{n}".encode(),
            value=_payload(n, at),
            partition=0,
            timestamp=int(at.timestamp() * 1000),
        )
    assert producer.flush(30) == 0


def _raw_hour(spec: Any, hour: datetime) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [build_raw_asset(spec)],
        partition_key=hour.strftime("%Y-%m-%d-%H:%M"),
        resources=RESOURCES,
        raise_on_error=False,
    )


def test_windows_fixed_before_a_neighbour_published_are_refused_then_rechain(
    stack_settings: Settings, spark_session: SparkSession
) -> None:
    topic = f"neighbours_{uuid.uuid4().hex[:8]}"
    admin = AdminClient(stack_settings.kafka.client_config())
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    spec = renamed(SPECS[0], topic=topic)
    kafka, tables = KafkaClient(), CatalogClient()
    _produce(
        stack_settings,
        topic,
        [(0, HOUR0 + timedelta(minutes=10)), (1, HOUR0 + timedelta(minutes=20))],
    )

    # Run B fixes hour 01 while the partition is idle: nothing at or after 01:00 -> [2, 2).
    contract = window_contract(
        settings=stack_settings,
        kafka=kafka,
        iceberg=tables,
        spec=spec,
        start=HOUR1,
        end=HOUR1 + timedelta(hours=1),
    )
    assert contract.windows is not None
    assert contract.windows.hour_offsets(HOUR1) == {0: (2, 2)}
    run_b = f"run-b-{uuid.uuid4().hex[:8]}"
    outcome = replay.replay_to_branch(
        spark_session, contract, settings=stack_settings, iceberg=tables, spec=spec, run_id=run_b
    )
    # A producer whose clock is behind writes an event stamped 00:50 (offset 2), then 01:10.
    _produce(
        stack_settings,
        topic,
        [(2, HOUR0 + timedelta(minutes=50)), (3, HOUR1 + timedelta(minutes=10))],
    )

    # Run A publishes hour 00 through the real asset: its end is the first record >= 01:00.
    assert _raw_hour(spec, HOUR0).success
    cat, ns = tables.catalog(), stack_settings.catalog.namespace
    raw = tables.spark_name(spec.raw_table)
    assert ledger.published_offsets(cat, ns, raw) == {HOUR0: {0: (0, 3)}}
    main_after_a = cat.load_table(tables.identifier(spec.raw_table)).metadata.current_snapshot_id

    # B's own checks pass: the fault is only visible against its new neighbour.
    results = checks.run_checks(spark_session, spec, outcome)
    assert all(r.passed for r in results), [(r.name, r.summary) for r in results]
    request = publish.raw_request(spark_session, spec, outcome, results)
    request.record = {"table_name": raw, "run_id": run_b}
    with pytest.raises(PublishRefused) as refused:
        publish.publish(tables, spark_session, request)
    message = str(refused.value)
    assert "partition 0: hour 2026-03-03T01:00:00+00:00 starts at offset 2" in message
    assert "the published hour before it ends at 3" in message and "run the same hours" in message
    table = cat.load_table(tables.identifier(spec.raw_table))
    assert table.metadata.current_snapshot_id == main_after_a, "main moved"
    assert ledger.published_offsets(cat, ns, raw) == {HOUR0: {0: (0, 3)}}

    # The same hour run again chains on A: offset 2 is counted once (in hour 00), none lost.
    assert _raw_hour(spec, HOUR1).success
    assert ledger.published_offsets(cat, ns, raw) == {HOUR0: {0: (0, 3)}, HOUR1: {0: (3, 4)}}
    offsets = sorted(
        r.kafka_offset for r in spark_session.table(raw).select("kafka_offset").collect()
    )
    assert offsets == [0, 1, 2, 3]


def test_neighbour_mismatches_name_each_broken_boundary() -> None:
    """The comparison alone: the hour before, the hour after, an hour published differently,
    and a partition a published neighbour does not have (its chain starts at 0 after it)."""
    h0, h1, h2 = HOUR0, HOUR1, HOUR1 + timedelta(hours=1)
    published = {h0: {0: (0, 5)}, h2: {0: (9, 12)}}
    assert windows.neighbour_mismatches({h1: {0: (5, 9)}}, published) == []
    assert windows.neighbour_mismatches({h1: {0: (5, 9), 1: (0, 0)}}, published) == []
    problems = windows.neighbour_mismatches({h1: {0: (4, 10)}, h2: {0: (10, 12)}}, published)
    assert problems == [
        "partition 0: hour 2026-03-03T01:00:00+00:00 starts at offset 4, but the published "
        "hour before it ends at 5",
        "hour 2026-03-03T02:00:00+00:00 is published as {0: (9, 12)}, not {0: (10, 12)}",
    ]
    assert windows.neighbour_mismatches({h1: {0: (5, 9), 1: (0, 3)}}, published) == [
        "partition 1: hour 2026-03-03T01:00:00+00:00 ends at offset 3, but the published hour "
        "after it starts at 0"
    ]
