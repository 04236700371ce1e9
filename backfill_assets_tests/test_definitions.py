"""The Definitions users depend on load, and keep their names."""

from __future__ import annotations

from backfill_assets.definitions import defs


def test_definitions_load_with_the_expected_resources() -> None:
    repo = defs.get_repository_def()
    assert set(repo.get_top_level_resources()) >= {"kafka", "spark", "iceberg"}
