"""Spark Connect (issue 27): runs as thin clients of one warm local Spark Connect server.

One server is started for the session (``stack/connect.py``, stopped by PID at the end). The
backfills run in a child process with ``BACKFILL_SPARK_CONNECT`` set, as a daemon-launched run
would: a process that uses Spark Connect cannot also hold a classic session (pyspark switches
the whole process), and the rest of the suite runs classic Spark in this process. The child
reports whether it started a JVM; the published tables are read here with pyiceberg.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from click.testing import CliRunner

from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.stack.connect import LocalConnectServer
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support import services

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

START = datetime(2026, 5, 1, tzinfo=UTC)

# Runs in the child: raw hours 00..05 then the hourly aggregate of event hours 00..02, through
# Dagster exactly as test_derived materializes them; prints one JSON line.
CHILD = r"""
import json, os, sys
import dagster as dg
from pathlib import Path
from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.spec.declared import renamed

topic, which = sys.argv[1], sys.argv[2:]
spec = renamed(SPECS[0], topic=topic)
assets = build_topic_assets(spec)
ranges = {"raw": ("2026-05-01-00:00", "2026-05-01-05:00"),
          f"{topic}_hourly": ("2026-05-01-00:00", "2026-05-01-02:00")}
out = {}
with dg.instance_for_test() as instance:
    for key in which:
        sel = [a for a in assets if a.key.path[-1] == key or a.key.path[0] == key]
        first, last = ranges[key]
        res = dg.materialize(sel, resources=RESOURCES, instance=instance, raise_on_error=False,
                             selection=[a.key for a in sel],
                             tags={"dagster/asset_partition_range_start": first,
                                   "dagster/asset_partition_range_end": last})
        def chain(err):
            while err is not None:
                yield err.message.strip().splitlines()[-1] if err.message.strip() else ""
                err = err.cause or err.context
        failures = [" <- ".join(chain(getattr(e.event_specific_data, "error", None)))
                    or (e.message or "") for e in res.all_events if e.is_failure]
        out[key] = {"success": res.success, "run_id": res.run_id, "failures": failures,
                    "checks": {e.check_name: e.passed for e in res.get_asset_check_evaluations()}}
from pyspark import SparkContext
from backfill_assets.stack import spark
out["session_modules"] = sorted({type(s).__module__ for s in spark._connect_sessions.values()})
out["spark_context"] = SparkContext._active_spark_context is not None
def children(pid):
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found + [g for c in found for g in children(c)]
out["java_children"] = [
    (Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ")[:200]).decode()
    for c in children(os.getpid())
    if b"java" in Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[0]
]
print("RESULT " + json.dumps(out))
"""


# Runs in the child: the raw asset of a registry topic test's topic (argv[2]: test_avro_topic or
# test_protobuf_topic; several writer versions, bad records) over Spark Connect, with the
# registry BACKFILL_SCHEMA_REGISTRY_URL names.
CHILD_REGISTRY = r"""
import importlib, json, sys
import dagster as dg
from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import RESOURCES

case = importlib.import_module(f"backfill_assets_tests.lake.{sys.argv[2]}")
RANGE, spec = case.RANGE, case._spec(sys.argv[1])
with dg.instance_for_test() as instance:
    res = dg.materialize([build_raw_asset(spec)], resources=RESOURCES, instance=instance,
                         raise_on_error=False,
                         tags={"dagster/asset_partition_range_start": RANGE[0],
                               "dagster/asset_partition_range_end": RANGE[1]})
    out = {"success": res.success,
           "failures": [e.message or "" for e in res.all_events if e.is_failure],
           "checks": {e.check_name: e.passed for e in res.get_asset_check_evaluations()}}
from backfill_assets.stack import spark
out["session_modules"] = sorted({type(s).__module__ for s in spark._connect_sessions.values()})
print("RESULT " + json.dumps(out))
"""


# Runs in the child: the current state of a small raw table over Spark Connect, an hour whose
# table exists, with every request the client sends counted by a gRPC interceptor on its
# channel; prints one JSON line.
CHILD_CURRENT = r"""
import collections, json, os, sys
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
import grpc
os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # what pyspark's remote() does: Connect mode
from pyspark.sql.connect.client import DefaultChannelBuilder
from pyspark.sql.connect.session import SparkSession
from backfill_assets.lake.decode.envelope import KAFKA_COLUMNS
from backfill_assets.lake.write import derived, tables
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import SPARK_TYPES
from backfill_assets.stack import spark as stack_spark
from backfill_assets.stack.settings import Settings

class Counter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    on, sent = False, collections.Counter()
    def count(self, continuation, details, request):
        method = details.method.rsplit("/", 1)[-1]
        if self.on and method in ("ExecutePlan", "AnalyzePlan", "Config"):
            plan = getattr(request, "plan", None)
            command = plan.command.WhichOneof("command_type") if plan is not None else None
            # A checkpointed frame released by the garbage collector: not the run's request.
            released = command == "remove_cached_remote_relation_command"
            self.sent["release" if released else method] += 1
        return continuation(details, request)
    intercept_unary_unary = intercept_unary_stream = count

settings = Settings.from_env()
class Channel(DefaultChannelBuilder):
    def metadata(self):
        return [*super().metadata(), ("authorization", f"Bearer {settings.spark_connect_token}")]
counter, channel = Counter(), Channel(settings.spark_connect)
channel.add_interceptor(counter)
# Created in another thread, as a run's SparkResource starts it: the run's thread then has no
# active session, and pyspark asks no setting for each timestamp literal (F.lit(datetime)).
builder = SparkSession.builder.channelBuilder(channel)
session = ThreadPoolExecutor(1).submit(builder.create).result()
stack_spark._apply_confs(settings.spark_connect, session, stack_spark._session_sql(settings))

spec = renamed(load_specs()[0], topic=sys.argv[1])
where = f"{settings.catalog.name}.{settings.catalog.namespace}"
raw, current = f"{where}.{spec.raw_table}", f"{where}.{spec.current_table}"
session.sql(tables.table_ddl(spec, raw))
start = datetime(2026, 5, 1, tzinfo=UTC)
rows = []
for i in range(30):
    at = start + timedelta(hours=i % 3, minutes=i)
    hour = at.replace(minute=0)
    key, event = f"o{i % 7}", ("created", "open") if i < 7 else ("updated", "paid")
    tomb = i == 29
    payload = [None] * 9 if tomb else [f"e{i}", key, "c1", *event, 100 + i, "EUR", "web", at]
    payload[1] = key  # a tombstone holds its key too
    rows.append(("t", i % 2, i, at, hour, i, key.encode(), tomb, 1, *payload, "r0"))
columns = [*KAFKA_COLUMNS, *((c.name, SPARK_TYPES[c.type]) for c in spec.columns)]
schema = ", ".join(f"{n} {t}" for n, t in [*columns, ("ingest_run_id", "string")])
session.createDataFrame(rows, schema).writeTo(raw).append()
hour = timedelta(hours=1)
derived._ensure_current_table(session, spec, current)  # an earlier run created it
counter.on = True
out = derived.build_current(session, spec, raw, current, start + hour, start + 2 * hour, "run-1")
counter.on = False
print("RESULT " + json.dumps({
    "sent": dict(counter.sent),
    "checks": {c.name: c.passed for c in out.checks},
    "touched": out.metadata["source_keys"],
    "expected_touched": len({r[10] for r in rows if r[4] == start + hour}),
}))
"""


@dataclasses.dataclass
class Server:
    url: str
    settings: Settings
    server: LocalConnectServer


# The session's server requires this pre-shared token: every run over Connect here sends it.
TOKEN = f"t-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def connect_server(stack_settings: Settings) -> Iterator[Server]:
    """One local Spark Connect server on the test stack, on a free port, requiring a token."""
    settings = dataclasses.replace(
        stack_settings, spark_connect_port=services.free_port(), spark_connect_token=TOKEN
    )
    server = LocalConnectServer(settings)
    status = server.start()
    try:
        assert status.responding, status.describe()
        yield Server(server.url, settings, server)
    finally:
        server.stop()


def _child(url: str, topic: str, *assets: str, script: str = CHILD) -> dict[str, Any]:
    env = {**os.environ, "BACKFILL_SPARK_CONNECT": url, "BACKFILL_SPARK_CONNECT_TOKEN": TOKEN}
    proc = subprocess.run(
        [sys.executable, "-c", script, topic, *assets],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def _rows(cat: Catalog, ident: str) -> list[dict[str, Any]]:
    if not cat.table_exists(ident):
        return []
    return cat.load_table(ident).scan().to_arrow().to_pylist()  # type: ignore[no-any-return]


def test_server_properties_are_private_and_bound_to_loopback(connect_server: Server) -> None:
    conf = connect_server.server.conf_path
    assert conf.stat().st_mode & 0o777 == 0o600
    props = connect_server.server.properties()
    assert props["spark.connect.grpc.binding.address"] == "127.0.0.1"
    assert props["spark.connect.grpc.binding.port"] == str(
        connect_server.settings.spark_connect_port
    )
    assert "spark.driver.memory" not in props and "spark.pyspark.driver.python" not in props
    assert connect_server.server.status().responding
    assert Path(connect_server.server.log_path).parent.name == "logs"


def test_a_client_without_the_token_is_refused_and_the_token_stays_hidden(
    connect_server: Server,
) -> None:
    """The server requires its pre-shared token: a client without it, or with another, gets
    no answer; with it, a query runs. The token is in none of: the server's command line, its
    properties file, its log, ``stack status``."""
    from backfill_assets.stack import spark

    server = connect_server.server
    assert spark.probe(server.url, 5.0) is None
    assert spark.probe(server.url, 5.0, token="wrong") is None
    assert spark.probe(server.url, 5.0, token=TOKEN) is not None
    pid = server.running_pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline
    assert TOKEN not in server.conf_path.read_text()
    assert TOKEN not in server.log_tail(500)
    assert TOKEN not in server.status().describe()


def test_session_settings_cost_one_request_and_an_earlier_callers_do_not_stay(
    connect_server: Server,
) -> None:
    """What connect_session gives a session: every setting in one Config request, no request
    when this process already gave the same session the same settings, and a setting an
    earlier caller gave (one run's spark_config) unset once a caller no longer gives it. The
    session is the Connect client's own class, so this process stays classic."""
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    from backfill_assets.stack import spark

    session = spark.remote_builder(RemoteSession.builder, connect_server.url, TOKEN).create()
    sent: list[str | None] = []
    config = session.client.config

    def counted(op: Any) -> Any:
        sent.append(op.WhichOneof("op_type"))
        return config(op)

    session.client.config = counted
    key = f"test://{uuid.uuid4().hex}"  # this test's entry of the per-URL bookkeeping
    zone = {"spark.sql.session.timeZone": "UTC"}
    try:
        spark._apply_confs(key, session, {**zone, "spark.sql.shuffle.partitions": "13"})
        spark._apply_confs(key, session, {**zone, "spark.sql.shuffle.partitions": "13"})
        assert sent == ["set"]
        assert session.conf.get("spark.sql.shuffle.partitions") == "13"
        sent.clear()
        spark._apply_confs(key, session, zone)
        assert sent == ["unset", "set"]
        assert session.conf.get("spark.sql.shuffle.partitions") != "13"
        assert session.conf.get("spark.sql.session.timeZone") == "UTC"
    finally:
        spark._applied_confs.pop(key, None)
        session.stop()


def _counted_session(url: str) -> tuple[Any, list[str]]:
    """A Connect client of the session's server (this process stays classic) whose requests
    are listed as they are sent: ExecutePlan, AnalyzePlan, Config."""
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    from backfill_assets.stack import spark

    session = spark.remote_builder(RemoteSession.builder, url, TOKEN).create()
    session.conf.set("spark.sql.session.timeZone", "UTC")  # as connect_session gives it
    sent: list[str] = []
    client = session.client
    for attr, name in (
        ("_execute_and_fetch", "ExecutePlan"),
        ("_analyze", "AnalyzePlan"),
        ("config", "Config"),
    ):
        real = getattr(client, attr)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            sent.append(_name)
            return _real(*args, **kwargs)

        setattr(client, attr, counted)
    return session, sent


_TYPED = """SELECT * FROM VALUES
  (1, 'a', CAST(1.5 AS DOUBLE), CAST(12.34 AS DECIMAL(10, 2)), true,
   TIMESTAMP'2026-05-01 23:30:00', DATE'2026-05-01', named_struct('x', 1), array(1, 2)),
  (CAST(NULL AS INT), CAST(NULL AS STRING), CAST(NULL AS DOUBLE), CAST(NULL AS DECIMAL(10, 2)),
   CAST(NULL AS BOOLEAN), CAST(NULL AS TIMESTAMP), CAST(NULL AS DATE),
   CAST(NULL AS STRUCT<x: INT>), CAST(NULL AS ARRAY<INT>))
  AS t(i, s, d, m, b, ts, dt, st, ar)"""


def test_fetch_converts_as_pyspark_does_in_one_request(connect_server: Server) -> None:
    """stack/fetch.py over Connect: the same pandas frame as ``toPandas`` (dtypes and values,
    timestamps, decimals, structs, arrays, NULLs, no rows), the same rows as ``collect``, and
    Arrow as ``toArrow``, each in one ExecutePlan and nothing else; ``toPandas`` and
    ``collect`` cost a Config request more, ``toArrow`` an AnalyzePlan. ``local_frame`` is
    ``createDataFrame`` of an Arrow table without a request until the frame is used."""
    import pandas as pd
    import pyarrow as pa
    from pyspark.sql.types import LongType, StructField, StructType

    from backfill_assets.stack import fetch

    session, sent = _counted_session(connect_server.url)
    try:
        typed = session.sql(_TYPED)
        for frame in (typed, typed.where("i > 5")):
            expected = frame.toPandas()
            assert sent.count("Config") >= 1
            sent.clear()
            pd.testing.assert_frame_equal(fetch.to_pandas(frame), expected)
            assert sent == ["ExecutePlan"]
            sent.clear()
        expected_rows = typed.collect()
        assert "Config" in sent
        sent.clear()
        assert fetch.rows(typed) == expected_rows
        assert [r.asDict() for r in fetch.rows(typed)] == [r.asDict() for r in expected_rows]
        assert fetch.arrow(typed).equals(typed.toArrow())
        assert sent == ["ExecutePlan", "ExecutePlan", "ExecutePlan", "AnalyzePlan", "ExecutePlan"]
        schema = StructType([StructField("p", LongType(), False), StructField("o", LongType())])
        cells = pa.table({"p": pa.array([0, 1], pa.int64()), "o": pa.array([7, None], pa.int64())})
        sent.clear()
        local = fetch.local_frame(session, cells, schema)
        assert sent == []  # createDataFrame reads twelve settings first
        assert fetch.rows(local) == session.createDataFrame([(0, 7), (1, None)], schema).collect()
        assert local.schema == schema
    finally:
        session.stop()


# slow tier (CI runs it): ~20-30 s, most of it the child's imports and the server's first jobs.
@pytest.mark.slow
def test_a_current_state_run_costs_seven_round_trips(
    connect_server: Server, iceberg_catalog: Catalog
) -> None:
    """The current state's ``build_current`` over Spark Connect, for an hour of a small raw
    table whose current-state table exists: 7 requests, all ExecutePlan: no schema question
    (AnalyzePlan), no setting read (Config), no branch statement (pyiceberg commits those). A
    child process counts them with a gRPC interceptor on its client's channel (as in the slow
    tests, this process stays classic). The hour's checks pass."""
    out = _child(connect_server.url, f"orders_{uuid.uuid4().hex[:8]}", script=CHILD_CURRENT)

    assert out["checks"] == {"uniqueness": True, "source_applied": True, "schema_contract": True}
    assert out["touched"] == out["expected_touched"] > 0
    # What the 7 are: the source's 4 checkpoints and its winners' hours, the MERGE, and the
    # figures with the contract's counts (one action; the column types from the catalog's
    # metadata, so no schema question either).
    # (Checkpointed frames released by the garbage collector are sent apart, and not counted.)
    sent = {k: n for k, n in out["sent"].items() if k != "release"}
    assert sent == {"ExecutePlan": 7}, out["sent"]


# slow tier (CI runs it): ~55 s; the cluster tier runs test_exactness over Connect as well.
@pytest.mark.slow
def test_backfill_over_connect_publishes_what_was_produced(
    connect_server: Server, stack_settings: Settings, iceberg_catalog: Catalog
) -> None:
    topic = f"orders_{uuid.uuid4().hex[:8]}"
    config = GeneratorConfig(topic=topic, start=START, hours=6, events_per_hour=120, seed=13)
    truth = generate(stack_settings, config)
    hourly = f"{topic}_hourly"

    out = _child(connect_server.url, topic, "raw", hourly)

    assert out["raw"]["success"], out["raw"]["failures"]
    assert out[hourly]["success"], out[hourly]["failures"]
    for key in ("raw", hourly):
        checks = out[key]["checks"]
        assert checks and all(checks.values()), (key, checks)
    # A thin client: a Spark Connect session, no SparkContext and no JVM child in the run.
    assert out["session_modules"] == ["pyspark.sql.connect.session"], out
    assert out["spark_context"] is False
    assert out["java_children"] == []

    ns = stack_settings.catalog.namespace
    raw = _rows(iceberg_catalog, f"{ns}.raw_{topic}")
    per_hour: dict[str, int] = {}
    for row in raw:
        hour = row["kafka_hour"].astimezone(UTC).isoformat()
        per_hour[hour] = per_hour.get(hour, 0) + 1
    for h in range(6):
        hour = datetime(2026, 5, 1, h, tzinfo=UTC).isoformat()
        t = truth.kafka_hours[hour]
        assert per_hour.get(hour, 0) == t["valid"] + t["tombstones"] + t["duplicates"], hour
    got = {
        (r["event_hour"].astimezone(UTC).isoformat(), r["currency"]): (
            r["events"],
            r["amount_minor"],
        )
        for r in _rows(iceberg_catalog, f"{ns}.{hourly}")
    }
    expected = {
        (hour, cur): (v["events"], v["amount_minor"])
        for hour, by_cur in truth.event_hours.items()
        if START <= datetime.fromisoformat(hour) < datetime(2026, 5, 1, 3, tzinfo=UTC)
        for cur, v in by_cur.items()
    }
    assert got == expected
    # The publish's audit commit is on main (made by pyiceberg, fast-forwarded by Spark).
    main = iceberg_catalog.load_table(f"{ns}.raw_{topic}").metadata
    snap = main.snapshot_by_id(main.refs["main"].snapshot_id)
    assert snap is not None and snap.summary is not None
    assert snap.summary.additional_properties.get("backfill.run-id") == out["raw"]["run_id"]


# slow tier (CI runs it): ~20 s each; test_avro_topic and test_protobuf_topic cover the same
# decode on the local engine.
@pytest.mark.slow
@pytest.mark.parametrize("case_name", ["test_avro_topic", "test_protobuf_topic"])
def test_registry_topic_over_connect_decodes_every_writer_version(
    connect_server: Server,
    stack_settings: Settings,
    iceberg_catalog: Catalog,
    registry: LocalRegistry,
    case_name: str,
) -> None:
    """The decode runs on the Connect server (its spark.jars: spark-avro's from_avro, the udf
    jar's ProtobufRow with protobuf-java): the same topic as the local-engine test gives the
    same rows and quarantine reasons through a thin client."""
    import importlib

    from confluent_kafka.schema_registry import SchemaRegistryClient

    case = importlib.import_module(f"backfill_assets_tests.lake.{case_name}")
    topic = f"{case_name.split('_')[1]}_{uuid.uuid4().hex[:8]}"
    records = case._records(SchemaRegistryClient({"url": registry.url}), topic)
    offsets = case._produce(stack_settings, topic, records)

    out = _child(connect_server.url, topic, case_name, script=CHILD_REGISTRY)

    assert out["success"], out["failures"]
    assert out["checks"] and all(out["checks"].values()), out["checks"]
    assert "decoded_content" in out["checks"]
    assert out["session_modules"] == ["pyspark.sql.connect.session"], out
    ns = stack_settings.catalog.namespace
    rows = {r["kafka_offset"]: r for r in _rows(iceberg_catalog, f"{ns}.raw_{topic}")}
    quarantine = {
        r["kafka_offset"]: r["reason"] for r in _rows(iceberg_catalog, f"{ns}.{topic}_quarantine")
    }
    for offset, (_, want) in zip(offsets, records, strict=True):
        if isinstance(want, str):
            assert quarantine.get(offset) == want[2:], offset
            continue
        got = rows[offset]
        for name, value in want.items():
            if name == "event_time_ms":
                assert int(got["event_time"].timestamp() * 1000) == value, offset
            else:
                assert got[name] == value, (offset, name)
    assert len(rows) + len(quarantine) == len(records)


def test_unreachable_connect_server_is_a_settings_error(
    connect_server: Server,
    stack_settings: Settings,
    iceberg_catalog: Catalog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from backfill_assets.ops import cli

    topic = f"orders_{uuid.uuid4().hex[:8]}"
    generate(stack_settings, GeneratorConfig(topic=topic, start=START, hours=2, events_per_hour=20))
    dead = f"sc://127.0.0.1:{services.free_port()}"
    # The CLI refuses before launching anything (no webserver is even asked).
    monkeypatch.setenv("BACKFILL_SPARK_CONNECT", dead)
    monkeypatch.setenv("BACKFILL_WEBSERVER_PORT", str(services.free_port()))
    result = CliRunner().invoke(
        cli.cli,
        ["backfill", "--topic", topic, "--start", "2026-05-01-00:00", "--end", "2026-05-01-00:00"],
    )
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "BACKFILL_SPARK_CONNECT" in errors[0] and dead in errors[0]
    # A run that meets it fails at once with the same message, and publishes nothing.
    out = _child(dead, topic, "raw")
    assert not out["raw"]["success"]
    assert any("BACKFILL_SPARK_CONNECT" in f and dead in f for f in out["raw"]["failures"]), out
    ident = f"{stack_settings.catalog.namespace}.raw_{topic}"
    assert (
        not iceberg_catalog.table_exists(ident)
        or not iceberg_catalog.load_table(ident).metadata.snapshots
    )
    assert out["java_children"] == []


@pytest.mark.parametrize(
    ("bind", "local_ip"), [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", None), ("10.1.2.3", None)]
)
def test_the_driver_stays_on_loopback_only_when_the_server_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bind: str, local_ip: str | None
) -> None:
    """A server bound to another address (a pod's) is the driver of executors on other hosts:
    its driver must not be pinned to 127.0.0.1, whatever the caller's environment says."""
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    settings = Settings.from_env(
        {
            "BACKFILL_HOME": str(tmp_path),
            "BACKFILL_JAR_CACHE": str(REPO_ROOT / ".stack" / "jars"),
            "BACKFILL_SPARK_CONNECT_BIND": bind,
        }
    )
    server = LocalConnectServer(settings)
    assert server.env().get("SPARK_LOCAL_IP") == local_ip
    assert server.properties()["spark.connect.grpc.binding.address"] == bind
