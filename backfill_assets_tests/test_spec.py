"""topics.yaml is validated at load, with errors that name the topic and the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from backfill_assets.lake.spec import SPEC_PATH, SpecError, load_specs


def _copy_sql(tmp_path: Path) -> None:
    """The declared tables' SQL files, beside the copied spec (their paths are relative)."""
    if not (tmp_path / "tables").exists():
        shutil.copytree(SPEC_PATH.parent / "tables", tmp_path / "tables")


def _write(tmp_path: Path, mutate: dict[str, object]) -> Path:
    doc = yaml.safe_load(SPEC_PATH.read_text())
    entry = doc["topics"][0]
    for key, value in mutate.items():
        if value is None:
            entry.pop(key)
        else:
            entry[key] = value
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump(doc))
    _copy_sql(tmp_path)
    return path


def test_shipped_spec_loads() -> None:
    (orders,) = load_specs()
    assert orders.topic == "orders"
    assert sorted(orders.upcasters) == [1, 2]
    assert orders.raw_table == "raw_orders"
    assert orders.allowed_lateness_hours == 3
    assert orders.max_record_bytes == 1_048_576


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        ({"format": "avro"}, "format 'avro' is not supported; allowed: json"),
        ({"key_field": "customer"}, "key_field 'customer' is not one of the columns"),
        ({"partition_start": "2026-01-01T00:30:00+00:00"}, "partition_start must be a whole"),
        ({"partition_start": "yesterday"}, "partition_start must be ISO-8601"),
        ({"allowed_lateness_hours": -1}, "allowed_lateness_hours must be >= 0"),
        ({"allowed_lateness_hours": "3h"}, "field 'allowed_lateness_hours' has the wrong type"),
        ({"quarantine_max_ratio": 2}, "quarantine_max_ratio must be between 0 and 1"),
        ({"max_record_bytes": 0}, "max_record_bytes must be a positive whole number"),
        ({"max_record_bytes": "1MB"}, "max_record_bytes must be a positive whole number"),
        ({"upcasters": {1: "backfill_assets.lake.transforms.orders:nope"}}, "is not a function"),
        ({"upcasters": {1: "no_such_module:f"}}, "cannot import no_such_module"),
        ({"event_id_field": None}, "missing required field 'event_id_field'"),
        (
            {"columns": [{"name": "event_id", "type": "uuid"}]},
            "column 'event_id' has type 'uuid'; allowed: string",
        ),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, mutate: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match="topic 'orders'") as err:
        load_specs(_write(tmp_path, mutate))
    assert message in str(err.value)


def test_duplicate_topics_are_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load(SPEC_PATH.read_text())
    doc["topics"].append(doc["topics"][0])
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump(doc))
    _copy_sql(tmp_path)
    with pytest.raises(SpecError, match="listed twice: orders"):
        load_specs(path)
