"""BACKFILL_KAFKA_PROPERTIES: Java-named Kafka client properties reach librdkafka (translated)
and Spark's Kafka source (``kafka.``-prefixed); what the project owns, what no client can
read, and what is unknown is refused naming the setting; secret values stay out of errors.
In-process, no services (the real-broker mTLS test is test_kafka_mtls.py)."""

from __future__ import annotations

import json

import pytest
from confluent_kafka.admin import AdminClient

from backfill_assets.errors import SettingsError
from backfill_assets.stack import kafka_auth
from backfill_assets.stack.settings import Settings, listing

SECRET = "pl4nted-s3cr3t"
OAUTH = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"


def _settings(props: dict[str, object], **env: str) -> Settings:
    return Settings.from_env(
        {
            "BACKFILL_KAFKA_BOOTSTRAP": "k:9093",
            "BACKFILL_KAFKA_PROPERTIES": json.dumps(props),
            **env,
        }
    )


def test_a_pem_keystore_file_is_librdkafkas_certificate_and_key() -> None:
    s = _settings(
        {
            "security.protocol": "ssl",
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": "/etc/kafka/ca.pem",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": "/etc/kafka/client.pem",
            "ssl.key.password": SECRET,
            "ssl.endpoint.identification.algorithm": "",
        }
    )
    assert s.kafka.security_protocol == "SSL"
    assert s.kafka.client_config() == {
        "bootstrap.servers": "k:9093",
        "security.protocol": "SSL",
        "ssl.ca.location": "/etc/kafka/ca.pem",
        "ssl.certificate.location": "/etc/kafka/client.pem",
        "ssl.key.location": "/etc/kafka/client.pem",
        "ssl.key.password": SECRET,
        "ssl.endpoint.identification.algorithm": "none",
    }
    spark = s.kafka.spark_options()
    assert spark["kafka.security.protocol"] == "SSL"
    assert spark["kafka.ssl.keystore.type"] == "PEM"
    assert spark["kafka.ssl.keystore.location"] == "/etc/kafka/client.pem"
    assert spark["kafka.ssl.key.password"] == SECRET
    assert spark["kafka.ssl.endpoint.identification.algorithm"] == ""
    assert spark["kafka.isolation.level"] == "read_committed"
    assert SECRET not in repr(s)


def test_pem_strings_and_a_pkcs12_keystore() -> None:
    pem = _settings(
        {
            "security.protocol": "SSL",
            "ssl.truststore.type": "PEM",
            "ssl.truststore.certificates": "CA-PEM",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.certificate.chain": "CERT-PEM",
            "ssl.keystore.key": "KEY-PEM",
        }
    )
    conf = pem.kafka.client_config()
    assert (conf["ssl.ca.pem"], conf["ssl.certificate.pem"], conf["ssl.key.pem"]) == (
        "CA-PEM",
        "CERT-PEM",
        "KEY-PEM",
    )
    assert pem.kafka.spark_options()["kafka.ssl.keystore.key"] == "KEY-PEM"
    p12 = _settings(
        {
            "security.protocol": "SSL",
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": "/c.p12",
            "ssl.keystore.password": SECRET,
        }
    )
    conf = p12.kafka.client_config()
    assert (conf["ssl.keystore.location"], conf["ssl.keystore.password"]) == ("/c.p12", SECRET)
    assert "ssl.certificate.location" not in conf


def test_oauthbearer_oidc_reaches_both_clients_and_librdkafka_takes_it() -> None:
    jaas = f'{OAUTH} required clientId="backfill" clientSecret="{SECRET}" scope="kafka";'
    s = _settings(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.oauthbearer.token.endpoint.url": "https://127.0.0.1:9/token",
            "sasl.login.callback.handler.class": (
                "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
            ),
            "sasl.jaas.config": jaas,
        }
    )
    conf = s.kafka.client_config()
    assert conf == {
        "bootstrap.servers": "k:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "OAUTHBEARER",
        "sasl.oauthbearer.method": "oidc",
        "sasl.oauthbearer.token.endpoint.url": "https://127.0.0.1:9/token",
        "sasl.oauthbearer.client.id": "backfill",
        "sasl.oauthbearer.client.secret": SECRET,
        "sasl.oauthbearer.scope": "kafka",
    }
    AdminClient({**conf, "log_level": 0})  # librdkafka knows every name (it raises if not)
    spark = s.kafka.spark_options()
    assert spark["kafka.sasl.jaas.config"] == jaas
    assert spark["kafka.sasl.login.callback.handler.class"].endswith("LoginCallbackHandler")
    unsecured = _settings(
        {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.jaas.config": f'{OAUTH} required unsecuredLoginStringClaim_sub="alice";',
        }
    ).kafka.client_config()
    assert unsecured["enable.sasl.oauthbearer.unsecure.jwt"] == "true"
    assert unsecured["sasl.oauthbearer.config"] == "principal=alice"


def test_a_scram_jaas_line_gives_librdkafka_user_and_password() -> None:
    jaas = f'{SCRAM} required username="svc" password="a\\"{SECRET}";'
    s = _settings(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.jaas.config": jaas,
        }
    )
    conf = s.kafka.client_config()
    assert (conf["sasl.username"], conf["sasl.password"]) == ("svc", f'a"{SECRET}')
    assert s.kafka.sasl_mechanism == "SCRAM-SHA-512"


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"bootstrap.servers": "x:1"}, "bootstrap.servers is set by BACKFILL_KAFKA_BOOTSTRAP"),
        ({"isolation.level": "read_uncommitted"}, "isolation.level is set by the project"),
        ({"group.id": "g"}, "group.id is set by the project"),
        ({"auto.offset.reset": "earliest"}, "auto.offset.reset is set by the project"),
        ({"linger.ms": 5}, "'linger.ms' is not a property taken here; allowed: security.protocol"),
        ({"ssl.keystore.location": "/k.jks"}, "ssl.keystore.type must be PEM or PKCS12"),
        (
            {"ssl.truststore.type": "JKS", "ssl.truststore.location": "/t"},
            "ssl.truststore.type must be PEM",
        ),
        ({"ssl.keystore.type": "PKCS12", "ssl.keystore.key": "K"}, "need ssl.keystore.type=PEM"),
        ({"security.protocol": "TLS"}, "security.protocol must be one of PLAINTEXT, SSL"),
        ({"ssl.keystore.key": ["K"]}, "ssl.keystore.key must be a string, number or boolean"),
        ({"security.protocol": "SASL_SSL"}, "needs BACKFILL_KAFKA_SASL_MECHANISM (or sasl.mech"),
        ({"sasl.jaas.config": f"Krb5LoginModule required pw={SECRET};"}, "MODULE one of"),
        ({"sasl.jaas.config": f"{SCRAM} required password {SECRET};"}, "not k=v"),
    ],
)
def test_refused_properties_name_the_setting(props: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as raised:
        _settings(props)
    text = str(raised.value)
    assert "BACKFILL_KAFKA_" in text and message in text
    assert SECRET not in text


@pytest.mark.parametrize("raw", ["{not json", '["security.protocol"]'])
def test_not_a_json_object_is_refused(raw: str) -> None:
    with pytest.raises(SettingsError, match="BACKFILL_KAFKA_PROPERTIES"):
        Settings.from_env({"BACKFILL_KAFKA_PROPERTIES": raw})


def test_a_property_a_setting_stands_for_is_set_in_one_place() -> None:
    with pytest.raises(SettingsError) as raised:
        _settings(
            {"sasl.jaas.config": f'{SCRAM} required username="a" password="{SECRET}";'},
            BACKFILL_KAFKA_SASL_PASSWORD="other",
        )
    assert "sasl.jaas.config is set by BACKFILL_KAFKA_SASL_PASSWORD" in str(raised.value)
    with pytest.raises(SettingsError, match="is set by BACKFILL_KAFKA_SSL_CA_LOCATION"):
        _settings(
            {"ssl.truststore.type": "PEM", "ssl.truststore.location": "/ca.pem"},
            BACKFILL_KAFKA_SSL_CA_LOCATION="/other.pem",
        )


def test_the_sasl_settings_and_the_map_combine() -> None:
    """The SCRAM settings are sugar over the same properties; the map adds a client
    certificate on top (SASL_SSL with mTLS)."""
    s = _settings(
        {"ssl.keystore.type": "PKCS12", "ssl.keystore.location": "/c.p12"},
        BACKFILL_KAFKA_SECURITY_PROTOCOL="SASL_SSL",
        BACKFILL_KAFKA_SASL_MECHANISM="SCRAM-SHA-256",
        BACKFILL_KAFKA_SASL_USERNAME="svc",
        BACKFILL_KAFKA_SASL_PASSWORD=SECRET,
    )
    java = s.kafka.java_properties()
    assert java["security.protocol"] == "SASL_SSL"
    assert java["sasl.jaas.config"] == f'{SCRAM} required username="svc" password="{SECRET}";'
    assert java["ssl.keystore.location"] == "/c.p12"
    conf = s.kafka.client_config()
    assert (conf["sasl.username"], conf["ssl.keystore.location"]) == ("svc", "/c.p12")


def test_secret_properties_are_masked_in_the_listing() -> None:
    props = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "OAUTHBEARER",
        "sasl.jaas.config": f'{OAUTH} required clientId="c" clientSecret="{SECRET}";',
        "ssl.keystore.type": "PEM",
        "ssl.keystore.key": SECRET,
        "ssl.key.password": SECRET,
    }
    rows = {r.variable: r for r in listing({"BACKFILL_KAFKA_PROPERTIES": json.dumps(props)})}
    value = rows["BACKFILL_KAFKA_PROPERTIES"].value
    assert value is not None and SECRET not in value
    assert json.loads(value) == {
        **props,
        "sasl.jaas.config": "***",
        "ssl.keystore.key": "***",
        "ssl.key.password": "***",
    }
    assert kafka_auth.masked("{broken " + SECRET) == "***"
