"""A class-data-sharing (CDS) archive for the local Spark driver JVM.

A fresh Spark driver spends most of its first seconds loading, verifying and linking classes
(Spark SQL, Iceberg, Parquet, Kafka). The JVM can map them from an archive instead (JDK dynamic
CDS): :func:`build` (``backfill-assets jars cds``, run by scripts/bootstrap.sh) runs a small
Spark workload (:mod:`backfill_assets.stack.cds_train`) once with
``-XX:ArchiveClassesAtExit``, and every later local driver JVM starts with
``-XX:SharedArchiveFile`` (:func:`java_options`, added by
:func:`backfill_assets.stack.spark.spark_config`). A 1-hour run starts its session and does its
first Iceberg work in about half the time (bench/README.md).

The archive is named by what it depends on (pyspark's version, the JVM, the jars), so a change
makes a new one instead of reusing a stale one; an archive the JVM cannot use is ignored
(``-Xshare:auto``), and the JVM's own warnings go to stderr, not to the stdout of a command
that prints JSON. The archive is written to a temporary name and renamed: readers see a whole
file or none. ``BACKFILL_SPARK_CDS=off`` disables it. Only the local driver JVM uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backfill_assets.errors import CdsError
from backfill_assets.stack import jars
from backfill_assets.stack.settings import Settings

# JVM logging: warnings to stderr (by default they go to stdout).
QUIET = "-Xlog:disable -Xlog:all=warning:stderr"


def archive_path(settings: Settings) -> Path:
    """Where the archive for this pyspark, JVM and jar set lives (in the jar cache)."""
    import pyspark

    java = os.environ.get("JAVA_HOME") or shutil.which("java") or "java"
    spark_jars = sorted(p.name for p in jars.jars(settings, "spark"))
    key = json.dumps([pyspark.__version__, os.path.realpath(java), spark_jars])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return settings.jar_cache / "cds" / f"spark-driver-{digest}.jsa"


def java_options(settings: Settings) -> str:
    """The driver JVM options that map the archive, or "" (disabled, not local, not built)."""
    if not settings.spark_cds or not settings.spark_master.startswith("local"):
        return ""
    path = archive_path(settings)
    if not path.is_file():
        return ""
    return f"-XX:SharedArchiveFile={path} -Xshare:auto {QUIET}"


def build(settings: Settings, timeout_s: float = 600) -> tuple[Path, bool]:
    """Build the archive unless it exists; (its path, whether it was built now)."""
    path = archive_path(settings)
    if path.is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cds-train-") as home:
        partial = path.parent / f".{path.name}.{os.getpid()}.partial"
        # The workload runs on its own throwaway local catalog, whatever this process uses.
        env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
        env.update(
            BACKFILL_HOME=home,
            BACKFILL_JAR_CACHE=str(settings.jar_cache),
            PYICEBERG_HOME=home,
            BACKFILL_SPARK_CDS="off",
        )
        began = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "backfill_assets.stack.cds_train", str(partial)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0 or not partial.is_file() or partial.stat().st_size == 0:
            partial.unlink(missing_ok=True)
            raise CdsError(
                f"building the Spark CDS archive failed after {time.monotonic() - began:.0f}s "
                f"(exit {proc.returncode}); Spark still works, it only starts slower. "
                f"Output: {(proc.stdout + proc.stderr).strip()[-1500:]}"
            )
        os.replace(partial, path)
    return path, True
