"""Session-wide real components: one Kafka broker, one Spark session, one Iceberg catalog.

Each is started once per test session under a temporary ``BACKFILL_HOME`` with free ports, so
tests never touch a developer's running demo stack. The JVM jars come from the project's jar
cache (``scripts/bootstrap.sh`` resolves them; the fixture re-checks, which is a no-op then).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from backfill_assets.stack import jars
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support import services

# The suite runs as on a laptop that is not on UTC (issue 11: naive datetimes were read in the
# local zone and overwrote the wrong hours). Set before any Spark JVM or Python worker starts,
# so both inherit it; BACKFILL_TEST_TZ picks another zone (CI also runs one module in Berlin).
os.environ["TZ"] = os.environ.get("BACKFILL_TEST_TZ", "America/New_York")
time.tzset()

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession


@pytest.fixture(autouse=True)
def _no_repository_dagster_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps the CLI's default Dagster home (a dagster.yaml in the current directory or the
    repository, when DAGSTER_HOME is unset) out of tests run in-process: a test that unsets
    DAGSTER_HOME means no instance, and none writes to the developer's .stack/dagster."""
    from backfill_assets.ops import cli

    monkeypatch.setattr(cli, "dagster_home_dirs", lambda: ())


@pytest.fixture
def settings_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """For tests of where settings come from: no BACKFILL_* or AWS_* variable in the
    environment (the session's stack_env sets some) and an empty working directory (no .env),
    which it returns."""
    for name in list(os.environ):
        if name.startswith(("BACKFILL_", "AWS_")):
            monkeypatch.delenv(name)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


# Which stack the session's fixtures start: "local" (one broker, classic local Spark, SQLite:
# the default tier) or "cluster" (the production-shaped stack of support/cluster_stack.py, that
# the `cluster` tier runs the named modules on, unchanged).
TEST_STACK = os.environ.get("BACKFILL_TEST_STACK", "local")
if TEST_STACK not in ("local", "cluster"):
    raise pytest.UsageError(f"BACKFILL_TEST_STACK={TEST_STACK!r}: use local or cluster")


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """BACKFILL_* variables for the test stack, also exported for code that reads os.environ
    (Dagster resources inside runs)."""
    if TEST_STACK == "cluster":
        yield from _cluster_env(tmp_path_factory)
        return
    home = tmp_path_factory.mktemp("stack")
    port = services.free_port()
    controller = services.free_port()
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


_PRODUCTION: list[Any] = []  # the running ProductionStack, on the cluster stack


@pytest.fixture(scope="session")
def production(stack_env: dict[str, str]) -> Any:
    """The running production-shaped stack (support/cluster_stack.py); cluster stack only."""
    if not _PRODUCTION:
        pytest.skip("needs BACKFILL_TEST_STACK=cluster")
    return _PRODUCTION[-1]


@pytest.fixture(scope="session")
def kafka_to_fault(stack_settings: Settings) -> object:
    """What a broker fault test stops a broker of (support/broker_fault.py): the session's
    single broker's settings, or on the cluster stack the running Kafka cluster."""
    return _PRODUCTION[-1].kafka.cluster if _PRODUCTION else stack_settings


def _cluster_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    from backfill_assets_tests.support.cluster_stack import production_stack

    home = tmp_path_factory.mktemp("cluster")
    jar_cache = os.environ.get("BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars"))
    with production_stack(home, jar_cache) as stack:
        _PRODUCTION.append(stack)
        env = {
            **stack.env,
            "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
            "BACKFILL_SENSORS": "off",
        }
        (home / "start-timings.json").write_text(json.dumps(stack.timings))
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            yield env


@pytest.fixture(scope="session")
def stack_settings(stack_env: dict[str, str]) -> Iterator[Settings]:
    """Settings of a running, real Apache Kafka broker (KRaft) started for this session (on
    the cluster stack: of the running cluster)."""
    settings = Settings.from_env(stack_env)
    if TEST_STACK == "cluster":
        yield settings
        return
    jars.resolve_all(settings)
    broker = LocalBroker(settings)
    broker.start()
    try:
        yield settings
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def registry(stack_settings: Settings) -> Iterator[LocalRegistry]:
    """One local schema registry for the session, on a free port, under the session's home;
    BACKFILL_SCHEMA_REGISTRY_URL names it (for code that reads os.environ: Dagster resources)."""
    reg = LocalRegistry(stack_settings, port=services.free_port())
    reg.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BACKFILL_SCHEMA_REGISTRY_URL", reg.url)
            yield reg
    finally:
        reg.stop()


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
    dagster_yaml = None
    if TEST_STACK == "cluster":  # Postgres storage, as production loads it
        dagster_yaml = REPO_ROOT / "infra" / "production" / "dagster.yaml"
    with services.dagster_services(home, {**os.environ, **stack_env}, dagster_yaml) as url:
        yield url


@pytest.fixture(scope="session")
def cdc_source(stack_settings: Settings) -> Iterator[Any]:
    """The CDC source the ``cdc`` tier's modules share (support/cdc_source.py): Postgres with
    logical decoding and a Kafka Connect worker, started once, stopped at the end."""
    from backfill_assets_tests.support import cdc_source as shared

    yield from shared.running(stack_settings)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``stops_shared_services`` run after every other test of the session."""
    items.sort(key=lambda item: item.get_closest_marker("stops_shared_services") is not None)
