"""The router's modules import one another without cycles (a cycle forces function-level imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenfleet.runtime.router as router_pkg

PACKAGE = "tokenfleet.runtime.router"


def _imports(path: Path) -> set[str]:
    """The router modules `path` imports anywhere in it (also inside functions)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                out |= {f"{PACKAGE}.{a.name}" for a in node.names}
            elif node.module.startswith(PACKAGE + "."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PACKAGE + ".")}
    return out


def test_router_modules_have_no_import_cycle():
    root = Path(router_pkg.__file__).parent
    graph = {f"{PACKAGE}.{p.stem}": _imports(p) for p in root.glob("*.py") if p.stem != "__init__"}
    assert f"{PACKAGE}.upstream" in graph[f"{PACKAGE}.resume"]
    assert f"{PACKAGE}.proxy" not in graph[f"{PACKAGE}.resume"]
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
