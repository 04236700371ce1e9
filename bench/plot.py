"""Plot bench/figures.csv: one panel per goal, its ratios over the passes, the goal as a line.

The figures are those the passes of bench/HISTORY.md state (one row each, with its command);
this script only draws them. Needs matplotlib (the ``bench`` extra, or
``.venv/bin/pip install matplotlib``).
    .venv/bin/python bench/plot.py                 # writes bench/ratios.png
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Goals where more is better (a ratio at or above the line meets it); the rest are ceilings.
AT_LEAST = {"exactness tax", "throughput vs bare Spark"}
# Comparisons without a goal: the line marks parity.
PARITY = {
    "Iceberg Kafka Connect sink",
    "Dagster events on Postgres",
    "Dagster events on SQLite",
    "hour writer",
}


def load(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def passes(rows: list[dict[str, str]]) -> list[str]:
    """Every (date, pass) once, in the order of the file (oldest first)."""
    seen: dict[str, None] = {}
    for row in sorted(rows, key=lambda r: r["date"]):
        seen.setdefault(f"{row['date'][5:]} {row['pass']}", None)
    return list(seen)


def plot(rows: list[dict[str, str]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {label: i for i, label in enumerate(passes(rows))}
    goals: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    targets: dict[str, float] = {}
    for row in rows:
        x = order[f"{row['date'][5:]} {row['pass']}"]
        goals[row["goal"]][row["metric"]].append((x, float(row["ratio"])))
        targets[row["goal"]] = float(row["target"])
    cols = 3
    lines = -(-len(goals) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(13, 2.4 * lines + 1), sharex=True, squeeze=False)
    for ax, (goal, series) in zip(axes.flat, goals.items(), strict=False):
        for metric, points in series.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=metric)
        sense = ">=" if goal in AT_LEAST else "<="
        ax.axhline(targets[goal], color="grey", linestyle="--", linewidth=0.8)
        said = "line: parity, no goal" if goal in PARITY else f"goal {sense} {targets[goal]:g}"
        ax.set_title(f"{goal} ({said})", fontsize=9)
        ax.tick_params(labelsize=7)
        if len(series) > 1:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(goals) :]:
        ax.axis("off")
    for ax in axes[-1]:  # the pass names under the bottom row (the x axes are shared)
        ax.set_xticks(range(len(order)), list(order), rotation=70, ha="right", fontsize=6)
        ax.tick_params(axis="x", labelbottom=True)
    fig.suptitle("bench/figures.csv: ratios over the passes (dashed: the goal)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=72)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--figures", type=Path, default=HERE / "figures.csv")
    parser.add_argument("--out", type=Path, default=HERE / "ratios.png")
    args = parser.parse_args()
    plot(load(args.figures), args.out)
    print(f"{args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
