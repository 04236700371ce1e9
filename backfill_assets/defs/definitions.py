"""The project's single Dagster entry point (loaded by workspace.yaml and the tests).

Everything is generated from the spec (``BACKFILL_SPEC``, default the package's topics.yaml),
validated when this module loads: a bad declaration fails loading, naming the topic, the table
and the column, and no Spark session is started.
"""

from __future__ import annotations

import dagster as dg

from backfill_assets.defs.build import build_defs, build_resources, run_executor
from backfill_assets.spec.loader import load_specs

__all__ = ["ASSETS", "RESOURCES", "SPECS", "build_defs", "build_resources", "defs", "run_executor"]

RESOURCES: dict[str, object] = build_resources()
SPECS = load_specs()
defs = build_defs(SPECS)
ASSETS: list[dg.AssetsDefinition] = [
    a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition)
]
