"""The CLI's edges: Ctrl-C exits 130 and an unexpected error 5, each with one line on stderr
(``--debug`` shows the traceback). Cheap: in-process or one small subprocess, no Spark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import click
import pytest

from backfill_assets.ops import cli
from backfill_assets.ops.cli.common import Exit
from backfill_assets.stack.settings import REPO_ROOT


@click.command("boom")
@click.option("--raise", "what", type=click.Choice(["error", "interrupt"]), default="error")
def _boom(what: str) -> int:
    if what == "interrupt":
        raise KeyboardInterrupt
    raise RuntimeError("the disk is on fire\nand a second line")


@pytest.fixture
def boom(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``boom`` command that fails the way no code anticipates."""
    monkeypatch.setitem(cli.cli.commands, "boom", _boom)


@pytest.mark.usefixtures("boom")
def test_an_unexpected_error_is_one_line_and_exit_5(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["boom"]) == Exit.UNEXPECTED
    assert int(Exit.UNEXPECTED) == 5
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "error: unexpected error: RuntimeError: the disk is on fire ...; "
        "re-run with --debug for the traceback\n"
    )


@pytest.mark.usefixtures("boom")
def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--debug", "boom"]) == Exit.UNEXPECTED
    _, err = capsys.readouterr()
    assert err.startswith("Traceback (most recent call last):")
    assert "RuntimeError: the disk is on fire\nand a second line" in err
    assert err.endswith("error: unexpected error: RuntimeError: the disk is on fire ...\n")


def test_debug_is_a_global_option_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out, _ = capsys.readouterr()
    assert "--debug" in out
    assert "5  an unexpected error" in out and "130  interrupted (Ctrl-C)" in out


@pytest.mark.usefixtures("boom")
def test_a_keyboard_interrupt_in_a_command_exits_130(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["boom", "--raise", "interrupt"]) == Exit.INTERRUPTED
    assert int(Exit.INTERRUPTED) == 130
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == "interrupted (Ctrl-C)"


def test_ctrl_c_exits_130(tmp_path: Path) -> None:
    """A real SIGINT to a command that is waiting."""
    ready = tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import sys, time
        import click
        from backfill_assets.ops import cli

        @click.command("wait")
        def wait() -> int:
            open({str(ready)!r}, "w").close()
            time.sleep(60)
            return 0

        cli.cli.add_command(wait)
        sys.exit(cli.main(["wait"]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert out == b""
    assert err.decode().strip() == "interrupted (Ctrl-C)"
