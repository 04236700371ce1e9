"""``columns``: a registry topic's columns derived from its subject's latest schema, as the
block to paste into topics.yaml to pin them (:mod:`backfill_assets.spec.registry_columns`)."""

from __future__ import annotations

from typing import Any

import click
import yaml

from backfill_assets.errors import ArgumentError, SpecError
from backfill_assets.ops.cli.common import with_ui
from backfill_assets.ops.cli.output import Ui
from backfill_assets.spec import registry_columns
from backfill_assets.spec.loader import spec_path
from backfill_assets.spec.model import REGISTRY_FORMATS
from backfill_assets.stack.settings import Settings


@click.command(
    "columns", short_help="Print a registry topic's columns from its latest schema, to pin them."
)
@click.option("--topic", required=True, help="an avro, json_schema or protobuf topic in the spec")
@with_ui
def columns_command(ui: Ui, settings: Settings, topic: str) -> int:
    """Print the columns of the topic's subject's latest schema in the schema registry as the
    ``columns:`` block of topics.yaml: pasted into the topic's entry, it pins them (loading
    then uses them as they are, without asking the registry). A topic that declares no
    columns gets these at every load. Fields that cannot be columns are listed as comments."""
    entry = _entry(topic)
    subject = str(entry.get("subject") or f"{topic}-value")
    message = entry.get("message") if isinstance(entry.get("message"), str) else None
    url = settings.schema_registry_url
    derived = registry_columns.read_columns(
        entry["format"], subject, url, message, settings.schema_registry_auth
    )
    ui.line(block(topic, url, derived))
    if derived.unsupported:
        ui.note(f"left out: {derived.problem()}")
    ui.emit(
        {
            "topic": topic,
            "subject": subject,
            "version": derived.version,
            "url": url,
            "columns": derived.columns,
            "unsupported": [{"name": n, "reason": why} for n, why in derived.unsupported],
        }
    )
    return 0


def block(topic: str, url: str, derived: registry_columns.Derived) -> str:
    """The ``columns:`` block, indented as a topic's fields are in topics.yaml."""
    lines = [
        f"    # topic {topic!r}: subject {derived.subject!r} version {derived.version} at {url}",
        "    columns:",
    ]
    for column in derived.columns:
        flow = yaml.safe_dump([column], default_flow_style=True, sort_keys=False, width=1000)
        lines.append(f"      - {flow.strip()[1:-1]}")
    for name, why in derived.unsupported:
        lines.append(f"      # not a column: field {name!r} {why}")
    return "\n".join(lines)


def _entry(topic: str) -> dict[str, Any]:
    """The topic's entry in the spec as written (not loaded: loading would derive or need the
    columns this command prints)."""
    path = spec_path()
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"cannot read topic spec {path}: {exc}") from exc
    entries = doc.get("topics") if isinstance(doc, dict) else None
    found = {e.get("topic"): e for e in entries or () if isinstance(e, dict)}
    if topic not in found:
        names = ", ".join(str(n) for n in found)
        raise ArgumentError(f"unknown topic {topic!r}; {path} has: {names}")
    entry = found[topic]
    if entry.get("format") not in REGISTRY_FORMATS:
        formats = ", ".join(REGISTRY_FORMATS)
        raise ArgumentError(
            f"topic {topic!r} has format {entry.get('format')!r}: only {formats} topics read a "
            "schema registry subject; declare its `columns`"
        )
    return dict(entry)
