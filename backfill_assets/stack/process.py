"""The processes ``stack`` starts (the broker, the schema registry, the Spark Connect server,
the Kafka Connect worker): finding Java, a free port, launching one, whether a PID is one of ours
and alive, stopping it, its log's tail; and :class:`Server`, the start/wait/stop every one of
them shares.

Every helper acts only on processes this package started and recorded in its own PID files.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Generic, TypeVar

from backfill_assets.errors import StackError


def java(error: type[StackError], server: str) -> str:
    """The ``java`` on PATH, or ``error`` naming the ``server`` that needs it."""
    found = shutil.which("java")
    if found is None:
        raise error(
            f"Java is not on PATH; {server} needs a JDK 17+ "
            "(apt-get install openjdk-17-jdk-headless)"
        )
    return found


def launch(
    cmd: list[str],
    log_path: Path,
    pid_path: Path,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start the server ``cmd`` without waiting for it: in a session of its own, reading
    nothing, its output (stdout and stderr) appended to ``log_path``, and its PID recorded in
    ``pid_path`` (what :func:`recorded_pid` and :func:`stop` read)."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
    pid_path.write_text(f"{proc.pid}\n")
    return proc


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def recorded_pid(pid_path: Path, *markers: bytes) -> int | None:
    """The PID in ``pid_path`` if that process is alive and its command line holds every one
    of ``markers`` (so a recycled PID is never taken for ours); else None."""
    try:
        pid = int(pid_path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if not alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if all(m in cmdline for m in markers) else None


def terminate(pids: list[int], timeout_s: float) -> None:
    """SIGTERM ``pids``, wait up to ``timeout_s`` for them all, then SIGKILL the rest (a broker
    whose peers are gone can wait forever in controlled shutdown); returns once all are gone."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.05)


def stop(pid: int | None, pid_path: Path, timeout_s: float) -> bool:
    """Stop our server ``pid`` (from :func:`recorded_pid`; None: none runs) and forget its PID
    file. True if one was running."""
    if pid is not None:
        terminate([pid], timeout_s)
    pid_path.unlink(missing_ok=True)
    return pid is not None


def require_free_port(port: int, error: type[StackError], setting: str) -> None:
    """Raise ``error`` if something listens on 127.0.0.1:``port``, naming the ``setting`` that
    moves it. Bound as the servers bind (SO_REUSEADDR): connections of a just-stopped server
    lingering in TIME_WAIT do not block a restart on the same port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise error(
                f"port 127.0.0.1:{port} is already in use; stop whatever holds it or choose "
                f"another port with {setting}"
            ) from None


def properties_escape(value: str) -> str:
    """A value as Java's Properties.load reads it back (backslash is its escape character)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def properties_text(conf: Mapping[str, str]) -> str:
    """``conf`` as a Java properties file (keys escaped where Properties.load would split)."""
    lines = []
    for key, value in sorted(conf.items()):
        name = properties_escape(key)
        for char in " =:#!":
            name = name.replace(char, "\\" + char)
        lines.append(f"{name}={properties_escape(value)}\n")
    return "".join(lines)


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a server's log, or a note that it wrote none."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log written)"
    return "\n".join(text[-lines:])


StatusT = TypeVar("StatusT")


class Server(Generic[StatusT]):
    """What every server ``stack`` starts shares. :meth:`start` launches it (nothing when ours
    already runs) and waits until it answers; a server it launched that dies or does not
    answer in time is stopped again, so a failed start leaves nothing running. Subclasses say
    how to launch, whether it answers, which PID is ours, and what their status is."""

    error: type[StackError] = StackError
    name = "the server"  # in messages: "the schema registry"
    start_timeout_s = 90.0
    poll_s = 0.25
    pid_path: Path
    log_path: Path

    @property
    def where(self) -> str:
        """Its address, in messages."""
        raise NotImplementedError

    def launch(self) -> subprocess.Popen[bytes] | None:
        """Start the JVM without waiting; None if ours already runs."""
        raise NotImplementedError

    def answers(self) -> bool:
        """Whether it serves requests now."""
        raise NotImplementedError

    def running_pid(self) -> int | None:
        """The PID from our PID file if that process is alive and is this server."""
        raise NotImplementedError

    def status(self) -> StatusT:
        raise NotImplementedError

    def on_ready(self) -> None:
        """Checks once it answers (raise :attr:`error`); none by default."""

    def log_tail(self, lines: int = 15) -> str:
        return f"[{self.log_path}]\n" + log_tail(self.log_path, lines)

    def start(self, timeout_s: float | None = None) -> StatusT:
        """Launch (a no-op when ours runs) and wait until it answers; a server launched here
        that fails to is stopped before the error is raised."""
        proc = self.launch()
        try:
            self.wait_ready(self.start_timeout_s if timeout_s is None else timeout_s, proc)
        except self.error:
            if proc is not None:
                self.stop()
            raise
        return self.status()

    def wait_ready(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Wait until it answers (then :meth:`on_ready`); fail if ``proc`` exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise self.error(
                    f"{self.name} exited with code {proc.returncode} during start-up. "
                    f"Last lines of its output:\n{self.log_tail()}"
                )
            if self.answers():
                self.on_ready()
                return
            time.sleep(self.poll_s)
        raise self.error(
            f"{self.name} at {self.where} did not answer within {timeout_s:.0f}s. "
            f"Last lines of its output:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the server this package started (SIGTERM, then SIGKILL). True if one ran."""
        return stop(self.running_pid(), self.pid_path, timeout_s)
