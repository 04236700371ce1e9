"""End to end through the Dagster webserver, the way an operator uses the UI.

A partition-range backfill of the raw asset is launched with the webserver's GraphQL mutation
``launchPartitionBackfill`` (the one the UI's "Materialize" dialog sends; no CLI tags), the
daemon executes it, and the test checks that main of the raw Iceberg table was published by that
backfill's run, with every blocking check passed. Then headless Chromium opens the asset's
partitions page and a screenshot is kept as an artifact.

The webserver serves the code location of ``topics.yaml``, so the topic is the shipped
``orders`` (as in test_operator.py, which fills the same topic): this module must run in a
pytest session of its own, which ``-m browser`` (scripts/test.sh) gives it.

Needs Debian's chromium and chromium-driver (``.ci/run`` installs them for the browser tier).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest

from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.lake.checks import CHECK_NAMES
from backfill_assets.ops import launch
from backfill_assets.stack.settings import REPO_ROOT, Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.browser

SPEC = SPECS[0]
RAW = dg.AssetKey(["raw", SPEC.topic])
START = datetime(2026, 6, 1, tzinfo=UTC)
RANGE = ("2026-06-01-01:00", "2026-06-01-04:00")  # four hourly partitions, inclusive
HOURS = [datetime(2026, 6, 1, h, tzinfo=UTC).isoformat() for h in range(1, 5)]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = REPO_ROOT / ".stack" / "artifacts" / "e2e"
APT_HINT = "apt-get install -y --no-install-recommends chromium chromium-driver"

ASSET_STATE = """
query Asset($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode {
      partitionStats { numMaterialized numPartitions numFailed numMaterializing }
      assetChecksOrError {
        __typename
        ... on AssetChecks {
          checks { name blocking executionForLatestMaterialization { runId status } }
        }
      }
    }
  }
}
"""

RUN_FAILURES = """
query Failures($runId: ID!) {
  logsForRun(runId: $runId) {
    ... on EventConnection {
      events {
        __typename
        ... on ExecutionStepFailureEvent { stepKey error { message } }
        ... on EngineEvent { message error { message } }
      }
    }
  }
}
"""


@pytest.fixture(scope="module", autouse=True)
def _browser_installed() -> None:
    """Fail at once, before the backfill, when the tier cannot run: never skip silently."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"the browser tier needs {', '.join(missing)}; install them with: {APT_HINT}")
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.fail("the browser tier needs selenium: .venv/bin/pip install -e '.[dev]'")


@dataclass(frozen=True)
class Backfill:
    backfill_id: str
    progress: launch.Progress
    runs: dict[str, str]  # run id -> status, as the UI's run list shows them
    truth: GroundTruth
    failures: list[str]  # the errors the UI's run pages show, for the assertion messages


@pytest.fixture(scope="module")
def backfill(
    request: pytest.FixtureRequest, stack_settings: Settings, dagster_services: str
) -> Backfill:
    others = [i.nodeid for i in request.session.items if "test_operator.py" in i.nodeid]
    if others:
        pytest.fail(
            f"test_operator.py also fills the shipped {SPEC.topic!r} topic in this session; run "
            "the browser tier on its own: pytest -m browser (as scripts/test.sh does)"
        )
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=SPEC.topic, start=START, hours=6, events_per_hour=100, seed=5),
    )
    client = launch.DagsterClient(dagster_services)
    # Exactly what the UI sends: the asset, a partition range, no tags.
    backfill_id = launch.launch_backfill(client, [(RAW, *RANGE)], tags={}, title="e2e: raw")
    progress = launch.wait(client, backfill_id, poll_s=2.0, timeout_s=600)
    runs = client.query(launch.RUN_METADATA, {"id": backfill_id})["runsOrError"]["results"]
    failures = [
        f"run {r['runId']}: {event.get('stepKey') or event.get('message')}: "
        + event["error"]["message"][:1500]
        for r in runs
        if r["status"] != "SUCCESS"
        for event in client.query(RUN_FAILURES, {"runId": r["runId"]})["logsForRun"]["events"]
        if event.get("error")
    ]
    return Backfill(backfill_id, progress, {r["runId"]: r["status"] for r in runs}, truth, failures)


def test_backfill_launched_like_the_ui_publishes_main(
    backfill: Backfill, dagster_services: str, stack_settings: Settings, iceberg_catalog: Catalog
) -> None:
    assert backfill.progress.succeeded, [backfill.progress.line(), *backfill.failures]
    assert (backfill.progress.targeted, backfill.progress.materialized) == (4, 4)
    assert backfill.runs and set(backfill.runs.values()) == {"SUCCESS"}, backfill.runs

    table = iceberg_catalog.load_table(f"{stack_settings.catalog.namespace}.{SPEC.raw_table}")
    main = table.snapshot_by_name("main")
    assert main is not None and main.summary is not None
    summary: dict[str, str] = dict(main.summary.additional_properties)
    assert summary["backfill.run-id"] in backfill.runs
    assert json.loads(summary["backfill.checks"]) == dict.fromkeys(CHECK_NAMES, "passed")
    assert json.loads(summary["backfill.offsets"]) == {
        str(p): [
            backfill.truth.hour_offsets[p][HOURS[0]][0],
            backfill.truth.hour_offsets[p][HOURS[-1]][1],
        ]
        for p in range(6)
    }

    # What the UI's asset page shows: 4 partitions materialized, each blocking check passed
    # in the run that published main.
    node = launch.DagsterClient(dagster_services).query(
        ASSET_STATE, {"key": {"path": list(RAW.path)}}
    )["assetNodeOrError"]
    assert node["partitionStats"]["numMaterialized"] == 4, node["partitionStats"]
    assert node["partitionStats"]["numFailed"] == 0
    checks = {c["name"]: c for c in node["assetChecksOrError"]["checks"]}
    assert set(checks) == set(CHECK_NAMES)
    for name, check in checks.items():
        execution = check["executionForLatestMaterialization"]
        assert check["blocking"], name
        assert execution == {"runId": summary["backfill.run-id"], "status": "SUCCEEDED"}, name


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--window-size=1600,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def _wait_for(driver: WebDriver, predicate: Callable[[str], bool], what: str) -> str:
    """Poll the page's visible text until ``predicate`` holds; return that text."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + 120
    while True:
        text = str(driver.find_element(By.TAG_NAME, "body").text)
        if predicate(text):
            return text
        if time.monotonic() > deadline:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / "timeout.html").write_text(driver.page_source)
            driver.save_screenshot(str(ARTIFACTS / "timeout.png"))
            pytest.fail(
                f"the Dagster UI did not show {what} within 120s; page saved to {ARTIFACTS}; "
                f"visible text: {text[:1500]!r}"
            )
        time.sleep(0.5)


def test_ui_shows_the_materialized_partitions(
    backfill: Backfill, dagster_services: str, browser: WebDriver
) -> None:
    from selenium.webdriver.common.by import By

    assert backfill.progress.succeeded, [backfill.progress.line(), *backfill.failures]
    # The first visit opens a "Join the Dagster community" dialog over the page; its Skip
    # button sends this mutation, so the dialog stays closed.
    launch.DagsterClient(dagster_services).query("mutation { setNuxSeen }", {})
    keys = [f"2026-06-01-{h:02d}:00" for h in range(1, 5)]
    browser.get(
        f"{dagster_services}/assets/{'/'.join(RAW.path)}?view=partitions&partition={keys[-1]}"
    )
    _wait_for(browser, lambda t: "Materialized (4)" in t, "the partition health")
    # Show only the materialized partitions: untick "Missing", as an operator would.
    browser.find_element(By.XPATH, "//label[starts-with(normalize-space(), 'Missing (')]").click()
    text = _wait_for(
        browser,
        lambda t: (
            "4 Partitions Selected" in t and re.search(r"\nRun\n[0-9a-f]{8}\n", t) is not None
        ),
        "the four materialized partitions and the selected one's run",
    )
    time.sleep(1)  # let the status bar and the metadata table finish their layout
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"raw_{SPEC.topic}_partitions.png"
    shot.unlink(missing_ok=True)
    assert browser.save_screenshot(str(shot))
    (ARTIFACTS / f"raw_{SPEC.topic}_partitions.txt").write_text(text)

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000, "a blank page compresses to a few kB"
    assert "Failed (0)" in text and "Materialized (4)" in text
    assert all(f"\n{k}\n" in text for k in keys), text
    run = re.search(r"\nRun\n([0-9a-f]{8})\n", text)
    assert run is not None and run[1] in {r[:8] for r in backfill.runs}, text
