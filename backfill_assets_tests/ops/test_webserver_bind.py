"""The Dagster UI is reachable from this machine only: the webserver listens on 127.0.0.1.

The webserver has no authentication, and its GraphQL API launches backfills. The default tier
already starts the session's real webserver (test_operator.py), so checking its socket is cheap.
"""

from __future__ import annotations

import re
import urllib.parse

from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.stack.test_broker import _listening_addresses


def test_webserver_listens_on_loopback_only(dagster_services: str) -> None:
    url = urllib.parse.urlsplit(dagster_services)
    assert url.port is not None
    # No 0.0.0.0 and no IPv6 socket (:: would also accept remote connections).
    assert _listening_addresses(url.port) == {"127.0.0.1"}


def test_demo_and_settings_default_to_loopback() -> None:
    assert Settings.from_env({}).webserver_host == "127.0.0.1"
    demo = (REPO_ROOT / "scripts" / "demo.sh").read_text()
    commands = re.findall(r"^[^#\n]*\.venv/bin/dg dev .*$", demo, re.M)
    assert len(commands) == 1, commands
    host = re.search(r"\s(?:-h|--host)[ =](\S+)", commands[0])
    assert host is not None and host[1] == "127.0.0.1", commands[0]
