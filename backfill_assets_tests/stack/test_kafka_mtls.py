"""mTLS through BACKFILL_KAFKA_PROPERTIES against a real broker whose SSL listener requires a
client certificate (``ssl.client.auth=required``; ``LocalBroker._mtls_config``).

The test makes a CA, the broker's certificate and a client certificate signed by the CA
(``cryptography``), the client's as a password-protected PKCS#12 keystore (the password holds a
unique token) and as a PEM file. With the certificate in the map, a raw-asset materialization
of one hour (KafkaClient metadata and ListOffsets, the librdkafka window scan, Spark's Kafka
read) succeeds and the password appears in no captured log, event or plan; the PEM keystore
works for both clients too. Without the certificate, or with a wrong keystore password, the
first Kafka call fails at once with one line naming BACKFILL_KAFKA_PROPERTIES.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.errors import KafkaAccessError
from backfill_assets.lake.offsets.contract import OffsetContract
from backfill_assets.lake.write.read import read_contract
from backfill_assets.spec.declared import renamed
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.stack.test_security import _add_spark_log_file, _remove_spark_log_file
from backfill_assets_tests.support.runs import materialize_range
from backfill_assets_tests.support.services import free_port

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.cluster

START = dt.datetime(2026, 2, 20, 3, tzinfo=dt.UTC)
RANGE = ("2026-02-20-03:00", "2026-02-20-04:00")


@dataclasses.dataclass
class Mtls:
    env: dict[str, str]
    settings: Settings
    broker: LocalBroker
    props: dict[str, str]  # the client's BACKFILL_KAFKA_PROPERTIES (PKCS#12 keystore)
    pem: Path  # the client's key and certificate as one PEM file
    password: str  # the PKCS#12 keystore's password: holds a unique token


def _cert(
    name: str,
    key: rsa.RSAPrivateKey,
    ca: tuple[x509.Name, rsa.RSAPrivateKey],
    *usages: x509.ObjectIdentifier,
) -> x509.Certificate:
    """A certificate for ``name`` signed by ``ca`` (SAN 127.0.0.1, the given key usages)."""
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca[0])
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .sign(ca[1], hashes.SHA256())
    )


def _certificates(directory: Path, password: str) -> dict[str, Path]:
    """CA, broker keystore (PEM key + certificate + CA), client PKCS#12 (``password``) and
    client PEM (unencrypted key + certificate), all in ``directory``."""
    directory.mkdir(parents=True)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "backfill-mtls-test-ca")])
    now = dt.datetime.now(dt.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    plain = (serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    broker_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    broker = _cert(
        "kafka-broker",
        broker_key,
        (ca_name, ca_key),
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    client_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    client = _cert(
        "backfill-client", client_key, (ca_name, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    files = {
        "ca": (directory / "ca.pem", ca.public_bytes(pem)),
        "broker": (
            directory / "broker.pem",
            broker_key.private_bytes(pem, *plain) + broker.public_bytes(pem) + ca.public_bytes(pem),
        ),
        "client_pem": (
            directory / "client.pem",
            client_key.private_bytes(pem, *plain) + client.public_bytes(pem),
        ),
        "client_p12": (
            directory / "client.p12",
            pkcs12.serialize_key_and_certificates(
                b"backfill-client",
                client_key,
                client,
                [ca],
                serialization.BestAvailableEncryption(password.encode()),
            ),
        ),
    }
    for path, data in files.values():
        path.touch(mode=0o600)
        path.write_bytes(data)
    return {name: path for name, (path, _) in files.items()}


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, stack_settings: Settings) -> Iterator[Mtls]:
    home = tmp_path_factory.mktemp("mtls")
    password = f"pw-{uuid.uuid4().hex}"
    files = _certificates(home / "tls", password)
    props = {
        "security.protocol": "SSL",
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(files["ca"]),
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(files["client_p12"]),
        "ssl.keystore.password": password,
    }
    env = {
        "BACKFILL_HOME": str(home),
        "BACKFILL_JAR_CACHE": str(stack_settings.jar_cache),
        "BACKFILL_KAFKA_PORT": str(free_port()),
        "BACKFILL_KAFKA_CONTROLLER_PORT": str(free_port()),
        "BACKFILL_KAFKA_HEAP": "256m",
        "BACKFILL_KAFKA_SSL_KEYSTORE": str(files["broker"]),
        "BACKFILL_KAFKA_PROPERTIES": json.dumps(props),
        # The session's catalog: the process's one Spark session was built for it.
        "BACKFILL_CATALOG_URI": stack_settings.catalog.uri,
        "BACKFILL_WAREHOUSE": stack_settings.catalog.warehouse,
    }
    settings = Settings.from_env(env)
    broker = LocalBroker(settings)
    broker.start()
    try:
        yield Mtls(env, settings, broker, props, files["client_pem"], password)
    finally:
        broker.stop()


def _with_props(mtls: Mtls, props: dict[str, str]) -> Settings:
    return Settings.from_env({**mtls.env, "BACKFILL_KAFKA_PROPERTIES": json.dumps(props)})


def test_a_client_certificate_reaches_every_client_and_its_password_no_log(
    mtls: Mtls,
    spark_session: SparkSession,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    for key, value in mtls.env.items():
        monkeypatch.setenv(key, value)
    topic = f"orders_mtls_{uuid.uuid4().hex[:8]}"
    spec = renamed(SPECS[0], topic=topic)
    truth = generate(  # the producer and the admin client, through mTLS
        mtls.settings,
        GeneratorConfig(topic=topic, start=START, hours=2, events_per_hour=40, seed=7),
    )
    spark_log = tmp_path / "spark.log"
    appender = _add_spark_log_file(spark_session, spark_log)
    try:
        (tmp_path / "dagster").mkdir()
        with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
            result = materialize_range(
                [build_raw_asset(spec)], instance, *RANGE, raise_on_error=False
            )
            assert result.success, [
                e.event_specific_data for e in result.all_events if e.is_failure
            ]
            mats = result.get_asset_materialization_events()
            run = mats[-1].materialization.metadata["run"].value
            events = "\n".join(dg.serialize_value(e) for e in instance.all_logs(result.run_id))
        assert isinstance(run, dict)
        assert run["records_read"] == sum(h["records"] for h in truth.kafka_hours.values()) > 0
        stable = KafkaClient(mtls.settings).log_ends(topic)[0][1]
        whole = OffsetContract(topic, START, START, {0: (0, stable)})
        frame = read_contract(spark_session, mtls.settings, whole)
        plan = str(frame._jdf.queryExecution().toString())
    finally:
        _remove_spark_log_file(spark_session, appender)
    out, err = capfd.readouterr()
    spark_text = spark_log.read_text(errors="replace")
    # The captures hold what they should: the Java consumer's config dump (keystore password
    # hidden), the run's Dagster lines, Python log records.
    assert "ssl.keystore.password = [hidden]" in spark_text
    assert f"replaying {topic}" in err + out
    assert "KafkaRelation(strategy=Assign" in plan
    places = {
        "python logging": caplog.text,
        "stdout": out,
        "stderr": err,
        "dagster event log": events,
        "spark log (JVM, INFO)": spark_text,
        "spark plan of an mTLS Kafka read": plan,
        "settings repr": repr(mtls.settings),
        "broker log": mtls.broker.log_path.read_text(errors="replace"),
    }
    assert [name for name, text in places.items() if mtls.password in text] == []


def _pem_settings(mtls: Mtls, inline: bool) -> Settings:
    """The client's PEM keystore: one file (key and certificate), or the two as strings."""
    trust = {k: v for k, v in mtls.props.items() if not k.startswith("ssl.keystore")}
    if not inline:
        keystore = {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(mtls.pem)}
        return _with_props(mtls, {**trust, **keystore})
    text = mtls.pem.read_text()
    end = text.index("-----END PRIVATE KEY-----") + len("-----END PRIVATE KEY-----\n")
    keystore = {
        "ssl.keystore.type": "PEM",
        "ssl.keystore.key": text[:end],
        "ssl.keystore.certificate.chain": text[end:],
    }
    return _with_props(mtls, {**trust, **keystore})


@pytest.mark.parametrize("inline", [False, True], ids=["pem-file", "pem-strings"])
def test_a_pem_keystore_reaches_both_clients(
    mtls: Mtls, spark_session: SparkSession, inline: bool
) -> None:
    """librdkafka gets ssl.certificate/key.location (or .pem), Spark's Java client the PEM
    keystore as it is; an inline key never shows in the plan of a read."""
    topic = f"orders_mtls_pem_{uuid.uuid4().hex[:8]}"
    generate(
        mtls.settings,
        GeneratorConfig(topic=topic, start=START, hours=1, events_per_hour=30, seed=3),
    )
    pem = _pem_settings(mtls, inline)
    client = KafkaClient(pem)
    assert client.partitions(topic) == list(range(6))
    stable = client.log_ends(topic)[0][1]  # partition 0's last stable offset
    whole = OffsetContract(topic, START, START, {0: (0, stable)})
    frame = read_contract(spark_session, pem, whole)
    # Control records of transactions hold offsets too: at most that many rows, and some.
    assert 0 < frame.count() <= stable
    # Spark's plan of a Kafka read (what its UI shows) names the strategy and offsets only.
    plan = str(frame._jdf.queryExecution().analyzed().toString())
    assert "KafkaRelation(strategy=Assign" in plan
    key_line = mtls.pem.read_text().splitlines()[1]  # a line of the key's base64 body
    assert key_line not in plan


def test_without_a_client_certificate_the_first_call_fails_naming_the_setting(
    mtls: Mtls,
) -> None:
    no_cert = _with_props(
        mtls, {k: v for k, v in mtls.props.items() if not k.startswith("ssl.keystore")}
    )
    began = time.monotonic()
    with pytest.raises(KafkaAccessError) as raised:
        KafkaClient(no_cert).partitions("any_topic")
    message = str(raised.value)
    assert time.monotonic() - began < 20  # KafkaClient.request_timeout_s is 30 s
    assert "\n" not in message
    assert f"Kafka at {no_cert.kafka.bootstrap_servers} refused the TLS connection" in message
    assert "BACKFILL_KAFKA_PROPERTIES" in message and "ssl.keystore" in message


def test_a_wrong_keystore_password_fails_naming_the_setting_not_the_password(
    mtls: Mtls,
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    settings = _with_props(mtls, {**mtls.props, "ssl.keystore.password": wrong})
    with pytest.raises(KafkaAccessError) as raised:
        KafkaClient(settings).partitions("any_topic")
    message = str(raised.value)
    assert "\n" not in message
    assert "could not start" in message and "BACKFILL_KAFKA_PROPERTIES" in message
    assert wrong not in message and mtls.password not in message
