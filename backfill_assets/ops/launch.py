"""Launch and follow Dagster partition backfills and runs through the webserver's GraphQL API.

This is the same API the Dagster UI uses. A range of partitions becomes a backfill object:
listed under Overview -> Backfills, executed by the backfill daemon with the assets' BackfillPolicy
and the run queue limits of dagster.yaml, cancellable from the UI. A single partition becomes one
run, as the UI's Materialize does when one partition is selected: it goes straight to the run
queue and does not wait for the backfill daemon's next pass (up to 30 s, fixed in Dagster 1.13).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from backfill_assets.errors import LaunchError, WebserverUnavailable

LAUNCH = """
mutation Launch($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
    ... on PartitionKeysNotFoundError { message }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
    ... on RunConflict { message }
  }
}
"""

STATUS = """
query Status($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill {
      id
      status
      assetBackfillData {
        assetBackfillStatuses {
          __typename
          ... on AssetPartitionsStatusCounts {
            assetKey { path }
            numPartitionsTargeted
            numPartitionsInProgress
            numPartitionsMaterialized
            numPartitionsFailed
          }
        }
      }
    }
    ... on PythonError { message }
    ... on BackfillNotFoundError { message }
  }
}
"""

RUN_METADATA = """
query Runs($id: String!) {
  runsOrError(filter: {tags: [{key: "dagster/backfill", value: $id}]}) {
    ... on Runs {
      results {
        runId
        status
        assetMaterializations {
          assetKey { path }
          metadataEntries {
            label
            ... on IntMetadataEntry { intValue }
            ... on FloatMetadataEntry { floatValue }
          }
        }
      }
    }
  }
}
"""

ASSET_JOB = """
query AssetJob($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename
    ... on AssetNode { jobNames repository { name location { name } } }
    ... on AssetNotFoundError { message }
  }
}
"""

LAUNCH_RUN = """
mutation LaunchRun($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on InvalidSubsetError { message }
    ... on PipelineNotFoundError { message }
    ... on RunConflict { message }
    ... on UnauthorizedError { message }
    ... on ConflictingExecutionParamsError { message }
    ... on PresetNotFoundError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}
"""

RUN_STATUS = """
query RunStatus($id: ID!) {
  runOrError(runId: $id) {
    __typename
    ... on Run {
      runId
      status
      assetMaterializations {
        assetKey { path }
        metadataEntries { label ... on IntMetadataEntry { intValue } }
      }
    }
    ... on RunNotFoundError { message }
    ... on PythonError { message }
  }
}
"""

# Backfill statuses, then run statuses.
TERMINAL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"} | {
    "SUCCESS",
    "FAILURE",
}
SUCCESS = {"COMPLETED", "COMPLETED_SUCCESS", "SUCCESS"}
# Tag of the runs launched by :func:`launch_run`; dagster.yaml caps them like backfill runs.
SINGLE_RUN_TAG = "backfill_assets/single_partition"


@dataclass
class Progress:
    id: str  # the backfill id, or the run id of a single-partition run
    status: str
    targeted: int
    materialized: int
    failed: int
    in_progress: int
    records: int
    elapsed_s: float

    @property
    def done(self) -> int:
        return self.materialized + self.failed

    @property
    def rate(self) -> float:
        return self.records / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.done == 0 or self.done >= self.targeted:
            return None
        return self.elapsed_s / self.done * (self.targeted - self.done)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    @property
    def succeeded(self) -> bool:
        return self.status in SUCCESS and self.failed == 0

    def line(self, width: int = 30) -> str:
        frac = self.done / self.targeted if self.targeted else 0.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        eta = f"ETA {self.eta_s:,.0f}s" if self.eta_s is not None else "ETA -"
        return (
            f"[{bar}] {self.done}/{self.targeted} asset partitions ({self.failed} failed) "
            f"{self.records:,} records {self.rate:,.0f} rec/s {eta} {self.status}"
        )


class DagsterClient:
    """A minimal GraphQL client for the Dagster webserver."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/") + "/graphql"
        self.timeout_s = timeout_s

    def query(self, document: str, variables: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps({"query": document, "variables": variables}).encode()
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                payload: dict[str, Any] = json.loads(resp.read())
        except (urllib.error.URLError, TimeoutError) as exc:
            raise WebserverUnavailable(
                f"cannot reach the Dagster webserver at {self.url} ({exc}); start it with "
                "`bash scripts/demo.sh` or `.venv/bin/dg dev -w workspace.yaml`, or set "
                "BACKFILL_WEBSERVER_HOST / BACKFILL_WEBSERVER_PORT"
            ) from exc
        if payload.get("errors"):
            raise LaunchError(f"GraphQL error from {self.url}: {payload['errors'][0]['message']}")
        data: dict[str, Any] = payload["data"]
        return data


def launch_backfill(
    client: DagsterClient,
    ranges: Sequence[tuple[dg.AssetKey, str, str]],
    tags: dict[str, str],
    title: str,
) -> str:
    """Launch one asset backfill; ``ranges`` gives each asset its first and last partition.

    Dagster executes the assets of one backfill in dependency order, so a derived asset waits
    for the raw partitions it reads.
    """
    params = {
        "partitionsByAssets": [
            {
                "assetKey": {"path": list(key.path)},
                "partitions": {"range": {"start": first, "end": last}},
            }
            for key, first, last in ranges
        ],
        "tags": [{"key": k, "value": v} for k, v in sorted(tags.items())],
        "title": title,
    }
    result = client.query(LAUNCH, {"params": params})["launchPartitionBackfill"]
    if result["__typename"] != "LaunchBackfillSuccess":
        raise LaunchError(
            f"the webserver refused the backfill ({result['__typename']}): "
            f"{result.get('message', '').strip()[:500]}"
        )
    return str(result["backfillId"])


def progress(client: DagsterClient, backfill_id: str, started: float) -> Progress:
    data = client.query(STATUS, {"id": backfill_id})["partitionBackfillOrError"]
    if data["__typename"] != "PartitionBackfill":
        raise LaunchError(f"backfill {backfill_id}: {data.get('message', data['__typename'])}")
    statuses = [
        s
        for s in (data.get("assetBackfillData") or {}).get("assetBackfillStatuses", [])
        if s["__typename"] == "AssetPartitionsStatusCounts"
    ]
    return Progress(
        id=backfill_id,
        status=data["status"],
        targeted=sum(s["numPartitionsTargeted"] for s in statuses),
        materialized=sum(s["numPartitionsMaterialized"] for s in statuses),
        failed=sum(s["numPartitionsFailed"] for s in statuses),
        in_progress=sum(s["numPartitionsInProgress"] for s in statuses),
        records=_records_read(client, backfill_id),
        elapsed_s=time.monotonic() - started,
    )


def wait(
    client: DagsterClient,
    backfill_id: str,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> Progress:
    """Poll until the backfill ends (or ``timeout_s`` passes); return the last progress."""
    return _poll(
        lambda started: progress(client, backfill_id, started),
        f"backfill {backfill_id}",
        "Overview -> Backfills",
        poll_s=poll_s,
        timeout_s=timeout_s,
        on_progress=on_progress,
    )


def single_partition(ranges: Sequence[tuple[dg.AssetKey, str, str]]) -> str | None:
    """The partition key when every asset of ``ranges`` covers the same one partition."""
    bounds = {(first, last) for _, first, last in ranges}
    if len(bounds) == 1:
        first, last = bounds.pop()
        if first == last:
            return first
    return None


def launch_run(
    client: DagsterClient,
    keys: Sequence[dg.AssetKey],
    partition: str,
    tags: dict[str, str],
    title: str,
) -> str:
    """Launch one run of ``keys`` (with their blocking checks) for one partition, as the UI's
    Materialize does; return its run id. The run goes to the run queue at once."""
    if not keys:
        raise LaunchError("launch_run needs at least one asset key")
    node = client.query(ASSET_JOB, {"key": {"path": list(keys[0].path)}})["assetNodeOrError"]
    if node["__typename"] != "AssetNode":
        raise LaunchError(
            f"the webserver does not know asset {keys[0].to_user_string()}: "
            f"{node.get('message', node['__typename'])}"
        )
    jobs = [name for name in node["jobNames"] if name.startswith("__ASSET_JOB")]
    if not jobs:
        raise LaunchError(
            f"asset {keys[0].to_user_string()} is in no implicit asset job ({node['jobNames']})"
        )
    run_tags = {**tags, "dagster/partition": partition, SINGLE_RUN_TAG: title}
    params = {
        "selector": {
            "repositoryLocationName": node["repository"]["location"]["name"],
            "repositoryName": node["repository"]["name"],
            "pipelineName": jobs[0],
            "assetSelection": [{"path": list(key.path)} for key in keys],
        },
        "mode": "default",
        "executionMetadata": {
            "tags": [{"key": k, "value": v} for k, v in sorted(run_tags.items())]
        },
    }
    result = client.query(LAUNCH_RUN, {"params": params})["launchPipelineExecution"]
    if result["__typename"] != "LaunchRunSuccess":
        detail = result.get("message") or "; ".join(
            e["message"] for e in result.get("errors") or []
        )
        raise LaunchError(
            f"the webserver refused the run ({result['__typename']}): {detail.strip()[:500]}"
        )
    return str(result["run"]["runId"])


def run_progress(client: DagsterClient, run_id: str, targeted: int, started: float) -> Progress:
    """A single-partition run as a :class:`Progress` of ``targeted`` asset partitions."""
    data = client.query(RUN_STATUS, {"id": run_id})["runOrError"]
    if data["__typename"] != "Run":
        raise LaunchError(f"run {run_id}: {data.get('message', data['__typename'])}")
    done = {tuple(m["assetKey"]["path"]) for m in data["assetMaterializations"]}
    status = str(data["status"])
    left = max(targeted - len(done), 0)
    return Progress(
        id=run_id,
        status=status,
        targeted=targeted,
        materialized=len(done),
        failed=left if status in TERMINAL and status not in SUCCESS else 0,
        in_progress=0 if status in TERMINAL else left,
        records=_raw_records([data]),
        elapsed_s=time.monotonic() - started,
    )


def wait_run(
    client: DagsterClient,
    run_id: str,
    targeted: int,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> Progress:
    """Poll until the run ends (or ``timeout_s`` passes); return the last progress."""
    return _poll(
        lambda started: run_progress(client, run_id, targeted, started),
        f"run {run_id}",
        "Runs",
        poll_s=poll_s,
        timeout_s=timeout_s,
        on_progress=on_progress,
    )


def _poll(
    fetch: Callable[[float], Progress],
    what: str,
    where: str,
    *,
    poll_s: float,
    timeout_s: float | None,
    on_progress: Callable[[Progress], None] | None,
) -> Progress:
    started = time.monotonic()
    while True:
        current = fetch(started)
        if on_progress is not None:
            on_progress(current)
        if current.finished:
            return current
        if timeout_s is not None and current.elapsed_s > timeout_s:
            raise LaunchError(
                f"{what} still {current.status} after {timeout_s:.0f}s; it keeps running in "
                f"Dagster (see {where})"
            )
        time.sleep(poll_s)


def _records_read(client: DagsterClient, backfill_id: str) -> int:
    """Records read by the backfill's finished raw materializations."""
    data = client.query(RUN_METADATA, {"id": backfill_id})["runsOrError"]
    return _raw_records(data.get("results", []))


def _raw_records(runs: Sequence[dict[str, Any]]) -> int:
    """Records read by the runs' raw materializations: each partition's own ``records_read``
    (a run of several hours materializes each hour with its own count), summed."""
    total = 0
    for run in runs:
        for mat in run["assetMaterializations"]:
            if mat["assetKey"]["path"][0] != "raw":
                continue
            for entry in mat["metadataEntries"]:
                if entry["label"] == "records_read":
                    total += int(entry.get("intValue") or 0)
    return total
