"""The CLI's rendering: text and tables for people, or one JSON document for machines, behind
one interface (:class:`Ui`); progress bars, spinners and notes on stderr in both modes.

All rich code of the project is in this module. Without a terminal rich prints plain text: no
colours, no live bars, no line wrapping.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

__all__ = ["Table", "Ui", "row", "table"]


def _console(stream: IO[str]) -> Console:
    """A rich console on ``stream``; when it is not a terminal: plain text, no wrapping at 80."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    width = None if tty else int(os.environ.get("COLUMNS") or 0) or 200
    return Console(file=stream, width=width, highlight=False, emoji=False)


class Ui:
    """Where one command's output goes: rich text and tables on stdout for people, or one JSON
    document on stdout for machines (``--json``); progress and notes on stderr in both modes."""

    def __init__(self, as_json: bool) -> None:
        self.json = as_json
        self.stdout = sys.stdout
        self.out = _console(sys.stdout)
        self.err = _console(sys.stderr)

    def line(self, text: str = "") -> None:
        """A line of the human report (nothing in --json mode)."""
        if not self.json:
            self.out.print(text, markup=False, highlight=False, soft_wrap=True)

    def table(self, table: Table) -> None:
        if not self.json:
            self.out.print(table)

    def note(self, text: str) -> None:
        """A warning or a progress line for people: stderr, in every mode."""
        self.err.print(text, markup=False, highlight=False, soft_wrap=True)

    def emit(self, doc: Any) -> None:
        """The one JSON document of --json mode (nothing otherwise)."""
        if self.json:
            self.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
            self.stdout.flush()

    @contextlib.contextmanager
    def progress(
        self, description: str, total: float | None, unit: str
    ) -> Iterator[Callable[[float, float | None], None]]:
        """A live bar on stderr (done/total, rate per second, elapsed, ETA) while the block
        runs, if stderr is a terminal; yields ``update(completed, total)``. Off otherwise."""
        if not self.err.is_terminal:

            def ignore(completed: float, new_total: float | None = None) -> None:
                pass

            yield ignore
            return
        with _bar(self.err, _Rate(unit)) as bar:
            task = bar.add_task(description, total=total, detail="")

            def update(completed: float, new_total: float | None = None) -> None:
                bar.update(task, completed=completed, total=new_total or total)

            yield update

    @contextlib.contextmanager
    def tracker(self, description: str, unit: str) -> Iterator[Callable[[int, int, str], None]]:
        """A live bar on stderr for work whose total is learnt on the way (terminal only: check
        ``err.is_terminal`` first); yields ``update(completed, total, detail)``."""
        with _bar(self.err, TextColumn(unit)) as bar:
            task = bar.add_task(description, total=None, detail="")

            def update(completed: int, total: int, detail: str) -> None:
                bar.update(task, total=total or None, completed=completed, detail=detail)

            yield update

    @contextlib.contextmanager
    def spinner(self, text: str) -> Iterator[None]:
        """A spinner on stderr for work without a known total (terminal only)."""
        if not self.err.is_terminal:
            yield
            return
        with self.err.status(text):
            yield


def _bar(console: Console, rate: ProgressColumn) -> Progress:
    """Description, bar, done/total, ``rate``, elapsed, ETA and a detail field."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        rate,
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
    )


class _Rate(ProgressColumn):
    """Completed units per second, e.g. ``812.5 records/s``."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-" if speed is None else f"{speed:,.1f} {self.unit}/s")


def table(*columns: str, title: str | None = None) -> Table:
    """A table whose cells never lose characters (ids must stay copyable): long cells fold."""
    out = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name in columns:
        out.add_column(name, overflow="fold")
    return out


def row(table: Table, *cells: object) -> None:
    """Add a row of plain text: no rich markup is interpreted in data (``[a, b)`` stays)."""
    table.add_row(*(Text("-" if c is None else str(c)) for c in cells))
