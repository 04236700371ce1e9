"""A topic named the way real estates name them (dots, a hyphen, capitals) works end to end
(issue 48 item 1): its gap sensor asks for its hours, the runs publish them, a rollback undoes
them and the sensor asks again, and ``backfill-assets gaps --topic <real name>`` reports them.
Kafka is read by the real name; tables, asset keys and sensors carry the derived identifier.
Real broker, Spark, catalog and Dagster instance.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
import yaml

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import build_gap_sensor, gap_sensor_name
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.operations import rollback
from backfill_assets.ops import cli
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import SPEC_PATH
from backfill_assets.stack import catalog
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

START = datetime(2026, 7, 14, tzinfo=UTC)


def _tick(
    sensor: dg.SensorDefinition, assets: list[dg.AssetsDefinition], instance: dg.DagsterInstance
) -> list[tuple[list[str], str, str]]:
    context = dg.build_sensor_context(
        instance=instance,
        resources=RESOURCES,
        definitions=dg.Definitions(assets=assets, sensors=[sensor], resources=RESOURCES),
    )
    out = []
    for req in sensor.evaluate_tick(context).run_requests or []:
        keys = sorted(k.to_user_string() for k in req.asset_selection or [])
        out.append(
            (
                keys,
                req.tags["dagster/asset_partition_range_start"],
                req.tags["dagster/asset_partition_range_end"],
            )
        )
    return sorted(out)


def _h(hour: int) -> str:
    return (START + timedelta(hours=hour)).strftime("%Y-%m-%d-%H:%M")


def test_a_dotted_hyphenated_capitalised_topic_works_end_to_end(
    stack_settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    suffix = uuid.uuid4().hex[:8]
    topic = f"Shop.Orders-{suffix}.v1"
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    name = f"shop_orders_{suffix}_v1"
    assert (spec.name, spec.raw_table) == (name, f"raw_{name}")
    assert gap_sensor_name(spec) == f"{name}_offset_gaps"
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=3, events_per_hour=40, partitions=2),
    )
    assert truth.kafka_hours, "the generator wrote records"
    assets = build_topic_assets(spec)
    raw, current = f"raw/{name}", f"lakehouse/{name}_current"
    sensor = build_gap_sensor(spec)

    with dg.instance_for_test() as instance:
        # The Kafka hours that hold records are gaps, requested under the identifier's keys.
        assert _tick(sensor, assets, instance) == [([current, raw], _h(0), _h(2))]
        selection = [a for a in assets if a.key.to_user_string() in (raw, current)]
        run = materialize_range(selection, instance, _h(0), _h(2))
        assert run.success
        rows = (
            CatalogClient()
            .catalog()
            .load_table(f"{stack_settings.catalog.namespace}.{spec.raw_table}")
            .scan()
            .to_arrow()
        )
        assert rows.num_rows > 0 and set(rows.column("topic").to_pylist()) == {topic}
        assert all(req[0] != [current, raw] for req in _tick(sensor, assets, instance))

        # Rolled back, the hours are gaps again.
        cat = catalog.load(stack_settings.catalog)
        ns = stack_settings.catalog.namespace
        full = f"{cat.name}.{ns}.{spec.raw_table}"
        rollback.rollback(cat, ns, run_id=run.run_id, table_name=full, specs=[spec])
        assert ([current, raw], _h(0), _h(2)) in _tick(sensor, assets, instance)

    # The CLI by the real name (the spec file as a team writes it: no tables, default name).
    doc = yaml.safe_load(SPEC_PATH.read_text())
    entry = {**doc["topics"][0], "topic": topic, "partition_start": START.isoformat()}
    entry.pop("tables")
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump({"topics": [entry]}))
    monkeypatch.setenv("BACKFILL_SPEC", str(path))
    code = cli.main(["gaps", "--topic", topic, "--json"])
    out = capsys.readouterr().out
    assert code == 1, out  # 1: something is due
    found = json.loads(out)
    assert found["topic"] == topic
    assert found["raw_gaps"][0]["start"] == START.isoformat()
    assert f"--topic {topic} " in found["raw_gaps"][0]["fill"]
