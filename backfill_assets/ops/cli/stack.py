"""``jars``, ``kafka``, ``catalog``, ``stack``: the local stack; ``generate``: its demo data."""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import click

from backfill_assets.errors import CdsError
from backfill_assets.ops.cli.common import Exit, parse_hour, topic_option, with_ui
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack import catalog, jars
from backfill_assets.stack.broker import LocalBroker
from backfill_assets.stack.connect import LocalConnectServer
from backfill_assets.stack.registry import LocalRegistry, RegistryStatus, external_status
from backfill_assets.stack.settings import Settings


@click.command("jars")
@click.argument("action", type=click.Choice(["resolve", "cds"]))
@with_ui
def jars_command(ui: Ui, settings: Settings, action: str) -> int:
    """Resolve JVM artifacts from Maven Central (idempotent); ``cds`` builds the Spark driver's
    class-data-sharing archive from them (idempotent; exits 4 if it cannot, and Spark then
    starts without it)."""
    if action == "cds":
        from backfill_assets.stack import cds

        began = time.monotonic()
        try:
            with ui.spinner("building the Spark CDS archive (a small Spark workload, once)"):
                path, built = cds.build(settings)
        except CdsError as err:
            ui.note(f"error: {err}")
            return Exit.FAILED
        state = f"built in {time.monotonic() - began:.0f}s" if built else "already built"
        ui.line(f"Spark driver CDS archive: {state} ({path})")
        ui.emit({"path": str(path), "built": built})
        return 0
    with ui.spinner("resolving jars"):
        resolved = _resolve_jars(settings)
    for jar_set, info in resolved.items():
        state = "resolved" if info["resolved"] else "already up to date"
        ui.line(f"{jar_set}: {state} ({info['dir']})")
    ui.emit(resolved)
    return 0


def _resolve_jars(settings: Settings) -> dict[str, dict[str, Any]]:
    resolved = {
        jar_set: {"resolved": ran, "dir": str(jars.jar_dir(settings, jar_set))}
        for jar_set, ran in jars.resolve_all(settings).items()
    }
    built = not jars.udf_jar_path(settings).is_file()
    resolved["udf"] = {"resolved": built, "dir": str(jars.udf_jar(settings).parent)}
    built = jars.build_registry(settings)
    resolved["schema-registry"] = {"resolved": built, "dir": str(jars.registry_dir(settings))}
    return resolved


@click.command("kafka", short_help="Manage the embedded local Kafka broker (KRaft).")
@click.argument("action", type=click.Choice(["start", "stop", "status"]))
@with_ui
def kafka_command(ui: Ui, settings: Settings, action: str) -> int:
    """Manage the embedded local Kafka broker (KRaft). ``status`` exits 1 when the broker does
    not answer."""
    broker = LocalBroker(settings)
    if action == "stop":
        stopped = broker.stop()
        ui.line("broker stopped" if stopped else "broker was not running")
        ui.emit({"stopped": stopped})
        return 0
    if action == "start":
        with ui.spinner("starting the broker"):
            status = broker.start()
    else:
        status = broker.status()
    ui.line(status.describe())
    ui.emit(asdict(status))
    return Exit.OK if action == "start" or status.responding else Exit.NOT_OK


@click.command("catalog")
@click.argument("action", type=click.Choice(["init"]))
@with_ui
def catalog_command(ui: Ui, settings: Settings, action: str) -> int:
    """Create/show the Iceberg catalog and namespace (and check S3 access when the warehouse
    or the archive is on S3)."""
    cat = catalog.load(settings.catalog)
    catalog.check_s3_access(settings)
    namespace = settings.catalog.namespace
    cat.create_namespace_if_not_exists(namespace)
    tables = [".".join(t) for t in cat.list_tables(namespace)]
    ui.line(f"catalog {settings.catalog.name!r} ({settings.catalog.kind}) namespace {namespace!r}")
    ui.line(f"warehouse {settings.catalog.warehouse}")
    ui.line("tables: " + (", ".join(tables) if tables else "(none yet)"))
    ui.emit(
        {
            "catalog": settings.catalog.name,
            "kind": settings.catalog.kind,
            "namespace": namespace,
            "warehouse": settings.catalog.warehouse,
            "tables": tables,
        }
    )
    return 0


@click.command("stack")
@click.argument("action", type=click.Choice(["up", "down", "status"]))
@click.option(
    "--cdc",
    is_flag=True,
    help="up: also start the CDC source (Postgres with logical decoding on "
    "BACKFILL_CDC_POSTGRES_PORT, a Kafka Connect worker with Debezium's Postgres connector on "
    "BACKFILL_KAFKA_CONNECT_PORT) and capture its demo table public.accounts into the topic "
    "cdc_demo.public.accounts",
)
@with_ui
def stack_command(ui: Ui, settings: Settings, action: str, cdc: bool) -> int:
    """The whole local stack: jars, catalog, broker, the schema registry (unless
    BACKFILL_SCHEMA_REGISTRY_URL names one; port BACKFILL_SCHEMA_REGISTRY_PORT), and the Spark
    Connect server that runs reach when BACKFILL_SPARK_CONNECT names it (port
    BACKFILL_SPARK_CONNECT_PORT); with ``--cdc``, the CDC source too (``down`` stops it
    whenever it runs). ``status`` exits 1 when a component ``up`` would start (with ``--cdc``:
    the CDC source too) is down or not answering, or the registry that
    BACKFILL_SCHEMA_REGISTRY_URL names does not answer."""
    broker = LocalBroker(settings)
    server = LocalConnectServer(settings)
    if action == "down":
        cdc_doc = _cdc(ui, settings, action, wanted=cdc)
        registry_stopped = LocalRegistry(settings).stop()
        ui.line(
            "schema registry stopped" if registry_stopped else "schema registry was not running"
        )
        spark_stopped = server.stop()
        ui.line("spark connect stopped" if spark_stopped else "spark connect was not running")
        stopped = broker.stop()
        ui.line("broker stopped" if stopped else "broker was not running")
        ui.emit(
            {
                "stopped": stopped,
                "spark_connect_stopped": spark_stopped,
                "schema_registry_stopped": registry_stopped,
                **(cdc_doc or {}),
            }
        )
        return 0
    doc: dict[str, Any] = {}
    if action == "up":
        with ui.spinner("resolving jars"):
            doc["jars"] = _resolve_jars(settings)
        for jar_set, info in doc["jars"].items():
            state = "resolved" if info["resolved"] else "already up to date"
            ui.line(f"{jar_set}: {state} ({info['dir']})")
        catalog.init_local_catalog(settings.catalog)
        with ui.spinner("starting the broker"):
            status = broker.start()
        ui.line(status.describe())
        with ui.spinner("starting the schema registry"):
            registry_status = _registry(settings, start=True)
        with ui.spinner("starting the Spark Connect server"):
            spark_status = server.start()
    else:
        status = broker.status()
        ui.line(status.describe())
        registry_status = _registry(settings, start=False)
        spark_status = server.status()
    ui.line(registry_status.describe())
    ui.line(spark_status.describe())
    doc["broker"] = asdict(status)
    doc["schema_registry"] = asdict(registry_status)
    doc["spark_connect"] = asdict(spark_status)
    cdc_doc = _cdc(ui, settings, action, wanted=cdc)
    if cdc_doc is not None:
        doc["cdc"] = cdc_doc
    if action == "up":
        ui.emit(doc)
        return 0
    doc["down"] = down = components_down(doc, cdc=cdc)
    ui.emit(doc)
    if down:
        up = "stack up --cdc" if cdc else "stack up"
        ui.note(f"down: {', '.join(down)} (start it: `backfill-assets {up}`)")
        return Exit.NOT_OK
    return Exit.OK


def components_down(doc: dict[str, Any], *, cdc: bool) -> list[str]:
    """The components of a ``stack status`` document that are expected and not answering.
    Expected: what ``stack up`` starts with these settings, i.e. the broker, the Spark Connect
    server and the local schema registry, or instead the registry BACKFILL_SCHEMA_REGISTRY_URL
    names (which must answer); with ``--cdc`` also the CDC source's Postgres and its Kafka
    Connect worker. A CDC source that runs unasked is reported, never expected."""
    down = []
    if not doc["broker"]["responding"]:
        down.append("broker")
    if not doc["schema_registry"]["ready"]:
        down.append("schema registry")
    if not doc["spark_connect"]["responding"]:
        down.append("spark connect")
    if cdc:
        if doc["cdc"]["postgres"]["pid"] is None:
            down.append("cdc postgres")
        if not doc["cdc"]["kafka_connect"]["ready"]:
            down.append("kafka connect")
    return down


def _cdc(ui: Ui, settings: Settings, action: str, *, wanted: bool) -> dict[str, Any] | None:
    """The CDC source's part of ``stack``: ``up --cdc`` starts it with its demo table and
    connector; ``down`` stops whatever of it runs; ``status`` reports it when it runs or is
    asked for. None: nothing to report."""
    from backfill_assets.demo import cdc as demo
    from backfill_assets.stack.cdc import CdcSource

    source = CdcSource(settings)
    if action == "down":
        worker_stopped, postgres_stopped = source.stop()
        if worker_stopped or postgres_stopped or wanted:
            ui.line("kafka connect " + ("stopped" if worker_stopped else "was not running"))
            ui.line("cdc postgres " + ("stopped" if postgres_stopped else "was not running"))
        return {"kafka_connect_stopped": worker_stopped, "cdc_postgres_stopped": postgres_stopped}
    topic = None
    if action == "up" and wanted:
        with ui.spinner("starting the CDC source (Postgres, Kafka Connect, Debezium)"):
            _, topic = demo.start(source)
    postgres_pid = source.postgres.running_pid()
    worker = source.worker.status()
    if not wanted and postgres_pid is None and not worker.running:
        return None
    where = f"127.0.0.1:{source.postgres.port}"
    pid = f" pid={postgres_pid}" if postgres_pid is not None else ""
    ui.line(f"cdc postgres {'running' if postgres_pid else 'stopped'} {where}{pid}")
    ui.line(worker.describe())
    if topic:
        ui.line(f"cdc demo: table {demo.TABLE} of database {demo.DATABASE} -> topic {topic}")
    return {
        "postgres": {"pid": postgres_pid, "address": where, "data": str(source.postgres.root)},
        "kafka_connect": asdict(worker),
        "topic": topic,
    }


def _registry(settings: Settings, *, start: bool) -> RegistryStatus:
    """The local schema registry's status (started first when ``start``), or that of the
    registry BACKFILL_SCHEMA_REGISTRY_URL names, which the stack never starts or stops."""
    if settings.schema_registry_url_setting:
        return external_status(settings)
    registry = LocalRegistry(settings)
    return registry.start() if start else registry.status()


@click.command("generate")
@topic_option
@click.option("--partitions", type=int, default=6, show_default=True)
@click.option(
    "--hours", type=int, default=48, show_default=True, help="hours of back-dated history"
)
@click.option("--events-per-hour", type=int, default=600, show_default=True)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--start",
    help="first hour (ISO-8601, UTC); default: the --hours hours that ended an hour before the "
    "current one",
)
@click.option(
    "--format",
    "encoding",
    type=click.Choice(["json", "avro"]),
    default="json",
    show_default=True,
    help="avro: the same orders in Confluent's wire format, schemas registered under "
    "<topic>-value in the schema registry (start it with `stack up`)",
)
@with_ui
def generate_command(
    ui: Ui,
    settings: Settings,
    topic: str,
    partitions: int,
    hours: int,
    events_per_hour: int,
    seed: int,
    start: str | None,
    encoding: Literal["json", "avro"],
) -> int:
    """Write deterministic demo history into Kafka."""
    from backfill_assets.demo.generator import GeneratorConfig, generate

    if start:
        first = parse_hour(start, "--start")
    else:
        # The history ends an hour before the current hour: its last hour is then sealed at
        # once (an hour that ended less than BACKFILL_SEAL_GRACE_S ago, with no record after it,
        # is not), so a demo started at 10:02 can backfill all of it.
        now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        first = now - timedelta(hours=hours + 1)
    config = GeneratorConfig(
        topic=topic,
        partitions=partitions,
        start=first,
        hours=hours,
        events_per_hour=events_per_hour,
        seed=seed,
        encoding=encoding,
    )
    manifest = settings.home / "demo" / f"{topic}.ground-truth.json"
    with ui.progress(f"writing {topic}", None, "records") as update:
        truth = generate(settings, config, manifest_path=manifest, on_progress=update)
    totals = truth.totals
    ui.line(
        f"wrote {totals['records']} {encoding} records to {topic!r} "
        f"({config.partitions} partitions, {config.hours} h from {first.isoformat()}): "
        + ", ".join(f"{k}={v}" for k, v in totals.items() if k != "records")
    )
    ui.line(f"ground truth: {manifest}")
    ui.emit(
        {
            "topic": topic,
            "partitions": config.partitions,
            "start": first.isoformat(),
            "hours": config.hours,
            "format": encoding,
            "totals": totals,
            "ground_truth": str(manifest),
        }
    )
    return 0
