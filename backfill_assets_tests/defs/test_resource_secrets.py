"""Secrets are resource config shown as EnvVars: the Dagster UI (the repository snapshot it
reads) names the variable, never the value; the value still reaches the clients; unset
variables leave the resources as they were."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.remote_representation.external_data import (
    RepositorySnap,
    ResourceConfigEnvVarSnap,
)
from dagster._serdes import serialize_value

from backfill_assets.defs.definitions import build_defs, build_resources
from backfill_assets.defs.resources import IcebergResource, KafkaResource, SparkResource
from backfill_assets.spec.loader import load_specs

# Dagster's own snapshot code reads a deprecated schedule property.
SNAPSHOT_WARNING = pytest.mark.filterwarnings(
    "ignore:Property `ScheduleDefinition.environment_vars`:DeprecationWarning"
)
SECRETS = {
    "BACKFILL_KAFKA_SASL_PASSWORD": "sasl-pw-7f3a91",
    "BACKFILL_CATALOG_JDBC_PASSWORD": "jdbc-pw-2c8e44",
    "AWS_ACCESS_KEY_ID": "AKIA-key-id-5d1b07",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-9e6c12",
    "BACKFILL_SCHEMA_REGISTRY_TOKEN": "reg-token-4a0d63",
    "BACKFILL_SPARK_CONNECT_TOKEN": "connect-token-8b2f19",
}
# Settings that carry secrets inside a JSON value: the whole variable is an EnvVar.
INSIDE = {
    "BACKFILL_KAFKA_PROPERTIES": ("kafka-props-secret-31c7", '{"ssl.key.password": "%s"}'),
    "BACKFILL_CATALOG_PROPERTIES": ("catalog-props-secret-6e90", '{"header.X-Key": "%s"}'),
    "BACKFILL_SPARK_CONF": ("spark-conf-secret-0d44", '{"spark.hadoop.fs.s3a.secret.key": "%s"}'),
}
# Which resource holds each variable, under which field.
FIELDS = {
    "kafka": {
        "sasl_password": "BACKFILL_KAFKA_SASL_PASSWORD",
        "kafka_properties": "BACKFILL_KAFKA_PROPERTIES",
        "schema_registry_token": "BACKFILL_SCHEMA_REGISTRY_TOKEN",
        "s3_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    },
    "iceberg": {
        "catalog_jdbc_password": "BACKFILL_CATALOG_JDBC_PASSWORD",
        "catalog_properties": "BACKFILL_CATALOG_PROPERTIES",
        "s3_access_key_id": "AWS_ACCESS_KEY_ID",
    },
    "spark": {
        "catalog_properties": "BACKFILL_CATALOG_PROPERTIES",
        "spark_connect_token": "BACKFILL_SPARK_CONNECT_TOKEN",
        "spark_conf": "BACKFILL_SPARK_CONF",
        "s3_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    },
}


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Every secret variable set; the values to look for (the JSON ones: the secret inside)."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    for name, (secret, template) in INSIDE.items():
        monkeypatch.setenv(name, template % secret)
    return {**SECRETS, **{name: secret for name, (secret, _) in INSIDE.items()}}


@SNAPSHOT_WARNING
def test_the_ui_shows_env_vars_never_values(secrets: dict[str, str]) -> None:
    defs = build_defs(load_specs())
    snap = RepositorySnap.from_def(defs.get_repository_def(), defer_snapshots=True)
    resources = {r.name: r for r in snap.resources or []}
    env = ResourceConfigEnvVarSnap
    for resource, fields in FIELDS.items():
        values = resources[resource].configured_values
        for field, variable in fields.items():
            assert values[field] == env(name=variable), (resource, field)
    assert set(snap.utilized_env_vars or {}) >= set(secrets)
    shown = serialize_value(snap)
    leaked = [value for value in secrets.values() if value in shown]
    assert not leaked, f"secret values in the repository snapshot: {leaked}"


def test_the_values_reach_the_clients_and_stay_out_of_reprs(secrets: dict[str, str]) -> None:
    resources = build_resources()
    kafka = resources["kafka"]
    iceberg = resources["iceberg"]
    assert isinstance(kafka, KafkaResource) and isinstance(iceberg, IcebergResource)
    live_kafka = kafka.process_config_and_initialize()
    live_iceberg = iceberg.process_config_and_initialize()
    settings = live_kafka.client().settings
    assert settings.kafka.sasl_password == secrets["BACKFILL_KAFKA_SASL_PASSWORD"]
    assert settings.catalog.s3_secret_access_key == secrets["AWS_SECRET_ACCESS_KEY"]
    catalog = live_iceberg.client().settings.catalog
    assert catalog.jdbc_password == secrets["BACKFILL_CATALOG_JDBC_PASSWORD"]
    assert catalog.s3_access_key_id == secrets["AWS_ACCESS_KEY_ID"]
    assert live_iceberg.settings.catalog.s3_secret_access_key == secrets["AWS_SECRET_ACCESS_KEY"]
    assert settings.schema_registry_token == secrets["BACKFILL_SCHEMA_REGISTRY_TOKEN"]
    kafka_props = settings.kafka.java_properties()
    assert kafka_props["ssl.key.password"] == secrets["BACKFILL_KAFKA_PROPERTIES"]
    for shown in (repr(live_kafka), repr(live_iceberg), repr(settings)):
        leaked = [name for name, value in secrets.items() if value in shown]
        assert leaked == [], shown


def test_configured_secrets_reach_spark_and_the_catalog(secrets: dict[str, str]) -> None:
    """A value configured on a resource (not the variable's) is what its clients get, for the
    secrets inside JSON settings too."""
    props = '{"header.X-Key": "from-config"}'
    live = IcebergResource(catalog_properties=props).process_config_and_initialize()
    assert live.settings.catalog.properties["header.X-Key"] == "from-config"
    conf = '{"spark.hadoop.fs.s3a.secret.key": "conf-from-config"}'
    kafka = KafkaResource(schema_registry_token="tok-from-config", kafka_properties=None)
    assert kafka.process_config_and_initialize().client().settings.schema_registry_token == (
        "tok-from-config"
    )
    assert SparkResource(spark_conf=conf).spark_conf == conf


def test_a_configured_value_wins_over_the_environment(secrets: dict[str, str]) -> None:
    live = KafkaResource(sasl_password="from-config").process_config_and_initialize()
    assert live.client().settings.kafka.sasl_password == "from-config"


def test_a_configured_value_wins_and_the_rest_comes_from_every_source(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run worker whose resource holds a secret reads the other settings as every entry
    point does: the .env of its working directory and the settings file too."""
    path = settings_sandbox.parent / "settings.toml"
    path.write_text('BACKFILL_KAFKA_PORT = 29092\nBACKFILL_KAFKA_SASL_USERNAME = "svc"\n')
    (settings_sandbox / ".env").write_text("BACKFILL_KAFKA_SASL_PASSWORD=from-env-file\n")
    monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
    live = KafkaResource(sasl_password="from-config").process_config_and_initialize()
    kafka = live.client().settings.kafka
    assert (kafka.sasl_password, kafka.sasl_username, kafka.local_port) == (
        "from-config",
        "svc",
        29092,
    )


@SNAPSHOT_WARNING
def test_unset_variables_leave_the_resources_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRETS:
        monkeypatch.delenv(name, raising=False)
    defs = build_defs(load_specs())
    snap = RepositorySnap.from_def(defs.get_repository_def(), defer_snapshots=True)
    for resource in snap.resources or []:
        assert not any(
            isinstance(v, ResourceConfigEnvVarSnap) for v in resource.configured_values.values()
        ), resource.name
    live = KafkaResource().process_config_and_initialize()
    assert live.client()._settings is None  # reads the environment at each call, as before
    assert live.client().settings.kafka.sasl_password is None
    # A variable set later (e.g. in the run's environment) is still read by the clients.
    monkeypatch.setenv("BACKFILL_KAFKA_SASL_PASSWORD", "late")
    assert live.client().settings.kafka.sasl_password == "late"
    assert isinstance(dg.EnvVar("X"), str)
