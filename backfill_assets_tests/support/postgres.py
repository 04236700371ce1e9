"""A real Postgres server for the cluster tier, from Debian's postgresql-15 binaries.

The server runs as the unprivileged ``postgres`` user (``initdb`` refuses root), listens on
127.0.0.1 on a free port with scram-sha-256 password authentication, keeps its unix socket in
its own temporary directory and runs with fsync off (test data only). Two roles and databases
are created, each with a random password: ``dagster`` (Dagster's run, event log and schedule
storage) and ``iceberg`` owning ``iceberg_catalog`` (the Iceberg JDBC catalog).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from backfill_assets_tests.support.services import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_USER = "postgres"


@dataclass(frozen=True)
class PgServer:
    """How to reach the running server; passwords are random per server."""

    host: str
    port: int
    dagster_db: str
    dagster_user: str
    dagster_password: str = field(repr=False)
    catalog_db: str
    catalog_user: str
    catalog_password: str = field(repr=False)
    root: Path
    pid: int

    @property
    def catalog_uri(self) -> str:
        """BACKFILL_CATALOG_URI for the Iceberg catalog (credentials set separately)."""
        return f"postgresql+psycopg2://{self.host}:{self.port}/{self.catalog_db}"

    @property
    def log(self) -> Path:
        return self.root / "server.log"


def _as_postgres(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", PG_USER, "--", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def _chown(path: Path) -> None:
    shutil.chown(path, PG_USER, PG_USER)


def _init(root: Path, superuser_password: str) -> Path:
    _chown(root)
    root.chmod(0o700)
    pwfile = root / "pw"
    pwfile.write_text(superuser_password + "\n")
    pwfile.chmod(0o600)
    _chown(pwfile)
    data = root / "data"
    proc = _as_postgres(
        str(PG_BIN / "initdb"),
        "-D",
        str(data),
        "-U",
        PG_USER,
        "--auth=scram-sha-256",
        f"--pwfile={pwfile}",
        "-E",
        "UTF8",
        "--locale=C.UTF-8",
    )
    pwfile.unlink()
    if proc.returncode != 0:
        raise RuntimeError(f"initdb failed: {proc.stderr or proc.stdout}")
    return data


def _start(root: Path, data: Path, port: int) -> int:
    options = (
        f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={root} "
        "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    )
    proc = _as_postgres(
        str(PG_BIN / "pg_ctl"),
        "-D",
        str(data),
        "-l",
        str(root / "server.log"),
        "-w",
        "-t",
        "60",
        "-o",
        options,
        "start",
    )
    if proc.returncode != 0:
        log = (root / "server.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"pg_ctl start failed: {proc.stdout}{proc.stderr}\n{log}")
    return int((data / "postmaster.pid").read_text().splitlines()[0])


def _create_roles(port: int, superuser_password: str, roles: dict[str, tuple[str, str]]) -> None:
    """``roles``: database -> (owner role, its password)."""
    import psycopg2  # type: ignore[import-untyped]
    from psycopg2 import sql

    con = psycopg2.connect(
        host="127.0.0.1", port=port, user=PG_USER, password=superuser_password, dbname="postgres"
    )
    con.autocommit = True
    try:
        with con.cursor() as cur:
            for db, (role, password) in roles.items():
                cur.execute(
                    sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(role)),
                    (password,),
                )
                cur.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(db), sql.Identifier(role)
                    )
                )
    finally:
        con.close()


def _stop(data: Path, pid: int, timeout_s: float = 30) -> None:
    proc = _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
    if proc.returncode == 0:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@contextmanager
def postgres_server() -> Iterator[PgServer]:
    """Start a throwaway server, yield how to reach it, stop it (``pg_ctl stop -m fast``, else
    by its PID) and delete its files."""
    # Under /tmp, not pytest's tmp_path: the postgres user must be able to traverse the parents.
    root = Path(tempfile.mkdtemp(prefix="backfill-pg-"))
    superuser_password = secrets.token_urlsafe(16)
    data = _init(root, superuser_password)
    port = free_port()
    pid = _start(root, data, port)
    try:
        server = PgServer(
            host="127.0.0.1",
            port=port,
            dagster_db="dagster",
            dagster_user="dagster",
            dagster_password=secrets.token_urlsafe(16),
            catalog_db="iceberg_catalog",
            catalog_user="iceberg",
            catalog_password=secrets.token_urlsafe(16),
            root=root,
            pid=pid,
        )
        _create_roles(
            port,
            superuser_password,
            {
                server.dagster_db: (server.dagster_user, server.dagster_password),
                server.catalog_db: (server.catalog_user, server.catalog_password),
            },
        )
        yield server
    finally:
        _stop(data, pid)
        shutil.rmtree(root, ignore_errors=True)
