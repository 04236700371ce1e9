"""The project against a real Iceberg REST catalog that requires a token.

The server (``support/iceberg_rest.py``) is Iceberg's own REST catalog code (iceberg-core's test
fixtures: ``RESTCatalogAdapter``/``RESTCatalogServlet``) over a JDBC catalog, with a small token
filter of ours in front, because Iceberg's fixture checks no ``Authorization`` header and its
token endpoint accepts any client secret: the filter issues the token at ``/v1/oauth/tokens``
for the right client id and secret only, and refuses every other request without it.

The credential reaches both engines through ``BACKFILL_CATALOG_PROPERTIES`` only: a raw asset's
run (Dagster, the project's resources and ``get_session``, classic local mode, in a subprocess as
in ``test_pg_s3.py``) creates, writes and publishes its tables through the catalog; pyiceberg (the
project's ``CatalogClient``) reads the published rows back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backfill_assets.errors import SettingsError
from backfill_assets.stack import catalog, jars
from backfill_assets.stack.settings import REPO_ROOT, Settings, listing
from backfill_assets_tests.support.iceberg_rest import IcebergRest

pytestmark = pytest.mark.cluster

TABLE = "rest_probe"


@pytest.fixture(scope="module")
def rest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IcebergRest]:
    root = tmp_path_factory.mktemp("iceberg-rest")
    jar_cache = os.environ.get("BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars"))
    base = Settings.from_env({"BACKFILL_JAR_CACHE": jar_cache, "BACKFILL_HOME": str(root)})
    jars.resolve(base, "iceberg-rest")  # a no-op when scripts/bootstrap.sh resolved it
    server = IcebergRest(base, root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _child_env(env: dict[str, str]) -> dict[str, str]:
    """A subprocess's environment: this one's without any other catalog or Spark Connect
    setting a session-wide fixture may have exported, plus ``env``."""
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BACKFILL_CATALOG_", "AWS_", "BACKFILL_SPARK_CONNECT"))
    }
    return {**inherited, **env}


def _env(rest: IcebergRest, properties: dict[str, str] | None) -> dict[str, str]:
    env = {
        "BACKFILL_HOME": str(rest.root / "home"),
        "BACKFILL_JAR_CACHE": str(rest.settings.jar_cache),
        "PYICEBERG_HOME": str(rest.root / "pyiceberg-home"),
        "BACKFILL_CATALOG_KIND": "rest",
        "BACKFILL_CATALOG_URI": rest.url,
        "BACKFILL_WAREHOUSE": rest.warehouse,
        "BACKFILL_NAMESPACE": "restns",
    }
    if properties is not None:
        env["BACKFILL_CATALOG_PROPERTIES"] = json.dumps(properties)
    return env


def test_a_bearer_token_alone_also_works_for_pyiceberg(rest: IcebergRest) -> None:
    """``token`` (a bearer token, no OAuth2 exchange) in the properties: pyiceberg lists and
    creates through the catalog."""
    client = catalog.CatalogClient(Settings.from_env(_env(rest, {"token": rest.token})))
    cat = client.catalog()
    cat.create_namespace_if_not_exists("tokenns")
    assert ("tokenns",) in cat.list_namespaces()


@pytest.mark.parametrize(
    "properties", [None, {"credential": "backfill-x:wrong-secret-value", "oauth2-server-uri": ""}]
)
def test_missing_or_wrong_credential_is_one_line_naming_the_setting(
    rest: IcebergRest, properties: dict[str, str] | None
) -> None:
    """No credential, or a wrong secret: one line naming BACKFILL_CATALOG_PROPERTIES and the
    catalog's URL, without the secret given."""
    if properties is not None:
        properties["oauth2-server-uri"] = f"{rest.url}/v1/oauth/tokens"
    settings = Settings.from_env(_env(rest, properties))
    with pytest.raises(SettingsError) as caught:
        catalog.load(settings.catalog)
    message = str(caught.value)
    assert message.startswith("BACKFILL_CATALOG_PROPERTIES: the REST catalog " + rest.url)
    assert "\n" not in message
    assert "wrong-secret-value" not in message and rest.token not in message


# Spark's own REST client (Iceberg's Java one) meeting a wrong credential, in a fresh
# interpreter (the session's Spark, if another module started it, is built for SQLite).
_SPARK_REFUSED = """
import json
from backfill_assets.stack import catalog, spark
from backfill_assets.stack.settings import Settings
s = Settings.from_env()
session = spark.get_session(s)
try:
    session.sql(f"SHOW NAMESPACES IN {s.catalog.name}").collect()
    found = {"raised": None, "message": None}
except Exception as exc:
    refused = catalog.refusal(s.catalog, exc)
    found = {"raised": str(exc), "message": None if refused is None else str(refused)}
print("RESULT", json.dumps(found))
"""


def test_a_refusal_met_in_sparks_jvm_is_one_line_naming_the_setting(
    rest: IcebergRest, stack_env: dict[str, str]
) -> None:
    """Spark's catalog (Iceberg's Java REST client) refused with a wrong client secret raises
    a Java traceback; :func:`catalog.refusal` (what a run's failure and the CLI report) turns
    it into the one line pyiceberg's refusal gets, without the secret."""
    oauth = {"oauth2-server-uri": f"{rest.url}/v1/oauth/tokens", "scope": "catalog"}
    wrong = {"credential": "backfill-x:wrong-secret-value", **oauth}
    env = {**_env(rest, wrong), "BACKFILL_HOME": str(rest.root / "jvm-home")}
    proc = subprocess.run(
        [sys.executable, "-c", _SPARK_REFUSED],
        env={**_child_env(stack_env), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
    found = json.loads(lines[0].removeprefix("RESULT "))
    assert found["raised"] is not None and "NotAuthorizedException" in found["raised"]
    message = found["message"]
    assert message is not None, found["raised"][:2000]
    assert message.startswith("BACKFILL_CATALOG_PROPERTIES: the REST catalog " + rest.url)
    assert "NotAuthorizedException" in message and "\n" not in message
    assert "wrong-secret-value" not in message and "credentials given: credential" in message


def test_settings_listing_masks_the_catalog_credentials(rest: IcebergRest) -> None:
    """``backfill-assets settings`` (the listing it prints) shows the property names, never the
    credential or token values."""
    env = _env(rest, {"credential": rest.credential, "token": rest.token, "scope": "catalog"})
    shown = {s.variable: s.value for s in listing(env)}["BACKFILL_CATALOG_PROPERTIES"]
    assert shown is not None and '"credential"' in shown and '"scope": "catalog"' in shown
    assert rest.client_secret not in shown and rest.token not in shown


# One raw-asset run through the project's own path (Dagster, the project's resources and
# assets) with the REST catalog, in a fresh interpreter: the session's Spark, if another module
# started it, is built for the local SQLite catalog.
_RUN_SCRIPT = """
import json, os, sys
from pathlib import Path
from datetime import timedelta
import dagster as dg
from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.spec.declared import renamed
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support import small_topic
from backfill_assets_tests.support.runs import materialize_range

s = Settings.from_env()
catalog.load(s.catalog).create_namespace_if_not_exists(s.catalog.namespace)
spec = renamed(SPECS[0], topic=sys.argv[1], partition_start=small_topic.START)
with dg.instance_for_test() as instance:
    result = materialize_range(
        [build_raw_asset(spec)], instance, small_topic.START,
        small_topic.START + timedelta(hours=1), raise_on_error=False,
    )
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
# Whether the client secret is on any process's command line (the Spark driver JVM, still up,
# is this interpreter's child).
secret = os.environ.pop("PROBE_SECRET").encode()
leaked = []
for proc in Path("/proc").glob("[0-9]*"):
    try:
        line = (proc / "cmdline").read_bytes()
    except OSError:
        continue
    if secret in line:
        leaked.append(line.replace(secret, b"***")[:300].decode(errors="replace"))
print("RESULT", json.dumps({"success": result.success, "checks": checks, "leaked": leaked}))
"""


def test_a_raw_asset_run_publishes_through_the_token_rest_catalog(
    rest: IcebergRest, stack_env: dict[str, str], stack_settings: Settings
) -> None:
    """The raw asset of a small orders topic (the session's broker), materialized by Dagster
    with the project's resources and Spark session, gets its token with the credential in
    BACKFILL_CATALOG_PROPERTIES, writes and publishes through the REST catalog with every check
    passing; pyiceberg (the project's CatalogClient) reads every valid offset of the hour from
    main, the cut record not. Neither the client secret nor the token is on any process's
    command line (the Spark driver's included), nor on the server's."""
    from backfill_assets.defs.definitions import SPECS
    from backfill_assets.spec.declared import renamed
    from backfill_assets_tests.support import small_topic

    topic = f"orders_{uuid.uuid4().hex[:8]}"
    small_topic.produce(stack_settings, topic)
    oauth = {"oauth2-server-uri": f"{rest.url}/v1/oauth/tokens", "scope": "catalog"}
    env = {
        **_env(rest, {"credential": rest.credential, **oauth}),
        "BACKFILL_HOME": str(rest.root / "run-home"),
        "BACKFILL_NAMESPACE": "runs",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_SCRIPT, topic],
        env={**_child_env(stack_env), **env, "PROBE_SECRET": rest.client_secret},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines == [lines[0]], proc.stderr[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["success"] and result["checks"] and all(result["checks"].values()), result
    assert result["leaked"] == []
    spec = renamed(SPECS[0], topic=topic, partition_start=small_topic.START)
    client = catalog.CatalogClient(Settings.from_env(env))
    rows = client.catalog().load_table(client.identifier(spec.raw_table)).scan().to_arrow()
    offsets = set(rows.column("kafka_offset").to_pylist())
    assert set(range(small_topic.EVENTS)) <= offsets and small_topic.EVENTS not in offsets
    pid = rest.running_pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert rest.token.encode() not in cmdline and rest.client_secret.encode() not in cmdline
