"""A Spark standalone cluster on this machine, for the production-shaped (``cluster``) tier: a
master and workers as separate JVMs from the pip pyspark distribution, whose executors run in
their own processes. Nothing is downloaded: the jars are pyspark's own.

Every process listens on 127.0.0.1 and is stopped by its PID (the executors are the workers'
children and end with them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from backfill_assets_tests.support.services import free_port


@dataclass(frozen=True)
class SparkCluster:
    """A running standalone cluster: the master URL and the processes behind it."""

    master_url: str
    master_ui: str
    pids: tuple[int, ...]
    logs: Path


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise RuntimeError("no java on PATH (need a JDK 17+) to start the Spark cluster")
    return found


def _env() -> dict[str, str]:
    # Started with plain `java` (not spark-class), a worker needs SPARK_SCALA_VERSION to find
    # the launcher's jars for its executors ("Cannot find any build directories" otherwise).
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_SCALA_VERSION": "2.13",
    }


def _launch(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Spark exited ({proc.returncode}); see {log}:\n{_tail(log)}")
        with socket.socket() as sock:
            sock.settimeout(1)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"Spark did not listen on 127.0.0.1:{port} in {timeout_s:.0f} s; see {log}")


def _alive_workers(ui: str) -> int:
    import json

    with urllib.request.urlopen(f"{ui}/json/", timeout=5) as resp:
        state = json.load(resp)
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


def _wait_workers(ui: str, want: int, procs: list[subprocess.Popen[bytes]], logs: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a Spark worker exited; see the logs in {logs}")
        try:
            if _alive_workers(ui) >= want:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{want} Spark workers did not register with the master; see {logs}")


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def spark_standalone(
    root: Path, workers: int = 2, worker_cores: int = 1, worker_memory: str = "1g"
) -> Iterator[SparkCluster]:
    """Start a master and ``workers`` workers under ``root``; yield the cluster; stop all by
    PID (the workers' executors are their children and end with them)."""
    root.mkdir(parents=True, exist_ok=True)
    classpath = f"{spark_home()}/jars/*"
    java = _java()
    port, ui_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        master_log = root / "master.log"
        procs.append(
            _launch(
                [java, "-Xmx256m", "-Dspark.master.rest.enabled=false", "-cp", classpath,
                 "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                 "--port", str(port), "--webui-port", str(ui_port)],
                master_log,
            )
        )  # fmt: skip
        _wait_port(port, procs[0], master_log, 90)
        master = f"spark://127.0.0.1:{port}"
        for i in range(1, workers + 1):
            work = root / f"worker{i}"
            work.mkdir(exist_ok=True)
            procs.append(
                _launch(
                    [java, "-Xmx256m", "-cp", classpath, "org.apache.spark.deploy.worker.Worker",
                     "--host", "127.0.0.1", "--cores", str(worker_cores),
                     "--memory", worker_memory, "--webui-port", str(free_port()),
                     "--work-dir", str(work), master],
                    root / f"worker{i}.log",
                )
            )  # fmt: skip
        ui = f"http://127.0.0.1:{ui_port}"
        _wait_workers(ui, workers, procs, root)
        yield SparkCluster(master, ui, tuple(p.pid for p in procs), root)
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    for proc in reversed(procs):  # workers (and their executors) first, the master last
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
