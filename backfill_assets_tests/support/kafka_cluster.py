"""A 3-node KRaft Kafka cluster (SASL/SCRAM-SHA-512 over TLS, RF 3, min ISR 2) for the tests.

The test makes its own CA and server certificate (``cryptography``), starts the nodes through
:class:`backfill_assets.stack.broker.LocalKafkaCluster` on free ports, and yields the
``BACKFILL_KAFKA_*`` variables that point the project at the cluster as a non-super SCRAM user
with ACLs on its topics only. Every node is stopped by its PID (SIGKILL after a timeout).
"""

from __future__ import annotations

import datetime
import ipaddress
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from backfill_assets.stack.broker import LocalKafkaCluster
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.services import free_port

USER = "backfill"
# Characters a SCRAM password may hold that URL, JAAS and properties parsers trip on.
PASSWORD_CHARS = "p@ss:w/rd#1-"


@dataclass
class KafkaCluster:
    env: dict[str, str]  # BACKFILL_KAFKA_* (and BACKFILL_HOME/JAR_CACHE) for the cluster
    settings: Settings
    cluster: LocalKafkaCluster
    start_s: float  # how long the 3 nodes took to start (seconds)

    def admin(self) -> AdminClient:
        """An admin client of the inter-broker admin (a super user)."""
        return AdminClient({**self.cluster.nodes[0].admin_config(), "log_level": 0})

    def allow(self, principal: str, topic: str, group: str = "*") -> None:
        """ACLs for ``principal`` (``User:name``) to read, describe and write ``topic``
        (idempotently), and to read consumer group ``group``."""
        bindings = [
            AclBinding(
                ResourceType.TOPIC,
                topic,
                ResourcePatternType.LITERAL,
                principal,
                "*",
                op,
                AclPermissionType.ALLOW,
            )
            for op in (AclOperation.READ, AclOperation.DESCRIBE, AclOperation.WRITE)
        ]
        bindings.append(
            AclBinding(
                ResourceType.GROUP,
                group,
                ResourcePatternType.LITERAL,  # "*": every group
                principal,
                "*",
                AclOperation.READ,
                AclPermissionType.ALLOW,
            )
        )
        bindings.append(
            AclBinding(
                ResourceType.BROKER,
                "kafka-cluster",
                ResourcePatternType.LITERAL,
                principal,
                "*",
                AclOperation.IDEMPOTENT_WRITE,
                AclPermissionType.ALLOW,
            )
        )
        admin = self.admin()  # kept alive until the futures are done
        for future in admin.create_acls(bindings).values():
            future.result()

    def wait_authorized(self, topic: str, timeout_s: float = 30) -> None:
        """Until every live node shows ``topic`` to the settings' user: ACLs reach each node
        through the metadata log, so a client could otherwise be refused by a lagging one."""
        deadline = time.monotonic() + timeout_s
        for node in self.cluster.nodes:
            if node.running_pid() is None:
                continue
            conf = {
                **self.settings.kafka.client_config(),
                "bootstrap.servers": node.bootstrap,
                "log_level": 0,
            }
            admin = AdminClient(conf)
            while True:
                meta = admin.list_topics(topic=topic, timeout=5)
                info = meta.topics.get(topic)
                if info is not None and info.error is None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{topic!r} not visible to the user at {node.bootstrap}")
                time.sleep(0.2)


def write_certificates(directory: Path) -> tuple[Path, Path]:
    """A CA and a server certificate (SAN DNS:localhost, IP:127.0.0.1) signed by it; returns
    (keystore PEM: unencrypted PKCS#8 key + certificate + CA, CA PEM)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "backfill-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    eku = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kafka-broker")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(san, critical=False)
        .add_extension(eku, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    directory.mkdir(parents=True, exist_ok=True)
    keystore, ca_path = directory / "broker-keystore.pem", directory / "ca.pem"
    keystore.touch(mode=0o600)
    keystore.write_bytes(key_pem + cert.public_bytes(pem) + ca.public_bytes(pem))
    ca_path.write_bytes(ca.public_bytes(pem))
    return keystore, ca_path


def cluster_env(
    home: Path, jar_cache: str, password: str, ports: list[tuple[int, int]]
) -> dict[str, str]:
    """The environment of a SASL_SSL cluster on ``ports`` (client, controller) in ``home``
    (certificates made there)."""
    keystore, ca = write_certificates(home / "tls")
    return {
        "BACKFILL_HOME": str(home),
        "BACKFILL_JAR_CACHE": jar_cache,
        "BACKFILL_KAFKA_BOOTSTRAP": ",".join(f"127.0.0.1:{p}" for p, _ in ports),
        # The first node's ports: what the single-broker settings name.
        "BACKFILL_KAFKA_PORT": str(ports[0][0]),
        "BACKFILL_KAFKA_CONTROLLER_PORT": str(ports[0][1]),
        "BACKFILL_KAFKA_HEAP": "256m",
        "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "BACKFILL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "BACKFILL_KAFKA_SASL_USERNAME": USER,
        "BACKFILL_KAFKA_SASL_PASSWORD": password,
        "BACKFILL_KAFKA_SSL_CA_LOCATION": str(ca),
        "BACKFILL_KAFKA_SSL_KEYSTORE": str(keystore),
    }


@contextmanager
def kafka_cluster(home: Path, jar_cache: str, password: str) -> Iterator[KafkaCluster]:
    """Start the cluster in ``home``; yield it; stop every node by PID."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    env = cluster_env(home, jar_cache, password, ports)
    settings = Settings.from_env(env)
    cluster = LocalKafkaCluster(settings, ports)
    began = time.monotonic()
    try:
        cluster.start()
        yield KafkaCluster(env, settings, cluster, time.monotonic() - began)
    finally:
        cluster.stop()
