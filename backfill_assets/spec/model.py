"""The declarative topic-to-table spec (``topics.yaml``), validated when Definitions load.

Per topic: how to read its records (columns, key, event id, event time, schema versions), its
current-state rule, and its declared tables (Spark SQL files over the topic's events, other
topics' current state and other declared tables; see :mod:`backfill_assets.spec.declared`).
The pydantic models below are the spec's schema: their field descriptions document it.
:mod:`backfill_assets.spec.loader` loads them; a bad field or declaration fails loading with a
:class:`SpecError` that names the file, the topic, the table and the field path, one line per
problem. Nothing here starts Spark.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from backfill_assets.spec.transforms import identity
from backfill_assets.spec.transforms.reference import Reference
from backfill_assets.spec.transforms.reference import identity as reference_identity

if TYPE_CHECKING:
    from pyspark.sql import Column

SPEC_PATH = Path(__file__).resolve().parent / "topics.yaml"
ColumnType = Literal["string", "bigint", "int", "double", "boolean", "timestamp"]
COLUMN_TYPES: tuple[str, ...] = get_args(ColumnType)
# An exact decimal column: ``decimal(p,s)``, 1 <= p <= 38, 0 <= s <= p (Spark's own bounds).
DECIMAL_TYPE = re.compile(r"decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def decimal_of(column_type: str) -> tuple[int, int] | None:
    """(precision, scale) of a ``decimal(p,s)`` column type, None for any other type."""
    found = DECIMAL_TYPE.fullmatch(column_type)
    return (int(found[1]), int(found[2])) if found else None


class _SparkTypes(dict[str, str]):
    """The Spark SQL type of each column type: the names happen to agree (this is the one
    place that says so), ``decimal(p,s)`` included."""

    def __missing__(self, key: str) -> str:
        if decimal_of(key) is None:
            raise KeyError(key)
        return key


SPARK_TYPES: dict[str, str] = _SparkTypes({t: t for t in COLUMN_TYPES})
# Kafka's own default limit for one record batch (message.max.bytes) is about 1 MiB.
DEFAULT_MAX_RECORD_BYTES = 1_048_576
Upcaster = Callable[["Column"], dict[str, "Column"]]


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

Hours = Annotated[StrictInt, Field(ge=0)]


class _Spec(BaseModel):
    """A frozen spec entry: unknown keys are refused, naming the allowed ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    # Fields the loader fills in; topics.yaml cannot set them.
    derived: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _known_fields_then_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict):
            allowed = sorted(set(cls.model_fields) - cls.derived)
            unknown = sorted(str(k) for k in data if k not in allowed)
            if unknown:
                raise ValueError(f"unknown field(s) {unknown}; allowed: {allowed}")
        return cls._defaults(data, info.context or {})

    @classmethod
    def _defaults(cls, data: Any, context: Mapping[str, Any]) -> Any:
        """``data`` with the defaults that depend on other fields (raw input: may be wrong)."""
        return data


def _names_once(columns: tuple[ColumnSpec, ...]) -> tuple[ColumnSpec, ...]:
    names = [c.name for c in columns]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"a column is listed twice: {twice}")
    return columns


def _timestamp_column(columns: tuple[ColumnSpec, ...], name: str, field: str) -> None:
    """Raise unless ``name`` is one of ``columns`` and a timestamp."""
    names = [c.name for c in columns]
    if name not in names:
        raise ValueError(f"{field}: {name!r} is not one of the columns {names}")
    if columns[names.index(name)].type != "timestamp":
        stamps = [c.name for c in columns if c.type == "timestamp"]
        raise ValueError(f"{field}: {name!r} must be a timestamp column (one of {stamps})")


def _importable(target: str) -> str:
    module_name, colon, attr = target.partition(":")
    if not colon:
        raise ValueError(f"{target!r} must look like `package.module:function`")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name}: {exc}") from None
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"{target} is not a function")
    return target


def _column_type(value: Any) -> Any:
    """A column type: one of :data:`COLUMN_TYPES`, or ``decimal(p,s)`` (written without
    spaces)."""
    if isinstance(value, str):
        found = decimal_of(value.strip())
        if found is not None:
            precision, scale = found
            if not 1 <= precision <= 38 or scale > precision:
                raise ValueError(
                    f"{value!r}: a decimal needs 1 <= precision <= 38 and scale <= precision"
                )
            return f"decimal({precision},{scale})"
        if value in COLUMN_TYPES:
            return value
    allowed = ", ".join(repr(t) for t in COLUMN_TYPES)
    raise ValueError(f"must be {allowed} or 'decimal(p,s)' (got {value!r})")


class ColumnSpec(_Spec):
    """A column of a topic's records or of a declared table."""

    name: str = Field(description="the payload field (topic) or output column (table)")
    type: Annotated[str, BeforeValidator(_column_type)] = Field(
        description="its Spark type: string, bigint, int, double, boolean, timestamp or "
        "decimal(p,s) (exact: from a JSON number, or a Debezium topic's decimal string)"
    )
    nullable: bool = Field(default=True, description="false quarantines (or fails) rows without it")
    allowed: tuple[str, ...] | None = Field(default=None, description="the only values it may take")
    min: StrictInt | StrictFloat | None = Field(
        default=None, description="its smallest allowed value"
    )
    max: StrictInt | StrictFloat | None = Field(
        default=None, description="its largest allowed value"
    )

    @field_validator("min", "max", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"must be a number (got {value!r})")
        return value


Columns = Annotated[tuple[ColumnSpec, ...], AfterValidator(_names_once)]


class MeasureSpec(_Spec):
    """A figure reconciled on every run: ``table`` (an aggregate over the table's rows in the
    window) must equal ``source`` (an aggregate over the source's rows in the window). A bare
    string ``x`` is short for ``{name: x}``."""

    name: str = Field(description="the figure's name (and the column summed by default)")
    table: str = Field(description="aggregate over the table's window; default `sum(<name>)`")
    source: str = Field(description="aggregate over the source's window; default `sum(<name>)`")

    @classmethod
    def _defaults(cls, data: Any, context: Mapping[str, Any]) -> Any:
        data = {"name": data} if isinstance(data, str) else data
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            return {"table": f"sum({data['name']})", "source": f"sum({data['name']})", **data}
        return data


class TableSpec(_Spec):
    """A declared table: Spark SQL with ``{start}``/``{end}`` over named relations, written
    per event-time hour through write-audit-publish."""

    derived: ClassVar[frozenset[str]] = frozenset({"topic", "sql_origin", "refs"})

    name: str = Field(
        pattern=r"^[a-z_][a-z0-9_]*$", description="the Iceberg table: a lower-case identifier"
    )
    topic: str = Field(default="", description="the topic it is declared under (set by the loader)")
    sql: str = Field(
        description="one Spark SQL query, or a `.sql` file relative to topics.yaml (loaded)"
    )
    sql_origin: str = Field(
        default="inline", description="the file the SQL came from, for messages"
    )
    event_time: str = Field(description="its timestamp column each run's window filters on")
    grain: tuple[str, ...] = Field(min_length=1, description="the columns that make a row unique")
    lateness_hours: Hours = Field(description="late events accepted; default: the topic's")
    lookback_hours: Hours = Field(
        default=0, description="extra hours before the window the SQL reads"
    )
    source: str = Field(description="relation measures reconcile against; default: the topic")
    columns: Columns = Field(description="its output columns, exactly as the SQL selects them")
    measures: tuple[MeasureSpec, ...] = Field(
        default=(), description="figures checked on every run"
    )
    refs: tuple[str, ...] = Field(
        default=(), description="relations its SQL reads (set by validation)"
    )
    description: str | None = Field(default=None, description="shown on the asset")

    @classmethod
    def _defaults(cls, data: Any, context: Mapping[str, Any]) -> Any:
        if not isinstance(data, dict):
            return data
        data = {"topic": context.get("topic", ""), **data, "measures": data.get("measures") or ()}
        ref = data.get("sql")
        if isinstance(ref, str) and ref.strip().endswith(".sql") and "\n" not in ref.strip():
            sql_file = (Path(context.get("path", SPEC_PATH)).parent / ref.strip()).resolve()
            try:
                data.update(sql=sql_file.read_text(), sql_origin=str(sql_file))
            except OSError as exc:
                raise ValueError(f"sql: cannot read its SQL file {sql_file}: {exc}") from None
        return data

    @model_validator(mode="after")
    def _columns_agree(self) -> TableSpec:
        _timestamp_column(self.columns, self.event_time, "event_time")
        names = [c.name for c in self.columns]
        for g in self.grain:
            if g not in names:
                raise ValueError(f"grain: column {g!r} is not one of its columns {names}")
        return self

    def column(self, name: str) -> ColumnSpec:
        return next(c for c in self.columns if c.name == name)


class CurrentSpec(_Spec):
    """The current-state rule: per ``key`` the latest event by ``order_by`` (then Kafka
    time, partition, offset); a tombstone, or an event matching ``deleted_when``, deletes."""

    key: str = Field(description="must be the topic's key_field (default)")
    order_by: str = Field(description="timestamp column; default: the topic's event_time_field")
    deleted_when: str | None = Field(
        default=None, description="SQL condition marking a deleting event"
    )


# The columns every row of a Debezium topic (``envelope: debezium``) holds besides the source
# table's, added to its columns by the spec (docs/cdc.md): the change's op (r snapshot read, c
# create, u update, d delete), its position in the source's log (``source.lsn``), Debezium's
# processing time (``ts_ms``), the source's commit time (``source.ts_ms``, the event time), an
# id per change (``<lsn>:<op>:<key>``: a change delivered twice has one id) and the source
# columns whose unchanged out-of-line (TOAST) value the change does not carry (comma-separated).
CDC_COLUMNS: tuple[ColumnSpec, ...] = (
    ColumnSpec(name="cdc_op", type="string", nullable=False, allowed=("r", "c", "u", "d")),
    ColumnSpec(name="cdc_lsn", type="bigint", nullable=False),
    ColumnSpec(name="cdc_ts_ms", type="bigint"),
    ColumnSpec(name="cdc_source_ts", type="timestamp", nullable=False),
    ColumnSpec(name="cdc_event_id", type="string", nullable=False),
    ColumnSpec(name="cdc_unavailable", type="string"),
)
CDC_NAMES = tuple(c.name for c in CDC_COLUMNS)
# A Debezium topic's current-state rule: deletes are ops d (and tombstones); the order is the
# source's log position (derived.py), order_ts shows the commit time.
CDC_CURRENT = {"order_by": "cdc_source_ts", "deleted_when": "cdc_op = 'd'"}
# Key column types a Debezium topic's key field may have (its value is part of cdc_event_id).
CDC_KEY_TYPES = ("string", "bigint", "int")

FORMATS = ("json", "avro", "json_schema", "protobuf")
# The formats whose values are in Confluent's wire format and name a registry subject.
REGISTRY_FORMATS = ("avro", "json_schema", "protobuf")


def _binary_fields(spec: TopicSpec) -> None:
    """Raise if an avro or protobuf topic sets what only a JSON topic uses."""
    how = {
        "avro": "Avro's schema resolution reads every version as the columns (added fields "
        "from defaults, removed ones NULL, int widened to long)",
        "protobuf": "every version is read as the columns by field name (a field the writer "
        "lacks NULL, int32 widened to bigint, float to double)",
    }[spec.format]
    decimals = [c.name for c in spec.columns if decimal_of(c.type) is not None]
    if decimals and spec.envelope is None:
        raise ValueError(f"columns: an {spec.format} topic has no decimal columns yet: {decimals}")
    for name in ("version_field", "upcasters", "decoders"):
        if getattr(spec, name):
            raise ValueError(
                f"{name}: an {spec.format} topic has none; each record names its writer schema "
                f"by the registry id in its wire format, and {how}"
            )


def _format_fields(spec: TopicSpec) -> None:
    """Raise if a field does not fit the topic's format or envelope."""
    if spec.envelope is not None or spec.schemas is not None:
        _cdc_fields(spec)
    if spec.format in ("avro", "protobuf"):
        _binary_fields(spec)
    elif spec.subject is not None and spec.format not in REGISTRY_FORMATS:
        raise ValueError(
            "subject: only an avro, json_schema or protobuf topic reads a schema registry subject"
        )
    if spec.message is not None and spec.format != "protobuf":
        raise ValueError("message: only a protobuf topic names the message its records hold")


def _cdc_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A Debezium topic's entry with the CDC columns added (unless already there: a dumped
    spec) and its event id and time defaulting to theirs."""
    columns = data.get("columns")
    if isinstance(columns, list | tuple):
        names = {
            c.get("name") if isinstance(c, dict) else getattr(c, "name", None) for c in columns
        }
        if not names & set(CDC_NAMES):
            columns = [*columns, *(c.model_dump(exclude_defaults=True) for c in CDC_COLUMNS)]
    return {
        "event_id_field": "cdc_event_id",
        "event_time_field": "cdc_source_ts",
        **data,
        "columns": columns,
    }


def _cdc_fields(spec: TopicSpec) -> None:
    """Raise unless a Debezium topic's fields agree (docs/cdc.md)."""
    if spec.envelope is None:
        raise ValueError("schemas: only a topic with `envelope: debezium` names its schemas mode")
    if spec.format == "avro":
        _cdc_avro_fields(spec)
    elif spec.format != "json":
        raise ValueError(
            "envelope: debezium reads Kafka's JSON converter (format: json) or Avro through "
            "the schema registry (format: avro)"
        )
    elif spec.schemas is None:
        raise ValueError(
            "schemas: a Debezium topic says how its converter writes: `embedded` "
            "(schemas.enable=true) or `none`"
        )
    for name in ("version_field", "upcasters", "decoders"):
        if getattr(spec, name):
            raise ValueError(
                f"{name}: a Debezium topic's columns are read from `after` as declared"
            )
    if spec.tables:
        raise ValueError("tables: declared tables over a Debezium topic are not supported yet")
    cdc = tuple(c for c in spec.columns if c.name in CDC_NAMES or c.name.startswith("cdc_"))
    if cdc != CDC_COLUMNS:
        raise ValueError(
            f"columns: names starting with cdc_ are the envelope's own {list(CDC_NAMES)}, added "
            "by the spec: rename the source column"
        )
    key = next((c for c in spec.columns if c.name == spec.key_field), None)
    if key is not None and key.type not in CDC_KEY_TYPES:
        raise ValueError(f"key_field: a Debezium topic's key must be one of {list(CDC_KEY_TYPES)}")
    rule = spec.current
    if rule is not None and (rule.order_by, rule.deleted_when) != tuple(CDC_CURRENT.values()):
        raise ValueError(
            "current: a Debezium topic's current state orders by the source's log position "
            "(cdc_lsn, then the Kafka offset) and deletes on op d; order_by and deleted_when "
            "cannot be set"
        )


def _cdc_avro_fields(spec: TopicSpec) -> None:
    """Raise unless a Debezium avro topic's fields agree: no schemas mode (the schemas are the
    registry's), and columns of the types the Avro envelope is read as (docs/cdc.md)."""
    if spec.schemas is not None:
        raise ValueError(
            "schemas: a Debezium avro topic's schemas are in the registry; leave schemas out"
        )
    readable = ("string", "bigint", "int", "boolean", "timestamp")
    other = [
        c.name
        for c in spec.columns
        if c.name not in CDC_NAMES and c.type not in readable and decimal_of(c.type) is None
    ]
    if other:
        raise ValueError(
            f"columns: a Debezium avro topic reads string, bigint, int, boolean, decimal(p,s) "
            f"(decimal.handling.mode=string) and timestamp (a ZonedTimestamp) columns: {other}"
        )


# Kafka's own rule for a topic name (kafka.common.internals.Topic): at most 249 characters.
KAFKA_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
# A topic's identifier (``TopicSpec.name``): it must leave room for the longest table name
# built from it ("<name>_quarantine") in a JDBC catalog's 255-character table-name column.
IDENTIFIER_MAX = 200
IDENTIFIER = re.compile(rf"[a-z_][a-z0-9_]{{0,{IDENTIFIER_MAX - 1}}}")
IDENTIFIER_RULE = f"a-z, 0-9 and _, not starting with a digit, at most {IDENTIFIER_MAX} characters"


def identifier_of(topic: str) -> str:
    """The default identifier of a Kafka topic name: lower case, every character other than
    a-z, 0-9 and _ replaced by _, prefixed with ``t_`` if it would start with a digit; a
    result longer than :data:`IDENTIFIER_MAX` keeps its head and ends with ``_`` and 8 hex
    digits of the name's SHA-256. ``shop.Orders-v1`` -> ``shop_orders_v1``;
    ``dbz.public.customers`` -> ``dbz_public_customers``; ``1st`` -> ``t_1st``."""
    name = re.sub(r"[^a-z0-9_]", "_", topic.lower())
    if not name or name[0].isdigit():
        name = f"t_{name}"
    if len(name) > IDENTIFIER_MAX:
        digest = hashlib.sha256(topic.encode()).hexdigest()[:8]
        name = f"{name[: IDENTIFIER_MAX - 9]}_{digest}"
    return name


class TopicSpec(_Spec):
    """A Kafka topic: how to read its records, its current state and its declared tables."""

    topic: str = Field(description="the Kafka topic, any legal Kafka name (Kafka is read by it)")
    name: str = Field(
        default="",
        description="the identifier that names the topic's tables, assets and sensors and its "
        "relation in declared tables' SQL; default: derived from the topic (identifier_of)",
    )
    format: Literal["json", "avro", "json_schema", "protobuf"] = Field(
        description="the record values' encoding: json; avro (Confluent's wire format: "
        "magic byte 0, the registry's 4-byte schema id, Avro binary); json_schema (the same "
        "header, then UTF-8 JSON read by the json format's rules); or protobuf (the header, the "
        "message-index path, protobuf binary)"
    )
    envelope: Literal["debezium"] | None = Field(
        default=None,
        description="debezium: each value is a Debezium change event (format json: Kafka's JSON "
        "converter; format avro: Avro through the schema registry, keys too); "
        "the columns are the source table's, read from `after` (the key from `before` for a "
        "delete), and the CDC_COLUMNS are added (docs/cdc.md)",
    )
    schemas: Literal["embedded", "none"] | None = Field(
        default=None,
        description="envelope debezium, format json: `embedded` when keys and values are "
        '`{"schema": ..., "payload": ...}` (converter schemas.enable=true), `none` when they '
        "are the bare JSON",
    )
    message: str | None = Field(
        default=None,
        description="protobuf: the full name of the message the records hold (package "
        "included); default: the first message of each writer schema",
    )
    subject: str | None = Field(
        default=None,
        description="avro, json_schema, protobuf: the schema registry subject (avro: its latest "
        "schema gives the fields' defaults); default `<topic>-value`",
    )
    key_field: str = Field(description="the column whose value the Kafka key holds")
    event_id_field: str = Field(description="unique per event; duplicates are removed")
    event_time_field: str = Field(description="timestamp column that orders events")
    version_field: str | None = Field(default=None, description="payload field naming its version")
    partition_start: datetime = Field(description="first Kafka-time hour, ISO-8601 with offset")
    allowed_lateness_hours: Hours = Field(description="hours an event-time hour stays open")
    quarantine_max_ratio: StrictFloat = Field(ge=0, le=1, description="blocking quarantine ratio")
    upcasters: Mapping[StrictInt, Annotated[str, AfterValidator(_importable)]] = Field(
        default_factory=dict, description="schema version -> `package.module:function`"
    )
    decoders: Mapping[StrictInt, Annotated[str, AfterValidator(_importable)]] = Field(
        default_factory=dict,
        description="schema version -> `package.module:function`: its Python reference decode, "
        "which the raw table's decoded_content check compares the stored rows with",
    )
    columns: Columns = Field(
        description="the latest schema: every field a record carries; avro, json_schema, "
        "protobuf: may be left out, then derived at load from the subject's latest schema in "
        "the registry (spec/registry_columns.py); declared columns pin them"
    )
    max_record_bytes: StrictInt = Field(
        default=DEFAULT_MAX_RECORD_BYTES, gt=0, description="key + value above it are quarantined"
    )
    latest_version: StrictInt | None = Field(
        default=None, description="version read as the columns say; default 1 without version_field"
    )
    current: CurrentSpec | None = Field(default=None, description="the current-state rule")
    tables: tuple[TableSpec, ...] = Field(default=(), description="tables declared over the topic")

    @classmethod
    def _defaults(cls, data: Any, context: Mapping[str, Any]) -> Any:
        if not isinstance(data, dict):
            return data
        topic = data.get("topic")
        name = data.get("name") or (identifier_of(topic) if isinstance(topic, str) else None)
        data = {
            **data,
            **({"name": name} if name is not None else {}),
            "upcasters": data.get("upcasters") or {},
            "decoders": data.get("decoders") or {},
        }
        if data.get("format") in REGISTRY_FORMATS and data.get("subject") is None:
            data["subject"] = f"{data.get('topic')}-value"
        if data.get("envelope") == "debezium":
            data = _cdc_defaults(data)
        if data.get("version_field") is None and data.get("latest_version") is None:
            data["latest_version"] = 1  # no version field: every record is read as the columns
        rule = {"key": data.get("key_field"), "order_by": data.get("event_time_field")}
        if data.get("envelope") == "debezium":
            rule = {"key": data.get("key_field"), **CDC_CURRENT}
        if isinstance(data.get("current"), dict | None) and None not in rule.values():
            data["current"] = {**rule, **(data.get("current") or {})}
        lateness = data.get("allowed_lateness_hours")
        inherited = {
            "source": name,
            # A wrong topic-level value is reported once, on the topic.
            "lateness_hours": lateness if type(lateness) is int and lateness >= 0 else 0,
        }
        tables = data.get("tables") or ()
        if isinstance(tables, list):
            tables = [{**inherited, **t} if isinstance(t, dict) else t for t in tables]
        return {**data, "tables": tables}

    @field_validator("topic")
    @classmethod
    def _kafka_name(cls, value: str) -> str:
        if not KAFKA_TOPIC.fullmatch(value) or value in {".", ".."}:
            raise ValueError(
                f"{value!r} is not a legal Kafka topic name: 1 to 249 of a-z, A-Z, 0-9, '.', "
                "'_', '-' (and not '.' or '..')"
            )
        return value

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        # It prefixes the topic's Iceberg tables and names its Dagster assets and sensors,
        # which accept only letters, digits and underscores.
        if not IDENTIFIER.fullmatch(value):
            raise ValueError(
                f"{value!r} is not an identifier: {IDENTIFIER_RULE} (it names the topic's "
                "tables, assets and sensors)"
            )
        return value

    @field_validator("partition_start", mode="before")
    @classmethod
    def _whole_hour(cls, value: Any) -> datetime:
        example = "e.g. '2026-01-01T00:00:00+00:00'"
        try:
            start = value if isinstance(value, datetime) else datetime.fromisoformat(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be ISO-8601 with a UTC offset, {example}") from None
        if start.tzinfo is None or start.minute or start.second or start.microsecond:
            raise ValueError(f"must be a whole hour with a UTC offset, {example}")
        return start

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        if value not in FORMATS:
            raise ValueError(f"{value!r} is not a format; allowed: {list(FORMATS)}")
        return value

    @model_validator(mode="after")
    def _fields_agree(self) -> TopicSpec:
        names = [c.name for c in self.columns]
        _format_fields(self)
        for field in ("key_field", "event_id_field"):
            if getattr(self, field) not in names:
                raise ValueError(f"{field}: {getattr(self, field)!r} is not one of the columns")
        _timestamp_column(self.columns, self.event_time_field, "event_time_field")
        ups, latest = self.upcasters, self.latest_version
        if self.version_field is None and ups:
            raise ValueError("upcasters need a version_field (the payload field naming it)")
        if latest is not None and latest in ups:
            raise ValueError(
                f"version {latest} is both latest_version (read as the columns) and an "
                "upcaster's; keep one"
            )
        if not ups and latest is None:
            raise ValueError(
                "give latest_version (its records carry the columns' fields) or upcasters for "
                "at least one schema version"
            )
        if latest is not None and ups and latest < max(ups):
            raise ValueError(f"latest_version {latest} is older than an upcaster's version")
        unknown = sorted(set(self.decoders) - set(self.versions))
        if unknown:
            raise ValueError(
                f"decoders: version(s) {unknown} have no upcaster (versions: {self.versions})"
            )
        if self.current is not None:
            if self.current.key not in names:
                raise ValueError(f"current.key: {self.current.key!r} is not one of the columns")
            _timestamp_column(self.columns, self.current.order_by, "current.order_by")
        return self

    @property
    def source_columns(self) -> tuple[ColumnSpec, ...]:
        """The columns the records' payloads carry (a Debezium topic's source table's, without
        the :data:`CDC_COLUMNS`)."""
        if self.envelope != "debezium":
            return self.columns
        return tuple(c for c in self.columns if c.name not in CDC_NAMES)

    @property
    def contract_columns(self) -> tuple[ColumnSpec, ...]:
        """The raw table's contract: the columns, except that a Debezium topic's source columns
        other than the key may be NULL there (a delete carries the key only, an update may
        leave out an unchanged TOAST value); the parse quarantines any other missing value and
        the current state's contract holds the declared nullability."""
        if self.envelope != "debezium":
            return self.columns
        return tuple(
            c.model_copy(update={"nullable": True})
            if c.name not in CDC_NAMES and c.name != self.key_field
            else c
            for c in self.columns
        )

    @property
    def raw_table(self) -> str:
        return f"raw_{self.name}"

    @property
    def quarantine_table(self) -> str:
        return f"{self.name}_quarantine"

    @property
    def current_table(self) -> str:
        return f"{self.name}_current"

    @property
    def current_rule(self) -> CurrentSpec:
        return self.current or CurrentSpec(key=self.key_field, order_by=self.event_time_field)

    @property
    def versions(self) -> list[int]:
        """Every schema version the replay accepts, oldest first."""
        extra = [self.latest_version] if self.latest_version is not None else []
        return sorted({*self.upcasters, *extra})

    def upcaster(self, version: int) -> Upcaster:
        if version not in self.upcasters and version == self.latest_version:
            return identity(self.columns)
        module_name, _, attr = self.upcasters[version].partition(":")
        fn: Upcaster = getattr(importlib.import_module(module_name), attr)
        return fn

    def decoder(self, version: int) -> Reference | None:
        """The Python reference decode of ``version``
        (:mod:`~backfill_assets.spec.transforms.reference`), or None if the spec names none.
        A version read as the columns say has its columns' reference
        (:func:`~backfill_assets.spec.transforms.reference.identity`)."""
        if version in self.decoders:
            module_name, _, attr = self.decoders[version].partition(":")
            fn: Reference = getattr(importlib.import_module(module_name), attr)
            return fn
        if version not in self.upcasters and version == self.latest_version:
            return reference_identity(self.columns)
        return None
