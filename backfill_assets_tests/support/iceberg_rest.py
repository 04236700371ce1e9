"""A real Iceberg REST catalog that requires a token, for the cluster tier.

Iceberg's own REST server code (``RESTCatalogAdapter`` and ``RESTCatalogServlet`` from
iceberg-core's test fixtures, the ``iceberg-rest`` jar set) over a JDBC catalog on SQLite, served
by Jetty on 127.0.0.1 from ``java/backfill_assets_tests/IcebergRestCatalog.java`` (launched as a
single-file source program: no build step). Iceberg's fixture checks no ``Authorization`` header
and its token endpoint accepts any client secret, so that launcher puts a small filter of ours in
front: ``/v1/oauth/tokens`` issues the token only for the right client id and secret
(client_credentials), every other request needs ``Authorization: Bearer <token>``.

The token and the credential travel in the server's environment, never on its command line.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backfill_assets.errors import StackError
from backfill_assets.stack import jars, process
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.services import free_port

SOURCE = Path(__file__).parent / "java" / "backfill_assets_tests" / "IcebergRestCatalog.java"


@dataclass(frozen=True)
class RestStatus:
    pid: int | None
    ready: bool
    url: str


@dataclass
class IcebergRest(process.Server[RestStatus]):
    """One REST catalog under ``root`` (its SQLite catalog, warehouse, log and PID file)."""

    settings: Settings
    root: Path
    port: int = field(default_factory=free_port)
    client_id: str = field(default_factory=lambda: "backfill-" + secrets.token_hex(4))
    client_secret: str = field(default_factory=lambda: secrets.token_urlsafe(18), repr=False)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    name = "the Iceberg REST catalog"
    start_timeout_s = 60.0

    def __post_init__(self) -> None:
        self.pid_path = self.root / "rest.pid"
        self.log_path = self.root / "rest.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def warehouse(self) -> str:
        return (self.root / "warehouse").as_uri()

    @property
    def credential(self) -> str:
        """``client_id:client_secret``, as Iceberg's ``credential`` property takes it."""
        return f"{self.client_id}:{self.client_secret}"

    @property
    def where(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen[bytes] | None:
        if self.running_pid() is not None:
            return None
        java = process.java(StackError, self.name)
        (self.root / "warehouse").mkdir(parents=True, exist_ok=True)
        classpath = f"{jars.jar_dir(self.settings, 'iceberg-rest')}/*"
        jars.jars(self.settings, "iceberg-rest")  # a clear error when the set is not resolved
        env = {
            **os.environ,
            "REST_PORT": str(self.port),
            "REST_WAREHOUSE": self.warehouse,
            "REST_JDBC_URI": f"jdbc:sqlite:{self.root / 'catalog.db'}",
            "REST_TOKEN": self.token,
            "REST_CREDENTIAL": self.credential,
        }
        cmd = [java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp", classpath, str(SOURCE)]
        return process.launch(cmd, self.log_path, self.pid_path, cwd=self.root, env=env)

    def answers(self) -> bool:
        """Whether it serves ``/v1/config`` (with the token)."""
        request = urllib.request.Request(
            self.url + "/v1/config", headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def running_pid(self) -> int | None:
        return process.recorded_pid(self.pid_path, str(SOURCE).encode())

    def status(self) -> RestStatus:
        pid = self.running_pid()
        return RestStatus(pid=pid, ready=pid is not None and self.answers(), url=self.url)
