"""The one place where local and production differ.

Every environment-specific value is a named setting, a ``BACKFILL_*`` variable (plus the
standard ``AWS_*`` ones for object storage), declared once as a field of :class:`Environment`
(pydantic-settings: type, default, description). Nothing else in the package calls
``os.environ``. Every entry point reads the same sources, highest first: the current
directory's ``.env`` (its values win, as in Dagster's processes), the process environment, the
TOML file ``BACKFILL_SETTINGS_FILE`` names, the defaults (:func:`_sources`). Defaults describe
the embedded local stack: a KRaft broker on 127.0.0.1, Spark ``local[2]``, a SQLite SQL catalog
with a ``file://`` warehouse, all under ``.stack/``. ``infra/README.md`` lists every variable
and a production example; ``backfill-assets settings`` lists each with its current value, its
default and its source (:func:`listing`, from the model's fields, secrets masked).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from importlib.resources.abc import Traversable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    FilePath,
    SecretStr,
    StringConstraints,
    ValidationError,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

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
    # The hours (partitions) one backfill run covers at most (BACKFILL_MAX_HOURS_PER_RUN): a
    # longer range is cut into runs of this size (defs.assets.backfill_policy).
    max_hours_per_run: int = 720
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
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        overrides: Mapping[str, str] | None = None,
    ) -> Settings:
        """Read the settings (:class:`Environment`) from their sources, highest first:
        ``overrides`` (the Dagster resources' configured secrets), then either ``environ``
        alone when it is given (no file, not the process environment), or the current
        directory's ``.env``, the process environment and the ``BACKFILL_SETTINGS_FILE`` file;
        the defaults last. Raises :class:`SettingsError` naming the first invalid variable."""
        return _settings(_read(_sources(environ, overrides)))


# --- The variables -------------------------------------------------------------
# Every variable the package reads is a field of Environment, named as the variable. Each
# source below knows them by that one name: the environment, the .env file, the keys of the
# settings file, an explicit mapping.
ENV_FILE = ".env"
SETTINGS_FILE = "BACKFILL_SETTINGS_FILE"

# Test-only failpoints (backfill_assets.stack.faults), in the order a raw run reaches them.
FaultPoint = Literal[
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
]
FAULT_POINTS: tuple[str, ...] = get_args(FaultPoint)

# The sparsest content sample allowed: 1 in 1024 still catches a fault touching 5,000 records
# of a window with probability 99.2%.
MAX_CONTENT_SAMPLE = 1024
# The longest run a backfill is cut into (BACKFILL_MAX_HOURS_PER_RUN), in hours: a year.
MAX_HOURS_PER_RUN = 8760
LOCAL_CORES = 2


def default_master(max_records_per_s: int) -> str:
    """The local master when BACKFILL_SPARK_MASTER is unset: ``local[2]``; a throttled process
    (BACKFILL_REPLAY_MAX_RECORDS_PER_S > 0) gets half the cores, ``local[1]``, so the machine's
    other core stays with live consumers (bench/live_traffic.py: a live consumer's p99 rose
    1.42-1.45x beside a throttled ``local[2]`` replay, 1.07-1.13x beside ``local[1]``). An
    explicit BACKFILL_SPARK_MASTER always wins."""
    cores = max(1, LOCAL_CORES // 2) if max_records_per_s else LOCAL_CORES
    return f"local[{cores}]"


def _upper(value: Any) -> Any:
    return value.strip().upper() if isinstance(value, str) else value


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def _executor_name(value: Any) -> Any:
    return value.strip().lower().replace("-", "_") if isinstance(value, str) else value


def _json_text(value: Any) -> Any:
    """A JSON-object setting given as a TOML table (in the settings file): its JSON text."""
    return json.dumps(value) if isinstance(value, dict | list) else value


def _resolved(path: Path) -> Path:
    return path.resolve()


def _spark_connect(raw: str | None) -> str | None:
    """``BACKFILL_SPARK_CONNECT``: ``sc://host:port`` (optionally ``/;token=...`` and other
    parameters); unset or blank means classic in-process Spark."""
    raw = (raw or "").strip()
    if not raw:
        return None
    match = re.fullmatch(r"sc://([^:/;]+)(?::(\d+))?(/.*)?", raw)
    if match is None or (match.group(2) is not None and not 0 < int(match.group(2)) < 65536):
        raise ValueError(
            "BACKFILL_SPARK_CONNECT must be a Spark Connect URL sc://HOST:PORT (e.g. "
            "sc://127.0.0.1:15002), or unset for in-process Spark"
        )
    return raw


def _schema_registry_url(raw: str | None) -> str | None:
    """``BACKFILL_SCHEMA_REGISTRY_URL``: an http(s) URL of a Confluent-API schema registry
    (Apicurio's is ``.../apis/ccompat/v7``); unset or blank: the local registry."""
    raw = (raw or "").strip().rstrip("/")
    if not raw:
        return None
    if re.fullmatch(r"https?://[^/\s]+(/\S*)?", raw) is None:
        raise ValueError(
            "BACKFILL_SCHEMA_REGISTRY_URL must be an http(s) URL of a Confluent-API schema "
            f"registry (e.g. http://127.0.0.1:18081{CCOMPAT_PATH}), or unset for the local one"
        )
    return raw


@dataclass(frozen=True)
class Allowed:
    """What a field allows, in its error message, where pydantic's own words would not do."""

    text: str


def _under_home(name: str) -> Callable[[dict[str, Any]], Path]:
    """The default of a path under BACKFILL_HOME."""
    return lambda values: (values["BACKFILL_HOME"] / name).resolve()


def _uri_under_home(name: str) -> Callable[[dict[str, Any]], str]:
    """The default of a ``file://`` URI under BACKFILL_HOME."""
    return lambda values: (values["BACKFILL_HOME"] / name).as_uri()


def _catalog_uri(values: dict[str, Any]) -> str | None:
    """A SQL catalog's default: SQLite under BACKFILL_HOME; a REST catalog has none."""
    if values["BACKFILL_CATALOG_KIND"] != "sql":
        return None
    return f"sqlite:///{values['BACKFILL_HOME'] / 'catalog' / 'catalog.db'}"


_MEMORY = StringConstraints(
    strip_whitespace=True, to_lower=True, pattern=r"^[1-9][0-9]*[kmgtpKMGTP]?$"
)
_MEMORY_ALLOWED = Allowed("a JVM memory size: a number with a unit, e.g. 512m or 4g")
Port = Annotated[int, Field(ge=1, le=65535)]
Positive = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Memory = Annotated[str, _MEMORY, _MEMORY_ALLOWED]
OptionalMemory = Annotated[str | None, _MEMORY, _MEMORY_ALLOWED]
Location = Annotated[Path, AfterValidator(_resolved)]
JsonObject = Annotated[str | None, BeforeValidator(_json_text)]
Secret = SecretStr | None


class Environment(BaseSettings):
    """Every variable the package reads, declared once: type, default (some follow others)
    and meaning. pydantic parses and checks each; :func:`_settings` makes :class:`Settings` of
    them with the checks that span variables. ``infra/README.md`` says more of each."""

    model_config = SettingsConfigDict(
        case_sensitive=True,
        env_ignore_empty=True,  # empty means unset, in every source
        extra="ignore",  # the environment holds much else
        coerce_numbers_to_str=True,  # a TOML number for a text setting
        use_attribute_docstrings=True,  # each field's description
        frozen=True,
    )

    BACKFILL_SETTINGS_FILE: Path | None = None
    """A TOML file of settings (keys: these names), below the environment and .env."""
    BACKFILL_HOME: Location = DEFAULT_HOME.resolve()
    """Root of local state; the path defaults below derive from it."""
    BACKFILL_JAR_CACHE: Location = Field(default_factory=_under_home("jars"))
    """Where jar sets are resolved to."""
    BACKFILL_DAGSTER_STORAGE: Location = Field(default_factory=_under_home("dagster"))
    """Dagster's file storage."""
    BACKFILL_SPEC: Location | None = None
    """The topics-and-tables spec (unset: the package's topics.yaml)."""

    BACKFILL_KAFKA_PORT: Port = 19092
    """Client port of the local broker."""
    BACKFILL_KAFKA_CONTROLLER_PORT: Port = Field(
        default_factory=lambda v: v["BACKFILL_KAFKA_PORT"] + 1
    )
    """KRaft controller port of the local broker."""
    BACKFILL_KAFKA_BOOTSTRAP: str = Field(
        default_factory=lambda v: f"127.0.0.1:{v['BACKFILL_KAFKA_PORT']}"
    )
    """Kafka's bootstrap servers."""
    BACKFILL_KAFKA_SECURITY_PROTOCOL: Annotated[
        kafka_auth.SecurityProtocol, BeforeValidator(_upper)
    ] = "PLAINTEXT"
    """Kafka's security protocol."""
    BACKFILL_KAFKA_SASL_MECHANISM: Annotated[
        kafka_auth.SaslMechanism | None, BeforeValidator(_upper)
    ] = None
    """SASL mechanism; required with SASL_*."""
    BACKFILL_KAFKA_SASL_USERNAME: str | None = None
    """SASL user."""
    BACKFILL_KAFKA_SASL_PASSWORD: Secret = None
    """SASL password."""
    BACKFILL_KAFKA_SSL_CA_LOCATION: str | None = None
    """PEM CA bundle the clients trust."""
    BACKFILL_KAFKA_PROPERTIES: JsonObject = None
    """Kafka client properties, a JSON object (stack/kafka_auth.py)."""
    BACKFILL_KAFKA_HEAP: Memory = "512m"
    """-Xmx of the local broker."""
    BACKFILL_KAFKA_SSL_KEYSTORE: Annotated[
        Annotated[FilePath, AfterValidator(_resolved)] | None,
        Allowed(
            "an existing PEM file: the local broker's key (unencrypted PKCS#8), certificate, CA"
        ),
    ] = None
    """The local brokers' PEM key, certificate and CA."""

    BACKFILL_CATALOG_KIND: Annotated[CatalogKind, BeforeValidator(_lower)] = "sql"
    """sql (SQL catalog) or rest."""
    BACKFILL_CATALOG_URI: str | None = Field(default_factory=_catalog_uri)
    """The catalog's URI (required for rest)."""
    BACKFILL_CATALOG_NAME: str = "lake"
    """The catalog's name, in Spark and pyiceberg."""
    BACKFILL_NAMESPACE: str = "lakehouse"
    """Namespace of the tables."""
    BACKFILL_WAREHOUSE: str = Field(default_factory=_uri_under_home("warehouse"))
    """Warehouse location."""
    BACKFILL_CATALOG_JDBC_USER: str | None = None
    """A SQL catalog's database user."""
    BACKFILL_CATALOG_JDBC_PASSWORD: Secret = None
    """Its password."""
    BACKFILL_CATALOG_PROPERTIES: JsonObject = None
    """Iceberg catalog properties, a JSON object."""
    BACKFILL_S3_ENDPOINT: str | None = None
    """S3 endpoint of a non-AWS store."""
    AWS_ACCESS_KEY_ID: Secret = None
    """S3 access key."""
    AWS_SECRET_ACCESS_KEY: Secret = None
    """S3 secret key."""
    AWS_REGION: str | None = None
    """S3 region."""
    BACKFILL_ARCHIVE_URI: str = Field(default_factory=_uri_under_home("archive"))
    """Archive of Kafka history older than retention."""
    BACKFILL_ARCHIVE_FILE_RECORDS: Positive = 100_000
    """Records per archive file at most."""

    BACKFILL_REPLAY_MAX_RECORDS_PER_S: Count = 0
    """Replay throttle per run, records per second (0: none)."""
    BACKFILL_SPARK_MASTER: str = Field(
        default_factory=lambda v: default_master(v["BACKFILL_REPLAY_MAX_RECORDS_PER_S"])
    )
    """spark.master."""
    BACKFILL_SPARK_DRIVER_MEMORY: Memory = "2g"
    """spark.driver.memory."""
    BACKFILL_SPARK_EXECUTOR_MEMORY: OptionalMemory = None
    """spark.executor.memory (unset: Spark's default)."""
    BACKFILL_SPARK_EXECUTOR_CORES: Annotated[int | None, Field(ge=1)] = None
    """spark.executor.cores (unset: Spark's default)."""
    BACKFILL_SPARK_SHUFFLE_PARTITIONS: Positive = 4
    """spark.sql.shuffle.partitions."""
    BACKFILL_SPARK_CONF: JsonObject = None
    """Any other spark.* settings, a JSON object."""
    BACKFILL_SPARK_CDS: bool = True
    """Start the local driver from the class-data-sharing archive."""
    BACKFILL_SPARK_CONNECT: Annotated[str | None, AfterValidator(_spark_connect)] = None
    """Spark Connect URL sc://HOST:PORT (unset: in-process Spark)."""
    BACKFILL_SPARK_CONNECT_PORT: Port = 15002
    """Port of the local Spark Connect server."""
    BACKFILL_SPARK_CONNECT_BIND: Annotated[
        IPv4Address, Allowed("an IPv4 address to bind, e.g. 127.0.0.1, or 0.0.0.0 for all")
    ] = IPv4Address("127.0.0.1")
    """The address the local Spark Connect server binds."""
    BACKFILL_SPARK_CONNECT_TOKEN: Secret = None
    """The token the local Spark Connect server requires and clients send."""

    BACKFILL_SCHEMA_REGISTRY_URL: Annotated[str | None, AfterValidator(_schema_registry_url)] = None
    """A Confluent-API schema registry's URL (unset: the local one)."""
    BACKFILL_SCHEMA_REGISTRY_PORT: Port = 18081
    """Port of the local schema registry."""
    BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH: Secret = None
    """The registry's HTTP basic credentials USER:PASSWORD."""
    BACKFILL_SCHEMA_REGISTRY_TOKEN: Secret = None
    """The registry's bearer token."""
    BACKFILL_SCHEMA_REGISTRY_LOGICAL_CLUSTER: str = ""
    """The logical cluster a bearer token needs (Confluent Cloud)."""
    BACKFILL_CDC_POSTGRES_PORT: Port = 15432
    """Port of the CDC source's Postgres."""
    BACKFILL_KAFKA_CONNECT_PORT: Port = 18083
    """REST port of the CDC source's Kafka Connect."""
    BACKFILL_KAFKA_CONNECT_HEAP: Memory = "512m"
    """-Xmx of Kafka Connect."""

    BACKFILL_WEBSERVER_HOST: str = "127.0.0.1"
    """Address of the Dagster webserver."""
    BACKFILL_WEBSERVER_PORT: Port = 3000
    """Port of the Dagster webserver."""
    BACKFILL_SENSORS: bool = True
    """Default status of the gap and late-data sensors."""
    BACKFILL_SENSOR_INTERVAL_S: Annotated[
        int, Field(ge=1, le=86_400), Allowed("1 to 86400 seconds (a day)")
    ] = 120
    """Seconds between two ticks of each gap and late-data sensor."""
    BACKFILL_GAP_READ_BUDGET: Positive = GAP_READ_BUDGET
    """Records a gap-sensor tick reads before it probes the rest."""
    BACKFILL_SEAL_GRACE_S: Count = 300
    """Seconds after an hour's end an idle partition seals it."""
    BACKFILL_PUBLISH_ATTEMPTS: Positive = 5
    """Rebases of a publish at most."""
    BACKFILL_RUN_EXECUTOR: Annotated[RunExecutor, BeforeValidator(_executor_name)] = "in_process"
    """How runs execute their steps."""
    BACKFILL_CONTENT_SAMPLE: Annotated[
        int,
        Field(ge=1, le=MAX_CONTENT_SAMPLE),
        Allowed(
            f"from 1 (decode every record) to {MAX_CONTENT_SAMPLE} (decode 1 record in "
            f"{MAX_CONTENT_SAMPLE} of an hour larger than BACKFILL_CONTENT_SAMPLE_ABOVE records)"
        ),
    ] = 16
    """K: the decoded_content check decodes 1 record in K of a large hour."""
    BACKFILL_CONTENT_SAMPLE_ABOVE: Count = 50_000
    """Hours with more records than this are sampled."""
    BACKFILL_MAX_HOURS_PER_RUN: Annotated[
        int,
        Field(ge=1, le=MAX_HOURS_PER_RUN),
        Allowed(f"1 to {MAX_HOURS_PER_RUN} hours (a year); default 720 (30 days)"),
    ] = 720
    """Hours one backfill run covers at most: the unit of retry and of publication."""
    BACKFILL_FAULT_POINT: FaultPoint | None = None
    """Test-only: a failpoint where a run kills itself (stack/faults.py)."""

    BACKFILL_MAINTENANCE_EXPIRE: bool = True
    """Expire old snapshots."""
    BACKFILL_MAINTENANCE_SNAPSHOT_RETENTION_HOURS: Count = 168
    """Snapshots younger than this are kept: the rollback window."""
    BACKFILL_MAINTENANCE_MIN_SNAPSHOTS: Positive = 5
    """Snapshots of each branch kept whatever their age."""
    BACKFILL_MAINTENANCE_ORPHANS: bool = True
    """Remove files no snapshot references."""
    BACKFILL_MAINTENANCE_ORPHAN_RETENTION_HOURS: Annotated[
        int,
        Field(ge=24),
        Allowed("24 or more (default 72): files of a write still running could be deleted"),
    ] = 72
    """Only orphan files older than this are removed."""
    BACKFILL_MAINTENANCE_COMPACTION: bool = True
    """Compact small data files and manifests."""
    BACKFILL_MAINTENANCE_TARGET_FILE_MB: Positive = 128
    """Target data file size of compaction, MiB."""
    BACKFILL_MAINTENANCE_BRANCHES: bool = True
    """Drop the branches of runs that ended without publishing."""
    BACKFILL_MAINTENANCE_BRANCH_RETENTION_HOURS: Count = 72
    """How long a failed run's branch is kept."""
    BACKFILL_MAINTENANCE_RUNNING_GRACE_HOURS: Positive = 24
    """Age of a branch of a run of unknown outcome before it is dropped."""
    BACKFILL_MAINTENANCE_CRON: Annotated[
        str,
        StringConstraints(strip_whitespace=True, pattern=r"^\S+(\s+\S+){4}$"),
        Allowed("a 5-field cron expression, e.g. '17 3 * * *'"),
    ] = "17 3 * * *"
    """Cron (UTC) of the maintenance schedules."""
    BACKFILL_MAINTENANCE_SCHEDULES: bool = True
    """Default status of the maintenance schedules."""
    BACKFILL_QUARANTINE_BYTES_DAYS: Annotated[int | None, Field(ge=0)] = None
    """Days quarantined records' raw bytes are kept (unset: for good)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The sources of the read under way (:func:`_read`), highest first; else the
        documented ones (:func:`_sources`). The defaults come after them."""
        sources = _READING.get()
        return tuple(s for _, s in (_sources(None) if sources is None else sources))


# --- Where the values come from --------------------------------------------------
# The sources of a read, highest first, each with its name as `backfill-assets settings`
# shows it ("override": the Dagster resources' configured secrets, never listed).
Origin = Literal["override", ".env", "environment", "settings file"]
Sources = Sequence[tuple[Origin, PydanticBaseSettingsSource]]
_READING: ContextVar[Sources | None] = ContextVar("backfill_settings_sources", default=None)


class _Given(EnvSettingsSource):
    """Variables given as a mapping, read as the environment is (empty means unset)."""

    def __init__(self, settings_cls: type[BaseSettings], variables: Mapping[str, str]) -> None:
        self._given = {name: value for name, value in variables.items() if value != ""}
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return self._given


class _SettingsFile(TomlConfigSettingsSource):
    """``BACKFILL_SETTINGS_FILE``: a TOML file whose keys are the variables' names, prefix
    included (``BACKFILL_HOME = "/srv/backfill"``), so one name means one setting everywhere;
    a key that is no variable is refused, as is a missing file."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise SettingsError(
                f"{SETTINGS_FILE}={str(path)!r} is not a file; allowed: a TOML file of settings "
                "(keys: the variable names, e.g. BACKFILL_HOME), or unset"
            )
        super().__init__(settings_cls, toml_file=path)

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            doc = super()._read_file(file_path)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{SETTINGS_FILE}={str(self.path)!r} is not TOML: {exc}") from None
        names = set(Environment.model_fields) - {SETTINGS_FILE}
        for key in doc:
            if key not in names:
                raise SettingsError(
                    f"{SETTINGS_FILE}={str(self.path)!r}: {key!r} is not a setting; allowed: the "
                    "variable names `backfill-assets settings` lists, e.g. BACKFILL_HOME"
                )
        return doc


def _sources(
    environ: Mapping[str, str] | None, overrides: Mapping[str, str] | None = None
) -> list[tuple[Origin, PydanticBaseSettingsSource]]:
    """The sources of one read, highest first (infra/README.md): ``overrides``; then
    ``environ`` alone if given; else the current directory's ``.env`` (its values win over the
    environment, as in Dagster's processes), the process environment, and the file
    ``BACKFILL_SETTINGS_FILE`` names (in .env or the environment). Defaults come last."""
    cls = Environment
    found: list[tuple[Origin, PydanticBaseSettingsSource]] = []
    if overrides:
        found.append(("override", _Given(cls, overrides)))
    if environ is not None:
        return [*found, ("environment", _Given(cls, environ))]
    process = EnvSettingsSource(cls)
    path = process.env_vars.get(SETTINGS_FILE)
    if Path(ENV_FILE).is_file():  # else nothing to read (a source costs ~1 ms a read)
        dotenv = DotEnvSettingsSource(cls, env_file=ENV_FILE, dotenv_filtering="only_existing")
        found.append((".env", dotenv))
        path = dotenv.env_vars.get(SETTINGS_FILE) or path
    found.append(("environment", process))
    if path:
        found.append(("settings file", _SettingsFile(cls, Path(path))))
    return found


def _read(sources: Sources) -> Environment:
    """The variables as ``sources`` give them, checked by pydantic; an invalid one raises
    :class:`SettingsError` naming it, its value (masked) and what is allowed."""
    token = _READING.set(sources)
    try:
        return Environment()
    except ValidationError as exc:
        raise SettingsError(_message(exc, sources)) from None
    finally:
        _READING.reset(token)


# How pydantic's error types read in a message (greater_than_equal: see _problem).
_PROBLEMS = {
    "int_parsing": "is not a whole number",
    "int_from_float": "is not a whole number",
    "int_type": "is not a whole number",
    "bool_parsing": "is not a switch",
    "bool_type": "is not a switch",
    "literal_error": "is not supported",
    "string_pattern_mismatch": "is not of the allowed form",
    "path_not_file": "is not a file",
    "ip_v4_address": "is not an IPv4 address",
}


def _message(exc: ValidationError, sources: Sources) -> str:
    """One line for the first invalid variable (the others named after it): its name, its
    value as given (masked), where it was set unless in the environment, what is allowed."""
    errors = [e for e in exc.errors() if e["type"] != "default_factory_not_called"]
    first = errors[0]
    name = str(first["loc"][0])
    if first["type"] == "value_error":  # the field's own check, whose message names it
        text = str(first["ctx"]["error"])
    else:
        raw = first["input"]
        shown = repr(masked(name, raw) if isinstance(raw, str) else raw)
        problem = _problem(first)
        allowed = _allowed_text(Environment.model_fields[name])
        text = f"{name}={shown} {problem}"
        text += f"; allowed: {allowed}" if allowed and allowed not in problem else ""
    where = next((origin for origin, source in sources if name in source()), "environment")
    if where == "settings file":
        text += f" (set in {SETTINGS_FILE}={os.fspath(_settings_path(sources))!r})"
    elif where == ".env":
        text += f" (set in {Path.cwd() / ENV_FILE})"
    elif where == "override":
        text += " (set in a resource's configuration)"
    others = sorted({str(e["loc"][0]) for e in errors[1:]} - {name})
    return text + (f"; also invalid: {', '.join(others)}" if others else "")


def _settings_path(sources: Sources) -> Path:
    return next(s.path for _, s in sources if isinstance(s, _SettingsFile))


def _problem(error: ErrorDetails) -> str:
    kind = error["type"]
    ctx = error.get("ctx", {})
    if kind == "greater_than_equal":
        least = ctx["ge"]
        if least in (0, 1):
            return f"must be {'zero or ' if least == 0 else ''}a positive whole number"
        return f"is below {least}"
    if kind == "less_than_equal":
        return f"is above {ctx['le']}"
    return _PROBLEMS.get(kind, f"is not valid ({error['msg']})")


def _allowed_text(info: FieldInfo) -> str | None:
    """What ``info`` allows: its own words, else its choices, a switch's, or its bounds."""
    own = next((m.text for m in info.metadata if isinstance(m, Allowed)), None)
    if own is not None:
        return own
    choices = _choices(info.annotation)
    if choices:
        return ", ".join(choices)
    if info.annotation is bool:
        return "on, off"
    least = next((m.ge for m in info.metadata if hasattr(m, "ge")), None)
    most = next((m.le for m in info.metadata if hasattr(m, "le")), None)
    if least is not None and most is not None:
        return f"{least} to {most}"
    if least is not None:
        return {0: "zero or a positive whole number", 1: "a positive whole number"}.get(
            least, f"{least} or more"
        )
    return None


def _choices(annotation: Any) -> tuple[str, ...]:
    if get_origin(annotation) is Literal:
        return tuple(str(a) for a in get_args(annotation))
    return tuple(c for arg in get_args(annotation) for c in _choices(arg))


# --- From variables to settings ----------------------------------------------------
def _settings(env: Environment) -> Settings:
    """The :class:`Settings` of ``env``, with the checks that span variables."""
    return Settings(
        home=env.BACKFILL_HOME,
        jar_cache=env.BACKFILL_JAR_CACHE,
        kafka=_kafka_settings(env),
        catalog=_catalog_settings(env),
        spark_master=env.BACKFILL_SPARK_MASTER,
        spark_driver_memory=env.BACKFILL_SPARK_DRIVER_MEMORY,
        spark_shuffle_partitions=env.BACKFILL_SPARK_SHUFFLE_PARTITIONS,
        spark_executor_memory=env.BACKFILL_SPARK_EXECUTOR_MEMORY,
        spark_executor_cores=env.BACKFILL_SPARK_EXECUTOR_CORES,
        spark_extra_conf=_spark_conf(env.BACKFILL_SPARK_CONF),
        spark_cds=env.BACKFILL_SPARK_CDS,
        archive_uri=env.BACKFILL_ARCHIVE_URI,
        archive_file_records=env.BACKFILL_ARCHIVE_FILE_RECORDS,
        dagster_storage=env.BACKFILL_DAGSTER_STORAGE,
        webserver_host=env.BACKFILL_WEBSERVER_HOST,
        webserver_port=env.BACKFILL_WEBSERVER_PORT,
        sensors_running=env.BACKFILL_SENSORS,
        sensor_interval_s=env.BACKFILL_SENSOR_INTERVAL_S,
        gap_read_budget=env.BACKFILL_GAP_READ_BUDGET,
        replay_max_records_per_s=env.BACKFILL_REPLAY_MAX_RECORDS_PER_S,
        seal_grace_s=env.BACKFILL_SEAL_GRACE_S,
        publish_attempts=env.BACKFILL_PUBLISH_ATTEMPTS,
        fault_point=env.BACKFILL_FAULT_POINT,
        content_sample=env.BACKFILL_CONTENT_SAMPLE,
        content_sample_above=env.BACKFILL_CONTENT_SAMPLE_ABOVE,
        max_hours_per_run=env.BACKFILL_MAX_HOURS_PER_RUN,
        spec_path=env.BACKFILL_SPEC,
        maintenance=_maintenance(env),
        run_executor=env.BACKFILL_RUN_EXECUTOR,
        spark_connect=env.BACKFILL_SPARK_CONNECT,
        spark_connect_port=env.BACKFILL_SPARK_CONNECT_PORT,
        spark_connect_bind=str(env.BACKFILL_SPARK_CONNECT_BIND),
        spark_connect_token=_secret(env.BACKFILL_SPARK_CONNECT_TOKEN),
        schema_registry_url_setting=env.BACKFILL_SCHEMA_REGISTRY_URL,
        schema_registry_port=env.BACKFILL_SCHEMA_REGISTRY_PORT,
        **_schema_registry_auth(env),
        cdc_postgres_port=env.BACKFILL_CDC_POSTGRES_PORT,
        kafka_connect_port=env.BACKFILL_KAFKA_CONNECT_PORT,
        kafka_connect_heap=env.BACKFILL_KAFKA_CONNECT_HEAP,
    )


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def _is_set(env: Environment, name: str) -> bool:
    """Whether a source set variable ``name`` (a default does not count)."""
    return name in env.model_fields_set


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


def _kafka_settings(env: Environment) -> KafkaSettings:
    """The Kafka settings (BACKFILL_KAFKA_*), checked together."""
    port = env.BACKFILL_KAFKA_PORT
    if port == env.BACKFILL_KAFKA_CONTROLLER_PORT:
        raise SettingsError(
            f"BACKFILL_KAFKA_CONTROLLER_PORT must differ from BACKFILL_KAFKA_PORT (both are {port})"
        )
    props = _kafka_properties(env)
    protocol = props.pop("security.protocol", env.BACKFILL_KAFKA_SECURITY_PROTOCOL).upper()
    mechanism = props.pop("sasl.mechanism", env.BACKFILL_KAFKA_SASL_MECHANISM or "").upper() or None
    if protocol.startswith("SASL") and mechanism is None:
        raise SettingsError(
            f"security protocol {protocol} needs BACKFILL_KAFKA_SASL_MECHANISM (or sasl.mechanism "
            f"in {kafka_auth.VARIABLE}): one of {', '.join(kafka_auth.MECHANISMS)}"
        )
    keystore = env.BACKFILL_KAFKA_SSL_KEYSTORE
    return KafkaSettings(
        bootstrap_servers=env.BACKFILL_KAFKA_BOOTSTRAP,
        security_protocol=protocol,
        sasl_mechanism=mechanism,
        sasl_username=env.BACKFILL_KAFKA_SASL_USERNAME,
        sasl_password=_secret(env.BACKFILL_KAFKA_SASL_PASSWORD),
        ssl_ca_location=env.BACKFILL_KAFKA_SSL_CA_LOCATION,
        local_port=port,
        local_controller_port=env.BACKFILL_KAFKA_CONTROLLER_PORT,
        local_heap=env.BACKFILL_KAFKA_HEAP,
        local_ssl_keystore=None if keystore is None else str(keystore),
        properties=props,
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


def _kafka_properties(env: Environment) -> dict[str, str]:
    """``BACKFILL_KAFKA_PROPERTIES`` (stack/kafka_auth.py), none set twice: a property one of
    the SASL/CA settings stands for is refused, naming that setting."""
    raw = (env.BACKFILL_KAFKA_PROPERTIES or "").strip()
    if not raw:
        return {}
    props = kafka_auth.parse(raw)
    for variable, names in _KAFKA_SUGAR.items():
        for name in names:
            if name in props and _is_set(env, variable):
                raise SettingsError(
                    f"{kafka_auth.VARIABLE}: {name} is set by {variable}; set it in one place"
                )
    return props


def _catalog_settings(env: Environment) -> CatalogSettings:
    """The catalog settings (BACKFILL_CATALOG_*, BACKFILL_WAREHOUSE, S3), checked together."""
    kind = env.BACKFILL_CATALOG_KIND
    uri = env.BACKFILL_CATALOG_URI
    if not uri:
        raise SettingsError(
            "BACKFILL_CATALOG_KIND=rest needs BACKFILL_CATALOG_URI (the REST catalog's base URL)"
        )
    if kind == "sql" and not uri.startswith(("sqlite:///", "postgresql")):
        raise SettingsError(
            f"BACKFILL_CATALOG_URI={masked('BACKFILL_CATALOG_URI', uri)!r} is not a SQL catalog "
            "URI: use sqlite:///ABS/PATH.db or postgresql+psycopg2://HOST:PORT/DB"
        )
    return CatalogSettings(
        name=env.BACKFILL_CATALOG_NAME,
        kind=kind,
        uri=uri,
        warehouse=env.BACKFILL_WAREHOUSE,
        namespace=env.BACKFILL_NAMESPACE,
        jdbc_user=env.BACKFILL_CATALOG_JDBC_USER,
        jdbc_password=_secret(env.BACKFILL_CATALOG_JDBC_PASSWORD),
        s3_endpoint=env.BACKFILL_S3_ENDPOINT,
        s3_access_key_id=_secret(env.AWS_ACCESS_KEY_ID),
        s3_secret_access_key=_secret(env.AWS_SECRET_ACCESS_KEY),
        s3_region=env.AWS_REGION,
        properties=_catalog_properties(env.BACKFILL_CATALOG_PROPERTIES),
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


def _catalog_properties(raw: str | None) -> dict[str, str]:
    """``BACKFILL_CATALOG_PROPERTIES``: Iceberg catalog properties as a JSON object of strings
    (or numbers, booleans), given as they are to pyiceberg and to Spark's Iceberg catalog, e.g.
    ``{"credential": "ID:SECRET", "scope": "catalog"}``. Properties the project sets from its
    own settings are refused, naming that setting. Values never appear in messages."""
    name = "BACKFILL_CATALOG_PROPERTIES"
    example = 'e.g. {"credential": "CLIENT_ID:CLIENT_SECRET", "scope": "catalog"}'
    # The position only: the message of a JSON error can quote the (secret) text.
    doc = _json_object(name, raw, "Iceberg catalog properties", example, detail=False)
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
        props[key] = _property(name, repr(key), value)
    return props


def _json_object(
    name: str, raw: str | None, what: str, example: str, detail: bool
) -> dict[str, Any]:
    """The JSON object variable ``name`` holds ({} when unset or blank)."""
    raw = (raw or "").strip()
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        where = exc.msg if detail else f"at character {exc.pos}"
        raise SettingsError(f"{name} is not valid JSON ({where}); {example}") from None
    if not isinstance(doc, dict):
        raise SettingsError(f"{name} must be a JSON object of {what}; {example}")
    return doc


def _property(name: str, key: str, value: object) -> str:
    """A property's value as text: strings, numbers and booleans only."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise SettingsError(f"{name}: {key} must be a string, number or boolean")


def _spark_conf(raw: str | None) -> dict[str, str]:
    """``BACKFILL_SPARK_CONF``: extra ``spark.*`` settings as a JSON object of strings (or
    numbers, booleans), e.g. ``{"spark.executor.instances": "4"}``."""
    name = "BACKFILL_SPARK_CONF"
    example = 'e.g. {"spark.executor.instances": "4"}'
    doc = _json_object(name, raw, "spark.* settings", example, detail=True)
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
        conf[key] = _property(name, key, value)
    return conf


def _schema_registry_auth(env: Environment) -> dict[str, Any]:
    """The registry's credentials: ``BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH`` (``user:password``)
    or ``BACKFILL_SCHEMA_REGISTRY_TOKEN`` (a bearer token), not both; with a token,
    ``BACKFILL_SCHEMA_REGISTRY_LOGICAL_CLUSTER`` (Confluent Cloud's ``lsrc-...``, else empty)."""
    basic = _secret(env.BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH)
    token = _secret(env.BACKFILL_SCHEMA_REGISTRY_TOKEN)
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
        "schema_registry_logical_cluster": env.BACKFILL_SCHEMA_REGISTRY_LOGICAL_CLUSTER,
    }


def _maintenance(env: Environment) -> MaintenanceSettings:
    days = env.BACKFILL_QUARANTINE_BYTES_DAYS
    return MaintenanceSettings(
        expire_snapshots=env.BACKFILL_MAINTENANCE_EXPIRE,
        snapshot_retention=timedelta(hours=env.BACKFILL_MAINTENANCE_SNAPSHOT_RETENTION_HOURS),
        min_snapshots=env.BACKFILL_MAINTENANCE_MIN_SNAPSHOTS,
        remove_orphans=env.BACKFILL_MAINTENANCE_ORPHANS,
        orphan_retention=timedelta(hours=env.BACKFILL_MAINTENANCE_ORPHAN_RETENTION_HOURS),
        compact=env.BACKFILL_MAINTENANCE_COMPACTION,
        target_file_bytes=env.BACKFILL_MAINTENANCE_TARGET_FILE_MB * 1024 * 1024,
        drop_branches=env.BACKFILL_MAINTENANCE_BRANCHES,
        branch_retention=timedelta(hours=env.BACKFILL_MAINTENANCE_BRANCH_RETENTION_HOURS),
        running_grace=timedelta(hours=env.BACKFILL_MAINTENANCE_RUNNING_GRACE_HOURS),
        cron=env.BACKFILL_MAINTENANCE_CRON,
        schedules_running=env.BACKFILL_MAINTENANCE_SCHEDULES,
        quarantine_bytes_retention=None if days is None else timedelta(days=days),
    )


# --- Listing ------------------------------------------------------------------------
# The variables that hold secrets (pydantic's SecretStr fields): masked whole by
# `backfill-assets settings`. The Dagster resources show these and the JSON settings that may
# carry secrets as EnvVars, never as values (backfill_assets.defs.resources).
SECRET_VARS = tuple(
    name
    for name, info in Environment.model_fields.items()
    if SecretStr in (info.annotation, *get_args(info.annotation))
)


@dataclass(frozen=True)
class Setting:
    """One variable of :class:`Environment`, as ``backfill-assets settings`` shows it: its
    value (None: unset), its default (None: unset) and where the value came from, secrets
    masked."""

    variable: str
    value: str | None
    default: str | None
    source: Literal["environment", ".env", "settings file", "default"]
    secret: bool


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
    """Every variable of :class:`Environment` read as :meth:`Settings.from_env` reads it
    (``environ`` alone when given), sorted by name: value as given, default (one that follows
    other settings as it follows them) and source, secrets masked. Raises
    :class:`SettingsError` as ``from_env`` does."""
    sources = _sources(environ)
    env = _read(sources)
    _settings(env)  # the checks that span variables
    given = [(origin, source()) for origin, source in sources]
    values = dict(env)
    rows = []
    for name, info in sorted(Environment.model_fields.items()):
        default = _text(info.get_default(call_default_factory=True, validated_data=values))
        origin, raw = next(((o, found[name]) for o, found in given if name in found), (None, None))
        rows.append(
            Setting(
                variable=name,
                value=masked(name, default if origin is None else _text(raw)),
                default=masked(name, default),
                source=_listed(origin),
                secret=name in SECRET_VARS,
            )
        )
    return rows


def _listed(origin: Origin | None) -> Literal["environment", ".env", "settings file", "default"]:
    """A value's source as the listing names it (an override is none of the listing's)."""
    if origin is None or origin == "override":
        return "default"
    return origin


def _text(value: object) -> str | None:
    """A value as the listing shows it: switches ``on``/``off``, TOML tables as JSON, empty
    as unset."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return None if value is None or value == "" else str(value)


# --- Schema registry -----------------------------------------------------------
# Where Apicurio Registry (the local registry) serves the Confluent Schema Registry API.
CCOMPAT_PATH = "/apis/ccompat/v7"


def local_registry_url(port: int) -> str:
    return f"http://127.0.0.1:{port}{CCOMPAT_PATH}"
