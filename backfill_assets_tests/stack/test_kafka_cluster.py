"""The project against a production-shaped Kafka: 3 KRaft nodes, replication factor 3,
``min.insync.replicas=2``, SASL/SCRAM-SHA-512 over TLS (certificates made by the test), the
StandardAuthorizer denying what no ACL allows (support/kafka_cluster.py).

* records flushed by an idempotent ``acks=all`` producer while one broker is SIGKILLed are all
  counted, exactly, by the project's offset look-ups and window scan (through SASL_SSL, with the
  broker still dead), and the killed broker rejoins;
* a wrong password and a user without the topic's ACL each give one ``error:`` line naming
  what to fix, and exit 2, promptly.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)
from pyspark.sql import SparkSession

from backfill_assets.lake.offsets.scan import scan
from backfill_assets.lake.write import read
from backfill_assets.ops import cli
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.kafka_cluster import KafkaCluster, kafka_cluster

pytestmark = pytest.mark.cluster

HOUR = timedelta(hours=1)
START = datetime(2026, 3, 2, 10, tzinfo=UTC)
HOURS = [START + i * HOUR for i in range(3)]
SPEC_TOPIC = "orders"  # the spec's topic: what the CLI commands read by default


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    import os

    password = f"p@ss:w/rd#{uuid.uuid4().hex}"
    home = tmp_path_factory.mktemp("kafka-cluster")
    jars = os.environ.get("BACKFILL_JAR_CACHE", "")
    with kafka_cluster(home, jars, password) as kc:
        print(f"3-node SASL_SSL cluster started in {kc.start_s:.1f}s")  # noqa: T201
        yield kc


def _create_topic(kc: KafkaCluster, topic: str, partitions: int = 3) -> None:
    admin = kc.admin()
    # The cluster's defaults: replication factor 3, min.insync.replicas 2.
    admin.create_topics([NewTopic(topic, partitions)])[topic].result()
    kc.allow("User:backfill", topic)
    kc.wait_authorized(topic)


def _produce(
    producer: Producer, topic: str, n: int, first: int, delivered: Counter[Any], failed: list[str]
) -> None:
    def done(err: KafkaError | None, msg: Message[Any, Any]) -> None:
        if err is None:
            delivered[HOURS[int(msg.key()) // 400]] += 1  # type: ignore[arg-type]
        else:
            failed.append(err.str())

    # In time order, 400 records an hour: the kill after 600 falls inside the middle hour.
    for i in range(first, first + n):
        hour = HOURS[i // 400]
        ts = int((hour + timedelta(seconds=i % 400)).timestamp() * 1000)
        producer.produce(topic, key=str(i), value=f'{{"i": {i}}}', timestamp=ts, on_delivery=done)
        producer.poll(0)


def test_a_broker_killed_mid_produce_loses_nothing_that_was_flushed(
    cluster: KafkaCluster, spark_session: SparkSession
) -> None:
    topic = f"kill_{uuid.uuid4().hex[:8]}"
    _create_topic(cluster, topic)
    producer = Producer(
        {
            **cluster.settings.kafka.client_config(),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
        }
    )
    delivered: Counter[Any] = Counter()
    failed: list[str] = []
    _produce(producer, topic, 600, 0, delivered, failed)
    replicas = cluster.admin().list_topics(topic, timeout=20).topics[topic].partitions
    assert [len(p.replicas) for p in replicas.values()] == [3, 3, 3]
    admin = cluster.admin()
    described = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)])
    configs = next(iter(described.values())).result()
    assert configs["min.insync.replicas"].value == "2"
    victim = cluster.cluster.nodes[2]
    killed = victim.kill()  # SIGKILL while records of the first batch may still be in flight
    assert killed is not None
    _produce(producer, topic, 600, 600, delivered, failed)
    assert producer.flush(90) == 0, "every record was acknowledged or failed"
    assert failed == [] and sum(delivered.values()) == 1200, "acks=all, 2 of 3 in sync"

    # Read back through SASL_SSL with the broker still dead: offsets and the window scan.
    kafka = KafkaClient(cluster.settings)
    marks = kafka.watermarks(topic)
    assert sum(high - low for low, high in marks.values()) == 1200
    windows = scan(kafka, topic, HOURS[0], HOURS[-1] + HOUR, seal_grace=timedelta(0))
    counted = {h: sum(c.records for c in windows.cells[h].values()) for h in windows.hours}
    assert counted == dict(delivered)
    # Spark's Kafka source (Java client) reads the same ranges with KafkaSettings.spark_options:
    # SCRAM-SHA-512 through JAAS, the PEM truststore; the session's Spark is classic local.
    frame = read._read_kafka(spark_session, cluster.settings, topic, windows.ranges)
    assert frame.count() == 1200

    began = time.monotonic()
    cluster.cluster.restart(3)
    print(f"killed broker rejoined in {time.monotonic() - began:.1f}s")  # noqa: T201
    assert victim.running_pid() not in (None, killed)
    assert sum(h - lo for lo, h in KafkaClient(cluster.settings).watermarks(topic).values()) == 1200


def _cli(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    *args: str,
) -> tuple[int, str, float]:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    began = time.monotonic()
    code = cli.main(list(args))
    elapsed = time.monotonic() - began
    _out, err = capsys.readouterr()
    return code, err, elapsed


def _error_lines(err: str) -> list[str]:
    # librdkafka's own log lines (``%3|...``) go to stderr too; the CLI's answer is its own.
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_wrong_password_is_one_error_naming_the_setting_exit_2(
    cluster: KafkaCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    env = {**cluster.env, "BACKFILL_KAFKA_SASL_PASSWORD": wrong}
    code, err, elapsed = _cli(capsys, monkeypatch, env, "archive", "--status")
    lines = _error_lines(err)
    assert code == 2, err
    assert len(lines) == 1, err
    assert (
        f"Kafka at {cluster.settings.kafka.bootstrap_servers} rejected authentication" in (lines[0])
    )
    assert "BACKFILL_KAFKA_SASL_PASSWORD" in lines[0]
    assert "BACKFILL_KAFKA_SASL_USERNAME" in lines[0]
    assert wrong not in err
    assert elapsed < 15, f"took {elapsed:.1f}s"


def _wait_until_user_logs_in(env: dict[str, str], timeout_s: float = 30) -> None:
    """A new SCRAM user's credentials reach every broker through the metadata log."""
    conf = {**Settings.from_env(env).kafka.client_config(), "log_level": 0}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            AdminClient(conf).list_topics(timeout=3)
            return
        except KafkaException:
            if time.monotonic() > deadline:
                raise


def test_a_user_without_the_topics_acl_is_told_so_exit_2(
    cluster: KafkaCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = cluster.admin()
    if SPEC_TOPIC not in admin.list_topics(timeout=20).topics:
        _create_topic(cluster, SPEC_TOPIC)
    user, password = f"noacl-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    upsert = UserScramCredentialUpsertion(
        user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode()
    )
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result()
    env = {
        **cluster.env,
        "BACKFILL_KAFKA_SASL_USERNAME": user,
        "BACKFILL_KAFKA_SASL_PASSWORD": password,
    }
    _wait_until_user_logs_in(env)
    # The project's own user reads the topic; this one is authenticated but has no ACL.
    assert KafkaClient(cluster.settings).partitions(SPEC_TOPIC) == [0, 1, 2]
    code, err, elapsed = _cli(capsys, monkeypatch, env, "archive", "--status")
    lines = _error_lines(err)
    assert code == 2, err
    assert len(lines) == 1, err
    assert f"topic {SPEC_TOPIC!r}" in lines[0]
    assert "missing or not authorized" in lines[0] and repr(user) in lines[0], lines[0]
    assert "BACKFILL_KAFKA_SASL_USERNAME" in lines[0]
    assert elapsed < 15, f"took {elapsed:.1f}s"
