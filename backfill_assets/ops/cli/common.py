"""What the commands share: ``--json`` and the settings (:func:`with_ui`), the topic and range
options, the parsing of hours, durations and table names, and the spec and Kafka look-ups."""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import dagster as dg
import yaml

from backfill_assets.errors import ArgumentError
from backfill_assets.ops.cli.output import Ui
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import Settings

if TYPE_CHECKING:
    from backfill_assets.stack.kafka import KafkaClient

PARTITION_FMT = "%Y-%m-%d-%H:%M"  # Dagster's hourly partition keys


class Exit(enum.IntEnum):
    """The exit statuses of every command (listed in ``backfill-assets --help`` and README)."""

    OK = 0
    NOT_OK = 1  # the command's own answer is no: a red plan, gaps due, a silent broker
    USAGE = 2  # wrong arguments or settings (click's own status for wrong arguments)
    UNAVAILABLE = 3  # Kafka, the local stack, the catalog or the webserver did not answer
    FAILED = 4  # a check or a guard refused, or a run, a backfill or a step failed
    UNEXPECTED = 5  # an error the project does not anticipate (a bug): one line; --debug shows it
    INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report a process it stopped


def with_ui(fn: Callable[..., int]) -> Callable[..., int]:
    """Give a command ``--json``, a :class:`Ui` and the settings. In --json mode anything
    printed to stdout while the command runs goes to stderr, so stdout holds one document."""

    @functools.wraps(fn)
    def run(*args: Any, as_json: bool, **kwargs: Any) -> int:
        ui = Ui(as_json)
        settings = Settings.from_env()
        if not as_json:
            return fn(ui, settings, *args, **kwargs)
        with contextlib.redirect_stdout(sys.stderr):
            return fn(ui, settings, *args, **kwargs)

    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print one JSON document on stdout and nothing else (progress goes to stderr).",
    )(run)


def topic_option(fn: Callable[..., int]) -> Callable[..., int]:
    return click.option("--topic", default="orders", show_default=True, help="topic in the spec")(
        fn
    )


def range_options(fn: Callable[..., int]) -> Callable[..., int]:
    """``--topic`` and the range: ``--start`` and ``--end``, or ``--last`` (resolved here, so
    the command gets ``start`` and ``end`` either way)."""

    @functools.wraps(fn)
    def resolved(
        *args: Any, start: str | None, end: str | None, last: str | None, **kw: Any
    ) -> int:
        start, end = resolve_range(start, end, last)
        return fn(*args, start=start, end=end, **kw)

    wrapped: Callable[..., int] = resolved
    wrapped = click.option(
        "--last",
        help="instead of --start/--end: the hours that ended last, e.g. 6h or 2d (up to the "
        "last hour that ended at least BACKFILL_SEAL_GRACE_S ago)",
    )(wrapped)
    wrapped = click.option(
        "--end", help="end hour, ISO-8601 UTC (exclusive), e.g. 2026-06-01T05:00Z"
    )(wrapped)
    wrapped = click.option(
        "--start", help="first hour, ISO-8601 UTC (inclusive), e.g. 2026-06-01T01:00Z"
    )(wrapped)
    return topic_option(wrapped)


def resolve_range(
    start: str | None, end: str | None, last: str | None, now: datetime | None = None
) -> tuple[str, str]:
    """``--start``/``--end`` as given, or the ``--last`` hours that ended: up to the start of
    the current hour, or of the one before while the seal grace of the last one runs (an idle
    hour is sealed only then)."""
    if last is None:
        if start is None or end is None:
            raise ArgumentError("give --start and --end, or --last (e.g. --last 6h)")
        return start, end
    if start is not None or end is not None:
        raise ArgumentError("--last replaces --start and --end; give one or the other")
    span = parse_duration(last, "--last")
    if span < timedelta(hours=1) or span % timedelta(hours=1):
        raise ArgumentError(f"--last {last!r} must be whole hours, e.g. 6h or 2d")
    now = now or datetime.now(UTC)
    stop = now.replace(minute=0, second=0, microsecond=0)
    if now - stop < timedelta(seconds=Settings.from_env().seal_grace_s):
        stop -= timedelta(hours=1)
    return (stop - span).isoformat(), stop.isoformat()


# -- the spec, Kafka -------------------------------------------------------------------------


def specs() -> dict[str, TopicSpec]:
    """The topics of the spec Definitions load (read without building the Definitions)."""
    from backfill_assets.spec.loader import load_specs

    return {s.topic: s for s in load_specs()}


def spec(topic: str) -> TopicSpec:
    """The spec of the Kafka topic ``topic`` (or of the topic whose identifier it is)."""
    found = specs()
    if topic in found:
        return found[topic]
    named = [s for s in found.values() if s.name == topic]
    if named:
        return named[0]
    raise ArgumentError(f"unknown topic {topic!r}; topics.yaml has: {', '.join(found)}")


def kafka() -> KafkaClient:
    """The Kafka client the commands use (one place, so tests can shorten its timeout)."""
    from backfill_assets.stack.kafka import KafkaClient

    return KafkaClient()


def ranges(
    topic_spec: TopicSpec, start: datetime, end: datetime
) -> list[tuple[list[dg.AssetKey], datetime, datetime]]:
    """What a backfill of [start, end) materializes (:func:`planner.backfill_ranges`)."""
    from backfill_assets.ops.planner import backfill_ranges

    return backfill_ranges(topic_spec, start, end)


# -- arguments -------------------------------------------------------------------------------


def topic_range(topic: str, start: str, end: str) -> tuple[TopicSpec, datetime, datetime]:
    first, stop = parse_hour(start, "--start"), parse_hour(end, "--end")
    found = spec(topic)
    if stop <= first:
        raise ArgumentError("--end must be after --start (the range is [start, end))")
    if first < found.partition_start:
        raise ArgumentError(
            f"--start {first.isoformat()} is before the first partition of {topic!r} "
            f"({found.partition_start.isoformat()})"
        )
    if stop > datetime.now(UTC).replace(minute=0, second=0, microsecond=0):
        raise ArgumentError(
            f"--end {stop.isoformat()} is in an hour that has not closed yet; "
            "backfill only hours that have ended"
        )
    return found, first, stop


def hours(first: datetime, stop: datetime) -> int:
    return int((stop - first) / timedelta(hours=1))


def backfill_concurrency() -> int:
    """The run-queue limit for backfill runs, from the instance's dagster.yaml."""
    home = os.environ.get("DAGSTER_HOME")
    path = Path(home) / "dagster.yaml" if home else None
    if path is None or not path.is_file():
        return 1
    doc = yaml.safe_load(path.read_text()) or {}
    limits = doc.get("concurrency", {}).get("runs", {}).get("tag_concurrency_limits", [])
    for limit in limits:
        if limit.get("key") == "dagster/backfill":
            return int(limit.get("limit", 1))
    return int(doc.get("concurrency", {}).get("runs", {}).get("max_concurrent_runs", 1))


def parse_duration(text: str, flag: str = "--window") -> timedelta:
    units = {"m": 60, "h": 3600, "d": 86400}
    if len(text) < 2 or text[-1] not in units or not text[:-1].isdigit():
        raise ArgumentError(f"{flag} {text!r} is not a duration; use e.g. 90m, 6h or 2d")
    return timedelta(seconds=int(text[:-1]) * units[text[-1]])


def parse_hour(text: str, flag: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ArgumentError(
            f"{flag} {text!r} is not an ISO-8601 time; use e.g. 2026-01-01T00:00:00+00:00"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    if value.minute or value.second or value.microsecond:
        raise ArgumentError(f"{flag} {text!r} must be on a whole hour, e.g. 2026-01-01T05:00Z")
    return value.astimezone(UTC)
