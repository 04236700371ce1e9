"""A real S3-compatible object store for the cluster tier: S3Proxy (``org.gaul:s3proxy``, the
``s3proxy`` jar set) on its filesystem provider, with SigV4/SigV2 authentication and random
access and secret keys. Buckets are subdirectories of its base directory."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from backfill_assets.stack import jars
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.services import free_port

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str
    root: Path
    pid: int

    @property
    def log(self) -> Path:
        return self.root / "s3proxy.log"


def _properties(endpoint: str, access: str, secret: str, basedir: Path) -> str:
    return "\n".join(
        [
            f"s3proxy.endpoint={endpoint}",
            "s3proxy.authorization=aws-v2-or-v4",
            f"s3proxy.identity={access}",
            f"s3proxy.credential={secret}",
            "jclouds.provider=filesystem",
            "jclouds.identity=unused",
            "jclouds.credential=unused",
            f"jclouds.filesystem.basedir={basedir}",
            "",
        ]
    )


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"S3Proxy exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"S3Proxy did not listen on {port} in {timeout_s} s:\n{log.read_text()}")


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue


def create_buckets(server: S3Server, buckets: Sequence[str]) -> None:
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(
        access_key=server.access_key,
        secret_key=server.secret_key,
        region=server.region,
        endpoint_override=server.endpoint,
        allow_bucket_creation=True,
    )
    for bucket in buckets:
        fs.create_dir(bucket)


@contextmanager
def s3proxy_server(
    settings: Settings, buckets: Sequence[str] = (), start_timeout_s: float = 120
) -> Iterator[S3Server]:
    """Start S3Proxy (jars from ``settings``' jar cache), create ``buckets``, yield how to
    reach it, stop it by its PID and delete its files."""
    classpath = jars.jar_dir(settings, "s3proxy")
    jars.jars(settings, "s3proxy")  # a clear error when the set is not resolved
    root = Path(tempfile.mkdtemp(prefix="backfill-s3-"))
    (root / "data").mkdir()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    access, secret = secrets.token_hex(10), secrets.token_urlsafe(24)
    conf = root / "s3proxy.conf"
    conf.touch(mode=0o600)  # it holds the secret
    conf.write_text(_properties(endpoint, access, secret, root / "data"))
    server = S3Server(endpoint, access, secret, REGION, root, 0)
    argv = ["java", "-Xmx256m", "-cp", f"{classpath}/*", "org.gaul.s3proxy.Main"]
    with server.log.open("wb") as log:
        proc = subprocess.Popen(
            [*argv, "--properties", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        _wait_listening(port, proc, server.log, start_timeout_s)
        server = S3Server(endpoint, access, secret, REGION, root, proc.pid)
        create_buckets(server, buckets)
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(root, ignore_errors=True)
