"""One Iceberg catalog, visible to Spark and to pyiceberg under the same name.

Locally it is a SQL catalog: a SQLite file in WAL mode plus a ``file://`` warehouse. Spark
reaches it through Iceberg's JDBC catalog (sqlite-jdbc), pyiceberg through ``SqlCatalog``.
Both use the same two tables (``iceberg_tables``, ``iceberg_namespace_properties``); every
table commit is a single-row compare-and-swap of ``metadata_location``, so it is atomic for
readers of either engine. In production the same functions build a REST or JDBC/Postgres
catalog on object storage from :class:`~backfill_assets.stack.settings.CatalogSettings`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from pyiceberg.catalog import Catalog, load_catalog

from backfill_assets.stack.settings import CatalogSettings, Settings

# The DDL Iceberg's Java JdbcCatalog uses with jdbc.schema-version=V1 (views supported).
# Created up front so whichever engine touches the catalog first, both find the same schema.
_SQLITE_DDL = (
    "CREATE TABLE IF NOT EXISTS iceberg_tables("
    "catalog_name VARCHAR(255) NOT NULL,table_namespace VARCHAR(255) NOT NULL,"
    "table_name VARCHAR(255) NOT NULL,metadata_location VARCHAR(1000),"
    "previous_metadata_location VARCHAR(1000), iceberg_type VARCHAR(5),"
    "PRIMARY KEY (catalog_name, table_namespace, table_name))",
    "CREATE TABLE IF NOT EXISTS iceberg_namespace_properties("
    "catalog_name VARCHAR(255) NOT NULL,namespace VARCHAR(255) NOT NULL,"
    "property_key VARCHAR(255),property_value VARCHAR(1000),"
    "PRIMARY KEY (catalog_name, namespace, property_key))",
)


def init_local_catalog(cfg: CatalogSettings) -> None:
    """Create the SQLite catalog file (WAL mode) and the warehouse directory. Idempotent."""
    path = cfg.sqlite_path
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.warehouse.startswith("file://"):
        Path(urlparse(cfg.warehouse).path).mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA journal_mode=WAL")
        for ddl in _SQLITE_DDL:
            con.execute(ddl)
        con.commit()
    finally:
        con.close()


def pyiceberg_properties(cfg: CatalogSettings) -> dict[str, str]:
    """Properties for ``pyiceberg.catalog.load_catalog``; may contain secrets."""
    props: dict[str, str] = {"warehouse": cfg.warehouse}
    if cfg.kind == "sql":
        props["type"] = "sql"
        props["uri"] = cfg.uri
        if cfg.jdbc_user:
            props["uri"] = _with_credentials(cfg.uri, cfg.jdbc_user, cfg.jdbc_password)
    else:
        props["type"] = "rest"
        props["uri"] = cfg.uri
    props.update(_s3_properties(cfg))
    return props


def spark_properties(cfg: CatalogSettings) -> dict[str, str]:
    """``spark.sql.catalog.<name>.*`` settings for the same catalog; may contain secrets."""
    base = f"spark.sql.catalog.{cfg.name}"
    conf = {
        base: "org.apache.iceberg.spark.SparkCatalog",
        f"{base}.warehouse": cfg.warehouse,
        # Other processes (runs, sensors, CLI rollbacks through pyiceberg) commit to the same
        # tables: a session-level metadata cache would let a run branch from a stale main.
        f"{base}.cache-enabled": "false",
    }
    if cfg.kind == "sql":
        conf[f"{base}.type"] = "jdbc"
        conf[f"{base}.uri"] = _jdbc_url(cfg.uri)
        conf[f"{base}.jdbc.schema-version"] = "V1"
        if cfg.jdbc_user:
            conf[f"{base}.jdbc.user"] = cfg.jdbc_user
        if cfg.jdbc_password:
            conf[f"{base}.jdbc.password"] = cfg.jdbc_password
    else:
        conf[f"{base}.type"] = "rest"
        conf[f"{base}.uri"] = cfg.uri
    if cfg.warehouse.startswith("s3"):
        conf[f"{base}.io-impl"] = "org.apache.iceberg.aws.s3.S3FileIO"
    for key, value in _s3_properties(cfg).items():
        conf[f"{base}.{key}"] = value
    return conf


def load(cfg: CatalogSettings) -> Catalog:
    """The pyiceberg catalog (created on first use for the local SQLite backend)."""
    init_local_catalog(cfg)
    props: dict[str, Any] = pyiceberg_properties(cfg)
    return load_catalog(cfg.name, **props)


def _jdbc_url(uri: str) -> str:
    """Translate a SQLAlchemy URI into the JDBC URL Iceberg's Java catalog expects."""
    if uri.startswith("sqlite:///"):
        return "jdbc:sqlite:" + uri.removeprefix("sqlite:///")
    if uri.startswith("postgresql"):
        rest = uri.split("://", 1)[1]
        if "@" in rest:
            rest = rest.split("@", 1)[1]
        return "jdbc:postgresql://" + rest
    return uri


def _with_credentials(uri: str, user: str, password: str | None) -> str:
    scheme, rest = uri.split("://", 1)
    auth = (
        quote(user, safe="")
        if password is None
        else f"{quote(user, safe='')}:{quote(password, safe='')}"
    )
    return f"{scheme}://{auth}@{rest}"


def _s3_properties(cfg: CatalogSettings) -> dict[str, str]:
    props: dict[str, str] = {}
    if cfg.s3_endpoint:
        props["s3.endpoint"] = cfg.s3_endpoint
        props["s3.path-style-access"] = "true"
    if cfg.s3_access_key_id:
        props["s3.access-key-id"] = cfg.s3_access_key_id
    if cfg.s3_secret_access_key:
        props["s3.secret-access-key"] = cfg.s3_secret_access_key
    if cfg.s3_region:
        props["s3.region"] = cfg.s3_region
        props["client.region"] = cfg.s3_region
    return props


class CatalogClient:
    """The project's tables in its one catalog, as pyiceberg loads them and as Spark names them.

    Reads :class:`Settings` from the environment at each call unless given ``settings``."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings

    @property
    def settings(self) -> Settings:
        return self._settings or Settings.from_env()

    def catalog(self) -> Catalog:
        return load(self.settings.catalog)

    def spark_name(self, table: str) -> str:
        """``<catalog>.<namespace>.<table>``, the name Spark SQL uses."""
        cfg = self.settings.catalog
        return f"{cfg.name}.{cfg.namespace}.{table}"

    def identifier(self, table: str) -> str:
        """``<namespace>.<table>``, the name pyiceberg uses."""
        return f"{self.settings.catalog.namespace}.{table}"
