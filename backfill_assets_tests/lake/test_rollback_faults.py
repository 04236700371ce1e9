"""A rollback killed at any step: the ledger and the tables never disagree, and the next
rollback or sensor tick converges (issue 30: "a rollback is not atomic with the ledger").

Each test rolls back the latest raw publish (Kafka hours 06-07, raw table only) in its own
process (``python -m backfill_assets_tests.lake.test_rollback_faults``, the runner at the bottom),
SIGKILLed at one failpoint of :func:`backfill_assets.lake.operations.rollback.rollback`:

* ``rollback_intent_recorded``: the ledger holds the intent, main has not moved. The ledger
  must still say what main holds (raw hours covered by the run whose rows are there) and no
  reader may be due; re-running the rollback completes it.
* ``rollback_table_committed``: main moved back, no ledger outcome. The ledger must already
  say the hours are gone (read through the table's commit) and every reader's hours built from
  them due; re-running the rollback refuses as already done and records the outcome.
* ``rollback_ledger_committed``: everything but the audit row.

Then what a sensor tick sees (``detect.find``) is rebuilt: raw and current, then the declared
tables once due; the ledger agrees with main and every declared table is covered again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.errors import RollbackError
from backfill_assets.spec.declared import renamed
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

    from backfill_assets.spec.model import TopicSpec
    from backfill_assets.stack.settings import Settings

pytestmark = pytest.mark.faults

START = datetime(2026, 10, 1, tzinfo=UTC)
HOURS = 8
HOUR = timedelta(hours=1)
UNDONE = {START + 6 * HOUR, START + 7 * HOUR}
RUN_TIMEOUT_S = 240


def _p(hour: int) -> str:
    return f"{START + hour * HOUR:%Y-%m-%d-%H:%M}"


def _spec(topic: str) -> TopicSpec:
    from backfill_assets.defs.definitions import SPECS

    # Partitions from the first hour of data (late events' earlier event hours are built too).
    return renamed(SPECS[0], topic=topic, partition_start=START)


@dataclasses.dataclass
class World:
    settings: Settings
    env: dict[str, str]
    spec: TopicSpec
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]
    cat: Catalog
    logs: Path

    @property
    def ns(self) -> str:
        return self.settings.catalog.namespace

    def full(self, table: str) -> str:
        return f"{self.cat.name}.{self.ns}.{table}"

    def run(self, keys: list[str], first: int, last: int) -> str:
        selection = [a for a in self.assets if a.key.to_user_string() in keys]
        result = materialize_range(selection, self.instance, _p(first), _p(last))
        assert result.success
        return result.run_id

    def covered(self, table: str) -> dict[datetime, str]:
        from backfill_assets.lake.offsets import ledger

        return {
            h: e.run_id for h, e in ledger.coverage(self.cat, self.ns, self.full(table)).items()
        }

    @property
    def raw_keys(self) -> list[str]:
        return [f"raw/{self.spec.topic}", f"lakehouse/{self.spec.topic}_current"]

    def declared_names(self) -> list[str]:
        return [t.name for t in self.spec.tables]

    @property
    def declared_keys(self) -> list[str]:
        return [f"lakehouse/{t.name}" for t in self.spec.tables]


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings,
    stack_env: dict[str, str],
    spark_session: SparkSession,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[World]:
    from backfill_assets.defs.assets import build_topic_assets
    from backfill_assets.demo.generator import GeneratorConfig, generate
    from backfill_assets.stack import catalog

    topic = f"orders_rbf_{uuid.uuid4().hex[:8]}"
    spec = _spec(topic)
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=HOURS, events_per_hour=60, seed=37),
    )
    env = {**os.environ, **stack_env}
    env.pop("BACKFILL_FAULT_POINT", None)
    with dg.instance_for_test() as instance:
        w = World(
            stack_settings,
            env,
            spec,
            instance,
            build_topic_assets(spec),
            catalog.load(stack_settings.catalog),
            tmp_path_factory.mktemp("rollback-faults"),
        )
        w.run(w.raw_keys, 0, 5)
        w.run(w.raw_keys, 6, 7)
        w.run(w.declared_keys, 0, HOURS - 1)
        _assert_agree(w)
        yield w


def _main_rows(world: World) -> dict[datetime, set[str]]:
    """Kafka hour -> the runs whose rows main of the raw table holds for it."""
    table = world.cat.load_table(f"{world.ns}.{world.spec.raw_table}")
    rows = table.scan(selected_fields=("kafka_hour", "ingest_run_id")).to_arrow().to_pylist()
    out: dict[datetime, set[str]] = {}
    for row in rows:
        out.setdefault(row["kafka_hour"].astimezone(UTC), set()).add(row["ingest_run_id"])
    return out


def _assert_agree(world: World) -> None:
    """The ledger covers exactly the raw hours main holds, each by the run whose rows it has."""
    assert {h: {r} for h, r in world.covered(world.spec.raw_table).items()} == _main_rows(world)


def _rollback_killed_at(world: World, point: str, run_id: str) -> None:
    log = world.logs / f"{point}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "backfill_assets_tests.lake.test_rollback_faults",
                "--topic",
                world.spec.topic,
                "--run",
                run_id,
                "--table",
                world.full(world.spec.raw_table),
            ],
            cwd=Path(__file__).resolve().parents[2],
            env={**world.env, "BACKFILL_FAULT_POINT": point},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started
            proc.wait()
            pytest.fail(f"rollback at {point} hung:\n{log.read_text()[-4000:]}")
    assert code == -signal.SIGKILL, f"not killed at {point} ({code}):\n{log.read_text()[-4000:]}"


def _stale_hours(world: World) -> set[datetime]:
    """Every event hour of a declared table that reads Kafka hours 06-07 (lateness 3, no
    lookback, or the event hours their rows hold), within the hours published."""
    from backfill_assets.lake.offsets import ledger

    entries = ledger.coverage(world.cat, world.ns, world.full(world.spec.raw_table))
    held = {h for k in UNDONE for h in (entries[k].event_hours or {})}
    lateness = world.spec.allowed_lateness_hours
    mapped = {k - i * HOUR for k in UNDONE for i in range(lateness + 1)}
    return (held | mapped) & {START + i * HOUR for i in range(HOURS)}


def _converge(world: World) -> None:
    """What the next sensor ticks see and request, run: raw and current gaps first, then the
    declared hours due once they are published; then nothing is due and the ledger agrees."""
    from backfill_assets.lake.coverage import detect
    from backfill_assets.stack.kafka import KafkaClient

    kafka = KafkaClient(world.settings)
    found = detect.find(kafka, world.cat, world.ns, world.spec)
    assert set(found.raw_gaps) == UNDONE
    assert set(found.current_gaps) == UNDONE
    world.run(world.raw_keys, 6, 7)
    found = detect.find(kafka, world.cat, world.ns, world.spec)
    assert not found.raw_gaps and not found.current_gaps
    due = {h for d in found.tables_due.values() for h in d}
    assert due, "the declared hours built from the undone hours are due"
    world.run(world.declared_keys, (min(due) - START) // HOUR, (max(due) - START) // HOUR)
    found = detect.find(kafka, world.cat, world.ns, world.spec)
    assert not any(found.tables_due.values())
    everything = {START + i * HOUR for i in range(HOURS)}
    for t in world.spec.tables:
        assert set(world.covered(t.name)) == everything
    _assert_agree(world)


def _latest_raw_run(world: World) -> str:
    return world.covered(world.spec.raw_table)[START + 7 * HOUR]


def _rollback_rows(world: World, table: str) -> list[dict[str, Any]]:
    from backfill_assets.lake.offsets import ledger

    return [
        r for r in ledger._rows(world.cat, world.ns, world.full(table)) if r["event"] != "publish"
    ]


def test_killed_after_the_intent_changes_nothing_and_a_rerun_completes(world: World) -> None:
    from backfill_assets.lake.operations import rollback

    run_id = _latest_raw_run(world)
    before = {t: world.covered(t) for t in (world.spec.current_table, *world.declared_names())}
    _rollback_killed_at(world, "rollback_intent_recorded", run_id)
    # The intent is in the ledger, but main did not move: the ledger still says what main holds
    # and no reader's hour became due.
    assert any(r["event"] == "rollback" for r in _rollback_rows(world, world.spec.raw_table))
    assert set(world.covered(world.spec.raw_table)) >= UNDONE
    _assert_agree(world)
    assert {t: world.covered(t) for t in before} == before
    # Running the rollback again completes it.
    rollback.rollback(
        world.cat,
        world.ns,
        run_id=run_id,
        table_name=world.full(world.spec.raw_table),
        specs=[world.spec],
    )
    _assert_rolled_back(world)
    _converge(world)


def test_killed_after_the_table_commit_the_ledger_already_agrees(world: World) -> None:
    from backfill_assets.lake.operations import rollback

    run_id = _latest_raw_run(world)
    stale = _stale_hours(world)
    known = {r["rollback_id"] for r in _rollback_rows(world, world.spec.raw_table)}
    _rollback_killed_at(world, "rollback_table_committed", run_id)
    # Main moved back and the ledger has only the intent: reading it already says so.
    assert [
        r["event"]
        for r in _rollback_rows(world, world.spec.raw_table)
        if r["rollback_id"] not in known
    ] == ["rollback"]
    _assert_rolled_back(world, stale)
    # Running the rollback again: nothing left to undo, said as such; the ledger's outcome
    # is recorded from the table's commit on the way.
    with pytest.raises(RollbackError, match="not live any more"):
        rollback.rollback(
            world.cat,
            world.ns,
            run_id=run_id,
            table_name=world.full(world.spec.raw_table),
            specs=[world.spec],
        )
    assert sorted(
        r["event"]
        for r in _rollback_rows(world, world.spec.raw_table)
        if r["rollback_id"] not in known
    ) == ["rollback", "rollback_committed"]
    _assert_rolled_back(world, stale)
    _converge(world)


def test_killed_after_the_ledger_outcome(world: World) -> None:
    run_id = _latest_raw_run(world)
    stale = _stale_hours(world)
    _rollback_killed_at(world, "rollback_ledger_committed", run_id)
    _assert_rolled_back(world, stale)
    _converge(world)


def _assert_rolled_back(world: World, stale: set[datetime] | None = None) -> None:
    _assert_agree(world)
    everything = {START + i * HOUR for i in range(HOURS)}
    assert set(world.covered(world.spec.raw_table)) == everything - UNDONE
    assert set(world.covered(world.spec.current_table)) == everything - UNDONE
    for name in world.declared_names():
        covered = set(world.covered(name))
        assert covered, name
        assert not covered & UNDONE, name
        if stale is not None:
            assert covered == everything - stale, name


# ------------------------------------------------------------------------------ the runner
def _main(argv: list[str]) -> int:
    """Roll back ``--run`` on ``--table`` (raw table of ``--topic``) in this process."""
    from backfill_assets.lake.operations import rollback
    from backfill_assets.stack import catalog
    from backfill_assets.stack.settings import Settings

    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--table", required=True)
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    results = rollback.rollback(
        catalog.load(settings.catalog),
        settings.catalog.namespace,
        run_id=args.run,
        table_name=args.table,
        specs=[_spec(args.topic)],
        launched_by="test_rollback_faults",
    )
    print("ROLLBACK-RESULT " + json.dumps([r.to_json() for r in results]), flush=True)  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
