"""The CLI's edges: Ctrl-C exits 130 and an unexpected error 5, each with one line on stderr
(``--debug`` shows the traceback); ``stack status`` exits 1 when a component it expects is
down. Cheap: in-process or one small subprocess, no Spark, no broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import click
import pytest

from backfill_assets.ops import cli
from backfill_assets.ops.cli import stack
from backfill_assets.ops.cli.common import Exit
from backfill_assets.stack.broker import BrokerStatus, LocalBroker
from backfill_assets.stack.connect import ConnectStatus, LocalConnectServer
from backfill_assets.stack.registry import RegistryStatus
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


# -- stack status ----------------------------------------------------------------------------


@pytest.fixture
def empty_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A BACKFILL_HOME where nothing runs, with the local registry (not an external one)."""
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path))
    monkeypatch.delenv("BACKFILL_SCHEMA_REGISTRY_URL", raising=False)
    return tmp_path


@pytest.mark.usefixtures("empty_home")
def test_stack_status_exits_1_naming_what_is_down(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["stack", "status"]) == Exit.NOT_OK
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split(" url=")[0].split(" bootstrap=")[0] for line in lines] == [
        "broker stopped",
        "schema registry stopped",
        "spark connect stopped",
    ]
    assert (
        err
        == "down: broker, schema registry, spark connect (start it: `backfill-assets stack up`)\n"
    )


@pytest.mark.usefixtures("empty_home")
def test_stack_status_json_lists_what_is_down(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["stack", "status", "--cdc", "--json"]) == Exit.NOT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["down"] == [
        "broker",
        "schema registry",
        "spark connect",
        "cdc postgres",
        "kafka connect",
    ]


def test_stack_status_exits_0_when_every_expected_component_answers(
    empty_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broker(self: LocalBroker) -> BrokerStatus:
        return BrokerStatus(pid=1, running=True, responding=True, bootstrap_servers="b:1")

    def server(self: LocalConnectServer, timeout_s: float = 10.0) -> ConnectStatus:
        return ConnectStatus(pid=2, running=True, responding=True, url="sc://h:1")

    def registry(settings: Any, *, start: bool) -> RegistryStatus:
        return RegistryStatus(pid=3, running=True, ready=True, url="http://h:2")

    monkeypatch.setattr(LocalBroker, "status", broker)
    monkeypatch.setattr(LocalConnectServer, "status", server)
    monkeypatch.setattr(stack, "_registry", registry)
    assert cli.main(["stack", "status"]) == Exit.OK
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 3 and err == ""
    # The CDC source is expected only when asked for (--cdc); here it does not run.
    assert cli.main(["stack", "status", "--cdc"]) == Exit.NOT_OK
    assert capsys.readouterr().err.startswith("down: cdc postgres, kafka connect")


def test_an_external_registry_that_does_not_answer_is_down(
    empty_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BACKFILL_SCHEMA_REGISTRY_URL", "http://127.0.0.1:9/apis/ccompat/v7")
    assert cli.main(["stack", "status"]) == Exit.NOT_OK
    out, err = capsys.readouterr()
    assert "schema registry (BACKFILL_SCHEMA_REGISTRY_URL) NOT answering" in out
    assert "schema registry" in err
