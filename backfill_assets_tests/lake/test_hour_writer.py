"""A month of hours in one Spark task fits a small driver: the hour-partitioned tables' writes
sort each task's rows by hour (one open data file at a time) instead of keeping a Parquet
writer open per hour (Iceberg's fanout writer, which ran a 2 GB driver out of heap at 672
hours, and a 512 MB one at 720 in this test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_month_of_hours_in_one_task_fits_a_small_driver(
    stack_env: dict[str, str], tmp_path: Path
) -> None:
    # The session's own settings (a cluster stack's Connect server, catalog) stay out: the
    # month is written by a local driver of its own, into a catalog of its own.
    inherited = {
        k: v for k, v in os.environ.items() if not k.startswith(("BACKFILL_", "PYICEBERG_"))
    }
    env = {
        **inherited,
        "BACKFILL_HOME": str(tmp_path),
        "BACKFILL_SPARK_MASTER": "local[2]",
        "PYICEBERG_HOME": str(tmp_path / "pyiceberg-home"),
        "BACKFILL_JAR_CACHE": stack_env["BACKFILL_JAR_CACHE"],
        "BACKFILL_SPARK_DRIVER_MEMORY": "512m",
        "PYTHONPATH": str(REPO_ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "backfill_assets_tests.support.month_write", "720"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"the month's write failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert written == {
        "files": 720,
        "rows": 720 * 3,
        "driver": {"master": "local[2]", "memory": "512m"},
    }
