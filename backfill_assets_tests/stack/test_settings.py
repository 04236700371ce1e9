"""The settings module: local defaults, production shapes, and errors that name the variable."""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

import pytest
import yaml

from backfill_assets.errors import SettingsError
from backfill_assets.stack import catalog, spark
from backfill_assets.stack import settings as settings_module
from backfill_assets.stack.settings import REPO_ROOT, Settings, listing

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def test_local_defaults_describe_the_embedded_stack(tmp_path: object) -> None:
    s = Settings.from_env({"BACKFILL_HOME": "/tmp/bf-home"})
    assert s.kafka.bootstrap_servers == "127.0.0.1:19092"
    assert s.kafka.local_controller_port == 19093
    assert s.spark_master == "local[2]"
    assert s.catalog.kind == "sql"
    assert s.catalog.uri == "sqlite:////tmp/bf-home/catalog/catalog.db"
    assert s.catalog.warehouse == "file:///tmp/bf-home/warehouse"
    assert s.webserver_host == "127.0.0.1"
    assert s.run_executor == "in_process"
    assert (s.content_sample, s.content_sample_above) == (16, 50_000)
    assert s.sensor_interval_s == 120
    assert Settings.from_env({"BACKFILL_SENSOR_INTERVAL_S": "10"}).sensor_interval_s == 10
    assert s.gap_read_budget == 500_000
    assert Settings.from_env({"BACKFILL_GAP_READ_BUDGET": "1000"}).gap_read_budget == 1000


def test_a_throttled_process_gets_half_the_local_cores_unless_the_master_is_set() -> None:
    """Live consumers keep a core beside a throttled backfill, with the default settings."""
    throttled = {"BACKFILL_HOME": "/tmp/bf-home", "BACKFILL_REPLAY_MAX_RECORDS_PER_S": "2000"}
    assert Settings.from_env(throttled).spark_master == "local[1]"
    assert Settings.from_env(
        {**throttled, "BACKFILL_REPLAY_MAX_RECORDS_PER_S": "0"}
    ).spark_master == ("local[2]")
    explicit = {**throttled, "BACKFILL_SPARK_MASTER": "local[2]"}
    assert Settings.from_env(explicit).spark_master == "local[2]"


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
        ({"BACKFILL_RUN_EXECUTOR": "threads"}, "BACKFILL_RUN_EXECUTOR.*in_process.*multiprocess"),
        ({"BACKFILL_CONTENT_SAMPLE": "0"}, "BACKFILL_CONTENT_SAMPLE='0'.* from 1 .* to 1024"),
        ({"BACKFILL_CONTENT_SAMPLE": "4096"}, "BACKFILL_CONTENT_SAMPLE='4096'.* to 1024"),
        ({"BACKFILL_CONTENT_SAMPLE": "1/16"}, "BACKFILL_CONTENT_SAMPLE='1/16'"),
        ({"BACKFILL_CONTENT_SAMPLE_ABOVE": "lots"}, "BACKFILL_CONTENT_SAMPLE_ABOVE"),
        ({"BACKFILL_MAX_HOURS_PER_RUN": "0"}, "BACKFILL_MAX_HOURS_PER_RUN='0' .* 1 to 8760"),
        ({"BACKFILL_MAX_HOURS_PER_RUN": "9000"}, "BACKFILL_MAX_HOURS_PER_RUN='9000' .* 1 to 8760"),
        ({"BACKFILL_SENSOR_INTERVAL_S": "0"}, "BACKFILL_SENSOR_INTERVAL_S='0' must be a positive"),
        ({"BACKFILL_SENSOR_INTERVAL_S": "2m"}, "BACKFILL_SENSOR_INTERVAL_S='2m' is not a whole"),
        (
            {"BACKFILL_SENSOR_INTERVAL_S": "90000"},
            "BACKFILL_SENSOR_INTERVAL_S='90000' .* 1 to 86400",
        ),
        ({"BACKFILL_GAP_READ_BUDGET": "0"}, "BACKFILL_GAP_READ_BUDGET='0' must be a positive"),
        ({"BACKFILL_SCHEMA_REGISTRY_URL": "registry:8081"}, "BACKFILL_SCHEMA_REGISTRY_URL"),
        (
            {"BACKFILL_SCHEMA_REGISTRY_PORT": "99999"},
            "BACKFILL_SCHEMA_REGISTRY_PORT='99999'.*1 to 65535",
        ),
    ],
)
def test_bad_values_name_the_variable_and_what_is_allowed(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        Settings.from_env(env)


def test_schema_registry_is_the_local_one_unless_a_url_is_set() -> None:
    local = Settings.from_env({"BACKFILL_SCHEMA_REGISTRY_PORT": "18555"})
    assert local.schema_registry_url == "http://127.0.0.1:18555/apis/ccompat/v7"
    assert local.schema_registry_url_setting is None
    remote = Settings.from_env({"BACKFILL_SCHEMA_REGISTRY_URL": "https://sr.example.internal/"})
    assert remote.schema_registry_url == "https://sr.example.internal"


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


def test_catalog_properties_reach_both_engines_and_secrets_stay_off_the_command_line() -> None:
    """BACKFILL_CATALOG_PROPERTIES reaches pyiceberg's properties and Spark's catalog settings
    (the classic builder and the Spark Connect server's properties file both take
    spark_config); the secret ones go to a new driver JVM in a properties file, not
    on spark-submit's command line; the listing masks them."""
    props = {
        "credential": "client:cl13nt-s3cret",
        "scope": "catalog",
        "header.X-Tenant": "lake",
        "rest.sigv4-enabled": True,
    }
    env = {
        "BACKFILL_CATALOG_KIND": "rest",
        "BACKFILL_CATALOG_URI": "https://rest.internal",
        "BACKFILL_CATALOG_PROPERTIES": json.dumps(props),
    }
    s = Settings.from_env(env)
    py = catalog.pyiceberg_properties(s.catalog)
    assert py["credential"] == "client:cl13nt-s3cret" and py["rest.sigv4-enabled"] == "true"
    assert py["header.X-Tenant"] == "lake" and py["uri"] == "https://rest.internal"
    conf = spark.spark_config(s)
    assert conf["spark.sql.catalog.lake.credential"] == "client:cl13nt-s3cret"
    assert conf["spark.sql.catalog.lake.scope"] == "catalog"
    assert spark.secret_settings(conf) == {
        "spark.sql.catalog.lake.credential": "client:cl13nt-s3cret"
    }
    # Spark's UI and event log redact it (its default regex would not).
    assert re.search(conf["spark.redaction.regex"], "spark.sql.catalog.lake.credential")
    assert re.search(conf["spark.redaction.regex"], "spark.sql.catalog.lake.header.Authorization")
    assert "cl13nt-s3cret" not in repr(s)
    shown = {r.variable: r.value for r in listing(env)}["BACKFILL_CATALOG_PROPERTIES"]
    assert shown is not None and "cl13nt-s3cret" not in shown and '"scope": "catalog"' in shown


@pytest.mark.parametrize(
    ("props", "owner"),
    [
        ({"uri": "x"}, "'uri' is set by BACKFILL_CATALOG_URI"),
        ({"warehouse": "s3://x"}, "'warehouse' is set by BACKFILL_WAREHOUSE"),
        ({"type": "hive"}, "'type' is set by BACKFILL_CATALOG_KIND"),
        ({"catalog-impl": "x.Y"}, "'catalog-impl' is set by BACKFILL_CATALOG_KIND"),
        ({"jdbc.password": "pw"}, "'jdbc.password' is set by BACKFILL_CATALOG_JDBC_USER"),
        ({"spark.sql.catalog.lake.token": "t"}, "not an Iceberg catalog property"),
        ({"token": {"nested": 1}}, "'token' must be a string"),
        (["token"], "must be a JSON object"),
    ],
)
def test_catalog_properties_the_project_owns_are_refused(props: object, owner: str) -> None:
    env = {"BACKFILL_CATALOG_PROPERTIES": json.dumps(props)}
    with pytest.raises(SettingsError, match=r"^BACKFILL_CATALOG_PROPERTIES") as caught:
        Settings.from_env(env)
    assert owner in str(caught.value)


def test_invalid_catalog_properties_json_does_not_echo_the_text() -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_env({"BACKFILL_CATALOG_PROPERTIES": '{"token": "tok-s3cret",'})
    assert "tok-s3cret" not in str(caught.value)


def test_spark_config_follows_the_master_setting(stack_settings: Settings) -> None:
    local = spark.spark_config(stack_settings)
    assert local["spark.master"] == "local[2]"
    assert local["spark.driver.bindAddress"] == "127.0.0.1"
    assert "iceberg-spark-runtime-4.1_2.13" in local["spark.jars"]
    assert "spark-sql-kafka-0-10_2.13-4.1.3" in local["spark.jars"]


def test_spark_core_settings_reach_the_session_builder(stack_env: dict[str, str]) -> None:
    env = {
        **stack_env,
        "BACKFILL_SPARK_MASTER": "spark://spark-master.example.internal:7077",
        "BACKFILL_SPARK_DRIVER_MEMORY": "3G",
        "BACKFILL_SPARK_EXECUTOR_MEMORY": "6g",
        "BACKFILL_SPARK_EXECUTOR_CORES": "3",
        "BACKFILL_SPARK_CONF": '{"spark.executor.instances": 4, "spark.speculation": false}',
    }
    conf = spark.spark_config(Settings.from_env(env), {"spark.sql.adaptive.enabled": False})
    assert conf["spark.master"] == "spark://spark-master.example.internal:7077"
    assert conf["spark.driver.memory"] == "3g"
    assert conf["spark.executor.memory"] == "6g"
    assert conf["spark.executor.cores"] == "3"
    assert conf["spark.executor.instances"] == "4"
    assert conf["spark.speculation"] == "false"
    assert conf["spark.sql.adaptive.enabled"] == "false"  # the resource's overrides come last
    # Unset: Spark's own defaults, nothing in the builder.
    local = spark.spark_config(Settings.from_env(stack_env))
    assert local["spark.driver.memory"] == "2g"
    assert "spark.executor.memory" not in local
    assert "spark.executor.cores" not in local


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"BACKFILL_SPARK_EXECUTOR_MEMORY": "lots"}, "BACKFILL_SPARK_EXECUTOR_MEMORY='lots'"),
        ({"BACKFILL_SPARK_DRIVER_MEMORY": "2 GB"}, "BACKFILL_SPARK_DRIVER_MEMORY"),
        ({"BACKFILL_SPARK_EXECUTOR_CORES": "0"}, "BACKFILL_SPARK_EXECUTOR_CORES"),
        ({"BACKFILL_SPARK_CONF": "spark.a=1"}, "BACKFILL_SPARK_CONF is not valid JSON"),
        ({"BACKFILL_SPARK_CONF": '["spark.a"]'}, "JSON object"),
        ({"BACKFILL_SPARK_CONF": '{"fs.s3a.x": "1"}'}, "'fs.s3a.x' is not a Spark setting"),
        (
            {"BACKFILL_SPARK_CONF": '{"spark.executor.memory": "4g"}'},
            "spark.executor.memory is set by BACKFILL_SPARK_EXECUTOR_MEMORY",
        ),
        ({"BACKFILL_SPARK_CONF": '{"spark.sql.catalog.lake.uri": "x"}'}, "BACKFILL_CATALOG_"),
        ({"BACKFILL_SPARK_CONF": '{"spark.a": {"b": 1}}'}, "string, number or boolean"),
    ],
)
def test_bad_spark_settings_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(names)):
        Settings.from_env(env)


def test_running_session_was_built_with_the_settings_and_says_what_it_cannot_change(
    stack_env: dict[str, str],
    spark_session: SparkSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = spark_session.sparkContext.getConf()
    assert running.get("spark.driver.memory") == "2g"
    assert running.get("spark.sql.catalog.lake") == "org.apache.iceberg.spark.SparkCatalog"
    caplog.set_level(logging.WARNING, logger=spark.__name__)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == spark.__name__]

    # The same settings again: the running session is reused without a word.
    assert spark.get_session(Settings.from_env(stack_env)) is spark_session
    assert warnings() == []
    # A core setting the running session cannot take is named, with the variable that set it.
    env = {**stack_env, "BACKFILL_SPARK_EXECUTOR_MEMORY": "3g"}
    assert spark.get_session(Settings.from_env(env)) is spark_session
    messages = warnings()
    assert len(messages) == 1, messages
    assert "spark.executor.memory=(Spark default), not 3g" in messages[0]
    assert "BACKFILL_SPARK_EXECUTOR_MEMORY" in messages[0]


def test_both_sensors_tick_at_the_configured_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.defs.sensors import build_gap_sensor, build_late_data_sensor

    for value, expected in ((None, 120), ("7", 7)):
        if value is None:
            monkeypatch.delenv("BACKFILL_SENSOR_INTERVAL_S", raising=False)
        else:
            monkeypatch.setenv("BACKFILL_SENSOR_INTERVAL_S", value)
        for build in (build_gap_sensor, build_late_data_sensor):
            assert build(SPECS[0], SPECS).minimum_interval_seconds == expected


PRODUCTION = REPO_ROOT / "infra" / "production"
# The deployment descriptions whose environment variables must be real settings.
DEPLOYMENT_FILES = (
    "docker-compose.yml",
    "Dockerfile",
    "k8s/values.yaml",
    "k8s/spark-cluster.yaml",
    "k8s/README.md",
    "postgres/10-iceberg-catalog.sh",
)
_ENV_NAME = re.compile(r"\b(?:BACKFILL|AWS|DAGSTER_POSTGRES)_[A-Z0-9_]*[A-Z0-9]")


def _names_the_code_reads() -> set[str]:
    """Every variable settings.py reads (the fields of its Environment model), and those
    production/dagster.yaml reads (``env:``)."""
    names = set(settings_module.Environment.model_fields)
    names |= set(re.findall(r"env:\s*([A-Z][A-Z0-9_]*)", (PRODUCTION / "dagster.yaml").read_text()))
    return names


def test_deployment_files_parse_and_name_only_real_settings() -> None:
    """The compose file, the Dockerfile and the k8s files set no BACKFILL_*, AWS_* or
    DAGSTER_POSTGRES_* variable that neither settings.py nor production/dagster.yaml reads: a
    misspelt or retired name would be silently ignored by the deployment."""
    known = _names_the_code_reads()
    assert {"BACKFILL_SPARK_CONNECT", "BACKFILL_MAINTENANCE_CRON", "DAGSTER_POSTGRES_HOST"} <= known
    unknown: dict[str, set[str]] = {}
    for name in DEPLOYMENT_FILES:
        path = PRODUCTION / name
        text = path.read_text()
        if path.suffix in (".yml", ".yaml"):
            assert list(yaml.safe_load_all(text)), name
        found = set(_ENV_NAME.findall(text)) - known
        if found:
            unknown[name] = found
    assert not unknown, f"names no code reads: {unknown}"


def test_compose_file_sets_the_shape_the_cluster_tier_ran() -> None:
    """docker-compose.yml points the project at what support/cluster_stack.py ran: the JDBC
    catalog on Postgres, S3 warehouse and archive, SASL_SSL + SCRAM-SHA-512 Kafka with a CA
    bundle, and runs as Spark Connect clients; each value is a valid setting."""
    compose = yaml.safe_load((PRODUCTION / "docker-compose.yml").read_text())
    env = {k: str(v) for k, v in compose["x-backfill-env"].items()}
    tested = {
        "BACKFILL_CATALOG_KIND": "sql",
        "BACKFILL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "BACKFILL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    }
    assert {k: env.get(k) for k in tested} == tested
    assert env["BACKFILL_CATALOG_URI"].startswith("postgresql+psycopg2://")
    assert env["BACKFILL_WAREHOUSE"].startswith("s3://")
    assert env["BACKFILL_ARCHIVE_URI"].startswith("s3://")
    assert env["BACKFILL_KAFKA_SSL_CA_LOCATION"]
    settings = Settings.from_env({k: re.sub(r"\$\{[^}]*\}", "x", v) for k, v in env.items()})
    assert settings.spark_connect == env["BACKFILL_SPARK_CONNECT"]
    assert spark.needs_cloud_jars(settings)
