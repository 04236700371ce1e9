"""The local Spark Connect server: a warm Spark engine that runs talk to as thin clients.

``backfill-assets stack up`` starts it after the broker: one JVM from the pip pyspark
distribution (``SparkSubmit`` with the ``SparkConnectServer`` class), listening on
``127.0.0.1:<BACKFILL_SPARK_CONNECT_PORT>``, with the same Spark settings a classic run gives
its in-process driver (:func:`backfill_assets.stack.spark.spark_config`: the Iceberg runtime,
the Kafka source, the UDF jar, the catalog). Runs reach it when ``BACKFILL_SPARK_CONNECT``
names it (:func:`backfill_assets.stack.spark.get_session`).

Its properties file (catalog secrets: mode 0600), PID file and output live under
``<BACKFILL_HOME>/connect``; log4j writes warnings to ``<BACKFILL_HOME>/logs/spark-connect.log``.
``stop`` signals only the PID this module started (checked against the process command line).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from backfill_assets.errors import ConnectError
from backfill_assets.stack import process, spark
from backfill_assets.stack.settings import Settings

MAIN_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# What Spark's launcher gives every JVM on Java 17+ (printed by SPARK_PRINT_LAUNCH_COMMAND=1
# spark-submit); bin/spark-submit is not used, so the server keeps one PID (ours).
JAVA_MODULE_OPTIONS = (
    "-XX:+IgnoreUnrecognizedVMOptions",
    "--add-modules=jdk.incubator.vector",
    *(
        f"--add-opens=java.base/{pkg}=ALL-UNNAMED"
        for pkg in (
            "java.lang",
            "java.lang.invoke",
            "java.lang.reflect",
            "java.io",
            "java.net",
            "java.nio",
            "java.util",
            "java.util.concurrent",
            "java.util.concurrent.atomic",
            "jdk.internal.ref",
            "sun.nio.ch",
            "sun.nio.cs",
            "sun.security.action",
            "sun.util.calendar",
        )
    ),
    "--add-opens=java.security.jgss/sun.security.krb5=ALL-UNNAMED",
    "-Djdk.reflect.useDirectMethodHandle=false",
    "-Dio.netty.tryReflectionSetAccessible=true",
    "-Dio.netty.allocator.type=pooled",
    "-Dio.netty.handler.ssl.defaultEndpointVerificationAlgorithm=NONE",
    "--enable-native-access=ALL-UNNAMED",
)
# Settings of spark_config() that mean nothing to a server started with plain java: the heap
# is -Xmx/-Xms in the argv, the driver's JVM options are the argv itself, and the client's own
# interpreter is the client's business.
_CLIENT_ONLY = (
    "spark.driver.memory",
    "spark.driver.extraJavaOptions",
    "spark.pyspark.driver.python",
)


@dataclass(frozen=True)
class ConnectStatus:
    """What ``backfill-assets stack status`` reports for the Spark Connect server."""

    pid: int | None
    running: bool
    responding: bool
    url: str
    version: str | None = None
    log: str = ""

    def describe(self) -> str:
        state = "running" if self.running else "stopped"
        if self.running and not self.responding:
            state += " (not answering Spark Connect requests)"
        parts = [f"spark connect {state}", f"url={self.url}"]
        if self.pid is not None:
            parts.append(f"pid={self.pid}")
        if self.version:
            parts.append(f"spark={self.version}")
        parts.append(f"log={self.log}")
        return " ".join(parts)


# The variable the Spark Connect server reads its pre-shared token from (spark.connect.
# authenticate.token's environment form): clients must send it as a bearer header.
TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"


class LocalConnectServer(process.Server[ConnectStatus]):
    """A Spark Connect server on 127.0.0.1 whose state lives in ``<home>/connect``."""

    error = ConnectError
    name = "the Spark Connect server"
    start_timeout_s = 180.0
    poll_s = 0.5

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = settings.home / "connect"
        self.conf_path = self.dir / "spark-connect.conf"
        self.pid_path = self.dir / "spark-connect.pid"
        self.out_path = self.dir / "spark-connect.out"
        self.log_path = settings.home / "logs" / "spark-connect.log"

    @property
    def port(self) -> int:
        return self.settings.spark_connect_port

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- configuration
    def properties(self) -> dict[str, str]:
        """The server's Spark settings (secrets included: never log them)."""
        conf = {k: v for k, v in spark.spark_config(self.settings).items() if k not in _CLIENT_ONLY}
        conf["spark.app.name"] = "backfill_assets Spark Connect server"
        conf["spark.connect.grpc.binding.address"] = self.settings.spark_connect_bind
        conf["spark.connect.grpc.binding.port"] = str(self.port)
        return conf

    def argv(self) -> list[str]:
        heap = self.settings.spark_driver_memory
        return [
            process.java(ConnectError, "the local Spark Connect server"),
            f"-Xmx{heap}",
            f"-Xms{heap}",
            spark.JIT_OPTIONS,
            *JAVA_MODULE_OPTIONS,
            f"-Dlog4j2.configurationFile={spark.LOG4J_CONFIG}",
            f"-Dbackfill.log.dir={self.log_path.parent}",
            "-Dbackfill.log.name=spark-connect",
            "-cp",
            str(spark_home() / "jars" / "*"),
            "org.apache.spark.deploy.SparkSubmit",
            "--properties-file",
            str(self.conf_path),
            "--class",
            MAIN_CLASS,
            "--name",
            "backfill_assets Spark Connect server",
            "spark-internal",
        ]

    def env(self) -> dict[str, str]:
        """The server's environment. The pre-shared token travels here (Spark reads
        ``SPARK_CONNECT_AUTHENTICATE_TOKEN``), never in its command line or properties file.

        Bound to loopback (the default), the server's driver is on 127.0.0.1 too; bound to
        another address (a pod's, or 0.0.0.0), the driver binds and advertises the host's own
        address (Spark's default: its resolved host name), which executors on other hosts reach."""
        env = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            # The Python of UDFs (mapInPandas, pandera) is the server's PYSPARK_PYTHON, not a
            # client's: spark.pyspark.python in the properties alone is not enough.
            "PYSPARK_PYTHON": sys.executable,
        }
        if self.settings.spark_connect_bind.startswith("127."):
            env["SPARK_LOCAL_IP"] = "127.0.0.1"
        else:
            env.pop("SPARK_LOCAL_IP", None)
        env.pop(TOKEN_ENV, None)
        if self.settings.spark_connect_token:
            env[TOKEN_ENV] = self.settings.spark_connect_token
        return env

    def _write_properties(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        text = process.properties_text(self.properties())
        # Holds the catalog's secrets: created 0600, never readable by others in between.
        self.conf_path.unlink(missing_ok=True)
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)

    # ----------------------------------------------------------------- lifecycle
    def launch(self) -> subprocess.Popen[bytes] | None:
        """Start the server without waiting; None if ours already runs."""
        if self.running_pid() is not None:
            return None
        process.require_free_port(self.port, ConnectError, "BACKFILL_SPARK_CONNECT_PORT")
        self._write_properties()
        return process.launch(
            self.argv(), self.out_path, self.pid_path, cwd=self.dir, env=self.env()
        )

    def status(self, timeout_s: float = 10.0) -> ConnectStatus:
        pid = self.running_pid()
        version = (
            spark.probe(self.url, timeout_s, self.settings.spark_connect_token)
            if pid is not None
            else None
        )
        return ConnectStatus(
            pid=pid,
            running=pid is not None,
            responding=version is not None,
            url=self.url,
            version=version,
            log=str(self.log_path),
        )

    @property
    def where(self) -> str:
        return self.url

    def answers(self) -> bool:
        """Whether a client session works."""
        return (
            spark.port_open("127.0.0.1", self.port, 1.0)
            and spark.probe(self.url, 10.0, self.settings.spark_connect_token) is not None
        )

    def log_tail(self, lines: int = 15) -> str:
        found = []
        for path in (self.out_path, self.log_path):
            try:
                text = path.read_text(errors="replace").splitlines()
            except FileNotFoundError:
                continue
            found.append(f"[{path}]\n" + "\n".join(text[-lines:]))
        return "\n".join(found) or "(no output written)"

    def running_pid(self) -> int | None:
        """The PID from our PID file if that process is alive and is our server."""
        return process.recorded_pid(
            self.pid_path, MAIN_CLASS.encode(), str(self.conf_path).encode()
        )


def spark_home() -> Path:
    """The pip pyspark distribution (jars/, bin/)."""
    found = importlib.util.find_spec("pyspark")
    if found is None or found.origin is None:
        raise ConnectError("pyspark is not installed in this environment")
    return Path(found.origin).parent
