"""Issue 30, finding 5: a topic deleted and recreated is a new log under the same name.

Real broker, real Spark runs, real catalog and ledger, the gap sensor evaluated tick by tick
against a real Dagster instance (as test_autopilot_gaps.py). Hours 0-1 are published from the
first log; the topic is deleted and recreated, and the new log gets hours 1-3. A raw run and
the gap sensor must refuse it, naming the topic, both topic ids and the adopt command; after
`adopt`, the new log's unpublished hours (2-3) are read from it, hour 1 (published from the old
log, held by the new one too) is named as not re-read, and hours 0-1 stay as they were.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import TopicCollection
from confluent_kafka.admin import AdminClient

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.sensors import REQUEST_TAG, build_gap_sensor
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.operations import rollback
from backfill_assets.ops import cli
from backfill_assets.ops.cli import common
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START = datetime(2026, 6, 1, tzinfo=UTC)


@dataclasses.dataclass
class World:
    spec: TopicSpec
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    settings: Settings
    cursor: str | None = None

    @property
    def rc(self) -> list[str]:
        return sorted([f"raw/{self.spec.topic}", f"lakehouse/{self.spec.topic}_current"])

    def h(self, hour: int) -> str:
        return (START + timedelta(hours=hour)).strftime(detect.PARTITION_FMT)

    @property
    def raw(self) -> str:
        cat = catalog.load(self.settings.catalog)
        return f"{cat.name}.{self.settings.catalog.namespace}.{self.spec.raw_table}"

    def rows(self) -> list[dict[str, Any]]:
        """The raw table's ledger rows, oldest first."""
        cat = catalog.load(self.settings.catalog)
        table = cat.load_table(f"{self.settings.catalog.namespace}.backfill_ledger")
        rows = table.scan(row_filter=f"table_name == '{self.raw}'").to_arrow().to_pylist()
        return sorted(rows, key=lambda r: (r["recorded_at"], str(r["hour"])))

    def main_snapshot(self) -> int | None:
        cat = catalog.load(self.settings.catalog)
        ident = f"{self.settings.catalog.namespace}.{self.spec.raw_table}"
        return cat.load_table(ident).metadata.current_snapshot_id


def _tick(world: World) -> tuple[list[tuple[str, list[str], str, str]], str | None]:
    sensor = build_gap_sensor(world.spec)
    context = dg.build_sensor_context(
        instance=world.instance,
        cursor=world.cursor,
        resources=RESOURCES,
        definitions=dg.Definitions(assets=world.assets, sensors=[sensor], resources=RESOURCES),
    )
    data = sensor.evaluate_tick(context)
    world.cursor = data.cursor
    out = [
        (
            req.tags[REQUEST_TAG].split(":")[0],
            sorted(k.to_user_string() for k in req.asset_selection or []),
            req.tags["dagster/asset_partition_range_start"],
            req.tags["dagster/asset_partition_range_end"],
        )
        for req in data.run_requests or []
    ]
    return sorted(out), data.skip_message


def _run(world: World, first: str, last: str, *, ok: bool = True) -> dg.ExecuteInProcessResult:
    selection = [a for a in world.assets if a.key.to_user_string() in world.rc]
    result = materialize_range(selection, world.instance, first, last, raise_on_error=False)
    assert result.success is ok
    return result


def _recreate(settings: Settings, topic: str) -> None:
    """Delete ``topic`` and wait until the broker lets it be created again."""
    admin = AdminClient(settings.kafka.client_config())
    admin.delete_topics([topic], operation_timeout=30)[topic].result()
    deadline = time.monotonic() + 60
    while topic in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline, "the topic was not deleted"
        time.sleep(0.5)


def _topic_id(settings: Settings, topic: str) -> str:
    """The topic's id, asked of the broker here (not through the code under test)."""
    admin = AdminClient(settings.kafka.client_config())
    return str(admin.describe_topics(TopicCollection([topic]))[topic].result().topic_id)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Exit status and stdout (+ stderr unless --json)."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out if "--json" in args else out + err


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"recreated_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, partition_start=START, tables=())
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=3, partitions=2, events_per_hour=30),
    )
    with dg.instance_for_test() as instance:
        yield World(spec, instance, build_topic_assets(spec), stack_settings)


@pytest.fixture
def the_spec(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's spec: the world's topic only."""
    monkeypatch.setattr(common, "specs", lambda: {world.spec.topic: world.spec})


def test_recreated_topic_is_refused_until_adopted(
    world: World, capsys: pytest.CaptureFixture[str], the_spec: None
) -> None:
    topic = world.spec.topic
    _run(world, world.h(0), world.h(1))
    old = _topic_id(world.settings, topic)
    before_rows, before_main = world.rows(), world.main_snapshot()
    assert {r["hour"].astimezone(UTC) for r in before_rows} == {
        START,
        START + timedelta(hours=1),
    }

    _recreate(world.settings, topic)
    generate(
        world.settings,
        GeneratorConfig(
            topic=topic,
            start=START + timedelta(hours=1),
            hours=3,
            partitions=2,
            events_per_hour=25,
            seed=99,
        ),
    )
    new = _topic_id(world.settings, topic)
    assert new != old
    wanted = [
        f"topic {topic!r}",
        f"old topic id {old}",
        f"new topic id {new}",
        "nothing was published",
        f"backfill-assets adopt --topic {topic}",
    ]

    # (a) A raw run is refused with that one message; main and the ledger are unchanged.
    result = _run(world, world.h(2), world.h(3), ok=False)
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error is not None
    message = error.message
    for text in wanted:
        assert text in message, (text, message)
    assert "Traceback" not in message and "WindowError" not in message
    assert world.rows() == before_rows
    assert world.main_snapshot() == before_main

    # (b) The gap sensor requests nothing, tick after tick, and says why.
    for _ in range(2):
        requests, skip = _tick(world)
        assert requests == []
        assert skip is not None
        for text in wanted:
            assert text in skip, (text, skip)

    # (c) `gaps` says so first, with the adopt command, and exits "refused" (4).
    code, out = _cli(capsys, "gaps", "--topic", topic)
    assert code == common.Exit.FAILED, out
    assert out.index("REFUSED") < out.index("Kafka hours checked")
    for text in wanted:
        assert text in " ".join(out.split()), (text, out)

    # adopt --dry-run records nothing; adopt names the hour it does not re-read.
    code, out = _cli(capsys, "adopt", "--topic", topic, "--dry-run")
    assert code == 0, out
    assert world.rows() == before_rows
    code, out = _cli(capsys, "adopt", "--topic", topic, "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["adopted"] is True and doc["new"]["topic_id"] == new
    hour1 = (START + timedelta(hours=1)).isoformat()
    (item,) = doc["not_re_read"]
    assert item["hours"] == [hour1]
    assert f"backfill-assets rollback --run {before_rows[0]['run_id']}" in item["rollback"]
    assert doc["to_read"] == [(START + timedelta(hours=h)).isoformat() for h in (2, 3)]

    # (d) The sensor now requests exactly the new log's unpublished hours; a run publishes
    # them with the new log's record counts, and hours 0-1 keep their rows.
    requests, _ = _tick(world)
    assert requests == [("raw", world.rc, world.h(2), world.h(3))]
    _run(world, world.h(2), world.h(3))
    rows = world.rows()
    assert all(r in rows for r in before_rows)
    assert not [r for r in rows if r["event"] == "rollback"]
    kafka = KafkaClient()
    bounds = [START + timedelta(hours=h) for h in (2, 3, 4)]
    at = kafka.offsets_for_many(topic, [int(b.timestamp() * 1000) for b in bounds])
    stamps = [int(b.timestamp() * 1000) for b in bounds]
    for i, hour in enumerate(bounds[:2]):
        (row,) = [r for r in rows if r["event"] == "publish" and r["hour"] == hour]
        expected = sum(at[stamps[i + 1]][p] - at[stamps[i]][p] for p in at[stamps[i]])
        assert row["records"] == expected > 0
        assert row["topic_id"] == new
    assert _tick(world)[0] == []
    code, out = _cli(capsys, "gaps", "--topic", topic)
    assert code == common.Exit.NOT_OK, out
    assert "NOT RE-READ" in out and hour1 in out


# slow tier (CI runs it): ~46 s; added time in the default tier (JSON Schema topics) moved out.
@pytest.mark.slow
def test_stale_hour_says_why_in_gaps(
    stack_settings: Settings,
    spark_session: SparkSession,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = f"stale_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    monkeypatch.setattr(common, "specs", lambda: {topic: spec})
    generate(stack_settings, GeneratorConfig(topic=topic, start=START, hours=2, events_per_hour=30))
    with dg.instance_for_test() as instance:
        world = World(spec, instance, build_topic_assets(spec), stack_settings)
        raw_run = _run(world, world.h(0), world.h(1)).run_id
        tables = [a for a in world.assets if a.key.to_user_string().startswith("lakehouse/")]
        tables = [a for a in tables if not a.key.to_user_string().endswith("_current")]
        materialize_range(tables, instance, world.h(0), world.h(1))
        cat = catalog.load(stack_settings.catalog)
        ns = stack_settings.catalog.namespace
        done = rollback.rollback(cat, ns, run_id=raw_run, specs=[spec])
        # Put the raw hours back, so the declared hours are due (not waiting on raw).
        _run(world, world.h(0), world.h(1))
    stale = ledger.stale(cat, ns, f"{cat.name}.{ns}.{spec.tables[0].name}")
    assert stale, done
    code, out = _cli(capsys, "gaps", "--topic", topic)
    flat = " ".join(out.split())
    assert code == common.Exit.NOT_OK, out
    assert f"of table {spec.raw_table} undid rows it read" in flat, out
    assert "the gap sensor" in flat and "rebuilds it, or run:" in flat, out
