"""The declarative topic-to-table spec (``topics.yaml``), validated when Definitions load.

Per topic: how to read its records (columns, key, event id, event time, schema versions), its
current-state rule, and its declared tables (Spark SQL files over the topic's events, other
topics' current state and other declared tables; see :mod:`backfill_assets.lake.declared`). A bad
field or declaration fails loading with a :class:`SpecError` that names the topic, the table
and the field or column. Nothing here starts Spark.
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

SPEC_PATH = Path(__file__).resolve().parents[1] / "topics.yaml"
COLUMN_TYPES = ("string", "bigint", "int", "double", "boolean", "timestamp")
# Kafka's own default limit for one record batch (message.max.bytes) is about 1 MiB.
DEFAULT_MAX_RECORD_BYTES = 1_048_576
Upcaster = Callable[["Column"], dict[str, "Column"]]


class SpecError(BackfillError):
    """topics.yaml has a field the project cannot use."""


# Columns every event of a topic carries besides its own, as the declared tables' SQL sees them.
EVENT_META_COLUMNS = (
    ("kafka_timestamp", "timestamp"),
    ("kafka_partition", "int"),
    ("kafka_offset", "bigint"),
    ("kafka_hour", "timestamp"),
)
# Columns the current-state table adds to the topic's columns.
CURRENT_META_COLUMNS = (
    ("deleted", "boolean"),
    ("order_ts", "timestamp"),
    ("kafka_timestamp", "timestamp"),
    ("kafka_hour", "timestamp"),
    ("kafka_partition", "int"),
    ("kafka_offset", "bigint"),
)


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    type: str
    nullable: bool = True
    allowed: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class MeasureSpec:
    """A figure reconciled on every run: ``table`` (an aggregate over the table's rows in the
    window) must equal ``source`` (an aggregate over the source's rows in the window)."""

    name: str
    table: str
    source: str


@dataclass(frozen=True)
class TableSpec:
    """A declared table: Spark SQL with ``{start}``/``{end}`` over named relations, written
    per event-time hour through write-audit-publish."""

    name: str
    topic: str
    sql: str
    sql_origin: str  # the file (or "inline") the SQL came from, for messages
    event_time: str
    grain: tuple[str, ...]
    lateness_hours: int
    lookback_hours: int
    source: str  # the relation measures reconcile against (the topic's events by default)
    columns: tuple[ColumnSpec, ...]
    measures: tuple[MeasureSpec, ...] = ()
    refs: tuple[str, ...] = ()  # relations the SQL reads, found when the spec is validated
    description: str | None = None

    def column(self, name: str) -> ColumnSpec:
        return next(c for c in self.columns if c.name == name)


@dataclass(frozen=True)
class CurrentSpec:
    """The current-state rule: per ``key`` the latest event by ``order_by`` (then Kafka
    time, partition, offset); a tombstone, or an event matching ``deleted_when``, deletes."""

    key: str
    order_by: str
    deleted_when: str | None = None


@dataclass(frozen=True)
class TopicSpec:
    topic: str
    format: str
    key_field: str
    event_id_field: str
    event_time_field: str
    version_field: str | None
    partition_start: datetime
    allowed_lateness_hours: int
    quarantine_max_ratio: float
    upcasters: Mapping[int, str]
    columns: tuple[ColumnSpec, ...]
    # A record whose key + value exceed this is quarantined as record_too_large:<bytes>.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    # Records of this version already carry the columns' fields: read them as they are.
    latest_version: int | None = None
    current: CurrentSpec | None = None
    tables: tuple[TableSpec, ...] = ()

    @property
    def raw_table(self) -> str:
        return f"raw_{self.topic}"

    @property
    def quarantine_table(self) -> str:
        return f"{self.topic}_quarantine"

    @property
    def current_table(self) -> str:
        return f"{self.topic}_current"

    @property
    def current_rule(self) -> CurrentSpec:
        return self.current or CurrentSpec(self.key_field, self.event_time_field)

    @property
    def versions(self) -> list[int]:
        """Every schema version the replay accepts, oldest first."""
        extra = [self.latest_version] if self.latest_version is not None else []
        return sorted({*self.upcasters, *extra})

    def upcaster(self, version: int) -> Upcaster:
        if version not in self.upcasters and version == self.latest_version:
            from backfill_assets.lake.transforms import identity

            return identity(self.columns)
        module_name, _, attr = self.upcasters[version].partition(":")
        fn: Upcaster = getattr(importlib.import_module(module_name), attr)
        return fn


def spec_path() -> Path:
    """The spec Definitions load: ``BACKFILL_SPEC`` if set, else the package's topics.yaml."""
    from backfill_assets.stack.settings import Settings

    return Settings.from_env().spec_path or SPEC_PATH


def load_specs(path: Path | None = None) -> list[TopicSpec]:
    """Parse and validate every topic in ``path`` (default :func:`spec_path`), and every
    declared table's SQL against the columns it reads (without Spark)."""
    from backfill_assets.lake import declared

    path = path or spec_path()
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
    return declared.validate(specs, path)


def _topic(entry: Any, index: int, path: Path) -> TopicSpec:
    where = f"{path}: topics[{index}]"
    if not isinstance(entry, dict):
        raise SpecError(f"{where} must be a mapping")
    topic = _req(entry, "topic", str, where)
    where = f"{path}: topic {topic!r}"
    unknown = set(entry) - _TOPIC_FIELDS
    if unknown:
        raise SpecError(
            f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_TOPIC_FIELDS)}"
        )
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
    raw_up = entry.get("upcasters") or {}
    if not isinstance(raw_up, dict):
        raise SpecError(f"{where}: upcasters must map schema versions to `module:function`")
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
    version_field = entry.get("version_field")
    if version_field is not None and not isinstance(version_field, str):
        raise SpecError(f"{where}: version_field must be the name of the payload's version field")
    latest = entry.get("latest_version")
    if latest is None and version_field is None:
        latest = 1  # no version field: every record is read as the columns say
    if latest is not None and (not isinstance(latest, int) or isinstance(latest, bool)):
        raise SpecError(f"{where}: latest_version must be a whole number")
    if version_field is None and upcasters:
        raise SpecError(
            f"{where}: upcasters need a version_field (the payload field naming the version)"
        )
    if latest is not None and latest in upcasters:
        raise SpecError(
            f"{where}: version {latest} is both latest_version (read as the columns) and an "
            "upcaster's; keep one"
        )
    if not upcasters and latest is None:
        raise SpecError(
            f"{where}: give latest_version (its records carry the columns' fields) or "
            "upcasters for at least one schema version"
        )
    if latest is not None and upcasters and latest < max(upcasters):
        raise SpecError(f"{where}: latest_version {latest} is older than an upcaster's version")
    columns = tuple(_column(c, where) for c in _req(entry, "columns", list, where))
    col_names = {c.name for c in columns}
    if len(col_names) != len(columns):
        raise SpecError(f"{where}: a column is listed twice")
    for field in ("key_field", "event_id_field", "event_time_field"):
        name = _req(entry, field, str, where)
        if name not in col_names:
            raise SpecError(f"{where}: {field} {name!r} is not one of the columns")
    if next(c for c in columns if c.name == entry["event_time_field"]).type != "timestamp":
        raise SpecError(
            f"{where}: event_time_field {entry['event_time_field']!r} must be a timestamp"
        )
    current = _current(
        entry.get("current"), entry["key_field"], entry["event_time_field"], columns, where
    )
    tables = tuple(
        _table(t, topic, lateness, columns, path, where) for t in _opt_list(entry, "tables", where)
    )
    return TopicSpec(
        topic=topic,
        format=fmt,
        key_field=entry["key_field"],
        event_id_field=entry["event_id_field"],
        event_time_field=entry["event_time_field"],
        version_field=version_field,
        partition_start=start,
        allowed_lateness_hours=lateness,
        quarantine_max_ratio=ratio,
        upcasters=upcasters,
        columns=columns,
        max_record_bytes=max_bytes,
        latest_version=latest,
        current=current,
        tables=tables,
    )


_TOPIC_FIELDS = frozenset(
    {
        "topic",
        "format",
        "key_field",
        "event_id_field",
        "event_time_field",
        "partition_start",
        "allowed_lateness_hours",
        "quarantine_max_ratio",
        "max_record_bytes",
        "version_field",
        "latest_version",
        "upcasters",
        "columns",
        "current",
        "tables",
    }
)
_TABLE_FIELDS = frozenset(
    {
        "name",
        "sql",
        "description",
        "event_time",
        "grain",
        "lateness_hours",
        "lookback_hours",
        "source",
        "columns",
        "measures",
    }
)


def _opt_list(entry: Mapping[str, Any], field: str, where: str) -> list[Any]:
    value = entry.get(field) or []
    if not isinstance(value, list):
        raise SpecError(f"{where}: {field} must be a list")
    return value


def _current(
    raw: Any, key_field: str, event_time: str, columns: tuple[ColumnSpec, ...], where: str
) -> CurrentSpec:
    if raw is None:
        return CurrentSpec(key_field, event_time)
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: current must be a mapping (key, order_by, deleted_when)")
    unknown = set(raw) - {"key", "order_by", "deleted_when"}
    if unknown:
        raise SpecError(f"{where}: current has unknown field(s) {sorted(unknown)}")
    types = {c.name: c.type for c in columns}
    key = raw.get("key", key_field)
    if key not in types:
        raise SpecError(f"{where}: current.key {key!r} is not one of the columns")
    order_by = raw.get("order_by", event_time)
    if types.get(order_by) != "timestamp":
        raise SpecError(f"{where}: current.order_by {order_by!r} must be a timestamp column")
    deleted_when = raw.get("deleted_when")
    if deleted_when is not None and not isinstance(deleted_when, str):
        raise SpecError(f"{where}: current.deleted_when must be a SQL condition (a string)")
    return CurrentSpec(key, order_by, deleted_when)


def _table(
    raw: Any,
    topic: str,
    lateness: int,
    topic_columns: tuple[ColumnSpec, ...],
    path: Path,
    where: str,
) -> TableSpec:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise SpecError(f"{where}: every entry of tables needs a name")
    name = raw["name"]
    where = f"{where}, table {name!r}"
    if not name.isidentifier() or name != name.lower():
        raise SpecError(f"{where}: a table name must be a lower-case SQL identifier")
    unknown = set(raw) - _TABLE_FIELDS
    if unknown:
        raise SpecError(
            f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_TABLE_FIELDS)}"
        )
    sql_ref = _req(raw, "sql", str, where)
    if sql_ref.strip().endswith(".sql") and "\n" not in sql_ref.strip():
        sql_file = (path.parent / sql_ref.strip()).resolve()
        try:
            sql, origin = sql_file.read_text(), str(sql_file)
        except OSError as exc:
            raise SpecError(f"{where}: cannot read its SQL file {sql_file}: {exc}") from None
    else:
        sql, origin = sql_ref, "inline"
    columns = tuple(_column(c, where) for c in _req(raw, "columns", list, where))
    names = [c.name for c in columns]
    if len(set(names)) != len(names):
        raise SpecError(f"{where}: a column is listed twice")
    event_time = _req(raw, "event_time", str, where)
    if event_time not in names:
        raise SpecError(f"{where}: event_time {event_time!r} is not one of its columns {names}")
    if next(c for c in columns if c.name == event_time).type != "timestamp":
        raise SpecError(f"{where}: event_time {event_time!r} must be a timestamp column")
    grain = _req(raw, "grain", list, where)
    if not grain:
        raise SpecError(f"{where}: grain must list the columns that make a row unique")
    for g in grain:
        if g not in names:
            raise SpecError(f"{where}: grain column {g!r} is not one of its columns {names}")
    table_lateness = raw.get("lateness_hours", lateness)
    lookback = raw.get("lookback_hours", 0)
    for field, value in (("lateness_hours", table_lateness), ("lookback_hours", lookback)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SpecError(f"{where}: {field} must be a whole number of hours >= 0")
    source = raw.get("source", topic)
    if not isinstance(source, str):
        raise SpecError(f"{where}: source must name a relation (default: the topic {topic!r})")
    measures = []
    for item in _opt_list(raw, "measures", where):
        m = {"name": item} if isinstance(item, str) else item
        if not isinstance(m, dict) or not isinstance(m.get("name"), str):
            raise SpecError(f"{where}: every measure needs a name")
        extra = set(m) - {"name", "table", "source"}
        if extra:
            raise SpecError(f"{where}: measure {m['name']!r} has unknown field(s) {sorted(extra)}")
        default = f"sum({m['name']})"
        measures.append(
            MeasureSpec(m["name"], str(m.get("table", default)), str(m.get("source", default)))
        )
    description = raw.get("description")
    return TableSpec(
        name=name,
        topic=topic,
        sql=sql,
        sql_origin=origin,
        event_time=event_time,
        grain=tuple(str(g) for g in grain),
        lateness_hours=table_lateness,
        lookback_hours=lookback,
        source=source,
        columns=columns,
        measures=tuple(measures),
        description=str(description) if description is not None else None,
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
