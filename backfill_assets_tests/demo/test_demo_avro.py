"""The demo's orders in Avro (issue 28): ``generate`` with ``encoding="avro"`` writes the same
planned records as the JSON demo, each event in Confluent's wire format through the real schema
registry, and the raw asset built from the README's "Adding an Avro topic" spec publishes them
with every check passing: each row equals its planned event (v1 events read with v2's channel
default), malformed records are quarantined with their exact bytes, and nothing is lost.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
import yaml

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.demo.generator import (
    GeneratorConfig,
    GroundTruth,
    PlannedRecord,
    generate,
    plan_events,
)
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import (
    WITH_EVENT_TIME_MS,
    dicts_by_offset,
    materialize_range,
    rows_by_offset,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

README = Path(__file__).resolve().parents[2] / "README.md"
HOUR0 = datetime(2026, 2, 12, 5, tzinfo=UTC)
RANGE = ("2026-02-12-05:00", "2026-02-12-06:00")


def readme_spec(topic: str) -> TopicSpec:
    """The YAML entry of the README's "Adding an Avro topic", for ``topic`` (and its subject),
    starting at HOUR0."""
    section = README.read_text(encoding="utf-8").split("## Adding an Avro topic", 1)[1]
    match = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert match, "README: no yaml block under 'Adding an Avro topic'"
    (entry,) = yaml.safe_load(match.group(1))
    assert entry["format"] == "avro" and entry["subject"] == f"{entry['topic']}-value"
    entry.update(topic=topic, subject=f"{topic}-value", partition_start=HOUR0.isoformat())
    return TopicSpec.model_validate(entry)


@dataclass
class World:
    result: dg.ExecuteInProcessResult
    truth: GroundTruth
    ids: dict[int, int]  # JSON schema version -> the registry's schema id
    # (partition, offset) -> the planned record produced there
    planned: dict[tuple[int, int], PlannedRecord]
    rows: dict[tuple[int, int], dict[str, Any]]
    quarantine: dict[tuple[int, int], Any]


def _at_offsets(truth: GroundTruth, plan: list[PlannedRecord]) -> dict[tuple[int, int], Any]:
    out: dict[tuple[int, int], PlannedRecord] = {}
    seen: dict[int, int] = {}
    for record in plan:
        p = record.partition
        out[(p, truth.partition_offsets[p].first_offset + seen.get(p, 0))] = record
        seen[p] = seen.get(p, 0) + 1
    return out


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings, spark_session: SparkSession, registry: LocalRegistry
) -> Iterator[World]:
    from backfill_assets.demo import avro

    topic = f"orders_avro_{uuid.uuid4().hex[:8]}"
    spec = readme_spec(topic)
    config = GeneratorConfig(
        topic=topic,
        partitions=2,
        start=HOUR0,
        hours=2,
        events_per_hour=120,
        seed=9,
        duplicate_share=0.05,
        malformed_share=0.02,
        tombstone_share=0.05,
        encoding="avro",
    )
    plan = plan_events(config)  # the JSON plan: pure, the same records generate() encodes
    assert {r.kind for r in plan} == {"valid", "duplicate", "malformed", "tombstone"}
    assert {r.schema_version for r in plan if r.kind == "valid"} == {1, 2}
    settings = dataclasses.replace(stack_settings, schema_registry_url_setting=registry.url)
    truth = generate(settings, config)
    ns = stack_settings.catalog.namespace
    with dg.instance_for_test() as instance:
        result = materialize_range([build_raw_asset(spec)], instance, *RANGE, raise_on_error=False)
    rows = dicts_by_offset(spark_session, f"lake.{ns}.{spec.raw_table}", *WITH_EVENT_TIME_MS)
    quarantine = rows_by_offset(spark_session, f"lake.{ns}.{spec.quarantine_table}")
    ids = avro.register(registry.url, topic)  # already registered: the same ids
    yield World(result, truth, ids, _at_offsets(truth, plan), rows, quarantine)


def _expected_row(record: PlannedRecord, ids: dict[int, int]) -> dict[str, Any]:
    if record.kind == "tombstone":
        return {"order_id": record.order_id, "event_id": None, "is_tombstone": True}
    assert record.value is not None and record.schema_version is not None
    payload = json.loads(record.value)
    return {
        "event_id": record.event_id,
        "order_id": record.order_id,
        "customer_id": payload["customer_id"],
        "event_type": record.event_type,
        "status": record.status,
        "amount_minor": record.amount_minor,
        "currency": record.currency,
        # v1 has no channel: the latest schema's default, as the JSON upcaster gives it
        "channel": payload.get("channel", "unknown"),
        "event_time_ms": record.event_time_ms,
        "schema_version": ids[record.schema_version],
        "is_tombstone": False,
    }


def test_demo_avro_topic_publishes_with_every_check_green(world: World) -> None:
    assert world.result.success, [
        e.event_specific_data for e in world.result.all_events if e.is_failure
    ]
    checks = {e.check_name: e.passed for e in world.result.get_asset_check_evaluations()}
    assert checks and all(checks.values()), checks
    assert "decoded_content" in checks


def test_rows_equal_the_planned_records(world: World) -> None:
    want = {
        key: _expected_row(record, world.ids)
        for key, record in world.planned.items()
        if record.kind != "malformed"
    }
    assert set(world.rows) == set(want)
    for key, values in want.items():
        got = world.rows[key]
        assert {name: got[name] for name in values} == values, key
    totals = world.truth.totals
    assert len(world.rows) == totals["valid"] + totals["duplicates"] + totals["tombstones"]


def test_malformed_records_are_quarantined_with_their_bytes(world: World) -> None:
    malformed = {k: r for k, r in world.planned.items() if r.kind == "malformed"}
    assert malformed and set(world.quarantine) == set(malformed)
    for key, row in world.quarantine.items():
        assert row["reason"] == "not_avro_wire_format"
        assert bytes(row["kafka_value"]) == malformed[key].value
    assert not set(world.rows) & set(world.quarantine)


def test_json_stays_the_default_encoding() -> None:
    """No stack: the default plan is JSON, and a manifest without an encoding reads as JSON."""
    config = GeneratorConfig(start=HOUR0, hours=1, events_per_hour=5)
    assert config.encoding == "json"
    old = {k: v for k, v in config.to_dict().items() if k != "encoding"}
    assert GeneratorConfig.from_dict(old) == config
    avro_config = dataclasses.replace(config, encoding="avro")
    assert GeneratorConfig.from_dict(avro_config.to_dict()) == avro_config
    from backfill_assets.errors import GeneratorError

    with pytest.raises(GeneratorError, match=r"GeneratorConfig\.encoding"):
        dataclasses.replace(config, encoding="protobuf")  # type: ignore[arg-type]


def test_generate_command_writes_the_avro_topic(
    stack_settings: Settings, registry: LocalRegistry, capsys: pytest.CaptureFixture[str]
) -> None:
    """`backfill-assets generate --format avro`, as the README shows it: every event in the wire
    format with an id of ``<topic>-value``, the rest as planned; the manifest says avro."""
    from confluent_kafka import Consumer, TopicPartition

    from backfill_assets.demo import avro
    from backfill_assets.lake.decode.envelope import schema_id
    from backfill_assets.ops import cli

    topic = f"orders_avro_cli_{uuid.uuid4().hex[:8]}"
    args = ["generate", "--topic", topic, "--format", "avro", "--partitions", "1"]
    args += ["--hours", "1", "--events-per-hour", "40", "--start", HOUR0.isoformat(), "--json"]
    assert cli.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "avro"
    truth = GroundTruth.from_json(Path(doc["ground_truth"]))
    config = truth.generator_config()
    assert config.encoding == "avro"
    plan = plan_events(config)
    consumer = Consumer({**stack_settings.kafka.client_config(), "group.id": topic})
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes | None] = []
    deadline = time.monotonic() + 60
    while len(values) < len(plan) and time.monotonic() < deadline:
        values += [m.value() for m in consumer.consume(len(plan) - len(values), timeout=5)]
    consumer.close()
    assert len(values) == len(plan) == truth.totals["records"]
    ids = avro.register(registry.url, topic)
    for record, value in zip(plan, values, strict=True):
        if record.kind in ("valid", "duplicate"):
            assert record.schema_version is not None
            assert schema_id(value) == ids[record.schema_version]
        else:
            assert value == record.value  # raw JSON bytes, or a tombstone's NULL
