"""``backfill-assets``: the operator's command line (click for arguments, rich for output).

Every failure the project anticipates (a :class:`~backfill_assets.errors.BackfillError`)
prints ``error: <message>`` on stderr, saying what to run next, and exits with the status of
its ``kind`` (:class:`~.common.Exit`): 2 wrong arguments or settings (as click's usage errors),
3 a service unavailable, 4 refused or failed. Anything else is a bug or a failure nobody
anticipated: one line naming it and exit 5 (the traceback with ``--debug``); Ctrl-C exits 130.
``--json`` on every command prints exactly one JSON document on stdout and nothing else there;
progress bars and notes always go to stderr (:mod:`.output`).

This package holds the root group and :func:`main`; the commands are in one module per group
(:mod:`.stack`, :mod:`.backfill`, :mod:`.rollback`, :mod:`.upkeep`, :mod:`.adopt`,
:mod:`.accept`, :mod:`.quarantine`, :mod:`.columns`, :mod:`.settings`), what they share in
:mod:`.common` and all rendering in :mod:`.output`. All click and rich code of the project is
in this package; the library reports progress through plain callbacks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import click
import dagster as dg

from backfill_assets.errors import BackfillError, ErrorKind
from backfill_assets.ops.cli import (
    accept,
    adopt,
    backfill,
    columns,
    quarantine,
    rollback,
    settings,
    stack,
    upkeep,
)
from backfill_assets.ops.cli.common import Exit
from backfill_assets.ops.cli.output import Ui
from backfill_assets.stack.catalog import refusal
from backfill_assets.stack.settings import REPO_ROOT, Settings, env_file_values

__all__ = ["AnticipatedError", "Exit", "Ui", "cli", "main"]


class AnticipatedError(click.ClickException):
    """A BackfillError: ``error: <message>`` and exit status 4 (refused or failed); its
    subclasses exit 2 and 3."""

    exit_code = Exit.FAILED

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class _WrongArgument(AnticipatedError):
    exit_code = Exit.USAGE


class _Unavailable(AnticipatedError):
    exit_code = Exit.UNAVAILABLE


ERRORS: dict[ErrorKind, type[AnticipatedError]] = {
    "usage": _WrongArgument,
    "unavailable": _Unavailable,
    "failed": AnticipatedError,
}


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BackfillError as exc:
            raise ERRORS[exc.kind](str(exc)) from None
        except Exception as exc:
            refused = _catalog_refusal(exc)
            if refused is None:
                raise
            raise ERRORS[refused.kind](str(refused)) from None


def _catalog_refusal(exc: Exception) -> BackfillError | None:
    """The one line for a REST catalog that refused our credentials, met in Spark's JVM (whose
    error is a Java traceback) or pyiceberg; None for any other error or unreadable settings."""
    try:
        return refusal(Settings.from_env().catalog, exc)
    except BackfillError:
        return None


def dagster_home_dirs() -> tuple[Path, ...]:
    """Where the CLI looks for a dagster.yaml when DAGSTER_HOME is unset: the current directory,
    then the repository the package runs from (tests replace this to keep it out)."""
    return (Path.cwd(), REPO_ROOT)


def dagster_home_defaults(
    environ: Mapping[str, str], search: tuple[Path, ...] | None = None
) -> dict[str, str]:
    """DAGSTER_HOME and BACKFILL_DAGSTER_STORAGE for a command run from the repository, as
    scripts/demo.sh sets them: when DAGSTER_HOME is unset, the first directory of ``search``
    (:func:`dagster_home_dirs`) that has a dagster.yaml, and, unless BACKFILL_DAGSTER_STORAGE is
    set, ``${BACKFILL_HOME:-<that directory>/.stack}/dagster``. Nothing when DAGSTER_HOME is
    set or no dagster.yaml is found."""
    if environ.get("DAGSTER_HOME"):
        return {}
    dirs = dagster_home_dirs() if search is None else search
    home = next((d.resolve() for d in dirs if (d / "dagster.yaml").is_file()), None)
    if home is None:
        return {}
    found = {"DAGSTER_HOME": str(home)}
    if not environ.get("BACKFILL_DAGSTER_STORAGE"):
        state = Path(environ.get("BACKFILL_HOME") or home / ".stack").resolve()
        found["BACKFILL_DAGSTER_STORAGE"] = str(state / "dagster")
    return found


@contextlib.contextmanager
def _env_file() -> Iterator[frozenset[str]]:
    """The current directory's ``.env`` in ``os.environ`` while a command runs, its values
    winning over the environment, as Dagster's webserver, daemon and code servers load it (so a
    command and the code location started from the same directory read the same settings);
    then as before. Yields the names it set."""
    values = env_file_values()
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield frozenset(values)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _dagster_home() -> Iterator[frozenset[str]]:
    """:func:`dagster_home_defaults` in ``os.environ`` while a command runs, then as before;
    yields the names of the variables it set."""
    defaults = dagster_home_defaults(os.environ)
    os.environ.update(defaults)
    try:
        yield frozenset(defaults)
    finally:
        for name in defaults:
            os.environ.pop(name, None)


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
@click.option(
    "--debug",
    is_flag=True,
    help="Show the traceback of an unexpected error (exit status 5) instead of one line.",
)
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Safe Kafka -> Iceberg backfills with Dagster.

    Settings are read from a .env file in the current directory, whose values win as in
    Dagster's webserver, daemon and code servers, then the environment, then the TOML file
    BACKFILL_SETTINGS_FILE names (`backfill-assets settings` shows each one's source). The
    Dagster instance is $DAGSTER_HOME's; when it is unset, the current directory's or else the
    repository's dagster.yaml, with its storage in $BACKFILL_HOME/dagster (.stack/dagster).

    \b
    Exit status:
      0  done
      1  the command's answer is no: a red score in `plan`, gaps due in `gaps`, a broker that
         does not answer `kafka status`, a component down in `stack status`
      2  wrong arguments or settings; the message says what is allowed
      3  a service is unavailable: Kafka, the local stack, the catalog or the webserver did
         not answer; run again once it is back
      4  refused or failed: a check or a guard refused (e.g. a rollback that would discard
         later publishes, or `gaps` of a topic deleted and recreated that awaits `adopt`),
         or a run, a backfill or a maintenance step failed
      5  an unexpected error (a bug): one line names it; --debug shows the traceback
      130  interrupted (Ctrl-C)
    """
    ctx.meta[settings.ENV_FILE_SET] = ctx.with_resource(_env_file())
    ctx.meta[settings.CLI_SET] = ctx.with_resource(_dagster_home())


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
    upkeep.report_empty_command,
    adopt.adopt_command,
    accept.accept_command,
    quarantine.quarantine_command,
    columns.columns_command,
    settings.settings_command,
):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> int:
    """The console script: run one command, return its exit status (:class:`~.common.Exit`)."""
    # Dagster flags beta parameters (backfill_policy) on every load; operators need not see it.
    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    warnings.filterwarnings("ignore", category=dg.PreviewWarning)
    args = sys.argv[1:] if argv is None else argv
    try:
        result = cli.main(args=args, prog_name="backfill-assets", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort as exc:
        # click turns Ctrl-C (KeyboardInterrupt) anywhere in a command into Abort.
        if isinstance(exc.__cause__, KeyboardInterrupt):
            return _interrupted()
        click.echo("aborted", err=True)
        return Exit.NOT_OK
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as exc:  # the one place an error no code anticipated is reported
        return unexpected(exc, debug=_debug(args))
    return int(result or 0)


def _interrupted() -> int:
    click.echo("interrupted (Ctrl-C)", err=True)
    return Exit.INTERRUPTED


def _debug(args: list[str]) -> bool:
    """Whether ``--debug`` is among the root group's options (the arguments before the
    command's name; the group's options take no values)."""
    return "--debug" in itertools.takewhile(lambda arg: arg.startswith("-"), args)


def unexpected(exc: BaseException, *, debug: bool) -> int:
    """Report an error no code anticipated: its traceback with ``--debug``, then one line
    naming it (its type and the first line of its message); exit status 5."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    lines = str(exc).strip().splitlines()
    name = type(exc).__name__ + (f": {lines[0]}" if lines else "") + (" ..." if lines[1:] else "")
    hint = "" if debug else "; re-run with --debug for the traceback"
    click.echo(f"error: unexpected error: {name}{hint}", err=True)
    return Exit.UNEXPECTED
