"""The operator CLI: every command takes --json and prints one document; anticipated failures
print a message naming what is wrong (never a traceback) and exit 2 (wrong arguments), 3 (a
service unavailable) or 4 (refused or failed); a rollback is recorded in the Dagster instance.
Cheap: in-process, no Spark, the session's broker and catalog only where a command reads them."""

from __future__ import annotations

import io
import json
import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from click.testing import CliRunner

from backfill_assets.lake.operations.rollback import HourRestore, RollbackResult
from backfill_assets.ops import cli
from backfill_assets.ops.cli import common, rollback
from backfill_assets.ops.cli.common import resolve_range
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

COMMANDS = sorted(cli.cli.commands)
RANGE = ["--start", "2026-06-01T01:00Z", "--end", "2026-06-01T05:00Z"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_command_is_there() -> None:
    assert COMMANDS == [
        "accept",
        "adopt",
        "archive",
        "audit",
        "backfill",
        "catalog",
        "columns",
        "gaps",
        "generate",
        "jars",
        "kafka",
        "maintain",
        "materialize",
        "plan",
        "quarantine",
        "report-empty",
        "rollback",
        "settings",
        "stack",
    ]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    code, out, err = _run(capsys, "--version")
    assert code == 0 and err == ""
    assert out == f"backfill-assets {version('backfill_assets')}\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command_lists_json(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, command, "--help")
    assert code == 0
    assert "--json" in out and "Print one JSON document on stdout" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--start", "2026-06-01T05:00Z", "--end", "2026-06-01T01:00Z"], "--end must be"),
        (["backfill", "--start", "soon", "--end", "2026-06-01T05:00Z"], "--start 'soon' is not"),
        (["materialize", "--start", "2026-06-01T01:00Z", "--end", "later"], "--end 'later' is not"),
        (["plan", "--start", "2026-06-01T01:30Z", "--end", "2026-06-01T05:00Z"], "whole hour"),
        (["generate", "--start", "yesterday"], "--start 'yesterday' is not"),
        (["plan", *RANGE, "--window", "a while"], "--window 'a while' is not a duration"),
        (["plan", "--start", "2026-06-01T01:00Z"], "give --start and --end, or --last"),
        (["backfill", "--last", "6h", *RANGE], "--last replaces --start and --end"),
        (["plan", "--last", "90m"], "--last '90m' must be whole hours"),
        (["materialize", "--last", "soon"], "--last 'soon' is not a duration"),
    ],
)
def test_a_bad_range_exits_2_naming_the_flag(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert err.startswith("error: ") and message in err, err
    assert out == "" and "Traceback" not in err


@pytest.mark.parametrize("command", ["plan", "backfill", "materialize", "gaps", "archive"])
def test_an_unknown_topic_exits_2_naming_the_topics(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [command, "--topic", "payments"]
    if command in ("plan", "backfill", "materialize"):
        args += RANGE
    code, _, err = _run(capsys, *args)
    assert code == 2
    assert err.startswith("error: unknown topic 'payments'; topics.yaml") and "orders" in err


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (["kafka", "restart"], "'start', 'stop', 'status'"),
        (["stack", "sideways"], "'up', 'down', 'status'"),
        (["rollback", "--dry-run"], "give exactly one of --run RUN_ID or --backfill BACKFILL_ID"),
        (["rollback", "--run", "r1", "--backfill", "b1"], "give exactly one of --run"),
        (["audit", "--limit", "many"], "'--limit': 'many' is not a valid integer"),
        (["nonsense"], "No such command 'nonsense'"),
    ],
)
def test_wrong_arguments_exit_2_saying_what_is_allowed(
    args: list[str], allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert allowed in err and "Usage: backfill-assets" in err, err
    assert out == "" and "Traceback" not in err


def test_click_runner_sees_the_same_exit_status() -> None:
    result = CliRunner().invoke(cli.cli, ["plan", "--start", "soon", "--end", "later"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --start 'soon' is not an ISO-8601 time")


@pytest.fixture
def closed_kafka(stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Kafka settings pointing at a port nothing listens on, and a 2 s metadata timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("BACKFILL_KAFKA_BOOTSTRAP", address)
    monkeypatch.setattr(common, "kafka", lambda: KafkaClient(request_timeout_s=2.0))
    yield address


@pytest.mark.parametrize(
    "args", [["archive", "--status"], ["gaps", "--json"], ["plan", *RANGE, "--json"]]
)
def test_an_unreachable_kafka_is_an_error_not_a_traceback(
    args: list[str],
    closed_kafka: str,
    iceberg_catalog: Catalog,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    code, out, err = _run(capsys, *args)
    assert code == 3
    assert err.startswith(f"error: Kafka at {closed_kafka} did not answer"), err
    assert "Traceback" not in err and out == ""


def test_usage_unavailable_and_refused_exit_with_documented_statuses(
    closed_kafka: str,
    iceberg_catalog: Catalog,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A wrong argument, a service that does not answer (Kafka, the webserver) and a refusal
    exit with three different statuses, each listed in the root command's help."""
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    wrong, _, err = _run(capsys, "plan", "--start", "soon", "--end", "later")
    assert err.startswith("error: --start 'soon' is not an ISO-8601 time"), err
    no_kafka, _, err = _run(capsys, "gaps")
    assert err.startswith(f"error: Kafka at {closed_kafka} did not answer"), err
    no_webserver, _, err = _run(capsys, "backfill", *RANGE, "--webserver", f"http://{closed_kafka}")
    assert err.startswith("error: cannot reach the Dagster webserver"), err
    refused, _, err = _run(capsys, "rollback", "--run", "no-such-run")
    assert err.startswith("error: no successful publish of run no-such-run"), err
    assert (wrong, no_kafka, no_webserver, refused) == (2, 3, 3, 4)
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for status, meaning in (
        (2, "wrong arguments"),
        (3, "a service is unavailable"),
        (4, "refused"),
    ):
        assert f"\n    {status}  {meaning}" in out, out


@pytest.fixture
def orders_topic(stack_settings: Settings) -> str:
    """The spec's topic exists on the session broker (empty if nothing wrote to it yet; created
    exactly as the demo generator creates it, so a later `generate` accepts it)."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    from backfill_assets.demo.generator import TOPIC_CONFIGS

    admin = AdminClient(stack_settings.kafka.client_config())
    if "orders" not in admin.list_topics(timeout=10).topics:
        futures = admin.create_topics(
            [NewTopic("orders", num_partitions=6, replication_factor=1, config=TOPIC_CONFIGS)]
        )
        futures["orders"].result(timeout=30)
    return "orders"


def test_json_documents_parse(
    stack_settings: Settings,
    iceberg_catalog: Catalog,
    orders_topic: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    code, out, _ = _run(capsys, "kafka", "status", "--json")
    assert code == 0
    status = json.loads(out)
    assert status["responding"] is True
    assert status["bootstrap_servers"] == stack_settings.kafka.bootstrap_servers

    code, out, _ = _run(capsys, "gaps", "--json")
    assert code in (0, 1)
    assert json.loads(out)["topic"] == "orders"

    code, out, _ = _run(capsys, "plan", *RANGE, "--json")
    assert code in (0, 1)
    plan = json.loads(out)
    assert plan["topic"] == "orders" and plan["partitions"] == 4

    code, out, _ = _run(capsys, "audit", "--json", "--limit", "5")
    assert code == 0 and isinstance(json.loads(out), list)

    code, out, _ = _run(capsys, "catalog", "init", "--json")
    assert code == 0
    assert json.loads(out)["namespace"] == stack_settings.catalog.namespace

    code, out, _ = _run(capsys, "jars", "resolve", "--json")
    assert code == 0 and all(v["resolved"] is False for v in json.loads(out).values())


def test_human_output_is_plain_text_without_a_terminal(
    stack_settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "kafka", "status")
    assert code == 0
    assert out.startswith("broker running") and "\x1b[" not in out


def test_rollback_of_nothing_published_changes_nothing(
    iceberg_catalog: Catalog, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra in (["--dry-run"], ["--dry-run", "--json"], []):
        code, out, err = _run(capsys, "rollback", "--run", "no-such-run", *extra)
        assert code == 4 and out == ""
        assert err.startswith("error: no successful publish of run no-such-run")


# -- the rollback's trace in Dagster ----------------------------------------------------------

H1, H2 = datetime(2026, 6, 1, 1, tzinfo=UTC), datetime(2026, 6, 1, 2, tzinfo=UTC)


def _undone() -> list[RollbackResult]:
    return [
        RollbackResult(
            "lake.lakehouse.raw_orders",
            snapshot_before=222,
            restored_snapshot=111,
            undone_runs=["run-b"],
            partitions=[HourRestore(H1, "run-a", 111), HourRestore(H2)],
        ),
        RollbackResult("lake.lakehouse.not_an_asset", 2, 1, ["run-b"], [], [HourRestore(H1)]),
    ]


def test_rollback_is_recorded_per_asset_partition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    report = rollback._report_rollback(_undone(), what="backfill bf1", backfill_id="bf1")
    assert report == {
        "recorded": True,
        "dagster_home": str(tmp_path),
        "materializations": 1,
        "observations": 1,
    }
    key = dg.AssetKey(["raw", "orders"])
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        (restored,) = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=["2026-06-01-01:00"]), limit=5
        ).records
        (emptied,) = instance.fetch_observations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=["2026-06-01-02:00"]), limit=5
        ).records
    assert restored.asset_materialization is not None
    meta = {k: v.value for k, v in restored.asset_materialization.metadata.items()}
    assert meta["rollback_of"] == "backfill bf1" and meta["undone_backfill"] == "bf1"
    assert meta["restored_run"] == "run-a" and meta["published_snapshot"] == 111
    assert meta["restored_snapshot"] == 111 and meta["undone_runs"] == "run-b"
    assert emptied.asset_observation is not None
    meta = {k: v.value for k, v in emptied.asset_observation.metadata.items()}
    assert meta["rollback_of"] == "backfill bf1" and meta["rows"] == "none since the rollback"


def test_rollback_without_an_instance_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    report = rollback._report_rollback(_undone(), what="run run-b", backfill_id=None)
    assert report["recorded"] is False and "DAGSTER_HOME is not set" in report["reason"]


# -- the Dagster home of a command run from the repository -----------------------------------


def test_dagster_home_defaults_to_a_dagster_yaml_found(tmp_path: Path) -> None:
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    (repo / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    search = (elsewhere, repo)
    assert cli.dagster_home_defaults({}, search) == {
        "DAGSTER_HOME": str(repo),
        "BACKFILL_DAGSTER_STORAGE": str(repo / ".stack" / "dagster"),
    }
    state = tmp_path / "state"
    assert cli.dagster_home_defaults({"BACKFILL_HOME": str(state)}, search) == {
        "DAGSTER_HOME": str(repo),
        "BACKFILL_DAGSTER_STORAGE": str(state / "dagster"),
    }
    given = {"BACKFILL_DAGSTER_STORAGE": "/srv/dagster"}
    assert cli.dagster_home_defaults(given, search) == {"DAGSTER_HOME": str(repo)}
    assert cli.dagster_home_defaults({"DAGSTER_HOME": str(elsewhere)}, search) == {}
    assert cli.dagster_home_defaults({}, (elsewhere,)) == {}


def test_dagster_home_of_the_repository_is_the_scripts_and_settings_one() -> None:
    """From the repository root: the directory scripts/demo.sh and scripts/test.sh export, and
    the storage the settings module defaults to (under BACKFILL_HOME, else .stack)."""
    from backfill_assets.stack.settings import REPO_ROOT

    found = cli.dagster_home_defaults({}, (REPO_ROOT,))
    assert found["DAGSTER_HOME"] == str(REPO_ROOT)
    settings = Settings.from_env({})
    assert found["BACKFILL_DAGSTER_STORAGE"] == str(settings.dagster_storage)


def test_a_command_run_from_the_repository_uses_its_dagster_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No export needed: the command sees the default; the caller's environment is unchanged."""
    import click

    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "dagster_home_dirs", lambda: (Path.cwd(),))
    for name in ("DAGSTER_HOME", "BACKFILL_DAGSTER_STORAGE", "BACKFILL_HOME"):
        monkeypatch.delenv(name, raising=False)

    @click.command("probe")
    def probe() -> int:
        with dg.DagsterInstance.get() as instance:
            click.echo(f"{instance.root_directory} {os.environ['BACKFILL_DAGSTER_STORAGE']}")
        return 0

    monkeypatch.setitem(cli.cli.commands, "probe", probe)
    code, out, err = _run(capsys, "probe")
    assert code == 0, err
    assert out.split() == [str(tmp_path), str(tmp_path / ".stack" / "dagster")]
    assert "DAGSTER_HOME" not in os.environ and "BACKFILL_DAGSTER_STORAGE" not in os.environ


def test_progress_on_a_terminal_shows_count_rate_and_eta() -> None:
    from rich.console import Console

    ui = cli.Ui(as_json=False)
    screen = io.StringIO()
    ui.err = Console(file=screen, force_terminal=True, width=120, color_system=None)
    with ui.progress("materializing orders", 8, "partitions") as update:
        for done in range(1, 9):
            update(done, None)
    last = screen.getvalue().rsplit("\r", 1)[-1]
    assert "materializing orders" in last and " 8/8 " in last
    assert "partitions/s" in last and "ETA" in last


def test_progress_is_off_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    ui = cli.Ui(as_json=False)
    with ui.progress("archiving orders", 3, "partitions") as update:
        update(3, None)
    assert capsys.readouterr() == ("", "")


def test_a_dry_run_reads_publishes_the_ledger_lacks_from_history(tmp_path: Path) -> None:
    import pyarrow as pa
    from pyiceberg.catalog.sql import SqlCatalog

    from backfill_assets.lake.operations import rollback

    cat = SqlCatalog(
        "t", uri=f"sqlite:///{tmp_path}/c.db", warehouse=f"file://{tmp_path}/warehouse"
    )
    cat.create_namespace("ns")
    table = cat.create_table("ns.events", pa.schema([pa.field("x", pa.int64())]))
    table.append(pa.table({"x": [1]}))  # not a publish: no backfill.* summary
    table.append(
        pa.table({"x": [2]}),
        snapshot_properties={
            "backfill.published": "true",
            "backfill.run-id": "r1",
            "backfill.window": "2026-06-01T01:00:00+00:00/2026-06-01T03:00:00+00:00",
        },
    )
    table = cat.load_table("ns.events")
    found = rollback._unrecorded(cat, "ns", "t.ns.events", table)
    assert [(e.run_id, e.hour) for e in found] == [("r1", H1), ("r1", H2)]
    assert {e.snapshot_id for e in found} == {table.metadata.current_snapshot_id}
    assert not cat.table_exists("ns.backfill_ledger"), "a dry run writes nothing"


def test_maintain_refuses_an_unknown_table_naming_the_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, "maintain", "--table", "orders_hourlyy")
    assert code == 2
    assert err.startswith("error: unknown table(s) 'orders_hourlyy'")
    assert "orders_hourly" in err and "bookkeeping" in err and "Traceback" not in err


def test_maintain_runs_an_audited_pass(
    stack_settings: Settings,
    iceberg_catalog: Catalog,
    spark_session: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real pass over the audit table (Spark procedures included), reported as JSON and
    recorded in the audit table itself."""
    from backfill_assets.lake.write import audit

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    ns = stack_settings.catalog.namespace
    audit.append(
        iceberg_catalog, ns, audit.AuditRecord(event="archive", table_name="t", outcome="succeeded")
    )
    code, out, _ = _run(capsys, "maintain", "--table", audit.AUDIT_TABLE, "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["failed"] == []
    report = doc["tables"][audit.AUDIT_TABLE]
    assert report["ok"] is True and report["snapshots_before"] >= 1
    assert set(report["steps"]) >= {"drop_branches", "compact", "expire_snapshots"}
    rows = [r for r in audit.query(iceberg_catalog, ns) if r["event"] == "maintenance"]
    assert rows and rows[0]["launched_by"].startswith("cli:")


def test_last_is_the_hours_that_ended_and_are_past_the_seal_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BACKFILL_SEAL_GRACE_S", "300")
    at = datetime(2026, 6, 1, 10, 20, tzinfo=UTC)  # 10:00-11:00 runs; 09:00 ended 20 min ago
    assert resolve_range(None, None, "6h", now=at) == (
        "2026-06-01T04:00:00+00:00",
        "2026-06-01T10:00:00+00:00",
    )
    early = datetime(2026, 6, 1, 10, 2, tzinfo=UTC)  # 09:00-10:00 may still be sealing
    assert resolve_range(None, None, "2d", now=early) == (
        "2026-05-30T09:00:00+00:00",
        "2026-06-01T09:00:00+00:00",
    )
    assert resolve_range("a", "b", None) == ("a", "b")
