"""Micro-benchmark: the independent decode behind ``decoded_content``, per record, in Python.

Generates ``--hours`` x ``--events-per-hour`` orders records (the demo generator's planned
records: valid, malformed, tombstones, both schema versions) and times
:class:`backfill_assets.lake.content.RecordDecoder` over them (best of ``--repeat``, in this
thread's CPU time, which the machine's load inflates less than the wall time also shown), with
the byte hash of the window scan (:func:`backfill_assets.lake.windows.record_hash`) as baseline,
the sample predicate (:func:`backfill_assets.lake.content.in_sample`) and the scan's decode of
a large window (1 record in K decoded) per record of the window. No Kafka, no
Spark. Prints the load average: these machines are shared.

Run from the repository root:
    .venv/bin/python bench/decode.py
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=int, default=4)
    parser.add_argument("--events-per-hour", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    from backfill_assets.demo.generator import GeneratorConfig, plan_events
    from backfill_assets.lake import content, windows
    from backfill_assets.spec.loader import load_specs

    planned = plan_events(
        GeneratorConfig(
            start=datetime(2026, 9, 1, tzinfo=UTC),
            hours=args.hours,
            events_per_hour=args.events_per_hour,
        )
    )
    records = [(r.partition, i, r.key, r.value) for i, r in enumerate(planned)]
    (spec,) = [s for s in load_specs() if s.topic == "orders"]
    decode = content.RecordDecoder(spec)
    n = len(records)

    def timed(label: str, fn: Callable[[int, int, bytes | None, bytes | None], object]) -> float:
        best = best_wall = float("inf")
        for _ in range(args.repeat):
            began, began_wall = time.thread_time(), time.perf_counter()
            for p, o, k, v in records:
                fn(p, o, k, v)
            best = min(best, time.thread_time() - began)
            best_wall = min(best_wall, time.perf_counter() - began_wall)
        print(
            f"  {label:<40} {best * 1e6 / n:8.2f} us/record CPU ({best_wall * 1e6 / n:.2f} wall)",
            flush=True,
        )
        return best

    print(f"{n:,} records, best of {args.repeat}, load average {os.getloadavg()[0]:.1f}:")
    base = timed("record_hash (the scan's byte hash)", windows.record_hash)
    cell = windows.Cell(0, 0)
    timed("the scan's count (Cell.add, with the hash)", lambda p, o, k, v: cell.add(o, k, v, p))
    whole = timed("RecordDecoder (decode + content hash)", decode)
    timed("in_sample(p, o, 16)", lambda p, o, k, v: content.in_sample(p, o, 16))
    for k in (16, 8):
        sampled = windows._Decoding(decode, k, 0)  # a "large" window: only the sample
        timed(
            f"the scan's count and decode, 1 in {k}",
            lambda p, o, key, v, d=sampled: d.add(cell, p, o, key, v, cell.add(o, key, v, p)),
        )
    print(f"  decode / byte hash: {whole / base:.1f}x; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
