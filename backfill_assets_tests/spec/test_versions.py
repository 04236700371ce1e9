"""Each table's version (Dagster's ``code_version``) is a hash of what defines it: the same on
every load, different when the SQL, an upcaster or a column changes, different per table."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from backfill_assets.lake.offsets.archive import layout_version
from backfill_assets.spec import versions
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import TopicSpec


def _orders() -> TopicSpec:
    return load_specs()[0]


def test_versions_are_stable_across_loads() -> None:
    one, two = _orders(), _orders()
    assert versions.raw_version(one) == versions.raw_version(two)
    assert versions.current_version(one) == versions.current_version(two)
    for a, b in zip(one.tables, two.tables, strict=True):
        assert versions.declared_version(a) == versions.declared_version(b)
    assert layout_version("orders") == layout_version("orders")


def test_versions_differ_between_tables_and_kinds() -> None:
    spec = _orders()
    found = [
        versions.raw_version(spec),
        versions.current_version(spec),
        *(versions.declared_version(t) for t in spec.tables),
        layout_version(spec.topic),
    ]
    assert len(set(found)) == len(found) == 5
    assert all(len(v) == versions.DIGEST_CHARS for v in found)


def test_a_changed_sql_changes_only_its_table() -> None:
    spec = _orders()
    hourly, large = spec.tables
    edited = hourly.model_copy(update={"sql": hourly.sql.replace("count(*)", "count(1)")})
    assert edited.sql != hourly.sql
    assert versions.declared_version(edited) != versions.declared_version(hourly)
    # A declared table does not define the raw table or the current state.
    other = spec.model_copy(update={"tables": (edited, large)})
    assert versions.raw_version(other) == versions.raw_version(spec)
    assert versions.current_version(other) == versions.current_version(spec)


def test_a_changed_column_changes_the_tables_it_defines() -> None:
    spec = _orders()
    columns = tuple(
        c.model_copy(update={"max": 200_000_000}) if c.name == "amount_minor" else c
        for c in spec.columns
    )
    other = spec.model_copy(update={"columns": columns})
    assert versions.raw_version(other) != versions.raw_version(spec)
    assert versions.current_version(other) != versions.current_version(spec)
    hourly = spec.tables[0]
    cols = tuple(
        c.model_copy(update={"min": 1}) if c.name == "cancelled" else c for c in hourly.columns
    )
    assert versions.declared_version(
        hourly.model_copy(update={"columns": cols})
    ) != versions.declared_version(hourly)


def test_descriptions_and_file_locations_do_not_count() -> None:
    hourly = _orders().tables[0]
    moved = hourly.model_copy(
        update={"sql_origin": "/elsewhere/orders_hourly.sql", "description": "reworded"}
    )
    assert versions.declared_version(moved) == versions.declared_version(hourly)


def test_a_changed_upcaster_changes_the_raw_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "versions_upcasters_probe.py"
    body = "def upcast_v1(v):\n    return {{'amount_minor': {}}}\n"
    module.write_text(body.format("v"))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = _orders().model_copy(
        update={"upcasters": {1: "versions_upcasters_probe:upcast_v1"}, "latest_version": 2}
    )
    try:
        before = versions.raw_version(spec)
        assert versions.raw_version(spec) == before
        module.write_text(body.format("v.cast('bigint')"))
        importlib.reload(sys.modules["versions_upcasters_probe"])
        after = versions.raw_version(spec)
    finally:
        sys.modules.pop("versions_upcasters_probe", None)
    assert after != before
    assert versions.current_version(spec) == versions.current_version(_orders())
