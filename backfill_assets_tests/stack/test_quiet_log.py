"""A successful materialization prints no stack trace (issue 14).

Before the fix every publish logged Iceberg's ``CATALOG_NOT_FOUND ... lakehouse`` with a Java
stack trace: ``fast_forward`` was called with ``'<namespace>.<table>'``, and Iceberg first tries
the namespace as a catalog name. The table argument now names its catalog.

A new user reads any Java or Python stack trace as a failure, so the operator's own command,
``backfill-assets materialize``, runs here as a subprocess on the session's stack (its own Spark
driver JVM, whose stderr is captured too) and its whole output is searched for traceback noise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.spec.model import SPEC_PATH
from backfill_assets.stack.settings import REPO_ROOT, Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

START = datetime(2026, 8, 1, 2, tzinfo=UTC)
# Lines that mean "something failed" to a reader: a Python traceback, a Java stack frame, an
# exception or error class with its message (``org.apache...NoSuchTableException: ...``).
NOISE = (
    re.compile(r"Traceback \(most recent call last\)"),
    re.compile(r"^\s+at \S+\(.*\)\s*$|\tat "),
    re.compile(r"Exception\b"),
    re.compile(r"\b\w+Error: "),
    re.compile(r"\b\w+Warning: "),  # a Python warning (the JVM's own "WARNING:" is not one)
    re.compile(r"CATALOG_NOT_FOUND|SCHEMA_NOT_FOUND|TABLE_OR_VIEW_NOT_FOUND"),
)


# Lines an operator does not need on the console (issue 29): Dagster's per-event debug lines
# (they are in the instance, shown by the UI), Spark's default logging banner and its start-up
# warnings (in <BACKFILL_HOME>/logs/spark-driver.log), librdkafka's retries (kafka-clients.log).
CHATTY = (
    "STEP_OUTPUT",
    "ASSET_MATERIALIZATION",
    "RESOURCE_INIT_STARTED",
    "Using Spark's default log4j profile",
    "Setting default log level",
    "NativeCodeLoader",
    "GETPID",
)


def _spec_for(topic: str, directory: Path) -> Path:
    """The shipped topics.yaml for a fresh ``topic``: its tables renamed with it, so this module
    never collides with another module's ``orders`` tables in the session's catalog."""
    doc: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text())
    entry = doc["topics"][0]
    old = entry["topic"]
    entry["topic"] = topic
    # No lateness: the declared tables cover the same single hour, so one cheap materialize
    # also runs their path (Iceberg procedures, temp views) instead of skipping them.
    entry["allowed_lateness_hours"] = 0
    (directory / "tables").mkdir()
    for table in entry.get("tables", []):
        table["name"] = topic + table["name"].removeprefix(old)
        sql = (SPEC_PATH.parent / table["sql"]).read_text()
        new_sql = re.sub(rf"\bFROM {old}\b", f"FROM {topic}", sql)
        assert new_sql != sql, f"{table['sql']} no longer reads FROM {old}"
        (directory / table["sql"]).write_text(new_sql)
    doc["topics"] = [entry]
    path = directory / "topics.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# Three Spark runs in a subprocess (~90 s): in the slow tier, which CI runs, so the default tier
# stays under its 20-minute budget.
@pytest.mark.slow
def test_successful_materialize_prints_no_stack_trace(
    stack_settings: Settings,
    stack_env: dict[str, str],
    iceberg_catalog: Catalog,
    tmp_path: Path,
) -> None:
    topic = f"quiet_{uuid.uuid4().hex[:8]}"
    generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=1, events_per_hour=40, seed=14),
    )
    home = tmp_path / "dagster-home"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        **stack_env,
        "BACKFILL_SPEC": str(_spec_for(topic, tmp_path)),
        "DAGSTER_HOME": str(home),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "backfill_assets.ops.cli",
            "materialize",
            "--topic",
            topic,
            "--start",
            "2026-08-01T02:00Z",
            "--end",
            "2026-08-01T03:00Z",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    # Raw and current tables in one run, then each declared table in its own.
    assert output.count("succeeded") == 3, output[-5000:]
    noisy = [line for line in output.splitlines() if any(p.search(line) for p in NOISE)]
    assert not noisy, "a successful run printed:\n" + "\n".join(noisy[:40])
    chatty = [line for line in output.splitlines() if any(c in line for c in CHATTY)]
    assert not chatty, "the console shows what the operator does not need:\n" + "\n".join(
        chatty[:40]
    )
    assert f"replaying {topic}" in output  # the runs' own messages are still shown
    assert (Path(stack_env["BACKFILL_HOME"]) / "logs" / "spark-driver.log").is_file()
