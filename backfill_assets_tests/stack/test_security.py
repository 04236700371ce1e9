"""Security basics: Kafka SASL/TLS settings reach both Kafka clients, a backfill through a real
SASL broker leaks its password nowhere, and a wrong password fails at once, naming the broker.

The SASL broker is a second local KRaft broker (its own BACKFILL_HOME and free ports) whose
client listener is SASL_PLAINTEXT/PLAIN (see ``LocalBroker._sasl_config``); the Iceberg catalog
is the session's one, so the session's Spark session (created with that catalog) is reused.
The planted password holds a unique token, a double quote and a backslash (JAAS quoting).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.offsets.contract import OffsetContract
from backfill_assets.lake.write import audit
from backfill_assets.lake.write.read import read_contract
from backfill_assets.spec.declared import renamed
from backfill_assets.stack import catalog
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
START = datetime(2026, 2, 20, 3, tzinfo=UTC)
RANGE = ("2026-02-20-03:00", "2026-02-20-04:00")


# ------------------------------------------------------------------ settings pass through


# Every range reader fetches in large pieces, whatever the security settings.
FETCH = {
    "kafka.max.partition.fetch.bytes": str(8 << 20),
    "kafka.fetch.max.bytes": str(64 << 20),
}


def test_sasl_ssl_scram_reaches_both_clients() -> None:
    s = Settings.from_env(
        {
            "BACKFILL_KAFKA_BOOTSTRAP": "b-1.example:9096,b-2.example:9096",
            "BACKFILL_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
            "BACKFILL_KAFKA_SASL_MECHANISM": "scram-sha-512",
            "BACKFILL_KAFKA_SASL_USERNAME": "backfill",
            "BACKFILL_KAFKA_SASL_PASSWORD": "s3cr3t",
            "BACKFILL_KAFKA_SSL_CA_LOCATION": "/etc/backfill/kafka/ca.pem",
        }
    )
    assert s.kafka.client_config() == {
        "bootstrap.servers": "b-1.example:9096,b-2.example:9096",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "backfill",
        "sasl.password": "s3cr3t",
        "ssl.ca.location": "/etc/backfill/kafka/ca.pem",
    }
    # The window scan and the archiver: the same secured client, without librdkafka's 1 s pause.
    assert s.kafka.range_reader_config() == {
        **s.kafka.client_config(),
        "fetch.queue.backoff.ms": 10,
    }
    assert s.kafka.spark_options() == {
        **FETCH,
        "kafka.isolation.level": "read_committed",
        "kafka.bootstrap.servers": "b-1.example:9096,b-2.example:9096",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": f'{SCRAM} required username="backfill" password="s3cr3t";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/backfill/kafka/ca.pem",
    }


def test_sasl_plaintext_plain_reaches_both_clients() -> None:
    s = Settings.from_env(
        {
            "BACKFILL_KAFKA_PORT": "29092",
            "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "BACKFILL_KAFKA_SASL_MECHANISM": "PLAIN",
            "BACKFILL_KAFKA_SASL_USERNAME": "svc",
            "BACKFILL_KAFKA_SASL_PASSWORD": 'a"b\\c',
        }
    )
    assert s.kafka.client_config() == {
        "bootstrap.servers": "127.0.0.1:29092",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "svc",
        "sasl.password": 'a"b\\c',
    }
    # Quotes and backslashes are escaped for Kafka's JAAS parser (the real-broker test below
    # proves Spark's Java client authenticates with such a password).
    assert s.kafka.spark_options() == {
        **FETCH,
        "kafka.isolation.level": "read_committed",
        "kafka.bootstrap.servers": "127.0.0.1:29092",
        "kafka.security.protocol": "SASL_PLAINTEXT",
        "kafka.sasl.mechanism": "PLAIN",
        "kafka.sasl.jaas.config": f'{PLAIN} required username="svc" password="a\\"b\\\\c";',
    }
    assert 'a"b\\c' not in repr(s)


def test_ssl_only_and_oauth_have_no_jaas_line() -> None:
    ssl = Settings.from_env(
        {"BACKFILL_KAFKA_SECURITY_PROTOCOL": "SSL", "BACKFILL_KAFKA_SSL_CA_LOCATION": "/ca.pem"}
    )
    assert ssl.kafka.spark_options()["kafka.security.protocol"] == "SSL"
    assert "kafka.sasl.jaas.config" not in ssl.kafka.spark_options()
    assert "sasl.mechanism" not in ssl.kafka.client_config()
    oauth = Settings.from_env(
        {
            "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "BACKFILL_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
        }
    )
    assert oauth.kafka.spark_options()["kafka.sasl.mechanism"] == "OAUTHBEARER"
    assert "kafka.sasl.jaas.config" not in oauth.kafka.spark_options()


# ------------------------------------------------------------------ a real SASL broker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass
class SaslStack:
    env: dict[str, str]
    settings: Settings
    broker: LocalBroker
    token: str  # unique part of the password: any leak, escaped or not, contains it


@pytest.fixture(scope="module")
def sasl_stack(
    tmp_path_factory: pytest.TempPathFactory, stack_settings: Settings
) -> Iterator[SaslStack]:
    token = uuid.uuid4().hex
    home = tmp_path_factory.mktemp("sasl")
    env = {
        "BACKFILL_HOME": str(home),
        "BACKFILL_JAR_CACHE": str(stack_settings.jar_cache),
        "BACKFILL_KAFKA_PORT": str(_free_port()),
        "BACKFILL_KAFKA_CONTROLLER_PORT": str(_free_port()),
        "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "BACKFILL_KAFKA_SASL_MECHANISM": "PLAIN",
        "BACKFILL_KAFKA_SASL_USERNAME": "backfill",
        "BACKFILL_KAFKA_SASL_PASSWORD": f'pw-{token}-"q\\b',
        # The session's catalog: the process's one Spark session was built for it.
        "BACKFILL_CATALOG_URI": stack_settings.catalog.uri,
        "BACKFILL_WAREHOUSE": stack_settings.catalog.warehouse,
    }
    settings = Settings.from_env(env)
    broker = LocalBroker(settings)
    broker.start()
    try:
        yield SaslStack(env, settings, broker, token)
    finally:
        broker.stop()


def _materialize(spec: Any, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    return materialize_range([build_raw_asset(spec)], instance, *RANGE, raise_on_error=False)


_JVM_LOGGERS = ("org.apache.kafka", "org.apache.spark", "org.apache.iceberg")


def _add_spark_log_file(spark: SparkSession, path: Path) -> Any:
    """Attach a log4j2 file appender to the root logger of Spark's JVM and log Kafka, Spark
    and Iceberg at INFO (by logger: get_session resets the root level to WARN); returns it."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    log4j = jvm.org.apache.logging.log4j
    appender = (
        log4j.core.appender.FileAppender.newBuilder()
        .withFileName(str(path))
        .setName("leak-check")
        .setLayout(log4j.core.layout.PatternLayout.createDefaultLayout())
        .build()
    )
    appender.start()
    context = log4j.LogManager.getContext(False)
    context.getConfiguration().addAppender(appender)
    context.getConfiguration().getRootLogger().addAppender(appender, None, None)
    context.updateLoggers()
    for name in _JVM_LOGGERS:
        log4j.core.config.Configurator.setLevel(name, log4j.Level.toLevel("INFO"))
    return appender


def _remove_spark_log_file(spark: SparkSession, appender: Any) -> None:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    for name in _JVM_LOGGERS:
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, None)
    context = jvm.org.apache.logging.log4j.LogManager.getContext(False)
    context.getConfiguration().getRootLogger().removeAppender("leak-check")
    context.updateLoggers()
    appender.stop()


def _files_holding(root: Path, token: str, skip: set[Path] | None = None) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and path not in (skip or set()) and token.encode() in path.read_bytes():
            hits.append(str(path))
    return hits


def test_backfill_through_sasl_leaks_the_password_nowhere(
    sasl_stack: SaslStack,
    spark_session: SparkSession,
    stack_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    token = sasl_stack.token
    for key, value in sasl_stack.env.items():
        monkeypatch.setenv(key, value)
    topic = f"orders_sasl_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(
        sasl_stack.settings,
        GeneratorConfig(topic=topic, start=START, hours=2, events_per_hour=60, seed=5),
    )
    # Spark's own logs, at INFO for this run (the Kafka clients' config dumps are INFO), into a
    # file: the JVM's stderr is not the test's (it was inherited when the session started).
    spark_log = tmp_path / "spark.log"
    appender = _add_spark_log_file(spark_session, spark_log)
    try:
        (tmp_path / "dagster").mkdir()
        with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
            result = _materialize(spec, instance)
            assert result.success, [
                e.event_specific_data for e in result.all_events if e.is_failure
            ]
            records = sum(h["records"] for h in truth.kafka_hours.values())
            mats = result.get_asset_materialization_events()
            run = mats[-1].materialization.metadata["run"].value
            assert isinstance(run, dict) and run["records_read"] == records
            events = [dg.serialize_value(e) for e in instance.all_logs(result.run_id)]
            run = instance.get_run_by_id(result.run_id)
            assert run is not None
            run_text = dg.serialize_value(run)
        # Spark conf and the plan of a Kafka read with the SASL options.
        contract = OffsetContract(topic, START, START, {0: (0, 1)})
        plan = str(
            read_contract(spark_session, sasl_stack.settings, contract)
            ._jdf.queryExecution()
            .toString()
        )
        spark_conf = json.dumps(
            [
                sorted(spark_session.sparkContext.getConf().getAll()),
                sorted(spark_session.conf.getAll.items()),
            ]
        )
    finally:
        _remove_spark_log_file(spark_session, appender)

    settings = Settings.from_env(stack_env)
    ns = settings.catalog.namespace
    cat = catalog.load(settings.catalog)
    tables = {}
    for name in (spec.raw_table, spec.quarantine_table, audit.AUDIT_TABLE):
        table = cat.load_table(f"{ns}.{name}")
        tables[name] = [s.model_dump_json() for s in table.metadata.snapshots]
        tables[name].append(json.dumps(table.metadata.properties))
        assert any("backfill." in s for s in tables[name]) or name == audit.AUDIT_TABLE
    audit_rows = audit.query(cat, ns, run_id=result.run_id)
    assert [r["event"] for r in audit_rows] == ["publish"], "the run was audited"
    all_audit = cat.load_table(f"{ns}.{audit.AUDIT_TABLE}").scan().to_arrow().to_pylist()
    out, err = capfd.readouterr()

    places: dict[str, str] = {
        "python logging": caplog.text,
        "stdout": out,
        "stderr (Python, Dagster, librdkafka)": err,
        "dagster event log": "\n".join(events),
        "dagster run (config, tags)": run_text,
        "iceberg snapshots and properties": json.dumps(tables, default=str),
        "audit rows": json.dumps(all_audit, default=str),
        "spark conf": spark_conf,
        "spark plan of a SASL Kafka read": plan,
        "settings repr": repr(sasl_stack.settings),
    }
    spark_text = spark_log.read_text(errors="replace")
    places["spark log (JVM, INFO)"] = spark_text
    # The captures hold what they should: Spark's INFO lines including the Kafka consumer's
    # config dump, the run's Dagster log lines (its console logger writes to stderr, not
    # through the root logger), Python log records.
    assert "ConsumerConfig values" in spark_text and "sasl.jaas.config = [hidden]" in spark_text
    assert f"replaying {topic}" in err + out
    assert caplog.records
    leaks = [name for name, text in places.items() if token in text]
    broker_dir = sasl_stack.broker.dir
    leaks += _files_holding(broker_dir, token, skip={sasl_stack.broker.config_path})
    leaks += _files_holding(tmp_path / "dagster", token)
    warehouse = Path(settings.catalog.warehouse.removeprefix("file://")) / ns
    for name in (spec.raw_table, spec.quarantine_table, audit.AUDIT_TABLE):
        leaks += _files_holding(warehouse / name / "metadata", token)
    assert leaks == []
    # The one place that must hold it: the broker's own config, readable by its owner only.
    assert stat.S_IMODE(os.stat(sasl_stack.broker.config_path).st_mode) == 0o600


def test_wrong_password_fails_at_once_naming_broker_and_cause(
    sasl_stack: SaslStack,
    spark_session: SparkSession,
    stack_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    for key, value in {**sasl_stack.env, "BACKFILL_KAFKA_SASL_PASSWORD": wrong}.items():
        monkeypatch.setenv(key, value)
    spec = renamed(SPECS[0], topic=f"orders_sasl_{uuid.uuid4().hex[:8]}")
    began = time.monotonic()
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        result = _materialize(spec, instance)
        events = "\n".join(dg.serialize_value(e) for e in instance.all_logs(result.run_id))
    elapsed = time.monotonic() - began
    assert not result.success
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert failures
    message = str(failures[0].event_specific_data)
    bootstrap = sasl_stack.settings.kafka.bootstrap_servers
    assert f"Kafka at {bootstrap} rejected authentication" in message
    assert "Authentication failed" in message
    # KafkaClient.request_timeout_s is 30 s: failing well before it is failing "at once".
    assert elapsed < 25, f"took {elapsed:.0f}s"
    settings = Settings.from_env(stack_env)
    rows = audit.query(
        catalog.load(settings.catalog), settings.catalog.namespace, run_id=result.run_id
    )
    assert [r["event"] for r in rows] == ["run_failed"]
    assert f"Kafka at {bootstrap} rejected authentication" in rows[0]["detail"]
    assert wrong not in message and wrong not in events and wrong not in str(rows)
