"""The production-shaped stack, run for real (``-m cluster`` with ``BACKFILL_TEST_STACK=cluster``,
see support/cluster_stack.py): a backfill launched from the CLI through the webserver and run
by the daemon on Postgres-backed Dagster, as a thin client of the Spark Connect server on the
standalone cluster, reading the 3-broker SASL/SCRAM TLS Kafka cluster (one broker SIGKILLed in
the middle of it) into the JDBC catalog on Postgres with its files on S3Proxy.

Also: no secret of the stack appears in any log, in Dagster's event log or in an Iceberg
snapshot summary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.conftest import TEST_STACK

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from backfill_assets_tests.support.cluster_stack import ProductionStack

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        TEST_STACK != "cluster", reason="needs BACKFILL_TEST_STACK=cluster (scripts/test.sh)"
    ),
]

START = datetime(2026, 6, 1, tzinfo=UTC)
FIRST, END = "2026-06-01T00:00Z", "2026-06-01T04:00Z"  # four hours, [start, end)
SECRET_VARS = (
    "BACKFILL_KAFKA_SASL_PASSWORD",
    "BACKFILL_CATALOG_JDBC_PASSWORD",
    "AWS_SECRET_ACCESS_KEY",
    "DAGSTER_POSTGRES_PASSWORD",
)


@pytest.fixture(scope="module")
def orders(stack_settings: Settings) -> GroundTruth:
    """The topic the shipped topics.yaml names (RF 3 on this cluster), six hours of history."""
    return generate(
        stack_settings,
        GeneratorConfig(topic="orders", start=START, hours=6, events_per_hour=120, seed=5),
    )


@pytest.fixture(scope="module")
def cli_env(stack_env: dict[str, str], dagster_services: str) -> dict[str, str]:
    home = Path(stack_env["BACKFILL_HOME"]) / "dagster-home"
    return {**os.environ, **stack_env, "DAGSTER_HOME": str(home)}


@pytest.fixture(scope="module")
def instance(cli_env: dict[str, str]) -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.from_config(cli_env["DAGSTER_HOME"]) as inst:
        yield inst


def _failures(instance: dg.DagsterInstance) -> str:
    """The failure events of every failed run, for an assertion message."""
    lines = []
    failed = dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE])
    for run in instance.get_runs(filters=failed, limit=5):
        for entry in instance.all_logs(run.run_id):
            event = entry.dagster_event
            if event is not None and event.is_failure:
                lines.append(f"{run.run_id} {event.event_type_value}: {event.event_specific_data}")
    return "\n".join(lines)[-6000:]


def _started_runs(instance: dg.DagsterInstance) -> list[Any]:
    return list(instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])))


def _kill_a_broker_when_a_run_starts(
    production: ProductionStack, instance: dg.DagsterInstance, cli: subprocess.Popen[str]
) -> int:
    """Wait for the backfill's first run to start, then SIGKILL broker 2; its PID."""
    deadline = time.monotonic() + 600
    while not _started_runs(instance):
        assert cli.poll() is None, "the backfill ended before any run started"
        assert time.monotonic() < deadline, "no run started within 10 minutes"
        time.sleep(0.5)
    time.sleep(2)  # into the run: its Kafka scan and Spark read
    victim = production.kafka.cluster.nodes[1]
    pid = victim.kill()
    assert pid is not None, "broker 2 was not running"
    return pid


def test_a_backfill_through_the_webserver_survives_a_broker_killed_midway(
    orders: GroundTruth,
    cli_env: dict[str, str],
    dagster_services: str,
    instance: dg.DagsterInstance,
    production: ProductionStack,
    spark_session: SparkSession,
) -> None:
    cli = subprocess.Popen(
        [sys.executable, "-m", "backfill_assets.ops.cli", "backfill", "--start", FIRST,
         "--end", END, "--wait", "--timeout", "1500", "--webserver", dagster_services],
        cwd=REPO_ROOT, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _kill_a_broker_when_a_run_starts(production, instance, cli)
        out, _ = cli.communicate(timeout=1800)
    finally:
        if cli.poll() is None:
            cli.send_signal(signal.SIGTERM)
            cli.wait(60)
        production.kafka.cluster.restart(2)
    assert cli.returncode == 0, out + _failures(instance)
    hours = [datetime(2026, 6, 1, h, tzinfo=UTC).isoformat() for h in range(4)]
    read = sum(orders.kafka_hours[h]["records"] for h in hours)
    assert f"(0 failed), {read:,} records," in out, out

    # Every record of the four hours is in the raw table or the quarantine, once.
    ns = Settings.from_env().catalog.namespace
    positions: list[tuple[int, int]] = []
    for table in ("raw_orders", "orders_quarantine"):
        rows = spark_session.table(f"lake.{ns}.{table}").select("kafka_partition", "kafka_offset")
        positions += [(r[0], r[1]) for r in rows.collect()]
    assert len(positions) == len(set(positions)) == read
    quarantined = spark_session.table(f"lake.{ns}.orders_quarantine").count()
    assert quarantined == sum(orders.kafka_hours[h].get("malformed", 0) for h in hours)


def _files_holding(root: Path, values: dict[str, str]) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if not path.is_file() or path.stat().st_size > 50_000_000:
            continue
        data = path.read_bytes()
        found += [f"{path}: {name}" for name, value in values.items() if value.encode() in data]
    return found


def test_no_secret_in_logs_events_or_snapshot_summaries(
    stack_env: dict[str, str], instance: dg.DagsterInstance, production: ProductionStack
) -> None:
    values = {name: stack_env[name] for name in SECRET_VARS}
    home = Path(stack_env["BACKFILL_HOME"])
    # Logs: the project's (Spark Connect server, drivers), the Spark master/workers and their
    # executors' stdout/stderr, Dagster's services and compute logs, the brokers' logs.
    roots = [home / "logs", home / "spark-cluster", home / "dagster", home / "dagster-home"]
    roots += [p for p in (home / "kafka").rglob("*") if p.is_dir() and p.name == "logs"]
    leaks = [leak for root in roots if root.exists() for leak in _files_holding(root, values)]
    assert not leaks, leaks
    # The scan does find a secret where one must be: the Connect server's properties (0600).
    conf = production.connect.conf_path
    assert _files_holding(conf.parent, values), f"the scan found no secret even in {conf}"
    assert conf.stat().st_mode & 0o077 == 0

    runs = [run.run_id for run in instance.get_runs()]
    assert runs, "no run was recorded"
    for run_id in runs:
        logs = instance.all_logs(run_id)
        dump = "\n".join(repr(e) for e in logs)
        assert not [n for n, v in values.items() if v in dump], run_id

    from backfill_assets.stack import catalog

    cat = catalog.load(Settings.from_env().catalog)
    ns = Settings.from_env().catalog.namespace
    for ident in cat.list_tables(ns):
        for snapshot in cat.load_table(ident).metadata.snapshots:
            summary = repr(snapshot.summary)
            assert not [n for n, v in values.items() if v in summary], (ident, snapshot)


def test_dagster_on_postgres_records_run_times_in_utc_off_a_utc_server(
    instance: dg.DagsterInstance, stack_env: dict[str, str]
) -> None:
    """The Postgres server runs in the suite's zone (America/New_York by default), as a server
    on a laptop would. Dagster stores naive timestamps and reads them as UTC, so without the
    connection's ``timezone=UTC`` (infra/production/dagster.yaml) every run looked 5 hours old
    and run monitoring failed runs as "taking longer than 300 seconds to start"."""
    import psycopg2  # type: ignore[import-untyped]

    conn = psycopg2.connect(
        host=stack_env["DAGSTER_POSTGRES_HOST"],
        port=stack_env["DAGSTER_POSTGRES_PORT"],
        dbname=stack_env["DAGSTER_POSTGRES_DB"],
        user=stack_env["DAGSTER_POSTGRES_USER"],
        password=stack_env["DAGSTER_POSTGRES_PASSWORD"],
    )
    with conn, conn.cursor() as cur:
        cur.execute("SHOW timezone")
        server_zone = cur.fetchone()[0]
    conn.close()
    assert server_zone != "UTC", "the hostile condition is gone: the server is on UTC"

    @dg.op
    def noop() -> None:
        pass

    @dg.job
    def tick() -> None:
        noop()

    before = datetime.now(UTC)
    result = tick.execute_in_process(instance=instance)
    assert result.success
    record = instance.get_run_record_by_id(result.run_id)
    assert record is not None
    created = record.create_timestamp
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    assert abs((created - before).total_seconds()) < 120, (created, before, server_zone)
