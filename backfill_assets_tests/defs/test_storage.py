"""The local default's Dagster storage (backfill_assets/defs/storage.py): Dagster's SQLite files,
each database's engine kept. No Kafka or Spark: a no-op hourly asset on real instances."""

import shutil
import threading
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster import AssetExecutionContext, DagsterEventType

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


def _kept_home(tmp_path: Path, base: Path) -> Path:
    return _home(
        tmp_path,
        "kept",
        "storage:\n  custom:\n    module: backfill_assets.defs.storage\n"
        f"    class: SqliteStorage\n    config:\n      base_dir: {base}\n",
    )


def _seen_while_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: str, hours: int
) -> tuple[set[int], dg.ExecuteInProcessResult]:
    """Materialize ``hours`` partitions in one run while a reader polls the index as the
    backfill daemon reads it (``get_asset_event_summary_records``, a second instance on the same
    files); the counts of materializations the reader saw, and the run."""
    monkeypatch.setenv("DAGSTER_EVENT_BATCH_SIZE", batch)
    tmp_path.mkdir()
    base = tmp_path / "storage"
    stock = _home(tmp_path, "stock", f"storage:\n  sqlite:\n    base_dir: {base}\n")
    seen: set[int] = set()
    done = threading.Event()
    with dg.DagsterInstance.from_config(str(_kept_home(tmp_path, base))) as instance:
        _materialize(instance, 0, 0)  # the databases exist before the reader opens them
        with dg.DagsterInstance.from_config(str(stock)) as reader:

            def poll() -> None:
                while not done.is_set():
                    rows = reader.get_asset_event_summary_records(
                        DagsterEventType.ASSET_MATERIALIZATION,
                        asset_key=hourly.key,
                        after_storage_id=None,
                        limit=10_000,
                        ascending=True,
                    )
                    seen.add(len(rows) - 1)

            thread = threading.Thread(target=poll, daemon=True)
            thread.start()
            try:
                result = _materialize(instance, 1, hours)
            finally:
                done.set()
                thread.join(timeout=30)
    return seen, result


def test_a_ranged_runs_materializations_appear_in_the_index_all_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the backfill daemon reads of a ranged run's materializations is none or all of them
    (so it cannot launch a child run for part of the range). The same poller, unbatched,
    sees the rows arrive one commit at a time: it can see a partial set."""
    hours = 120
    seen, result = _seen_while_stored(tmp_path / "batched", monkeypatch, "1000", hours)
    assert result.success
    assert seen <= {0, hours}, sorted(seen)
    seen_alone, _ = _seen_while_stored(tmp_path / "alone", monkeypatch, "0", hours)
    assert seen_alone - {0, hours}, "unbatched, the poller never saw a partial set"


def test_a_batch_whose_index_write_fails_is_stored_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's index transaction fails (a fault injected into its tag rows): it is rolled
    back and each event's index rows are written alone; no event is lost or stored twice,
    in the run's own log or in the index."""
    monkeypatch.setenv("DAGSTER_EVENT_BATCH_SIZE", "1000")
    original = storage.EventLogStorage._store_asset_event_tags
    failed: list[int] = []

    def fail_batches(self: Any, conn: Any, events: Any, ids: Any) -> None:
        if len(events) > 1:
            failed.append(len(events))
            raise RuntimeError("injected: the index's batch fails")
        original(self, conn, events, ids)

    monkeypatch.setattr(storage.EventLogStorage, "_store_asset_event_tags", fail_batches)
    with dg.DagsterInstance.from_config(str(_kept_home(tmp_path, tmp_path / "s"))) as instance:
        result = _materialize(instance, 0, 47)
        assert result.success
        assert 48 in failed, f"the fault was not reached: {failed}"
        logged = instance.all_logs(result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
        assert len(logged) == 48
        indexed = instance.get_asset_event_summary_records(
            DagsterEventType.ASSET_MATERIALIZATION, asset_key=hourly.key, limit=1000
        )
        assert sorted(str(r.partition) for r in indexed) == HOURS.get_partition_keys()[:48]
        planned = instance.get_asset_event_summary_records(
            DagsterEventType.ASSET_MATERIALIZATION_PLANNED, asset_key=hourly.key, limit=1000
        )
        assert sorted(str(r.partition) for r in planned) == HOURS.get_partition_keys()[:48]
        assert failed == [48, 48], "the run's planned events and its materializations, a batch each"
        assert _partition_figures(instance) == {
            k: i for i, k in enumerate(HOURS.get_partition_keys()[:48])
        }
