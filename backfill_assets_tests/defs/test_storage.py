"""The local default's Dagster storage (backfill_assets/defs/storage.py): Dagster's SQLite files,
each database's engine kept. No Kafka or Spark: a no-op hourly asset on real instances."""

import shutil
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster import AssetExecutionContext

from backfill_assets.defs import storage

REPO_ROOT = Path(__file__).resolve().parents[2]
HOURS = dg.HourlyPartitionsDefinition(start_date="2026-06-01-00:00")


@dg.asset(partitions_def=HOURS, backfill_policy=dg.BackfillPolicy.single_run())
def hourly(context: AssetExecutionContext) -> dg.MaterializeResult:  # type: ignore[type-arg]
    for i, key in enumerate(context.partition_keys):
        context.add_asset_metadata({"n": i}, partition_key=key)
    return dg.MaterializeResult(metadata={"partitions": len(context.partition_keys)})


def _materialize(instance: dg.DagsterInstance, first: int, last: int) -> dg.ExecuteInProcessResult:
    keys = HOURS.get_partition_keys()
    return dg.materialize(
        [hourly],
        instance=instance,
        tags={
            "dagster/asset_partition_range_start": keys[first],
            "dagster/asset_partition_range_end": keys[last],
        },
    )


def _home(tmp_path: Path, name: str, storage_yaml: str) -> Path:
    home = tmp_path / name
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n" + storage_yaml)
    return home


def test_the_project_dagster_yaml_uses_the_kept_engine_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("BACKFILL_DAGSTER_STORAGE", str(tmp_path / "storage"))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        kinds: set[type] = {
            type(instance.run_storage),
            type(instance.event_log_storage),
            type(instance.schedule_storage),
        }
        kept: set[type] = {storage.RunStorage, storage.EventLogStorage, storage.ScheduleStorage}
        assert kinds == kept
        assert _materialize(instance, 0, 23).success
        assert len(instance.get_materialized_partitions(hourly.key)) == 24
    assert (tmp_path / "storage" / "history" / "runs.db").is_file()


def test_either_storage_reads_what_the_other_wrote(tmp_path: Path) -> None:
    """The same files as ``storage: sqlite:``: runs and per-partition events written by one are
    read by the other, both ways (an instance can move between them)."""
    base = tmp_path / "storage"
    stock = _home(tmp_path, "stock", f"storage:\n  sqlite:\n    base_dir: {base}\n")
    kept = _home(
        tmp_path,
        "kept",
        "storage:\n  custom:\n    module: backfill_assets.defs.storage\n"
        f"    class: SqliteStorage\n    config:\n      base_dir: {base}\n",
    )
    with dg.DagsterInstance.from_config(str(kept)) as instance:
        first = _materialize(instance, 0, 47)
        assert first.success
    with dg.DagsterInstance.from_config(str(stock)) as instance:
        assert instance.get_run_by_id(first.run_id) is not None
        assert len(instance.get_materialized_partitions(hourly.key)) == 48
        second = _materialize(instance, 48, 71)
        assert second.success
    with dg.DagsterInstance.from_config(str(kept)) as instance:
        assert {r.run_id for r in instance.get_runs()} == {first.run_id, second.run_id}
        assert len(instance.get_materialized_partitions(hourly.key)) == 72
        figures = _partition_figures(instance)
        assert figures == {k: i for i, k in enumerate(HOURS.get_partition_keys()[:48])} | {
            k: i for i, k in enumerate(HOURS.get_partition_keys()[48:72])
        }


def _partition_figures(instance: dg.DagsterInstance) -> dict[str, Any]:
    records = instance.fetch_materializations(hourly.key, limit=1000).records
    out: dict[str, Any] = {}
    for record in records:
        mat = record.asset_materialization
        assert mat is not None and mat.partition is not None
        out[mat.partition] = mat.metadata["n"].value
    return out


def test_an_engine_is_kept_per_database_and_the_oldest_dropped(tmp_path: Path) -> None:
    urls = [f"sqlite:///{tmp_path / f'db{i}.db'}" for i in range(storage.MAX_ENGINES + 1)]
    first = storage.engine_for(urls[0])
    assert storage.engine_for(urls[0]) is first
    assert storage.engine_for(urls[0], 30) is not first, "a busy timeout is its own engine"
    for url in urls[1:]:
        storage.engine_for(url)
    # urls[0] with no timeout was used before every other: it is the one dropped.
    assert storage.engine_for(urls[0]) is not first
    assert storage.engine_for(urls[-1]) is storage.engine_for(urls[-1])
