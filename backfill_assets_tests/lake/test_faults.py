"""Fault injection: kill -9 of a run, a broker restart mid-replay, two overlapping runs.

Every materialization under test runs in its own process (``python -m
backfill_assets_tests.lake.test_faults``, the runner at the bottom of this file) with this session's
``BACKFILL_*`` environment and a shared temporary ``DAGSTER_HOME``, as its own process group,
so a SIGKILL takes the run's Spark JVM and Python workers with it (a container or node dying).
Kills come from the failpoints of :mod:`backfill_assets.stack.faults` (``BACKFILL_FAULT_POINT``) or,
for the branch write, from this test watching the table's data directory and killing the
process group the moment the write's first data file appears.

What is asserted: a killed run died by SIGKILL; main is exactly its pre-run snapshot and
checksum, or exactly the clean result (and for kills before the fast-forward, exactly the
pre-run one); a reader polling main during the run never saw anything else; what the killed
run left (its branch, orphan data files, no audit row). One re-run over all killed hours, with
every killed run's branch still there, converges to the checksum of a clean reference backfill
with no duplicate events and audits the publish the last killed run never recorded. A broker
stopped and restarted mid-read ends the run on its own (retried and published, or failed
naming what it could not read), never hung. Two overlapping runs: both publish one after the
other, or one is fenced; re-running the fenced one gives the clean union.

The kill scenarios share one table and use disjoint hours, so every scenario's pre-run state
differs from its clean result (a fault that published nothing is distinguishable from a clean
publish). The reference table is a second topic generated from the same config (identical
offsets and bytes, which the fixture checks); checksums are sums over rows, so the expected
checksum of any set of hours is the sum of the reference's per-hour checksums. The reference
and the faulted table's first hour are not under test and run in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.lake.coverage.detect import PARTITION_FMT
from backfill_assets.lake.write import wap
from backfill_assets.spec.declared import renamed
from backfill_assets_tests.support import broker_fault, connect_server, warehouse

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

    from backfill_assets.demo.generator import GroundTruth
    from backfill_assets.spec.model import TopicSpec
    from backfill_assets.stack.settings import Settings

START = datetime(2026, 4, 1, tzinfo=UTC)
HOURS = 10
EVENTS_PER_HOUR = 150
SEED = 23
# A run here takes under a minute on a busy 2-core machine; this bounds a hang.
RUN_TIMEOUT_S = 480

pytestmark = pytest.mark.faults


def _hour(i: int) -> datetime:
    return START + timedelta(hours=i)


def _hours(first: int, last: int) -> set[str]:
    return {_hour(i).isoformat() for i in range(first, last + 1)}


# ------------------------------------------------------------------------------ the world
@dataclasses.dataclass
class World:
    settings: Settings
    env: dict[str, str]
    spec: TopicSpec  # the table the scenarios fault
    truth: GroundTruth
    reference: dict[str, tuple[int, int]]  # hour -> (rows, checksum) of a clean backfill
    logs: Path

    @property
    def table(self) -> str:
        return _spark_table(self.settings, self.spec)

    def expected(self, hours: set[str]) -> tuple[int, int]:
        """(rows, checksum) a clean backfill of ``hours`` leaves on main."""
        return (
            sum(self.reference[h][0] for h in hours),
            sum(self.reference[h][1] for h in hours),
        )


def _spark_table(settings: Settings, spec: TopicSpec) -> str:
    return f"{settings.catalog.name}.{settings.catalog.namespace}.{spec.raw_table}"


def _spec(topic: str) -> TopicSpec:
    from backfill_assets.defs.definitions import SPECS

    return renamed(SPECS[0], topic=topic)


def _generate(settings: Settings, topic: str) -> GroundTruth:
    from backfill_assets.demo.generator import GeneratorConfig, generate

    config = GeneratorConfig(
        topic=topic, start=START, hours=HOURS, events_per_hour=EVENTS_PER_HOUR, seed=SEED
    )
    return generate(settings, config)


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings,
    stack_env: dict[str, str],
    spark_session: SparkSession,
    tmp_path_factory: pytest.TempPathFactory,
) -> World:
    """The faulted table, seeded with a clean publish of hour 0, and the clean reference."""
    _OWN_SESSION[0] = getattr(spark_session, "session_id", None)
    suffix = uuid.uuid4().hex[:8]
    faulted, reference = _spec(f"orders_faults_{suffix}"), _spec(f"orders_ref_{suffix}")
    truth = _generate(stack_settings, faulted.topic)
    ref_truth = _generate(stack_settings, reference.topic)
    # Same config, so the same records at the same offsets: the reference's checksums apply.
    assert ref_truth.hour_offsets == truth.hour_offsets
    assert ref_truth.kafka_hours == truth.kafka_hours

    dagster_home = tmp_path_factory.mktemp("faults-dagster-home")
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, **stack_env, "DAGSTER_HOME": str(dagster_home)}
    # Create the instance's SQLite storage once: two runs starting together on a fresh
    # DAGSTER_HOME race on its schema migration (alembic_version UNIQUE constraint).
    subprocess.run(
        [sys.executable, "-c", "import dagster as dg; dg.DagsterInstance.get().dispose()"],
        env=env,
        check=True,
        timeout=120,
    )
    env.pop("BACKFILL_FAULT_POINT", None)
    env.pop("BACKFILL_REPLAY_MAX_RECORDS_PER_S", None)
    logs = tmp_path_factory.mktemp("faults-runs")

    # The clean reference (every hour) and the seed are not under test: they run in this
    # process, on its warm Spark session.
    _materialize_here(reference, 0, HOURS - 1)
    per_hour = _per_hour(spark_session, _spark_table(stack_settings, reference), reference)
    for hour, figures in truth.kafka_hours.items():
        # The raw table is the committed log: re-sent events are rows too.
        want = figures["valid"] + figures["tombstones"] + figures["duplicates"]
        assert per_hour[hour][0] == want, hour
    _materialize_here(faulted, 0, 0)
    built = World(stack_settings, env, faulted, truth, per_hour, logs)
    _assert_clean(spark_session, built, _hours(0, 0))
    return built


def _materialize_here(spec: TopicSpec, first: int, last: int) -> None:
    import dagster as dg

    from backfill_assets.defs.assets import build_raw_asset
    from backfill_assets_tests.support.runs import materialize_range

    with dg.instance_for_test() as instance:
        result = materialize_range([build_raw_asset(spec)], instance, _hour(first), _hour(last))
    assert result.success


# ------------------------------------------------------------------------------ runs
@dataclasses.dataclass
class Run:
    proc: subprocess.Popen[bytes]
    run_id: str
    log: Path

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        """The return code; a run still going after ``timeout_s`` is killed and fails the test."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"run {self.run_id} hung for {timeout_s:.0f}s:\n{self.tail()}")
        _wait_group_gone(self.proc.pid)
        # A Connect server finishes what a killed client had sent: wait for it.
        if code == -signal.SIGKILL and (left := connect_server.wait_idle(_OWN_SESSION[0])):
            print(f"FAULTS killed run {self.run_id}: the server still ran {left}")  # noqa: T201
        return code

    def kill(self) -> None:
        """SIGKILL the run's process group (only the group this test started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _wait_group_gone(self.proc.pid)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def result(self) -> dict[str, Any]:
        """The runner's last line (JSON), written when the run ended by itself."""
        for line in reversed(self.log.read_text(errors="replace").splitlines()):
            if line.startswith("FAULTS-RESULT "):
                parsed: dict[str, Any] = json.loads(line.removeprefix("FAULTS-RESULT "))
                return parsed
        raise AssertionError(f"run {self.run_id} wrote no result:\n{self.tail()}")


_STARTED: list[Run] = []
# The test's own Spark Connect session (its queries are not a killed run's), if any.
_OWN_SESSION: list[str | None] = [None]


@pytest.fixture(scope="module", autouse=True)
def _no_run_outlives_the_module() -> Iterator[None]:
    yield
    for run in _STARTED:
        if run.proc.poll() is None:
            run.kill()


def _start(world: World, first: int, last: int, **env: str) -> Run:
    run_id = str(uuid.uuid4())
    log = world.logs / f"{run_id}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "backfill_assets_tests.lake.test_faults",
                "--topic",
                world.spec.topic,
                "--first",
                f"{_hour(first):{PARTITION_FMT}}",
                "--last",
                f"{_hour(last):{PARTITION_FMT}}",
                "--run-id",
                run_id,
            ],
            cwd=Path(__file__).resolve().parents[2],
            env={**world.env, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    run = Run(proc, run_id, log)
    _STARTED.append(run)
    return run


def _wait_group_gone(pgid: int, timeout_s: float = 30.0) -> None:
    """Wait until no process of group ``pgid`` (a run this test started) is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            raise AssertionError(f"processes of run group {pgid} outlived the run")
        time.sleep(0.1)


# ------------------------------------------------------------------------------ observing main
@dataclasses.dataclass(frozen=True)
class MainState:
    snapshot_id: int | None
    rows: int
    checksum: int
    hours: frozenset[str]


def _main_snapshot(spark: SparkSession, table: str) -> int | None:
    from backfill_assets.lake.write.wap import ref_snapshot_id

    if not spark.catalog.tableExists(table):
        return None
    return ref_snapshot_id(spark, table, "main")


def _main_state(spark: SparkSession, world: World) -> MainState:
    """Main's snapshot and, read at exactly that snapshot, its rows, checksum and hours."""
    from pyspark.sql import functions as F

    from backfill_assets.lake.write.replay import checksum_expr

    snap = _main_snapshot(spark, world.table)
    if snap is None:
        return MainState(None, 0, 0, frozenset())
    df = spark.sql(f"SELECT * FROM {world.table} VERSION AS OF {snap}")
    row = df.agg(
        F.count("*").alias("n"),
        checksum_expr(world.spec).alias("c"),
        F.collect_set(F.date_trunc("hour", "kafka_timestamp")).alias("h"),
    ).first()
    assert row is not None
    hours = frozenset(h.astimezone(UTC).isoformat() for h in row["h"])
    return MainState(snap, int(row["n"]), int(row["c"]), hours)


def _per_hour(spark: SparkSession, table: str, spec: TopicSpec) -> dict[str, tuple[int, int]]:
    from pyspark.sql import functions as F

    from backfill_assets.lake.write.replay import checksum_expr

    rows = (
        spark.table(table)
        .groupBy(F.date_trunc("hour", "kafka_timestamp").alias("h"))
        .agg(F.count("*").alias("n"), checksum_expr(spec).alias("c"))
        .collect()
    )
    return {r["h"].astimezone(UTC).isoformat(): (int(r["n"]), int(r["c"])) for r in rows}


def _assert_clean(spark: SparkSession, world: World, hours: set[str]) -> MainState:
    """Main holds exactly a clean backfill of ``hours``: checksum, rows, no offset twice."""
    state = _main_state(spark, world)
    assert state.hours == hours
    assert (state.rows, state.checksum) == world.expected(hours)
    row = spark.sql(
        f"SELECT count(*) - count(DISTINCT kafka_partition, kafka_offset) AS dup_offsets "
        f"FROM {world.table} VERSION AS OF {state.snapshot_id}"
    ).first()
    assert row is not None and row["dup_offsets"] == 0
    for hour in hours:
        truth = world.truth.kafka_hours[hour]
        want = truth["valid"] + truth["tombstones"] + truth["duplicates"]
        assert world.reference[hour][0] == want, hour
    return state


class Reader(threading.Thread):
    """A reader of main during a run: every checksum it sees must be a whole state."""

    def __init__(self, spark: SparkSession, world: World) -> None:
        super().__init__(daemon=True)
        self.spark, self.world = spark, world
        self.seen: set[tuple[int, int]] = set()
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        from pyspark.sql import functions as F

        from backfill_assets.lake.write.replay import checksum_expr

        try:
            while not self._stop_event.wait(3.0):
                if not self.spark.catalog.tableExists(self.world.table):
                    continue
                # One query, one snapshot: exactly what any reader of main gets.
                row = (
                    self.spark.table(self.world.table)
                    .agg(F.count("*").alias("n"), checksum_expr(self.world.spec).alias("c"))
                    .first()
                )
                assert row is not None
                self.seen.add((int(row["n"]), int(row["c"])))
        except BaseException as exc:
            self.error = exc

    def finish(self) -> set[tuple[int, int]]:
        self._stop_event.set()
        self.join(timeout=60)
        if self.error is not None:
            raise self.error
        return self.seen


# ------------------------------------------------------------------------------ catalog views
def _audit_rows(settings: Settings, run_id: str) -> list[dict[str, Any]]:
    from backfill_assets.lake.write import audit
    from backfill_assets.stack import catalog

    return audit.query(catalog.load(settings.catalog), settings.catalog.namespace, run_id=run_id)


def _refs(spark: SparkSession, table: str) -> dict[str, int]:
    return {
        r["name"]: int(r["snapshot_id"])
        for r in spark.sql(f"SELECT name, snapshot_id FROM {table}.refs").collect()
    }


def _summary(spark: SparkSession, table: str, snapshot_id: int) -> dict[str, str]:
    row = spark.sql(
        f"SELECT summary FROM {table}.snapshots WHERE snapshot_id = {snapshot_id}"
    ).first()
    assert row is not None
    return dict(row[0])


@dataclasses.dataclass(frozen=True)
class DataDir:
    """A table's data prefix: a local directory, or an S3 prefix on the cluster stack."""

    settings: Settings
    uri: str


def _data_dir(catalog: Catalog, world: World) -> DataDir:
    ident = f"{world.settings.catalog.namespace}.{world.spec.raw_table}"
    return DataDir(world.settings, catalog.load_table(ident).location().rstrip("/") + "/data")


def _data_files(root: DataDir) -> set[str]:
    """Every data file under a table's data directory (referenced by a snapshot or not)."""
    return warehouse.parquet_files(root.settings, root.uri)


# ------------------------------------------------------------------------------ the failpoints
def test_fault_point_setting_is_validated_and_inert_when_unset() -> None:
    from backfill_assets.errors import SettingsError
    from backfill_assets.stack import faults
    from backfill_assets.stack.settings import Settings

    with pytest.raises(SettingsError, match=r"BACKFILL_FAULT_POINT='nowhere'.*checks_passed"):
        Settings.from_env({"BACKFILL_FAULT_POINT": "nowhere"})
    assert Settings.from_env({"BACKFILL_FAULT_POINT": "branch_opened"}).fault_point == (
        "branch_opened"
    )
    assert Settings.from_env({}).fault_point is None
    with pytest.raises(ValueError, match="unknown failpoint"):
        faults.failpoint("nowhere")
    for point in faults.POINTS:  # this process has no BACKFILL_FAULT_POINT: nothing happens
        faults.failpoint(point)


# ------------------------------------------------------------------------------ kill -9
# (fault, first hour, last hour): disjoint hours after the seed publish of hour 0. The kills run
# in this order; one re-run then covers all their hours, with every killed run's leftovers.
BEFORE_FAST_FORWARD = ("branch_write", "branch_opened", "checks_passed", "branch_committed")
KILLS = [
    ("branch_write", 1, 2),
    ("branch_opened", 3, 3),
    ("checks_passed", 4, 4),
    ("branch_committed", 5, 5),
    ("main_fast_forwarded", 6, 6),
]
KILLED_HOURS = (1, 6)


@dataclasses.dataclass
class Killed:
    fault: str
    run_id: str
    main_after: MainState


@pytest.fixture(scope="module")
def killed() -> list[Killed]:
    """The killed runs, in order, for the re-run test."""
    return []


@pytest.mark.parametrize(("fault", "first", "last"), KILLS, ids=[k[0] for k in KILLS])
def test_kill_9_leaves_main_whole(
    world: World,
    spark_session: SparkSession,
    iceberg_catalog: Catalog,
    killed: list[Killed],
    fault: str,
    first: int,
    last: int,
) -> None:
    spark = spark_session
    pre = _main_state(spark, world)
    scope = _hours(first, last)
    assert pre.hours and not pre.hours & scope, "the fault's hours must be new to main"
    clean = world.expected(set(pre.hours | scope))
    refs_before = _refs(spark, world.table)

    reader = Reader(spark, world)
    reader.start()
    if fault == "branch_write":
        # A genuine mid-write kill: the moment the branch write's first data file exists, the
        # run's whole process group gets SIGKILL. Spark's tasks write the data files, then the
        # driver makes the one commit, so the kill lands between the two (or, on a very slow
        # machine, just after the branch commit: both states are checked below).
        data_dir = _data_dir(iceberg_catalog, world)
        files_before = _data_files(data_dir)
        run = _start(world, first, last)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not _data_files(data_dir) - files_before:
            assert run.proc.poll() is None, f"run ended before writing:\n{run.tail()}"
            assert time.monotonic() < deadline, "no data file appeared"
            time.sleep(0.005)
        os.killpg(run.proc.pid, signal.SIGKILL)
    else:
        run = _start(world, first, last, BACKFILL_FAULT_POINT=fault)
    code = run.wait()
    seen = reader.finish()
    assert code == -signal.SIGKILL, f"exit {code}, expected death by SIGKILL:\n{run.tail()}"

    after = _main_state(spark, world)
    if fault in BEFORE_FAST_FORWARD:
        assert after == pre, "main moved although the run died before publishing"
    else:
        assert after.snapshot_id != pre.snapshot_id
        assert (after.rows, after.checksum) == clean
        head = _summary(spark, world.table, after.snapshot_id or 0)
        assert head["backfill.run-id"] == run.run_id
        assert head["backfill.published"] == "true"
    assert seen <= {(pre.rows, pre.checksum), clean}, "a reader saw a partial main"

    # What the killed run left: its branch (for the mid-write kill, only if the kill landed
    # after the commit), and no audit row (nothing runs after SIGKILL).
    branch = wap.branch_name(run.run_id)
    refs = _refs(spark, world.table)
    stale = set(refs) - set(refs_before)
    assert stale == {branch}
    if fault == "branch_write":
        # Data files of the killed write exist; if the commit did not happen, none of them is
        # referenced by any snapshot, and the branch is still at main's snapshot.
        new_files = _data_files(_data_dir(iceberg_catalog, world)) - files_before
        assert new_files
        committed = refs[branch] != pre.snapshot_id
        referenced = _referenced_files(spark, world.table)
        if not committed:
            assert not new_files & referenced, "an uncommitted write's files are referenced"
        where = "after the branch commit" if committed else "before the branch commit"
        orphans = len(new_files - referenced)
        print(f"FAULTS mid-write kill landed {where}; {orphans} unreferenced data files")  # noqa: T201
    elif fault == "main_fast_forwarded":
        assert refs[branch] == after.snapshot_id
    elif fault == "branch_opened":
        assert refs[branch] == pre.snapshot_id, "nothing was written to the branch"
    else:
        head = _summary(spark, world.table, refs[branch])
        assert head["backfill.run-id"] == run.run_id
        expect = "true" if fault == "branch_committed" else None
        assert head.get("backfill.published") == expect
    assert _audit_rows(world.settings, run.run_id) == []
    killed.append(Killed(fault, run.run_id, after))


def test_rerun_after_kills_converges(
    world: World, spark_session: SparkSession, killed: list[Killed]
) -> None:
    """One re-run over every killed hour, with all the killed runs' branches still there."""
    spark = spark_session
    assert [k.fault for k in killed] == [k[0] for k in KILLS], "run the kill tests first"
    pre = _main_state(spark, world)
    assert pre == killed[-1].main_after
    hours = _hours(0, KILLED_HOURS[1])
    assert (pre.rows, pre.checksum) != world.expected(hours)
    stale = {wap.branch_name(k.run_id) for k in killed}
    assert stale <= set(_refs(spark, world.table))

    rerun = _start(world, *KILLED_HOURS)
    assert rerun.wait() == 0, rerun.tail()
    final = _assert_clean(spark, world, hours)
    rows = _audit_rows(world.settings, rerun.run_id)
    assert [(r["event"], r["outcome"]) for r in rows] == [("publish", "succeeded")]
    assert (rows[0]["snapshot_before"], rows[0]["snapshot_after"]) == (
        pre.snapshot_id,
        final.snapshot_id,
    )
    refs = set(_refs(spark, world.table))
    assert wap.branch_name(rerun.run_id) not in refs, "the re-run dropped its branch"
    # The branch of the run killed after its fast-forward holds nothing main lacks: the re-run's
    # publish dropped it. A branch of a run killed earlier looks exactly like a live run's
    # branch, so it stays (for an operator, or a pruning job that asks Dagster).
    kept = {k.fault for k in killed if wap.branch_name(k.run_id) in refs}
    assert kept == set(BEFORE_FAST_FORWARD)
    # The run killed after the fast-forward published without an audit row; the re-run
    # records it from main's history.
    late = _audit_rows(world.settings, killed[-1].run_id)
    assert [(r["event"], r["outcome"]) for r in late] == [("publish", "succeeded")]
    assert late[0]["snapshot_after"] == killed[-1].main_after.snapshot_id
    assert late[0]["snapshot_before"] == killed[-2].main_after.snapshot_id
    assert rerun.run_id in late[0]["detail"]
    for k in killed[:-1]:
        assert _audit_rows(world.settings, k.run_id) == [], "unpublished kills stay unaudited"


def _referenced_files(spark: SparkSession, table: str) -> set[str]:
    """Data files referenced by any snapshot of any ref of ``table``."""
    rows = spark.sql(f"SELECT file_path FROM {table}.all_data_files").collect()
    return {warehouse.object_name(r["file_path"]) for r in rows}


# ------------------------------------------------------------------------------ the broker
BROKER_HOURS = (7, 9)
THROTTLE_RECORDS_PER_S = 20
BROKER_DOWN_S = 5.0


def test_broker_restart_mid_replay_fails_clearly_or_recovers(
    world: World, spark_session: SparkSession, kafka_to_fault: object
) -> None:
    """The session's broker is stopped during a throttled read and started again (same port,
    same data). The run must end on its own, never hang: either it retried and published the
    exact window, or it failed naming what it could not read with main untouched. Either way
    a re-run (if needed) converges with nothing lost or duplicated."""
    spark = spark_session
    pre = _main_state(spark, world)
    scope = _hours(*BROKER_HOURS)
    assert not pre.hours & scope
    records = sum(world.truth.kafka_hours[h]["records"] for h in scope)
    # At the cap the read alone lasts this long; the broker goes down well inside it.
    assert records / THROTTLE_RECORDS_PER_S >= 3 * BROKER_DOWN_S
    broker = broker_fault.victim(kafka_to_fault, world.spec.topic)
    bootstrap = broker.bootstrap
    pid_before = broker.status().pid

    run = _start(
        world, *BROKER_HOURS, BACKFILL_REPLAY_MAX_RECORDS_PER_S=str(THROTTLE_RECORDS_PER_S)
    )
    # The offsets contract comes from Python (librdkafka); the read from Spark's JVM. Once that
    # JVM holds a connection to the broker, the throttled chunked read is under way.
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not broker.reading(run.proc.pid):
        assert run.proc.poll() is None, f"run ended before reading:\n{run.tail()}"
        assert time.monotonic() < deadline, "the run's Spark never connected to Kafka"
        time.sleep(0.2)
    time.sleep(BROKER_DOWN_S)  # a chunk or two in
    assert run.proc.poll() is None, f"the run ended before the broker stopped:\n{run.tail()}"
    try:
        assert broker.stop()
        time.sleep(BROKER_DOWN_S)
        assert run.proc.poll() is None, "the run ended while the broker was down"
    finally:
        status = broker.start()
    assert status.responding and status.bootstrap_servers == bootstrap
    assert status.pid != pid_before
    code = run.wait()

    after = _main_state(spark, world)
    if code == 0:
        outcome = "retried and published"
        assert _audit_events(world, run.run_id) == [("publish", "succeeded")]
        final = _assert_clean(spark, world, set(pre.hours | scope))
    else:
        outcome = "failed clearly"
        assert code == 1, run.tail()
        assert after == pre, "a failed read must leave main untouched"
        errors = " ".join(run.result()["errors"])
        rows = _audit_rows(world.settings, run.run_id)
        assert [(r["event"], r["outcome"]) for r in rows] == [("run_failed", "failed")]
        named = [world.spec.topic, bootstrap]
        assert any(n in errors for n in named), f"error names neither topic nor broker: {errors}"
        rerun = _start(world, *BROKER_HOURS)
        assert rerun.wait() == 0, rerun.tail()
        final = _assert_clean(spark, world, set(pre.hours | scope))
    print(f"FAULTS broker restart mid-replay: {outcome}; main {final.snapshot_id}")  # noqa: T201


def _audit_events(world: World, run_id: str) -> list[tuple[str, str]]:
    return [(r["event"], r["outcome"]) for r in _audit_rows(world.settings, run_id)]


# ------------------------------------------------------------------------------ overlapping runs
def test_overlapping_runs_never_corrupt_main(world: World, spark_session: SparkSession) -> None:
    """Hours 1-4 and 3-6 of a fresh table, started together. Allowed: both publish one after
    the other (the second branched from the first's publish), or one publishes and the other is
    fenced (publish refused, main untouched by it). After re-running a fenced run, main is the
    clean result of hours 1-6. A reader never sees anything but whole results."""
    spark = spark_session
    topic = f"orders_overlap_{uuid.uuid4().hex[:8]}"
    truth = _generate(world.settings, topic)
    assert truth.hour_offsets == world.truth.hour_offsets
    ours = dataclasses.replace(world, spec=_spec(topic), truth=truth)
    spans = {"a": (1, 4), "b": (3, 6)}
    clean = {k: ours.expected(_hours(*v)) for k, v in spans.items()}
    union = ours.expected(_hours(1, 6))

    reader = Reader(spark, ours)
    reader.start()
    runs = {k: _start(ours, *v) for k, v in spans.items()}
    codes = {k: r.wait() for k, r in runs.items()}
    seen = reader.finish()
    assert seen <= {(0, 0), clean["a"], clean["b"], union}, "a reader saw a partial main"
    events = {k: _audit_events(ours, r.run_id) for k, r in runs.items()}
    rows = {k: _audit_rows(ours.settings, r.run_id) for k, r in runs.items()}
    state = _main_state(spark, ours)

    winners = [k for k, c in codes.items() if c == 0]
    assert winners, f"neither overlapping run published: {codes}\n{runs['a'].tail()}"
    if len(winners) == 2:
        outcome = "serialized"
        assert all(e == [("publish", "succeeded")] for e in events.values()), events
        first, second = sorted(winners, key=lambda k: rows[k][0]["finished_at"])
        assert rows[second][0]["snapshot_before"] == rows[first][0]["snapshot_after"]
        assert (state.rows, state.checksum) == union
    else:
        (winner,) = winners
        (loser,) = set(spans) - {winner}
        outcome = f"run {loser} fenced"
        assert codes[loser] == 1, runs[loser].tail()
        assert events[winner] == [("publish", "succeeded")]
        assert events[loser] == [("publish_refused", "failed")], events[loser]
        detail = rows[loser][0]["detail"]
        # The refusal names the run that published the overlapping window.
        assert f"run {runs[winner].run_id} published" in detail, detail
        assert "overlaps this run's window" in detail, detail
        assert rows[loser][0]["snapshot_before"] != state.snapshot_id
        assert "PublishError" in runs[loser].tail(20000)
        # Main is exactly the winner's clean result: nothing of the fenced run leaked.
        assert (state.rows, state.checksum) == clean[winner]
        assert state.snapshot_id == rows[winner][0]["snapshot_after"]
        rerun = _start(ours, *spans[loser])
        assert rerun.wait() == 0, rerun.tail()
        assert _audit_events(ours, rerun.run_id) == [("publish", "succeeded")]
    _assert_clean(spark, ours, _hours(1, 6))
    print(f"FAULTS overlapping runs: {outcome}")  # noqa: T201


# ------------------------------------------------------------------------------ the runner
def _main(argv: list[str]) -> int:
    """Materialize the raw asset of ``--topic`` over a partition range, in this process, on
    the Dagster instance of ``$DAGSTER_HOME``; print ``FAULTS-RESULT <json>`` at the end."""
    import dagster as dg

    from backfill_assets.defs.assets import build_raw_asset
    from backfill_assets.defs.definitions import RESOURCES

    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", required=True)
    parser.add_argument("--first", required=True)
    parser.add_argument("--last", required=True)
    parser.add_argument("--run-id", required=True)
    args = parser.parse_args(argv)
    job = dg.Definitions(
        assets=[build_raw_asset(_spec(args.topic))], resources=RESOURCES
    ).resolve_implicit_global_asset_job_def()
    with dg.DagsterInstance.get() as instance:
        result = job.execute_in_process(
            instance=instance,
            run_id=args.run_id,
            tags={
                "dagster/asset_partition_range_start": args.first,
                "dagster/asset_partition_range_end": args.last,
            },
            raise_on_error=False,
        )
    errors = [
        e.step_failure_data.error.message
        for e in result.all_events
        if e.is_step_failure and e.step_failure_data.error is not None
    ]
    report = {"run_id": result.run_id, "success": result.success, "errors": errors}
    print("FAULTS-RESULT " + json.dumps(report), flush=True)  # noqa: T201
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
