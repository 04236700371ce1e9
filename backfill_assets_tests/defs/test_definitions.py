"""The Definitions users depend on load, and keep their names: a renamed key would silently
detach a table's history in the Dagster instance."""

from __future__ import annotations

import dagster as dg
import pytest

from backfill_assets.defs.definitions import build_defs, defs
from backfill_assets.spec.loader import load_specs
from backfill_assets.stack.settings import Settings

RAW = dg.AssetKey(["raw", "orders"])
HOURLY = dg.AssetKey(["lakehouse", "orders_hourly"])
CURRENT = dg.AssetKey(["lakehouse", "orders_current"])
LARGE = dg.AssetKey(["lakehouse", "orders_large_paid"])
ARCHIVE = dg.AssetKey(["archive", "orders"])
QUARANTINE = dg.AssetKey(["quarantine", "orders"])
TOPIC = dg.AssetKey(["kafka", "orders"])


def test_asset_keys_and_resources() -> None:
    repo = defs.get_repository_def()
    assert set(repo.get_top_level_resources()) >= {"kafka", "spark", "iceberg"}
    graph = defs.resolve_asset_graph()
    assert set(graph.get_all_asset_keys()) == {
        TOPIC,
        RAW,
        HOURLY,
        CURRENT,
        LARGE,
        ARCHIVE,
        QUARANTINE,
    }
    sensors = {s.name: s for s in defs.sensors or []}
    assert set(sensors) == {"orders_offset_gaps", "orders_late_data", "orders_observe_topic"}
    assert set(sensors["orders_offset_gaps"].asset_selection.resolve(graph)) == {  # type: ignore[union-attr]
        RAW,
        HOURLY,
        CURRENT,
        LARGE,
    }
    schedules = {s.name: s for s in defs.schedules or []}
    assert set(schedules) == {
        "orders_archive_hourly",
        *(f"maintain_{t}_schedule" for t in ("raw_orders", "orders_quarantine", "bookkeeping")),
        *(f"maintain_{t}_schedule" for t in ("orders_current", "orders_hourly")),
        "maintain_orders_large_paid_schedule",
    }
    assert schedules["orders_archive_hourly"].cron_schedule == "5 * * * *"  # type: ignore[union-attr]


def test_blocking_checks_users_rely_on() -> None:
    graph = defs.resolve_asset_graph()
    checks = {(k.asset_key, k.name) for k in graph.asset_check_keys}
    expected = {
        (RAW, "count_reconciliation"),
        (RAW, "checksum"),
        (RAW, "schema_contract"),
        (RAW, "uniqueness"),
        (RAW, "quarantine_ratio"),
        (RAW, "decoded_content"),
        (RAW, "records_kept"),
        (HOURLY, "reconciliation"),
        (HOURLY, "uniqueness"),
        (HOURLY, "schema_contract"),
        (LARGE, "reconciliation"),
        (LARGE, "uniqueness"),
        (LARGE, "schema_contract"),
        (CURRENT, "uniqueness"),
        (CURRENT, "source_applied"),
        (CURRENT, "schema_contract"),
    }
    assert checks == expected
    for key in defs.resolve_all_asset_keys():
        for spec in defs.resolve_assets_def(key).check_specs:
            assert spec.blocking, f"{spec.key} must be blocking"


def test_backfill_policy_cuts_runs_at_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """BACKFILL_MAX_HOURS_PER_RUN sets every table's run size, and the planner counts runs of
    that size."""
    from backfill_assets.defs.assets import backfill_policy
    from backfill_assets.ops import planner

    monkeypatch.setenv("BACKFILL_MAX_HOURS_PER_RUN", "24")
    assert backfill_policy() == dg.BackfillPolicy.multi_run(max_partitions_per_run=24)
    rebuilt = build_defs(load_specs())
    for key in (RAW, HOURLY):
        assert rebuilt.resolve_assets_def(key).backfill_policy == backfill_policy()
    assert planner._hours_per_run() == 24


def test_partitions_lateness_mapping_and_backfill_policy() -> None:
    raw = defs.resolve_assets_def(RAW)
    hourly = defs.resolve_assets_def(HOURLY)
    assert isinstance(raw.partitions_def, dg.HourlyPartitionsDefinition)
    assert raw.partitions_def.timezone == "UTC"
    assert raw.backfill_policy == dg.BackfillPolicy.multi_run(max_partitions_per_run=720)
    # Event-time hour 10:00 reads Kafka-time hours 10:00 .. 13:00 (allowed lateness 3 h).
    upstream = (
        defs.resolve_asset_graph()
        .get_parent_partition_keys_for_child(
            "2026-02-01-10:00",
            parent_asset_key=RAW,
            child_asset_key=HOURLY,
        )
        .partitions_subset.get_partition_keys()
    )
    assert sorted(upstream) == [f"2026-02-01-{h}:00" for h in range(10, 14)]
    assert hourly.partitions_def == raw.partitions_def


def test_lineage_reads_topic_archive_raw_tables() -> None:
    """The UI's asset graph: kafka/orders -> archive/orders -> raw/orders -> lakehouse/*."""
    graph = defs.resolve_asset_graph()
    topic = graph.get(TOPIC)
    assert not topic.is_materializable, "a topic is observed, never materialized here"
    assert topic.kinds == {"kafka"}
    assert graph.get(ARCHIVE).parent_keys == {TOPIC}
    assert graph.get(RAW).parent_keys == {TOPIC, ARCHIVE}
    assert graph.get(CURRENT).parent_keys == {RAW}
    assert graph.get(HOURLY).parent_keys == {RAW}
    assert graph.get(TOPIC).child_keys == {ARCHIVE, RAW}


def test_column_schemas_and_check_descriptions_come_from_the_spec() -> None:
    from backfill_assets.defs.definitions import SPECS

    spec = SPECS[0]
    graph = defs.resolve_asset_graph()

    def columns(key: dg.AssetKey) -> dict[str, str]:
        schema = graph.get(key).metadata["dagster/column_schema"]
        assert isinstance(schema, dg.TableSchema)
        return {c.name: c.type for c in schema.columns}

    raw = columns(RAW)
    assert {c.name: c.type for c in spec.columns}.items() <= raw.items()
    assert {
        "kafka_partition": "int",
        "kafka_offset": "bigint",
        "ingest_run_id": "string",
    }.items() <= raw.items()
    hourly = next(t for t in spec.tables if t.name == "orders_hourly")
    assert columns(HOURLY) == {c.name: c.type for c in hourly.columns}
    current = columns(CURRENT)
    assert spec.key_field in current and "deleted" in current
    # Constraints of the spec's contract are shown with the column.
    status = next(c for c in spec.columns if c.allowed)
    schema = graph.get(RAW).metadata["dagster/column_schema"]
    shown = next(c for c in schema.columns if c.name == status.name)
    assert any(all(v in o for v in status.allowed or ()) for o in shown.constraints.other)
    # Every check says what it asserts, specific to the asset kind.
    for key in (RAW, HOURLY, CURRENT, LARGE):
        for check in defs.resolve_assets_def(key).check_specs:
            assert check.description, check.key
    uniq = {
        key: next(c for c in defs.resolve_assets_def(key).check_specs if c.name == "uniqueness")
        for key in (RAW, HOURLY)
    }
    assert uniq[RAW].description != uniq[HOURLY].description


def test_every_job_runs_in_process_unless_the_setting_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The executor is the Definitions' default, so runs launched from the UI (which sends no
    run config) get it too, not only the CLI's."""
    graph_job = defs.resolve_implicit_global_asset_job_def()
    assert graph_job.executor_def is dg.in_process_executor
    monkeypatch.setenv("BACKFILL_RUN_EXECUTOR", "multiprocess")
    other = build_defs(load_specs()).resolve_implicit_global_asset_job_def()
    assert other.executor_def is dg.multiprocess_executor


def test_loading_the_definitions_prints_no_framework_warnings() -> None:
    """Every CLI command and run loads the code location: it must not print Dagster's beta
    notice for the backfill policy once per asset (issue 29: 8 blocks per demo command)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import backfill_assets.defs.definitions"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Warning" not in done.stderr, done.stderr[-2000:]


def test_every_asset_has_a_code_version_from_its_definition() -> None:
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.lake.offsets.archive import layout_version
    from backfill_assets.spec import versions

    spec = SPECS[0]
    graph = defs.resolve_asset_graph()
    expected = {
        RAW: versions.raw_version(spec),
        CURRENT: versions.current_version(spec),
        HOURLY: versions.declared_version(spec.tables[0]),
        LARGE: versions.declared_version(spec.tables[1]),
        ARCHIVE: layout_version(spec.topic),
    }
    assert {key: graph.get(key).code_version for key in expected} == expected
    assert len(set(expected.values())) == len(expected)


def test_every_table_asset_names_its_table_in_the_catalog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dagster/table_name`` is ``<catalog>.<namespace>.<table>`` from the settings."""
    cfg = Settings.from_env().catalog
    graph = defs.resolve_asset_graph()
    assert graph.get(RAW).metadata["dagster/table_name"] == f"{cfg.name}.{cfg.namespace}.raw_orders"
    assert (
        graph.get(RAW).metadata["quarantine_table_name"]
        == f"{cfg.name}.{cfg.namespace}.orders_quarantine"
    )
    monkeypatch.setenv("BACKFILL_CATALOG_NAME", "prod")
    monkeypatch.setenv("BACKFILL_NAMESPACE", "orders_ns")
    other = build_defs(load_specs()).resolve_asset_graph()
    names = {
        key: other.get(key).metadata.get("dagster/table_name")
        for key in (RAW, CURRENT, HOURLY, LARGE)
    }
    assert names == {
        RAW: "prod.orders_ns.raw_orders",
        CURRENT: "prod.orders_ns.orders_current",
        HOURLY: "prod.orders_ns.orders_hourly",
        LARGE: "prod.orders_ns.orders_large_paid",
    }
    assert "dagster/table_name" not in other.get(ARCHIVE).metadata  # Parquet files, no table
