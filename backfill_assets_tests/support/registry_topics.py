"""Shared by the schema-registry topic tests (test_avro_topic, test_jsonschema_topic).

Each produces a corpus of (value bytes, expected row or ``"q:<reason>"``) to a new topic,
backfills it with the raw asset and holds the run, the rows and the quarantine in a
:class:`World`; the helpers here assert what both formats promise of such a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import dagster as dg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

# (value bytes, expected row's values or "q:<reason>"), in produce order.
Records = list[tuple[bytes | None, Any]]


@dataclass
class World:
    spec: TopicSpec
    result: dg.ExecuteInProcessResult
    # (partition, offset) -> what was produced: a row's expected values, or "q:<reason>"
    expected: dict[tuple[int, int], Any]
    values: dict[tuple[int, int], bytes | None]
    rows: dict[tuple[int, int], dict[str, Any]]
    quarantine: dict[tuple[int, int], Any]


def produce(settings: Settings, topic: str, records: Records, hour0: datetime) -> list[int]:
    """Create ``topic`` (one partition, kept forever) and produce ``records`` to it in order,
    the i-th with key ``o<i+1>`` and timestamp ``hour0`` + 2 min + i s; the offsets, sorted."""
    admin = AdminClient(dict(settings.kafka.client_config()))
    futures = admin.create_topics([NewTopic(topic, 1, 1, config={"retention.ms": "-1"})])
    futures[topic].result(timeout=30)
    producer = Producer({**settings.kafka.client_config(), "enable.idempotence": True})
    offsets: list[int] = []
    for i, (value, _) in enumerate(records):
        ts = int((hour0 + timedelta(minutes=2, seconds=i)).timestamp() * 1000)
        producer.produce(
            topic,
            value=value,
            key=f"o{i + 1}".encode(),
            timestamp=ts,
            on_delivery=lambda err, msg: offsets.append(-1 if err else msg.offset() or 0),
        )
    assert producer.flush(30) == 0
    assert sorted(offsets) == list(range(len(records)))
    return sorted(offsets)


def assert_publishes_with_every_check_green(world: World) -> None:
    """The run succeeded and every asset check passed, the independent decode's included."""
    assert world.result.success, [
        e.event_specific_data for e in world.result.all_events if e.is_failure
    ]
    checks = {e.check_name: e.passed for e in world.result.get_asset_check_evaluations()}
    assert checks and all(checks.values()), checks
    assert "decoded_content" in checks


def assert_rows_equal_what_was_produced(world: World) -> None:
    """Exactly the offsets expected as rows are rows, each with the produced values."""
    want_rows = {k: v for k, v in world.expected.items() if isinstance(v, dict)}
    assert set(world.rows) == set(want_rows)
    for key, values in want_rows.items():
        got, want = world.rows[key], {"is_tombstone": False, **values}
        assert {name: got[name] for name in want} == want, key


def assert_bad_records_quarantined(world: World) -> None:
    """Each bad record is quarantined with its reason and exact bytes, and nothing is lost."""
    want_q = {k: v[2:] for k, v in world.expected.items() if isinstance(v, str)}
    assert {k: r["reason"] for k, r in world.quarantine.items()} == want_q
    for key, r in world.quarantine.items():
        assert bytes(r["kafka_value"]) == world.values[key]
    # Nothing lost: every offset read is a row or a quarantine row, never both.
    assert set(world.rows) | set(world.quarantine) == set(world.expected)
    assert not set(world.rows) & set(world.quarantine)
