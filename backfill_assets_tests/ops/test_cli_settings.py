"""``backfill-assets settings``: every variable the package reads, from the settings model
(no second list), with its value, default and source; secrets never printed. In-process, no
services."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from backfill_assets.ops import cli
from backfill_assets.stack.settings import REPO_ROOT, SECRET_VARS, listing

PACKAGE = REPO_ROOT / "backfill_assets"
# Names that look like variables in the package's source but are Python constants or words in
# a message, never read from the environment.
NOT_VARIABLES = {
    "BACKFILL_POLICY",  # defs/assets.py: the assets' Dagster BackfillPolicy
    "BACKFILL_TAG",  # ops/planner.py: Dagster's backfill run tag
    "BACKFILL_ID",  # "--backfill BACKFILL_ID" in an error message
}
# One planted secret per way a secret reaches a value: its own variable, a URL's password,
# Spark Connect's token parameter, a secret key of BACKFILL_SPARK_CONF, a secret Kafka client
# property of BACKFILL_KAFKA_PROPERTIES.
SECRET = "s3cr3t-Pl4nted"
# A registry takes one kind of credentials: the token is planted here, basic auth in
# stack/test_registry_auth.py.
SECRETS_ENV = {
    **{name: SECRET for name in SECRET_VARS if name != "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH"},
    "BACKFILL_CATALOG_PROPERTIES": json.dumps(
        {"credential": f"lake:{SECRET}", "header.Authorization": f"Bearer {SECRET}", "scope": "x"}
    ),
    "BACKFILL_CATALOG_URI": f"postgresql+psycopg2://lake:{SECRET}@db.internal:5432/catalog",
    "BACKFILL_SCHEMA_REGISTRY_URL": f"https://reader:{SECRET}@registry.internal/apis/ccompat/v7",
    "BACKFILL_SPARK_CONNECT": f"sc://spark.internal:15002/;token={SECRET};user_id=lake",
    "BACKFILL_SPARK_CONF": json.dumps(
        {"spark.hadoop.fs.s3a.secret.key": SECRET, "spark.executor.instances": "4"}
    ),
    "BACKFILL_KAFKA_PROPERTIES": json.dumps(
        {
            "security.protocol": "SSL",
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": "/etc/kafka/client.p12",
            "ssl.keystore.password": SECRET,
        }
    ),
}


def _package_variables() -> set[str]:
    """Every BACKFILL_* name in the package's files (a prefix such as BACKFILL_KAFKA_* left
    out), as grep finds them."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*"):
        if path.is_file() and path.suffix in {".py", ".yaml", ".yml", ".properties", ".sh"}:
            names.update(re.findall(r"\bBACKFILL_[A-Z0-9_]*[A-Z0-9]\b(?![_*])", path.read_text()))
    return names - NOT_VARIABLES


def test_every_variable_the_package_names_is_listed() -> None:
    listed = {s.variable for s in listing({})}
    found = _package_variables()
    assert len(found) > 50
    assert found <= listed, sorted(found - listed)
    # Read through a prefix ("BACKFILL_MAINTENANCE_" + ...), so grep alone misses them.
    assert "BACKFILL_MAINTENANCE_ORPHAN_RETENTION_HOURS" in listed
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"} <= listed


def test_every_listed_variable_is_documented() -> None:
    doc = (REPO_ROOT / "infra" / "README.md").read_text()
    assert [s.variable for s in listing({}) if f"`{s.variable}`" not in doc] == []


def test_values_defaults_and_sources(tmp_path: Path) -> None:
    rows = {
        s.variable: s
        for s in listing({"BACKFILL_HOME": str(tmp_path), "BACKFILL_KAFKA_PORT": "29092"})
    }
    home = rows["BACKFILL_HOME"]
    assert (home.value, home.source) == (str(tmp_path), "environment")
    port = rows["BACKFILL_KAFKA_PORT"]
    assert (port.value, port.default, port.source) == ("29092", "19092", "environment")
    # A default that follows other settings is the one the parser would use with them.
    assert rows["BACKFILL_KAFKA_CONTROLLER_PORT"].default == "29093"
    assert rows["BACKFILL_JAR_CACHE"].default == str(tmp_path.resolve() / "jars")
    shuffle = rows["BACKFILL_SPARK_SHUFFLE_PARTITIONS"]
    assert (shuffle.value, shuffle.default, shuffle.source) == ("4", "4", "default")
    assert rows["BACKFILL_SPARK_CDS"].default == "on"
    unset = rows["BACKFILL_SPEC"]
    assert (unset.value, unset.default, unset.source) == (None, None, "default")


def test_secrets_never_appear(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path))
    for name, value in SECRETS_ENV.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["settings"]) == 0
    text, err = capsys.readouterr()
    assert cli.main(["settings", "--json"]) == 0
    doc_text, json_err = capsys.readouterr()
    for out in (text, err, doc_text, json_err):
        assert SECRET not in out
    rows = {row["variable"]: row for row in json.loads(doc_text)["settings"]}
    for name in set(SECRET_VARS) & set(SECRETS_ENV):
        assert rows[name] == {
            "variable": name,
            "value": "***",
            "default": None,
            "source": "environment",
            "secret": True,
        }
    assert rows["BACKFILL_CATALOG_URI"]["value"] == (
        "postgresql+psycopg2://lake:***@db.internal:5432/catalog"
    )
    assert rows["BACKFILL_SPARK_CONNECT"]["value"] == (
        "sc://spark.internal:15002/;token=***;user_id=lake"
    )
    assert json.loads(rows["BACKFILL_CATALOG_PROPERTIES"]["value"]) == {
        "credential": "***",
        "header.Authorization": "***",
        "scope": "x",
    }
    assert json.loads(rows["BACKFILL_SPARK_CONF"]["value"]) == {
        "spark.hadoop.fs.s3a.secret.key": "***",
        "spark.executor.instances": "4",
    }
    assert json.loads(rows["BACKFILL_KAFKA_PROPERTIES"]["value"]) == {
        "security.protocol": "SSL",
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": "/etc/kafka/client.p12",
        "ssl.keystore.password": "***",
    }


def test_the_table_and_the_json_list_the_same_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path))
    monkeypatch.setenv("BACKFILL_SENSORS", "off")
    assert cli.main(["settings", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["settings"]
    assert [r["variable"] for r in rows] == sorted(r["variable"] for r in rows)
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out
    for row in rows:
        assert row["variable"] in out
    assert re.search(r"BACKFILL_SENSORS\s+off\s+on\s+environment", out)
    assert re.search(
        rf"\n{len(rows)} settings; [1-9][0-9]* set \(environment, .env, settings file or cli\)", out
    )


def test_a_variable_the_cli_sets_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """DAGSTER_HOME unset and a dagster.yaml found: the CLI sets BACKFILL_DAGSTER_STORAGE."""
    (tmp_path / "dagster.yaml").write_text("{}\n")
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("BACKFILL_DAGSTER_STORAGE", raising=False)
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(cli, "dagster_home_dirs", lambda: (tmp_path,))
    assert cli.main(["settings", "--json"]) == 0
    rows = {r["variable"]: r for r in json.loads(capsys.readouterr().out)["settings"]}
    storage = rows["BACKFILL_DAGSTER_STORAGE"]
    assert (storage["value"], storage["source"]) == (str(tmp_path / "state" / "dagster"), "cli")


def test_an_invalid_setting_exits_2_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BACKFILL_SPARK_SHUFFLE_PARTITIONS", "many")
    assert cli.main(["settings"]) == 2
    assert "BACKFILL_SPARK_SHUFFLE_PARTITIONS='many' is not a whole number" in (
        capsys.readouterr().err
    )


def test_the_current_directorys_env_file_is_read_as_dagster_reads_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A .env beside the code location: the command reads it as Dagster's webserver, daemon and
    code servers started there do (the same parse, its values winning over the environment),
    says which values came from it, and leaves the environment as it was."""
    from dagster._core.secrets.env_file import get_env_var_dict  # Dagster's own reader

    (tmp_path / ".env").write_text(
        "# the team's settings\n"
        "BACKFILL_KAFKA_PORT=29092\n"
        'export BACKFILL_SENSORS="off"\n'
        f"BACKFILL_KAFKA_SASL_PASSWORD={SECRET}\n"
        "BACKFILL_SPEC\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("BACKFILL_KAFKA_PORT", "39092")
    # Left by other tests' sessions in this process otherwise (the controller port follows).
    for name in ("BACKFILL_SENSORS", "BACKFILL_SPEC", "BACKFILL_KAFKA_CONTROLLER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["settings", "--json"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    rows = {r["variable"]: r for r in json.loads(out)["settings"]}
    read = {name: rows[name]["value"] for name in get_env_var_dict(str(tmp_path))}
    assert read == {
        "BACKFILL_KAFKA_PORT": "29092",
        "BACKFILL_SENSORS": "off",
        "BACKFILL_KAFKA_SASL_PASSWORD": "***",
    }
    assert {rows[name]["source"] for name in read} == {".env"}
    assert (rows["BACKFILL_SPEC"]["value"], rows["BACKFILL_SPEC"]["source"]) == (None, "default")
    assert (rows["BACKFILL_HOME"]["source"], rows["BACKFILL_KAFKA_CONTROLLER_PORT"]["value"]) == (
        "environment",
        "29093",
    )
    import os

    assert os.environ["BACKFILL_KAFKA_PORT"] == "39092"
    assert "BACKFILL_SENSORS" not in os.environ


def test_a_settings_file_value_is_listed_as_such_and_its_secrets_masked(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """BACKFILL_SETTINGS_FILE's values show source `settings file`, below .env and the
    environment; its secrets, whole or inside a TOML table, are never printed."""
    path = settings_sandbox.parent / "settings.toml"
    path.write_text(
        "BACKFILL_KAFKA_PORT = 29092\n"
        "BACKFILL_SPARK_SHUFFLE_PARTITIONS = 8\n"
        "BACKFILL_SENSORS = false\n"
        f'BACKFILL_KAFKA_SASL_PASSWORD = "{SECRET}"\n'
        "[BACKFILL_CATALOG_PROPERTIES]\n"
        f'credential = "lake:{SECRET}"\n'
        'scope = "catalog"\n'
    )
    (settings_sandbox / ".env").write_text("BACKFILL_SPARK_SHUFFLE_PARTITIONS=16\n")
    monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
    monkeypatch.setenv("BACKFILL_SENSORS", "on")
    assert cli.main(["settings"]) == 0
    text = capsys.readouterr().out
    assert cli.main(["settings", "--json"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in text and SECRET not in out
    assert re.search(r"BACKFILL_KAFKA_PORT\s+29092\s+19092\s+settings file", text)
    rows = {r["variable"]: r for r in json.loads(out)["settings"]}
    shown = {name: (rows[name]["value"], rows[name]["source"]) for name in rows}
    assert shown["BACKFILL_KAFKA_PORT"] == ("29092", "settings file")
    assert shown["BACKFILL_KAFKA_SASL_PASSWORD"] == ("***", "settings file")
    assert shown["BACKFILL_SPARK_SHUFFLE_PARTITIONS"] == ("16", ".env")
    assert shown["BACKFILL_SENSORS"] == ("on", "environment")
    assert shown["BACKFILL_SETTINGS_FILE"] == (str(path), "environment")
    assert rows["BACKFILL_KAFKA_CONTROLLER_PORT"]["default"] == "29093"
    props = rows["BACKFILL_CATALOG_PROPERTIES"]
    assert props["source"] == "settings file"
    assert json.loads(props["value"]) == {"credential": "***", "scope": "catalog"}
