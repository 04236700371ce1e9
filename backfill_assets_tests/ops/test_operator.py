"""Operator tooling against the real stack: plan, a backfill launched from the CLI through the
webserver and executed by the daemon, the audit trail, and rollback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.definitions import ASSETS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.lake.write.replay import checksum_expr
from backfill_assets.lake.write.wap import ref_snapshot_id
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

START = datetime(2026, 6, 1, tzinfo=UTC)
HOURS = [datetime(2026, 6, 1, h, tzinfo=UTC).isoformat() for h in range(1, 5)]


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backfill_assets.ops.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


@pytest.fixture(scope="module")
def orders(stack_settings: Settings) -> GroundTruth:
    """The topic the shipped topics.yaml names, filled with six hours of history."""
    return generate(
        stack_settings,
        GeneratorConfig(topic="orders", start=START, hours=6, events_per_hour=150, seed=3),
    )


@pytest.fixture(scope="module")
def cli_env(stack_env: dict[str, str], dagster_services: str) -> dict[str, str]:
    home = Path(stack_env["BACKFILL_HOME"]) / "dagster-home"
    return {**os.environ, **stack_env, "DAGSTER_HOME": str(home)}


@pytest.fixture(scope="module")
def instance(cli_env: dict[str, str]) -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.from_config(cli_env["DAGSTER_HOME"]) as inst:
        yield inst


def test_plan_states_the_exact_contract(orders: GroundTruth, cli_env: dict[str, str]) -> None:
    out = _cli(
        cli_env,
        "plan",
        "--start",
        "2026-06-01T01:00Z",
        "--end",
        "2026-06-01T05:00Z",
        "--window",
        "2h",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["offsets"] == {
        str(p): [orders.hour_offsets[p][HOURS[0]][0], orders.hour_offsets[p][HOURS[-1]][1]]
        for p in range(6)
    }
    assert plan["records"] == sum(orders.kafka_hours[h]["records"] for h in HOURS)
    assert plan["all_in_kafka"] is True and plan["fits_window"] is True
    assert plan["schema_versions_seen"] == [1, 2]
    assert plan["runs"] == 1 and plan["partitions"] == 4
    scores = {s["dimension"]: s["color"] for s in plan["scorecard"]}
    assert set(scores) == {"scope", "capacity", "cost", "recovery", "governance", "closure"}
    assert scores["closure"] == "green"

    human = _cli(cli_env, "plan", "--start", "2026-06-01T01:00Z", "--end", "2026-06-01T05:00Z")
    assert "readiness" in human.stdout and "p0:[" in human.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--start", "2026-06-01T01:30Z", "--end", "2026-06-01T05:00Z"], "whole hour"),
        (["--start", "2026-06-01T05:00Z", "--end", "2026-06-01T01:00Z"], "after --start"),
        (["--start", "soon", "--end", "2026-06-01T05:00Z"], "not an ISO-8601 time"),
        (
            ["--topic", "payments", "--start", "2026-06-01T01:00Z", "--end", "2026-06-01T02:00Z"],
            "unknown topic 'payments'; topics.yaml has: orders",
        ),
    ],
)
def test_bad_arguments_say_what_is_allowed(
    cli_env: dict[str, str], args: list[str], message: str
) -> None:
    out = _cli(cli_env, "plan", *args)
    assert out.returncode == 2
    assert message in out.stderr


def _raw_state(spark: SparkSession) -> tuple[int | None, Any]:
    table = "lake.lakehouse.raw_orders"
    return ref_snapshot_id(spark, table, "main"), spark.table(table).agg(
        checksum_expr(_spec())
    ).first()[0]  # type: ignore[index]


def _spec() -> Any:
    from backfill_assets.defs.definitions import SPECS

    return SPECS[0]


def _materialize(instance: dg.DagsterInstance, first: str, last: str) -> str:
    raw = [a for a in ASSETS if a.key == dg.AssetKey(["raw", "orders"])]
    result = materialize_range(raw, instance, first, last)
    return result.run_id


def _snapshots(cat: Catalog, *tables: str) -> list[int | None]:
    return [cat.load_table(f"lakehouse.{t}").metadata.current_snapshot_id for t in tables]


def _graphql(url: str, query: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{url}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        data: dict[str, Any] = json.loads(resp.read())["data"]
        return data


# Long (2-4 min): in the slow tier, which CI runs, to keep the default tier near 20 min.
@pytest.mark.slow
def test_backfill_audit_and_rollback(
    orders: GroundTruth,
    cli_env: dict[str, str],
    dagster_services: str,
    instance: dg.DagsterInstance,
    spark_session: SparkSession,
    iceberg_catalog: Catalog,
) -> None:
    # A first publish of two hours: the state a rollback must return to.
    first_run = _materialize(instance, "2026-06-01-01:00", "2026-06-01-02:00")
    before = _raw_state(spark_session)

    out = _cli(
        cli_env,
        "backfill",
        "--start",
        "2026-06-01T01:00Z",
        "--end",
        "2026-06-01T05:00Z",
        "--wait",
        "--timeout",
        "600",
        "--webserver",
        dagster_services,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ids = sorted(set(re.findall(r"launched backfill (\S+):", out.stdout)))
    assert len(ids) == 1, out.stdout  # one backfill object, as the UI creates
    # raw and current over 4 hours; each declared table (orders_hourly, orders_large_paid) over
    # the one event hour complete within the range
    assert re.search(r"10/10 asset partitions \(0 failed\)", out.stdout), out.stdout
    # the records of every hour, not of one hour per run
    read = sum(orders.kafka_hours[h]["records"] for h in HOURS)
    assert f"(0 failed), {read:,} records," in out.stdout, out.stdout

    # The UI's backfill list shows them, completed.
    listed = _graphql(
        dagster_services,
        "{ partitionBackfillsOrError { ... on PartitionBackfills { results { id status } } } }",
    )["partitionBackfillsOrError"]["results"]
    statuses = {b["id"]: b["status"] for b in listed}
    assert {statuses[i] for i in ids} <= {"COMPLETED", "COMPLETED_SUCCESS"}, statuses

    after = _raw_state(spark_session)
    assert after[0] != before[0]
    rows = json.loads(_cli(cli_env, "audit", "--backfill", ids[0], "--json").stdout)
    published = {r["table_name"] for r in rows if r["event"] == "publish"}
    assert published == {
        "lake.lakehouse.raw_orders",
        "lake.lakehouse.orders_current",
        "lake.lakehouse.orders_hourly",
        "lake.lakehouse.orders_large_paid",
    }
    assert all(r["launched_by"].startswith("cli:") for r in rows)

    # A later publish by another run blocks the rollback unless forced.
    later_run = _materialize(instance, "2026-06-01-03:00", "2026-06-01-03:00")
    refused = _cli(cli_env, "rollback", "--backfill", ids[0])
    assert refused.returncode == 4  # refused: the documented status of a guard's refusal
    assert later_run in refused.stderr and "--force" in refused.stderr
    assert _cli(cli_env, "rollback", "--run", later_run).returncode == 0

    # A dry run names every table, main's snapshot now and after, and per hour the run whose
    # rows come back (none for hours nothing published before the backfill); it writes nothing.
    current = _raw_state(spark_session)
    bookkeeping = _snapshots(iceberg_catalog, "backfill_audit", "backfill_ledger")
    dry = _cli(cli_env, "rollback", "--backfill", ids[0], "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["dry_run"] is True and plan["rollback_of"] == f"backfill {ids[0]}"
    tables = {t["table_name"]: t for t in plan["tables"]}
    assert set(tables) == published
    raw = tables["lake.lakehouse.raw_orders"]
    assert (raw["snapshot_before"], raw["restored_snapshot"]) == (current[0], before[0])
    assert {p["hour"]: p["restored_run"] for p in raw["partitions"]} == {
        HOURS[0]: first_run,
        HOURS[1]: first_run,
        HOURS[2]: None,
        HOURS[3]: None,
    }
    assert _raw_state(spark_session) == current
    assert _snapshots(iceberg_catalog, "backfill_audit", "backfill_ledger") == bookkeeping

    done = _cli(cli_env, "rollback", "--backfill", ids[0])
    assert done.returncode == 0, done.stderr
    assert _raw_state(spark_session) == before, "exact pre-backfill snapshot and checksum"
    # Dagster shows what was undone: hours 1-2 hold the first run's rows again (their latest
    # materialization names the rollback and that run), hours 3-4 none (an observation says so).
    raw_key = dg.AssetKey(["raw", "orders"])
    mats = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=raw_key, asset_partitions=["2026-06-01-01:00"]), limit=1
    ).records
    assert mats[0].asset_materialization is not None
    meta = {k: v.value for k, v in mats[0].asset_materialization.metadata.items()}
    assert meta["rollback_of"] == f"backfill {ids[0]}" and meta["restored_run"] == first_run
    assert meta["restored_snapshot"] == before[0]
    obs = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=raw_key, asset_partitions=["2026-06-01-04:00"]), limit=1
    ).records
    assert obs[0].asset_observation is not None
    assert obs[0].asset_observation.metadata["undone_backfill"].value == ids[0]
    assert "Dagster (" in done.stdout
    audit = json.loads(_cli(cli_env, "audit", "--backfill", ids[0], "--json").stdout)
    rolled = [r["table_name"] for r in audit if r["event"] == "rollback"]
    assert sorted(rolled) == sorted(published)  # one rollback row per published table


# Long (2-4 min): in the slow tier, which CI runs, to keep the default tier near 20 min.
@pytest.mark.slow
def test_one_hour_is_launched_as_one_run(
    orders: GroundTruth,
    cli_env: dict[str, str],
    dagster_services: str,
    instance: dg.DagsterInstance,
) -> None:
    """One hour skips the backfill daemon: one run, tagged with its partition, straight into the
    run queue (as the UI's Materialize of one partition); --wait follows the run."""
    hour = datetime(2026, 6, 1, 5, tzinfo=UTC)
    backfills_before = len(instance.get_backfills())
    out = _cli(
        cli_env,
        "backfill",
        "--start",
        hour.isoformat(),
        "--end",
        "2026-06-01T06:00Z",
        "--wait",
        "--timeout",
        "600",
        "--webserver",
        dagster_services,
        "--json",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert "backfill_id" not in doc
    run_id = doc["run_id"]
    assert {r["asset"] for r in doc["ranges"]} == {"raw/orders", "lakehouse/orders_current"}
    assert {(r["first"], r["last"]) for r in doc["ranges"]} == {("2026-06-01-05:00",) * 2}
    progress = doc["progress"]
    assert progress["succeeded"] and progress["status"] == "SUCCESS"
    assert (progress["materialized"], progress["failed"], progress["targeted"]) == (2, 0, 2)
    assert progress["records"] == orders.kafka_hours[hour.isoformat()]["records"]

    assert len(instance.get_backfills()) == backfills_before, "no backfill object"
    run = instance.get_run_by_id(run_id)
    assert run is not None
    assert run.tags["dagster/partition"] == "2026-06-01-05:00"
    assert "dagster/backfill" not in run.tags
    assert (
        run.tags["backfill_assets/single_partition"] == "orders 2026-06-01-05:00..2026-06-01-05:00"
    )
    assert run.tags["backfill_assets/launched_by"].startswith("cli:")
    rows = json.loads(_cli(cli_env, "audit", "--run", run_id, "--json").stdout)
    assert {r["table_name"] for r in rows if r["event"] == "publish"} == {
        "lake.lakehouse.raw_orders",
        "lake.lakehouse.orders_current",
    }

    # --as-backfill keeps the backfill object for one hour.
    forced = _cli(
        cli_env,
        "backfill",
        "--start",
        hour.isoformat(),
        "--end",
        "2026-06-01T06:00Z",
        "--as-backfill",
        "--webserver",
        dagster_services,
        "--json",
    )
    assert forced.returncode == 0, forced.stderr
    launched = json.loads(forced.stdout)["backfill_id"]
    assert instance.get_backfill(launched) is not None
    final = launch_wait(dagster_services, launched)
    assert final.succeeded, final.line()


def launch_wait(url: str, backfill_id: str) -> Any:
    from backfill_assets.ops import launch

    return launch.wait(launch.DagsterClient(url), backfill_id, poll_s=1.0, timeout_s=600)
