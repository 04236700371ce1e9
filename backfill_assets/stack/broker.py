"""Manage the embedded local Apache Kafka broker (KRaft, broker+controller in one JVM).

The broker runs from the jars resolved by :mod:`backfill_assets.stack.jars`, listens on 127.0.0.1
only, and keeps its log directories, config, PID file and log under ``<home>/kafka``.
Formatting the KRaft storage happens once; ``start`` is a no-op when our broker already runs;
``stop`` signals only the PID this module started (checked against the process command line).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from backfill_assets.errors import BrokerError, JarResolutionError
from backfill_assets.stack import jars
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


class LocalBroker:
    """A single-node KRaft broker whose state lives in ``settings.kafka_data_dir``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = settings.kafka_data_dir
        self.log_dirs = self.dir / "logs"
        self.config_path = self.dir / "server.properties"
        self.pid_path = self.dir / "broker.pid"
        self.log_path = self.dir / "broker.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.settings.kafka.local_port}"

    # ----------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = 90.0) -> BrokerStatus:
        """Format storage if needed, start the broker, and wait until it answers metadata."""
        pid = self._running_pid()
        if pid is not None:
            self.wait_ready(timeout_s)
            return self.status()
        java = _java()
        classpath = self._classpath()
        for port in (self.settings.kafka.local_port, self.settings.kafka.local_controller_port):
            _require_free_port(port)
        self._write_config()
        self._format(java, classpath)
        env = {**os.environ, "KAFKA_HEAP_OPTS": ""}
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen(
                [
                    java,
                    f"-Xmx{self.settings.kafka.local_heap}",
                    "-XX:+UseG1GC",
                    f"-Dlog4j2.configurationFile={_LOG4J_CONFIG}",
                    f"-Dkafka.logs.dir={self.dir}",
                    "-cp",
                    classpath,
                    _MAIN_CLASS,
                    str(self.config_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self.pid_path.write_text(f"{proc.pid}\n")
        try:
            self.wait_ready(timeout_s, proc=proc)
        except BrokerError:
            self.stop()
            raise
        return self.status()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker this module started (SIGTERM, then SIGKILL). True if one was running."""
        pid = self._running_pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.1)
        self.pid_path.unlink(missing_ok=True)
        return True

    def status(self) -> BrokerStatus:
        pid = self._running_pid()
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

    def wait_ready(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise BrokerError(
                    f"Kafka broker exited with code {proc.returncode} during start-up. "
                    f"Last lines of {self.log_path}:\n{self._log_tail()}"
                )
            try:
                self._cluster_id(timeout_s=2)
                return
            except BrokerError:
                time.sleep(0.5)
        raise BrokerError(
            f"Kafka broker at {self.bootstrap} did not answer metadata requests within "
            f"{timeout_s:.0f}s. Last lines of {self.log_path}:\n{self._log_tail()}"
        )

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
                out.write("".join(f"{k}={_properties_escape(v)}\n" for k, v in client.items()))
            proc = subprocess.run(
                [
                    _java(),
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
        port = self.settings.kafka.local_port
        cport = self.settings.kafka.local_controller_port
        self.log_dirs.mkdir(parents=True, exist_ok=True)
        lines = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{cport}",
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
        lines.update(self._sasl_config())
        text = "".join(f"{k}={_properties_escape(v)}\n" for k, v in lines.items())
        self.config_path.touch(mode=0o600)
        self.config_path.chmod(0o600)  # it may hold the SASL user's password
        self.config_path.write_text(text)

    def _sasl_config(self) -> dict[str, str]:
        """With ``SASL_PLAINTEXT`` + ``PLAIN`` settings, the client listener authenticates the
        settings' user (the controller listener stays PLAINTEXT on loopback); else nothing."""
        kafka = self.settings.kafka
        if kafka.security_protocol == "PLAINTEXT":
            return {}
        user, password = kafka.sasl_username, kafka.sasl_password
        if (
            kafka.security_protocol != "SASL_PLAINTEXT"
            or kafka.sasl_mechanism != "PLAIN"
            or user is None
            or password is None
            or not re.fullmatch(r"[A-Za-z0-9._-]+", user)
        ):
            raise BrokerError(
                "the local broker supports BACKFILL_KAFKA_SECURITY_PROTOCOL=PLAINTEXT, or "
                "SASL_PLAINTEXT with BACKFILL_KAFKA_SASL_MECHANISM=PLAIN and a "
                "BACKFILL_KAFKA_SASL_USERNAME (letters, digits, . _ -) and _PASSWORD; got "
                f"{kafka.security_protocol}/{kafka.sasl_mechanism}"
            )
        port, cport = kafka.local_port, kafka.local_controller_port
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

    def _format(self, java: str, classpath: str) -> None:
        if (self.log_dirs / "meta.properties").exists():
            return
        cluster_id = new_cluster_id()
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
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        if proc.returncode != 0:
            raise BrokerError(
                f"formatting KRaft storage in {self.log_dirs} failed: "
                f"{(proc.stdout + proc.stderr).strip()[-800:]}"
            )

    def _running_pid(self) -> int | None:
        """The PID from our PID file if that process is alive and is our broker."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not _alive(pid):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        if _MAIN_CLASS.encode() in cmdline and str(self.config_path).encode() in cmdline:
            return pid
        return None

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text[-lines:])


def _properties_escape(value: str) -> str:
    """A value as Java's Properties.load reads it back (backslash is its escape character)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def new_cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64 without padding.

    Like Kafka's own ``Uuid.randomUuid()``, ids starting with '-' are drawn again: the storage
    tool's argument parser would read such an id as an option (1 in 64 ids).
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError(
            "Java is not on PATH; the local Kafka broker needs a JDK 17+ "
            "(apt-get install openjdk-17-jdk-headless)"
        )
    return java


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as dead.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _require_free_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As Kafka binds (SO_REUSEADDR): connections of a just-stopped broker lingering in
        # TIME_WAIT do not block a restart on the same port; a listening process still does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise BrokerError(
                f"port 127.0.0.1:{port} is already in use; stop whatever holds it or choose "
                "other ports with BACKFILL_KAFKA_PORT / BACKFILL_KAFKA_CONTROLLER_PORT"
            ) from None
