"""Dagster resources: thin wrappers over the plain clients of :mod:`backfill_assets.stack`
(Kafka metadata/offsets, the Spark session, the Iceberg catalog).

All three read :class:`~backfill_assets.stack.settings.Settings` from the environment when a run
starts, so no connection detail or secret ever lands in run config or the Dagster UI.
"""

from __future__ import annotations

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


class SparkResource(PySparkResource):
    """dagster-pyspark's session resource, configured from the settings module.

    ``spark_config`` holds only extra, non-secret overrides; the base configuration (master,
    jars, Iceberg catalog, ``BACKFILL_SPARK_*``) comes from
    :func:`backfill_assets.stack.spark.spark_config`. Both go into the session builder, where
    core settings (executor memory and cores) take effect.
    """

    spark_config: dict[str, Any] = Field(default_factory=dict)
    _starting: Future[Any] | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Starts the session in a background thread: what a run does before it needs Spark
        (Kafka's window scan, the ledger) overlaps the JVM's start, which is seconds in a
        fresh run process. The first use of :attr:`spark_session` waits for it and raises
        its error, if any."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="spark-session")
        self._starting = pool.submit(spark.get_session, Settings.from_env(), self.spark_config)
        pool.shutdown(wait=False)

    @property
    def spark_session(self) -> Any:
        if self._spark_session is None and self._starting is not None:
            self._spark_session = self._starting.result()
        return self._spark_session


class KafkaResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """Kafka metadata and offset look-ups (:class:`~backfill_assets.stack.kafka.KafkaClient`)."""

    request_timeout_s: float = 30.0

    def client(self) -> KafkaClient:
        return KafkaClient(request_timeout_s=self.request_timeout_s)


class IcebergResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """The project's Iceberg catalog (:class:`~backfill_assets.stack.catalog.CatalogClient`),
    the same catalog Spark writes through."""

    @property
    def settings(self) -> Settings:
        return Settings.from_env()

    def client(self) -> CatalogClient:
        return CatalogClient()

    def catalog(self) -> Catalog:
        return self.client().catalog()

    def spark_name(self, table: str) -> str:
        return self.client().spark_name(table)

    def identifier(self, table: str) -> str:
        return self.client().identifier(table)
