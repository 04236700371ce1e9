"""Benchmark: what Dagster's per-partition materialization events cost a run of many partitions.

A run of an hourly asset over a 7-day range ends with one ASSET_MATERIALIZATION per partition
(168), each carrying the run's metadata. In the reduced north star (seventeenth pass) writing a
raw run's 168 took 8.7 s under load. This times an in-process run of a no-op hourly asset over
1 and over 168 partitions (each partition's own figures added, as ``defs/assets.py`` does),
with the run's metadata small (a checksum) or as large as the raw asset's (``per_hour`` of 168
hours, offsets, run totals), alternating, on a fresh SQLite instance each. Prints each case's
seconds, the cost per partition beyond the first, and the ratio big / small metadata. No
Kafka, no Spark.

    .venv/bin/python bench/partition_events.py --repeat 3   (~1 min)
"""

import argparse
import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import dagster as dg


def _run(partitions: int, big: bool) -> float:
    hours_def = dg.HourlyPartitionsDefinition(start_date="2026-06-01-00:00")
    hours = [f"2026-06-{1 + i // 24:02d}T{i % 24:02d}:00:00+00:00" for i in range(168)]

    @dg.asset(partitions_def=hours_def, backfill_policy=dg.BackfillPolicy.single_run())
    def hourly(context: dg.AssetExecutionContext) -> Any:
        for key in context.partition_keys:
            figures = {"read": 6000, "written": 5990, "quarantined": 10}
            context.add_asset_metadata(figures, partition_key=key)
        metadata: dict[str, Any] = {"checksum": "123"}
        if big:
            per_hour = {h: {"read": 6000, "written": 5990, "quarantined": 10} for h in hours}
            metadata["per_hour"] = dg.MetadataValue.json(per_hour)
            metadata["offsets"] = dg.MetadataValue.json({str(p): [0, 10**6] for p in range(12)})
            metadata["run"] = dg.MetadataValue.json({f"figure_{i}": i for i in range(12)})
        return dg.MaterializeResult(metadata=metadata)

    last = hours_def.get_partition_keys()[partitions - 1]
    home = tempfile.mkdtemp(prefix="bench-partition-events-")
    with open(os.path.join(home, "dagster.yaml"), "w") as f:
        f.write("telemetry:\n  enabled: false\n")
    with dg.DagsterInstance.from_config(home) as instance:
        began = time.monotonic()
        dg.materialize(
            [hourly],
            instance=instance,
            tags={
                "dagster/asset_partition_range_start": "2026-06-01-00:00",
                "dagster/asset_partition_range_end": last,
            },
        )
        return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    _run(1, False)  # imports and first-run costs, not counted
    seconds: dict[tuple[int, bool], list[float]] = {}
    for _ in range(args.repeat):
        for case in ((1, False), (168, False), (1, True), (168, True)):
            seconds.setdefault(case, []).append(_run(*case))
    med = {case: statistics.median(values) for case, values in seconds.items()}
    for (n, big), value in sorted(med.items()):
        print(f"  {n:>3} partition(s), {'large' if big else 'small'} metadata: {value:.2f} s")
    for big in (False, True):
        per = (med[(168, big)] - med[(1, big)]) / 167 * 1000
        print(f"  per partition beyond the first ({'large' if big else 'small'}): {per:.1f} ms")
    print(
        f"  168 partitions, large / small metadata: {med[(168, True)] / med[(168, False)]:.2f}x; "
        f"load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
