"""Spark configuration: the same code builds a ``local[2]`` session here and a cluster one in
production; only :class:`~backfill_assets.stack.settings.Settings` differs."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backfill_assets.errors import SettingsError, SparkConnectError
from backfill_assets.stack import catalog, cds, jars, process
from backfill_assets.stack.settings import Settings, is_secret_name

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.client.retries import DefaultPolicy

_log = logging.getLogger(__name__)

# HotSpot leaves methods over 8,000 bytes of bytecode to the interpreter. The replay's parse
# (a strict kind check per field, per schema version, and the quarantine reason) makes Spark
# generate a 14,720-byte processNext, which then ran interpreted (bench/parse.py: the parse
# 3.0 s -> 2.0 s for 203,916 records with this option). Given to the driver and executors.
JIT_OPTIONS = "-XX:-DontCompileHugeMethods"


# Spark's default spark.redaction.regex, plus the catalog's credential and authorization keys.
REDACTION_REGEX = "(?i)secret|password|token|access[.]key|credential|authorization"


def spark_config(settings: Settings, extra: Mapping[str, object] | None = None) -> dict[str, str]:
    """Every Spark setting the project needs, as given to the session builder; ``extra``
    (the resource's ``spark_config``) comes last. Contains catalog secrets, never log it whole."""
    local = settings.spark_master.startswith("local")
    conf = {
        "spark.master": settings.spark_master,
        "spark.app.name": "backfill_assets",
        "spark.jars": ",".join(str(p) for p in spark_jars(settings)),
        "spark.sql.extensions": (
            "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
        ),
        **_session_sql(settings),
        "spark.driver.memory": settings.spark_driver_memory,
        "spark.executor.memory": settings.spark_executor_memory or "",
        "spark.executor.cores": (
            str(settings.spark_executor_cores) if settings.spark_executor_cores else ""
        ),
        "spark.ui.showConsoleProgress": "false",
        # Spark's default redaction (UI, event log) misses Iceberg's `credential` property and
        # `header.Authorization`: redact every key naming a secret the settings mask.
        "spark.redaction.regex": REDACTION_REGEX,
        # Local runs bind the UI and driver to loopback only.
        "spark.driver.host": "127.0.0.1" if local else "",
        "spark.driver.bindAddress": "127.0.0.1" if local else "",
        "spark.ui.enabled": "false" if local else "true",
        # Local Python workers must use this interpreter (pandas, pyarrow, pandera live here);
        # a cluster's workers use their image's interpreter (infra/production/Dockerfile,
        # target spark-worker).
        "spark.pyspark.python": sys.executable if local else "",
        "spark.pyspark.driver.python": sys.executable if local else "",
    }
    conf = {k: v for k, v in conf.items() if v != ""}
    conf.update(catalog.spark_properties(settings.catalog))
    conf.update(_archive_s3a(settings))
    conf.update(settings.spark_extra_conf)
    for key, value in (extra or {}).items():
        conf[key] = str(value).lower() if isinstance(value, bool) else str(value)
    # Ours come first, so an option the settings give (the last one wins) overrides them.
    driver = JIT_OPTIONS
    if local:
        driver = f"{local_heap_option(settings)} {driver}"
    if local and (sharing := cds.java_options(settings)):
        driver = f"{sharing} {driver}"  # the class-data-sharing archive
    if local:
        driver = f"{log_options(settings)} {driver}"
    for key, ours in (
        ("spark.driver.extraJavaOptions", driver),
        ("spark.executor.extraJavaOptions", JIT_OPTIONS),
    ):
        conf[key] = f"{ours} {conf.get(key, '')}".strip()
    return conf


def needs_cloud_jars(settings: Settings) -> bool:
    """Whether Spark needs the ``spark-cloud`` jar set: a JDBC catalog on Postgres, or the
    warehouse or the archive on S3. The default local stack (SQLite, ``file://``) does not, so
    its classpath, and the class-data-sharing archive built for it, stay as they are."""
    cfg = settings.catalog
    return (
        (cfg.kind == "sql" and cfg.uri.startswith("postgresql"))
        or cfg.warehouse.startswith(("s3://", "s3a://"))
        or settings.archive_uri.startswith(("s3://", "s3a://"))
    )


def spark_jars(settings: Settings) -> list[Path]:
    """The jars given to Spark (``spark.jars``): the ``spark`` set, the ``spark-cloud`` set when
    :func:`needs_cloud_jars`, the ``spark-formats`` set (spark-avro, for avro topics'
    ``from_avro``) and the project's own JVM functions. The class-data-sharing archive is keyed
    by the ``spark`` set only: ``spark.jars`` are loaded by Spark's own class loader, not from
    the JVM's class path the archive was built for, so adding spark-avro leaves it valid."""
    cloud = jars.jars(settings, "spark-cloud") if needs_cloud_jars(settings) else []
    formats = jars.jars(settings, "spark-formats")
    return [*jars.jars(settings, "spark"), *cloud, *formats, jars.udf_jar(settings)]


def _session_sql(settings: Settings) -> dict[str, str]:
    """The per-session SQL settings: in the classic builder, and what a Spark Connect client
    sends (:func:`connect_session`)."""
    return {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": str(settings.spark_shuffle_partitions),
        "spark.sql.adaptive.enabled": "true",
    }


LOG4J_CONFIG = Path(__file__).resolve().parent / "spark-log4j2.properties"


def log_options(settings: Settings) -> str:
    """The local driver logs warnings to ``<BACKFILL_HOME>/logs/spark-driver.log`` and only
    errors to the console (Spark's default prints its profile banner and start-up warnings on
    every run). A ``log4j2.configurationFile`` in the settings' own options still wins."""
    logs = settings.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return f"-Dlog4j2.configurationFile={LOG4J_CONFIG} -Dbackfill.log.dir={logs}"


def local_heap_option(settings: Settings) -> str:
    """The local driver's heap is sized up front (``-Xms`` = ``spark.driver.memory``).

    In local mode the driver JVM is also the executor. Left to grow, G1 expands its heap
    toward the bound as a longer run keeps allocating: a 10x window peaked at 1.48x the
    resident memory of a 1x window although what either holds after a full GC is the same
    (bench/throughput.py, scale). Sized up front, the footprint is what is configured,
    whatever the window (1.06x), at the price of a small window's: +0.8 GiB for 2g."""
    return f"-Xms{settings.spark_driver_memory}"


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


# Settings whose value may be shown in a warning (no secrets), with the variable that sets them.
_NAMED = {
    "spark.master": "BACKFILL_SPARK_MASTER",
    "spark.driver.memory": "BACKFILL_SPARK_DRIVER_MEMORY",
    "spark.executor.memory": "BACKFILL_SPARK_EXECUTOR_MEMORY",
    "spark.executor.cores": "BACKFILL_SPARK_EXECUTOR_CORES",
}


def get_session(settings: Settings, extra: Mapping[str, object] | None = None) -> SparkSession:
    """The process's Spark session, built on first use with every setting of
    :func:`spark_config` in the builder (core settings such as executor memory only take
    effect there). A session that already runs is reused; any core setting it was built with
    differently is logged as a warning naming the setting, since Spark cannot change it."""
    from pyspark.sql import SparkSession

    # py4j logs every call into the JVM with its arguments at DEBUG: the Kafka JAAS line and
    # catalog passwords would land in any DEBUG log. Never let it go below INFO.
    logging.getLogger("py4j").setLevel(logging.INFO)
    catalog.init_local_catalog(settings.catalog)
    if settings.spark_connect:
        return connect_session(settings, extra)
    if settings.spark_master.startswith("local"):
        # PySpark picks the worker interpreter from PYSPARK_PYTHON when the context starts.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        # A local session binds to loopback anyway; without this the JVM first warns that the
        # host name resolves to a loopback address and picks another interface.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    conf = spark_config(settings, extra)
    existing = _running_session()
    if existing is not None:
        _warn_fixed_settings(existing, conf)
    # A new driver JVM gets its secrets from a properties file, not its command line.
    hidden = secret_settings(conf) if existing is None else {}
    builder = SparkSession.builder
    for key, value in conf.items():
        if key not in hidden:
            builder = builder.config(key, value)
    with submit_properties(hidden):
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session


def secret_settings(conf: Mapping[str, str]) -> dict[str, str]:
    """The settings of ``conf`` whose name says they hold a secret (password, key, token,
    credential: the catalog's, Hadoop's ``fs.s3a.*.key``, any of ``BACKFILL_SPARK_CONF``)."""
    return {key: value for key, value in conf.items() if is_secret_name(key)}


SUBMIT_ARGS = "PYSPARK_SUBMIT_ARGS"


@contextlib.contextmanager
def submit_properties(conf: Mapping[str, str]) -> Iterator[None]:
    """While pyspark starts a driver JVM: ``conf`` in a properties file (mode 0600) that
    spark-submit reads, named in ``PYSPARK_SUBMIT_ARGS``. pyspark hands every builder setting to
    spark-submit as ``--conf KEY=VALUE``, which any user on the machine can read in ``ps``;
    the file is removed as soon as the JVM has started (it reads the file before it serves)."""
    if not conf:
        yield
        return
    before = os.environ.get(SUBMIT_ARGS)
    if before and "--properties-file" in before:
        raise SettingsError(
            f"{SUBMIT_ARGS} names a --properties-file, but the Spark settings that hold secrets "
            f"({', '.join(sorted(conf))}) need their own; give yours in BACKFILL_SPARK_CONF"
        )
    fd, path = tempfile.mkstemp(prefix="backfill-spark-", suffix=".conf")  # mode 0600
    with os.fdopen(fd, "w") as out:
        out.write(process.properties_text(conf))
    os.environ[SUBMIT_ARGS] = f"--properties-file {shlex.quote(path)} {before or 'pyspark-shell'}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SUBMIT_ARGS, None)
        else:
            os.environ[SUBMIT_ARGS] = before
        os.unlink(path)


def _running_session() -> SparkSession | None:
    from pyspark.sql import SparkSession

    session = SparkSession._instantiatedSession
    if session is None or session._sc._jsc is None:
        return None
    return session


def _warn_fixed_settings(session: SparkSession, conf: Mapping[str, str]) -> None:
    """Log, per core setting (fixed when the SparkContext started), that the running session
    differs from what the settings ask for. SQL settings (``spark.sql.*``, ``spark.hadoop.*``)
    are per session and applied by the builder, so they are not compared."""
    running = dict(session.sparkContext.getConf().getAll())
    for key, wanted in conf.items():
        if key.startswith(("spark.sql.", "spark.hadoop.")) or key == "spark.app.name":
            continue
        have = running.get(key)
        if have == wanted:
            continue
        if key.endswith("extraJavaOptions") and set(wanted.split()) <= set((have or "").split()):
            continue  # Spark adds its own JVM options to the ones it was given
        if key in _NAMED:
            detail = f"{key}={have or '(Spark default)'}, not {wanted} ({_NAMED[key]})"
        else:
            detail = f"{key} differs from the settings"
        _log.warning(
            "a Spark session already runs in this process and keeps its %s: core settings "
            "only apply when the session is built; stop that session (or restart the "
            "process) to apply them",
            detail,
        )


# --- Spark Connect ---------------------------------------------------------------
# Static SQL settings belong to the server (its properties file, or the remote endpoint's own
# configuration); a client may only change the per-session ones.
_SERVER_SQL = ("spark.sql.extensions", "spark.sql.catalog.", "spark.sql.warehouse.dir")
_connect_sessions: dict[str, SparkSession] = {}
# Per URL: the session and the settings this process last gave it (_apply_confs).
_applied_confs: dict[str, tuple[Any, dict[str, str]]] = {}


def is_connect(session: SparkSession) -> bool:
    """Whether ``session`` is a Spark Connect client (no JVM handle: ``sparkContext``,
    ``_jvm`` and ``_jsparkSession`` are not there)."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def session_confs(conf: Mapping[str, str]) -> dict[str, str]:
    """The settings a Spark Connect client sends: per-session ``spark.sql.*`` ones only (core
    and static settings, and the catalog with its secrets, are fixed by the server)."""
    return {
        k: v
        for k, v in conf.items()
        if k.startswith("spark.sql.") and not k.startswith(_SERVER_SQL)
    }


def check_connect(settings: Settings, timeout_s: float = 5.0) -> str:
    """The Spark version the ``BACKFILL_SPARK_CONNECT`` endpoint reports, without switching
    this process to Spark Connect; :class:`SparkConnectError` if it does not answer."""
    url = settings.spark_connect
    assert url is not None
    version = probe(url, timeout_s, settings.spark_connect_token)
    if version is None:
        host, port = endpoint(url)
        raise SparkConnectError(
            f"BACKFILL_SPARK_CONNECT={url.split(';', 1)[0]}: no Spark Connect server answers at "
            f"{host}:{port}. Start the local one (`backfill-assets stack up`) or fix the URL; "
            "unset it for in-process Spark"
        )
    return version


def connect_session(
    settings: Settings, extra: Mapping[str, object] | None = None, timeout_s: float = 5.0
) -> SparkSession:
    """A thin-client session on the ``BACKFILL_SPARK_CONNECT`` endpoint (no JVM in this
    process), reused within the process per URL like the classic session. Raises
    :class:`SparkConnectError` naming the setting within about ``timeout_s`` when the
    endpoint does not answer (the client's own retries would wait about 10 minutes)."""

    url = settings.spark_connect
    assert url is not None
    shown = url.split(";", 1)[0]  # the parameters may hold a token
    session = _connect_sessions.get(url)
    if session is None or getattr(session, "is_stopped", True):
        host, port = endpoint(url)
        if not port_open(host, port, timeout_s):
            raise SparkConnectError(
                f"BACKFILL_SPARK_CONNECT={shown}: nothing answers at {host}:{port}. Start the "
                "local server (`backfill-assets stack up`) or fix the URL; unset it for "
                "in-process Spark"
            )
        session = _remote_session(url, settings.spark_connect_token)
        client = session.client
        policies = client.get_retry_policies()
        client.set_retry_policies([quick_retries(timeout_s)])
        try:
            session.version  # noqa: B018 - the first request: is this Spark Connect?
        except Exception as exc:
            raise SparkConnectError(
                f"BACKFILL_SPARK_CONNECT={shown}: {host}:{port} does not answer as a Spark "
                f"Connect server ({type(exc).__name__}: "
                f"{(str(exc).strip().splitlines() or [''])[0][:200]}). Check the URL, or the "
                "server's log (`backfill-assets stack status`)"
            ) from None
        finally:
            client.set_retry_policies(policies)
        _connect_sessions[url] = session
    # Not spark_config(): a thin client needs neither the jars nor a JDK to build the UDF jar.
    conf = {**_session_sql(settings), **settings.spark_extra_conf}
    for key, value in (extra or {}).items():
        conf[key] = str(value).lower() if isinstance(value, bool) else str(value)
    _apply_confs(url, session, session_confs(conf))
    return session


def _apply_confs(url: str, session: Any, confs: dict[str, str]) -> None:
    """Give the session exactly ``confs`` of the settings this module sets: all in one Config
    request (one round trip, not one per setting), none when they are what this process last
    gave the same session; a setting an earlier caller gave and this one does not is unset,
    so one run's ``spark_config`` never outlives it in the process's shared session."""
    from pyspark.sql.connect import proto

    before_session, before = _applied_confs.get(url, (None, {}))
    if before_session is not session:
        before = {}
    elif before == confs:
        return
    stale = [k for k in before if k not in confs]
    if stale:
        session.client.config(
            proto.ConfigRequest.Operation(unset=proto.ConfigRequest.Unset(keys=stale))
        )
    pairs = [proto.KeyValue(key=k, value=v) for k, v in confs.items()]
    session.client.config(proto.ConfigRequest.Operation(set=proto.ConfigRequest.Set(pairs=pairs)))
    _applied_confs[url] = (session, dict(confs))


def probe(url: str, timeout_s: float, token: str | None = None) -> str | None:
    """The Spark version a Spark Connect endpoint reports, or None if it does not answer
    within about ``timeout_s`` (or refuses the client: a wrong or missing ``token``). Uses the
    Connect client's own session class, so the process is not switched to Connect mode (a
    classic session in it keeps working)."""
    from pyspark.sql.connect.client.retries import DefaultPolicy
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    host, port = endpoint(url)
    if not port_open(host, port, min(timeout_s, 3.0)):
        return None
    session = remote_builder(RemoteSession.builder, url, token).create()
    try:
        session.client.set_retry_policies([quick_retries(timeout_s)])
        return str(session.version)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):  # a probe never fails on its own clean-up
            session.client.set_retry_policies([DefaultPolicy(max_retries=0)])
            session.stop()


def _remote_session(url: str, token: str | None) -> Any:
    """A Spark Connect session for this process's work (the process switches to Connect mode,
    as ``SparkSession.builder.remote`` switches it)."""
    from pyspark.sql import SparkSession

    if token is None:
        return SparkSession.builder.remote(url).create()
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    # What pyspark's remote() does before it creates the session: functions and columns are
    # Connect's from now on in this process.
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    return remote_builder(RemoteSession.builder, url, token).create()


def remote_builder(builder: Any, url: str, token: str | None) -> Any:
    """``builder`` (a Spark Connect session builder) aimed at ``url``; with ``token``, every
    request carries it as ``authorization: Bearer <token>``, the header the server's
    pre-shared-token check reads. The channel stays plaintext: pyspark sends a ``token=``
    URL parameter only over TLS (or to ``localhost``), and the server that ``stack up``
    starts speaks no TLS, so beyond one host a TLS-terminating proxy carries it
    (infra/README.md)."""
    if token is None:
        return builder.remote(url)
    from pyspark.sql.connect.client import DefaultChannelBuilder

    class _Bearer(DefaultChannelBuilder):
        def metadata(self) -> Any:
            return [*super().metadata(), ("authorization", f"Bearer {token}")]

    return builder.channelBuilder(_Bearer(url))


def quick_retries(timeout_s: float) -> DefaultPolicy:
    """A retry policy that gives up after roughly ``timeout_s`` (the default retries
    UNAVAILABLE for about 10 minutes)."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    return DefaultPolicy(
        max_retries=max(1, int(timeout_s)), initial_backoff=250, max_backoff=1000, jitter=0
    )


def endpoint(url: str) -> tuple[str, int]:
    """Host and port of an ``sc://host[:port]`` URL (Spark Connect's default port 15002)."""
    rest = url.removeprefix("sc://").split("/", 1)[0].split(";", 1)[0]
    host, _, port = rest.partition(":")
    return host, int(port) if port else 15002


def port_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def cache_on_disk(df: DataFrame) -> DataFrame:
    """Persist ``df`` on local disk only. A replay's caches grow with its window; kept in memory
    they grew the local driver JVM with it (bench/throughput.py: peak RSS 1.6x for a 10x window,
    1.15x on disk, throughput unchanged)."""
    from pyspark import StorageLevel

    return df.persist(StorageLevel.DISK_ONLY)
