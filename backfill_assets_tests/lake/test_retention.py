"""Retention-risk warnings name topic, hour and offsets of unmaterialized data about to leave,
and say whether it is archived."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.operations.archiver import run_archiver
from backfill_assets.spec.declared import renamed
from backfill_assets.stack import catalog
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings

START = datetime(2026, 9, 1, tzinfo=UTC)


def _set_retention(settings: Settings, topic: str, ms: int) -> None:
    admin = AdminClient(settings.kafka.client_config())
    resource = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry("retention.ms", str(ms), incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result(30)


def test_hours_about_to_leave_retention_are_reported(stack_settings: Settings) -> None:
    topic = f"ret_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(
        stack_settings, GeneratorConfig(topic=topic, start=START, hours=3, events_per_hour=30)
    )
    cat = catalog.load(stack_settings.catalog)
    ns = stack_settings.catalog.namespace
    now = datetime.now(UTC)

    # Unlimited retention: nothing is at risk.
    assert detect.find(KafkaClient(), cat, ns, spec, now=now).retention_risks == []

    # Retention such that the first hour leaves Kafka in about 2 h: within a 24 h horizon all
    # three (unmaterialized) hours are at risk, within a 2.5 h horizon only the first.
    age_of_first_hour_end = now - (START + timedelta(hours=1))
    _set_retention(
        stack_settings,
        topic,
        int((age_of_first_hour_end + timedelta(hours=2)) / timedelta(milliseconds=1)),
    )
    risks = detect.find(KafkaClient(), cat, ns, spec, now=now).retention_risks
    assert [r["hour"] for r in risks] == [
        (START + timedelta(hours=h)).isoformat() for h in range(3)
    ]
    first = risks[0]
    assert first["topic"] == topic
    assert first["offsets"] == {
        str(p): truth.hour_offsets[p][START.isoformat()]
        for p in range(6)
        if truth.hour_offsets[p][START.isoformat()][1] > truth.hour_offsets[p][START.isoformat()][0]
    }
    assert [r["archived"] for r in risks] == [False] * 3
    # Once archived, the same hours are still at risk of leaving Kafka, but say they are safe.
    run_archiver(KafkaClient(), CatalogClient(), spec)
    archived = detect.find(KafkaClient(), cat, ns, spec, now=now).retention_risks
    assert [(r["hour"], r["archived"]) for r in archived] == [(r["hour"], True) for r in risks]
    near = detect.find(
        KafkaClient(), cat, ns, spec, now=now, retention_horizon=timedelta(minutes=150)
    ).retention_risks
    assert [r["hour"] for r in near] == [START.isoformat()]
