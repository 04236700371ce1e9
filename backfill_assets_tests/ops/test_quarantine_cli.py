"""Issue 48, item 3: quarantine you can work off.

A topic's records of an unknown schema version (9) are quarantined with the other malformed
ones. ``backfill-assets quarantine`` lists them by hour and reason with their first offsets;
after the fix (the spec learns version 9), ``quarantine --reason unknown_schema_version
--rerun`` re-runs exactly the hours holding them through the usual branch, checks and publish,
and reports that they moved into the table, the other reasons stayed, and every other row is
as it was. Real broker, Spark runs, catalog and Dagster instance; the CLI in process.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, TopicPartition

from backfill_assets.defs.assets import quarantine_asset_key
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.ops import cli
from backfill_assets.ops.cli import common
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 4, 24, tzinfo=UTC)
V2_HOUR = START + timedelta(hours=3)  # the generator writes v2 in the second half of 4 hours
ORDERS = "backfill_assets.spec.transforms.orders"


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = cli.main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _v9_offsets(settings: Settings, topic: str, start: int, end: int) -> list[int]:
    """Partition 0's offsets in ``[start, end)`` whose value is JSON with schema_version 9."""
    consumer = Consumer(
        {**settings.kafka.client_config(), "group.id": "t", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, 0, start)])
    out = []
    try:
        for _ in range(start, end):
            msg = consumer.poll(10)
            assert msg is not None and msg.error() is None
            try:
                value = json.loads(msg.value() or b"null")
            except ValueError:
                continue
            if isinstance(value, dict) and value.get("schema_version") == 9:
                out.append(int(msg.offset()))  # type: ignore[arg-type]
    finally:
        consumer.close()
    return out


@pytest.mark.slow  # two Spark runs through the CLI, ~60 s
def test_quarantine_is_listed_and_its_hours_rerun_after_a_fix(
    stack_settings: Settings,
    spark_session: SparkSession,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    topic = f"qwork_{uuid.uuid4().hex[:8]}"
    spec = renamed(
        SPECS[0], topic=topic, partition_start=START, tables=(), quarantine_max_ratio=0.5
    )
    truth = generate(
        stack_settings,
        GeneratorConfig(
            topic=topic, start=START, hours=4, partitions=1, events_per_hour=200,
            malformed_share=0.08, seed=11,
        ),
    )  # fmt: skip
    start, end = truth.hour_offsets[0][V2_HOUR.isoformat()]
    v9 = _v9_offsets(stack_settings, topic, start, end)
    assert v9, "the generator wrote no version-9 record in the hour"
    specs: dict[str, TopicSpec] = {topic: spec}
    monkeypatch.setattr(common, "specs", lambda: specs)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    hour = V2_HOUR.isoformat()
    code, doc = _cli(capsys, "materialize", "--topic", topic, "--start", hour,
                     "--end", (V2_HOUR + timedelta(hours=1)).isoformat())  # fmt: skip
    assert code == 0 and doc["succeeded"]

    code, listed = _cli(capsys, "quarantine", "--topic", topic)
    assert code == 0
    by_reason = {g["reason"]: g for g in listed["groups"]}
    assert by_reason["unknown_schema_version:9"]["records"] == len(v9)
    assert by_reason["unknown_schema_version:9"]["first_offsets"] == {"0": v9[0]}
    assert {g["hour"] for g in listed["groups"]} == {hour}
    others = {r: g["records"] for r, g in by_reason.items() if r != "unknown_schema_version:9"}
    assert others, "the generator wrote no other malformed record in the hour"
    # The quarantine table is an asset: the raw publish observed its per-reason counts.
    with dg.DagsterInstance.get() as instance:
        found = instance.fetch_observations(quarantine_asset_key(spec), limit=1).records
    assert found and found[0].asset_observation is not None
    reasons = found[0].asset_observation.metadata["reasons"].value
    assert reasons == {r: g["records"] for r, g in by_reason.items()}

    # The fix: the spec reads version 9 as version 2.
    specs[topic] = renamed(
        spec,
        topic=topic,
        upcasters={**spec.upcasters, 9: f"{ORDERS}:upcast_v2"},
        decoders={**spec.decoders, 9: f"{ORDERS}:decode_v2"},
    )
    code, rerun = _cli(capsys, "quarantine", "--topic", topic,
                       "--reason", "unknown_schema_version", "--rerun")  # fmt: skip
    assert code == 0, rerun
    moved = rerun["moved"]
    assert moved["moved_to_table"] == [f"0:{o}" for o in v9]
    assert moved["newly_quarantined"] == [] and moved["left_quarantine_without_a_row"] == []
    assert moved["still_quarantined"] == others
    assert moved["other_rows_unchanged"] is True
    assert [r["first"] for r in rerun["runs"] if "raw" in r["assets"][0]] == [
        V2_HOUR.strftime("%Y-%m-%d-%H:%M")
    ]
    table = f"lake.{stack_settings.catalog.namespace}.{spec.raw_table}"
    got = spark_session.table(table).where(f"kafka_offset IN ({', '.join(map(str, v9))})")
    assert sorted(r["kafka_offset"] for r in got.collect()) == v9
    code, after = _cli(capsys, "quarantine", "--topic", topic)
    assert "unknown_schema_version:9" not in {g["reason"] for g in after["groups"]}

    # Raw bytes are kept for BACKFILL_QUARANTINE_BYTES_DAYS: maintenance then drops them and
    # keeps each record's hash and byte lengths.
    qtable = f"lake.{stack_settings.catalog.namespace}.{spec.quarantine_table}"
    columns = "kafka_offset, record_hash, length(kafka_key) AS k, length(kafka_value) AS v"
    before = {
        r[0]: tuple(r[1:]) for r in spark_session.sql(f"SELECT {columns} FROM {qtable}").collect()
    }
    assert before and all(v is not None for _, _, v in before.values())
    for step in ("COMPACTION", "EXPIRE", "ORPHANS", "BRANCHES"):
        monkeypatch.setenv(f"BACKFILL_MAINTENANCE_{step}", "false")
    monkeypatch.setenv("BACKFILL_QUARANTINE_BYTES_DAYS", "0")
    code = cli.main(["maintain", "--table", spec.quarantine_table])
    printed = capsys.readouterr()
    assert code == 0, printed
    assert "quarantine_bytes" in printed.out + printed.err
    spark_session.catalog.refreshTable(qtable)
    kept = spark_session.sql(
        f"SELECT kafka_offset, record_hash, key_bytes, value_bytes, kafka_key, kafka_value "
        f"FROM {qtable}"
    ).collect()
    assert {r[0]: (r[1], r[2], r[3]) for r in kept} == before
    assert all(r["kafka_key"] is None and r["kafka_value"] is None for r in kept)
    code, listed_after = _cli(capsys, "quarantine", "--topic", topic)
    assert listed_after["groups"] == after["groups"]
