"""A wheel of the project works outside the checkout: its data files travel with it.

The wheel is built from a copy of this checkout (pip, with build isolation: setuptools comes
from PyPI)
and unpacked into a temporary directory; a child process imports it from there, with the
checkout neither on its path nor its working directory, and with its own HOME.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backfill_assets_tests.support.wheel import build_wheel

PROBE = """
import json, sys
from backfill_assets.spec.loader import load_specs
from backfill_assets.stack import broker, jars
from backfill_assets.stack.settings import Settings
specs = load_specs()
print(json.dumps({
    "package": __import__("backfill_assets").__file__,
    "topics": [s.topic for s in specs],
    "tables": [t.name for s in specs for t in s.tables],
    "poms": [str(jars.pom_path(j)) for j in ("spark", "kafka-broker")],
    "poms_exist": all(jars.pom_path(j).is_file() for j in ("spark", "kafka-broker")),
    "maven_settings": (jars.MAVEN_DIR / "settings.xml").is_file(),
    "broker_logging": broker._LOG4J_CONFIG.is_file(),
    "home": str(Settings.from_env().home),
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src"))


def test_wheel_holds_the_package_and_its_data_but_not_the_tests(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "backfill_assets/spec/topics.yaml",
        "backfill_assets/spec/tables/orders_hourly.sql",
        "backfill_assets/stack/maven/settings.xml",
        "backfill_assets/stack/maven/spark/pom.xml",
        "backfill_assets/stack/maven/kafka-broker/pom.xml",
        "backfill_assets/stack/broker-log4j2.properties",
        "backfill_assets/stack/java/backfill_assets/udf/StrictJson.java",
    ):
        assert data in names, f"{data} is missing from {wheel.name}"
    assert not [n for n in names if n.startswith("backfill_assets_tests/")]


def test_wheel_install_loads_spec_and_jar_sets_outside_the_checkout(
    wheel: Path, tmp_path: Path
) -> None:
    target, home = tmp_path / "site", tmp_path / "home"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)  # what `pip install --target` lays down for a pure wheel
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BACKFILL_", "PYTHON"))}
    env.update(PYTHONPATH=str(target), HOME=str(home), PYTHONSAFEPATH="1")
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["package"].startswith(str(target)), found["package"]
    assert found["topics"] == ["orders"]
    assert set(found["tables"]) == {"orders_hourly", "orders_large_paid"}
    assert found["poms_exist"] and found["maven_settings"] and found["broker_logging"]
    assert all(p.startswith(str(target)) for p in found["poms"])
    assert found["home"] == str(home / ".backfill_assets")
