"""The production-shaped stack of the ``cluster`` tier, started on this machine from the
package registries (no Docker): Postgres (Dagster's storage and the Iceberg JDBC catalog),
S3Proxy (the warehouse and the archive), a 3-broker SASL/SCRAM-over-TLS Kafka cluster, a Spark
standalone cluster (a master, two workers) and a Spark Connect server submitting to it.

:func:`production_stack` yields the environment that points the project at all of it: the same
``BACKFILL_*``/``AWS_*``/``DAGSTER_POSTGRES_*`` variables production sets (infra/README.md).
Every process is stopped by its PID when the block ends, in reverse order of start.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from backfill_assets.stack import jars
from backfill_assets.stack.connect import LocalConnectServer
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support.kafka_cluster import PASSWORD_CHARS, USER, KafkaCluster
from backfill_assets_tests.support.kafka_cluster import kafka_cluster as start_kafka
from backfill_assets_tests.support.postgres import postgres_server
from backfill_assets_tests.support.s3proxy import s3proxy_server
from backfill_assets_tests.support.services import free_port
from backfill_assets_tests.support.spark_cluster import spark_standalone

# Dagster's production instance file, as production loads it (Postgres storage).
PRODUCTION_DAGSTER_YAML = REPO_ROOT / "infra" / "production" / "dagster.yaml"
PRODUCTION_COMPOSE = REPO_ROOT / "infra" / "production" / "docker-compose.yml"


def production_event_batch_size() -> str:
    """``DAGSTER_EVENT_BATCH_SIZE`` as the production compose file gives every Dagster process
    (Dagster's own opt-in batched event writes)."""
    import yaml

    compose = yaml.safe_load(PRODUCTION_COMPOSE.read_text())
    return str(compose["x-backfill-env"]["DAGSTER_EVENT_BATCH_SIZE"])


@dataclass
class ProductionStack:
    env: dict[str, str]
    kafka: KafkaCluster
    connect: LocalConnectServer
    timings: dict[str, float] = field(default_factory=dict)  # seconds each part took to start
    # the values no log, event or snapshot summary may contain
    secret_values: tuple[str, ...] = ()


def _grant_everything(kafka: KafkaCluster) -> None:
    """The project's client user may do what a backfill service account does: create, grow,
    read and write topics, commit consumer groups and run transactions (the tests' producers
    use the same user). Production would scope these to its topics' prefix."""
    principal = f"User:{USER}"
    bindings = [
        AclBinding(rtype, name, ResourcePatternType.LITERAL, principal, "*", AclOperation.ALL,
                   AclPermissionType.ALLOW)
        for rtype, name in (
            (ResourceType.TOPIC, "*"),
            (ResourceType.GROUP, "*"),
            (ResourceType.TRANSACTIONAL_ID, "*"),
            (ResourceType.BROKER, "kafka-cluster"),
        )
    ]  # fmt: skip
    admin = kafka.admin()  # kept alive until the futures are done
    for future in admin.create_acls(bindings, request_timeout=60).values():
        future.result()
    _wait_acls(kafka, len(bindings))


def _wait_acls(kafka: KafkaCluster, count: int, timeout_s: float = 60) -> None:
    """Until every node's authorizer holds the user's ACLs (they reach each node through the
    metadata log; a lagging node would refuse the first client it serves)."""
    from confluent_kafka.admin import AclBindingFilter  # type: ignore[attr-defined]

    wanted = AclBindingFilter(  # None: any name, any host
        ResourceType.ANY, None, ResourcePatternType.ANY, f"User:{USER}", None,  # type: ignore[arg-type]
        AclOperation.ANY, AclPermissionType.ANY,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    for node in kafka.cluster.nodes:
        admin = AdminClient({**node.admin_config(), "bootstrap.servers": node.bootstrap})
        while len(admin.describe_acls(wanted, request_timeout=10).result()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ACLs did not reach the broker at {node.bootstrap}")
            time.sleep(0.2)


def _spark_env(master: str) -> dict[str, str]:
    """The Connect server's Spark settings on the standalone cluster: two one-core executors
    of 512 MiB, the server (driver) heap 1 GiB; the machine has two cores."""
    return {
        "BACKFILL_SPARK_MASTER": master,
        "BACKFILL_SPARK_DRIVER_MEMORY": "1g",
        "BACKFILL_SPARK_EXECUTOR_MEMORY": "512m",
        "BACKFILL_SPARK_EXECUTOR_CORES": "1",
        # The server's UI on a port of its own: support/connect_server.py asks it what runs.
        "BACKFILL_SPARK_CONF": json.dumps(
            {"spark.cores.max": "2", "spark.ui.port": str(free_port())}
        ),
        "BACKFILL_SPARK_CONNECT_PORT": str(free_port()),
    }


@contextmanager
def production_stack(home: Path, jar_cache: str) -> Iterator[ProductionStack]:
    """Start every component under ``home``; yield the stack; stop all by PID."""
    timings: dict[str, float] = {}
    base = Settings.from_env({"BACKFILL_JAR_CACHE": jar_cache, "BACKFILL_HOME": str(home)})
    jars.resolve_all(base)
    password = PASSWORD_CHARS + secrets.token_hex(4)
    with ExitStack() as stack:
        began = time.monotonic()
        pg = stack.enter_context(postgres_server())
        s3 = stack.enter_context(s3proxy_server(base, ["lake-warehouse", "lake-archive"]))
        timings["postgres+s3proxy"] = time.monotonic() - began
        began = time.monotonic()
        kafka = stack.enter_context(start_kafka(home / "kafka", jar_cache, password))
        _grant_everything(kafka)
        timings["kafka(3)"] = time.monotonic() - began
        began = time.monotonic()
        cluster = stack.enter_context(spark_standalone(home / "spark-cluster"))
        timings["spark master+2 workers"] = time.monotonic() - began
        env = {
            **kafka.env,
            "BACKFILL_HOME": str(home),
            "BACKFILL_JAR_CACHE": jar_cache,
            "PYICEBERG_HOME": str(home / "pyiceberg-home"),
            "BACKFILL_CATALOG_KIND": "sql",
            "BACKFILL_CATALOG_URI": pg.catalog_uri,
            "BACKFILL_CATALOG_JDBC_USER": pg.catalog_user,
            "BACKFILL_CATALOG_JDBC_PASSWORD": pg.catalog_password,
            "BACKFILL_WAREHOUSE": "s3://lake-warehouse/lake",
            "BACKFILL_ARCHIVE_URI": "s3://lake-archive/archive",
            "BACKFILL_S3_ENDPOINT": s3.endpoint,
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_REGION": s3.region,
            "DAGSTER_POSTGRES_HOST": pg.host,
            "DAGSTER_POSTGRES_PORT": str(pg.port),
            "DAGSTER_POSTGRES_DB": pg.dagster_db,
            "DAGSTER_POSTGRES_USER": pg.dagster_user,
            "DAGSTER_POSTGRES_PASSWORD": pg.dagster_password,
            # as infra/production/docker-compose.yml sets it
            "DAGSTER_EVENT_BATCH_SIZE": production_event_batch_size(),
            **_spark_env(cluster.master_url),
        }
        began = time.monotonic()
        connect = LocalConnectServer(Settings.from_env(env))
        connect.start(timeout_s=300)
        stack.callback(connect.stop)
        env["BACKFILL_SPARK_CONNECT"] = connect.url
        timings["spark connect"] = time.monotonic() - began
        yield ProductionStack(
            env,
            kafka,
            connect,
            timings,
            (password, pg.catalog_password, pg.dagster_password, s3.secret_key),
        )
