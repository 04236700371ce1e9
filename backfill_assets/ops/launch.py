"""Launch and follow Dagster partition backfills through the webserver's GraphQL API.

This is the same API and the same backfill object the Dagster UI uses: a backfill launched
here is listed under Overview -> Backfills, is executed by the daemon with the assets'
BackfillPolicy and the run queue limits of dagster.yaml, and can be cancelled from the UI.
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

from backfill_assets.errors import BackfillError

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

TERMINAL = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
SUCCESS = {"COMPLETED", "COMPLETED_SUCCESS"}


class LaunchError(BackfillError):
    """The webserver refused or could not be reached; nothing was launched."""


@dataclass
class Progress:
    backfill_id: str
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
            raise LaunchError(
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
        backfill_id=backfill_id,
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
    started = time.monotonic()
    while True:
        current = progress(client, backfill_id, started)
        if on_progress is not None:
            on_progress(current)
        if current.finished:
            return current
        if timeout_s is not None and current.elapsed_s > timeout_s:
            raise LaunchError(
                f"backfill {backfill_id} still {current.status} after {timeout_s:.0f}s; it "
                "keeps running in Dagster (see Overview -> Backfills)"
            )
        time.sleep(poll_s)


def _records_read(client: DagsterClient, backfill_id: str) -> int:
    """Records read by the backfill's finished raw materializations (one figure per run)."""
    data = client.query(RUN_METADATA, {"id": backfill_id})["runsOrError"]
    total = 0
    for run in data.get("results", []):
        seen = False
        for mat in run["assetMaterializations"]:
            if mat["assetKey"]["path"][0] != "raw" or seen:
                continue
            for entry in mat["metadataEntries"]:
                if entry["label"] == "records_read":
                    total += int(entry.get("intValue") or 0)
                    seen = True
    return total
