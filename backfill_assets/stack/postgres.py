"""A local Postgres server from Debian's postgresql-15 binaries: the CDC source (stack/cdc.py)
and the cluster tier's catalog and Dagster storage (backfill_assets_tests/support/postgres.py).

The server runs as the unprivileged ``postgres`` user when we are root (``initdb`` refuses
root), else as ourselves. It listens on 127.0.0.1 only, with scram-sha-256 password
authentication for every connection (replication included: initdb's default pg_hba), keeps its
unix socket in its own directory and runs with fsync off (throwaway local data only). Its
directory ``root`` holds the cluster (``data/``), the server's log and, in ``superuser.secret``
(mode 0600, never read by the server), the superuser's random password, made at ``initdb``.

:data:`LOGICAL_DECODING` are the settings a CDC source needs (Debezium's pgoutput plugin reads
the write-ahead log through a logical replication slot). ``stop`` stops only the postmaster
whose PID the cluster's ``postmaster.pid`` names and whose command line names our data
directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backfill_assets.errors import PostgresError
from backfill_assets.stack import process

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_USER = "postgres"
# wal_level=logical: the WAL holds what logical decoding needs; a slot and a WAL sender for
# each connector (and a few spare for a re-created one).
LOGICAL_DECODING = {"wal_level": "logical", "max_replication_slots": "8", "max_wal_senders": "8"}


@dataclass(frozen=True)
class PgServer:
    """How to reach a running server as its superuser (password random per cluster)."""

    host: str
    port: int
    superuser: str
    superuser_password: str = field(repr=False)
    root: Path
    pid: int

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def connect(self, dbname: str = "postgres", user: str | None = None, password: str = "") -> Any:
        """A psycopg2 connection (autocommit) as the superuser, or as ``user``/``password``."""
        import psycopg2  # type: ignore[import-untyped]

        con = psycopg2.connect(
            host=self.host,
            port=self.port,
            dbname=dbname,
            user=user or self.superuser,
            password=password if user else self.superuser_password,
        )
        con.autocommit = True
        return con

    def create_role_and_database(
        self, role: str, password: str, dbname: str, *, replication: bool = False
    ) -> None:
        """A login ``role`` (with REPLICATION when asked) owning database ``dbname``; both kept
        as they are when they exist (the role's password is set again)."""
        from psycopg2 import sql

        con = self.connect()
        try:
            with con.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                verb = "ALTER" if cur.fetchone() else "CREATE"
                attrs = "LOGIN REPLICATION" if replication else "LOGIN"
                cur.execute(
                    sql.SQL(verb + " ROLE {} " + attrs + " PASSWORD %s").format(
                        sql.Identifier(role)
                    ),
                    (password,),
                )
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
                if cur.fetchone() is None:
                    cur.execute(
                        sql.SQL("CREATE DATABASE {} OWNER {}").format(
                            sql.Identifier(dbname), sql.Identifier(role)
                        )
                    )
        finally:
            con.close()


class LocalPostgres:
    """One Postgres cluster in ``root`` listening on 127.0.0.1:``port``, with the server
    settings ``conf`` added to the defaults (e.g. :data:`LOGICAL_DECODING`)."""

    def __init__(self, root: Path, port: int, conf: Mapping[str, str] | None = None) -> None:
        self.root = root
        self.port = port
        self.conf = dict(conf or {})
        self.data = root / "data"
        self.secret_path = root / "superuser.secret"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def start(self, timeout_s: float = 60.0) -> PgServer:
        """Initialise the cluster if needed and start it (``pg_ctl start -w``); when ours
        already runs, only say how to reach it."""
        if not (PG_BIN / "initdb").is_file():
            raise PostgresError(
                f"no Postgres 15 binaries in {PG_BIN}; install them (apt-get install postgresql-15)"
            )
        if not (self.data / "PG_VERSION").is_file():
            self._init()
        pid = self.running_pid()
        if pid is None:
            process.require_free_port(self.port, PostgresError, "BACKFILL_CDC_POSTGRES_PORT")
            pid = self._start(timeout_s)
        return PgServer(
            host="127.0.0.1",
            port=self.port,
            superuser=PG_USER,
            superuser_password=self.secret_path.read_text().strip(),
            root=self.root,
            pid=pid,
        )

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop our server (``pg_ctl stop -m fast``, else by its PID). True if one ran."""
        pid = self.running_pid()
        if pid is None:
            return False
        proc = _as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"
        )
        if proc.returncode != 0 and process.alive(pid):
            process.terminate([pid], timeout_s)
        return True

    def running_pid(self) -> int | None:
        """The postmaster's PID from ``postmaster.pid`` if it runs our data directory."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        if not process.alive(pid):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        return pid if str(self.data).encode() in cmdline else None

    def _init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        _chown(self.root)
        password = secrets.token_urlsafe(16)
        pwfile = self.root / "initdb.pw"
        pwfile.write_text(password + "\n")
        pwfile.chmod(0o600)
        _chown(pwfile)
        shutil.rmtree(self.data, ignore_errors=True)  # a half-done earlier initdb
        proc = _as_postgres(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data),
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
            raise PostgresError(
                f"initdb in {self.data} failed (the {PG_USER} user must be able to enter every "
                f"parent directory of {self.root}): {(proc.stderr or proc.stdout)[-800:]}"
            )
        # Written by us, after initdb: the server never reads it.
        fd = os.open(self.secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(password + "\n")

    def _start(self, timeout_s: float) -> int:
        conf = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.root),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            **self.conf,
        }
        proc = _as_postgres(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(int(timeout_s)),
            "-o",
            " ".join(f"-c {k}={v}" for k, v in conf.items()),
            "start",
        )
        pid = self.running_pid()
        if proc.returncode != 0 or pid is None:
            raise PostgresError(
                f"pg_ctl start in {self.data} failed: {proc.stdout}{proc.stderr}\n"
                f"{process.log_tail(self.log_path)}"
            )
        return pid


def _as_postgres(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the postgres user when we are root, else as ourselves."""
    prefix = ["runuser", "-u", PG_USER, "--"] if os.geteuid() == 0 else []
    return subprocess.run(
        [*prefix, *argv], capture_output=True, text=True, check=False, timeout=120
    )


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, PG_USER, PG_USER)


@contextmanager
def throwaway_server(
    port: int, conf: Mapping[str, str] | None = None, prefix: str = "backfill-pg-"
) -> Iterator[PgServer]:
    """A server in a new temporary directory, stopped and deleted on exit (tests)."""
    import tempfile

    # Under /tmp, not pytest's tmp_path: the postgres user must be able to enter the parents.
    root = Path(tempfile.mkdtemp(prefix=prefix))
    pg = LocalPostgres(root, port, conf)
    try:
        yield pg.start()
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
