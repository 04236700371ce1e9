"""Tests for the demo event generator: the pure planning rules first, then a real broker."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import random
import re
import time
import uuid
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from backfill_assets.demo.generator import (
    HOUR_MS,
    MALFORMED_REASONS,
    GeneratorConfig,
    GroundTruth,
    PlannedRecord,
    build_ground_truth,
    generate,
    hour_iso,
    plan_events,
    produce_history,
)
from backfill_assets.errors import GeneratorError
from backfill_assets.stack.settings import Settings

START = datetime(2026, 1, 1, tzinfo=UTC)
ISO_MILLIS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
TWO_DECIMALS = re.compile(rb'"amount":\d+\.\d\d[,}]')


def config(**overrides: Any) -> GeneratorConfig:
    """A small config (6 hours x 200 events) with the given fields changed."""
    fields: dict[str, Any] = {"start": START, "hours": 6, "events_per_hour": 200}
    fields.update(overrides)
    return GeneratorConfig(**fields)


def by_partition(plan: list[PlannedRecord]) -> dict[int, list[PlannedRecord]]:
    parts: dict[int, list[PlannedRecord]] = defaultdict(list)
    for record in plan:
        parts[record.partition].append(record)
    return parts


@pytest.fixture(scope="module")
def small_config() -> GeneratorConfig:
    return config()


@pytest.fixture(scope="module")
def small_plan(small_config: GeneratorConfig) -> list[PlannedRecord]:
    return plan_events(small_config)


@pytest.fixture(scope="module")
def busy_config() -> GeneratorConfig:
    """Every trait turned up high, so rare cases (hour boundaries, all reasons) show up."""
    return config(
        hours=4,
        events_per_hour=1500,
        seed=11,
        late_share=0.3,
        duplicate_share=0.5,
        malformed_share=0.2,
        tombstone_share=0.2,
    )


@pytest.fixture(scope="module")
def busy_plan(busy_config: GeneratorConfig) -> list[PlannedRecord]:
    return plan_events(busy_config)


# --------------------------------------------------------------------------------------------
# Pure planning
# --------------------------------------------------------------------------------------------


def test_same_config_gives_a_byte_identical_plan(small_config: GeneratorConfig) -> None:
    first, second = plan_events(small_config), plan_events(small_config)
    assert first == second
    assert [r.value for r in first] == [r.value for r in second]


def test_different_seed_gives_a_different_plan(small_plan: list[PlannedRecord]) -> None:
    other = plan_events(config(seed=8))
    assert [r.value for r in other] != [r.value for r in small_plan]


def test_kafka_timestamps_are_non_decreasing_per_partition_and_in_range(
    busy_config: GeneratorConfig, busy_plan: list[PlannedRecord]
) -> None:
    for records in by_partition(busy_plan).values():
        stamps = [r.timestamp_ms for r in records]
        assert stamps == sorted(stamps)
        assert busy_config.start_ms <= stamps[0]
        assert stamps[-1] < busy_config.end_ms


def test_events_are_spread_over_every_hour(
    small_config: GeneratorConfig, small_plan: list[PlannedRecord]
) -> None:
    per_hour = Counter(hour_iso(r.timestamp_ms) for r in small_plan if r.kind != "duplicate")
    assert set(per_hour.values()) == {small_config.events_per_hour}
    assert len(per_hour) == small_config.hours


def test_partition_is_crc32_of_the_order_id(
    small_config: GeneratorConfig, small_plan: list[PlannedRecord]
) -> None:
    for record in small_plan:
        assert record.key == record.order_id.encode()
        assert record.partition == zlib.crc32(record.key) % small_config.partitions
    assert {r.partition for r in small_plan} == set(range(small_config.partitions))


def test_duplicates_carry_identical_bytes_and_never_cross_an_hour(
    busy_plan: list[PlannedRecord],
) -> None:
    duplicates = 0
    for records in by_partition(busy_plan).values():
        for previous, record in itertools.pairwise(records):
            if record.kind != "duplicate":
                continue
            duplicates += 1
            assert previous.kind == "valid"
            assert (record.key, record.value) == (previous.key, previous.value)
            assert record.event_id == previous.event_id
            assert 0 <= record.timestamp_ms - previous.timestamp_ms <= 50
            assert hour_iso(record.timestamp_ms) == hour_iso(previous.timestamp_ms)
    assert duplicates == sum(r.kind == "duplicate" for r in busy_plan) > 1000
    valid_ids = [r.event_id for r in busy_plan if r.kind == "valid"]
    assert len(valid_ids) == len(set(valid_ids))


def test_every_share_zero_gives_only_valid_timely_records() -> None:
    plan = plan_events(
        config(late_share=0, duplicate_share=0, malformed_share=0, tombstone_share=0)
    )
    assert {r.kind for r in plan} == {"valid"}
    assert not any(r.late for r in plan)
    for record in plan:
        assert record.event_time_ms is not None
        assert 0 <= record.timestamp_ms - record.event_time_ms <= 60_000


@pytest.mark.parametrize(
    ("trait", "kind"),
    [
        ("duplicate_share", "duplicate"),
        ("malformed_share", "malformed"),
        ("tombstone_share", "tombstone"),
    ],
)
def test_each_trait_switches_off_on_its_own(trait: str, kind: str) -> None:
    plan = plan_events(config(**{trait: 0.0}))
    kinds: Counter[str] = Counter(r.kind for r in plan)
    assert kinds[kind] == 0
    assert set(kinds) == {"valid", "duplicate", "malformed", "tombstone"} - {kind}


def test_event_time_is_never_after_the_kafka_timestamp(
    busy_config: GeneratorConfig, busy_plan: list[PlannedRecord]
) -> None:
    late = 0
    for record in busy_plan:
        slack = 50 if record.kind == "duplicate" else 0  # a duplicate is produced up to 50 ms later
        if record.kind not in ("valid", "duplicate"):
            assert record.event_time_ms is None
            continue
        assert record.event_time_ms is not None
        lag = record.timestamp_ms - record.event_time_ms
        if record.late:
            late += 1
            assert timedelta(minutes=10) <= timedelta(milliseconds=lag)
            assert lag <= busy_config.max_lateness.total_seconds() * 1000 + slack
        else:
            assert 0 <= lag <= 60_000 + slack
    assert late > 0


def test_schema_v1_before_the_switch_and_v2_after(
    small_config: GeneratorConfig, small_plan: list[PlannedRecord]
) -> None:
    switch = small_config.start_ms + small_config.hours * HOUR_MS // 2
    assert small_config.schema_switch_ms == switch
    valid = [r for r in small_plan if r.kind == "valid"]
    assert {r.schema_version for r in valid if r.timestamp_ms < switch} == {1}
    assert {r.schema_version for r in valid if r.timestamp_ms >= switch} == {2}
    assert {r.schema_version for r in plan_events(config(schema_switch_fraction=0.0))} <= {
        2,
        None,
    }
    assert {r.schema_version for r in plan_events(config(schema_switch_fraction=1.0))} <= {
        1,
        None,
    }


def test_payloads_match_their_labels(small_plan: list[PlannedRecord]) -> None:
    for record in small_plan:
        if record.kind not in ("valid", "duplicate"):
            continue
        assert record.value is not None
        body = json.loads(record.value)
        assert list(body) == sorted(body)
        assert b" " not in record.value
        assert body["schema_version"] == record.schema_version
        assert body["event_id"] == record.event_id
        assert body["order_id"] == record.order_id
        assert body["event_type"] == record.event_type
        assert body["status"] == record.status
        assert body["currency"] == record.currency in ("EUR", "USD", "GBP")
        assert re.fullmatch(r"c-\d{5}", body["customer_id"])
        assert record.amount_minor is not None
        assert 500 <= record.amount_minor <= 50_000
        if record.schema_version == 1:
            assert set(body) == {
                "schema_version",
                "event_id",
                "order_id",
                "customer_id",
                "event_type",
                "amount",
                "currency",
                "status",
                "event_time",
            }
            assert TWO_DECIMALS.search(record.value)
            assert round(body["amount"] * 100) == record.amount_minor
            assert ISO_MILLIS.match(body["event_time"])
            parsed = datetime.fromisoformat(body["event_time"].replace("Z", "+00:00"))
            assert parsed == datetime.fromtimestamp(0, UTC) + timedelta(
                milliseconds=record.event_time_ms or 0
            )
        else:
            canonical = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
            assert record.value == canonical
            assert body["amount_minor"] == record.amount_minor
            assert body["event_time"] == record.event_time_ms
            assert body["channel"] in ("web", "app", "store")
            assert "amount" not in body


def test_orders_follow_their_lifecycle(busy_plan: list[PlannedRecord]) -> None:
    history: dict[str, list[PlannedRecord]] = defaultdict(list)
    for record in busy_plan:
        if record.kind in ("valid", "tombstone"):
            history[record.order_id].append(record)
    created_ids = set()
    for order_id, records in history.items():
        types = [str(r.event_type) if r.kind == "valid" else "deleted" for r in records]
        assert re.fullmatch(r"created(,updated){0,2}(,cancelled(,deleted)?)?", ",".join(types)), (
            order_id,
            types,
        )
        created_ids.add(order_id)
        statuses = [r.status for r in records if r.kind == "valid"]
        assert statuses[0] == "open"
        for event_type, status in zip(types, statuses, strict=False):
            expected = {"created": {"open"}, "updated": {"open", "paid"}}
            assert status in expected.get(event_type, {"cancelled"})
        tombstones = [r for r in records if r.kind == "tombstone"]
        for tombstone in tombstones:
            assert tombstone.value is None
            assert tombstone.event_id is None
    for record in busy_plan:
        if record.kind == "malformed":
            assert record.order_id in created_ids


def test_malformed_records_cover_every_reason(busy_plan: list[PlannedRecord]) -> None:
    malformed = [r for r in busy_plan if r.kind == "malformed"]
    assert {r.malformed_reason for r in malformed} == set(MALFORMED_REASONS)
    for record in malformed:
        assert record.value is not None
        if record.malformed_reason == "invalid_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(record.value)
            continue
        body = json.loads(record.value)
        assert body["order_id"] == record.order_id
        if record.malformed_reason == "missing_event_time":
            assert "event_time" not in body
        elif record.malformed_reason == "wrong_type":
            field = "amount" if body["schema_version"] == 1 else "amount_minor"
            assert body[field] == "abc"
        else:
            assert body["schema_version"] == 9


def test_ground_truth_counts_add_up(
    busy_config: GeneratorConfig, busy_plan: list[PlannedRecord], tmp_path: Path
) -> None:
    truth = build_ground_truth(busy_config, busy_plan)
    assert len(truth.kafka_hours) == busy_config.hours
    for counts in truth.kafka_hours.values():
        parts = ("valid", "duplicates", "malformed", "tombstones")
        assert counts["records"] == sum(counts[k] for k in parts)
        assert counts["valid"] == counts["v1"] + counts["v2"]
        assert counts["late"] <= counts["valid"]
    for key, total in truth.totals.items():
        assert total == sum(c[key] for c in truth.kafka_hours.values())
    kinds = Counter(r.kind for r in busy_plan)
    assert truth.totals["records"] == len(busy_plan)
    assert truth.totals["valid"] == kinds["valid"]
    assert truth.totals["duplicates"] == kinds["duplicate"]
    assert truth.totals["malformed"] == kinds["malformed"] == sum(truth.malformed_reasons.values())
    assert truth.totals["tombstones"] == kinds["tombstone"]
    assert truth.totals["late"] == sum(r.late for r in busy_plan if r.kind == "valid")
    events = sum(v["events"] for per in truth.event_hours.values() for v in per.values())
    amount = sum(v["amount_minor"] for per in truth.event_hours.values() for v in per.values())
    valid = [r for r in busy_plan if r.kind == "valid"]
    assert events == len(valid)
    assert amount == sum(r.amount_minor or 0 for r in valid)
    assert min(truth.event_hours) < hour_iso(busy_config.start_ms)  # late events at the start
    for partition, hours in truth.hour_offsets.items():
        bounds = list(hours.values())
        part = truth.partition_offsets[partition]
        assert bounds[0][0] == part.first_offset
        assert bounds[-1][1] == part.end_offset
        for (_, end), (start, _) in itertools.pairwise(bounds):
            assert end == start
    total_by_hours = sum(
        end - start for hours in truth.hour_offsets.values() for start, end in hours.values()
    )
    assert total_by_hours == len(busy_plan)

    path = tmp_path / "manifest" / "truth.json"
    truth.write(path)
    assert GroundTruth.from_json(path) == truth
    assert truth.generator_config() == busy_config


def test_offset_for_time_bisects_timestamps(
    small_config: GeneratorConfig, small_plan: list[PlannedRecord]
) -> None:
    truth = build_ground_truth(small_config, small_plan, {p: 1000 for p in range(6)})
    for partition, part in truth.partition_offsets.items():
        stamps = part.timestamps_ms
        assert part.first_offset == 1000
        assert part.end_offset == 1000 + len(stamps)
        assert truth.offset_for_time(partition, small_config.start_ms - 1) == 1000
        assert truth.offset_for_time(partition, small_config.end_ms) == part.end_offset
        for index, ts in enumerate(stamps):
            expected = 1000 + stamps.index(ts)
            assert truth.offset_for_time(partition, ts) == expected
            assert truth.offset_for_time(partition, ts + 1) > 1000 + index


def test_missing_manifest_raises_generator_error(tmp_path: Path) -> None:
    with pytest.raises(GeneratorError, match="manifest"):
        GroundTruth.from_json(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"partitions": 0}, "partitions"),
        ({"hours": 0}, "hours"),
        ({"events_per_hour": -5}, "events_per_hour"),
        ({"late_share": 0.6}, "late_share"),
        ({"duplicate_share": -0.01}, "duplicate_share"),
        ({"malformed_share": 0.51}, "malformed_share"),
        ({"tombstone_share": float("nan")}, "tombstone_share"),
        ({"schema_switch_fraction": 1.5}, "schema_switch_fraction"),
        ({"max_lateness": timedelta(minutes=5)}, "max_lateness"),
        ({"start": datetime(2026, 1, 1)}, "start"),  # naive
        ({"start": datetime(2026, 1, 1, 0, 30, tzinfo=UTC)}, "start"),
        ({"start": datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=1)))}, "start"),
        ({"topic": "bad topic!"}, "topic"),
        ({"topic": ""}, "topic"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_config_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(GeneratorError, match=rf"\b{field}\b"):
        config(**overrides)


# --------------------------------------------------------------------------------------------
# Real broker (``stack_settings`` comes from conftest.py)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generated:
    config: GeneratorConfig
    plan: list[PlannedRecord]
    truth: GroundTruth
    manifest: Path


def unique_topic() -> str:
    return f"test-generator-{uuid.uuid4().hex[:12]}"


def admin_for(settings: Settings) -> AdminClient:
    return AdminClient(dict(settings.kafka.client_config()))


def delete_topics(settings: Settings, topics: list[str]) -> None:
    """Best-effort cleanup of the topics a test created."""
    admin = admin_for(settings)  # keep the client alive until the futures resolve
    futures = admin.delete_topics(topics, operation_timeout=30)
    for future in futures.values():
        with contextlib.suppress(KafkaException):
            future.result()


def throwaway_consumer(settings: Settings) -> Consumer:
    return Consumer(
        {
            **settings.kafka.client_config(),
            "group.id": f"test-generator-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )


@pytest.fixture
def topic(stack_settings: Settings) -> Iterator[str]:
    name = unique_topic()
    yield name
    delete_topics(stack_settings, [name])


@pytest.fixture(scope="module")
def generated(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Generated]:
    cfg = config(topic=unique_topic())
    manifest = tmp_path_factory.mktemp("generator") / "truth.json"
    truth = generate(stack_settings, cfg, manifest_path=manifest)
    yield Generated(config=cfg, plan=plan_events(cfg), truth=truth, manifest=manifest)
    delete_topics(stack_settings, [cfg.topic])


def test_generate_writes_exactly_the_planned_records(
    stack_settings: Settings, generated: Generated
) -> None:
    cfg, plan, truth = generated.config, generated.plan, generated.truth
    expected = by_partition(plan)
    consumer = throwaway_consumer(stack_settings)
    try:
        for partition in range(cfg.partitions):
            low, high = consumer.get_watermark_offsets(
                TopicPartition(cfg.topic, partition), timeout=10
            )
            assert (low, high) == (0, len(expected[partition]))
            assert truth.partition_offsets[partition].end_offset == high
        consumer.assign([TopicPartition(cfg.topic, p, 0) for p in range(cfg.partitions)])
        seen: dict[int, list[tuple[int, bytes | None, bytes | None, int]]] = defaultdict(list)
        deadline = time.monotonic() + 60
        while sum(len(v) for v in seen.values()) < len(plan) and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=1000, timeout=1):
                assert message.error() is None, message.error()
                where, offset = message.partition(), message.offset()
                assert where is not None and offset is not None
                ts_type, ts = message.timestamp()
                assert ts_type == TIMESTAMP_CREATE_TIME
                seen[where].append((offset, message.key(), message.value(), ts))
    finally:
        consumer.close()
    for partition, records in expected.items():
        assert seen[partition] == [
            (offset, r.key, r.value, r.timestamp_ms) for offset, r in enumerate(records)
        ]
    assert truth.totals["records"] == len(plan)
    assert GroundTruth.from_json(generated.manifest) == truth


def test_generate_creates_the_topic_with_unbounded_retention_and_create_time(
    stack_settings: Settings, generated: Generated
) -> None:
    resource = ConfigResource(ResourceType.TOPIC, generated.config.topic)
    admin = admin_for(stack_settings)
    futures = admin.describe_configs([resource])
    entries = next(iter(futures.values())).result()
    assert entries["retention.ms"].value == "-1"
    assert entries["retention.bytes"].value == "-1"
    assert entries["message.timestamp.type"].value == "CreateTime"


def test_second_generate_on_the_same_topic_refuses(
    stack_settings: Settings, generated: Generated
) -> None:
    with pytest.raises(GeneratorError, match="already has data") as excinfo:
        generate(stack_settings, generated.config)
    assert generated.config.topic in str(excinfo.value)
    assert "--topic" in str(excinfo.value)


def test_offsets_for_times_matches_the_ground_truth(
    stack_settings: Settings, generated: Generated
) -> None:
    cfg, truth = generated.config, generated.truth
    rng = random.Random(1)
    stamps = [cfg.start_ms - 1, cfg.end_ms, cfg.end_ms + HOUR_MS]
    stamps += [cfg.start_ms + h * HOUR_MS for h in range(cfg.hours)]
    stamps += [rng.randrange(cfg.start_ms, cfg.end_ms) for _ in range(20)]
    stamps += [rng.choice(truth.partition_offsets[0].timestamps_ms) for _ in range(5)]
    consumer = throwaway_consumer(stack_settings)
    try:
        for ts in stamps:
            # One entry per partition per call: librdkafka answers per partition, not per entry.
            request = [TopicPartition(cfg.topic, p, ts) for p in range(cfg.partitions)]
            for answer in consumer.offsets_for_times(request, timeout=10):
                assert answer.error is None, answer.error
                end = truth.partition_offsets[answer.partition].end_offset
                got = end if answer.offset < 0 else answer.offset
                assert got == truth.offset_for_time(answer.partition, ts), (answer.partition, ts)
    finally:
        consumer.close()
    for partition, hours in truth.hour_offsets.items():
        for hour, (start, _end) in hours.items():
            ts = int(datetime.fromisoformat(hour).timestamp() * 1000)
            assert start == truth.offset_for_time(partition, ts)


def test_generate_uses_an_existing_empty_topic(stack_settings: Settings, topic: str) -> None:
    cfg = config(topic=topic, partitions=3, hours=1, events_per_hour=50)
    create = NewTopic(topic, num_partitions=3, replication_factor=1)
    admin = admin_for(stack_settings)
    admin.create_topics([create])[topic].result()
    truth = generate(stack_settings, cfg)
    assert sum(p.end_offset for p in truth.partition_offsets.values()) == len(plan_events(cfg))


def test_produce_history_writes_every_chunk_in_order(stack_settings: Settings, topic: str) -> None:
    cfg = config(topic=topic, partitions=3, hours=5, events_per_hour=40)
    progress: list[tuple[int, int]] = []
    produced = produce_history(
        stack_settings, cfg, chunk_hours=2, on_progress=lambda d, t: progress.append((d, t))
    )
    chunks = [
        dataclasses.replace(cfg, start=START + timedelta(hours=h), hours=n, seed=cfg.seed + i)
        for i, (h, n) in enumerate([(0, 2), (2, 2), (4, 1)])
    ]
    assert produced == sum(len(plan_events(c)) for c in chunks)
    assert progress == [(2, 5), (4, 5), (5, 5)]
    consumer = throwaway_consumer(stack_settings)
    try:
        highs = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(3)
        }
        assert sum(highs.values()) == produced
        consumer.assign([TopicPartition(topic, p, 0) for p in range(3)])
        stamps: dict[int, list[int]] = defaultdict(list)
        deadline = time.monotonic() + 60
        while sum(len(v) for v in stamps.values()) < produced and time.monotonic() < deadline:
            for msg in consumer.consume(500, timeout=1.0):
                assert msg.error() is None
                stamps[msg.partition()].append(msg.timestamp()[1])  # type: ignore[index]
    finally:
        consumer.close()
    lo, hi = cfg.start_ms, cfg.start_ms + 5 * HOUR_MS
    for p, ts in stamps.items():
        assert ts == sorted(ts), f"partition {p}: chunks out of order"
        assert lo <= ts[0] and ts[-1] < hi
    # The chunks' hours all have records: chunk 3 is the fifth hour.
    assert any(t >= lo + 4 * HOUR_MS for ts in stamps.values() for t in ts)


def test_produce_history_refuses_a_bad_chunk_size(stack_settings: Settings) -> None:
    with pytest.raises(GeneratorError, match="chunk_hours=0 must be a whole number"):
        produce_history(stack_settings, config(hours=2), chunk_hours=0)


@pytest.mark.parametrize(
    ("partitions", "topic_config", "message"),
    [
        (2, {}, "partitions"),
        (3, {"message.timestamp.type": "LogAppendTime"}, "LogAppendTime"),
    ],
)
def test_generate_refuses_an_unsuitable_existing_topic(
    stack_settings: Settings,
    topic: str,
    partitions: int,
    topic_config: dict[str, str],
    message: str,
) -> None:
    create = NewTopic(topic, num_partitions=partitions, replication_factor=1, config=topic_config)
    admin = admin_for(stack_settings)
    admin.create_topics([create])[topic].result()
    with pytest.raises(GeneratorError, match=message):
        generate(stack_settings, config(topic=topic, partitions=3, hours=1, events_per_hour=50))
