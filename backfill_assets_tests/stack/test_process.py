"""The helpers every server ``stack`` starts shares (stack/process.py), on real processes and
sockets of this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backfill_assets.errors import BrokerError
from backfill_assets.stack import process


def test_a_port_in_use_is_refused_naming_the_setting_that_moves_it() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(BrokerError, match=rf"127\.0\.0\.1:{port} is already in use.*PORT_X"):
            process.require_free_port(port, BrokerError, "PORT_X")
    process.require_free_port(port, BrokerError, "PORT_X")  # closed: free again


def test_a_recorded_pid_counts_only_while_its_process_is_ours_and_alive(tmp_path: Path) -> None:
    marker = f"marker-{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    pid_path = tmp_path / "server.pid"
    pid_path.write_text(f"{child.pid}\n")
    try:
        assert process.recorded_pid(pid_path, marker.encode()) == child.pid
        # A PID file whose process is another program (a recycled PID) is not ours.
        assert process.recorded_pid(pid_path, b"some-other-server") is None
        assert process.stop(process.recorded_pid(pid_path, marker.encode()), pid_path, 10)
        assert child.wait(timeout=10) != 0
        assert not process.alive(child.pid)
        assert not pid_path.exists()
        assert process.stop(process.recorded_pid(pid_path, marker.encode()), pid_path, 10) is False
    finally:
        child.kill()


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
        time.sleep(0.01)  # until it has exited and is not reaped yet: a zombie
    assert not process.alive(child.pid)
    child.wait()


def test_properties_escape_round_trips_backslashes_and_newlines() -> None:
    assert process.properties_escape("a\\b\nc") == "a\\\\b\\nc"
