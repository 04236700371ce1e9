"""No function or method in the package is longer than ~80 lines (issue 29): long ones are
split into named helpers. Ruff's max-branches and max-statements (pyproject.toml) back this."""

from __future__ import annotations

import ast
from pathlib import Path

import backfill_assets

MAX_LINES = 80
PACKAGE = Path(backfill_assets.__file__).parent


def test_no_function_over_max_lines() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            # The whole definition, docstring included (decorators excluded).
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                where = path.relative_to(PACKAGE.parent)
                offenders.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    assert not offenders, f"functions over {MAX_LINES} lines: " + "; ".join(offenders)
