"""JVM artifacts come from the checked-in poms and are resolved once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from backfill_assets.errors import JarResolutionError
from backfill_assets.stack import jars
from backfill_assets.stack.settings import Settings


def test_second_resolution_does_nothing(stack_settings: Settings) -> None:
    assert jars.resolve_all(stack_settings) == {
        "kafka-broker": False,
        "spark": False,
        "spark-cloud": False,
        "s3proxy": False,
        "spark-formats": False,
        "kafka-connect": False,
        "kafka-connect-avro": False,
        "iceberg-rest": False,
    }
    names = {p.name for p in jars.jars(stack_settings, "kafka-broker")}
    assert any(n.startswith("kafka_2.13-4.") for n in names)
    spark_names = {p.name for p in jars.jars(stack_settings, "spark")}
    assert "spark-sql-kafka-0-10_2.13-4.1.3.jar" in spark_names
    assert any(n.startswith("iceberg-spark-runtime-4.1_2.13-") for n in spark_names)
    assert any(n.startswith("sqlite-jdbc-") for n in spark_names)
    # Jars pyspark already ships must not be added a second time.
    assert not any(n.startswith(("scala-library", "slf4j-api")) for n in spark_names)
    # Postgres and S3 for Spark: exactly the five jars, none of their transitive deps (hadoop-aws
    # alone would pull the 0.5 GB AWS SDK bundle).
    cloud = sorted(p.name for p in jars.jars(stack_settings, "spark-cloud"))
    assert cloud == [
        "apache-client-2.54.17.jar",
        "hadoop-aws-3.4.2.jar",
        "iceberg-aws-bundle-1.12.0.jar",
        "postgresql-42.7.14.jar",
        "s3-transfer-manager-2.54.17.jar",
    ]
    s3proxy = {p.name for p in jars.jars(stack_settings, "s3proxy")}
    assert "s3proxy-4.1.0.jar" in s3proxy
    # jackson 3 from the imported BOM, not the 2.18 annotations s3proxy's own pom would give
    assert not any(n.startswith("jackson-annotations-2.18") for n in s3proxy)
    # Apicurio's converter at the registry's version; Kafka and Jackson only from kafka-connect.
    avro = {p.name for p in jars.jars(stack_settings, "kafka-connect-avro")}
    assert "apicurio-registry-utils-converter-2.4.2.Final.jar" in avro
    assert not any(n.startswith(("kafka-", "connect-", "jackson-")) for n in avro)


def test_unresolved_cache_names_the_command(stack_settings: Settings, tmp_path: Path) -> None:
    empty = dataclasses.replace(stack_settings, jar_cache=tmp_path)
    assert not jars.is_resolved(empty, "spark")
    with pytest.raises(JarResolutionError, match="backfill-assets jars resolve"):
        jars.jars(empty, "spark")


def test_unknown_set_lists_the_known_ones() -> None:
    with pytest.raises(JarResolutionError, match="kafka-broker, spark, spark-cloud, s3proxy"):
        jars.pom_path("flink")


def test_bench_sets_are_known_but_not_resolved_by_default() -> None:
    """A benchmark's set has a pom and resolves on demand; `jars resolve` leaves it out."""
    assert jars.pom_path("iceberg-sink").is_file()
    assert not set(jars.BENCH_JAR_SETS) & set(jars.JAR_SETS)


def test_udf_jar_is_built_once_and_named_by_its_sources(
    stack_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The project's JVM functions compile into the cache on first use (against pyspark's jars
    and the spark-formats set, for ProtobufRow's protobuf-java); a second call reuses the jar, a
    changed source builds a new one under a new name."""
    import zipfile

    cache = dataclasses.replace(stack_settings, jar_cache=tmp_path)
    # The resolved spark-formats set of the session's cache (resolving it again is Maven's job).
    (tmp_path / "spark-formats").symlink_to(jars.jar_dir(stack_settings, "spark-formats"))
    built = jars.udf_jar(cache)
    assert built.parent == tmp_path / "udf" and built == jars.udf_jar_path(cache)
    with zipfile.ZipFile(built) as jar:
        names = jar.namelist()
    assert {"backfill_assets/udf/StrictJson.class", "backfill_assets/udf/ProtobufRow.class"} <= set(
        names
    )
    stamp = built.stat().st_mtime_ns
    assert jars.udf_jar(cache) == built and built.stat().st_mtime_ns == stamp
    assert not list((tmp_path / "udf").glob("tmp*")), "no build directory left behind"

    import shutil

    changed = tmp_path / "java"
    shutil.copytree(jars.JAVA_SOURCES, changed)
    source = next(changed.rglob("StrictJson.java"))
    source.write_text(source.read_text() + "\n// changed\n")
    monkeypatch.setattr(jars, "JAVA_SOURCES", changed)
    rebuilt = jars.udf_jar(cache)
    assert rebuilt != built and rebuilt.is_file() and built.is_file()


def test_udf_jar_without_a_jdk_names_what_to_install(
    stack_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = dataclasses.replace(stack_settings, jar_cache=tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no javac on it
    with pytest.raises(JarResolutionError, match=r"javac is not on PATH.*jars resolve"):
        jars.udf_jar(cache)
    assert not jars.udf_jar_path(cache).exists()


def test_cloud_jars_only_for_postgres_or_s3(stack_settings: Settings, tmp_path: Path) -> None:
    """The default local stack's spark.jars (and so its CDS archive) has no cloud jars; a
    Postgres catalog, an s3:// warehouse or an s3:// archive each adds the spark-cloud set."""
    from backfill_assets.stack import spark

    cloud = {str(p) for p in jars.jars(stack_settings, "spark-cloud")}
    base = {"BACKFILL_JAR_CACHE": str(stack_settings.jar_cache), "BACKFILL_HOME": str(tmp_path)}

    def spark_jars(**env: str) -> set[str]:
        settings = Settings.from_env({**base, **env})
        return set(spark.spark_config(settings)["spark.jars"].split(","))

    assert not spark_jars() & cloud
    pg = "postgresql+psycopg2://127.0.0.1:5432/iceberg_catalog"
    assert cloud <= spark_jars(BACKFILL_CATALOG_URI=pg)
    assert cloud <= spark_jars(BACKFILL_WAREHOUSE="s3://bucket/lake")
    assert cloud <= spark_jars(BACKFILL_ARCHIVE_URI="s3://bucket/archive")
