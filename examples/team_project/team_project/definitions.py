"""The team's one code location: everything under ``defs/``, found by Dagster's defs folder
loader. ``defs/lakehouse/defs.yaml`` adds backfill_assets (its component); the rest is the
team's own."""

from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
