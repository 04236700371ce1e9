"""Where settings come from, in the order every entry point reads them: the working
directory's .env, the process environment, the BACKFILL_SETTINGS_FILE TOML file, the defaults
(infra/README.md); an explicit mapping alone; an invalid value in any of them is one line
naming the variable, what is allowed and the file that set it. In-process, no services."""

from __future__ import annotations

from pathlib import Path

import pytest

from backfill_assets.errors import SettingsError
from backfill_assets.stack.settings import Settings, listing

SECRET = "s3cr3t-in-a-file"


def _settings_file(directory: Path, text: str) -> Path:
    path = directory.parent / "settings.toml"
    path.write_text(text)
    return path


def test_a_settings_file_is_read_and_the_environment_beats_it(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _settings_file(
        settings_sandbox,
        "BACKFILL_KAFKA_PORT = 29092\n"
        "BACKFILL_SENSORS = false\n"
        'BACKFILL_SPARK_DRIVER_MEMORY = "4g"\n'
        'BACKFILL_KAFKA_SECURITY_PROTOCOL = "sasl_ssl"\n'
        'BACKFILL_KAFKA_SASL_MECHANISM = "SCRAM-SHA-512"\n'
        f'BACKFILL_KAFKA_SASL_PASSWORD = "{SECRET}"\n'
        "[BACKFILL_CATALOG_PROPERTIES]\n"
        'scope = "catalog"\n'
        '"rest.sigv4-enabled" = true\n',
    )
    monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
    monkeypatch.setenv("BACKFILL_SPARK_DRIVER_MEMORY", "3g")
    s = Settings.from_env()
    assert (s.kafka.local_port, s.kafka.bootstrap_servers) == (29092, "127.0.0.1:29092")
    assert s.kafka.local_controller_port == 29093  # a default follows the file's value
    assert s.sensors_running is False
    assert s.spark_driver_memory == "3g"  # the environment wins over the file
    assert (s.kafka.security_protocol, s.kafka.sasl_password) == ("SASL_SSL", SECRET)
    assert s.catalog.properties == {"scope": "catalog", "rest.sigv4-enabled": "true"}


def test_the_env_file_beats_the_environment_and_may_name_the_settings_file(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _settings_file(
        settings_sandbox, "BACKFILL_KAFKA_PORT = 49092\nBACKFILL_SENSORS = false\n"
    )
    (settings_sandbox / ".env").write_text(
        f"BACKFILL_KAFKA_PORT=29092\nBACKFILL_SETTINGS_FILE={path}\n"
    )
    monkeypatch.setenv("BACKFILL_KAFKA_PORT", "39092")
    s = Settings.from_env()
    assert s.kafka.local_port == 29092
    assert s.sensors_running is False  # from the file the .env names
    rows = {r.variable: r for r in listing()}
    assert (rows["BACKFILL_KAFKA_PORT"].value, rows["BACKFILL_KAFKA_PORT"].source) == (
        "29092",
        ".env",
    )
    assert (rows["BACKFILL_SENSORS"].value, rows["BACKFILL_SENSORS"].source) == (
        "off",
        "settings file",
    )


def test_an_explicit_mapping_is_read_alone(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _settings_file(settings_sandbox, "BACKFILL_KAFKA_PORT = 49092\n")
    (settings_sandbox / ".env").write_text("BACKFILL_SENSORS=off\n")
    monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
    monkeypatch.setenv("BACKFILL_SPARK_DRIVER_MEMORY", "3g")
    s = Settings.from_env({"BACKFILL_HOME": str(settings_sandbox)})
    assert (s.kafka.local_port, s.sensors_running, s.spark_driver_memory) == (19092, True, "2g")
    rows = {r.variable: r for r in listing({"BACKFILL_HOME": str(settings_sandbox)})}
    assert {r.source for name, r in rows.items() if name != "BACKFILL_HOME"} == {"default"}


# A bad value of each kind (whole number, port, switch, choice) and the message's words after
# the value.
BAD = [
    (
        "BACKFILL_PUBLISH_ATTEMPTS",
        "many",
        "is not a whole number; allowed: a positive whole number",
    ),
    ("BACKFILL_PUBLISH_ATTEMPTS", "0", "must be a positive whole number"),
    ("BACKFILL_SEAL_GRACE_S", "-1", "must be zero or a positive whole number"),
    ("BACKFILL_WEBSERVER_PORT", "70000", "is above 65535; allowed: 1 to 65535"),
    ("BACKFILL_WEBSERVER_PORT", "http", "is not a whole number; allowed: 1 to 65535"),
    ("BACKFILL_SENSORS", "maybe", "is not a switch; allowed: on, off"),
    ("BACKFILL_RUN_EXECUTOR", "threads", "is not supported; allowed: in_process, multiprocess"),
]


@pytest.mark.parametrize("where", ["environment", ".env", "settings file"])
@pytest.mark.parametrize(("name", "value", "says"), BAD)
def test_a_bad_value_in_any_source_is_one_line_naming_it_and_what_is_allowed(
    settings_sandbox: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    name: str,
    value: str,
    says: str,
) -> None:
    if where == "environment":
        monkeypatch.setenv(name, value)
        suffix = ""
    elif where == ".env":
        (settings_sandbox / ".env").write_text(f"{name}={value}\n")
        suffix = f" (set in {settings_sandbox / '.env'})"
    else:
        path = _settings_file(settings_sandbox, f'{name} = "{value}"\n')
        monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
        suffix = f" (set in BACKFILL_SETTINGS_FILE={str(path)!r})"
    with pytest.raises(SettingsError) as caught:
        Settings.from_env()
    assert str(caught.value) == f"{name}={value!r} {says}{suffix}"


def test_a_number_in_the_settings_file_is_shown_as_written(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _settings_file(settings_sandbox, "BACKFILL_WEBSERVER_PORT = 70000\n")
    monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
    with pytest.raises(SettingsError, match=r"^BACKFILL_WEBSERVER_PORT=70000 is above 65535"):
        Settings.from_env()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('BACKFILL_HOMEDIR = "/x"\n', "'BACKFILL_HOMEDIR' is not a setting; allowed: the variable"),
        ('HOME = "/x"\n', "'HOME' is not a setting"),  # keys keep the prefix
        ('BACKFILL_SETTINGS_FILE = "/x.toml"\n', "'BACKFILL_SETTINGS_FILE' is not a setting"),
        ("BACKFILL_HOME = /x\n", "is not TOML"),
        (None, "is not a file; allowed: a TOML file of settings"),
    ],
)
def test_a_settings_file_that_cannot_be_used_is_named(
    settings_sandbox: Path, monkeypatch: pytest.MonkeyPatch, text: str | None, says: str
) -> None:
    path = settings_sandbox.parent / "settings.toml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv("BACKFILL_SETTINGS_FILE", str(path))
    with pytest.raises(SettingsError) as caught:
        Settings.from_env()
    message = str(caught.value)
    assert message.startswith(f"BACKFILL_SETTINGS_FILE={str(path)!r}") and says in message
    assert "\n" not in message
