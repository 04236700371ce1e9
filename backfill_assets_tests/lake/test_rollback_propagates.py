"""Rollback propagates (issue 30, item 4): rolling back a raw run's hours makes every table
that read them due again (the current state and every declared table whose event hours map to
them), the dry run lists them, and once rebuilt the declared table equals the ground truth.

Before the fix, the dry run listed only the tables the run published to, the current state and
the declared tables kept their ledger coverage of rows built from the undone hours, and
``gaps`` said no table was due.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.operations import rollback
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

START = datetime(2026, 9, 1, tzinfo=UTC)
HOURS = 8
HOUR = timedelta(hours=1)


def _at(hour: int) -> datetime:
    return START + timedelta(hours=hour)


def _p(hour: int) -> str:
    return f"{_at(hour):%Y-%m-%d-%H:%M}"


@dataclasses.dataclass
class World:
    spec: TopicSpec
    truth: GroundTruth
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    cat: Catalog
    ns: str

    def full(self, table: str) -> str:
        return f"{self.cat.name}.{self.ns}.{table}"

    def run(self, keys: list[str], first: int, last: int) -> str:
        selection = [a for a in self.assets if a.key.to_user_string() in keys]
        result = materialize_range(selection, self.instance, _p(first), _p(last))
        assert result.success
        return result.run_id

    def covered(self, table: str) -> set[datetime]:
        return set(ledger.coverage(self.cat, self.ns, self.full(table)))

    def find(self, settings: Settings) -> detect.Findings:
        return detect.find(KafkaClient(settings), self.cat, self.ns, self.spec)


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"orders_rb_{uuid.uuid4().hex[:8]}"
    # Partitions from the first hour of data: the event hours of late events before it (which
    # the declared tables build once their Kafka hours are published) are not what this tests.
    spec = renamed(SPECS[0], topic=topic, partition_start=START)
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=HOURS, events_per_hour=80, seed=31),
    )
    with dg.instance_for_test() as instance:
        yield World(
            spec,
            truth,
            instance,
            build_topic_assets(spec),
            catalog.load(stack_settings.catalog),
            stack_settings.catalog.namespace,
        )


def _hourly_equals_truth(world: World, spark: SparkSession, table: str) -> None:
    """Every event hour of the declared hourly table whose events all reached Kafka by hour
    HOURS - 1 equals the generator's ground truth (events and amount per currency)."""
    rows = spark.table(world.full(table)).collect()
    got = {
        (r["event_hour"].astimezone(UTC).isoformat(), r["currency"]): (
            r["events"],
            r["amount_minor"],
        )
        for r in rows
        if r["event_hour"].astimezone(UTC) < _at(HOURS - world.spec.allowed_lateness_hours)
    }
    want = {
        (hour, cur): (v["events"], v["amount_minor"])
        for hour, by_cur in world.truth.event_hours.items()
        if START <= datetime.fromisoformat(hour) < _at(HOURS - world.spec.allowed_lateness_hours)
        for cur, v in by_cur.items()
    }
    assert want and got == want


# Long (2-4 min): in the slow tier, which CI runs, to keep the default tier near 20 min.
@pytest.mark.slow
def test_rollback_of_raw_hours_makes_every_reader_due(
    world: World, stack_settings: Settings, spark_session: SparkSession
) -> None:
    spec = world.spec
    raw, current = f"raw/{spec.topic}", f"lakehouse/{spec.topic}_current"
    tables = [t.name for t in spec.tables]
    keys = [f"lakehouse/{t}" for t in tables]
    hourly = next(t for t in tables if t.endswith("_hourly"))

    # Raw and current published by three runs; the one to undo, the latest, published Kafka
    # hours 05-06.
    world.run([raw, current], 0, 4)
    world.run([raw, current], 7, 7)
    undone_run = world.run([raw, current], 5, 6)
    world.run(keys, 0, HOURS - 1)
    everything = {_at(h) for h in range(HOURS)}
    for table in (spec.raw_table, spec.current_table, *tables):
        assert world.covered(table) == everything, table
    found = world.find(stack_settings)
    assert not found.raw_gaps and not found.current_gaps
    assert not any(found.tables_due.values())

    # The hours each reader built from Kafka hours 05-06: the current state's same hours; a
    # declared table's event hours 05-lateness .. 06 (no lookback), and the event hours the
    # undone rows hold.
    lateness = spec.allowed_lateness_hours
    raw_entries = ledger.coverage(world.cat, world.ns, world.full(spec.raw_table))
    held = {h for k in (5, 6) for h in (raw_entries[_at(k)].event_hours or {})}
    mapped = {_at(h) for h in range(5 - lateness, 7)}
    assert held and held <= everything
    want_declared = sorted((mapped | held) & everything)

    # The dry run (raw table only, as an operator undoing a bad raw publish) lists every
    # reader and the hours it makes due; it changes nothing.
    plan = rollback.plan_rollback(
        world.cat,
        world.ns,
        run_id=undone_run,
        table_name=world.full(spec.raw_table),
        specs=[spec],
    )
    assert [r.table_name for r in plan] == [world.full(spec.raw_table)]
    assert [h.hour for h in plan[0].partitions] == [_at(5), _at(6)]
    stale = {r.table_name: r.hours for r in plan[0].stale_readers}
    assert stale == {
        world.full(spec.current_table): [_at(5), _at(6)],
        **{world.full(t): want_declared for t in tables},
    }
    assert plan[0].to_json()["stale_readers"][0]["hours"] == [
        _at(5).isoformat(),
        _at(6).isoformat(),
    ]
    assert world.covered(spec.current_table) == everything

    done = rollback.rollback(
        world.cat,
        world.ns,
        run_id=undone_run,
        table_name=world.full(spec.raw_table),
        specs=[spec],
    )
    assert {r.table_name: r.hours for r in done[0].stale_readers} == stale

    # The ledger no longer covers what was built from the undone hours, in any table.
    assert world.covered(spec.raw_table) == everything - {_at(5), _at(6)}
    assert world.covered(spec.current_table) == everything - {_at(5), _at(6)}
    for table in tables:
        assert world.covered(table) == everything - set(want_declared), table
        reasons = ledger.stale(world.cat, world.ns, world.full(table))
        assert set(reasons) == set(want_declared)
        assert (
            f"of table {spec.raw_table} undid rows it read (run(s) {undone_run})"
            in (reasons[_at(5)])
        )

    # What the sensors see: the raw and current gaps now; each declared hour waits until the
    # raw hours it reads are published again, then is due.
    found = world.find(stack_settings)
    assert found.raw_gaps == [_at(5), _at(6)]
    assert found.current_gaps == [_at(5), _at(6)]
    assert not any(found.tables_due.values())
    world.run([raw, current], 5, 6)
    found = world.find(stack_settings)
    assert not found.raw_gaps and not found.current_gaps
    assert {t: sorted(d) for t, d in found.tables_due.items()} == {t: want_declared for t in tables}
    world.run(keys, (want_declared[0] - START) // HOUR, (want_declared[-1] - START) // HOUR)
    found = world.find(stack_settings)
    assert not any(found.tables_due.values())
    for table in tables:
        assert world.covered(table) == everything
    _hourly_equals_truth(world, spark_session, hourly)
