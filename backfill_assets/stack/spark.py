"""Spark configuration: the same code builds a ``local[2]`` session here and a cluster one in
production; only :class:`~backfill_assets.stack.settings.Settings` differs."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from backfill_assets.stack import catalog, jars
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def spark_config(settings: Settings) -> dict[str, str]:
    """Every Spark setting the project needs; contains catalog secrets, never log it whole."""
    conf = {
        "spark.master": settings.spark_master,
        "spark.app.name": "backfill_assets",
        "spark.jars": ",".join(str(p) for p in jars.jars(settings, "spark")),
        "spark.sql.extensions": (
            "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
        ),
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(settings.spark_shuffle_partitions),
        "spark.driver.memory": settings.spark_driver_memory,
        "spark.sql.adaptive.enabled": "true",
        "spark.ui.showConsoleProgress": "false",
        # Local runs bind the UI and driver to loopback only.
        "spark.driver.host": "127.0.0.1" if settings.spark_master.startswith("local") else "",
        "spark.driver.bindAddress": (
            "127.0.0.1" if settings.spark_master.startswith("local") else ""
        ),
        "spark.ui.enabled": "false" if settings.spark_master.startswith("local") else "true",
        # Local Python workers must use this interpreter (pandas, pyarrow, pandera live here);
        # a cluster's workers use their image's interpreter.
        "spark.pyspark.python": sys.executable if settings.spark_master.startswith("local") else "",
        "spark.pyspark.driver.python": (
            sys.executable if settings.spark_master.startswith("local") else ""
        ),
    }
    conf = {k: v for k, v in conf.items() if v != ""}
    conf.update(catalog.spark_properties(settings.catalog))
    conf.update(_archive_s3a(settings))
    return conf


def _archive_s3a(settings: Settings) -> dict[str, str]:
    """Hadoop s3a settings for reading an ``s3://`` archive (hadoop-aws jar in production)."""
    if not settings.archive_uri.startswith(("s3://", "s3a://")):
        return {}
    cfg = settings.catalog
    conf = {}
    if cfg.s3_endpoint:
        conf["spark.hadoop.fs.s3a.endpoint"] = cfg.s3_endpoint
        conf["spark.hadoop.fs.s3a.path.style.access"] = "true"
    if cfg.s3_access_key_id and cfg.s3_secret_access_key:
        conf["spark.hadoop.fs.s3a.access.key"] = cfg.s3_access_key_id
        conf["spark.hadoop.fs.s3a.secret.key"] = cfg.s3_secret_access_key
    if cfg.s3_region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = cfg.s3_region
    return conf


def get_session(settings: Settings) -> SparkSession:
    """The process's Spark session, created on first use (``getOrCreate``)."""
    from pyspark.sql import SparkSession

    # py4j logs every call into the JVM with its arguments at DEBUG: the Kafka JAAS line and
    # catalog passwords would land in any DEBUG log. Never let it go below INFO.
    logging.getLogger("py4j").setLevel(logging.INFO)
    catalog.init_local_catalog(settings.catalog)
    if settings.spark_master.startswith("local"):
        # PySpark picks the worker interpreter from PYSPARK_PYTHON when the context starts.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder
    for key, value in spark_config(settings).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session
