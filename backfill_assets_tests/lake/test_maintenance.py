"""Table maintenance expires, compacts, removes orphans and drops failed runs' branches without
changing any table's content or what the gap detection reports; rollback keeps working inside
the snapshot retention and fails naming the expired snapshot outside it; publishing goes on."""

from __future__ import annotations

import dataclasses
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_raw_asset, build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.maintenance import build_maintenance_defs, maintenance_targets
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.errors import MaintenanceError, RollbackError
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.offsets import ledger
from backfill_assets.lake.operations import maintenance, rollback
from backfill_assets.lake.write import audit
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import MaintenanceSettings, Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.slow

START = datetime(2026, 5, 1, tzinfo=UTC)
NOW = START + timedelta(hours=9)  # detect.find's clock: every generated hour has closed
ZERO = MaintenanceSettings(
    snapshot_retention=timedelta(0),
    min_snapshots=1,
    orphan_retention=timedelta(0),
    branch_retention=timedelta(0),
)


@dataclasses.dataclass
class World:
    spec: TopicSpec
    settings: Settings
    cat: Catalog
    instance: dg.DagsterInstance
    assets: list[dg.AssetsDefinition]

    def name(self, table: str) -> str:
        return f"{self.settings.catalog.name}.{self.settings.catalog.namespace}.{table}"

    @property
    def tables(self) -> list[str]:
        """The spec's tables this test has written (it leaves the large-payments one out)."""
        s = self.spec
        every = [s.raw_table, s.quarantine_table, s.current_table, *(t.name for t in s.tables)]
        ns = self.settings.catalog.namespace
        return [t for t in every if self.cat.table_exists(f"{ns}.{t}")]


def _run(
    world: World, assets: list[dg.AssetsDefinition], first: str, last: str
) -> dg.ExecuteInProcessResult:
    return materialize_range(assets, world.instance, first, last, raise_on_error=False)


def _raw_current(world: World) -> list[dg.AssetsDefinition]:
    return [a for a in world.assets if a.key.path[0] == "raw" or a.key.path[-1].endswith("current")]


def _hourly(world: World) -> list[dg.AssetsDefinition]:
    return [a for a in world.assets if a.key.path[-1] == f"{world.spec.topic}_hourly"]


@pytest.fixture(scope="module")
def world(stack_settings: Settings, spark_session: SparkSession) -> Iterator[World]:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=5, events_per_hour=120, seed=3),
    )
    with dg.instance_for_test() as instance:
        yield World(
            spec,
            stack_settings,
            catalog.load(stack_settings.catalog),
            instance,
            build_topic_assets(spec),
        )


def _content(spark: SparkSession, table: str, *without: str) -> list[str]:
    rows = spark.table(table).drop(*without).collect()
    return sorted(repr(sorted(r.asDict().items())) for r in rows)


def _refs(spark: SparkSession, table: str) -> set[str]:
    return {r["name"] for r in spark.sql(f"SELECT name FROM {table}.refs").collect()}


def _findings(world: World) -> tuple[Any, Any]:
    ns = world.settings.catalog.namespace
    found = detect.find(KafkaClient(), world.cat, ns, world.spec, specs=[world.spec], now=NOW)
    late = detect.late_event_hours(world.cat, ns, world.spec, now=NOW)
    return found, late


def _ledger(world: World, table: str) -> list[Any]:
    ns = world.settings.catalog.namespace
    return ledger.publishes(world.cat, ns, world.name(table))


def test_maintenance_keeps_content_coverage_and_publishing(
    world: World, spark_session: SparkSession
) -> None:
    spark, ns = spark_session, world.settings.catalog.namespace
    raw = world.name(world.spec.raw_table)
    first = _run(world, _raw_current(world), "2026-05-01-00:00", "2026-05-01-01:00")
    assert first.success, first.all_events
    second = _run(world, _raw_current(world), "2026-05-01-02:00", "2026-05-01-04:00")
    assert second.success, second.all_events
    hourly = _run(world, _hourly(world), "2026-05-01-00:00", "2026-05-01-01:00")
    assert hourly.success, hourly.all_events
    # A failed run: its blocking check fails, its branch is kept for inspection.
    strict = world.spec.model_copy(update={"quarantine_max_ratio": 0.0})
    failed = _run(world, [build_raw_asset(strict)], "2026-05-01-00:00", "2026-05-01-01:00")
    assert not failed.success
    failed_branch = f"audit_{failed.run_id.replace('-', '_')}"
    # A branch of a run that may still be running (no commit yet, no outcome recorded).
    live_branch = f"audit_{str(uuid.uuid4()).replace('-', '_')}"
    spark.sql(f"ALTER TABLE {raw} CREATE BRANCH `{live_branch}`").collect()
    assert {failed_branch, live_branch} <= _refs(spark, raw)
    # A stray file of a failed write, referenced by no snapshot.
    location = Path(urlparse(world.cat.load_table(f"{ns}.{world.spec.raw_table}").location()).path)
    some_file = next((location / "data").rglob("*.parquet"))
    stray = location / "data" / "stray-orphan.parquet"
    shutil.copy(some_file, stray)

    contents = {t: _content(spark, world.name(t)) for t in world.tables}
    raw_rows = _content(spark, raw, "ingest_run_id")
    ledgers = {t: _ledger(world, t) for t in world.tables}
    findings = _findings(world)
    snapshots = {t: len(world.cat.load_table(f"{ns}.{t}").metadata.snapshots) for t in world.tables}
    audit_before = audit.query(world.cat, ns)
    time.sleep(0.01)  # every commit above is strictly older than the pass's clock

    zero = dataclasses.replace(world.settings, maintenance=ZERO)
    assert len(world.tables) == 4
    with pytest.raises(MaintenanceError, match="does not exist"):
        maintenance.maintain(spark, zero, f"{world.spec.topic}_large_paid")
    said: list[str] = []
    reports = {
        t: maintenance.maintain(spark, zero, t, progress=said.append)
        for t in [*world.tables, audit.AUDIT_TABLE, ledger.LEDGER_TABLE]
    }
    assert said and any("expire_snapshots" in line for line in said)
    for rep in reports.values():
        assert rep.ok, rep.summary()
        assert rep.as_dict()["steps"]["expire_snapshots"]["ran"]
    r = reports[world.spec.raw_table]
    # Every step did something.
    assert r.count("expire_snapshots", "snapshots_expired") > 0, r.summary()
    assert r.count("drop_branches", "dropped") == 1, r.summary()
    assert r.count("drop_branches", "kept") == 1, r.summary()
    assert r.count("remove_orphans", "orphan_files_removed") >= 1, r.summary()
    assert r.count("compact", "manifests_rewritten") >= 1 or r.count("compact", "manifests_added")
    assert sum(rep.count("compact", "data_files_rewritten") for rep in reports.values()) > 0
    assert reports[audit.AUDIT_TABLE].count("compact", "data_files_rewritten") > 1
    assert not stray.exists()
    refs = _refs(spark, raw)
    assert failed_branch not in refs and "main" in refs
    assert live_branch in refs, "a branch whose run may still be running is kept"
    for t in world.tables:
        after = len(world.cat.load_table(f"{ns}.{t}").metadata.snapshots)
        assert after < snapshots[t] or snapshots[t] <= 2, (t, snapshots[t], after)

    # Content, coverage and gap findings are exactly what they were.
    for t in world.tables:
        assert _content(spark, world.name(t)) == contents[t], t
        assert _ledger(world, t) == ledgers[t], t
    assert _findings(world) == findings

    # The audit table has one row per pass, and everything it had before.
    audit_after = audit.query(world.cat, ns)
    passes = [row for row in audit_after if row["event"] == "maintenance"]
    assert {row["table_name"] for row in passes} == {
        world.name(t) for t in [*world.tables, audit.AUDIT_TABLE, ledger.LEDGER_TABLE]
    }
    raw_pass = next(row for row in passes if row["table_name"] == raw)
    assert raw_pass["outcome"] == "succeeded" and '"snapshots_expired"' in raw_pass["detail"]
    ids_before = {row["audit_id"] for row in audit_before}
    assert ids_before <= {row["audit_id"] for row in audit_after}

    # Outside the retention (zero here), main before the last publish has expired: rollback
    # says so, naming the snapshot, and changes nothing.
    publish_row = next(
        row
        for row in audit.query(world.cat, ns, table_name=raw, run_id=second.run_id)
        if row["event"] == "publish"
    )
    with pytest.raises(RollbackError, match="expired by table maintenance") as err:
        rollback.rollback(world.cat, ns, run_id=second.run_id, table_name=raw)
    assert str(publish_row["snapshot_before"]) in str(err.value)
    assert _content(spark, raw) == contents[world.spec.raw_table]

    # Publishing goes on after a compaction and expiry on main.
    before_republish = datetime.now(UTC)
    again = _run(world, _raw_current(world), "2026-05-01-00:00", "2026-05-01-01:00")
    assert again.success, again.all_events
    # The same rows, now carrying the new run's id.
    assert _content(spark, raw, "ingest_run_id") == raw_rows

    # Inside the retention, main before a publish is kept even when older than the cutoff and
    # beyond min_snapshots, so that publish can still be rolled back.
    window = dataclasses.replace(
        ZERO, snapshot_retention=datetime.now(UTC) - before_republish, compact=False
    )
    kept = maintenance.maintain(spark, dataclasses.replace(world.settings, maintenance=window), raw)
    assert kept.ok and kept.count("expire_snapshots", "protected") >= 1, kept.summary()
    results = rollback.rollback(world.cat, ns, run_id=again.run_id, table_name=raw)
    assert [res.table_name for res in results] == [raw]
    assert _content(spark, raw) == contents[world.spec.raw_table]
    assert _findings(world) == findings

    # The scheduled job runs the same pass and puts its report on the run and on the asset.
    jobs, _ = build_maintenance_defs([world.spec])
    job = next(j for j in jobs if j.name == f"maintain_{world.spec.raw_table}")
    result = job.execute_in_process(resources=RESOURCES, instance=world.instance)
    assert result.success
    observed = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    assert [e.asset_key for e in observed] == [dg.AssetKey(["raw", world.spec.topic])]
    assert result.output_for_node(f"{job.name}_pass")[world.spec.raw_table]["ok"] is True
    last = audit.query(world.cat, ns, table_name=raw, run_id=result.run_id)
    assert [row["event"] for row in last] == ["maintenance"]


def test_jobs_and_schedules_cover_every_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_MAINTENANCE_CRON", "41 4 * * *")
    monkeypatch.setenv("BACKFILL_MAINTENANCE_SCHEDULES", "off")
    jobs, schedules = build_maintenance_defs(SPECS)
    spec = SPECS[0]
    names = {j.name for j in jobs}
    for table in [spec.raw_table, spec.quarantine_table, spec.current_table]:
        assert f"maintain_{table}" in names
    for t in spec.tables:
        assert f"maintain_{t.name}" in names
    assert "maintain_bookkeeping" in names
    assert len(schedules) == len(jobs) == len(maintenance_targets(SPECS))
    for s in schedules:
        assert s.cron_schedule == "41 4 * * *"
        assert s.default_status == dg.DefaultScheduleStatus.STOPPED


def test_settings_refuse_unsafe_orphan_retention() -> None:
    from backfill_assets.errors import SettingsError

    env = {"BACKFILL_HOME": "/tmp/x", "BACKFILL_MAINTENANCE_ORPHAN_RETENTION_HOURS": "1"}
    with pytest.raises(SettingsError, match="ORPHAN_RETENTION_HOURS='1' is below 24"):
        Settings.from_env(env)
    ok = Settings.from_env({**env, "BACKFILL_MAINTENANCE_ORPHAN_RETENTION_HOURS": "48"})
    assert ok.maintenance.orphan_retention == timedelta(hours=48)
    assert Settings.from_env({"BACKFILL_HOME": "/tmp/x"}).maintenance == MaintenanceSettings()
