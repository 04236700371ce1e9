"""Spark configuration: the same code builds a ``local[2]`` session here and a cluster one in
production; only :class:`~backfill_assets.settings.Settings` differs."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from backfill_assets import catalog, jars
from backfill_assets.settings import Settings

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
    return conf


def get_session(settings: Settings) -> SparkSession:
    """The process's Spark session, created on first use (``getOrCreate``)."""
    from pyspark.sql import SparkSession

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
