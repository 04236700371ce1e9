"""A team adds the project to its own Dagster code location (docs/embedding.md).

``examples/team_project`` is such a team's ``dg`` project: its own asset in ``defs/``, and
``defs/lakehouse/defs.yaml`` naming the project's component with a spec beside it (a dotted
topic of the team's). The test builds the project's wheel and installs it, with the example,
into a fresh virtual environment; there it loads the combined Definitions (the team's asset
beside ours), materializes one hour of the team's topic, and runs one CLI command of that
environment against the same settings (``BACKFILL_SPEC`` names the same spec file).

The fresh environment takes the lock's third-party packages (dagster, pyspark, ...) from the
project's own ``.venv`` through a ``.pth`` line, instead of downloading 1 GB again: it holds
nothing of the project itself except the installed wheel, which the test asserts. Real broker,
Spark, catalog and Dagster.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support.wheel import build_wheel

EXAMPLE = REPO_ROOT / "examples" / "team_project"
TOPIC = "team.orders-v1"
START = datetime(2026, 5, 4, tzinfo=UTC)

PROBE = """
import json, sys
import dagster as dg
import backfill_assets
from team_project.definitions import defs

found = defs()
keys = sorted(k.to_user_string() for k in found.resolve_all_asset_keys())
wanted = {"raw/team_orders_v1", "lakehouse/team_orders_v1_current"}
assets = [
    a for a in found.assets or []
    if isinstance(a, dg.AssetsDefinition) and a.key.to_user_string() in wanted
]
with dg.instance_for_test() as instance:
    result = dg.materialize(
        assets, partition_key=sys.argv[1], instance=instance, resources=found.resources
    )
print(json.dumps({
    "package": backfill_assets.__file__,
    "keys": keys,
    "sensors": sorted(s.name for s in found.sensors or []),
    "success": result.success,
}))
"""


def _venv(tmp: Path, wheel: Path) -> Path:
    """A fresh virtual environment holding the wheel and the example (editable, as a team
    works on its own project), the lock's other packages reached through a .pth line to the
    project's .venv."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (purelib,) = (venv / "lib").glob("python3*/site-packages")
    (purelib / "zz_lock_packages.pth").write_text(site.getsitepackages()[0] + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=300)
    example = tmp / "team_project"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("__pycache__", "build"))
    subprocess.run([*pip, "-e", str(example)], check=True, timeout=300)
    return venv


@pytest.mark.slow
def test_a_team_project_embeds_the_assets_beside_its_own(
    stack_settings: Settings, tmp_path: Path
) -> None:
    generate(
        stack_settings,
        GeneratorConfig(topic=TOPIC, start=START, hours=2, partitions=1, events_per_hour=40),
    )
    wheel = build_wheel(tmp_path / "wheel", tmp_path / "src")
    venv = _venv(tmp_path, wheel)
    spec = tmp_path / "team_project" / "team_project" / "defs" / "lakehouse" / "topics.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(BACKFILL_SPEC=str(spec), PYTHONSAFEPATH="1")
    hour = START + timedelta(hours=1)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE, f"{hour:%Y-%m-%d-%H:%M}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["package"].startswith(str(venv)), found["package"]  # the wheel, not the checkout
    assert "team_report" in found["keys"]  # the team's own asset, beside ours
    assert {"raw/team_orders_v1", "lakehouse/team_orders_daily_paid"} <= set(found["keys"])
    assert "team_orders_v1_offset_gaps" in found["sensors"]
    assert found["success"]

    # The CLI of the same environment, with the same settings, sees the hour published.
    gaps = subprocess.run(
        [str(venv / "bin" / "backfill-assets"), "gaps", "--topic", TOPIC, "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert gaps.returncode in (0, 1), gaps.stderr[-3000:]
    doc = json.loads(gaps.stdout)
    missing = [(r["start"], r["end"]) for r in doc["raw_gaps"]]
    assert missing == [(START.isoformat(), hour.isoformat())], missing
