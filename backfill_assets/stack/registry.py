"""The local schema registry: Apicurio Registry with its Confluent-compatible API.

``backfill-assets stack up`` starts it unless ``BACKFILL_SCHEMA_REGISTRY_URL`` names another
registry. It is the Quarkus application :func:`backfill_assets.stack.jars.build_registry` builds
from Maven Central at bootstrap (``maven/schema-registry``), one JVM listening on
``127.0.0.1:<port>`` with in-memory storage (H2): its schemas live as long as the process.
Clients use the Confluent Schema Registry API under :data:`~backfill_assets.stack.settings.
CCOMPAT_PATH` (confluent-kafka's ``SchemaRegistryClient`` and serializers).

Its PID file and log live under ``<BACKFILL_HOME>/schema-registry``; ``stop`` signals only the
PID this module started (checked against the process command line).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass

from backfill_assets.errors import LocalRegistryError
from backfill_assets.stack import jars, process
from backfill_assets.stack.settings import Settings, local_registry_url


@dataclass(frozen=True)
class RegistryStatus:
    """What ``backfill-assets stack status`` reports for the schema registry."""

    pid: int | None
    running: bool
    ready: bool
    url: str
    external: bool = False
    refused: bool = False  # it answers, but refuses the credentials

    def describe(self) -> str:
        if self.external:
            state = "answering" if self.ready else "NOT answering"
            if self.refused:
                state = (
                    "refusing the credentials (BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH/"
                    "BACKFILL_SCHEMA_REGISTRY_TOKEN)"
                )
            return f"schema registry (BACKFILL_SCHEMA_REGISTRY_URL) {state} url={self.url}"
        state = "running" if self.running else "stopped"
        if self.running and not self.ready:
            state += " (not ready)"
        pid = f" pid={self.pid}" if self.pid is not None else ""
        return f"schema registry {state} url={self.url}{pid}"


class LocalRegistry(process.Server[RegistryStatus]):
    """One local Apicurio Registry on ``port`` (default: the settings' registry port)."""

    error = LocalRegistryError
    name = "the schema registry"
    start_timeout_s = 90.0

    def __init__(self, settings: Settings, port: int | None = None) -> None:
        self.settings = settings
        self.port = settings.schema_registry_port if port is None else port
        self.dir = settings.home / "schema-registry"
        self.pid_path = self.dir / "registry.pid"
        self.log_path = self.dir / "registry.log"

    @property
    def url(self) -> str:
        """The Confluent-compatible base URL clients use."""
        return local_registry_url(self.port)

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health/ready"

    def launch(self) -> subprocess.Popen[bytes] | None:
        """Build the application if needed and start the JVM without waiting; None if ours
        already runs."""
        if self.running_pid() is not None:
            return None
        jars.build_registry(self.settings)
        java = process.java(LocalRegistryError, "the schema registry")
        process.require_free_port(self.port, LocalRegistryError, "BACKFILL_SCHEMA_REGISTRY_PORT")
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            java,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dquarkus.http.port={self.port}",
            "-jar",
            str(jars.registry_jar_path(self.settings)),
        ]
        return process.launch(cmd, self.log_path, self.pid_path, cwd=self.dir)

    @property
    def where(self) -> str:
        return f"127.0.0.1:{self.port}"

    def answers(self) -> bool:
        return self.ready()

    def ready(self) -> bool:
        """Whether the registry answers its readiness check with status UP."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return bool(json.load(resp).get("status") == "UP")
        except (OSError, ValueError):
            return False

    def status(self) -> RegistryStatus:
        pid = self.running_pid()
        return RegistryStatus(
            pid=pid, running=pid is not None, ready=pid is not None and self.ready(), url=self.url
        )

    def running_pid(self) -> int | None:
        """The PID from our PID file if that process is alive and is our registry."""
        jar = str(jars.registry_jar_path(self.settings)).encode()
        port = f"-Dquarkus.http.port={self.port}".encode()
        return process.recorded_pid(self.pid_path, jar, port)


def external_status(settings: Settings) -> RegistryStatus:
    """The status of the registry ``BACKFILL_SCHEMA_REGISTRY_URL`` names (its subject list
    answers or not); ``stack`` never starts or stops it."""
    url = settings.schema_registry_url
    refused = False
    request = urllib.request.Request(url + "/subjects", headers=settings.schema_registry_headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            ready = resp.status == 200
    except urllib.error.HTTPError as exc:
        ready, refused = False, exc.code in (401, 403)
    except (OSError, urllib.error.URLError):
        ready = False
    return RegistryStatus(
        pid=None, running=ready or refused, ready=ready, url=url, external=True, refused=refused
    )
