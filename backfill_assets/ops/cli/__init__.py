"""``backfill-assets``: the operator's command line (click for arguments, rich for output).

Every failure the project anticipates (a :class:`~backfill_assets.errors.BackfillError`, or a
``dg.Failure`` raised by the Kafka resource) prints ``error: <message>`` on stderr, saying what
to run next, and exits with status 2; so do wrong arguments (click's usage message names what is
allowed). ``--json`` on every command prints exactly one JSON document on stdout and nothing
else there; progress bars and notes always go to stderr (:mod:`.output`).

This package holds the root group and :func:`main`; the commands are in one module per group
(:mod:`.stack`, :mod:`.backfill`, :mod:`.rollback`, :mod:`.upkeep`), what they share in
:mod:`.common` and all rendering in :mod:`.output`. All click and rich code of the project is in
this package; the library reports progress through plain callbacks.
"""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import IO, Any

import click
import dagster as dg

from backfill_assets.errors import BackfillError
from backfill_assets.ops.cli import backfill, rollback, stack, upkeep
from backfill_assets.ops.cli.output import Ui

__all__ = ["AnticipatedError", "Ui", "cli", "main"]


class AnticipatedError(click.ClickException):
    """A BackfillError or a Kafka resource failure: ``error: <message>``, exit status 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _message(exc: BaseException) -> str:
    if isinstance(exc, dg.Failure) and exc.description:
        return exc.description
    return str(exc)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (BackfillError, dg.Failure) as exc:
            raise AnticipatedError(_message(exc)) from None


def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``version``)."""
    try:
        return metadata.version("backfill_assets")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: `pip install -e .`)"


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(
    _version(), "--version", prog_name="backfill-assets", message="%(prog)s %(version)s"
)
def cli() -> None:
    """Safe Kafka -> Iceberg backfills with Dagster."""


for _command in (
    stack.jars_command,
    stack.kafka_command,
    stack.catalog_command,
    stack.stack_command,
    stack.generate_command,
    backfill.materialize_command,
    upkeep.archive_command,
    upkeep.maintain_command,
    backfill.plan_command,
    backfill.backfill_command,
    rollback.audit_command,
    rollback.rollback_command,
    upkeep.gaps_command,
):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> int:
    """The console script: run one command, return its exit status (2: anticipated failure or
    wrong arguments; 1: the command's own "not OK", e.g. a red plan or a failed backfill)."""
    # Dagster flags beta parameters (backfill_policy) on every load; operators need not see it.
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    warnings.filterwarnings("ignore", category=dg.PreviewWarning)
    try:
        result = cli.main(args=argv, prog_name="backfill-assets", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        return 1
    return int(result or 0)
