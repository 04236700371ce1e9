"""A code location for bench/latency.py ``--floor``: one asset that does nothing, partitioned
by hour, so launching it measures what any run pays before its first step (the run queue, the
run process, the code load). It imports the project's Definitions module, so its runs load the
same code as the project's runs do; only its own asset is in it."""

from __future__ import annotations

import dagster as dg

import backfill_assets.defs.definitions  # noqa: F401  (the project's code load, paid by each run)

START = "2026-06-01-00:00"


@dg.asset(partitions_def=dg.HourlyPartitionsDefinition(start_date=START))
def bench_floor_noop() -> None:
    """Nothing: the run's cost is Dagster's alone."""


defs = dg.Definitions(assets=[bench_floor_noop])
