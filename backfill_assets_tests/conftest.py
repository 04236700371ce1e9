"""Session-wide real components: one Kafka broker, one Spark session, one Iceberg catalog.

Each is started once per test session under a temporary ``BACKFILL_HOME`` with free ports, so
tests never touch a developer's running demo stack. The JVM jars come from the project's jar
cache (``scripts/bootstrap.sh`` resolves them; the fixture re-checks, which is a no-op then).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from backfill_assets.stack import jars
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.settings import REPO_ROOT, Settings

# The suite runs as on a laptop that is not on UTC (issue 11: naive datetimes were read in the
# local zone and overwrote the wrong hours). Set before any Spark JVM or Python worker starts,
# so both inherit it; BACKFILL_TEST_TZ picks another zone (CI also runs one module in Berlin).
os.environ["TZ"] = os.environ.get("BACKFILL_TEST_TZ", "America/New_York")
time.tzset()

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """BACKFILL_* variables for the test stack, also exported for code that reads os.environ
    (Dagster resources inside runs)."""
    home = tmp_path_factory.mktemp("stack")
    port = _free_port()
    controller = _free_port()
    env = {
        "BACKFILL_HOME": str(home),
        # The jar cache is shared with the developer's stack: it is read-only and keyed by pom.
        "BACKFILL_JAR_CACHE": os.environ.get(
            "BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars")
        ),
        "BACKFILL_KAFKA_PORT": str(port),
        "BACKFILL_KAFKA_CONTROLLER_PORT": str(controller),
        "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
        "PYICEBERG_HOME": str(home / "pyiceberg-home"),
        # Sensors stay off in the test daemon; tests evaluate them tick by tick.
        "BACKFILL_SENSORS": "off",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield env


@pytest.fixture(scope="session")
def stack_settings(stack_env: dict[str, str]) -> Iterator[Settings]:
    """Settings of a running, real Apache Kafka broker (KRaft) started for this session."""
    settings = Settings.from_env(stack_env)
    jars.resolve_all(settings)
    broker = LocalBroker(settings)
    broker.start()
    try:
        yield settings
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def spark_session(stack_settings: Settings) -> Iterator[SparkSession]:
    from backfill_assets.stack import spark

    session = spark.get_session(stack_settings)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def iceberg_catalog(stack_settings: Settings) -> Catalog:
    from backfill_assets.stack import catalog

    cat = catalog.load(stack_settings.catalog)
    cat.create_namespace_if_not_exists(stack_settings.catalog.namespace)
    return cat


@pytest.fixture(scope="session")
def dagster_services(stack_settings: Settings, stack_env: dict[str, str]) -> Iterator[str]:
    """A real Dagster webserver and daemon on this session's instance; yields the base URL.

    Both load workspace.yaml exactly as `dg dev` does; runs they launch are subprocesses
    that inherit the session's BACKFILL_* environment (so they reach the session's broker).
    """
    home = Path(stack_env["BACKFILL_HOME"]) / "dagster-home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    # Create the SQLite storage once, before the services: the webserver, the daemon and their
    # code servers all open it at start-up, and concurrent first-time creation can stamp
    # alembic_version twice ("more than one head present"), which fails the code location.
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)):
        pass
    port = _free_port()
    env = {**os.environ, **stack_env, "DAGSTER_HOME": str(home)}
    bin_dir = Path(sys.executable).parent
    logs = home / "services.log"
    procs = []
    with logs.open("ab") as log:
        for cmd in (
            [
                str(bin_dir / "dagster-webserver"),
                "-w",
                "workspace.yaml",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
            ],
            [str(bin_dir / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        ):
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(
                        f"Dagster services did not start; see {logs}:\n"
                        + logs.read_text(errors="replace")[-2000:]
                    ) from None
                time.sleep(1)
        yield url
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
