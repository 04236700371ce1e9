"""A real Postgres server for the cluster tier (backfill_assets.stack.postgres: Debian's
postgresql-15, run as the unprivileged ``postgres`` user, 127.0.0.1 on a free port,
scram-sha-256). Two roles and databases are created, each with a random password: ``dagster``
(Dagster's run, event log and schedule storage) and ``iceberg`` owning ``iceberg_catalog`` (the
Iceberg JDBC catalog).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from backfill_assets.stack.postgres import throwaway_server
from backfill_assets_tests.support.services import free_port


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


@contextmanager
def postgres_server() -> Iterator[PgServer]:
    """Start a throwaway server, yield how to reach it, stop it (``pg_ctl stop -m fast``, else
    by its PID) and delete its files."""
    with throwaway_server(free_port()) as pg:
        server = PgServer(
            host=pg.host,
            port=pg.port,
            dagster_db="dagster",
            dagster_user="dagster",
            dagster_password=secrets.token_urlsafe(16),
            catalog_db="iceberg_catalog",
            catalog_user="iceberg",
            catalog_password=secrets.token_urlsafe(16),
            root=pg.root,
            pid=pg.pid,
        )
        pg.create_role_and_database(server.dagster_user, server.dagster_password, "dagster")
        pg.create_role_and_database(server.catalog_user, server.catalog_password, server.catalog_db)
        yield server
