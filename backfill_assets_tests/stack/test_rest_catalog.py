"""The project against a real Iceberg REST catalog that requires a token.

The server (``support/iceberg_rest.py``) is Iceberg's own REST catalog code (iceberg-core's test
fixtures: ``RESTCatalogAdapter``/``RESTCatalogServlet``) over a JDBC catalog, with a small token
filter of ours in front, because Iceberg's fixture checks no ``Authorization`` header and its
token endpoint accepts any client secret: the filter issues the token at ``/v1/oauth/tokens``
for the right client id and secret only, and refuses every other request without it.

The credential reaches both engines through ``BACKFILL_CATALOG_PROPERTIES`` only: Spark (the
project's ``get_session``, classic local mode, in a subprocess as in ``test_pg_s3.py``) creates
the table and writes it through the project's write-audit-publish; pyiceberg (the project's
``CatalogClient``) reads the published rows back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# In a fresh interpreter with the REST settings: the project's Spark session, a table created
# and written on a run branch, then published (lake/write/wap.py); and whether the credential
# shows in the command line of any process (the Spark JVM is this interpreter's child).
_SPARK_SCRIPT = """
import json, os, sys
from pathlib import Path
from backfill_assets.lake.write import wap
from backfill_assets.stack import spark as sp
from backfill_assets.stack.settings import Settings

s = Settings.from_env()
spark = sp.get_session(s)
ns = f"{s.catalog.name}.{s.catalog.namespace}"
table = f"{ns}.{sys.argv[1]}"
spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ns}")
spark.sql(f"CREATE TABLE {table} (id bigint, s string) USING iceberg")
branch = wap.open_branch(spark, table, "run-rest")
spark.sql(f"INSERT INTO {branch.ident} VALUES (1, 'a'), (2, 'b')")
published = wap.publish(spark, branch, {"run_id": "run-rest"})
secret = os.environ.pop("PROBE_SECRET").encode()
leaked = []
for proc in Path("/proc").glob("[0-9]*"):
    try:
        line = (proc / "cmdline").read_bytes()
    except OSError:
        continue
    if secret in line:
        leaked.append(line.replace(secret, b"***")[:300].decode(errors="replace"))
print("RESULT " + json.dumps({"published": published, "leaked": leaked}))
spark.stop()
"""


def test_spark_writes_and_pyiceberg_reads_through_the_token_rest_catalog(
    rest: IcebergRest,
) -> None:
    """With ``credential`` (OAuth2 client_credentials) in BACKFILL_CATALOG_PROPERTIES, Spark
    gets the token from the catalog's token endpoint, creates, writes and publishes a table;
    pyiceberg reads the rows back with the same properties; neither the client secret nor the
    token is on any process's command line, nor on the server's."""
    oauth = {"oauth2-server-uri": f"{rest.url}/v1/oauth/tokens", "scope": "catalog"}
    env = _env(rest, {"credential": rest.credential, **oauth})
    proc = subprocess.run(
        [sys.executable, "-c", _SPARK_SCRIPT, TABLE],
        env={**os.environ, **env, "PROBE_SECRET": rest.client_secret},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["published"] and result["leaked"] == []

    client = catalog.CatalogClient(Settings.from_env(env))
    rows = client.catalog().load_table(client.identifier(TABLE)).scan().to_arrow()
    assert sorted(rows.column("id").to_pylist()) == [1, 2]
    pid = rest.running_pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert rest.token.encode() not in cmdline and rest.client_secret.encode() not in cmdline


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


def test_settings_listing_masks_the_catalog_credentials(rest: IcebergRest) -> None:
    """``backfill-assets settings`` (the listing it prints) shows the property names, never the
    credential or token values."""
    env = _env(rest, {"credential": rest.credential, "token": rest.token, "scope": "catalog"})
    shown = {s.variable: s.value for s in listing(env)}["BACKFILL_CATALOG_PROPERTIES"]
    assert shown is not None and '"credential"' in shown and '"scope": "catalog"' in shown
    assert rest.client_secret not in shown and rest.token not in shown
