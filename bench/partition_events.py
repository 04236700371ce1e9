"""Benchmark: what Dagster's per-partition materialization events cost a run of many partitions.

A run of an hourly asset over a 7-day range ends with one ASSET_MATERIALIZATION per partition
(168; ``--hours N`` for another length: a month's run is 672-720), each carrying the run's
metadata. In the reduced north star (seventeenth pass) writing a
raw run's 168 took 8.7 s under load. This times an in-process run of a no-op hourly asset over
1 and over 168 partitions (each partition's own figures added, as ``defs/assets.py`` does),
with the run's metadata small (a checksum), as large as the raw asset's was (``per_hour`` of the
run's hours, offsets, run totals) or as the raw asset's is now (the same without ``per_hour``),
alternating, on a fresh SQLite instance each. Prints each case's
seconds, the cost per partition beyond the first, and the ratio big / small metadata. No
Kafka, no Spark.

With ``--postgres`` every case also runs on a fresh database of a local Postgres 15 (Debian's,
started for the script on a free loopback port, stopped at the end), with the storage of
``infra/production/dagster.yaml`` (run, event log and schedule storage in Postgres through
psycopg2), alternating with the SQLite runs, and prints the ratio Postgres / SQLite per
partition.

With ``--storage`` every case also runs on the project's own SQLite storage (dagster.yaml's
``storage: custom:``, ``backfill_assets.defs.storage``: Dagster's files, each database's engine
kept), alternating with Dagster's stock ``storage: sqlite:``, and prints the ratio project /
stock per partition.

With ``--batch N`` every case also runs with Dagster's opt-in batched event writes
(``DAGSTER_EVENT_BATCH_SIZE=N``, read by Dagster at each event, so the script sets it around
each run), alternating with the unbatched runs, and prints the ratio batched / unbatched.

    .venv/bin/python bench/partition_events.py --repeat 3   (~1 min)
    .venv/bin/python bench/partition_events.py --repeat 3 --postgres --batch 1000   (~5 min)
    .venv/bin/python bench/partition_events.py --repeat 5 --storage   (~2 min)
    .venv/bin/python bench/partition_events.py --repeat 2 --storage --batch 1000 --hours 672
        (~12 min: the project's storage writes a batch in one transaction per database)
"""

import argparse
import contextlib
import itertools
import os
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg

_DATABASES = itertools.count()
# The project's storage (dagster.yaml), named as a store in place of a Postgres server.
PROJECT = "project"
_PROJECT_YAML = (
    "storage:\n  custom:\n    module: backfill_assets.defs.storage\n    class: SqliteStorage\n"
    "    config:\n      base_dir: {base}\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _postgres_yaml(pg: Any) -> str:
    """A ``storage: postgres:`` block (as infra/production/dagster.yaml's) on a new database."""
    name = f"events_{next(_DATABASES)}"
    pg.create_role_and_database("bench", "bench", name)
    return (
        "storage:\n  postgres:\n    postgres_db:\n      scheme: postgresql+psycopg2\n"
        '      params:\n        options: "-c timezone=UTC"\n'
        f"      hostname: {pg.host}\n      port: {pg.port}\n      db_name: {name}\n"
        "      username: bench\n      password: bench\n"
    )


# The run's metadata: "small" (a checksum), "large" (the raw asset's before 3cc5f1b: run totals,
# offsets and a per-hour map of the run's hours, which Dagster repeats on every partition's
# event), "raw" (the raw asset's since: the same without the per-hour map).
KINDS = ("small", "large", "raw")


def _run(partitions: int, kind: str, pg: Any = None, batch: int = 0) -> float:
    os.environ["DAGSTER_EVENT_BATCH_SIZE"] = str(batch)
    try:
        return _materialize(partitions, kind, pg)
    finally:
        os.environ.pop("DAGSTER_EVENT_BATCH_SIZE", None)


def _materialize(partitions: int, kind: str, pg: Any) -> float:
    hours_def = dg.HourlyPartitionsDefinition(start_date="2026-06-01-00:00")
    hours = [
        (datetime(2026, 6, 1, tzinfo=UTC) + timedelta(hours=i)).isoformat()
        for i in range(partitions)
    ]

    @dg.asset(partitions_def=hours_def, backfill_policy=dg.BackfillPolicy.single_run())
    def hourly(context: dg.AssetExecutionContext) -> Any:
        for key in context.partition_keys:
            figures = {"read": 6000, "written": 5990, "quarantined": 10}
            context.add_asset_metadata(figures, partition_key=key)
        metadata: dict[str, Any] = {"checksum": "123"}
        if kind == "large":
            per_hour = {h: {"read": 6000, "written": 5990, "quarantined": 10} for h in hours}
            metadata["per_hour"] = dg.MetadataValue.json(per_hour)
        if kind != "small":
            metadata["offsets"] = dg.MetadataValue.json({str(p): [0, 10**6] for p in range(12)})
            metadata["run"] = dg.MetadataValue.json({f"figure_{i}": i for i in range(12)})
        return dg.MaterializeResult(metadata=metadata)

    last = hours_def.get_partition_keys()[partitions - 1]
    home = tempfile.mkdtemp(prefix="bench-partition-events-")
    if pg is None:
        storage = ""
    elif pg == PROJECT:
        storage = _PROJECT_YAML.format(base=os.path.join(home, "storage"))
    else:
        storage = _postgres_yaml(pg)
    with open(os.path.join(home, "dagster.yaml"), "w") as f:
        f.write("telemetry:\n  enabled: false\n" + storage)
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


@contextlib.contextmanager
def _postgres(wanted: bool) -> Iterator[Any]:
    if not wanted:
        yield None
        return
    from backfill_assets.stack.postgres import throwaway_server

    with throwaway_server(free_port(), prefix="bench-partition-events-pg-") as pg:
        yield pg


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hours", type=int, default=168, help="the long run's partitions")
    parser.add_argument("--postgres", action="store_true", help="also on a local Postgres 15")
    parser.add_argument(
        "--storage", action="store_true", help="also on the project's SQLite storage"
    )
    parser.add_argument("--batch", type=int, default=0, help="also with DAGSTER_EVENT_BATCH_SIZE")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    n = args.hours
    with _postgres(args.postgres) as pg:
        stores: dict[str, Any] = {"sqlite": None}
        if args.storage:
            stores[PROJECT] = PROJECT
        if pg is not None:
            stores["postgres"] = pg
        variants = [(name, batch) for name in stores for batch in sorted({0, max(args.batch, 0)})]
        for name, batch in variants:
            _run(1, "small", stores[name], batch)  # imports and first-run costs, not counted
        seconds: dict[tuple[str, int, int, str], list[float]] = {}
        for _ in range(args.repeat):
            for case in itertools.product((1, n), KINDS):
                for name, batch in variants:
                    took = _run(*case, stores[name], batch)
                    seconds.setdefault((name, batch, *case), []).append(took)
    med = {case: statistics.median(values) for case, values in seconds.items()}
    per = {variant: _report(variant, med, n) for variant in variants}
    for kind in KINDS:
        if args.storage:
            ratio = per[(PROJECT, 0)][kind] / per[("sqlite", 0)][kind]
            print(f"per partition, project / stock SQLite ({kind} metadata): {ratio:.2f}x")
        if args.postgres:
            ratio = per[("postgres", 0)][kind] / per[("sqlite", 0)][kind]
            print(f"per partition, Postgres / SQLite ({kind} metadata): {ratio:.2f}x")
        if args.batch > 0:
            for name in stores:
                ratio = per[(name, args.batch)][kind] / per[(name, 0)][kind]
                print(f"per partition, {name} batched / unbatched ({kind}): {ratio:.2f}x")
    if args.storage:
        # The project's storage batches as dagster.yaml runs it (EVENT_BATCH_SIZE) when --batch.
        batch = max(args.batch, 0)
        now, before = med[(PROJECT, batch, n, "raw")], med[("sqlite", 0, n, "large")]
        print(
            f"a {n}-partition run, the project's storage (DAGSTER_EVENT_BATCH_SIZE={batch}) and "
            f"raw metadata against the stock storage unbatched and the large metadata: "
            f"{now:.2f} / {before:.2f} s = {now / before:.2f}x"
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


def _report(
    variant: tuple[str, int], med: dict[tuple[str, int, int, str], float], n: int
) -> dict[str, float]:
    """Print one variant's medians; its cost per partition beyond the first, by metadata."""
    name, batch = variant
    print(f"{name}, DAGSTER_EVENT_BATCH_SIZE={batch}:")
    per: dict[str, float] = {}
    for kind in KINDS:
        for size in (1, n):
            print(
                f"  {size:>3} partition(s), {kind} metadata: {med[(name, batch, size, kind)]:.2f} s"
            )
        per[kind] = (med[(name, batch, n, kind)] - med[(name, batch, 1, kind)]) / (n - 1) * 1000
        print(f"  per partition beyond the first ({kind}): {per[kind]:.1f} ms")
    return per


if __name__ == "__main__":
    main()
