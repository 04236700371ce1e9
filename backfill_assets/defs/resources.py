"""Dagster resources: thin wrappers over the plain clients of :mod:`backfill_assets.stack`
(Kafka metadata/offsets, the Spark session, the Iceberg catalog).

All three read :class:`~backfill_assets.stack.settings.Settings` from the environment when a run
starts. Secrets are also resource config: optional fields that
:func:`backfill_assets.defs.build.build_resources` sets to a ``dg.EnvVar`` when the
variable is set, so the Dagster UI shows the variable's name, never its value; the value goes
into the settings the clients use (in place of the variable's). Unset, the settings read
the environment as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import dagster as dg
from dagster_pyspark import PySparkResource
from pydantic import Field, PrivateAttr
from pyiceberg.catalog import Catalog

from backfill_assets.stack import spark
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import Settings


def _secret(variable: str) -> Any:
    """An optional secret field: None unless set (to ``dg.EnvVar(variable)``); never shown in
    the resource's repr."""
    return Field(
        default=None,
        repr=False,
        description=f"secret: set to EnvVar({variable!r}) when that variable is set",
    )


# Each resource's secret fields and the variable each one holds. The property maps and Spark's
# extra settings are secrets as a whole: they may carry passwords, keys and tokens.
CATALOG_SECRETS = {
    "catalog_jdbc_password": "BACKFILL_CATALOG_JDBC_PASSWORD",
    "catalog_properties": "BACKFILL_CATALOG_PROPERTIES",
    "s3_access_key_id": "AWS_ACCESS_KEY_ID",
    "s3_secret_access_key": "AWS_SECRET_ACCESS_KEY",
}
SPARK_SECRETS = {
    **CATALOG_SECRETS,
    "spark_connect_token": "BACKFILL_SPARK_CONNECT_TOKEN",
    "spark_conf": "BACKFILL_SPARK_CONF",
}
KAFKA_SECRETS = {
    "sasl_password": "BACKFILL_KAFKA_SASL_PASSWORD",
    "kafka_properties": "BACKFILL_KAFKA_PROPERTIES",
    "schema_registry_basic_auth": "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH",
    "schema_registry_token": "BACKFILL_SCHEMA_REGISTRY_TOKEN",
    # The archive's object storage (BACKFILL_ARCHIVE_URI=s3://...), reached with the client's
    # settings by the archiver and the replay.
    "s3_access_key_id": "AWS_ACCESS_KEY_ID",
    "s3_secret_access_key": "AWS_SECRET_ACCESS_KEY",
}
SECRET_VARIABLES = frozenset({*SPARK_SECRETS.values(), *KAFKA_SECRETS.values()})


def _settings(resource: object, fields: Mapping[str, str]) -> Settings | None:
    """The settings with the secrets configured on ``resource`` (its ``fields``, each named for
    the variable it holds) over every other source, or None (the client then reads the
    settings at each call, as before) when none is configured."""
    given = {var: getattr(resource, field) for field, var in fields.items()}
    given = {var: value for var, value in given.items() if value is not None}
    if not given:
        return None
    return Settings.from_env(overrides=given)


class SparkResource(PySparkResource):
    """dagster-pyspark's session resource, configured from the settings module.

    ``spark_config`` holds only extra, non-secret overrides; the base configuration (master,
    jars, Iceberg catalog, ``BACKFILL_SPARK_*``) comes from
    :func:`backfill_assets.stack.spark.spark_config`. Both go into the session builder, where
    core settings (executor memory and cores) take effect.
    """

    spark_config: dict[str, Any] = Field(default_factory=dict)
    # SPARK_SECRETS: the catalog's, for Spark's Iceberg catalog (see IcebergResource), the
    # Connect server's token and BACKFILL_SPARK_CONF.
    catalog_jdbc_password: str | None = _secret("BACKFILL_CATALOG_JDBC_PASSWORD")
    catalog_properties: str | None = _secret("BACKFILL_CATALOG_PROPERTIES")
    s3_access_key_id: str | None = _secret("AWS_ACCESS_KEY_ID")
    s3_secret_access_key: str | None = _secret("AWS_SECRET_ACCESS_KEY")
    spark_connect_token: str | None = _secret("BACKFILL_SPARK_CONNECT_TOKEN")
    spark_conf: str | None = _secret("BACKFILL_SPARK_CONF")
    _starting: Future[Any] | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Starts the session in a background thread: what a run does before it needs Spark
        (Kafka's window scan, the ledger) overlaps the JVM's start, which is seconds in a
        fresh run process. The first use of :attr:`spark_session` waits for it and raises
        its error, if any."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="spark-session")
        settings = _settings(self, SPARK_SECRETS) or Settings.from_env()
        self._starting = pool.submit(spark.get_session, settings, self.spark_config)
        pool.shutdown(wait=False)

    @property
    def spark_session(self) -> Any:
        if self._spark_session is None and self._starting is not None:
            self._spark_session = self._starting.result()
        return self._spark_session


class KafkaResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Kafka metadata and offset look-ups (:class:`~backfill_assets.stack.kafka.KafkaClient`)."""

    request_timeout_s: float = 30.0
    # KAFKA_SECRETS: the brokers' and the schema registry's credentials, and the archive's.
    sasl_password: str | None = _secret("BACKFILL_KAFKA_SASL_PASSWORD")
    kafka_properties: str | None = _secret("BACKFILL_KAFKA_PROPERTIES")
    schema_registry_basic_auth: str | None = _secret("BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH")
    schema_registry_token: str | None = _secret("BACKFILL_SCHEMA_REGISTRY_TOKEN")
    s3_access_key_id: str | None = _secret("AWS_ACCESS_KEY_ID")
    s3_secret_access_key: str | None = _secret("AWS_SECRET_ACCESS_KEY")

    def client(self) -> KafkaClient:
        return KafkaClient(
            settings=_settings(self, KAFKA_SECRETS), request_timeout_s=self.request_timeout_s
        )


class IcebergResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """The project's Iceberg catalog (:class:`~backfill_assets.stack.catalog.CatalogClient`),
    the same catalog Spark writes through."""

    catalog_jdbc_password: str | None = _secret("BACKFILL_CATALOG_JDBC_PASSWORD")
    catalog_properties: str | None = _secret("BACKFILL_CATALOG_PROPERTIES")
    s3_access_key_id: str | None = _secret("AWS_ACCESS_KEY_ID")
    s3_secret_access_key: str | None = _secret("AWS_SECRET_ACCESS_KEY")

    def _secrets(self) -> Settings | None:
        return _settings(self, CATALOG_SECRETS)

    @property
    def settings(self) -> Settings:
        return self._secrets() or Settings.from_env()

    def client(self) -> CatalogClient:
        return CatalogClient(settings=self._secrets())

    def catalog(self) -> Catalog:
        return self.client().catalog()

    def spark_name(self, table: str) -> str:
        return self.client().spark_name(table)

    def identifier(self, table: str) -> str:
        return self.client().identifier(table)
