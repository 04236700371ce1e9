"""``settings``: every setting the package reads, its value, default and source."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import click

from backfill_assets.ops.cli.common import with_ui
from backfill_assets.ops.cli.output import Ui, row, table
from backfill_assets.stack.settings import Setting, Settings, listing

# The variables the command line itself sets while a command runs (DAGSTER_HOME unset and a
# dagster.yaml found: backfill_assets.ops.cli.dagster_home_defaults); the root group keeps
# their names in the click context's meta under this key.
CLI_SET = "backfill_assets.cli_set"
# The variables the current directory's .env set while a command runs (Dagster's processes
# started from that directory read the same file).
ENV_FILE_SET = "backfill_assets.env_file_set"


@click.command("settings")
@with_ui
def settings_command(ui: Ui, settings: Settings) -> int:
    """List every setting the package reads: its environment variable, current value, default
    and source (.env: the current directory's .env file, which Dagster's webserver, daemon and
    code servers started there read too, and whose values win; environment; settings file: the
    TOML file BACKFILL_SETTINGS_FILE names, below the environment; default; cli: set by this
    command line from the dagster.yaml it found). Secrets (passwords, keys, tokens, also inside
    URLs and BACKFILL_SPARK_CONF) are never printed: `***` only says one is set.
    infra/README.md describes each setting."""
    meta = click.get_current_context().meta
    rows = [{**asdict(s), "source": _source(s, meta)} for s in listing()]
    out = table("variable", "value", "default", "source")
    for doc in rows:
        row(out, doc["variable"], _shown(doc["value"]), _shown(doc["default"]), doc["source"])
    ui.table(out)
    changed = sum(doc["source"] != "default" for doc in rows)
    ui.line(
        f"{len(rows)} settings; {changed} set (environment, .env, settings file or cli), "
        "the others default"
    )
    ui.emit({"settings": rows})
    return 0


def _source(setting: Setting, meta: dict[str, Any]) -> str:
    if setting.variable in meta.get(CLI_SET, ()):
        return "cli"
    if setting.variable in meta.get(ENV_FILE_SET, ()):
        return ".env"
    return setting.source


def _shown(value: str | None) -> str:
    return "(unset)" if value is None else value
