"""The version of what defines each table: a short hash, shown by Dagster as the asset's
``code_version`` so the UI tells which partitions were built by older definitions.

Each hash covers what decides the table's rows and nothing else (no file paths, no
descriptions), so it is the same on every checkout and every load:

* raw table: the topic's spec entry without its current-state rule and declared tables (they
  define other tables), the source of every upcaster the entry names, and the strict JSON
  reader's Java source (``backfill_assets/stack/java``) that parses every payload;
* current state: the current-state rule, the topic's columns and its key and event-id fields;
* declared table: its SQL and its spec entry.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Iterable
from typing import Any

from backfill_assets.spec.model import TableSpec, TopicSpec
from backfill_assets.stack.jars import JAVA_SOURCES

DIGEST_CHARS = 16
# Spec fields that say where a definition comes from or describe it, not what it computes.
_NOT_DEFINING = frozenset({"description", "sql_origin"})


def digest(kind: str, parts: Iterable[Any]) -> str:
    """A short, stable hash of ``parts`` (JSON-serializable, in order), prefixed by ``kind``
    so two kinds of definition never share a version."""
    text = json.dumps([kind, *parts], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def _entry(model: Any, exclude: set[str] | frozenset[str] = frozenset()) -> Any:
    dumped = model.model_dump(mode="json", exclude=set(exclude) | _NOT_DEFINING)
    return json.loads(json.dumps(dumped, sort_keys=True))


def upcaster_sources(spec: TopicSpec) -> list[tuple[int, str, str]]:
    """(version, ``module:function``, its source) of every upcaster the spec names."""
    out = []
    for version, target in sorted(spec.upcasters.items()):
        module_name, _, attr = target.partition(":")
        fn = inspect.unwrap(getattr(importlib.import_module(module_name), attr))
        out.append((version, target, inspect.getsource(fn)))
    return out


def strict_reader_sources() -> list[tuple[str, str]]:
    """(relative path, text) of the strict JSON reader's Java sources."""
    return [
        (path.relative_to(JAVA_SOURCES).as_posix(), path.read_text())
        for path in sorted(JAVA_SOURCES.rglob("*.java"))
    ]


# Spec fields added later, left out of the hash while unset, so a topic that does not use them
# keeps the version it had.
_LATER_FIELDS = ("envelope", "schemas")


def raw_version(spec: TopicSpec) -> str:
    unset = {name for name in _LATER_FIELDS if getattr(spec, name) is None}
    return digest(
        "raw",
        [
            _entry(spec, {"current", "tables", *unset}),
            upcaster_sources(spec),
            strict_reader_sources(),
        ],
    )


def current_version(spec: TopicSpec) -> str:
    return digest(
        "current",
        [
            _entry(spec.current_rule),
            [_entry(c) for c in spec.columns],
            {"key_field": spec.key_field, "event_id_field": spec.event_id_field},
        ],
    )


def declared_version(table: TableSpec) -> str:
    return digest("declared", [table.sql, _entry(table)])
