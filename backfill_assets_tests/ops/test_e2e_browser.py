"""End to end through the Dagster webserver, the way an operator uses the UI.

A partition-range backfill of the raw asset is launched with the webserver's GraphQL mutation
``launchPartitionBackfill`` (the one the UI's "Materialize" dialog sends; no CLI tags), the
daemon executes it, and the test checks that main of the raw Iceberg table was published by that
backfill's run, with every blocking check passed. Then headless Chromium opens the asset's
partitions page and a screenshot is kept as an artifact. Last, the gap sensor's tick (evaluated
here against the webserver's instance and stored as the daemon stores it) reports the hours with
nothing to hold, and the partition bars of ``raw/orders`` and of the declared ``orders_hourly``
say Missing only for real gaps and hours not settled yet; that screenshot of ``raw/orders`` is
also written to ``docs/ui-partitions.png``, the README's picture (commit it when it changes).

The history is recent (it ends 6 hours before now) and the spec served is the shipped one with
``partition_start`` two hours before it, so the bar is a dozen hours a reader can see, not every
hour since the shipped start.

The served spec also holds a second topic named the way real estates name Kafka topics,
``Shop.Orders-v1`` (the shipped entry without its declared tables; identifier
``shop_orders_v1``, issue 48): the same UI backfill targets its raw asset too, so a backfill
launched through the webserver is proven on such a name (asset key, run, checks, the table's
main), and its asset page shows the real Kafka name.

The webserver serves the code location of ``topics.yaml``, so the topic is the shipped
``orders`` (as in test_operator.py, which fills the same topic): this module must run in a
pytest session of its own, which ``-m browser`` (scripts/test.sh) gives it.

Needs Debian's chromium and chromium-driver (``.ci/run`` installs them for the browser tier).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
import yaml

from backfill_assets.defs.assets import build_topic_assets, raw_asset_key, table_asset_key
from backfill_assets.defs.definitions import RESOURCES, SPECS
from backfill_assets.defs.partitions import kafka_hours
from backfill_assets.defs.sensors import build_gap_sensor
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.lake.write.checks import CHECK_NAMES
from backfill_assets.ops import launch
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import SPEC_PATH, TopicSpec
from backfill_assets.stack.settings import REPO_ROOT, Settings

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.browser

SPEC = SPECS[0]
RAW = dg.AssetKey(["raw", SPEC.topic])
# The second topic: a real-world Kafka name, its identifier derived from it.
DOTTED = renamed(SPEC, topic="Shop.Orders-v1", tables=())
DOTTED_RAW = raw_asset_key(DOTTED)
# Six hours of history ending six hours before now: Kafka hours 6..11 hold nothing, and every
# event hour up to 8 has its allowed lateness (3 h) behind it.
START = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=12)
FIRST = START - timedelta(hours=2)  # the served spec's partition_start


def _key(hour: int) -> str:
    return f"{START + timedelta(hours=hour):%Y-%m-%d-%H:%M}"


RANGE = (_key(1), _key(4))  # four hourly partitions, inclusive
HOURS = [(START + timedelta(hours=h)).isoformat() for h in range(1, 5)]
DOCS_SHOT = REPO_ROOT / "docs" / "ui-partitions.png"
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


@pytest.fixture(scope="session", autouse=True)
def _served_spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The shipped spec with partition_start at FIRST, served by the webserver and daemon (and
    their runs), and no seal grace: the newest closed hour counts as sealed at once. Session
    scoped and autouse, so it is in the environment before the services start."""
    spec_dir = tmp_path_factory.mktemp("spec")
    shutil.copytree(SPEC_PATH.parent / "tables", spec_dir / "tables")
    text = SPEC_PATH.read_text()
    shipped = f'partition_start: "{SPEC.partition_start.isoformat()}"'
    assert shipped in text, shipped
    doc = yaml.safe_load(text.replace(shipped, f'partition_start: "{FIRST.isoformat()}"'))
    (entry,) = [t for t in doc["topics"] if t["topic"] == SPEC.topic]
    # The second topic as a team writes it: the real name, no `name:` (derived), no tables.
    doc["topics"].append({**entry, "topic": DOTTED.topic, "tables": []})
    path = spec_dir / "topics.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert [s.name for s in load_specs(path)] == [SPEC.name, "shop_orders_v1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BACKFILL_SPEC", str(path))
        mp.setenv("BACKFILL_SEAL_GRACE_S", "0")
        yield path


@dataclass(frozen=True)
class Backfill:
    backfill_id: str
    progress: launch.Progress
    runs: dict[str, str]  # run id -> status, as the UI's run list shows them
    truth: GroundTruth
    dotted_truth: GroundTruth  # of the DOTTED topic
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
    dotted_truth = generate(
        stack_settings,
        GeneratorConfig(
            topic=DOTTED.topic, start=START, hours=6, events_per_hour=40, partitions=2, seed=9
        ),
    )
    client = launch.DagsterClient(dagster_services)
    # Exactly what the UI sends: the assets, a partition range, no tags.
    backfill_id = launch.launch_backfill(
        client, [(RAW, *RANGE), (DOTTED_RAW, *RANGE)], tags={}, title="e2e: raw"
    )
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
    return Backfill(
        backfill_id,
        progress,
        {r["runId"]: r["status"] for r in runs},
        truth,
        dotted_truth,
        failures,
    )


def test_backfill_launched_like_the_ui_publishes_main(
    backfill: Backfill, dagster_services: str, stack_settings: Settings, iceberg_catalog: Catalog
) -> None:
    assert backfill.progress.succeeded, [backfill.progress.line(), *backfill.failures]
    assert (backfill.progress.targeted, backfill.progress.materialized) == (8, 8)
    assert backfill.runs and set(backfill.runs.values()) == {"SUCCESS"}, backfill.runs
    client = launch.DagsterClient(dagster_services)
    for spec, key, truth in (
        (SPEC, RAW, backfill.truth),
        (DOTTED, DOTTED_RAW, backfill.dotted_truth),
    ):
        run_id = _published_main(backfill, stack_settings, iceberg_catalog, spec, truth)
        # What the UI's asset page shows: 4 partitions materialized, each blocking check
        # passed in the run that published main.
        node = client.query(ASSET_STATE, {"key": {"path": list(key.path)}})["assetNodeOrError"]
        assert node["partitionStats"]["numMaterialized"] == 4, (key, node["partitionStats"])
        assert node["partitionStats"]["numFailed"] == 0
        checks = {c["name"]: c for c in node["assetChecksOrError"]["checks"]}
        assert set(checks) == set(CHECK_NAMES)
        for name, check in checks.items():
            execution = check["executionForLatestMaterialization"]
            assert check["blocking"], name
            assert execution == {"runId": run_id, "status": "SUCCEEDED"}, (key, name)


def _published_main(
    backfill: Backfill,
    stack_settings: Settings,
    iceberg_catalog: Catalog,
    spec: TopicSpec,
    truth: GroundTruth,
) -> str:
    """Check that main of ``spec``'s raw table was published by a run of the backfill, every
    check passed, with exactly the offsets of the range's hours; return that run's id."""
    table = iceberg_catalog.load_table(f"{stack_settings.catalog.namespace}.{spec.raw_table}")
    main = table.snapshot_by_name("main")
    assert main is not None and main.summary is not None
    summary: dict[str, str] = dict(main.summary.additional_properties)
    assert summary["backfill.run-id"] in backfill.runs
    assert json.loads(summary["backfill.checks"]) == dict.fromkeys(CHECK_NAMES, "passed")
    assert json.loads(summary["backfill.offsets"]) == {
        str(p): [truth.hour_offsets[p][HOURS[0]][0], truth.hour_offsets[p][HOURS[-1]][1]]
        for p in range(truth.partitions)
    }
    # Kafka was read by the real name.
    rows = table.scan(selected_fields=("topic",), limit=1).to_arrow()
    assert rows.column("topic").to_pylist() == [spec.topic]
    return summary["backfill.run-id"]


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
    keys = [_key(h) for h in range(1, 5)]
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

    # The second topic's asset page, under its identifier, names the real Kafka topic.
    browser.get(f"{dagster_services}/assets/{'/'.join(DOTTED_RAW.path)}")
    text = _wait_for(
        browser,
        lambda t: f"Kafka topic '{DOTTED.topic}'" in t,
        f"the asset {DOTTED_RAW.to_user_string()} naming the Kafka topic {DOTTED.topic!r}",
    )
    (ARTIFACTS / f"raw_{DOTTED.name}.txt").write_text(text)


def _report_empty_hours(stack_env: dict[str, str], served: Path) -> set[str]:
    """One tick of the gap sensor over the served spec, its asset events stored in the
    webserver's instance as the daemon stores them (the daemon's sensors are off in the test
    stack, and its run requests are not launched here). Returns the partitions reported."""
    specs = load_specs(served)
    spec = next(s for s in specs if s.topic == SPEC.topic)
    assets = build_topic_assets(spec, specs)
    sensor = build_gap_sensor(spec, specs)
    home = Path(stack_env["BACKFILL_HOME"]) / "dagster-home"
    with dg.DagsterInstance.from_config(str(home)) as instance:
        context = dg.build_sensor_context(
            instance=instance,
            resources=RESOURCES,
            definitions=dg.Definitions(assets=assets, sensors=[sensor], resources=RESOURCES),
        )
        data = sensor.evaluate_tick(context)
        for event in data.asset_events:
            instance.report_runless_asset_event(event)
    return {
        f"{e.asset_key.to_user_string()} {e.partition}"
        for e in data.asset_events
        if isinstance(e, dg.AssetMaterialization)
    }


def _missing(stack_env: dict[str, str], key: dg.AssetKey, now: datetime) -> set[str]:
    """The partitions of ``key`` (as of ``now``) with no materialization in the instance."""
    home = Path(stack_env["BACKFILL_HOME"]) / "dagster-home"
    with dg.DagsterInstance.from_config(str(home)) as instance:
        done = instance.get_materialized_partitions(key)
    partitions = kafka_hours(SPEC.model_copy(update={"partition_start": FIRST}))
    return set(partitions.get_partition_keys(current_time=now)) - done


def _partitions_page(
    driver: WebDriver,
    url: str,
    key: dg.AssetKey,
    missing: set[str],
    shot: Path | None = None,
    empty: str | None = None,
) -> str:
    """Open the asset's partitions page (with the known-empty partition ``empty`` selected,
    whose details must show the gap sensor's report); wait until its health shows exactly
    ``missing`` (and save a screenshot of the whole bar to ``shot``); then show only the
    missing partitions and wait until the list names each of them; return the page text."""
    from selenium.webdriver.common.by import By

    selected = f"&partition={empty}" if empty else ""
    driver.get(f"{url}/assets/{'/'.join(key.path)}?view=partitions{selected}")
    _wait_for(
        driver,
        lambda t: (
            f"Missing ({len(missing)})" in t
            and "Failed (0)" in t
            and (empty is None or "reported_by" in t)
        ),
        f"Missing ({len(missing)})" + (f" and the empty report of {empty}" if empty else ""),
    )
    if shot is not None:
        time.sleep(1)  # let the status bar finish its layout
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 20_000, "a blank page compresses to a few kB"
    driver.find_element(
        By.XPATH, "//label[starts-with(normalize-space(), 'Materialized (')]"
    ).click()
    return _wait_for(
        driver,
        lambda t: all(f"\n{k}\n" in t for k in missing),
        f"the missing partitions {sorted(missing)}",
    )


def _published_partition_shot(
    driver: WebDriver, url: str, key: dg.AssetKey, missing: set[str], partition: str, shot: Path
) -> None:
    """A screenshot of the asset's partitions page, the whole bar with exactly ``missing``
    Missing, and ``partition`` (published by a run) selected: its details name the run (the
    README's picture of a normal published hour)."""
    driver.get(f"{url}/assets/{'/'.join(key.path)}?view=partitions&partition={partition}")
    _wait_for(
        driver,
        lambda t: (
            f"Missing ({len(missing)})" in t
            and "Failed (0)" in t
            and re.search(r"\nRun\n[0-9a-f]{8}\n", t) is not None
        ),
        f"Missing ({len(missing)}) and the run that published {partition}",
    )
    time.sleep(1)  # let the status bar and the metadata table finish their layout
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000, "a blank page compresses to a few kB"


def test_partition_bar_says_missing_only_for_real_gaps(
    backfill: Backfill,
    dagster_services: str,
    stack_env: dict[str, str],
    _served_spec: Path,
    browser: WebDriver,
) -> None:
    assert backfill.progress.succeeded, [backfill.progress.line(), *backfill.failures]
    launch.DagsterClient(dagster_services).query("mutation { setNuxSeen }", {})
    now = datetime.now(UTC)
    closed = (now.replace(minute=0, second=0, microsecond=0) - START) // timedelta(hours=1)
    reported = _report_empty_hours(stack_env, _served_spec)
    assert f"{RAW.to_user_string()} {_key(-2)}" in reported, sorted(reported)[:20]

    # raw/orders: the two hours before the data (FIRST..START) and the six after it are done
    # (empty), hours 1-4 by the backfill; Kafka hours 0 and 5 hold records nobody published:
    # exactly the real gaps.
    raw_missing = _missing(stack_env, RAW, now)
    assert raw_missing == {_key(0), _key(5)}, sorted(raw_missing)
    shot = ARTIFACTS / f"raw_{SPEC.topic}_bar.png"
    _published_partition_shot(browser, dagster_services, RAW, raw_missing, _key(2), shot)
    shutil.copyfile(shot, DOCS_SHOT)
    text = _partitions_page(browser, dagster_services, RAW, raw_missing, empty=_key(-1))
    (ARTIFACTS / f"raw_{SPEC.topic}_bar.txt").write_text(text)

    # orders_hourly (event time, 3 h lateness): event hours 6..8 read only Kafka hours that are
    # empty and sealed, and no event of theirs exists: done. Every other hour is missing for a
    # reason an operator acts on or waits for: it holds events no run has built (-2..5), or it
    # reads a raw gap (Kafka hour 0 or 5: -2..0, 2..5), or its lateness is still open (the
    # newest three closed hours, 9..11 unless an hour ended while the test ran).
    hourly = table_asset_key(SPEC.tables[0].name)
    assert SPEC.tables[0].name == "orders_hourly" and SPEC.tables[0].lateness_hours == 3
    table_missing = _missing(stack_env, hourly, now)
    expected = {_key(h) for h in [*range(-2, 6), *range(closed - 3, closed)]}
    assert table_missing == expected, sorted(table_missing)
    text = _partitions_page(browser, dagster_services, hourly, table_missing)
    (ARTIFACTS / "orders_hourly_bar.txt").write_text(text)
