"""The project's wheel, built as a user's pip builds it, from what git tracks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from backfill_assets.stack.settings import REPO_ROOT


def build_wheel(out: Path, src: Path) -> Path:
    """Build the wheel into ``out`` from a copy (in ``src``) of the files git tracks
    (setuptools writes build/ beside the sources); pip with build isolation, so setuptools
    comes from PyPI."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "pyproject.toml", "README.md", "LICENSE", "backfill_assets"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("backfill_assets-*.whl")
    return built
