"""The declarative topic-to-table spec (``topics.yaml``), validated when Definitions load.

A bad field fails loading with a :class:`SpecError` that names the topic and the field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from backfill_assets.errors import BackfillError

if TYPE_CHECKING:
    from pyspark.sql import Column

SPEC_PATH = Path(__file__).with_name("topics.yaml")
COLUMN_TYPES = ("string", "bigint", "int", "double", "boolean", "timestamp")
# Kafka's own default limit for one record batch (message.max.bytes) is about 1 MiB.
DEFAULT_MAX_RECORD_BYTES = 1_048_576
Upcaster = Callable[["Column"], dict[str, "Column"]]


class SpecError(BackfillError):
    """topics.yaml has a field the project cannot use."""


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    type: str
    nullable: bool = True
    allowed: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class TopicSpec:
    topic: str
    format: str
    key_field: str
    event_id_field: str
    event_time_field: str
    version_field: str
    partition_start: datetime
    allowed_lateness_hours: int
    quarantine_max_ratio: float
    upcasters: Mapping[int, str]
    columns: tuple[ColumnSpec, ...]
    # A record whose key + value exceed this is quarantined as record_too_large:<bytes>.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES

    @property
    def raw_table(self) -> str:
        return f"raw_{self.topic}"

    @property
    def quarantine_table(self) -> str:
        return f"{self.topic}_quarantine"

    def upcaster(self, version: int) -> Upcaster:
        module_name, _, attr = self.upcasters[version].partition(":")
        fn: Upcaster = getattr(importlib.import_module(module_name), attr)
        return fn


def load_specs(path: Path = SPEC_PATH) -> list[TopicSpec]:
    """Parse and validate every topic in ``path``."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"cannot read topic spec {path}: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("topics"), list):
        raise SpecError(f"{path}: expected a mapping with a 'topics' list")
    specs = [_topic(entry, i, path) for i, entry in enumerate(doc["topics"])]
    names = [s.topic for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"{path}: topic(s) listed twice: {', '.join(dupes)}")
    return specs


def _topic(entry: Any, index: int, path: Path) -> TopicSpec:
    where = f"{path}: topics[{index}]"
    if not isinstance(entry, dict):
        raise SpecError(f"{where} must be a mapping")
    topic = _req(entry, "topic", str, where)
    where = f"{path}: topic {topic!r}"
    fmt = _req(entry, "format", str, where)
    if fmt != "json":
        raise SpecError(f"{where}: format {fmt!r} is not supported; allowed: json")
    try:
        start = datetime.fromisoformat(_req(entry, "partition_start", str, where))
    except ValueError:
        raise SpecError(f"{where}: partition_start must be ISO-8601 with a UTC offset") from None
    if start.tzinfo is None or start.minute or start.second:
        raise SpecError(f"{where}: partition_start must be a whole hour with a UTC offset")
    lateness = _req(entry, "allowed_lateness_hours", int, where)
    if lateness < 0:
        raise SpecError(f"{where}: allowed_lateness_hours must be >= 0")
    ratio = float(_req(entry, "quarantine_max_ratio", (int, float), where))
    if not 0 <= ratio <= 1:
        raise SpecError(f"{where}: quarantine_max_ratio must be between 0 and 1")
    max_bytes = entry.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise SpecError(f"{where}: max_record_bytes must be a positive whole number of bytes")
    raw_up = _req(entry, "upcasters", dict, where)
    upcasters: dict[int, str] = {}
    for version, target in raw_up.items():
        if not isinstance(version, int) or not isinstance(target, str) or ":" not in target:
            raise SpecError(
                f"{where}: upcasters entries must look like `1: package.module:function`"
            )
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise SpecError(
                f"{where}: upcasters[{version}]: cannot import {module_name}: {exc}"
            ) from exc
        if not callable(getattr(module, attr, None)):
            raise SpecError(f"{where}: upcasters[{version}]: {target} is not a function")
        upcasters[version] = target
    if not upcasters:
        raise SpecError(f"{where}: upcasters must list at least one schema version")
    columns = tuple(_column(c, where) for c in _req(entry, "columns", list, where))
    col_names = {c.name for c in columns}
    for field in ("key_field", "event_id_field", "event_time_field"):
        name = _req(entry, field, str, where)
        if name not in col_names:
            raise SpecError(f"{where}: {field} {name!r} is not one of the columns")
    return TopicSpec(
        topic=topic,
        format=fmt,
        key_field=entry["key_field"],
        event_id_field=entry["event_id_field"],
        event_time_field=entry["event_time_field"],
        version_field=_req(entry, "version_field", str, where),
        partition_start=start,
        allowed_lateness_hours=lateness,
        quarantine_max_ratio=ratio,
        upcasters=upcasters,
        columns=columns,
        max_record_bytes=max_bytes,
    )


def _column(raw: Any, where: str) -> ColumnSpec:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise SpecError(f"{where}: every column needs a name")
    name = raw["name"]
    ctype = raw.get("type")
    if ctype not in COLUMN_TYPES:
        raise SpecError(
            f"{where}: column {name!r} has type {ctype!r}; allowed: {', '.join(COLUMN_TYPES)}"
        )
    unknown = set(raw) - {"name", "type", "nullable", "allowed", "min", "max"}
    if unknown:
        raise SpecError(f"{where}: column {name!r} has unknown field(s) {sorted(unknown)}")
    allowed = raw.get("allowed")
    return ColumnSpec(
        name=name,
        type=ctype,
        nullable=bool(raw.get("nullable", True)),
        allowed=tuple(str(a) for a in allowed) if allowed is not None else None,
        min=raw.get("min"),
        max=raw.get("max"),
    )


def _req(entry: Mapping[str, Any], field: str, kind: Any, where: str) -> Any:
    if field not in entry:
        raise SpecError(f"{where}: missing required field {field!r}")
    value = entry[field]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise SpecError(f"{where}: field {field!r} has the wrong type ({type(value).__name__})")
    return value
