"""The lake reads the real Debezium's topics (issue 48): Postgres with logical decoding, Kafka
Connect and Debezium's Postgres connector (the shared ``cdc_source``), JSON with the schema
embedded and without.

The topic with the schema embedded is kept equal to the source by the real ``dagster-daemon``
running the package's sensors (gap and late-data) over a workspace whose ``topics.yaml`` holds
that topic alone: no run is launched by the test. Its runs are thin clients of a warm Spark
Connect server, as in the demo (``BACKFILL_SPARK_CONNECT``). Phases, each its own Kafka-time
hour: the snapshot; inserts, updates (one leaving a 100 kB TOASTed text unchanged) and
deletes; a key update (Debezium: delete, tombstone, create); a re-snapshot by a new connector
and slot on the same topics whose snapshot reads arrive after a newer change (ordered by the
source's LSN, not by arrival: no stale row, no duplicate, no deleted row back); a column added
to the source (the spec names it ahead of the migration). After each, the test waits until
the phase's changes are in Kafka, then until no sensor run is active and the gap check finds
nothing due (support/daemon.py); then the source read by ``SELECT`` is compared row for row
with the current-state table, and the raw table with the connector's committed records.

The topic without the schema gets the same changes; it is backfilled by hand once all phases
are in (one partition-range run of its raw and current-state assets through Dagster over every
hour, support/runs.py, in a child process on the same Connect server), then again once its
spec names the added column: the same comparisons at the end, and the column appears once the
spec names it.

Kafka Connect stamps records with its worker's clock, and a Kafka-time hour is backfilled only
once it has ended (and sealed), so the connectors here use the test clock
(support/cdc_source.py): each phase's records are stamped in an hour of the past, as by a worker
whose clock runs behind. Debezium's envelopes are untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
import yaml
from confluent_kafka import TopicPartition

from backfill_assets.defs.sensors import gap_sensor_name, late_sensor_name
from backfill_assets.demo import cdc as demo
from backfill_assets.errors import KafkaClientError
from backfill_assets.lake.coverage import detect
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack import catalog
from backfill_assets.stack.cdc import CdcSource, PgSource, debezium_postgres
from backfill_assets.stack.connect import ConnectStatus, LocalConnectServer
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.postgres import PgServer
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support import daemon, services
from backfill_assets_tests.support.cdc_source import Clock, SharedCdc

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.cdc

DATABASE, ROLE = "lake_cdc", "lakecdc"
BIG = 100_000  # characters of a large text value (stored out of line: TOAST)
# Per variant: connector name and topic prefix (also its slot), schemas.enable.
VARIANTS = {"embedded": ("lake-s", "lake_s", True), "none": ("lake-p", "lake_p", False)}
SENSORS = "embedded"  # the variant the daemon's sensors keep equal to the source, phase by phase
BY_HAND = "none"  # the variant backfilled by hand at the end
# The new connectors' snapshot waits this long after they made their slots.
RESNAPSHOT_DELAY_MS = 3000
TICK_S = 2  # BACKFILL_SENSOR_INTERVAL_S of the daemon
# A phase not converged after this long fails, with the sensors' last ticks (a run takes tens
# of seconds on 2 busy cores; the tier's whole time is about 3 minutes).
PHASE_S = 300
# Phases begin this many hours ago (one Kafka-time hour each). A tick of the gap sensor while a
# phase's changes are being written publishes the hour so far; the rest then belongs to the
# next hour (windows own offsets, not timestamps), so later phases may move an hour on.
HOURS_AGO = 10
COLUMNS: list[dict[str, Any]] = [
    {"name": "id", "type": "bigint", "nullable": False},
    {"name": "balance", "type": "decimal(12,2)", "nullable": False},
    {"name": "updated_at", "type": "timestamp", "nullable": False},
    {"name": "attrs", "type": "string"},
    {"name": "profile", "type": "string"},
    {"name": "notes", "type": "string"},
]
TIER = {"name": "tier", "type": "string"}  # the column the last phase adds to the source


def entry(variant: str, start: datetime, extra: list[dict[str, Any]] | None = None) -> Any:
    """The spec entry docs/cdc.md gives to copy, for this variant's topic."""
    _, prefix, _ = VARIANTS[variant]
    return {
        "topic": f"{prefix}.public.accounts",
        "format": "json",
        "envelope": "debezium",
        "schemas": variant,
        "key_field": "id",
        "partition_start": start.isoformat(),
        "allowed_lateness_hours": 0,
        "quarantine_max_ratio": 0.0,
        "columns": [*COLUMNS, *(extra or [])],
    }


def spec(variant: str, start: datetime, extra: list[dict[str, Any]] | None = None) -> TopicSpec:
    return TopicSpec.model_validate(entry(variant, start, extra))


@dataclass
class Phase:
    """What one phase's runs made of one topic, and what the source and Kafka held then."""

    name: str
    runs: list[str]  # the runs that published it
    success: bool
    checks: dict[str, list[bool]]  # asset:check -> each evaluation passed
    source: dict[int, dict[str, Any]]  # id -> the source's row by SELECT, as the lake holds it
    current: dict[int, dict[str, Any]]  # id -> the live current-state row
    deleted: set[int]  # ids marked deleted in the current state
    raw_offsets: list[int]  # the raw table's offsets
    quarantined: int
    kafka_offsets: list[int]  # the committed records' offsets
    unavailable: int  # current rows still naming unavailable columns
    failures: list[str] = field(default_factory=list)


@dataclass
class Lake:
    settings: Settings
    spark: SparkSession
    cdc: SharedCdc
    db: PgSource
    client: KafkaClient
    clock: Clock
    start: datetime
    instance: dg.DagsterInstance  # the daemon's
    daemon: subprocess.Popen[bytes]
    specs: dict[str, TopicSpec]
    rng: random.Random = field(default_factory=lambda: random.Random(48))
    # variant -> phase -> what it made
    phases: dict[str, dict[str, Phase]] = field(default_factory=lambda: {v: {} for v in VARIANTS})
    columns: list[str] = field(default_factory=lambda: [c["name"] for c in COLUMNS])
    seen_runs: set[str] = field(default_factory=set)
    spark_url: str = ""  # the Connect server's, for the backfill by hand

    @property
    def source(self) -> CdcSource:
        return self.cdc.source

    @property
    def server(self) -> PgServer:
        return self.cdc.server

    def sql(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """Each statement in its own transaction."""
        con = self.server.connect(self.db.dbname, self.db.user, self.db.password)
        try:
            with con.cursor() as cur:
                for text, args in statements:
                    cur.execute(text, args)
        finally:
            con.close()

    def query(self, text: str) -> list[tuple[Any, ...]]:
        con = self.server.connect(self.db.dbname, self.db.user, self.db.password)
        try:
            with con.cursor() as cur:
                cur.execute(text)
                return list(cur.fetchall())
        finally:
            con.close()

    def topic(self, variant: str) -> str:
        return self.specs[variant].topic


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _micros(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


def source_rows(lake: Lake, columns: list[str]) -> dict[int, dict[str, Any]]:
    """The source table's ``columns`` by ``SELECT``, as the lake holds them: json and jsonb as
    Postgres' text, timestamps as epoch microseconds."""
    cols = ", ".join(f"{c}::text" if c in ("attrs", "profile") else c for c in columns)
    rows = lake.query(f"SELECT {cols} FROM accounts")
    out = {}
    for row in rows:
        values = dict(zip(columns, row, strict=True))
        values["updated_at"] = _micros(values["updated_at"])
        out[values["id"]] = values
    return out


def lake_rows(
    lake: Lake, spec: TopicSpec, columns: list[str]
) -> tuple[dict[int, dict[str, Any]], set[int], int]:
    """The current-state table: live rows by id (``columns``, as :func:`source_rows`), deleted
    ids, and rows still naming a column Debezium left out."""
    from pyspark.sql import functions as F

    ns = lake.settings.catalog.namespace
    table = lake.spark.table(f"lake.{ns}.{spec.current_table}")
    rows = table.withColumn("updated_at", F.unix_micros("updated_at")).collect()
    live = {r["id"]: {c: r[c] for c in columns} for r in rows if not r["deleted"]}
    gone = {r["id"] for r in rows if r["deleted"]}
    unavailable = sum(1 for r in rows if r["cdc_unavailable"] is not None)
    return live, gone, unavailable


def kafka_offsets(lake: Lake, variant: str) -> list[int]:
    """The offsets of the committed records of the variant's topic (one partition)."""
    topic = lake.topic(variant)
    high = lake.client.log_ends(topic)[0][1]
    consumer = lake.client.range_consumer("cdc-lake-test")
    offsets: list[int] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 60
        while (not offsets or offsets[-1] < high - 1) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                offsets.append(int(msg.offset() or 0))
    finally:
        consumer.close()
    return offsets


Change = tuple[str | None, int]  # (op, or None for a tombstone; the key's id)


def changes(lake: Lake, variant: str, start: int) -> list[Change]:
    """The changes the variant's topic holds from offset ``start`` on, in order."""
    topic = lake.topic(variant)
    try:
        high = lake.client.log_ends(topic)[0][2]
    except KafkaClientError:  # the connector has not created its topic yet
        return []
    out: list[Change] = []
    if high <= start:
        return out
    consumer = lake.client.range_consumer("cdc-lake-test")
    try:
        consumer.assign([TopicPartition(topic, 0, start)])
        deadline = time.monotonic() + 30
        while start + len(out) < high and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error() is not None:
                continue
            key, value = json.loads(msg.key() or b"null"), msg.value()
            envelope = json.loads(value) if value is not None else None
            if variant == "embedded":
                key = key["payload"]
                envelope = envelope["payload"] if envelope is not None else None
            out.append((envelope["op"] if envelope is not None else None, key["id"]))
    finally:
        consumer.close()
    return out


def highs(lake: Lake) -> dict[str, int]:
    """Each variant's topic's high watermark (0 before the topic exists)."""
    out = {}
    for variant in VARIANTS:
        try:
            out[variant] = lake.client.log_ends(lake.topic(variant))[0][2]
        except KafkaClientError:
            out[variant] = 0
    return out


def wait_until(
    lake: Lake, start: dict[str, int], done: Callable[[list[Change]], bool], what: str
) -> None:
    """Wait until each variant's topic holds, from ``start`` on, the changes ``done`` looks
    for: the connectors wrote a phase's changes (Debezium writes in commit order, and may
    write a change twice: a task that restarts sends again what it had not committed)."""
    deadline = time.monotonic() + 90
    while True:
        seen = {v: changes(lake, v, start[v]) for v in VARIANTS}
        if all(done(found) for found in seen.values()):
            return
        assert time.monotonic() < deadline, f"waiting for {what}, the topics hold {seen}"
        time.sleep(0.2)


def record(
    lake: Lake, variant: str, name: str, runs: list[str], checks: dict[str, list[bool]],
    failures: list[str], columns: list[str],
) -> None:  # fmt: skip
    """Record what the runs ``runs`` made of the variant's topic as phase ``name``: the
    source's and the current state's ``columns``, the raw offsets, Kafka's."""
    s = lake.specs[variant]
    current, deleted, unavailable = lake_rows(lake, s, columns)
    ns = lake.settings.catalog.namespace
    raw = sorted(
        r[0] for r in lake.spark.table(f"lake.{ns}.{s.raw_table}").select("kafka_offset").collect()
    )
    quarantined = lake.spark.table(f"lake.{ns}.{s.quarantine_table}").count()
    lake.phases[variant][name] = Phase(
        name, runs, bool(runs) and not failures, checks, source_rows(lake, columns), current,
        deleted, raw, quarantined, kafka_offsets(lake, variant), unavailable, failures,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The daemon's sensors, and the backfill by hand
# --------------------------------------------------------------------------------------------


def _due(lake: Lake) -> dict[str, list[datetime]]:
    """What the gap check still finds for the sensors' topic (empty: nothing due)."""
    s = lake.specs[SENSORS]
    cat = catalog.load(lake.settings.catalog)
    found = detect.find(lake.client, cat, lake.settings.catalog.namespace, s)
    due = {"raw": found.raw_gaps, "current": found.current_gaps}
    return {k: v for k, v in due.items() if v}


def converge(lake: Lake, name: str) -> None:
    """Wait, with the daemon doing every launch, until no sensor run is active and nothing is
    due; record the phase (every run the sensors launched since the last phase). Fail at once
    when a sensor's run fails, or after PHASE_S with what is due and the last ticks."""
    began = time.time()
    due: dict[str, list[datetime]] = {}
    while True:
        assert lake.daemon.poll() is None, "the daemon exited: see its services.log"
        failed = daemon.failures(lake.instance, began)
        assert not failed, f"{name}: a sensor-launched run failed:\n" + "\n".join(failed)
        if not daemon.sensor_runs(lake.instance, daemon.ACTIVE):
            due = _due(lake)
            if not due:
                break
        if time.time() - began > PHASE_S:
            s = lake.specs[SENSORS]
            ticks = [gap_sensor_name(s), late_sensor_name(s)]
            raise AssertionError(
                f"{name}: not converged after {PHASE_S} s; still due {due}; last ticks:\n"
                + daemon.tick_summary(lake.instance, ticks, began)
            )
        time.sleep(1)
    runs = [r.run_id for r in daemon.sensor_runs(lake.instance) if r.run_id not in lake.seen_runs]
    lake.seen_runs.update(runs)
    checks = daemon.check_results(lake.instance, runs)
    record(lake, SENSORS, name, runs, checks, [], list(lake.columns))


# The backfill by hand, in a child process whose Spark is the warm Connect server the daemon's
# runs use (a process holds either classic Spark or Connect, and this one reads with classic).
BY_HAND_CHILD = r"""
import json, sys
from datetime import datetime
from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.spec.model import TopicSpec
from backfill_assets_tests.support.runs import materialize_range

entry, first, last = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
assets = build_topic_assets(TopicSpec.model_validate(entry))
result = materialize_range(
    assets, None, datetime.fromisoformat(first), datetime.fromisoformat(last), raise_on_error=False
)
failures = [str(e.event_specific_data)[:2000] for e in result.all_events if e.is_failure]
checks = [
    (f"{e.asset_key.to_user_string()}:{e.check_name}", bool(e.passed))
    for e in result.get_asset_check_evaluations()
]
print("RESULT " + json.dumps({"run": result.run_id, "success": result.success,
                              "failures": failures, "checks": checks}))
"""


def start_by_hand(lake: Lake, extra: list[dict[str, Any]]) -> subprocess.Popen[str]:
    """Start the backfill by hand of the schema-less topic (its spec with ``extra`` columns):
    its raw and current-state assets over every phase's hour as one partition-range run, on
    an instance of its own."""
    last = lake.start + timedelta(hours=len(PHASE_RUNS) - 1)
    args = [json.dumps(entry(BY_HAND, lake.start, extra)), lake.start.isoformat(), last.isoformat()]
    # Its log to a file: a pipe nobody reads while the phase converges would stall it.
    log = lake.settings.home / f"cdc-by-hand-{len(extra)}.log"
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-c", BY_HAND_CHILD, *args],
            cwd=REPO_ROOT,
            env={**os.environ, "BACKFILL_SPARK_CONNECT": lake.spark_url},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def record_by_hand(
    lake: Lake, name: str, child: subprocess.Popen[str], extra: list[dict[str, Any]]
) -> None:
    """Wait for the backfill by hand and record it as phase ``name``."""
    out, _ = child.communicate(timeout=PHASE_S)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    log = lake.settings.home / f"cdc-by-hand-{len(extra)}.log"
    assert child.returncode == 0 and lines, log.read_text(errors="replace")[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    checks: dict[str, list[bool]] = {}
    for key, passed in result["checks"]:
        checks.setdefault(key, []).append(passed)
    lake.specs[BY_HAND] = spec(BY_HAND, lake.start, extra)
    columns = [c["name"] for c in [*COLUMNS, *extra]]
    runs = [result["run"]] if result["success"] else []
    record(lake, BY_HAND, name, runs, checks, result["failures"], columns)


def _row(lake: Lake, account_id: int, notes: int = 64) -> tuple[Any, ...]:
    return demo.row(account_id, lake.rng, notes_bytes=notes)


def _connectors(
    lake: Lake, suffix: str = "", snapshot_delay_ms: int = 0
) -> dict[str, dict[str, str]]:
    """Each variant's connector config (its own slot), stamped by the test clock."""
    out = {}
    for name, prefix, schemas in VARIANTS.values():
        ref = lake.source.worker.secret(f"{name}{suffix}.password", lake.db.password)
        config = debezium_postgres(
            lake.db, ref, topic_prefix=prefix, tables=["public.accounts"],
            slot=f"{prefix}{suffix.replace('-', '')}", schemas=schemas,
        )  # fmt: skip
        delay = {"snapshot.delay.ms": str(snapshot_delay_ms)} if snapshot_delay_ms else {}
        # Two connectors of one topic prefix in a worker: their JMX metrics need other names.
        tags = {"custom.metric.tags": f"connector={name}{suffix}"}
        out[f"{name}{suffix}"] = {**config, **delay, **tags, **lake.clock.overrides()}
    return out


Done = Callable[[list[Change]], bool]


def phase_snapshot(lake: Lake, start: dict[str, int]) -> Done:
    """Four rows (one with a 100 kB text), then both connectors: their snapshot reads."""
    lake.sql(
        (demo.DDL, ()), *[(demo.INSERT, _row(lake, i, BIG if i == 1 else 64)) for i in range(1, 5)]
    )
    for name, config in _connectors(lake).items():
        lake.source.worker.put_connector(name, config)
    return lambda found: {i for op, i in found if op == "r"} == {1, 2, 3, 4}


def phase_changes(lake: Lake, start: dict[str, int]) -> Done:
    """Creates, updates (one leaving the large text unchanged: TOAST), deletes, JSON nulls."""
    lake.sql(
        ("UPDATE accounts SET balance = balance + 0.01 WHERE id = 1", ()),  # notes unchanged
        (demo.INSERT, _row(lake, 5, BIG)),
        ("UPDATE accounts SET notes = %s WHERE id = 5", (_row(lake, 5, BIG)[5],)),
        ("DELETE FROM accounts WHERE id = 2", ()),
        (demo.INSERT, (*_row(lake, 6)[:3], None, None, None)),
        ("UPDATE accounts SET attrs = 'null'::jsonb, profile = '[1,  2]' WHERE id = 6", ()),
    )
    return lambda found: ("u", 6) in found


def phase_key_update(lake: Lake, start: dict[str, int]) -> Done:
    """A key update (delete, tombstone, create), and a key deleted and created again."""
    lake.sql(
        ("UPDATE accounts SET id = 30 WHERE id = 3", ()),
        ("DELETE FROM accounts WHERE id = 6", ()),
        (demo.INSERT, _row(lake, 6)),
    )
    return lambda found: ("c", 6) in found


def _slot_exists(lake: Lake, slot: str) -> bool:
    return bool(lake.query(f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}'"))


def phase_resnapshot(lake: Lake, start: dict[str, int]) -> Done:
    """New connectors on new slots write the same topics, their snapshot delayed: each makes
    its slot (the snapshot's position), then row 4 is updated and the old connectors write
    that change, and only then do the snapshot reads reach Kafka, at an older position; the
    new connectors stream the update again. Then the old connectors go, and one more change."""
    worker = lake.source.worker
    configs = _connectors(lake, "-2", snapshot_delay_ms=RESNAPSHOT_DELAY_MS)
    for name, config in configs.items():
        worker.put_connector(name, config)
    deadline = time.monotonic() + 60
    while not all(_slot_exists(lake, c["slot.name"]) for c in configs.values()):
        assert time.monotonic() < deadline, "the new connectors made no slot"
        time.sleep(0.1)
    lake.sql(("UPDATE accounts SET balance = balance - 1 WHERE id = 4", ()))
    ids = {row[0] for row in lake.query("SELECT id FROM accounts")}
    # Every row read again, and the update twice: by the old connectors, then the new ones.
    wait_until(
        lake,
        start,
        lambda found: {i for op, i in found if op == "r"} == ids and found.count(("u", 4)) >= 2,
        "the re-snapshot",
    )
    for name in _connectors(lake):
        worker.delete_connector(name)
    lake.sql(("UPDATE accounts SET balance = balance + 2 WHERE id = 5", ()))
    return lambda found: ("u", 5) in found


def phase_column_added(lake: Lake, start: dict[str, int]) -> Done:
    """A column added to the source, then set by an update (its large text unchanged) and an
    insert; the other rows hold NULL there, in the source as in Debezium's next reads. The
    sensors' spec names it from the start; the spec of the topic backfilled by hand does not."""
    lake.sql(
        ("ALTER TABLE accounts ADD COLUMN tier text", ()),
        ("UPDATE accounts SET tier = 'gold', balance = balance + 1 WHERE id = 1", ()),
        ("INSERT INTO accounts VALUES (%s, %s, %s, %s, %s, %s, 'silver')", _row(lake, 7)),
    )
    lake.columns.append("tier")  # the source's columns, from now on
    return lambda found: ("c", 7) in found


PHASE_RUNS: list[tuple[str, Callable[[Lake, dict[str, int]], Done]]] = [
    ("snapshot", phase_snapshot),
    ("changes", phase_changes),
    ("key update", phase_key_update),
    ("re-snapshot", phase_resnapshot),
    ("column added", phase_column_added),
]
# The backfills by hand of the other topic, once every phase is in Kafka: with the spec as it
# was, then with the added column declared, every hour again.
EVERY_PHASE, COLUMN_IN_SPEC = "every phase", "column in spec"
RUNS = [(SENSORS, name) for name, _ in PHASE_RUNS] + [
    (BY_HAND, EVERY_PHASE),
    (BY_HAND, COLUMN_IN_SPEC),
]
LAST = {SENSORS: PHASE_RUNS[-1][0], BY_HAND: COLUMN_IN_SPEC}  # each variant's last phase


@contextmanager
def warm_spark(settings: Settings, home: Path) -> Iterator[tuple[str, Future[ConnectStatus]]]:
    """A Spark Connect server of the module's own (its port, its logs under ``home``), started
    in a thread while the daemon starts: the daemon's runs are its thin clients, as in the
    demo (scripts/demo.sh), instead of each starting Spark. Yields its URL and its start."""
    own = dataclasses.replace(settings, home=home, spark_connect_port=services.free_port())
    server = LocalConnectServer(own)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(server.start)
        try:
            yield server.url, started
        finally:
            wait([started])
            server.stop()


def _daemon_env(
    lake_home: Path, stack_env: dict[str, str], path: Path, spark_url: str
) -> dict[str, str]:
    return {
        **os.environ,
        **stack_env,
        "BACKFILL_SPARK_CONNECT": spark_url,
        "BACKFILL_SPEC": str(path),
        "BACKFILL_SENSORS": "on",
        "BACKFILL_SENSOR_INTERVAL_S": str(TICK_S),
        "BACKFILL_MAINTENANCE_SCHEDULES": "off",
        "BACKFILL_DAGSTER_STORAGE": str(lake_home / "storage"),
        "DAGSTER_HOME": str(lake_home / "dagster"),
    }


def run_phases(lake: Lake, home: Path, setup_s: float) -> None:
    """Each phase in its own hour, converged by the daemon's sensors; then the backfills by
    hand of the other topic. Seconds per step go to ``home/timings.txt`` (and stderr: -s)."""
    timings = [f"CDC source, Spark, Connect server and daemon up: {setup_s:.1f} s"]
    began = time.monotonic()
    for hour, (name, run) in enumerate(PHASE_RUNS):
        # This phase's records are stamped in its own hour, which ended hours ago.
        lake.clock.at(lake.start + timedelta(hours=hour, minutes=1))
        offsets = highs(lake)
        wait_until(lake, offsets, run(lake, offsets), name)
        if hour < len(PHASE_RUNS) - 1:
            converge(lake, name)
            timings.append(f"{name}: {time.monotonic() - began:.1f} s")
            began = time.monotonic()
    # Every change is in Kafka now: the other topic is backfilled by hand while the last phase
    # converges.
    first = start_by_hand(lake, [])
    converge(lake, name)
    timings.append(f"{name}: {time.monotonic() - began:.1f} s")
    record_by_hand(lake, EVERY_PHASE, first, [])
    record_by_hand(lake, COLUMN_IN_SPEC, start_by_hand(lake, [TIER]), [TIER])
    timings.append(f"by hand (two runs, the first meanwhile): {time.monotonic() - began:.1f} s")
    summary = "cdc lake: " + "; ".join(timings) + "\n"
    sys.stderr.write(summary)
    (home / "timings.txt").write_text(summary)


@pytest.fixture(scope="module")
def lake(
    stack_settings: Settings,
    stack_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Lake]:
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    start = now - timedelta(hours=HOURS_AGO)
    home = tmp_path_factory.mktemp("cdc-sensors")
    # The sensors' workspace: the topic with the schema embedded, its added column declared.
    path = home / "spec" / "topics.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"topics": [entry(SENSORS, start, [TIER])]}, sort_keys=False))
    specs = {SENSORS: spec(SENSORS, start, [TIER]), BY_HAND: spec(BY_HAND, start)}
    began = time.monotonic()
    clock = Clock(stack_settings.home / "lake-cdc-clock")
    with (
        warm_spark(stack_settings, home) as (url, spark_started),
        pytest.MonkeyPatch.context() as mp,
    ):
        env = _daemon_env(home, stack_env, path, url)
        # The instance this process opens (dagster.yaml reads the storage from the
        # environment) is the daemon's. This process keeps its own Spark (not Connect).
        mp.setenv("BACKFILL_DAGSTER_STORAGE", env["BACKFILL_DAGSTER_STORAGE"])
        mp.setenv("BACKFILL_SPEC", str(path))
        with (
            services.dagster_daemon(home / "dagster", env) as process,
            dg.DagsterInstance.from_config(str(home / "dagster")) as instance,
        ):
            # The shared CDC source and this process's Spark start while the Connect server
            # and the daemon do.
            cdc_source: SharedCdc = request.getfixturevalue("cdc_source")
            spark_session: SparkSession = request.getfixturevalue("spark_session")
            db = cdc_source.source.database(cdc_source.server, DATABASE, ROLE)
            status = spark_started.result()
            assert status.responding, status.describe()
            lake = Lake(
                stack_settings, spark_session, cdc_source, db, KafkaClient(stack_settings),
                clock, start, instance, process, specs, spark_url=url,
            )  # fmt: skip
            try:
                run_phases(lake, home, time.monotonic() - began)
                yield lake
            finally:
                _remove_connectors(lake)


def _remove_connectors(lake: Lake) -> None:
    """Delete this module's connectors and drop their slots (other modules share the source)."""
    worker = lake.source.worker
    for name in [*_connectors(lake), *_connectors(lake, "-2")]:
        if worker.connector_status(name) is not None:
            worker.delete_connector(name)
    slots = [
        c["slot.name"] for c in [*_connectors(lake).values(), *_connectors(lake, "-2").values()]
    ]
    deadline = time.monotonic() + 30
    con = lake.server.connect()
    try:
        with con.cursor() as cur:
            for slot in slots:
                while True:
                    cur.execute(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                    )
                    found = cur.fetchone()
                    if found is None:
                        break
                    if not found[0]:
                        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                        break
                    assert time.monotonic() < deadline, f"slot {slot} stays active"
                    time.sleep(0.2)
    finally:
        con.close()


def _phase(lake: Lake, variant: str, name: str) -> Phase:
    return lake.phases[variant][name]


@pytest.mark.parametrize(("variant", "phase"), RUNS)
def test_each_phase_publishes_with_every_check_green(lake: Lake, variant: str, phase: str) -> None:
    done = _phase(lake, variant, phase)
    assert done.success, done.failures
    assert done.checks and all(all(c) for c in done.checks.values()), done.checks
    assert all(done.checks[f"raw/{lake.specs[variant].name}:decoded_content"])


@pytest.mark.parametrize(("variant", "phase"), RUNS)
def test_the_current_state_equals_the_source_read_by_select(
    lake: Lake, variant: str, phase: str
) -> None:
    done = _phase(lake, variant, phase)
    assert done.source, "the source table is empty"
    assert done.current == done.source
    assert done.unavailable == 0


@pytest.mark.parametrize(("variant", "phase"), RUNS)
def test_the_raw_table_holds_every_committed_record(lake: Lake, variant: str, phase: str) -> None:
    done = _phase(lake, variant, phase)
    raw = done.raw_offsets
    # Every committed record up to where the run's windows end, each once; a record the
    # connector wrote after the run sealed its hours belongs to a later window.
    assert raw == [o for o in done.kafka_offsets if o <= raw[-1]]
    assert done.quarantined == 0


def test_no_run_but_the_sensors_published_the_sensors_topic(lake: Lake) -> None:
    """Every run on the daemon's instance was launched by one of its sensors (or schedules),
    none by the test; each phase took at least one."""
    runs = lake.instance.get_runs()
    assert runs
    for run in runs:
        assert "dagster/sensor_name" in run.tags or "dagster/schedule_name" in run.tags, run.tags
    assert all(p.runs for p in lake.phases[SENSORS].values())


def _raw(lake: Lake, variant: str, account_id: int) -> list[dict[str, Any]]:
    """The raw table's rows of one key, in offset order."""
    ns = lake.settings.catalog.namespace
    table = lake.spark.table(f"lake.{ns}.{lake.specs[variant].raw_table}")
    rows = table.where(f"id = {account_id}").orderBy("kafka_offset").collect()
    return [r.asDict() for r in rows]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deletes_and_a_key_update_remove_keys_for_good(lake: Lake, variant: str) -> None:
    """2 deleted, 3 moved to 30 (delete, tombstone, create), 6 deleted and created again: the
    re-snapshot after them brought none back."""
    last = _phase(lake, variant, LAST[variant])
    assert {2, 3} <= last.deleted
    assert {2, 3}.isdisjoint(last.current)
    assert {6, 30} <= set(last.current)
    ops = [(r["cdc_op"], r["is_tombstone"]) for r in _raw(lake, variant, 3)]
    assert ops[-2:] == [("d", False), (None, True)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_unchanged_large_value_keeps_its_value(lake: Lake, variant: str) -> None:
    """The update that left row 1's 100 kB text alone is stored without it (named in
    cdc_unavailable); the current state keeps the text the snapshot read."""
    updates = [r for r in _raw(lake, variant, 1) if r["cdc_op"] == "u"]
    assert updates and all(r["notes"] is None for r in updates)
    assert {r["cdc_unavailable"] for r in updates} == {"notes"}
    last = _phase(lake, variant, LAST[variant])
    notes = last.current[1]["notes"]
    assert len(notes) == BIG and notes == last.source[1]["notes"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_snapshot_read_arriving_after_a_newer_change_does_not_win(
    lake: Lake, variant: str
) -> None:
    """Row 4: the new connector's snapshot read reached Kafka after the old connector's
    update of it, at an older LSN; the current state holds the update (LSN order), right after
    the re-snapshot under the sensors, and at the end (nothing changes row 4 after it)."""
    rows = _raw(lake, variant, 4)
    reads = [r for r in rows if r["cdc_op"] == "r"]
    update = next(r for r in rows if r["cdc_op"] == "u")
    stale = reads[-1]
    assert stale["kafka_offset"] > update["kafka_offset"]
    assert stale["cdc_lsn"] <= update["cdc_lsn"]  # the same LSN: the read is older
    # The read is the row as of its (older) position: by arrival it would undo the update.
    assert stale["balance"] == update["balance"] + 1
    after = _phase(lake, variant, "re-snapshot" if variant == SENSORS else LAST[variant])
    assert after.current[4]["balance"] == update["balance"]
    assert after.current == after.source


def test_a_column_added_to_the_source_appears_once_the_spec_names_it(lake: Lake) -> None:
    """By hand: the backfill with the spec as it was has no such column; once the spec names
    it, every hour again: the source's values."""
    before = _phase(lake, BY_HAND, EVERY_PHASE)
    after = _phase(lake, BY_HAND, COLUMN_IN_SPEC)
    assert "tier" not in before.source[1] and "tier" not in before.current[1]
    tiers = {i: row["tier"] for i, row in after.source.items()}
    assert tiers[1] == "gold" and tiers[7] == "silver" and tiers[4] is None
    assert {i: row["tier"] for i, row in after.current.items()} == tiers


def test_a_column_the_spec_names_ahead_appears_under_the_sensors(lake: Lake) -> None:
    """The sensors' spec names the column before the source has it: the phase that adds it
    shows it in the current state without any run by hand."""
    before = _phase(lake, SENSORS, "re-snapshot")
    after = _phase(lake, SENSORS, "column added")
    assert "tier" not in before.source[1]
    tiers = {i: row["tier"] for i, row in after.source.items()}
    assert tiers[1] == "gold" and tiers[7] == "silver" and tiers[4] is None
    assert {i: row["tier"] for i, row in after.current.items()} == tiers
