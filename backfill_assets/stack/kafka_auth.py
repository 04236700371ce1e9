"""Kafka client properties passed through as the Java client names them
(``BACKFILL_KAFKA_PROPERTIES``, read in :mod:`backfill_assets.stack.settings`): checked here,
and translated for librdkafka (confluent-kafka), whose names differ for TLS key material and
which has no JAAS. Spark's Kafka source takes them as they are, ``kafka.``-prefixed.

Only authentication and TLS properties are taken, each with a known librdkafka counterpart, so
that both clients see the same credentials; anything else is refused, naming what is allowed.
Values of secret properties (:func:`is_secret`) never appear in an error message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Literal, get_args

from backfill_assets.errors import SettingsError

VARIABLE = "BACKFILL_KAFKA_PROPERTIES"
MASK = "***"

# Properties the project sets itself, with what owns each.
OWNED = {
    "bootstrap.servers": "BACKFILL_KAFKA_BOOTSTRAP",
    "isolation.level": "the project (read_committed: aborted records never reach a table)",
    "group.id": "the project (it commits no offsets; each reader gets its own group)",
    "auto.offset.reset": "the project (it reads explicit offset ranges)",
    "enable.auto.commit": "the project (it commits no offsets)",
    "max.partition.fetch.bytes": "the project (sized for whole offset ranges)",
    "fetch.max.bytes": "the project (sized for whole offset ranges)",
    "key.deserializer": "the project (bytes)",
    "value.deserializer": "the project (bytes)",
}
# Properties both clients take under the same name and with the same values.
_SAME_NAME = (
    "security.protocol",
    "sasl.mechanism",
    "ssl.key.password",
    "ssl.keystore.password",
    "sasl.oauthbearer.token.endpoint.url",
    "client.id",
)
# Properties librdkafka takes under another name, or derives from others (see librdkafka()).
_TRANSLATED = (
    "sasl.jaas.config",
    "ssl.truststore.type",
    "ssl.truststore.location",
    "ssl.truststore.certificates",
    "ssl.keystore.type",
    "ssl.keystore.location",
    "ssl.keystore.certificate.chain",
    "ssl.keystore.key",
    "ssl.endpoint.identification.algorithm",
)
# Properties only the Java client needs (librdkafka has the behaviour built in).
_JAVA_ONLY = ("sasl.login.callback.handler.class",)
ALLOWED = _SAME_NAME + _TRANSLATED + _JAVA_ONLY
# The security protocols and SASL mechanisms both clients take (BACKFILL_KAFKA_SECURITY_PROTOCOL
# and BACKFILL_KAFKA_SASL_MECHANISM are these types).
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]
PROTOCOLS: tuple[str, ...] = get_args(SecurityProtocol)
MECHANISMS: tuple[str, ...] = get_args(SaslMechanism)
_SECRET = re.compile(r"(?i)password|secret|jaas|token|credential|ssl\.keystore\.key$")
_EXAMPLE = (
    'e.g. {"security.protocol": "SSL", "ssl.keystore.type": "PEM", '
    '"ssl.keystore.location": "/etc/kafka/client.pem"}'
)


def is_secret(name: str) -> bool:
    """Whether property ``name`` holds a secret (a password, key material, a JAAS line)."""
    return _SECRET.search(name) is not None


def parse(raw: str) -> dict[str, str]:
    """``BACKFILL_KAFKA_PROPERTIES``: a JSON object of Java client property names to strings
    (numbers and booleans are taken as strings); checked, never echoing a secret value."""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{VARIABLE} is not valid JSON ({exc.msg}); {_EXAMPLE}") from None
    if not isinstance(doc, dict):
        raise SettingsError(f"{VARIABLE} must be a JSON object of Kafka client properties")
    props: dict[str, str] = {}
    for name, value in doc.items():
        if name in OWNED:
            raise SettingsError(f"{VARIABLE}: {name} is set by {OWNED[name]}, not here")
        if name not in ALLOWED:
            raise SettingsError(
                f"{VARIABLE}: {name!r} is not a property taken here; allowed: {', '.join(ALLOWED)}"
            )
        if isinstance(value, bool):
            props[name] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            props[name] = str(value)
        else:
            raise SettingsError(f"{VARIABLE}: {name} must be a string, number or boolean")
    check(props)
    return props


def check(props: Mapping[str, str]) -> None:
    """Refuse combinations one of the two clients cannot take (librdkafka reads no JKS)."""
    where = VARIABLE
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise SettingsError(f"{where}: security.protocol must be one of {', '.join(PROTOCOLS)}")
    mechanism = props.get("sasl.mechanism")
    if mechanism is not None and mechanism.upper() not in MECHANISMS:
        raise SettingsError(f"{where}: sasl.mechanism must be one of {', '.join(MECHANISMS)}")
    truststore = props.get("ssl.truststore.type", "").upper()
    if truststore != "PEM" and (truststore or _has(props, "ssl.truststore")):
        raise SettingsError(
            f"{where}: ssl.truststore.type must be PEM (librdkafka reads PEM CAs only)"
        )
    keystore = props.get("ssl.keystore.type", "").upper()
    if keystore not in ("PEM", "PKCS12") and (keystore or _has(props, "ssl.keystore")):
        raise SettingsError(
            f"{where}: ssl.keystore.type must be PEM or PKCS12 (librdkafka reads no JKS)"
        )
    pem_fields = ("ssl.keystore.certificate.chain", "ssl.keystore.key")
    if any(name in props for name in pem_fields) and keystore != "PEM":
        raise SettingsError(f"{where}: {' and '.join(pem_fields)} need ssl.keystore.type=PEM")
    if keystore == "PEM" and "ssl.keystore.password" in props:
        raise SettingsError(
            f"{where}: a PEM keystore takes ssl.key.password (an encrypted key), not "
            "ssl.keystore.password"
        )
    if "sasl.jaas.config" in props:
        jaas_options(props["sasl.jaas.config"])


def _has(props: Mapping[str, str], prefix: str) -> bool:
    return any(name.startswith(prefix + ".") and name != prefix + ".type" for name in props)


_JAAS = re.compile(r"\s*(\S+)\s+(required|requisite|sufficient|optional)\s+(.*?)\s*;?\s*$", re.S)
_JAAS_OPTION = re.compile(r'\s*([A-Za-z0-9_.]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s";]+)')
_MODULES = {
    "PlainLoginModule": "plain",
    "ScramLoginModule": "scram",
    "OAuthBearerLoginModule": "oauthbearer",
}


def jaas_options(line: str) -> tuple[str, dict[str, str]]:
    """The login module's kind (``plain``, ``scram``, ``oauthbearer``) and the options of a
    ``sasl.jaas.config`` line; raises :class:`SettingsError` (without the line's text)."""
    match = _JAAS.fullmatch(line)
    module = match.group(1).rsplit(".", 1)[-1] if match else ""
    if match is None or module not in _MODULES:
        raise SettingsError(
            f"{VARIABLE}: sasl.jaas.config must be 'MODULE required key=\"value\" ...;' with "
            f"MODULE one of {', '.join(_MODULES)} (Kafka's org.apache.kafka.common.security.*)"
        )
    options: dict[str, str] = {}
    rest = match.group(3)
    while rest.strip():
        option = _JAAS_OPTION.match(rest)
        if option is None:
            raise SettingsError(f"{VARIABLE}: sasl.jaas.config has an option that is not k=v")
        value = option.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        options[option.group(1)] = value
        rest = rest[option.end() :]
    return _MODULES[module], options


def librdkafka(props: Mapping[str, str]) -> dict[str, str]:
    """The librdkafka (confluent-kafka) configuration of Java-named ``props`` (checked)."""
    conf = {name: props[name] for name in _SAME_NAME if name in props}
    if "security.protocol" in conf:
        conf["security.protocol"] = conf["security.protocol"].upper()
    if "sasl.oauthbearer.token.endpoint.url" in conf:
        conf["sasl.oauthbearer.method"] = "oidc"
    if "ssl.truststore.location" in props:
        conf["ssl.ca.location"] = props["ssl.truststore.location"]
    if "ssl.truststore.certificates" in props:
        conf["ssl.ca.pem"] = props["ssl.truststore.certificates"]
    conf.update(_keystore(props))
    algorithm = props.get("ssl.endpoint.identification.algorithm")
    if algorithm is not None:
        conf["ssl.endpoint.identification.algorithm"] = algorithm.lower() or "none"
    if "sasl.jaas.config" in props:
        conf.update(_jaas(props["sasl.jaas.config"]))
    return conf


def _keystore(props: Mapping[str, str]) -> dict[str, str]:
    """The client certificate and key: a PEM keystore file holds both (librdkafka reads each
    from it), PEM strings go as strings, a PKCS#12 file goes as it is."""
    conf: dict[str, str] = {}
    pem = props.get("ssl.keystore.type", "").upper() == "PEM"
    if "ssl.keystore.location" in props:
        location = props["ssl.keystore.location"]
        if pem:
            conf["ssl.certificate.location"] = location
            conf["ssl.key.location"] = location
        else:
            conf["ssl.keystore.location"] = location
    if "ssl.keystore.certificate.chain" in props:
        conf["ssl.certificate.pem"] = props["ssl.keystore.certificate.chain"]
    if "ssl.keystore.key" in props:
        conf["ssl.key.pem"] = props["ssl.keystore.key"]
    return conf


def _jaas(line: str) -> dict[str, str]:
    """librdkafka's SASL credentials from a JAAS line: user and password (PLAIN, SCRAM); the
    OIDC client credentials, or an unsecured token's subject (OAUTHBEARER)."""
    kind, options = jaas_options(line)
    if kind != "oauthbearer":
        return {f"sasl.{key}": options[key] for key in ("username", "password") if key in options}
    conf = {
        target: options[source]
        for source, target in (
            ("clientId", "sasl.oauthbearer.client.id"),
            ("clientSecret", "sasl.oauthbearer.client.secret"),
            ("scope", "sasl.oauthbearer.scope"),
        )
        if source in options
    }
    if "unsecuredLoginStringClaim_sub" in options:
        conf["enable.sasl.oauthbearer.unsecure.jwt"] = "true"
        conf["sasl.oauthbearer.config"] = f"principal={options['unsecuredLoginStringClaim_sub']}"
    return conf


def masked(raw: str) -> str:
    """``BACKFILL_KAFKA_PROPERTIES`` fit to print: secret properties' values are ``***``; a
    value that is not a JSON object is masked whole (it cannot be told apart)."""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        return MASK
    if not isinstance(doc, dict):
        return MASK
    return json.dumps({k: MASK if is_secret(str(k)) else v for k, v in doc.items()})
