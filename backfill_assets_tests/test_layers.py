"""The package's layers: stack -> spec -> lake -> defs -> ops, and no import runs back up.

Read from the source with ``ast`` (every import counts: module level, inside functions and
under ``TYPE_CHECKING``), so a new upward import fails here before anyone runs the code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "backfill_assets"
# Lower number = lower layer. errors.py is shared by every layer. demo/ is a side room: the
# demo producer may use the machinery and the spec, and only ops/ (the CLI) starts it.
LAYERS = {"errors": 0, "stack": 0, "spec": 1, "lake": 2, "demo": 2, "defs": 3, "ops": 4}
NO_DAGSTER = ("stack", "spec", "lake", "demo")
# lake/'s rooms, lowest first: a room imports only rooms below it (write and coverage are
# side by side and do not import each other).
LAKE_ROOMS = {"decode": 0, "offsets": 1, "write": 2, "coverage": 2, "operations": 3}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in ``path``, relative ones resolved."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    return _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:  # `from backfill_assets.lake import ledger`
                yield node.lineno, f"{base}.{alias.name}"


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_sits_in_a_known_layer() -> None:
    layers = {_layer(_module(p)) for p in _sources()} - {""}
    assert layers <= set(LAYERS), f"modules outside the known layers: {layers - set(LAYERS)}"


def test_no_import_runs_back_up() -> None:
    upward = []
    for path in _sources():
        here = _layer(_module(path))
        if here not in LAYERS:
            continue
        for line, target in _imports(path):
            if not target.startswith("backfill_assets."):
                continue
            there = _layer(target)
            if there in LAYERS and LAYERS[there] > LAYERS[here]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not upward, "imports that run back up a layer:\n" + "\n".join(sorted(set(upward)))


def _lake_room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "lake" else ""


def test_every_lake_module_sits_in_a_room() -> None:
    loose = [
        _module(p)
        for p in _sources()
        if _layer(_module(p)) == "lake" and _module(p) != "backfill_assets.lake"
        if _lake_room(_module(p)) not in LAKE_ROOMS
    ]
    assert not loose, f"lake modules outside its rooms {sorted(LAKE_ROOMS)}: {loose}"


def test_no_import_runs_back_up_between_lake_rooms() -> None:
    wrong = []
    for path in _sources():
        here = _lake_room(_module(path))
        if here not in LAKE_ROOMS:
            continue
        for line, target in _imports(path):
            there = _lake_room(target)
            if there in LAKE_ROOMS and there != here and LAKE_ROOMS[there] >= LAKE_ROOMS[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not wrong, "lake imports that run up or across a room:\n" + "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("layer", NO_DAGSTER)
def test_lower_layers_do_not_import_dagster(layer: str) -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for path in _sources()
        if _layer(_module(path)) == layer
        for line, target in _imports(path)
        if target.split(".")[0] in ("dagster", "dagster_pyspark")
    ]
    assert not found, "\n".join(found)


def test_no_import_circles() -> None:
    modules = {_module(p): p for p in _sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {
            target
            for _, target in _imports(path)
            if target in modules and target != name and modules[target].name != "__init__.py"
        }
    circles = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checker_sees_an_upward_import() -> None:
    """The parser resolves what these tests judge: a relative import, a name import and one
    inside a function."""
    source = "from ..defs import resources\ndef f():\n    from backfill_assets.ops import cli\n"
    targets = [t for _, t in _imports_in(source, "backfill_assets.lake")]
    assert "backfill_assets.defs.resources" in targets
    assert "backfill_assets.ops.cli" in targets
