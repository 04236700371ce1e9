"""The production-shaped storage, run for real: Postgres (Dagster's storage and the Iceberg JDBC
catalog) and S3 (S3Proxy: the warehouse and the archive), both started here from the package
registries (Debian's postgresql-15, Maven Central's org.gaul:s3proxy).

Spark runs in a subprocess (classic local mode, the project's own ``get_session``): the conftest
session's Spark, if another module of the same pytest process started it, is built for the local
SQLite catalog and cannot be given other jars; a subprocess also leaves its driver log under its
own BACKFILL_HOME for the secrets check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from backfill_assets.defs.resources import IcebergResource
from backfill_assets.stack import jars
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support.cluster_stack import production_event_batch_size
from backfill_assets_tests.support.postgres import PgServer, postgres_server
from backfill_assets_tests.support.s3proxy import S3Server, s3proxy_server

pytestmark = pytest.mark.cluster

TABLE = "pgs3_probe"
RUN_ID = "run-pgs3"
PROD_DAGSTER_YAML = REPO_ROOT / "infra" / "production" / "dagster.yaml"


@dataclass(frozen=True)
class Tier:
    pg: PgServer
    s3: S3Server
    env: dict[str, str]  # the tier's settings, also in os.environ while the module runs

    @property
    def settings(self) -> Settings:
        return Settings.from_env(self.env)

    @property
    def secrets(self) -> dict[str, str]:
        return {
            "BACKFILL_CATALOG_JDBC_PASSWORD": self.pg.catalog_password,
            "DAGSTER_POSTGRES_PASSWORD": self.pg.dagster_password,
            "AWS_SECRET_ACCESS_KEY": self.s3.secret_key,
        }


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    home = tmp_path_factory.mktemp("pgs3")
    jar_cache = os.environ.get("BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars"))
    base = Settings.from_env({"BACKFILL_JAR_CACHE": jar_cache, "BACKFILL_HOME": str(home)})
    jars.resolve_all(base)  # a no-op when scripts/bootstrap.sh resolved them
    with (
        postgres_server() as pg,
        s3proxy_server(base, ["lake-warehouse", "lake-archive"]) as s3,
        pytest.MonkeyPatch.context() as mp,
    ):
        env = {
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
            "BACKFILL_DAGSTER_STORAGE": str(home / "dagster"),
            "BACKFILL_SENSORS": "off",
        }
        for key, value in env.items():
            mp.setenv(key, value)
        yield Tier(pg, s3, env)


# Run in a fresh interpreter with the tier's environment: the project's Spark session (classic,
# local[2]) on the JDBC catalog in Postgres with an S3FileIO warehouse; a write through the
# project's write-audit-publish (a run branch, then a fast-forward of main); and a read of an
# archive file on s3:// through Hadoop's s3a.
_SPARK_SCRIPT = """
import json, sys
from backfill_assets.lake.write import wap
from backfill_assets.stack import spark as sp
from backfill_assets.stack.settings import Settings

s = Settings.from_env()
spark = sp.get_session(s)
ns = f"{s.catalog.name}.{s.catalog.namespace}"
table = f"{ns}.{sys.argv[1]}"
spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ns}")
spark.sql(f"CREATE TABLE {table} (id bigint, s string) USING iceberg")
branch = wap.open_branch(spark, table, sys.argv[2])
spark.sql(f"INSERT INTO {branch.ident} VALUES (1, 'a'), (2, 'b')")
ref_during = wap.ref_snapshot_id(spark, table, branch.name)
main_before = branch.main_before
published = wap.publish(spark, branch, {"run_id": sys.argv[2]})
files = [r[0] for r in spark.sql(f"SELECT file_path FROM {table}.files").collect()]
archived = spark.read.parquet(sys.argv[3]).count()
print("RESULT " + json.dumps({"branch": branch.name, "ref_during": ref_during,
      "main_before": main_before, "published": published, "files": files,
      "archived": archived}))
spark.stop()
"""


@pytest.fixture(scope="module")
def spark_run(tier: Tier) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from backfill_assets.lake.offsets.archive import Archive

    archive = Archive(tier.settings)
    path = f"{archive.root}/probe/part-0.parquet"
    archive.fs.create_dir(f"{archive.root}/probe", recursive=True)
    with archive.fs.open_output_stream(path) as out:
        pq.write_table(pa.table({"offset": [0, 1, 2]}), out)
    proc = subprocess.run(
        [sys.executable, "-c", _SPARK_SCRIPT, TABLE, RUN_ID, archive.spark_uri(path)],
        env={**os.environ, **tier.env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    result["output"] = proc.stdout + proc.stderr
    return result


def test_spark_jdbc_catalog_on_postgres_and_s3_shared_with_pyiceberg(
    tier: Tier, spark_run: dict[str, Any]
) -> None:
    """Spark created, branched and fast-forwarded the table in the Postgres JDBC catalog with
    its files on S3; pyiceberg's SqlCatalog (psycopg2) with S3 IO reads the same rows and refs."""
    import psycopg2  # type: ignore[import-untyped]

    from backfill_assets.stack import catalog

    assert spark_run["files"] and all(
        f.startswith("s3://lake-warehouse/lake/") for f in spark_run["files"]
    )
    assert spark_run["ref_during"] != spark_run["main_before"]
    assert spark_run["archived"] == 3  # the s3:// archive file, read through s3a
    cat = catalog.load(tier.settings.catalog)
    table = cat.load_table(f"{tier.settings.catalog.namespace}.{TABLE}")
    assert sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "s": "a"},
        {"id": 2, "s": "b"},
    ]
    refs = table.metadata.refs
    assert refs["main"].snapshot_id == spark_run["published"]
    assert spark_run["branch"] not in refs  # dropped after the publish
    current = table.current_snapshot()
    assert current is not None and current.summary is not None
    summary = current.summary
    assert summary["backfill.run_id"] == RUN_ID and summary["backfill.published"] == "true"
    # The catalog really is the Postgres database, as the iceberg role sees it.
    con = psycopg2.connect(
        host=tier.pg.host,
        port=tier.pg.port,
        dbname=tier.pg.catalog_db,
        user=tier.pg.catalog_user,
        password=tier.pg.catalog_password,
    )
    try:
        with con.cursor() as cur:
            cur.execute("SELECT table_name, metadata_location FROM iceberg_tables")
            rows = cur.fetchall()
    finally:
        con.close()
    assert [(name, loc.startswith("s3://lake-warehouse/")) for name, loc in rows] == [(TABLE, True)]


@dg.asset
def pgs3_rows(iceberg: IcebergResource) -> dg.MaterializeResult:  # type: ignore[type-arg]
    """Reads the table Spark wrote, through the project's resource (Postgres catalog, S3 IO)."""
    rows = iceberg.catalog().load_table(iceberg.identifier(TABLE)).scan().to_arrow()
    return dg.MaterializeResult(metadata={"rows": rows.num_rows})


@pytest.fixture(scope="module")
def dagster_run(tier: Tier, spark_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A run of a small asset recorded by a Dagster instance on Postgres, configured by
    infra/production/dagster.yaml (the file production uses); the asset reads the table through
    the project's IcebergResource with its secrets as EnvVars."""
    import shutil

    from backfill_assets.defs.definitions import build_resources

    home = tmp_path_factory.mktemp("dagster-home")
    shutil.copy(PROD_DAGSTER_YAML, home / "dagster.yaml")

    resources = {"iceberg": build_resources(os.environ)["iceberg"]}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        result = dg.materialize([pgs3_rows], instance=instance, resources=resources)
        assert result.success
        yield instance, result.run_id


def test_dagster_instance_on_postgres_records_the_run(tier: Tier, dagster_run: Any) -> None:
    import psycopg2

    instance, run_id = dagster_run
    from dagster_postgres import (
        PostgresEventLogStorage,
        PostgresRunStorage,
        PostgresScheduleStorage,
    )

    assert isinstance(instance.run_storage, PostgresRunStorage)
    assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
    assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
    assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.SUCCESS
    mat = instance.get_latest_materialization_event(dg.AssetKey("pgs3_rows"))
    assert mat is not None and mat.asset_materialization.metadata["rows"].value == 2
    con = psycopg2.connect(
        host=tier.pg.host,
        port=tier.pg.port,
        dbname=tier.pg.dagster_db,
        user=tier.pg.dagster_user,
        password=tier.pg.dagster_password,
    )
    try:
        with con.cursor() as cur:
            cur.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,))
            assert cur.fetchall() == [("SUCCESS",)]
    finally:
        con.close()


HOURS = dg.HourlyPartitionsDefinition(start_date="2026-06-01-00:00")


@dg.asset(partitions_def=HOURS, backfill_policy=dg.BackfillPolicy.single_run())
def pgs3_hours(context) -> dg.MaterializeResult[None]:  # type: ignore[no-untyped-def]
    """A no-op ranged asset: each hour's own metadata, as the raw asset adds its figures."""
    for key in context.partition_keys:
        context.add_asset_metadata({"hour": key}, partition_key=key)
    return dg.MaterializeResult(metadata={"hours": len(context.partition_keys)})


def test_batched_event_writes_record_every_partition_in_fewer_connections(
    tier: Tier, dagster_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With production's DAGSTER_EVENT_BATCH_SIZE, a 24-hour ranged run on the Postgres
    instance records all 24 materializations, each with its own hour's metadata, and opens far
    fewer Postgres connections than the same run unbatched (Dagster's storage holds no pool:
    one connection per event unbatched, bench/partition_events.py)."""
    import psycopg2

    instance, _ = dagster_run
    connects: list[int] = []
    connect = psycopg2.connect

    def counted(*args: Any, **kwargs: Any) -> Any:
        connects.append(1)
        return connect(*args, **kwargs)

    monkeypatch.setattr(psycopg2, "connect", counted)
    keys = HOURS.get_partition_keys()[:24]
    tags = {
        "dagster/asset_partition_range_start": keys[0],
        "dagster/asset_partition_range_end": keys[-1],
    }
    opened: dict[str, int] = {}
    for batch in ("0", production_event_batch_size()):
        monkeypatch.setenv("DAGSTER_EVENT_BATCH_SIZE", batch)
        before = len(connects)
        result = dg.materialize([pgs3_hours], instance=instance, tags=tags)
        opened[batch] = len(connects) - before
        assert result.success
        events = instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
        recorded = {
            e.asset_materialization.partition: e.asset_materialization.metadata["hour"].value
            for e in events
            if e.asset_materialization is not None
        }
        assert recorded == {key: key for key in keys}, f"DAGSTER_EVENT_BATCH_SIZE={batch}"
    assert opened[production_event_batch_size()] < opened["0"] - len(keys), opened


def test_no_secret_in_driver_log_event_log_or_snapshot_summaries(
    tier: Tier, spark_run: dict[str, Any], dagster_run: Any
) -> None:
    from dagster._serdes import serialize_value

    from backfill_assets.stack import catalog

    logs = sorted((Path(tier.env["BACKFILL_HOME"]) / "logs").glob("*"))
    assert logs, "the local driver writes its log under BACKFILL_HOME/logs"
    places = {str(p): p.read_text(errors="replace") for p in logs}
    places["spark subprocess output"] = spark_run["output"]
    instance, run_id = dagster_run
    places["dagster event log"] = "\n".join(
        serialize_value(rec) for rec in instance.all_logs(run_id)
    )
    table = catalog.load(tier.settings.catalog).load_table(
        f"{tier.settings.catalog.namespace}.{TABLE}"
    )
    places["snapshot summaries"] = "\n".join(s.model_dump_json() for s in table.snapshots())
    places["table properties"] = json.dumps(dict(table.properties))
    assert "backfill.run_id" in places["snapshot summaries"]  # the check looks at real data
    for where, text in places.items():
        for name, value in tier.secrets.items():
            assert value not in text, f"{name} appears in {where}"


@pytest.mark.parametrize("variable", ["BACKFILL_CATALOG_JDBC_PASSWORD", "AWS_SECRET_ACCESS_KEY"])
def test_wrong_credentials_give_one_error_line_naming_the_setting(
    tier: Tier, spark_run: dict[str, Any], variable: str
) -> None:
    wrong = "wrong-" + variable.lower()
    proc = subprocess.run(
        [sys.executable, "-m", "backfill_assets.ops.cli", "catalog", "init"],
        env={**os.environ, **tier.env, variable: wrong},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and variable in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for value in [wrong, *tier.secrets.values()]:
        assert value not in proc.stdout + proc.stderr
    # With the right credentials the same command works.
    ok = subprocess.run(
        [sys.executable, "-m", "backfill_assets.ops.cli", "catalog", "init"],
        env={**os.environ, **tier.env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert TABLE in ok.stdout


def test_jdbc_password_with_url_reserved_characters(tier: Tier, spark_run: dict[str, Any]) -> None:
    """pyiceberg gets the password inside its SQLAlchemy URI (percent-encoded there); one with
    URL-reserved characters still logs in. (Spark takes it as the jdbc.password property.)"""
    import dataclasses

    import psycopg2

    from backfill_assets.stack import catalog

    odd = "p@ss:w/rd?#%& 'x\""

    def set_password(password: str) -> None:
        con = psycopg2.connect(
            host=tier.pg.host,
            port=tier.pg.port,
            dbname=tier.pg.catalog_db,
            user=tier.pg.catalog_user,
            password=tier.pg.catalog_password if password == odd else odd,
        )
        con.autocommit = True
        try:
            with con.cursor() as cur:
                cur.execute("ALTER ROLE CURRENT_USER PASSWORD %s", (password,))
        finally:
            con.close()

    set_password(odd)
    try:
        cfg = dataclasses.replace(tier.settings.catalog, jdbc_password=odd)
        tables = catalog.load(cfg).list_tables(cfg.namespace)
        assert (cfg.namespace, TABLE) in tables
    finally:
        set_password(tier.pg.catalog_password)
