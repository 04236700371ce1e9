"""The one place where local and production differ.

Every environment-specific value is a named setting read from ``BACKFILL_*`` environment
variables (plus the standard ``AWS_*`` ones for object storage). Nothing else in the package
calls ``os.environ``. Defaults describe the embedded local stack: a KRaft broker on 127.0.0.1,
Spark ``local[2]``, a SQLite SQL catalog with a ``file://`` warehouse, all under ``.stack/``.
``infra/README.md`` lists every variable and a production example; ``backfill-assets
settings`` lists each with its current value, its default and its source (:func:`listing`,
derived from the reads of :meth:`Settings.from_env` itself, secrets masked).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from backfill_assets.errors import SettingsError
from backfill_assets.stack import kafka_auth

REPO_ROOT = Path(__file__).resolve().parents[2]
# State (broker data, catalog, jars, Dagster storage) lives in the checkout's .stack/ when the
# package runs from a source checkout, else (a wheel install) in the user's home.
DEFAULT_HOME = (
    REPO_ROOT / ".stack"
    if (REPO_ROOT / "pyproject.toml").is_file()
    else Path.home() / ".backfill_assets"
)

CatalogKind = Literal["sql", "rest"]
RunExecutor = Literal["in_process", "multiprocess"]
_SECURITY_PROTOCOLS = kafka_auth.PROTOCOLS
_SASL_MECHANISMS = kafka_auth.MECHANISMS


# librdkafka's pause when its queue is full, for consumers of whole offset ranges (see
# KafkaSettings.range_reader_config).
READER_QUEUE_BACKOFF_MS = 10
# Spark's Kafka consumers (Java client) fetch whole offset ranges in pieces of this size per
# partition and request (the client's defaults: 1 MiB and 50 MiB); their buffers are on the
# JVM heap, which the local driver sizes up front.
SPARK_PARTITION_FETCH_BYTES = 8 << 20
SPARK_FETCH_BYTES = 64 << 20
# Records a gap-sensor tick reads from the offsets no publish covers, before it probes the rest
# by ListOffsets-by-timestamp (BACKFILL_GAP_READ_BUDGET;
# backfill_assets.lake.coverage.detect.kafka_hours).
GAP_READ_BUDGET = 500_000


@dataclass(frozen=True)
class KafkaSettings:
    """How to reach Kafka, and how the embedded local broker is laid out."""

    bootstrap_servers: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_ca_location: str | None = None
    local_port: int = 19092
    local_controller_port: int = 19093
    local_heap: str = "512m"
    # The local brokers' own TLS key and certificate (PEM: unencrypted PKCS#8 key, certificate,
    # CA chain), for BACKFILL_KAFKA_SECURITY_PROTOCOL=SASL_SSL; their truststore is
    # ssl_ca_location. Clients never read it.
    local_ssl_keystore: str | None = None

    # Java-named client properties (BACKFILL_KAFKA_PROPERTIES, stack/kafka_auth.py) other than
    # security.protocol and sasl.mechanism, which are the fields above.
    properties: Mapping[str, str] = field(default_factory=dict, repr=False)

    def java_properties(self) -> dict[str, str]:
        """Every client property as the Java client names it, secrets included (never log the
        result): the SASL/CA settings' sugar and BACKFILL_KAFKA_PROPERTIES."""
        props = sugar_properties(
            self.security_protocol,
            self.sasl_mechanism,
            self.sasl_username,
            self.sasl_password,
            self.ssl_ca_location,
        )
        return {**props, **self.properties}

    def client_config(self) -> dict[str, str | int | float | bool]:
        """librdkafka (confluent-kafka) settings, secrets included: never log the result."""
        conf: dict[str, str | int | float | bool] = {"bootstrap.servers": self.bootstrap_servers}
        conf.update(kafka_auth.librdkafka(self.java_properties()))
        return conf

    def range_reader_config(self) -> dict[str, str | int | float | bool]:
        """:meth:`client_config` for a consumer that reads a fixed offset range start to end
        (the window scan, the archiver). librdkafka stops fetching for a second
        (``fetch.queue.backoff.ms``, default 1000) whenever its local queue is full, which a
        reader that drains the queue in batches hits again and again: a 489,394-record range
        took 2.4 s to consume, 0.6 s with a 10 ms backoff (bench/README.md), with the same
        queue bound and so the same memory."""
        return {**self.client_config(), "fetch.queue.backoff.ms": READER_QUEUE_BACKOFF_MS}

    def spark_options(self) -> dict[str, str]:
        """Options for Spark's Kafka source (``kafka.``-prefixed Java client settings)."""
        # Committed reads only: records of aborted transactions must never reach a table.
        opts = {
            "kafka.bootstrap.servers": self.bootstrap_servers,
            "kafka.isolation.level": "read_committed",
            # Whole offset ranges: larger fetches than the Java client's 1 MiB per partition
            # (bench/README.md: a 489,394-record copy 3.9 s -> 3.5 s).
            "kafka.max.partition.fetch.bytes": str(SPARK_PARTITION_FETCH_BYTES),
            "kafka.fetch.max.bytes": str(SPARK_FETCH_BYTES),
        }
        opts.update({f"kafka.{k}": v for k, v in self.java_properties().items()})
        return opts


def sugar_properties(
    protocol: str,
    mechanism: str | None,
    username: str | None,
    password: str | None,
    ca_location: str | None,
) -> dict[str, str]:
    """The Java client properties the SASL/CA settings stand for (BACKFILL_KAFKA_SECURITY_
    PROTOCOL, _SASL_*, _SSL_CA_LOCATION)."""
    props: dict[str, str] = {}
    if protocol != "PLAINTEXT":
        props["security.protocol"] = protocol
    if mechanism:
        props["sasl.mechanism"] = mechanism
        if mechanism != "OAUTHBEARER" and username is not None and password is not None:
            module = (
                "org.apache.kafka.common.security.plain.PlainLoginModule"
                if mechanism == "PLAIN"
                else "org.apache.kafka.common.security.scram.ScramLoginModule"
            )
            props["sasl.jaas.config"] = (
                f"{module} required username={jaas_quote(username)} "
                f"password={jaas_quote(password)};"
            )
    if ca_location:
        props["ssl.truststore.type"] = "PEM"
        props["ssl.truststore.location"] = ca_location
    return props


def jaas_quote(value: str) -> str:
    """A JAAS option value in double quotes; Kafka's JAAS parser reads ``\\`` and ``\\"``
    inside quotes as escapes, so a password with quotes or backslashes survives intact."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class CatalogSettings:
    """One Iceberg catalog, seen by Spark and pyiceberg under the same name."""

    name: str
    kind: CatalogKind
    uri: str
    warehouse: str
    namespace: str
    jdbc_user: str | None = None
    jdbc_password: str | None = field(default=None, repr=False)
    s3_endpoint: str | None = None
    s3_access_key_id: str | None = field(default=None, repr=False)
    s3_secret_access_key: str | None = field(default=None, repr=False)
    s3_region: str | None = None
    # BACKFILL_CATALOG_PROPERTIES: Iceberg catalog properties passed through as they are to
    # pyiceberg and to Spark's catalog (credential, token, scope, header.*, rest.*, ...).
    properties: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)

    @property
    def sqlite_path(self) -> Path | None:
        """The SQLite file behind a local SQL catalog, or None for any other backend."""
        if self.kind == "sql" and self.uri.startswith("sqlite:///"):
            return Path(self.uri.removeprefix("sqlite:///")).resolve()
        return None


@dataclass(frozen=True)
class MaintenanceSettings:
    """Table maintenance (``backfill_assets.lake.operations.maintenance``): which steps run and
    what they
    keep. Retentions are ages; each step can be switched off."""

    expire_snapshots: bool = True
    # Snapshots younger than this are kept, and so is main before every publish younger than
    # this: the rollback window.
    snapshot_retention: timedelta = timedelta(hours=168)
    min_snapshots: int = 5
    remove_orphans: bool = True
    # Files newer than this are never removed: longer than any write can run.
    orphan_retention: timedelta = timedelta(hours=72)
    compact: bool = True
    target_file_bytes: int = 128 * 1024 * 1024
    drop_branches: bool = True
    branch_retention: timedelta = timedelta(hours=72)
    # A branch whose run is not known to have ended is kept until its newest commit is this old.
    running_grace: timedelta = timedelta(hours=24)
    cron: str = "17 3 * * *"
    schedules_running: bool = True
    # Quarantine tables: the raw key and value bytes of records quarantined longer ago than
    # this (by Kafka hour) are dropped, their hash and lengths kept (None: kept for good).
    quarantine_bytes_retention: timedelta | None = None


@dataclass(frozen=True)
class Settings:
    """Everything that differs between the embedded local stack and production."""

    home: Path
    jar_cache: Path
    kafka: KafkaSettings
    catalog: CatalogSettings
    spark_master: str
    spark_driver_memory: str
    spark_shuffle_partitions: int
    archive_uri: str
    archive_file_records: int
    dagster_storage: Path
    webserver_host: str
    webserver_port: int
    sensors_running: bool = True
    # Seconds between two evaluations of each gap and late-data sensor (BACKFILL_SENSOR_INTERVAL_S).
    sensor_interval_s: int = 120
    # Records one gap-sensor tick reads before it probes the rest (BACKFILL_GAP_READ_BUDGET).
    gap_read_budget: int = GAP_READ_BUDGET
    replay_max_records_per_s: int = 0  # 0: no throttle
    # A partition with no committed record at or after an hour's end seals that hour at its
    # last stable offset only when no transaction is open and the hour ended this long ago.
    seal_grace_s: int = 300
    # How often a publish whose main moved (disjoint windows published meanwhile) rebases.
    publish_attempts: int = 5
    fault_point: str | None = None  # test-only: see backfill_assets.stack.faults
    # The decoded_content check decodes every record of a Kafka hour of at most
    # content_sample_above records (BACKFILL_CONTENT_SAMPLE_ABOVE), and 1 record in
    # content_sample (BACKFILL_CONTENT_SAMPLE; 1: every record) of a larger hour: see
    # backfill_assets.lake.decode.content.
    content_sample: int = 16
    content_sample_above: int = 50_000
    # The topics-and-tables spec Definitions are built from (BACKFILL_SPEC); None: the
    # package's own topics.yaml.
    spec_path: Path | None = None
    # Spark core settings, applied when the session is built (BACKFILL_SPARK_EXECUTOR_*);
    # None leaves Spark's own default (local mode runs executors inside the driver anyway).
    spark_executor_memory: str | None = None
    spark_executor_cores: int | None = None
    # Any other spark.* settings (BACKFILL_SPARK_CONF, a JSON object), applied last.
    spark_extra_conf: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold keys
    # Start the local Spark driver JVM from the class-data-sharing archive of
    # backfill_assets/stack/cds.py when one was built (BACKFILL_SPARK_CDS, on by default).
    spark_cds: bool = True
    maintenance: MaintenanceSettings = field(default_factory=MaintenanceSettings)
    # How every run executes its steps (BACKFILL_RUN_EXECUTOR, defs/definitions.py::run_executor):
    # ``in_process``, one process and one Spark session per run; ``multiprocess``, Dagster's
    # default, a process and a Spark session per step.
    run_executor: RunExecutor = "in_process"
    # Spark Connect: the ``sc://host:port`` endpoint runs use as thin clients
    # (BACKFILL_SPARK_CONNECT; None: classic in-process Spark), and the port of the local server
    # ``stack up`` starts (BACKFILL_SPARK_CONNECT_PORT).
    spark_connect: str | None = None
    spark_connect_port: int = 15002
    # The address the local server binds (BACKFILL_SPARK_CONNECT_BIND), and the pre-shared token
    # it requires and clients send as a bearer header (BACKFILL_SPARK_CONNECT_TOKEN, a secret;
    # None: no token).
    spark_connect_bind: str = "127.0.0.1"
    spark_connect_token: str | None = field(default=None, repr=False)
    # Schema registry: a Confluent-API registry's URL (BACKFILL_SCHEMA_REGISTRY_URL;
    # None: the local one ``stack up`` starts on 127.0.0.1:BACKFILL_SCHEMA_REGISTRY_PORT).
    schema_registry_url_setting: str | None = None
    schema_registry_port: int = 18081
    # Its credentials, secrets (at most one): HTTP basic ``user:password``
    # (BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH) or a bearer token (BACKFILL_SCHEMA_REGISTRY_TOKEN).
    schema_registry_basic_auth: str | None = field(default=None, repr=False)
    schema_registry_token: str | None = field(default=None, repr=False)
    schema_registry_logical_cluster: str = ""
    # The CDC source (stack/cdc.py), local only: the Postgres with logical decoding
    # (BACKFILL_CDC_POSTGRES_PORT) and the Kafka Connect worker running Debezium's connector
    # (REST API on BACKFILL_KAFKA_CONNECT_PORT, heap BACKFILL_KAFKA_CONNECT_HEAP), both on
    # 127.0.0.1, their state under <home>/postgres and <home>/kafka-connect.
    cdc_postgres_port: int = 15432
    kafka_connect_port: int = 18083
    kafka_connect_heap: str = "512m"

    @property
    def schema_registry_url(self) -> str:
        """The registry's Confluent-compatible base URL: the configured one, else the local
        registry's (stack/registry.py)."""
        if self.schema_registry_url_setting:
            return self.schema_registry_url_setting
        return local_registry_url(self.schema_registry_port)

    @property
    def schema_registry_auth(self) -> dict[str, str]:
        """confluent-kafka ``SchemaRegistryClient`` settings for the registry's credentials
        (none: {}); secrets included, never log the result."""
        if self.schema_registry_basic_auth:
            return {"basic.auth.user.info": self.schema_registry_basic_auth}
        if self.schema_registry_token:
            # The client's static token needs a logical cluster (a header Confluent Cloud
            # reads; other registries ignore it).
            return {
                "bearer.auth.credentials.source": "STATIC_TOKEN",
                "bearer.auth.token": self.schema_registry_token,
                "bearer.auth.logical.cluster": self.schema_registry_logical_cluster,
            }
        return {}

    @property
    def schema_registry_headers(self) -> dict[str, str]:
        """The Authorization header the registry's credentials make (none: {}), for plain
        HTTP clients."""
        import base64

        if self.schema_registry_basic_auth:
            basic = base64.b64encode(self.schema_registry_basic_auth.encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        if self.schema_registry_token:
            return {"Authorization": f"Bearer {self.schema_registry_token}"}
        return {}

    @property
    def kafka_data_dir(self) -> Path:
        return self.home / "kafka"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read settings from ``environ`` (default: the process environment)."""
        env = (
            environ if isinstance(environ, Env) else Env(os.environ if environ is None else environ)
        )
        home = Path(env.get("BACKFILL_HOME", str(DEFAULT_HOME))).resolve()
        kafka = _kafka_settings(env)
        catalog = _catalog_settings(env, home)
        throttle = _int(env, "BACKFILL_REPLAY_MAX_RECORDS_PER_S", 0, zero_ok=True)
        return cls(
            home=home,
            jar_cache=Path(env.get("BACKFILL_JAR_CACHE", str(home / "jars"))).resolve(),
            kafka=kafka,
            catalog=catalog,
            spark_master=env.get("BACKFILL_SPARK_MASTER", default_master(throttle))
            or default_master(throttle),
            spark_driver_memory=_memory(env, "BACKFILL_SPARK_DRIVER_MEMORY", "2g") or "2g",
            spark_shuffle_partitions=_int(env, "BACKFILL_SPARK_SHUFFLE_PARTITIONS", 4),
            spark_executor_memory=_memory(env, "BACKFILL_SPARK_EXECUTOR_MEMORY", None),
            spark_executor_cores=(
                _int(env, "BACKFILL_SPARK_EXECUTOR_CORES", 1)
                if env.get("BACKFILL_SPARK_EXECUTOR_CORES")
                else None
            ),
            spark_extra_conf=_spark_conf(env),
            spark_cds=_switch(env, "BACKFILL_SPARK_CDS", default=True),
            archive_uri=env.get("BACKFILL_ARCHIVE_URI", (home / "archive").as_uri()),
            archive_file_records=_int(env, "BACKFILL_ARCHIVE_FILE_RECORDS", 100_000),
            dagster_storage=Path(
                env.get("BACKFILL_DAGSTER_STORAGE", str(home / "dagster"))
            ).resolve(),
            webserver_host=env.get("BACKFILL_WEBSERVER_HOST", "127.0.0.1"),
            webserver_port=_int(env, "BACKFILL_WEBSERVER_PORT", 3000),
            sensors_running=_switch(env, "BACKFILL_SENSORS", default=True),
            sensor_interval_s=_sensor_interval(env),
            gap_read_budget=_int(env, "BACKFILL_GAP_READ_BUDGET", GAP_READ_BUDGET),
            replay_max_records_per_s=throttle,
            seal_grace_s=_int(env, "BACKFILL_SEAL_GRACE_S", 300, zero_ok=True),
            publish_attempts=_int(env, "BACKFILL_PUBLISH_ATTEMPTS", 5),
            fault_point=_fault_point(env),
            content_sample=_content_sample(env),
            content_sample_above=_int(env, "BACKFILL_CONTENT_SAMPLE_ABOVE", 50_000, zero_ok=True),
            spec_path=Path(env["BACKFILL_SPEC"]).resolve() if env.get("BACKFILL_SPEC") else None,
            maintenance=_maintenance(env),
            run_executor=_run_executor(env),
            spark_connect=_spark_connect(env),
            spark_connect_port=_port(env, "BACKFILL_SPARK_CONNECT_PORT", 15002),
            spark_connect_bind=_bind(env, "BACKFILL_SPARK_CONNECT_BIND", "127.0.0.1"),
            spark_connect_token=env.get("BACKFILL_SPARK_CONNECT_TOKEN") or None,
            schema_registry_url_setting=_schema_registry_url(env),
            schema_registry_port=_port(env, "BACKFILL_SCHEMA_REGISTRY_PORT", 18081),
            **_schema_registry_auth(env),
            cdc_postgres_port=_port(env, "BACKFILL_CDC_POSTGRES_PORT", 15432),
            kafka_connect_port=_port(env, "BACKFILL_KAFKA_CONNECT_PORT", 18083),
            kafka_connect_heap=_memory(env, "BACKFILL_KAFKA_CONNECT_HEAP", "512m") or "512m",
        )


# The environment variables that hold secrets (read by Settings.from_env): masked whole by
# `backfill-assets settings`. The Dagster resources show these and the JSON settings that may
# carry secrets as EnvVars, never as values (backfill_assets.defs.resources).
SECRET_VARS = (
    "BACKFILL_KAFKA_SASL_PASSWORD",
    "BACKFILL_CATALOG_JDBC_PASSWORD",
    "BACKFILL_SPARK_CONNECT_TOKEN",
    "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH",
    "BACKFILL_SCHEMA_REGISTRY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)


class Env(Mapping[str, str]):
    """The environment as :meth:`Settings.from_env` reads it: each read (``get``, ``[]``)
    records the variable and the default the parser falls back to, so :func:`listing` names
    exactly the variables the parser reads, with no second list to keep in step."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._values = dict(environ)
        self.defaults: dict[str, str | None] = {}  # variable -> its default, in reading order

    def __getitem__(self, name: str) -> str:
        self.defaults.setdefault(name, None)
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def get(self, name: str, default: Any = None) -> Any:
        """The variable's value, else ``default`` (recorded as its default: None is unset)."""
        self.defaults.setdefault(name, default)
        return self._values.get(name, default)


@dataclass(frozen=True)
class Setting:
    """One variable :meth:`Settings.from_env` reads, as ``backfill-assets settings`` shows it:
    its value (None: unset) and its default (None: unset), secrets masked."""

    variable: str
    value: str | None
    default: str | None
    source: Literal["environment", "default"]
    secret: bool


# The file Dagster's webserver, daemon and code servers read when they start (from their
# working directory), and the command line reads as they do (:func:`env_file_values`).
ENV_FILE = ".env"


def env_file_values(directory: Path | None = None) -> dict[str, str]:
    """The variables of ``directory``'s ``.env`` file (default: the current directory), parsed
    as Dagster parses it (python-dotenv; a name without a value is skipped). Dagster's processes
    let the file's values win over the environment they inherit; so does the command line."""
    path = (Path.cwd() if directory is None else directory) / ENV_FILE
    if not path.is_file():
        return {}
    from dotenv import dotenv_values

    return {name: value for name, value in dotenv_values(path).items() if value is not None}


MASK = "***"
# Secrets inside other values: a URL's password (scheme://user:PASSWORD@host), a parameter
# such as Spark Connect's ``;token=...``, and a JSON value whose key names a secret
# (BACKFILL_SPARK_CONF).
_SECRET_WORDS = r"(?:token|password|passwd|secret|credential|key|authorization|user-?info)"
_EMBEDDED_SECRETS = (
    (re.compile(r"(\w[\w+.-]*://[^/\s:@]*:)[^@\s/]*@"), rf"\g<1>{MASK}@"),
    (re.compile(rf"(?i)(\b\w*{_SECRET_WORDS}\w*=)[^;&\s]+"), rf"\g<1>{MASK}"),
    (
        re.compile(rf'(?i)("[^"]*{_SECRET_WORDS}[^"]*"\s*:\s*)("(?:[^"\\]|\\.)*"|[^,}}\s]+)'),
        rf'\g<1>"{MASK}"',
    ),
)


def is_secret_name(name: str) -> bool:
    """Whether a property or header named ``name`` holds a secret (password, key, token,
    credential, authorization)."""
    return re.search(rf"(?i){_SECRET_WORDS}", name) is not None


def masked(variable: str, value: str | None) -> str | None:
    """``value`` fit to print: a secret variable's value is never shown (``***``), and secrets
    inside other values (URL passwords, tokens, secret keys of a JSON object) are masked."""
    if value is None:
        return None
    if variable in SECRET_VARS:
        return MASK if value else ""
    if variable == kafka_auth.VARIABLE:
        return kafka_auth.masked(value) if value.strip() else value
    for pattern, replacement in _EMBEDDED_SECRETS:
        value = pattern.sub(replacement, value)
    return value


def listing(environ: Mapping[str, str] | None = None) -> list[Setting]:
    """Every variable :meth:`Settings.from_env` reads from ``environ`` (default: the process
    environment), sorted by name: value, default and source, secrets masked. Raises
    :class:`SettingsError` as ``from_env`` does."""
    env = Env(os.environ if environ is None else environ)
    Settings.from_env(env)
    values = dict(os.environ if environ is None else environ)
    return [
        Setting(
            variable=name,
            value=masked(name, values.get(name, default)),
            default=masked(name, default),
            source="environment" if name in values else "default",
            secret=name in SECRET_VARS,
        )
        for name, default in sorted((n, d or None) for n, d in env.defaults.items())
    ]


# --- Schema registry -----------------------------------------------------------
# Where Apicurio Registry (the local registry) serves the Confluent Schema Registry API.
CCOMPAT_PATH = "/apis/ccompat/v7"


def local_registry_url(port: int) -> str:
    return f"http://127.0.0.1:{port}{CCOMPAT_PATH}"


def _schema_registry_url(env: Mapping[str, str]) -> str | None:
    """``BACKFILL_SCHEMA_REGISTRY_URL``: an http(s) URL of a Confluent-API schema registry
    (Apicurio's is ``.../apis/ccompat/v7``); unset or empty: the local registry."""
    name = "BACKFILL_SCHEMA_REGISTRY_URL"
    raw = (env.get(name) or "").strip().rstrip("/")
    if not raw:
        return None
    if re.fullmatch(r"https?://[^/\s]+(/\S*)?", raw) is None:
        raise SettingsError(
            f"{name} must be an http(s) URL of a Confluent-API schema registry "
            f"(e.g. http://127.0.0.1:18081{CCOMPAT_PATH}), or unset for the local registry"
        )
    return raw


def _schema_registry_auth(env: Mapping[str, str]) -> dict[str, Any]:
    """The registry's credentials: ``BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH`` (``user:password``)
    or ``BACKFILL_SCHEMA_REGISTRY_TOKEN`` (a bearer token), not both; with a token,
    ``BACKFILL_SCHEMA_REGISTRY_LOGICAL_CLUSTER`` (Confluent Cloud's ``lsrc-...``, else empty)."""
    basic = env.get("BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH") or None
    token = env.get("BACKFILL_SCHEMA_REGISTRY_TOKEN") or None
    cluster = env.get("BACKFILL_SCHEMA_REGISTRY_LOGICAL_CLUSTER", "")
    if basic and token:
        raise SettingsError(
            "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH and BACKFILL_SCHEMA_REGISTRY_TOKEN are both set; "
            "a schema registry takes one kind of credentials: unset one"
        )
    if basic is not None and ":" not in basic:
        raise SettingsError(
            "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH must be USER:PASSWORD (the user, a colon, then "
            "the password)"
        )
    return {
        "schema_registry_basic_auth": basic,
        "schema_registry_token": token,
        "schema_registry_logical_cluster": cluster,
    }


# --- Spark Connect -------------------------------------------------------------
def _spark_connect(env: Mapping[str, str]) -> str | None:
    """``BACKFILL_SPARK_CONNECT``: ``sc://host:port`` (optionally ``/;token=...`` and other
    parameters); unset or empty means classic in-process Spark."""
    name = "BACKFILL_SPARK_CONNECT"
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    match = re.fullmatch(r"sc://([^:/;]+)(?::(\d+))?(/.*)?", raw)
    if match is None or (match.group(2) is not None and not 0 < int(match.group(2)) < 65536):
        raise SettingsError(
            f"{name} must be a Spark Connect URL sc://HOST:PORT (e.g. sc://127.0.0.1:15002), "
            "or unset for in-process Spark"
        )
    return raw


def _bind(env: Mapping[str, str], name: str, default: str) -> str:
    """An IPv4 address to bind (``0.0.0.0``: every interface)."""
    value = (env.get(name, default) or default).strip()
    parts = value.split(".")
    if len(parts) != 4 or not all(p.isdigit() and int(p) < 256 for p in parts):
        raise SettingsError(
            f"{name}={value!r} is not an IPv4 address to bind (e.g. 127.0.0.1, or 0.0.0.0 for "
            "every interface)"
        )
    return value


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    value = _int(env, name, default)
    if value > 65535:
        raise SettingsError(f"{name}={value} is not a TCP port (1 to 65535)")
    return value


def _maintenance(env: Mapping[str, str]) -> MaintenanceSettings:
    prefix = "BACKFILL_MAINTENANCE_"
    orphan_hours = _int(env, prefix + "ORPHAN_RETENTION_HOURS", 72)
    if orphan_hours < 24:
        raise SettingsError(
            f"{prefix}ORPHAN_RETENTION_HOURS={orphan_hours} is below 24: files of a write still "
            "running could be deleted as orphans. Use 24 or more (default 72)"
        )
    cron = env.get(prefix + "CRON", "17 3 * * *").strip()
    if len(cron.split()) != 5:
        raise SettingsError(
            f"{prefix}CRON={cron!r} is not a 5-field cron expression (e.g. '17 3 * * *')"
        )
    return MaintenanceSettings(
        expire_snapshots=_switch(env, prefix + "EXPIRE", default=True),
        snapshot_retention=timedelta(
            hours=_int(env, prefix + "SNAPSHOT_RETENTION_HOURS", 168, zero_ok=True)
        ),
        min_snapshots=_int(env, prefix + "MIN_SNAPSHOTS", 5),
        remove_orphans=_switch(env, prefix + "ORPHANS", default=True),
        orphan_retention=timedelta(hours=orphan_hours),
        compact=_switch(env, prefix + "COMPACTION", default=True),
        target_file_bytes=_int(env, prefix + "TARGET_FILE_MB", 128) * 1024 * 1024,
        drop_branches=_switch(env, prefix + "BRANCHES", default=True),
        branch_retention=timedelta(
            hours=_int(env, prefix + "BRANCH_RETENTION_HOURS", 72, zero_ok=True)
        ),
        running_grace=timedelta(hours=_int(env, prefix + "RUNNING_GRACE_HOURS", 24)),
        cron=cron,
        schedules_running=_switch(env, prefix + "SCHEDULES", default=True),
        quarantine_bytes_retention=_quarantine_bytes(env),
    )


def _quarantine_bytes(env: Mapping[str, str]) -> timedelta | None:
    """``BACKFILL_QUARANTINE_BYTES_DAYS``: days a quarantined record's raw bytes are kept
    (unset: for good; 0: dropped by the next maintenance pass)."""
    if not env.get("BACKFILL_QUARANTINE_BYTES_DAYS"):
        return None
    return timedelta(days=_int(env, "BACKFILL_QUARANTINE_BYTES_DAYS", 0, zero_ok=True))


# The sparsest content sample allowed: 1 in 1024 still catches a fault touching 5,000 records
# of a window with probability 99.2%.
MAX_CONTENT_SAMPLE = 1024


def _content_sample(env: Mapping[str, str]) -> int:
    """``BACKFILL_CONTENT_SAMPLE``: K, the decoded_content check decodes 1 record in K of a
    large hour (1: every record)."""
    name = "BACKFILL_CONTENT_SAMPLE"
    raw = env.get(name, "16") or "16"
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_CONTENT_SAMPLE:
        raise SettingsError(
            f"{name}={raw!r}: it must be a whole number from 1 (decode every record) to "
            f"{MAX_CONTENT_SAMPLE} (decode 1 record in {MAX_CONTENT_SAMPLE} of an hour larger "
            "than BACKFILL_CONTENT_SAMPLE_ABOVE records)"
        )
    return k


def _sensor_interval(env: Mapping[str, str]) -> int:
    """``BACKFILL_SENSOR_INTERVAL_S``: seconds between two ticks of each gap and late-data
    sensor, at least 1 (a tick reads every partition's offsets and the ledger)."""
    name = "BACKFILL_SENSOR_INTERVAL_S"
    value = _int(env, name, 120)
    if value > 86_400:
        raise SettingsError(
            f"{name}={value} is more than a day: gaps would wait that long to be requested; "
            "allowed: 1 to 86400 seconds"
        )
    return value


def _int(env: Mapping[str, str], name: str, default: int, zero_ok: bool = False) -> int:
    raw = env.get(name, str(default))
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a whole number") from None
    if value < 0 or (value == 0 and not zero_ok):
        kind = "zero or a positive" if zero_ok else "a positive"
        raise SettingsError(f"{name}={raw!r} must be {kind} whole number")
    return value


_MEMORY = re.compile(r"[1-9][0-9]*[kmgtp]?", re.IGNORECASE)
# Keys BACKFILL_SPARK_CONF may not set: each has its own setting (named here), or is derived
# from other settings and would break the catalog or the jars if overridden.
_SPARK_CONF_OWNED = {
    "spark.master": "BACKFILL_SPARK_MASTER",
    "spark.driver.memory": "BACKFILL_SPARK_DRIVER_MEMORY",
    "spark.executor.memory": "BACKFILL_SPARK_EXECUTOR_MEMORY",
    "spark.executor.cores": "BACKFILL_SPARK_EXECUTOR_CORES",
    "spark.sql.shuffle.partitions": "BACKFILL_SPARK_SHUFFLE_PARTITIONS",
    "spark.jars": "BACKFILL_JAR_CACHE (backfill_assets/stack/maven/spark/pom.xml)",
    "spark.sql.session.timeZone": "nothing: the project needs UTC",
    "spark.sql.extensions": "nothing: Iceberg's SQL extensions are required",
}


def _memory(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    """A JVM memory size as Spark reads it (``512m``, ``4g``; a bare number is bytes)."""
    raw = env.get(name, default or "").strip()
    if not raw:
        return default
    if not _MEMORY.fullmatch(raw):
        raise SettingsError(
            f"{name}={raw!r} is not a memory size; use a number with a unit, e.g. 512m or 4g"
        )
    return raw.lower()


def _kafka_settings(env: Mapping[str, str]) -> KafkaSettings:
    """The Kafka settings of ``env`` (BACKFILL_KAFKA_*), validated."""
    port = _int(env, "BACKFILL_KAFKA_PORT", 19092)
    controller_port = _int(env, "BACKFILL_KAFKA_CONTROLLER_PORT", port + 1)
    if controller_port == port:
        raise SettingsError(
            f"BACKFILL_KAFKA_CONTROLLER_PORT must differ from BACKFILL_KAFKA_PORT (both are {port})"
        )
    protocol = env.get("BACKFILL_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT").upper()
    _choice("BACKFILL_KAFKA_SECURITY_PROTOCOL", protocol, _SECURITY_PROTOCOLS)
    mechanism = env.get("BACKFILL_KAFKA_SASL_MECHANISM")
    if mechanism is not None:
        mechanism = mechanism.upper()
        _choice("BACKFILL_KAFKA_SASL_MECHANISM", mechanism, _SASL_MECHANISMS)
    props = _kafka_properties(env)
    protocol = props.pop("security.protocol", protocol).upper()
    mechanism = props.pop("sasl.mechanism", mechanism or "").upper() or None
    if protocol.startswith("SASL") and mechanism is None:
        raise SettingsError(
            f"security protocol {protocol} needs BACKFILL_KAFKA_SASL_MECHANISM (or sasl.mechanism "
            f"in {kafka_auth.VARIABLE}): one of {', '.join(_SASL_MECHANISMS)}"
        )
    return KafkaSettings(
        bootstrap_servers=env.get("BACKFILL_KAFKA_BOOTSTRAP", f"127.0.0.1:{port}"),
        security_protocol=protocol,
        sasl_mechanism=mechanism,
        sasl_username=env.get("BACKFILL_KAFKA_SASL_USERNAME"),
        sasl_password=env.get("BACKFILL_KAFKA_SASL_PASSWORD"),
        ssl_ca_location=env.get("BACKFILL_KAFKA_SSL_CA_LOCATION"),
        local_port=port,
        local_controller_port=controller_port,
        local_heap=env.get("BACKFILL_KAFKA_HEAP", "512m"),
        properties=props,
        **_local_broker_tls(env),
    )


# The Java client properties each SASL/CA setting stands for: BACKFILL_KAFKA_PROPERTIES may
# not set them too.
_KAFKA_SUGAR = {
    "BACKFILL_KAFKA_SECURITY_PROTOCOL": ("security.protocol",),
    "BACKFILL_KAFKA_SASL_MECHANISM": ("sasl.mechanism",),
    "BACKFILL_KAFKA_SASL_USERNAME": ("sasl.jaas.config",),
    "BACKFILL_KAFKA_SASL_PASSWORD": ("sasl.jaas.config",),
    "BACKFILL_KAFKA_SSL_CA_LOCATION": (
        "ssl.truststore.type",
        "ssl.truststore.location",
        "ssl.truststore.certificates",
    ),
}


def _kafka_properties(env: Mapping[str, str]) -> dict[str, str]:
    """``BACKFILL_KAFKA_PROPERTIES`` (stack/kafka_auth.py), none set twice: a property one of
    the SASL/CA settings stands for is refused, naming that setting."""
    raw = (env.get(kafka_auth.VARIABLE) or "").strip()
    if not raw:
        return {}
    props = kafka_auth.parse(raw)
    for variable, names in _KAFKA_SUGAR.items():
        for name in names:
            if name in props and env.get(variable):
                raise SettingsError(
                    f"{kafka_auth.VARIABLE}: {name} is set by {variable}; set it in one place"
                )
    return props


def _local_broker_tls(env: Mapping[str, str]) -> dict[str, str]:
    """The local brokers' TLS files (BACKFILL_KAFKA_SSL_KEYSTORE), checked to exist."""
    keystore = env.get("BACKFILL_KAFKA_SSL_KEYSTORE")
    if keystore is None:
        return {}
    if not Path(keystore).is_file():
        raise SettingsError(
            f"BACKFILL_KAFKA_SSL_KEYSTORE={keystore!r} is not a file; it must be a PEM file "
            "holding the local broker's private key (unencrypted PKCS#8), certificate and CA"
        )
    return {"local_ssl_keystore": str(Path(keystore).resolve())}


def _catalog_settings(env: Mapping[str, str], home: Path) -> CatalogSettings:
    """The catalog settings of ``env`` (BACKFILL_CATALOG_*, BACKFILL_WAREHOUSE, S3), validated."""
    kind = env.get("BACKFILL_CATALOG_KIND", "sql").lower()
    _choice("BACKFILL_CATALOG_KIND", kind, ("sql", "rest"))
    default_uri = f"sqlite:///{home / 'catalog' / 'catalog.db'}"
    uri = env.get("BACKFILL_CATALOG_URI", default_uri if kind == "sql" else "")
    if not uri:
        raise SettingsError(
            "BACKFILL_CATALOG_KIND=rest needs BACKFILL_CATALOG_URI (the REST catalog's base URL)"
        )
    if kind == "sql" and not uri.startswith(("sqlite:///", "postgresql")):
        raise SettingsError(
            f"BACKFILL_CATALOG_URI={uri!r} is not a SQL catalog URI: use sqlite:///ABS/PATH.db "
            "or postgresql+psycopg2://HOST:PORT/DB"
        )
    return CatalogSettings(
        name=env.get("BACKFILL_CATALOG_NAME", "lake"),
        kind=kind,  # type: ignore[arg-type]  # validated by _choice above
        uri=uri,
        warehouse=env.get("BACKFILL_WAREHOUSE", (home / "warehouse").as_uri()),
        namespace=env.get("BACKFILL_NAMESPACE", "lakehouse"),
        jdbc_user=env.get("BACKFILL_CATALOG_JDBC_USER"),
        jdbc_password=env.get("BACKFILL_CATALOG_JDBC_PASSWORD"),
        s3_endpoint=env.get("BACKFILL_S3_ENDPOINT"),
        s3_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
        s3_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        s3_region=env.get("AWS_REGION"),
        properties=_catalog_properties(env),
    )


# Catalog properties the project sets itself, and the setting that owns each.
_CATALOG_OWNED = {
    "uri": "BACKFILL_CATALOG_URI",
    "warehouse": "BACKFILL_WAREHOUSE",
    "type": "BACKFILL_CATALOG_KIND",
    "catalog-impl": "BACKFILL_CATALOG_KIND",
    "py-catalog-impl": "BACKFILL_CATALOG_KIND",
    "cache-enabled": "the project (always false: other processes commit to the same tables)",
}
_CATALOG_OWNED_PREFIXES = {
    "jdbc.": "BACKFILL_CATALOG_JDBC_USER/BACKFILL_CATALOG_JDBC_PASSWORD",
}


def _catalog_properties(env: Mapping[str, str]) -> dict[str, str]:
    """``BACKFILL_CATALOG_PROPERTIES``: Iceberg catalog properties as a JSON object of strings
    (or numbers, booleans), given as they are to pyiceberg and to Spark's Iceberg catalog, e.g.
    ``{"credential": "ID:SECRET", "scope": "catalog"}``. Properties the project sets from its
    own settings are refused, naming that setting. Values never appear in messages."""
    name = "BACKFILL_CATALOG_PROPERTIES"
    raw = env.get(name, "").strip()
    if not raw:
        return {}
    example = 'e.g. {"credential": "CLIENT_ID:CLIENT_SECRET", "scope": "catalog"}'
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        # The position only: the message of a JSON error can quote the (secret) text.
        raise SettingsError(
            f"{name} is not valid JSON (at character {exc.pos}); {example}"
        ) from None
    if not isinstance(doc, dict):
        raise SettingsError(
            f"{name} must be a JSON object of Iceberg catalog properties; {example}"
        )
    props: dict[str, str] = {}
    for key, value in doc.items():
        owner = _CATALOG_OWNED.get(key) or next(
            (o for p, o in _CATALOG_OWNED_PREFIXES.items() if key.startswith(p)), None
        )
        if owner is not None:
            raise SettingsError(f"{name}: {key!r} is set by {owner}, not here")
        if not key or key.startswith("spark."):
            raise SettingsError(
                f"{name}: {key!r} is not an Iceberg catalog property (give names such as "
                "'credential' or 'header.X-Tenant', without the spark.sql.catalog.<name>. prefix)"
            )
        if isinstance(value, bool):
            props[key] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            props[key] = str(value)
        else:
            raise SettingsError(f"{name}: {key!r} must be a string, number or boolean")
    return props


def _spark_conf(env: Mapping[str, str]) -> dict[str, str]:
    """``BACKFILL_SPARK_CONF``: extra ``spark.*`` settings as a JSON object of strings (or
    numbers, booleans), e.g. ``{"spark.executor.instances": "4"}``."""
    name = "BACKFILL_SPARK_CONF"
    raw = env.get(name, "").strip()
    if not raw:
        return {}
    example = 'e.g. {"spark.executor.instances": "4"}'
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{name} is not valid JSON ({exc.msg}); {example}") from None
    if not isinstance(doc, dict):
        raise SettingsError(f"{name} must be a JSON object of spark.* settings; {example}")
    conf: dict[str, str] = {}
    for key, value in doc.items():
        if not key.startswith("spark."):
            raise SettingsError(f"{name}: key {key!r} is not a Spark setting (spark.*)")
        if key in _SPARK_CONF_OWNED:
            raise SettingsError(f"{name}: {key} is set by {_SPARK_CONF_OWNED[key]}, not here")
        if key.startswith("spark.sql.catalog."):
            raise SettingsError(
                f"{name}: {key} belongs to the Iceberg catalog, set by BACKFILL_CATALOG_*"
            )
        if isinstance(value, bool):
            conf[key] = "true" if value else "false"
        elif isinstance(value, str | int | float):
            conf[key] = str(value)
        else:
            raise SettingsError(f"{name}: {key} must be a string, number or boolean")
    return conf


LOCAL_CORES = 2


def default_master(max_records_per_s: int) -> str:
    """The local master when BACKFILL_SPARK_MASTER is unset: ``local[2]``; a throttled process
    (BACKFILL_REPLAY_MAX_RECORDS_PER_S > 0) gets half the cores, ``local[1]``, so the machine's
    other core stays with live consumers (bench/live_traffic.py: a live consumer's p99 rose
    1.42-1.45x beside a throttled ``local[2]`` replay, 1.07-1.13x beside ``local[1]``). An
    explicit BACKFILL_SPARK_MASTER always wins."""
    cores = max(1, LOCAL_CORES // 2) if max_records_per_s else LOCAL_CORES
    return f"local[{cores}]"


def _run_executor(env: Mapping[str, str]) -> RunExecutor:
    name = "BACKFILL_RUN_EXECUTOR"
    raw = env.get(name, "in_process").strip().lower().replace("-", "_") or "in_process"
    _choice(name, raw, ("in_process", "multiprocess"))
    return raw  # type: ignore[return-value]  # validated by _choice above


# Test-only failpoints (backfill_assets.stack.faults), in the order a raw run reaches them.
FAULT_POINTS = (
    # wap.open_branch: the run branch exists, nothing is written to it yet, nor to the
    # quarantine table (the next steps are the quarantine branch and the branch write).
    "branch_opened",
    # assets._audit_and_publish: every blocking check passed, nothing published yet.
    "checks_passed",
    # wap.publish: the audit commit is on the branch, main is not fast-forwarded yet.
    "branch_committed",
    # wap.publish: main is fast-forwarded; the branch is not dropped and no audit row written.
    "main_fast_forwarded",
    # rollback.rollback: the ledger holds the rollback's intent (its rollback row, its readers'
    # invalidations); the table's main has not moved.
    "rollback_intent_recorded",
    # rollback.rollback: main is moved back (with the property that commits the rollback); the
    # ledger has no outcome row yet.
    "rollback_table_committed",
    # rollback.rollback: the ledger's outcome row is written; no audit row yet.
    "rollback_ledger_committed",
)


def _fault_point(env: Mapping[str, str]) -> str | None:
    raw = env.get("BACKFILL_FAULT_POINT")
    if raw is None or raw == "":
        return None
    if raw not in FAULT_POINTS:
        raise SettingsError(
            f"BACKFILL_FAULT_POINT={raw!r} is not a failpoint (test-only setting); "
            f"allowed: {', '.join(FAULT_POINTS)}"
        )
    return raw


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "on" if default else "off")
    if raw is None or raw == "":
        return default
    if raw.lower() in ("on", "true", "1", "yes"):
        return True
    if raw.lower() in ("off", "false", "0", "no"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a switch; allowed: on, off")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SettingsError(f"{name}={value!r} is not supported; allowed: {', '.join(allowed)}")
