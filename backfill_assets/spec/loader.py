"""Loading the spec: ``topics.yaml`` parsed into :class:`~backfill_assets.spec.model.TopicSpec`
objects, every declared table's SQL checked against the columns it reads (without Spark). A
registry topic (avro, json_schema, protobuf) that declares no ``columns`` gets its subject's
latest schema's (:mod:`~backfill_assets.spec.registry_columns`, the only time loading asks the
schema registry).

A bad field fails loading with one :class:`~backfill_assets.errors.SpecError` line per
problem, naming the file, the topic, the table and the field path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from backfill_assets.errors import ColumnsError, RegistryUnavailable, SpecError
from backfill_assets.spec import declared, registry_columns
from backfill_assets.spec.model import REGISTRY_FORMATS, SPEC_PATH, TopicSpec
from backfill_assets.stack.settings import Settings


def spec_path() -> Path:
    """The spec Definitions load: ``BACKFILL_SPEC`` if set, else the package's topics.yaml."""
    return Settings.from_env().spec_path or SPEC_PATH


def load_specs(path: Path | None = None) -> list[TopicSpec]:
    """Parse and validate every topic in ``path`` (default :func:`spec_path`), and every
    declared table's SQL against the columns it reads (without Spark)."""
    path = path or spec_path()
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"cannot read topic spec {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("topics"), list):
        raise SpecError(f"{path}: expected a mapping with a 'topics' list")
    if set(doc) != {"topics"}:
        raise SpecError(
            f"{path}: unknown field(s) {sorted(set(doc) - {'topics'})}; allowed: topics"
        )
    specs, problems = [], []
    for i, entry in enumerate(doc["topics"]):
        name = entry.get("topic") if isinstance(entry, dict) else None
        where = f"{path}: topic {name!r}" if isinstance(name, str) else f"{path}: topics[{i}]"
        try:
            derived = _with_registry_columns(entry)
        except (ColumnsError, RegistryUnavailable) as err:
            problems.append(f"{where}: columns: {err}")
            continue
        try:
            specs.append(
                TopicSpec.model_validate(derived, context={"path": path, "topic": name or ""})
            )
        except ValidationError as err:
            found = [_problem(where, derived, e) for e in err.errors()]
            if derived is not entry:  # say where the columns came from
                subject = derived.get("subject") or f"{name}-value"
                found = [
                    f"{p} (columns derived from the latest schema of subject {subject!r}; "
                    "declare `columns` to pin them)"
                    for p in found
                ]
            problems += found
    if problems:
        raise SpecError("\n".join(problems))
    names = [s.topic for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"{path}: topic(s) listed twice: {', '.join(dupes)}")
    _check_identifiers(specs, path)
    return declared.validate(specs, path)


def _with_registry_columns(entry: Any) -> Any:
    """``entry`` with the columns of its subject's latest schema when it has a registry format
    and declares none (:mod:`~backfill_assets.spec.registry_columns`); declared columns pin
    them, and the registry is not asked."""
    if not isinstance(entry, dict) or "columns" in entry:
        return entry
    if entry.get("format") not in REGISTRY_FORMATS or not isinstance(entry.get("topic"), str):
        return entry
    if entry.get("envelope") is not None:  # the subject's schema is the envelope, not the row
        return entry
    subject = entry.get("subject") or f"{entry['topic']}-value"
    message = entry.get("message")
    settings = Settings.from_env()
    columns = registry_columns.derive_columns(
        entry["format"],
        str(subject),
        settings.schema_registry_url,
        message if isinstance(message, str) else None,
        settings.schema_registry_auth,
    )
    return {**entry, "columns": columns}


_LABELS = {"tables": "table", "columns": "column", "measures": "measure"}


def _problem(where: str, entry: Any, error: Any) -> str:
    """One pydantic error as ``<where>[, table 'x'][, column 'y']: <field path>: <message>``."""
    loc, kind, raw = list(error["loc"]), error["type"], entry
    if kind in ("missing", "extra_forbidden"):
        field = loc.pop()
        msg = f"{'missing required' if kind == 'missing' else 'unknown'} field {field!r}"
    elif kind == "value_error":
        msg = str(error["ctx"]["error"])
    else:
        msg = (
            re.sub(r"^\w+ should", "must", error["msg"])
            .replace("valid tuple", "list")
            .replace(" after validation", "")
        )
        if kind == "model_type":
            msg = "must be a mapping of its fields"
        if not isinstance(error["input"], dict):
            got = repr(error["input"])
            msg += f" (got {got if len(got) <= 60 else got[:57] + '...'})"
    path = ""
    for prev, part in zip([None, *loc], loc, strict=False):
        raw = _child(raw, part)
        label = raw.get("name") if isinstance(raw, dict) else raw
        if isinstance(part, int) and prev in _LABELS and isinstance(label, str):
            where += f", {_LABELS[str(prev)]} {label!r}"
        if part == "[key]":  # a mapping's key (not its value) is wrong
            path += " (key)"
        elif isinstance(part, int) or prev == "upcasters":
            path += f"[{part!r}]"
        else:
            path += f".{part}" if path else str(part)
    return f"{where}: {path}: {msg}" if path else f"{where}: {msg}"


def _child(raw: Any, part: Any) -> Any:
    if isinstance(raw, dict):
        return raw.get(part)
    if isinstance(raw, list) and isinstance(part, int) and 0 <= part < len(raw):
        return raw[part]
    return None


def _check_identifiers(specs: list[TopicSpec], path: Path) -> None:
    """Two topics whose identifiers (``name``) collide would share tables, assets and
    sensors: refused, naming both."""
    seen: dict[str, str] = {}
    for spec in specs:
        other = seen.setdefault(spec.name, spec.topic)
        if other != spec.topic:
            raise SpecError(
                f"{path}: topics {other!r} and {spec.topic!r} both name their tables, assets "
                f"and sensors {spec.name!r}; set `name:` (an identifier: a-z, 0-9, _) on one "
                "of them"
            )
