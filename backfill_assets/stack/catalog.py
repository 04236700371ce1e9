"""One Iceberg catalog, visible to Spark and to pyiceberg under the same name.

Locally it is a SQL catalog: a SQLite file in WAL mode plus a ``file://`` warehouse. Spark
reaches it through Iceberg's JDBC catalog (sqlite-jdbc), pyiceberg through ``SqlCatalog``.
Both use the same two tables (``iceberg_tables``, ``iceberg_namespace_properties``); every
table commit is a single-row compare-and-swap of ``metadata_location``, so it is atomic for
readers of either engine. In production the same functions build a REST or JDBC/Postgres
catalog on object storage from :class:`~backfill_assets.stack.settings.CatalogSettings`.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlparse

from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import CommitFailedException

from backfill_assets.errors import SettingsError, StackError
from backfill_assets.stack.settings import CatalogSettings, Settings

if TYPE_CHECKING:
    import pyarrow.fs as pafs

T = TypeVar("T")


def lost_race(exc: Exception) -> bool:
    """Whether a commit failed only because another writer committed to the table first."""
    return isinstance(exc, CommitFailedException)


def retry_commit(
    commit: Callable[[int], T],
    *,
    attempts: int,
    backoff_s: float,
    conflict: Callable[[Exception], bool] = lost_race,
) -> T:
    """``commit(attempt)`` for attempt 0, 1, ...: the one optimistic-concurrency retry of the
    package. Each call must be one atomic catalog commit on freshly loaded metadata (reload it
    when ``attempt`` > 0), so a retried commit never applies twice. An exception ``conflict``
    says is a lost race is retried after ``backoff_s * attempt`` seconds; any other, and the
    last attempt's, is raised as it is."""
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * attempt)
        try:
            return commit(attempt)
        except Exception as exc:
            if attempt == attempts - 1 or not conflict(exc):
                raise
    raise AssertionError("unreachable")


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
    # Runs in other processes commit to the file meanwhile: wait for their locks (the default
    # 5 s gave "database is locked" once), and switch to WAL only if it is not yet (a mode
    # change needs the database to itself).
    con = sqlite3.connect(path, timeout=60)
    try:
        if str(con.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
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
    props.update(cfg.properties)  # BACKFILL_CATALOG_PROPERTIES: validated not to clash
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
    for key, value in {**_s3_properties(cfg), **cfg.properties}.items():
        conf[f"{base}.{key}"] = value
    return conf


def load(cfg: CatalogSettings) -> Catalog:
    """The pyiceberg catalog (created on first use for the local SQLite backend). A SQL
    catalog's database that refuses the password, or cannot be reached, is a clear error
    naming the setting (the driver's own message, without credentials)."""
    from pyiceberg.exceptions import ForbiddenError, OAuthError, UnauthorizedError
    from sqlalchemy.exc import OperationalError

    init_local_catalog(cfg)
    props: dict[str, Any] = pyiceberg_properties(cfg)
    try:
        return load_catalog(cfg.name, **props)
    except OperationalError as exc:
        raise _database_error(cfg, exc) from None
    except (OAuthError, UnauthorizedError, ForbiddenError) as exc:
        raise refused_error(cfg, exc) from None


# How Iceberg's Java REST client (inside Spark, classic or Connect) reports a refusal: the
# exception's class name, then the server's words, somewhere in the pyspark error's text.
_JVM_REFUSAL = re.compile(
    r"org\.apache\.iceberg\.exceptions\.(NotAuthorized|Forbidden)Exception\)?:?\s*([^\n]*)"
)


def refusal(cfg: CatalogSettings, exc: BaseException) -> SettingsError | None:
    """:func:`refused_error` if ``exc`` is the REST catalog refusing our credentials, whether
    pyiceberg or Spark (Iceberg's Java client, in a JVM traceback) met it; else None."""
    from pyiceberg.exceptions import ForbiddenError, OAuthError, UnauthorizedError

    if isinstance(exc, (OAuthError, UnauthorizedError, ForbiddenError)):
        return refused_error(cfg, exc)
    found = _JVM_REFUSAL.search(str(exc)) if cfg.kind == "rest" else None
    if found is None:
        return None
    words = found.group(2).strip() or "refused"
    return refused_error(cfg, exc, f"{found.group(1)}Exception: {words}")


def refused_error(
    cfg: CatalogSettings, exc: BaseException, detail: str | None = None
) -> SettingsError:
    """One line naming the setting when the REST catalog refuses our credentials; the
    server's own words (``detail``, else the first line of ``exc``) are kept, any value of
    BACKFILL_CATALOG_PROPERTIES removed from them."""
    if detail is None:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    detail = detail[:300]
    for value in cfg.properties.values():
        if len(value) >= 4:
            detail = detail.replace(value, "***")
    given = ", ".join(sorted(k for k in cfg.properties if k in _AUTH_PROPERTIES)) or "none"
    return SettingsError(
        f"BACKFILL_CATALOG_PROPERTIES: the REST catalog {cfg.uri} (BACKFILL_CATALOG_URI) refused "
        f"the request ({type(exc).__name__}: {detail}); credentials given: {given}. Set "
        "'token' or 'credential' (with 'scope', 'oauth2-server-uri' if the server needs them)"
    )


# Iceberg REST catalog properties that authenticate (named, never shown, in errors).
_AUTH_PROPERTIES = frozenset(
    {"token", "credential", "rest.auth.type", "rest.sigv4-enabled", "header.Authorization"}
)


def _database_error(cfg: CatalogSettings, exc: Exception) -> Exception:
    where = cfg.uri.split("://", 1)[-1].rsplit("@", 1)[-1]  # host:port/db, never credentials
    detail = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
    if "password authentication failed" in detail or "no password supplied" in detail:
        return SettingsError(
            f"BACKFILL_CATALOG_JDBC_PASSWORD: the catalog database {where} refused the "
            f"password of user {cfg.jdbc_user!r} (BACKFILL_CATALOG_JDBC_USER); set the right "
            "password and run again"
        )
    return StackError(
        f"the catalog database {where} (BACKFILL_CATALOG_URI) could not be used: {detail}"
    )


def s3_filesystem(cfg: CatalogSettings) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem with the settings' endpoint, credentials and region."""
    import pyarrow.fs as pafs

    kwargs: dict[str, Any] = {}
    if cfg.s3_endpoint:
        endpoint = cfg.s3_endpoint
        kwargs["scheme"] = "https" if endpoint.startswith("https://") else "http"
        kwargs["endpoint_override"] = endpoint.split("://", 1)[-1]
    if cfg.s3_access_key_id and cfg.s3_secret_access_key:
        kwargs["access_key"] = cfg.s3_access_key_id
        kwargs["secret_key"] = cfg.s3_secret_access_key
    if cfg.s3_region:
        kwargs["region"] = cfg.s3_region
    return pafs.S3FileSystem(**kwargs)


# What S3 answers to a request it refuses, and the setting to blame.
_S3_REFUSALS = (
    ("SIGNATURE_DOES_NOT_MATCH", "AWS_SECRET_ACCESS_KEY"),
    ("SignatureDoesNotMatch", "AWS_SECRET_ACCESS_KEY"),
    ("INVALID_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
    ("InvalidAccessKeyId", "AWS_ACCESS_KEY_ID"),
    ("ACCESS_DENIED", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    ("AccessDenied", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
)


def check_s3_access(settings: Settings) -> None:
    """List the warehouse and the archive prefixes once each when they are on S3: wrong
    credentials are an error naming the variable, an unreachable endpoint one naming
    BACKFILL_S3_ENDPOINT. Nothing to do for local storage."""
    import pyarrow.fs as pafs

    cfg = settings.catalog
    for variable, uri in (
        ("BACKFILL_WAREHOUSE", cfg.warehouse),
        ("BACKFILL_ARCHIVE_URI", settings.archive_uri),
    ):
        if not uri.startswith(("s3://", "s3a://")):
            continue
        path = uri.split("://", 1)[1].rstrip("/")
        try:
            s3_filesystem(cfg).get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError as exc:
            text = str(exc)
            blamed = next((name for code, name in _S3_REFUSALS if code in text), None)
            if blamed is not None:
                raise SettingsError(
                    f"{blamed}: S3 refused the credentials for {uri} ({variable}); set the "
                    "right key and run again"
                ) from None
            raise StackError(
                f"S3 could not be reached for {uri} ({variable}) at "
                f"{cfg.s3_endpoint or 'the AWS default endpoint'} (BACKFILL_S3_ENDPOINT): "
                f"{text.splitlines()[0] if text else type(exc).__name__}"
            ) from None


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


def full_name(cfg: CatalogSettings, table: str) -> str:
    """``catalog.namespace.table``, the name Spark SQL uses, from a short, ``namespace.table``
    or full name of a table of the catalog ``cfg``."""
    parts = table.split(".")
    if len(parts) == 1:
        return f"{cfg.name}.{cfg.namespace}.{table}"
    if len(parts) == 2:
        return f"{cfg.name}.{table}"
    return table


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
