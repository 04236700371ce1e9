"""What the cluster stack's Spark Connect server is still executing.

A Spark Connect client killed with SIGKILL does not take its query with it: the server goes on
executing it (reattachable execution; an abandoned one is only interrupted after
``spark.connect.execute.manager.detachedTimeout``, 5 minutes by default). A fault test that
kills a run mid-write therefore waits, after the client is gone, until the server has no SQL
execution running, so what it then reads of the tables is final. The server's REST API (its
Spark UI, on ``spark.ui.port`` of ``BACKFILL_SPARK_CONF``) says what runs.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Mapping
from typing import Any


def _ui(env: Mapping[str, str]) -> str | None:
    if not env.get("BACKFILL_SPARK_CONNECT"):
        return None  # the classic in-process stack: a killed run's queries died with it
    port = json.loads(env.get("BACKFILL_SPARK_CONF") or "{}").get("spark.ui.port")
    return f"http://127.0.0.1:{port}/api/v1" if port else None


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def running(env: Mapping[str, str] | None = None, but: str | None = None) -> list[str] | None:
    """Descriptions of the server's SQL executions still running, but those of session
    ``but`` (the test's own); None without a server."""
    ui = _ui(os.environ if env is None else env)
    if ui is None:
        return None
    found = []
    for app in _get(f"{ui}/applications"):
        for execution in _get(f"{ui}/applications/{app['id']}/sql?details=false&length=100000"):
            text = str(execution.get("description", ""))
            if execution.get("status") == "RUNNING" and f'session_id: "{but}"' not in text:
                found.append(text[:200])
    return found


def wait_idle(
    but: str | None = None, timeout_s: float = 300.0, env: Mapping[str, str] | None = None
) -> list[str]:
    """Until the Connect server runs no SQL execution of a session other than ``but``; what
    ran when the wait began."""
    first = running(env, but)
    if not first:
        return []
    deadline = time.monotonic() + timeout_s
    while running(env, but):
        if time.monotonic() > deadline:
            raise AssertionError(f"the Connect server still executes after {timeout_s:.0f}s")
        time.sleep(0.5)
    return first
