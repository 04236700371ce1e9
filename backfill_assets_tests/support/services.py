"""A real Dagster webserver and daemon on one instance, for the tests and the benchmarks."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from backfill_assets.stack.settings import REPO_ROOT

# Ports this process has handed out: the kernel may give a released port again at once, and a
# cluster of three nodes once got the same client port for two of them (one never started).
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, never one this process was given
    before (services are started after their ports are picked, so a repeat would collide)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@contextmanager
def dagster_services(
    home: Path,
    env: dict[str, str],
    dagster_yaml: Path | None = None,
    start_timeout_s: float = 120,
    workspace: Path | None = None,
) -> Iterator[str]:
    """Start the webserver and the daemon on the instance in ``home`` (``dagster_yaml`` copied
    there, default the repository's); yield the base URL; stop both, by their PIDs.

    Both load ``workspace`` (default the repository's workspace.yaml) exactly as `dg dev` does;
    runs they launch are subprocesses that inherit ``env`` (so they reach the caller's broker
    and catalog)."""
    _prepare(home, dagster_yaml)
    port = free_port()
    logs = home / "services.log"
    procs = _start(home, {**env, "DAGSTER_HOME": str(home)}, port, logs, workspace)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, procs, logs, start_timeout_s)
        yield url
    finally:
        _stop(procs)


@contextmanager
def dagster_daemon(
    home: Path, env: dict[str, str], dagster_yaml: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start the daemon alone (no webserver: a test that only reads the instance saves its
    start on busy cores) on the instance in ``home``, as :func:`dagster_services` does; yield
    its process (the caller's waits check that it still runs); stop it by its PID."""
    _prepare(home, dagster_yaml)
    procs = _start(home, {**env, "DAGSTER_HOME": str(home)}, None, home / "services.log")
    try:
        yield procs[0]
    finally:
        _stop(procs)


def _prepare(home: Path, dagster_yaml: Path | None) -> None:
    import dagster as dg

    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(dagster_yaml or REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    # Create the SQLite storage once, before the services: the webserver, the daemon and their
    # code servers all open it at start-up, and concurrent first-time creation can stamp
    # alembic_version twice ("more than one head present"), which fails the code location.
    with dg.DagsterInstance.from_config(str(home)):
        pass


def _start(
    home: Path, env: dict[str, str], port: int | None, logs: Path, workspace: Path | None = None
) -> list[subprocess.Popen[bytes]]:
    """The daemon, and with a ``port`` the webserver first."""
    bin_dir = Path(sys.executable).parent
    ws = str(workspace or "workspace.yaml")
    webserver = [str(bin_dir / "dagster-webserver"), "-w", ws, "-h", "127.0.0.1"]
    commands = [[str(bin_dir / "dagster-daemon"), "run", "-w", ws]]
    if port is not None:
        commands.insert(0, [*webserver, "-p", str(port)])
    procs = []
    with logs.open("ab") as log:
        for cmd in commands:
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def _wait_ready(
    url: str, procs: list[subprocess.Popen[bytes]], logs: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/server_info", timeout=2):
                return
        except (OSError, http.client.HTTPException):  # not listening yet, or half started
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(
                    f"Dagster services did not start; see {logs}:\n"
                    + logs.read_text(errors="replace")[-2000:]
                ) from None
            time.sleep(1)


def _stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 60) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
