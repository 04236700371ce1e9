"""The Spark driver's class-data-sharing archive: used only when built, enabled and local, put
ahead of the settings' own driver options, and really mapped by a fresh driver JVM."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backfill_assets.stack import cds, spark
from backfill_assets.stack.settings import REPO_ROOT, Settings


@pytest.fixture
def settings(stack_env: dict[str, str]) -> Settings:
    return Settings.from_env(stack_env)


def test_options_only_for_a_built_enabled_local_archive(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "spark-driver-x.jsa"
    monkeypatch.setattr(cds, "archive_path", lambda _settings: archive)
    assert cds.java_options(settings) == ""  # not built
    archive.write_bytes(b"archive")
    assert cds.java_options(settings).startswith(f"-XX:SharedArchiveFile={archive} -Xshare:auto")
    assert "-Xlog:all=warning:stderr" in cds.java_options(settings)
    assert cds.java_options(dataclasses.replace(settings, spark_cds=False)) == ""
    cluster = dataclasses.replace(settings, spark_master="spark://10.0.0.5:7077")
    assert cds.java_options(cluster) == ""
    # A cluster's driver gets no archive, only the JIT option every JVM gets.
    assert spark.spark_config(cluster)["spark.driver.extraJavaOptions"] == spark.JIT_OPTIONS


def test_the_archive_goes_ahead_of_the_settings_own_driver_options(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "spark-driver-x.jsa"
    archive.write_bytes(b"archive")
    monkeypatch.setattr(cds, "archive_path", lambda _settings: archive)
    own = dataclasses.replace(
        settings, spark_extra_conf={"spark.driver.extraJavaOptions": "-Dmine=1"}
    )
    options = spark.spark_config(own)["spark.driver.extraJavaOptions"]
    heap = f"-Xms{settings.spark_driver_memory}"
    logs = spark.log_options(settings)  # the driver's log4j config, ahead of the archive
    assert options == f"{logs} {cds.java_options(settings)} {heap} {spark.JIT_OPTIONS} -Dmine=1"


def test_the_archive_is_named_by_what_it_depends_on(settings: Settings) -> None:
    path = cds.archive_path(settings)
    assert path.parent == settings.jar_cache / "cds"
    assert path == cds.archive_path(settings)
    other = dataclasses.replace(settings, jar_cache=settings.jar_cache / "elsewhere")
    with pytest.raises(Exception, match="jars resolve"):
        cds.archive_path(other)  # no jars there: nothing to key an archive on


def test_a_fresh_driver_maps_spark_classes_from_the_archive(
    settings: Settings, tmp_path: Path
) -> None:
    path, _ = cds.build(settings)  # scripts/bootstrap.sh built it already: a no-op then
    assert path.is_file() and path.stat().st_size > 10_000_000
    log = tmp_path / "class-load.log"
    script = (
        "from backfill_assets.stack import spark; "
        "from backfill_assets.stack.settings import Settings; "
        "s = spark.get_session(Settings.from_env()); s.range(3).count(); s.stop()"
    )
    env = {
        **os.environ,
        "BACKFILL_HOME": str(tmp_path),
        "PYICEBERG_HOME": str(tmp_path),
        "BACKFILL_JAR_CACHE": str(settings.jar_cache),
        "BACKFILL_SPARK_CONF": json.dumps(
            {"spark.driver.extraJavaOptions": f"-Xlog:class+load=info:file={log}"}
        ),
    }
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[cds]" not in out.stdout, "JVM warnings belong on stderr"
    loaded = log.read_text()
    assert "org.apache.spark.SparkContext source: shared objects file (top)" in loaded
    shared = loaded.count("source: shared objects file (top)")
    assert shared > 5_000, f"only {shared} classes came from the archive"


def test_the_session_jvm_compiles_huge_generated_methods(spark_session: object) -> None:
    """The parse's generated code is over HotSpot's 8,000-byte limit: without the option the
    JVM would interpret it (see spark.JIT_OPTIONS)."""
    from pyspark.sql import SparkSession

    assert isinstance(spark_session, SparkSession)
    jvm = spark_session.sparkContext._jvm
    assert jvm is not None
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert spark.JIT_OPTIONS in args


def test_the_local_session_jvm_sizes_its_heap_up_front(spark_session: object) -> None:
    """Its resident memory then does not grow with the window (see spark.local_heap_option):
    the heap committed at start is the configured maximum."""
    from pyspark.sql import SparkSession

    assert isinstance(spark_session, SparkSession)
    jvm = spark_session.sparkContext._jvm
    assert jvm is not None
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert f"-Xms{spark_session.conf.get('spark.driver.memory')}" in args
    heap = jvm.java.lang.management.ManagementFactory.getMemoryMXBean().getHeapMemoryUsage()
    assert heap.getCommitted() >= 0.9 * heap.getMax(), (heap.getCommitted(), heap.getMax())
