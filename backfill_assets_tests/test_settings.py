"""The settings module: local defaults, production shapes, and errors that name the variable."""

from __future__ import annotations

import pytest

from backfill_assets.errors import SettingsError
from backfill_assets.stack import catalog, spark
from backfill_assets.stack.settings import Settings


def test_local_defaults_describe_the_embedded_stack(tmp_path: object) -> None:
    s = Settings.from_env({"BACKFILL_HOME": "/tmp/bf-home"})
    assert s.kafka.bootstrap_servers == "127.0.0.1:19092"
    assert s.kafka.local_controller_port == 19093
    assert s.spark_master == "local[2]"
    assert s.catalog.kind == "sql"
    assert s.catalog.uri == "sqlite:////tmp/bf-home/catalog/catalog.db"
    assert s.catalog.warehouse == "file:///tmp/bf-home/warehouse"
    assert s.webserver_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"BACKFILL_KAFKA_PORT": "abc"}, "BACKFILL_KAFKA_PORT"),
        ({"BACKFILL_KAFKA_PORT": "-5"}, "BACKFILL_KAFKA_PORT"),
        (
            {"BACKFILL_KAFKA_PORT": "9000", "BACKFILL_KAFKA_CONTROLLER_PORT": "9000"},
            "BACKFILL_KAFKA_CONTROLLER_PORT",
        ),
        ({"BACKFILL_KAFKA_SECURITY_PROTOCOL": "TLS"}, "SASL_SSL"),
        ({"BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "BACKFILL_KAFKA_SASL_MECHANISM"),
        ({"BACKFILL_CATALOG_KIND": "hive"}, "BACKFILL_CATALOG_KIND"),
        ({"BACKFILL_CATALOG_KIND": "rest"}, "BACKFILL_CATALOG_URI"),
        ({"BACKFILL_CATALOG_URI": "mysql://x"}, "postgresql"),
    ],
)
def test_bad_values_name_the_variable_and_what_is_allowed(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        Settings.from_env(env)


def test_secrets_stay_out_of_repr() -> None:
    s = Settings.from_env(
        {
            "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "BACKFILL_KAFKA_SASL_MECHANISM": "scram-sha-512",
            "BACKFILL_KAFKA_SASL_USERNAME": "svc",
            "BACKFILL_KAFKA_SASL_PASSWORD": "hunter2-secret",
            "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
        }
    )
    assert "hunter2-secret" not in repr(s)
    assert "aws-secret-value" not in repr(s)
    conf = s.kafka.client_config()
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["sasl.password"] == "hunter2-secret"
    jaas = s.kafka.spark_options()["kafka.sasl.jaas.config"]
    assert "ScramLoginModule" in jaas
    assert 'username="svc"' in jaas


def test_production_catalogs_translate_for_both_engines() -> None:
    s = Settings.from_env(
        {
            "BACKFILL_CATALOG_URI": "postgresql+psycopg2://db.internal:5432/iceberg",
            "BACKFILL_CATALOG_JDBC_USER": "iceberg",
            "BACKFILL_CATALOG_JDBC_PASSWORD": "pw",
            "BACKFILL_WAREHOUSE": "s3://lake/warehouse",
            "BACKFILL_S3_ENDPOINT": "http://minio:9000",
        }
    )
    spark_conf = catalog.spark_properties(s.catalog)
    assert spark_conf["spark.sql.catalog.lake.uri"] == "jdbc:postgresql://db.internal:5432/iceberg"
    assert spark_conf["spark.sql.catalog.lake.jdbc.user"] == "iceberg"
    assert spark_conf["spark.sql.catalog.lake.io-impl"] == "org.apache.iceberg.aws.s3.S3FileIO"
    assert spark_conf["spark.sql.catalog.lake.s3.endpoint"] == "http://minio:9000"
    py = catalog.pyiceberg_properties(s.catalog)
    assert py["uri"] == "postgresql+psycopg2://iceberg:pw@db.internal:5432/iceberg"
    assert py["warehouse"] == spark_conf["spark.sql.catalog.lake.warehouse"]

    rest = Settings.from_env(
        {"BACKFILL_CATALOG_KIND": "rest", "BACKFILL_CATALOG_URI": "http://rest:8181"}
    )
    assert catalog.spark_properties(rest.catalog)["spark.sql.catalog.lake.type"] == "rest"
    assert catalog.pyiceberg_properties(rest.catalog)["type"] == "rest"


def test_spark_config_follows_the_master_setting(stack_settings: Settings) -> None:
    local = spark.spark_config(stack_settings)
    assert local["spark.master"] == "local[2]"
    assert local["spark.driver.bindAddress"] == "127.0.0.1"
    assert "iceberg-spark-runtime-4.1_2.13" in local["spark.jars"]
    assert "spark-sql-kafka-0-10_2.13-4.1.3" in local["spark.jars"]
