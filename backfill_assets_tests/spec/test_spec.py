"""topics.yaml is validated at load, with errors that name the file, the topic, the table and
the field path, say what was wrong and what is allowed (one line per problem)."""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from backfill_assets.errors import SpecError
from backfill_assets.spec import declared
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import SPEC_PATH, TableSpec, TopicSpec

TOPIC_FIELDS = (
    "['allowed_lateness_hours', 'columns', 'current', 'decoders', 'envelope', 'event_id_field', "
    "'event_time_field', 'format', 'key_field', 'latest_version', 'max_record_bytes', 'message', "
    "'name', 'partition_start', 'quarantine_max_ratio', 'schemas', 'subject', 'tables', 'topic', "
    "'upcasters', 'version_field']"
)
TABLE_FIELDS = (
    "['columns', 'description', 'event_time', 'grain', 'lateness_hours', 'lookback_hours', "
    "'measures', 'name', 'source', 'sql']"
)


def _copy_sql(tmp_path: Path) -> None:
    """The declared tables' SQL files, beside the copied spec (their paths are relative)."""
    if not (tmp_path / "tables").exists():
        shutil.copytree(SPEC_PATH.parent / "tables", tmp_path / "tables")


def _save(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump(doc))
    _copy_sql(tmp_path)
    return path


def _write(tmp_path: Path, mutate: dict[str, object], table: int | None = None) -> Path:
    """The shipped spec with the first topic's fields (or its ``table``-th table's) changed;
    a value of None removes the field."""
    doc = yaml.safe_load(SPEC_PATH.read_text())
    entry = doc["topics"][0] if table is None else doc["topics"][0]["tables"][table]
    for key, value in mutate.items():
        if value is None:
            entry.pop(key)
        else:
            entry[key] = value
    return _save(tmp_path, doc)


def _error(path: Path) -> str:
    with pytest.raises(SpecError) as err:
        load_specs(path)
    return str(err.value)


def test_shipped_spec_loads() -> None:
    (orders,) = load_specs()
    assert orders.topic == "orders"
    assert sorted(orders.upcasters) == [1, 2]
    assert orders.raw_table == "raw_orders"
    assert orders.allowed_lateness_hours == 3
    assert orders.max_record_bytes == 1_048_576


def test_shipped_spec_is_parsed_as_before() -> None:
    """The values the hand-written parser produced, field by field (defaults included)."""
    (orders,) = load_specs()
    assert orders.format == "json"
    assert (orders.key_field, orders.event_id_field, orders.event_time_field) == (
        "order_id",
        "event_id",
        "event_time",
    )
    assert orders.version_field == "schema_version" and orders.latest_version is None
    assert orders.versions == [1, 2]
    assert orders.upcasters == {
        1: "backfill_assets.spec.transforms.orders:upcast_v1",
        2: "backfill_assets.spec.transforms.orders:upcast_v2",
    }
    assert orders.partition_start == datetime(2026, 1, 1, tzinfo=UTC)
    assert orders.quarantine_max_ratio == 0.05
    assert isinstance(orders.columns, tuple) and len(orders.columns) == 9
    amount = next(c for c in orders.columns if c.name == "amount_minor")
    assert (amount.type, amount.nullable, amount.allowed) == ("bigint", False, None)
    assert (amount.min, amount.max) == (0, 100_000_000)
    assert type(amount.min) is int  # kept exact: compared with a bigint column
    channel = next(c for c in orders.columns if c.name == "channel")
    assert channel.allowed == ("web", "app", "store", "unknown")
    assert orders.current is not None and orders.current_rule == orders.current
    assert (orders.current.key, orders.current.order_by, orders.current.deleted_when) == (
        "order_id",
        "event_time",
        None,
    )
    hourly, large = orders.tables
    assert (hourly.name, large.name) == ("orders_hourly", "orders_large_paid")
    assert hourly.topic == "orders" and hourly.source == "orders" and hourly.refs == ("orders",)
    assert hourly.sql_origin == str(SPEC_PATH.parent / "tables" / "orders_hourly.sql")
    assert hourly.sql == (SPEC_PATH.parent / "tables" / "orders_hourly.sql").read_text()
    assert hourly.grain == ("event_hour", "currency") and hourly.event_time == "event_hour"
    assert (hourly.lateness_hours, hourly.lookback_hours) == (3, 0)  # the topic's lateness
    assert [(m.name, m.table, m.source) for m in hourly.measures] == [
        ("events", "sum(events)", "count(*)"),
        ("amount_minor", "sum(amount_minor)", "sum(amount_minor)"),
        ("cancelled", "sum(cancelled)", "count_if(event_type = 'cancelled')"),
    ]
    assert hourly.column("events").min == 1
    assert large.description == "Paid order events of 500.00 or more."


def test_specs_are_frozen_and_copied_with_model_copy() -> None:
    (orders,) = load_specs()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        orders.topic = "other"  # type: ignore[misc]
    table = orders.tables[0]
    assert hash(table) == hash(table.model_copy())  # tables and columns are hashable
    other = declared.renamed(orders, "pay", quarantine_max_ratio=0.5)
    assert isinstance(other, TopicSpec) and other.quarantine_max_ratio == 0.5
    assert [t.name for t in other.tables] == ["pay_hourly", "pay_large_paid"]
    assert all(isinstance(t, TableSpec) and t.topic == "pay" for t in other.tables)
    assert "FROM pay" in other.tables[0].sql and orders.tables[0].topic == "orders"
    with pytest.raises(TypeError, match="no field"):
        declared.renamed(orders, "pay", quarantine_ratio=0.5)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        ({"format": "avro"}, "topic 'orders': version_field: an avro topic has none"),
        ({"key_field": "customer"}, "key_field: 'customer' is not one of the columns"),
        ({"partition_start": "2026-01-01T00:30:00+00:00"}, "partition_start: must be a whole"),
        ({"partition_start": "yesterday"}, "partition_start: must be ISO-8601"),
        (
            {"allowed_lateness_hours": -1},
            "allowed_lateness_hours: must be greater than or equal to 0 (got -1)",
        ),
        (
            {"allowed_lateness_hours": "3h"},
            "allowed_lateness_hours: must be a valid integer (got '3h')",
        ),
        ({"allowed_lateness_hours": True}, "allowed_lateness_hours: must be a valid integer"),
        ({"quarantine_max_ratio": 2}, "quarantine_max_ratio: must be less than or equal to 1"),
        ({"max_record_bytes": 0}, "max_record_bytes: must be greater than 0 (got 0)"),
        ({"max_record_bytes": "1MB"}, "max_record_bytes: must be a valid integer (got '1MB')"),
        (
            {"upcasters": {1: "backfill_assets.spec.transforms.orders:nope"}},
            "upcasters[1]: backfill_assets.spec.transforms.orders:nope is not a function",
        ),
        ({"upcasters": {1: "no_such_module:f"}}, "upcasters[1]: cannot import no_such_module"),
        ({"event_id_field": None}, "topic 'orders': missing required field 'event_id_field'"),
        (
            {"columns": [{"name": "event_id", "type": "uuid"}]},
            "topic 'orders', column 'event_id': columns[0].type: must be 'string', 'bigint', "
            "'int', 'double', 'boolean', 'timestamp' or 'decimal(p,s)' (got 'uuid')",
        ),
        (
            {"format": "xml"},
            "format: 'xml' is not a format; allowed: ['json', 'avro', 'json_schema', 'protobuf']",
        ),
        (
            {"subject": "orders-value"},
            "subject: only an avro, json_schema or protobuf topic reads a schema registry",
        ),
        (
            {"message": "shop.Order"},
            "message: only a protobuf topic names the message its records hold",
        ),
        (
            {"colour": "blue"},
            f"topic 'orders': unknown field(s) ['colour']; allowed: {TOPIC_FIELDS}",
        ),
        (
            {"current": {"key": "order_id", "order_by": "amount_minor"}},
            "current.order_by: 'amount_minor' must be a timestamp column (one of ['event_time'])",
        ),
        (
            {"current": {"key": "order_id", "ordered_by": "event_time"}},
            "current: unknown field(s) ['ordered_by']; allowed: ['deleted_when', 'key', "
            "'order_by']",
        ),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, mutate: dict[str, object], message: str) -> None:
    error = _error(_write(tmp_path, mutate))
    assert error.startswith(f"{tmp_path / 'topics.yaml'}: topic 'orders'")
    assert message in error


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            {"grains": ["event_id"]},
            f"tables[1]: unknown field(s) ['grains']; allowed: {TABLE_FIELDS}",
        ),
        # Filled in by the loader, never by the spec.
        ({"topic": "payments"}, "tables[1]: unknown field(s) ['topic']; allowed: ['columns',"),
        ({"refs": ["orders"]}, "tables[1]: unknown field(s) ['refs']; allowed: ['columns',"),
        (
            {"lateness_hours": "two"},
            "tables[1].lateness_hours: must be a valid integer (got 'two')",
        ),
        ({"lookback_hours": -2}, "tables[1].lookback_hours: must be greater than or equal to 0"),
        ({"event_time": None}, "tables[1]: missing required field 'event_time'"),
        ({"grain": []}, "tables[1].grain: must have at least 1 item, not 0 (got [])"),
        ({"grain": ["event_id", "channel"]}, "grain: column 'channel' is not one of its columns"),
        ({"event_time": "order_id"}, "event_time: 'order_id' must be a timestamp column"),
        ({"sql": "tables/missing.sql"}, "tables[1]: sql: cannot read its SQL file"),
        (
            {"columns": [{"name": "event_time", "type": "date", "nullable": False}]},
            "table 'orders_large_paid', column 'event_time': tables[1].columns[0].type: must be "
            "'string', 'bigint', 'int', 'double', 'boolean', 'timestamp' or 'decimal(p,s)' "
            "(got 'date')",
        ),
        (
            {"measures": ["amount_minor", {"name": "rows", "tabel": "count(*)"}]},
            "table 'orders_large_paid', measure 'rows': tables[1].measures[1]: unknown field(s) "
            "['tabel']; allowed: ['name', 'source', 'table']",
        ),
    ],
)
def test_bad_table_fields_are_named(
    tmp_path: Path, mutate: dict[str, object], message: str
) -> None:
    error = _error(_write(tmp_path, mutate, table=1))
    assert error.startswith(
        f"{tmp_path / 'topics.yaml'}: topic 'orders', table 'orders_large_paid'"
    )
    assert message in error


@pytest.mark.parametrize(
    ("topic", "name"),
    [
        ("orders-v1", "orders_v1"),
        ("shop.Orders.v1", "shop_orders_v1"),
        ("1orders", "t_1orders"),
        ("dbz.public.customers", "dbz_public_customers"),
        ("A" * 249, "a" * 191 + "_" + hashlib.sha256(b"A" * 249).hexdigest()[:8]),
    ],
)
def test_any_legal_kafka_topic_name_gets_an_identifier(
    tmp_path: Path, topic: str, name: str
) -> None:
    """Kafka is read by the real name; tables, assets and sensors by the derived identifier
    (documented in docs/how-it-works.md), which leaves room for "<name>_quarantine" in a JDBC
    catalog's 255-character table names."""
    (spec,) = load_specs(_write(tmp_path, {"topic": topic, "tables": None}))
    assert (spec.topic, spec.name) == (topic, name)
    assert spec.raw_table == f"raw_{name}" and spec.current_table == f"{name}_current"
    assert len(spec.quarantine_table) <= 255 - len("raw_")


def test_an_explicit_name_keeps_the_declared_tables_sql(tmp_path: Path) -> None:
    (spec,) = load_specs(_write(tmp_path, {"topic": "shop.orders.v1", "name": "orders"}))
    assert (spec.topic, spec.name, spec.raw_table) == ("shop.orders.v1", "orders", "raw_orders")
    assert [t.source for t in spec.tables] == ["orders", "orders"]


def test_topics_whose_identifiers_collide_are_refused_naming_both(tmp_path: Path) -> None:
    doc = yaml.safe_load(SPEC_PATH.read_text())
    first = {**doc["topics"][0], "topic": "shop.orders"}
    first.pop("tables")
    doc["topics"] = [first, {**first, "topic": "shop-orders"}]
    error = _error(_save(tmp_path, doc))
    assert "topics 'shop.orders' and 'shop-orders' both name their tables, assets and " in error
    assert "sensors 'shop_orders'; set `name:`" in error


@pytest.mark.parametrize("topic", ["orders/v1", "ordres v1", "a" * 250, ".", ".."])
def test_an_illegal_kafka_topic_name_is_refused(tmp_path: Path, topic: str) -> None:
    error = _error(_write(tmp_path, {"topic": topic, "tables": None}))
    assert f"{topic!r} is not a legal Kafka topic name" in error


def test_a_name_that_is_not_an_identifier_is_refused(tmp_path: Path) -> None:
    error = _error(_write(tmp_path, {"topic": "shop.orders", "name": "Shop-Orders"}))
    assert "name: 'Shop-Orders' is not an identifier: a-z, 0-9 and _" in error


def test_bad_table_name_is_named(tmp_path: Path) -> None:
    error = _error(_write(tmp_path, {"name": "Large-Paid"}, table=1))
    assert "table 'Large-Paid': tables[1].name: must match pattern '^[a-z_][a-z0-9_]*$'" in error


def test_every_problem_is_one_line_without_pydantic_noise(tmp_path: Path) -> None:
    doc = yaml.safe_load(SPEC_PATH.read_text())
    orders = doc["topics"][0]
    orders.pop("format")
    orders["allowed_lateness_hours"] = "two"
    orders["tables"][0]["lookback_hours"] = "one"
    doc["topics"].append({"topic": "payments", "format": "json"})
    doc["topics"].append(["not", "a", "mapping"])
    with pytest.raises(SpecError) as err:
        load_specs(_save(tmp_path, doc))
    assert err.value.__cause__ is None and err.value.__context__ is None
    lines = str(err.value).splitlines()
    where = str(tmp_path / "topics.yaml")
    assert all(line.startswith(f"{where}: ") for line in lines), lines
    assert f"{where}: topic 'orders': missing required field 'format'" in lines
    assert (
        f"{where}: topic 'orders': allowed_lateness_hours: must be a valid integer (got 'two')"
        in lines
    )
    assert (
        f"{where}: topic 'orders', table 'orders_hourly': tables[0].lookback_hours: must be a "
        "valid integer (got 'one')"
    ) in lines
    assert f"{where}: topic 'payments': missing required field 'columns'" in lines
    assert (
        f"{where}: topics[2]: must be a mapping of its fields (got ['not', 'a', 'mapping'])"
        in lines
    )
    # The bad lateness is reported once, on the topic, not again on each table inheriting it.
    assert sum("lateness" in line for line in lines if "topic 'orders'" in line) == 1
    assert "pydantic" not in str(err.value) and "Input should" not in str(err.value)


def test_unknown_top_level_field_is_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load(SPEC_PATH.read_text())
    doc["topic"] = doc["topics"][0]
    assert "unknown field(s) ['topic']; allowed: topics" in _error(_save(tmp_path, doc))


def test_duplicate_topics_are_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load(SPEC_PATH.read_text())
    doc["topics"].append(doc["topics"][0])
    with pytest.raises(SpecError, match="listed twice: orders"):
        load_specs(_save(tmp_path, doc))


def _avro_topic(**over: Any) -> dict[str, Any]:
    """The shipped orders topic as an Avro topic: no version field, upcasters or decoders."""
    doc = yaml.safe_load(SPEC_PATH.read_text())
    topic = {
        k: v
        for k, v in doc["topics"][0].items()
        if k not in ("version_field", "upcasters", "decoders", "tables")
    }
    return {**topic, "format": "avro", **over}


def test_avro_topic_reads_its_subject(tmp_path: Path) -> None:
    spec = TopicSpec.model_validate(_avro_topic())
    assert (spec.format, spec.subject, spec.versions) == ("avro", "orders-value", [1])
    named = TopicSpec.model_validate(_avro_topic(subject="orders-avro-value"))
    assert named.subject == "orders-avro-value"
    # The columns stay declared: they pin the table.
    assert [c.name for c in named.columns] == [c.name for c in spec.columns]
    assert load_specs(_save(tmp_path, {"topics": [_avro_topic()]}))[0].format == "avro"


def test_json_schema_topic_reads_its_subject_and_keeps_json_versioning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A json_schema topic: the subject defaults to `<topic>-value`; its payload is JSON read
    by the json format's rules, so the shipped topic's versions and upcasters still apply."""
    doc = yaml.safe_load(SPEC_PATH.read_text())
    topic = {k: v for k, v in doc["topics"][0].items() if k != "tables"}
    spec = TopicSpec.model_validate({**topic, "format": "json_schema"})
    assert (spec.format, spec.subject, spec.versions) == ("json_schema", "orders-value", [1, 2])
    named = TopicSpec.model_validate({**topic, "format": "json_schema", "subject": "o-value"})
    assert named.subject == "o-value"
    saved = _save(tmp_path, {"topics": [{**topic, "format": "json_schema"}]})
    assert load_specs(saved)[0].format == "json_schema"
    # Without columns, they come from the subject's latest schema (test_registry_columns.py):
    # with no registry answering, loading says so.
    monkeypatch.setenv("BACKFILL_SCHEMA_REGISTRY_URL", "http://127.0.0.1:9/apis/ccompat/v7")
    no_columns = {k: v for k, v in topic.items() if k != "columns"}
    error = _error(_save(tmp_path, {"topics": [{**no_columns, "format": "json_schema"}]}))
    assert "topic 'orders': columns: the schema registry at http://127.0.0.1:9/" in error


@pytest.mark.parametrize(
    "over",
    [
        {"version_field": "schema_version"},
        {"upcasters": {1: "backfill_assets.spec.transforms.orders:upcast_v1"}},
        {"decoders": {1: "backfill_assets.spec.transforms.orders:decode_v1"}},
    ],
)
def test_avro_topic_refuses_json_versioning(tmp_path: Path, over: dict[str, Any]) -> None:
    field = next(iter(over))
    error = _error(_save(tmp_path, {"topics": [_avro_topic(**over)]}))
    assert f"{field}: an avro topic has none; each record names its writer schema" in error


def test_the_debezium_spec_to_copy_loads_beside_the_shipped_topics(tmp_path: Path) -> None:
    """docs/cdc.md's spec entry for a Debezium table, added to the shipped topics.yaml, loads
    as the Definitions load it (its ``decimal(12,2)`` column in the relations every current-
    state rule and declared table is checked against: a KeyError before); and a declared
    table may select a decimal column as ``decimal(p,s)``."""
    text = (Path(__file__).parents[2] / "docs" / "cdc.md").read_text()
    block = text.split("### Adding a Debezium table", 1)[1].split("```yaml\n", 1)[1]
    (entry,) = yaml.safe_load(block.split("```", 1)[0])
    doc = yaml.safe_load(SPEC_PATH.read_text())
    doc["topics"].append(entry)
    specs = load_specs(_save(tmp_path, doc))
    assert specs[-1].topic == "shop.public.accounts" and specs[-1].envelope == "debezium"
    table = {
        "name": "orders_amounts",
        "sql": (
            "SELECT event_time, CAST(amount_minor AS DECIMAL(12,2)) AS amount FROM orders "
            "WHERE event_time >= {start} AND event_time < {end}"
        ),
        "event_time": "event_time",
        "grain": ["event_time"],
        "columns": [
            {"name": "event_time", "type": "timestamp", "nullable": False},
            {"name": "amount", "type": "decimal(12,2)"},
        ],
    }
    doc["topics"][0]["tables"].append(table)
    assert load_specs(_save(tmp_path, doc))[0].tables[-1].name == "orders_amounts"
