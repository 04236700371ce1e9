"""The Definitions users depend on load, and keep their names: a renamed key would silently
detach a table's history in the Dagster instance."""

from __future__ import annotations

import dagster as dg

from backfill_assets.defs.definitions import defs

RAW = dg.AssetKey(["raw", "orders"])
HOURLY = dg.AssetKey(["lakehouse", "orders_hourly"])
CURRENT = dg.AssetKey(["lakehouse", "orders_current"])
LARGE = dg.AssetKey(["lakehouse", "orders_large_paid"])
ARCHIVE = dg.AssetKey(["archive", "orders"])


def test_asset_keys_and_resources() -> None:
    repo = defs.get_repository_def()
    assert set(repo.get_top_level_resources()) >= {"kafka", "spark", "iceberg"}
    graph = defs.resolve_asset_graph()
    assert set(graph.get_all_asset_keys()) == {RAW, HOURLY, CURRENT, LARGE, ARCHIVE}
    sensors = {s.name: s for s in defs.sensors or []}
    assert set(sensors) == {"orders_offset_gaps", "orders_late_data"}
    assert set(sensors["orders_offset_gaps"].asset_selection.resolve(graph)) == {  # type: ignore[union-attr]
        RAW,
        HOURLY,
        CURRENT,
        LARGE,
    }
    schedules = {s.name: s for s in defs.schedules or []}
    assert set(schedules) == {"orders_archive_hourly"}
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
        for spec in defs.get_assets_def(key).check_specs:
            assert spec.blocking, f"{spec.key} must be blocking"


def test_partitions_lateness_mapping_and_backfill_policy() -> None:
    raw = defs.get_assets_def(RAW)
    hourly = defs.get_assets_def(HOURLY)
    assert isinstance(raw.partitions_def, dg.HourlyPartitionsDefinition)
    assert raw.partitions_def.timezone == "UTC"
    assert raw.backfill_policy == dg.BackfillPolicy.multi_run(max_partitions_per_run=168)
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
