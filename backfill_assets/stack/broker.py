"""Manage the embedded local Apache Kafka broker (KRaft, broker+controller in one JVM).

The broker runs from the jars resolved by :mod:`backfill_assets.stack.jars`, listens on 127.0.0.1
only, and keeps its log directories, config, PID file and log under ``<home>/kafka``.
Formatting the KRaft storage happens once; ``start`` is a no-op when our broker already runs;
``stop`` signals only the PID this module started (checked against the process command line).

:class:`LocalKafkaCluster` runs N such nodes (each broker and controller, one KRaft quorum),
each in ``<home>/kafka/node<i>`` with its own ports, with replication factor 3 and
``min.insync.replicas=2`` by default.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from backfill_assets.errors import BrokerError, JarResolutionError
from backfill_assets.stack import jars, process
from backfill_assets.stack.settings import Settings, jaas_quote

_LOG4J_CONFIG = Path(__file__).resolve().parent / "broker-log4j2.properties"
_MAIN_CLASS = "kafka.Kafka"


@dataclass(frozen=True)
class BrokerStatus:
    """What ``backfill-assets kafka status`` reports."""

    pid: int | None
    running: bool
    responding: bool
    bootstrap_servers: str
    cluster_id: str | None = None
    version: str | None = None
    data_dir: str = ""

    def describe(self) -> str:
        state = "running" if self.running else "stopped"
        if self.running and not self.responding:
            state += " (not answering metadata requests)"
        parts = [f"broker {state}", f"bootstrap={self.bootstrap_servers}"]
        if self.pid is not None:
            parts.append(f"pid={self.pid}")
        if self.version:
            parts.append(f"kafka={self.version}")
        if self.cluster_id:
            parts.append(f"cluster_id={self.cluster_id}")
        parts.append(f"data={self.data_dir}")
        return " ".join(parts)


@dataclass(frozen=True)
class Node:
    """One node of a local cluster: its KRaft node id, client port and controller port."""

    node_id: int
    port: int
    controller_port: int


# The inter-broker (and ACL-managing) SCRAM user of local SASL_SSL brokers; its password is
# made at the first format and kept in <home>/kafka/admin.secret (mode 0600).
ADMIN_USER = "kafka-admin"
# The principal every certificate on the mTLS controller listener maps to (a super user).
NODE_PRINCIPAL = "kafka-node"


class LocalBroker(process.Server[BrokerStatus]):
    """A KRaft node (broker and controller in one JVM). Alone (no ``node``) it is the
    single-node broker whose state lives in ``settings.kafka_data_dir``; as ``node`` of
    ``voters`` it is one node of a :class:`LocalKafkaCluster`."""

    error = BrokerError
    name = "the Kafka broker"
    start_timeout_s = 90.0
    poll_s = 0.5

    def __init__(
        self, settings: Settings, node: Node | None = None, voters: tuple[Node, ...] = ()
    ) -> None:
        self.settings = settings
        kafka = settings.kafka
        self.node = node or Node(1, kafka.local_port, kafka.local_controller_port)
        self.voters = voters or (self.node,)
        self.clustered = node is not None
        base = settings.kafka_data_dir
        self.dir = base / f"node{self.node.node_id}" if self.clustered else base
        self.log_dirs = self.dir / "logs"
        self.config_path = self.dir / "server.properties"
        self.pid_path = self.dir / "broker.pid"
        self.log_path = self.dir / "broker.log"
        self.admin_secret_path = base / "admin.secret"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.node.port}"

    # ----------------------------------------------------------------- lifecycle
    def launch(self, cluster_id: str | None = None) -> subprocess.Popen[bytes] | None:
        """Format storage if needed (with ``cluster_id``, default a new one) and start the
        JVM without waiting for it; None if our node already runs."""
        if self.running_pid() is not None:
            return None
        java = process.java(BrokerError, "the local Kafka broker")
        classpath = self._classpath()
        for port in (self.node.port, self.node.controller_port):
            process.require_free_port(
                port, BrokerError, "BACKFILL_KAFKA_PORT / BACKFILL_KAFKA_CONTROLLER_PORT"
            )
        self._write_config()
        self._format(java, classpath, cluster_id or new_cluster_id())
        env = {**os.environ, "KAFKA_HEAP_OPTS": ""}
        cmd = [
            java,
            f"-Xmx{self.settings.kafka.local_heap}",
            "-XX:+UseG1GC",
            f"-Dlog4j2.configurationFile={_LOG4J_CONFIG}",
            f"-Dkafka.logs.dir={self.dir}",
            "-cp",
            classpath,
            _MAIN_CLASS,
            str(self.config_path),
        ]
        return process.launch(cmd, self.log_path, self.pid_path, env=env)

    def kill(self) -> int | None:
        """SIGKILL our node at once (a crash, for fault tests); its PID, or None."""
        pid = self.running_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            while process.alive(pid):
                time.sleep(0.05)
        self.pid_path.unlink(missing_ok=True)
        return pid

    def status(self) -> BrokerStatus:
        pid = self.running_pid()
        cluster_id = None
        responding = False
        if pid is not None:
            try:
                cluster_id = self._cluster_id(timeout_s=5)
                responding = True
            except BrokerError:
                responding = False
        return BrokerStatus(
            pid=pid,
            running=pid is not None,
            responding=responding,
            bootstrap_servers=self.bootstrap,
            cluster_id=cluster_id,
            version=self.version() if responding else None,
            data_dir=str(self.dir),
        )

    @property
    def where(self) -> str:
        return self.bootstrap

    def answers(self) -> bool:
        """Whether it answers a metadata request."""
        try:
            self._cluster_id(timeout_s=2)
        except BrokerError:
            return False
        return True

    # ----------------------------------------------------------------- queries
    def version(self) -> str:
        """The broker's metadata.version, read through the admin API (DescribeFeatures).

        The string names the Kafka release line the broker runs, e.g. ``4.1-IV1``.
        """
        # The Java client settings (SASL included) go in a private file removed right after.
        client = {
            k.removeprefix("kafka."): v
            for k, v in self.settings.kafka.spark_options().items()
            if k != "kafka.bootstrap.servers"
        }
        fd, command_config = tempfile.mkstemp(dir=self.dir, suffix=".properties")  # mode 0600
        try:
            with os.fdopen(fd, "w") as out:
                out.write(
                    "".join(f"{k}={process.properties_escape(v)}\n" for k, v in client.items())
                )
            proc = subprocess.run(
                [
                    process.java(BrokerError, "the local Kafka broker"),
                    f"-Dlog4j2.configurationFile={_LOG4J_CONFIG}",
                    "-Dlog4j2.level=ERROR",
                    "-cp",
                    self._classpath(),
                    "org.apache.kafka.tools.FeatureCommand",
                    "--bootstrap-server",
                    self.bootstrap,
                    "--command-config",
                    command_config,
                    "describe",
                ],
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            )
        finally:
            Path(command_config).unlink(missing_ok=True)
        pattern = r"Feature: metadata\.version\s.*FinalizedVersionLevel: (\S+)"
        match = re.search(pattern, proc.stdout)
        if proc.returncode != 0 or match is None:
            raise BrokerError(
                f"could not describe features of {self.bootstrap}: {proc.stderr.strip()[-500:]}"
            )
        return match.group(1)

    def _cluster_id(self, timeout_s: float) -> str:
        conf = {**self.settings.kafka.client_config(), "bootstrap.servers": self.bootstrap}
        admin = AdminClient({**conf, "log_level": 0})
        try:
            meta = admin.list_topics(timeout=timeout_s)
        except Exception as exc:  # KafkaException: not reachable yet
            raise BrokerError(f"no metadata from {self.bootstrap}: {exc}") from exc
        return str(meta.cluster_id)

    # ----------------------------------------------------------------- internals
    def _classpath(self) -> str:
        try:
            found = jars.jars(self.settings, "kafka-broker")
        except JarResolutionError as exc:
            raise BrokerError(str(exc)) from exc
        return os.pathsep.join(str(p) for p in found)

    def _write_config(self) -> None:
        port, cport = self.node.port, self.node.controller_port
        self.log_dirs.mkdir(parents=True, exist_ok=True)
        voters = ",".join(f"{v.node_id}@127.0.0.1:{v.controller_port}" for v in self.voters)
        lines = {
            "process.roles": "broker,controller",
            "node.id": str(self.node.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.log_dirs),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # Back-dated demo history must not be removed by time-based retention on arrival;
            # topics that want retention set it per topic.
            "log.retention.hours": "-1",
            "log.retention.check.interval.ms": "10000",
            "auto.create.topics.enable": "false",
        }
        if self.clustered:
            lines.update(_replication(len(self.voters)))
        lines.update(self._sasl_config())
        text = "".join(f"{k}={process.properties_escape(v)}\n" for k, v in lines.items())
        self.config_path.touch(mode=0o600)
        self.config_path.chmod(0o600)  # it may hold the SASL user's password
        self.config_path.write_text(text)

    def _sasl_config(self) -> dict[str, str]:
        """With ``SASL_PLAINTEXT`` + ``PLAIN`` settings, the client listener authenticates the
        settings' user (the controller listener stays PLAINTEXT on loopback); else nothing."""
        kafka = self.settings.kafka
        if kafka.security_protocol == "PLAINTEXT":
            return {}
        if kafka.security_protocol == "SASL_SSL":
            return self._scram_tls_config()
        if kafka.security_protocol == "SSL":
            return self._mtls_config()
        user, password = kafka.sasl_username, kafka.sasl_password
        if (
            kafka.security_protocol != "SASL_PLAINTEXT"
            or kafka.sasl_mechanism != "PLAIN"
            or user is None
            or password is None
            or not re.fullmatch(r"[A-Za-z0-9._-]+", user)
        ):
            got = f"{kafka.security_protocol}/{kafka.sasl_mechanism}"
            raise BrokerError(f"{_UNSUPPORTED}; got {got}")
        port, cport = self.node.port, self.node.controller_port
        jaas = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f"username={jaas_quote(user)} password={jaas_quote(password)} "
            f"user_{user}={jaas_quote(password)};"
        )
        return {
            "listeners": f"SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
            "inter.broker.listener.name": "SASL_PLAINTEXT",
            "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
            "sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas,
        }

    def _scram_tls_config(self) -> dict[str, str]:
        """SASL_SSL + SCRAM: clients and brokers authenticate as SCRAM users on the client
        listener (TLS with the keystore's certificate); controllers authenticate each other by
        certificate (mTLS) on the controller listener. The StandardAuthorizer denies what no
        ACL allows, except to the inter-broker admin and the nodes' certificates."""
        kafka = self.settings.kafka
        mechanism = kafka.sasl_mechanism or ""
        user = kafka.sasl_username
        if not mechanism.startswith("SCRAM-") or user is None or kafka.sasl_password is None:
            raise BrokerError(_UNSUPPORTED + f"; got SASL_SSL/{mechanism}")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", user) or user == ADMIN_USER:
            raise BrokerError(
                f"BACKFILL_KAFKA_SASL_USERNAME={user!r}: the local broker needs letters, digits "
                f"and . _ - only, other than its own {ADMIN_USER!r}"
            )
        if kafka.local_ssl_keystore is None or kafka.ssl_ca_location is None:
            raise BrokerError(
                "a SASL_SSL local broker needs BACKFILL_KAFKA_SSL_KEYSTORE (its PEM key and "
                "certificate) and BACKFILL_KAFKA_SSL_CA_LOCATION (the CA that signed it)"
            )
        port, cport = self.node.port, self.node.controller_port
        jaas = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f"username={jaas_quote(ADMIN_USER)} password={jaas_quote(self._admin_password())};"
        )
        return {
            "listeners": f"SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
            "inter.broker.listener.name": "SASL_SSL",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "sasl.enabled.mechanisms": mechanism,
            "sasl.mechanism.inter.broker.protocol": mechanism,
            f"listener.name.sasl_ssl.{mechanism.lower()}.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": kafka.local_ssl_keystore,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": kafka.ssl_ca_location,
            "listener.name.controller.ssl.client.auth": "required",
            # Only the controller listener authenticates by certificate: any certificate its
            # truststore's CA signed is a node.
            "ssl.principal.mapping.rules": f"RULE:^.*$/{NODE_PRINCIPAL}/",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN_USER};User:{NODE_PRINCIPAL}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _mtls_config(self) -> dict[str, str]:
        """SSL: the client listener requires a client certificate (mTLS) that the CA signed;
        brokers talk to each other there with their own certificate. No authorizer."""
        kafka = self.settings.kafka
        ca = kafka.properties.get("ssl.truststore.location") or kafka.ssl_ca_location
        if kafka.local_ssl_keystore is None or ca is None:
            raise BrokerError(
                "an SSL (mTLS) local broker needs BACKFILL_KAFKA_SSL_KEYSTORE (its PEM key and "
                "certificate) and a PEM CA that signed the clients' certificates "
                "(ssl.truststore.location in BACKFILL_KAFKA_PROPERTIES, or "
                "BACKFILL_KAFKA_SSL_CA_LOCATION)"
            )
        port, cport = self.node.port, self.node.controller_port
        return {
            "listeners": f"SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"SSL://127.0.0.1:{port}",
            "inter.broker.listener.name": "SSL",
            "listener.security.protocol.map": "SSL:SSL,CONTROLLER:PLAINTEXT",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": kafka.local_ssl_keystore,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": ca,
            "ssl.client.auth": "required",
        }

    def _admin_password(self) -> str:
        """The inter-broker admin's SCRAM password, made once per local stack (0600 file)."""
        try:
            return self.admin_secret_path.read_text().strip()
        except FileNotFoundError:
            pass
        self.admin_secret_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.admin_secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(24) + "\n")
        return self.admin_secret_path.read_text().strip()

    def admin_config(self) -> dict[str, str | int | float | bool]:
        """librdkafka settings of the inter-broker admin (a super user), for setting ACLs."""
        return {
            **self.settings.kafka.client_config(),
            "sasl.username": ADMIN_USER,
            "sasl.password": self._admin_password(),
        }

    def _scram_users(self) -> list[str]:
        """``--add-scram`` arguments of the storage tool: the admin and the settings' user."""
        kafka = self.settings.kafka
        if kafka.security_protocol != "SASL_SSL" or kafka.sasl_mechanism is None:
            return []
        users = [(ADMIN_USER, self._admin_password())]
        if kafka.sasl_username is not None and kafka.sasl_password is not None:
            if re.search(r'["\\\]]', kafka.sasl_password):
                raise BrokerError(
                    "BACKFILL_KAFKA_SASL_PASSWORD: the local broker's SCRAM set-up cannot take "
                    'a password with " \\ or ]'
                )
            users.append((kafka.sasl_username, kafka.sasl_password))
        args = []
        for name, password in users:
            args += ["--add-scram", f'{kafka.sasl_mechanism}=[name={name},password="{password}"]']
        return args

    def _format(self, java: str, classpath: str, cluster_id: str) -> None:
        if (self.log_dirs / "meta.properties").exists():
            return
        proc = subprocess.run(
            [
                java,
                f"-Dlog4j2.configurationFile={_LOG4J_CONFIG}",
                "-cp",
                classpath,
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(self.config_path),
                *self._scram_users(),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).strip()[-800:]
            for secret in (self.settings.kafka.sasl_password, self._admin_secret_if_any()):
                if secret:
                    out = out.replace(secret, "***")
            raise BrokerError(f"formatting KRaft storage in {self.log_dirs} failed: {out}")

    def _admin_secret_if_any(self) -> str | None:
        try:
            return self.admin_secret_path.read_text().strip()
        except FileNotFoundError:
            return None

    def running_pid(self) -> int | None:
        """The PID from our PID file if that process is alive and is our broker."""
        return process.recorded_pid(
            self.pid_path, _MAIN_CLASS.encode(), str(self.config_path).encode()
        )


_UNSUPPORTED = (
    "the local broker supports BACKFILL_KAFKA_SECURITY_PROTOCOL=PLAINTEXT; SSL (client "
    "certificates required); SASL_PLAINTEXT with BACKFILL_KAFKA_SASL_MECHANISM=PLAIN; or "
    "SASL_SSL with SCRAM-SHA-256/SCRAM-SHA-512; each SASL one with a "
    "BACKFILL_KAFKA_SASL_USERNAME (letters, digits, . _ -) and _PASSWORD"
)


def _replication(nodes: int) -> dict[str, str]:
    """Topic defaults of an N-node cluster: every record on up to 3 nodes, acknowledged by 2."""
    factor = str(min(nodes, 3))
    min_isr = str(min(nodes, 2))
    return {
        "default.replication.factor": factor,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": factor,
        "transaction.state.log.replication.factor": factor,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": factor,
        "share.coordinator.state.topic.min.isr": min_isr,
    }


class LocalKafkaCluster:
    """N local KRaft nodes, each broker and controller, on the given ports, one quorum."""

    def __init__(self, settings: Settings, ports: list[tuple[int, int]]) -> None:
        every = [port for pair in ports for port in pair]
        if len(set(every)) != len(every):
            raise BrokerError(
                f"the cluster's nodes need distinct ports (client, controller): {ports}; "
                "a port given twice lets one node answer for another that never started"
            )
        nodes = tuple(Node(i, p, c) for i, (p, c) in enumerate(ports, start=1))
        self.settings = settings
        self.nodes = [LocalBroker(settings, n, nodes) for n in nodes]
        self.cluster_id_path = settings.kafka_data_dir / "cluster.id"

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.nodes)

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every node (formatting each with one cluster id), wait until all answer."""
        if not self.cluster_id_path.exists():
            self.cluster_id_path.parent.mkdir(parents=True, exist_ok=True)
            self.cluster_id_path.write_text(new_cluster_id() + "\n")
        cluster_id = self.cluster_id_path.read_text().strip()
        try:
            procs = [b.launch(cluster_id) for b in self.nodes]
            deadline = time.monotonic() + timeout_s
            for broker, proc in zip(self.nodes, procs, strict=True):
                broker.wait_ready(max(deadline - time.monotonic(), 1.0), proc=proc)
        except BrokerError:
            self.stop()
            raise

    def restart(self, node_id: int, timeout_s: float = 90.0) -> None:
        """Start one (killed or stopped) node again and wait until it answers."""
        broker = self.nodes[node_id - 1]
        broker.wait_ready(timeout_s, proc=broker.launch(self.cluster_id_path.read_text().strip()))

    def stop(self, timeout_s: float = 20.0) -> int:
        """Stop every node of ours (SIGTERM together, SIGKILL after ``timeout_s``); how many."""
        pids = [p for p in (b.running_pid() for b in self.nodes) if p is not None]
        process.terminate(pids, timeout_s)
        for broker in self.nodes:
            broker.pid_path.unlink(missing_ok=True)
        return len(pids)


def new_cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64 without padding.

    Like Kafka's own ``Uuid.randomUuid()``, ids starting with '-' are drawn again: the storage
    tool's argument parser would read such an id as an option (1 in 64 ids).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id
