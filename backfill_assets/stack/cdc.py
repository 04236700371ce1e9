"""The local CDC source: a Postgres with logical decoding, a Kafka Connect worker
against the project's broker, and Debezium's Postgres connector registered over Connect's REST
API.

Every piece comes from a package registry: Postgres from Debian (stack/postgres.py), Kafka
Connect's runtime and JSON converter and Debezium's connector from Maven Central (the
``kafka-connect`` jar set, maven/kafka-connect/pom.xml) with Apicurio Registry's Avro converter
(the ``kafka-connect-avro`` set), run on one plain classpath.

* :class:`ConnectWorker`: one distributed-mode worker (``ConnectDistributed``; its connectors,
  offsets and statuses live in three compacted topics of the broker, so a restarted worker
  resumes its connectors where they were), REST API on ``127.0.0.1:<BACKFILL_KAFKA_CONNECT_PORT>``,
  state under ``<BACKFILL_HOME>/kafka-connect``. ``stop`` signals only the PID it started
  (checked against the process command line).
* :func:`debezium_postgres`: a connector's configuration (pgoutput, its own slot and filtered
  publication, decimals as strings, the JSON converter with or without schemas, or Avro through
  the schema registry in Confluent's wire format). The database
  password stays out of the connector's configuration (and so out of the broker's config topic
  and the REST API): the worker reads it from a 0600 file through Kafka's FileConfigProvider.
* :class:`CdcSource`: the Postgres (port BACKFILL_CDC_POSTGRES_PORT, under
  ``<BACKFILL_HOME>/postgres``) and the worker together, as ``stack up --cdc`` runs them.

The local broker's PLAINTEXT listener only: a worker for a SASL or TLS broker is not written.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backfill_assets.errors import CdcError, JarResolutionError
from backfill_assets.stack import jars, process
from backfill_assets.stack.postgres import LOGICAL_DECODING, LocalPostgres, PgServer
from backfill_assets.stack.settings import CCOMPAT_PATH, Settings

CONNECT_MAIN = "org.apache.kafka.connect.cli.ConnectDistributed"
POSTGRES_CONNECTOR = "io.debezium.connector.postgresql.PostgresConnector"
JSON_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
# Apicurio Registry's Avro converter (jar set kafka-connect-avro, the registry's 2.4.2.Final).
AVRO_CONVERTER = "io.apicurio.registry.utils.converter.AvroConverter"
# Apicurio's own REST API, which its serdes use, beside the Confluent-compatible one.
APICURIO_API_PATH = "/apis/registry/v2"
_LOG4J_CONFIG = Path(__file__).resolve().parent / "broker-log4j2.properties"
# The worker group and its three internal topics (compacted; Connect creates them).
GROUP_ID = "backfill-assets-cdc"
_INTERNAL_TOPICS = {
    "config.storage.topic": "_backfill_cdc_configs",
    "offset.storage.topic": "_backfill_cdc_offsets",
    "status.storage.topic": "_backfill_cdc_status",
}
# Answers of a worker that is (re)joining its group: a request is tried again.
_RETRY_STATUSES = (409, 500, 503)


@dataclass(frozen=True)
class WorkerStatus:
    """What ``backfill-assets stack status`` reports for the Kafka Connect worker."""

    pid: int | None
    running: bool
    ready: bool
    url: str
    connectors: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        state = "running" if self.running else "stopped"
        if self.running and not self.ready:
            state += " (not ready)"
        pid = f" pid={self.pid}" if self.pid is not None else ""
        found = " ".join(f"{name}={state}" for name, state in sorted(self.connectors.items()))
        return f"kafka connect {state} url={self.url}{pid}" + (f" {found}" if found else "")


class ConnectWorker(process.Server[WorkerStatus]):
    """One Kafka Connect worker in distributed mode against the settings' broker."""

    error = CdcError
    name = "the Kafka Connect worker"
    start_timeout_s = 120.0

    def __init__(
        self, settings: Settings, port: int | None = None, classpath: Sequence[Path] = ()
    ) -> None:
        self.settings = settings
        self.port = settings.kafka_connect_port if port is None else port
        # Jars added to the worker's classpath (tests: a producer interceptor).
        self.extra_classpath = tuple(classpath)
        self.dir = settings.home / "kafka-connect"
        self.config_path = self.dir / "worker.properties"
        self.pid_path = self.dir / "worker.pid"
        self.log_path = self.dir / "worker.log"
        # Connector secrets (database passwords) the worker reads with FileConfigProvider.
        self.secrets_path = self.dir / "secrets.properties"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- lifecycle
    def launch(self) -> subprocess.Popen[bytes] | None:
        """Start the JVM without waiting; None if ours already runs."""
        if self.running_pid() is not None:
            return None
        protocol = self.settings.kafka.security_protocol
        if protocol != "PLAINTEXT":
            raise CdcError(
                "the CDC source's Kafka Connect worker reaches a PLAINTEXT broker only; "
                f"BACKFILL_KAFKA_SECURITY_PROTOCOL={protocol}"
            )
        try:
            classpath = os.pathsep.join(
                map(
                    str,
                    [
                        *jars.jars(self.settings, "kafka-connect"),
                        *jars.jars(self.settings, "kafka-connect-avro"),
                        *self.extra_classpath,
                    ],
                )
            )
        except JarResolutionError as exc:
            raise CdcError(str(exc)) from exc
        java = process.java(CdcError, "the Kafka Connect worker")
        process.require_free_port(self.port, CdcError, "BACKFILL_KAFKA_CONNECT_PORT")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        cmd = [
            java,
            f"-Xmx{self.settings.kafka_connect_heap}",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={_LOG4J_CONFIG}",
            "-cp",
            classpath,
            CONNECT_MAIN,
            str(self.config_path),
        ]
        return process.launch(cmd, self.log_path, self.pid_path, cwd=self.dir)

    @property
    def where(self) -> str:
        return self.url

    def answers(self) -> bool:
        return self.ready()

    def on_ready(self) -> None:
        """It must know Debezium's Postgres connector."""
        plugins = {p.get("class") for p in self.request("GET", "/connector-plugins")}
        if POSTGRES_CONNECTOR not in plugins:
            raise CdcError(
                f"the Kafka Connect worker at {self.url} does not list {POSTGRES_CONNECTOR} "
                f"among its plugins ({', '.join(sorted(map(str, plugins)))})"
            )

    def ready(self) -> bool:
        """Whether the worker has joined its group: it answers its connector list."""
        try:
            with urllib.request.urlopen(self.url + "/connectors", timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, ValueError):
            return False

    def status(self) -> WorkerStatus:
        pid = self.running_pid()
        ready = pid is not None and self.ready()
        connectors: dict[str, str] = {}
        if ready:
            for name in self.request("GET", "/connectors"):
                state = self.connector_status(name)
                connectors[name] = _state(state) if state else "unknown"
        return WorkerStatus(
            pid=pid, running=pid is not None, ready=ready, url=self.url, connectors=connectors
        )

    def running_pid(self) -> int | None:
        """The PID from our PID file if that process is alive and is our worker."""
        return process.recorded_pid(
            self.pid_path, CONNECT_MAIN.encode(), str(self.config_path).encode()
        )

    # ----------------------------------------------------------------- connectors
    def secret(self, key: str, value: str) -> str:
        """Keep ``value`` in the worker's secrets file (mode 0600) under ``key``; the reference
        a connector's configuration names it by."""
        self.dir.mkdir(parents=True, exist_ok=True)
        values: dict[str, str] = {}
        if self.secrets_path.is_file():
            for line in self.secrets_path.read_text().splitlines():
                name, sep, rest = line.partition("=")
                if sep:
                    values[name] = rest
        values[key] = process.properties_escape(value)
        fd = os.open(self.secrets_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{k}={v}\n" for k, v in sorted(values.items())))
        return f"${{file:{self.secrets_path}:{key}}}"

    def put_connector(self, name: str, config: dict[str, str], timeout_s: float = 60.0) -> None:
        """Create connector ``name`` with ``config``, or give it that configuration (PUT is
        idempotent), then wait until it and its task run."""
        path = "/connectors/" + urllib.parse.quote(name, safe="") + "/config"
        self.request("PUT", path, config, timeout_s=timeout_s)
        self.wait_running(name, timeout_s)

    def delete_connector(self, name: str) -> None:
        self.request("DELETE", "/connectors/" + urllib.parse.quote(name, safe=""))

    def connector_status(self, name: str) -> dict[str, Any] | None:
        """The worker's status of connector ``name`` (connector and tasks), None if unknown."""
        path = "/connectors/" + urllib.parse.quote(name, safe="") + "/status"
        try:
            found = self.request("GET", path, retry=False)
        except CdcError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise
        return found if isinstance(found, dict) else None

    def wait_running(self, name: str, timeout_s: float) -> None:
        """Wait until connector ``name`` and at least one task are RUNNING; a FAILED one
        raises with its trace."""
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            state = self.connector_status(name)
            if state is not None:
                units = [state.get("connector", {}), *state.get("tasks", [])]
                failed = [u for u in units if u.get("state") == "FAILED"]
                if failed:
                    trace = str(failed[0].get("trace", ""))[:2000]
                    raise CdcError(f"connector {name!r} failed on {self.url}:\n{trace}")
                if len(units) > 1 and all(u.get("state") == "RUNNING" for u in units):
                    return
            time.sleep(0.25)
        raise CdcError(
            f"connector {name!r} on {self.url} was not running within {timeout_s:.0f}s "
            f"(status: {_state(state) if state else 'unknown'}). Last lines of "
            f"{self.log_path}:\n{process.log_tail(self.log_path)}"
        )

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        retry: bool = True,
        timeout_s: float = 30.0,
    ) -> Any:
        """One REST call, its JSON answer (None when empty); answers a worker gives while it
        rejoins its group are tried again until ``timeout_s``."""
        data = None if body is None else json.dumps(body).encode()
        deadline = time.monotonic() + timeout_s
        while True:
            req = urllib.request.Request(self.url + path, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            req.add_header("Accept", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    text = resp.read().decode()
                return json.loads(text) if text.strip() else None
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:1000]
                if retry and exc.code in _RETRY_STATUSES and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                raise CdcError(
                    f"Kafka Connect {method} {path} answered HTTP {exc.code}: {detail}"
                ) from None
            except OSError as exc:
                raise CdcError(f"Kafka Connect at {self.url} did not answer: {exc}") from exc

    # ----------------------------------------------------------------- internals
    def _write_config(self) -> None:
        lines = {
            "bootstrap.servers": self.settings.kafka.bootstrap_servers,
            "group.id": GROUP_ID,
            **_INTERNAL_TOPICS,
            # -1: the broker's default replication factor (1 on the local broker).
            "config.storage.replication.factor": "-1",
            "offset.storage.replication.factor": "-1",
            "status.storage.replication.factor": "-1",
            "offset.storage.partitions": "1",
            "status.storage.partitions": "1",
            "key.converter": JSON_CONVERTER,
            "value.converter": JSON_CONVERTER,
            "offset.flush.interval.ms": "1000",
            "listeners": self.url,
            "rest.advertised.host.name": "127.0.0.1",
            "rest.advertised.port": str(self.port),
            # The plugins' ServiceLoader manifests, no classpath scan (seconds faster).
            "plugin.discovery": "service_load",
            "config.providers": "file",
            "config.providers.file.class": (
                "org.apache.kafka.common.config.provider.FileConfigProvider"
            ),
        }
        self.config_path.write_text(
            "".join(f"{k}={process.properties_escape(v)}\n" for k, v in lines.items())
        )


def _state(status: dict[str, Any]) -> str:
    """``RUNNING`` or the states that are not, e.g. ``RUNNING/task0:FAILED``."""
    connector = str(status.get("connector", {}).get("state", "?"))
    tasks = [f"task{t.get('id')}:{t.get('state')}" for t in status.get("tasks", [])]
    bad = [t for t in tasks if not t.endswith(":RUNNING")]
    return "/".join([connector, *bad]) if bad or not tasks else connector


@dataclass(frozen=True)
class PgSource:
    """A database Debezium reads: where, as whom (a role with REPLICATION that owns the
    tables, so it can create the publication)."""

    host: str
    port: int
    dbname: str
    user: str
    password: str = field(repr=False)


def debezium_postgres(
    source: PgSource,
    password_ref: str,
    *,
    topic_prefix: str,
    tables: list[str],
    slot: str,
    schemas: bool,
    snapshot_mode: str = "initial",
    avro_registry: str | None = None,
) -> dict[str, str]:
    """Debezium's Postgres connector for ``tables`` (``schema.table``) of ``source``: topics
    ``<topic_prefix>.<schema>.<table>``, the pgoutput plugin through replication slot ``slot``
    and a publication of the same name holding only ``tables`` (created by the connector),
    numeric values as decimal strings (``decimal.handling.mode=string``: exact, and readable
    without the column's scale), a tombstone after each delete, keys and values in Kafka's JSON
    converter with (``schemas``) or without the schema beside each payload. ``password_ref`` is
    :meth:`ConnectWorker.secret`'s reference to the password.

    With ``avro_registry`` (an Apicurio Registry's Confluent-compatible URL, as
    BACKFILL_SCHEMA_REGISTRY_URL names the local one), keys and values are Avro instead, through
    Apicurio's converter (:func:`avro_converter`); ``schemas`` is then not used."""
    converter = "true" if schemas else "false"
    codec = {
        "key.converter": JSON_CONVERTER,
        "key.converter.schemas.enable": converter,
        "value.converter": JSON_CONVERTER,
        "value.converter.schemas.enable": converter,
    }
    if avro_registry is not None:
        codec = {**avro_converter("key", avro_registry), **avro_converter("value", avro_registry)}
    return {
        "connector.class": POSTGRES_CONNECTOR,
        "tasks.max": "1",
        "database.hostname": source.host,
        "database.port": str(source.port),
        "database.dbname": source.dbname,
        "database.user": source.user,
        "database.password": password_ref,
        "topic.prefix": topic_prefix,
        "table.include.list": ",".join(tables),
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": slot,
        "publication.autocreate.mode": "filtered",
        "snapshot.mode": snapshot_mode,
        "decimal.handling.mode": "string",
        "tombstones.on.delete": "true",
        # The broker creates no topic on its own: Connect creates the connector's, with the
        # broker's default partitions and replication factor.
        "topic.creation.default.partitions": "-1",
        "topic.creation.default.replication.factor": "-1",
        **codec,
    }


def avro_converter(side: str, registry_url: str) -> dict[str, str]:
    """A connector's ``<side>.converter`` (``key`` or ``value``) settings for Apicurio's Avro
    converter writing Confluent's wire format: magic byte 0, a 4-byte schema id
    (``as-confluent``: Apicurio's Legacy4ByteIdHandler), the id being the content id
    (``use-id=contentId``), which is what the registry's Confluent-compatible API serves as a
    schema id (``registry.ccompat.legacy-id-mode.enabled`` is false by default), no Apicurio
    headers; each new schema registered whole (``dereference-schema``) under subject
    ``<topic>-<side>`` (TopicIdStrategy).
    ``registry_url`` is the Confluent-compatible URL (``.../apis/ccompat/v7``); the converter
    talks to the same registry's own API (:data:`APICURIO_API_PATH`)."""
    base = registry_url.rstrip("/")
    if base.endswith(CCOMPAT_PATH):
        base = base[: -len(CCOMPAT_PATH)]
    prefix = f"{side}.converter"
    return {
        prefix: AVRO_CONVERTER,
        f"{prefix}.apicurio.registry.url": base + APICURIO_API_PATH,
        f"{prefix}.apicurio.registry.auto-register": "true",
        f"{prefix}.apicurio.registry.as-confluent": "true",
        f"{prefix}.apicurio.registry.use-id": "contentId",
        f"{prefix}.apicurio.registry.headers.enabled": "false",
        # One self-contained schema per version: without it, Apicurio registers each record
        # field (Debezium's Source) as an artifact of its own that the envelope's schema
        # references by name, which a reader of one schema id (Spark's from_avro) cannot parse.
        f"{prefix}.apicurio.registry.dereference-schema": "true",
    }


class CdcSource:
    """The local CDC source: a Postgres with logical decoding on BACKFILL_CDC_POSTGRES_PORT
    (in ``postgres_root``, default ``<BACKFILL_HOME>/postgres``: the ``postgres`` user must be
    able to enter its parents) and a Kafka Connect worker (:class:`ConnectWorker`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        postgres_root: Path | None = None,
        postgres_port: int | None = None,
        connect_port: int | None = None,
        worker_classpath: Sequence[Path] = (),
    ) -> None:
        self.postgres = LocalPostgres(
            postgres_root or settings.home / "postgres",
            settings.cdc_postgres_port if postgres_port is None else postgres_port,
            LOGICAL_DECODING,
        )
        self.worker = ConnectWorker(settings, connect_port, worker_classpath)

    def start(self, timeout_s: float = 120.0) -> tuple[PgServer, WorkerStatus]:
        """Start Postgres, then the worker (each a no-op when ours runs)."""
        server = self.postgres.start()
        return server, self.worker.start(timeout_s)

    def stop(self) -> tuple[bool, bool]:
        """Stop the worker, then Postgres; whether each was running."""
        return self.worker.stop(), self.postgres.stop()

    def database(self, server: PgServer, dbname: str, role: str) -> PgSource:
        """Database ``dbname`` owned by ``role`` (LOGIN REPLICATION), created if missing; the
        role's password is kept beside the cluster (``<role>.secret``, mode 0600)."""
        secret = self.postgres.root / f"{role}.secret"
        try:
            password = secret.read_text().strip()
        except FileNotFoundError:
            password = secrets.token_urlsafe(16)
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(password + "\n")
        server.create_role_and_database(role, password, dbname, replication=True)
        return PgSource(server.host, server.port, dbname, role, password)

    def connector(
        self,
        name: str,
        source: PgSource,
        timeout_s: float = 60.0,
        overrides: Mapping[str, str] | None = None,
        **options: Any,
    ) -> dict[str, str]:
        """Register (or reconfigure) Debezium connector ``name`` reading ``source`` with
        :func:`debezium_postgres`'s ``options`` (and ``overrides`` of any of its settings, e.g.
        ``producer.override.*``); waits until it runs; its configuration."""
        ref = self.worker.secret(f"{name}.password", source.password)
        config = {**debezium_postgres(source, ref, **options), **(overrides or {})}
        self.worker.put_connector(name, config, timeout_s)
        return config
