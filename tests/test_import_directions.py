"""Dependencies point one way: an AST walk over every module of operator/, runtime/, kernels/ and the
top-level tokenfleet/ package.

    kernels <- runtime.model <- runtime.engine <- runtime.server
                                              <- runtime.router
    runtime.server and runtime.router share only runtime.openai and runtime.kv_wire;
    the operator imports from the runtime only the config schemas (and the torch-free modules they import);
    a simulator (sim/, tokenfleet.sim) may import everything, and nothing imports it;
    the top-level package (tokenfleet/__init__.py, loaded by every import, the operator's too) imports
    nothing of tokenfleet: it exposes the offline API by name, loaded on first use.

Every import counts, also one inside a function or under TYPE_CHECKING: a lazy import is still a
dependency. A violation names the file, the line and the import as written.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Repository folder -> the package it becomes (pyproject.toml's package-dir).
FOLDERS = {
    "operator": "tokenfleet.operator",
    "runtime": "tokenfleet.runtime",
    "kernels": "tokenfleet.kernels",
    "sim": "tokenfleet.sim",
    "tokenfleet": "tokenfleet",
}
SCANNED = ("operator", "runtime", "kernels", "tokenfleet")

SERVER, ROUTER = "tokenfleet.runtime.server", "tokenfleet.runtime.router"
ONE_WAY = "kernels <- model <- engine <- server/router"
SHARED = "server and router share only runtime.openai and runtime.kv_wire"
# (importing package, packages it must not import, why)
RULES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "tokenfleet.kernels",
        ("tokenfleet.runtime", "tokenfleet.operator", "tokenfleet.sim"),
        "kernels stand alone: they raise ValueError/TypeError, not the runtime's errors",
    ),
    ("tokenfleet.runtime.model", ("tokenfleet.runtime.engine", SERVER, ROUTER), ONE_WAY),
    ("tokenfleet.runtime.engine", (SERVER, ROUTER), ONE_WAY),
    (SERVER, (ROUTER,), SHARED),
    (ROUTER, (SERVER,), SHARED),
    ("tokenfleet.runtime.openai", (SERVER, ROUTER), f"the shared wire package sits below both: {SHARED}"),
    ("tokenfleet.runtime.kv_wire", (SERVER, ROUTER), f"the shared wire module sits below both: {SHARED}"),
    ("tokenfleet.runtime", ("tokenfleet.operator",), "the runtime knows nothing of the operator"),
    ("tokenfleet", ("tokenfleet.sim",), "a simulator may import everything; nothing imports it"),
)
# The operator deploys the runtime and the router: it imports their config schemas and nothing else.
OPERATOR_SCHEMAS = ("tokenfleet.runtime.config", "tokenfleet.runtime.router.config")
HEAVY = ("torch", "triton", "transformers", "numpy")  # what the operator's image must not need


@dataclass(frozen=True, slots=True)
class Import:
    path: str  # file, relative to the repository
    line: int
    importer: str  # module holding the statement
    target: str  # the deepest tokenfleet (or third-party top-level) module it names
    text: str  # the statement as written


def _module_name(rel: Path) -> str:
    parts = [*FOLDERS[rel.parts[0]].split("."), *rel.with_suffix("").parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path, folders) -> list[tuple[Path, str, bool]]:
    """(file, module name, is a package __init__) for every .py under the given folders."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            out.append((path, _module_name(rel), path.name == "__init__.py"))
    return out


def collect_imports(root: Path, folders=SCANNED) -> list[Import]:
    """Every import statement of the scanned folders, resolved to absolute module names."""
    known = {name for _, name, _ in _sources(root, [f for f in FOLDERS if (root / f).is_dir()])}
    found = []
    for path, module, is_package in _sources(root, folders):
        source = path.read_text()
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(source, filename=rel)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the importer's package, one level up per extra dot
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    parent = ".".join([*base, node.module] if node.module else base)
                else:
                    parent = node.module or ""
                # `from pkg import name` imports the submodule pkg.name when there is one.
                targets = [
                    f"{parent}.{a.name}" if f"{parent}.{a.name}" in known else parent for a in node.names
                ]
            else:
                continue
            text = ast.get_source_segment(source, node) or ""
            statement = " ".join(text.split())
            found += [Import(rel, node.lineno, module, t, statement) for t in dict.fromkeys(targets)]
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _closure(imports: list[Import], roots: tuple[str, ...]) -> set[str]:
    """The modules `roots` load when imported: their tokenfleet imports, transitively, with every parent
    package (its __init__ runs too)."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if _within(imp.target, "tokenfleet"):
            edges.setdefault(imp.importer, set()).add(imp.target)
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            if name not in seen:
                seen.add(name)
                todo += edges.get(name, ())
    return seen


def violations(imports: list[Import]) -> list[str]:
    found = []
    for imp in imports:
        for importer, forbidden, why in RULES:
            if not _within(imp.importer, importer) or _within(imp.importer, "tokenfleet.sim"):
                continue
            for target in forbidden:
                if _within(imp.target, target):
                    found.append(
                        f"{imp.path}:{imp.line}: `{imp.text}` — {importer} must not import {target} ({why})"
                    )
    for imp in imports:
        # (torch and the like it may not import either: the operator check below reports that.)
        if imp.importer == "tokenfleet" and _within(imp.target, "tokenfleet"):
            found.append(
                f"{imp.path}:{imp.line}: `{imp.text}` — the top-level package runs on every import of "
                "tokenfleet (the operator's too): name the offline API in its lazy table, do not import it"
            )
    allowed = _closure(imports, OPERATOR_SCHEMAS)
    for imp in imports:
        if (
            _within(imp.importer, "tokenfleet.operator")
            and _within(imp.target, "tokenfleet")
            and not _within(imp.target, "tokenfleet.operator")
            and imp.target not in allowed
        ):
            found.append(
                f"{imp.path}:{imp.line}: `{imp.text}` — the operator imports from tokenfleet only its own "
                f"modules and the config schemas {OPERATOR_SCHEMAS} with what they import: {sorted(allowed)}"
            )
    for imp in imports:
        if imp.importer in allowed and imp.target.split(".")[0] in HEAVY:
            found.append(
                f"{imp.path}:{imp.line}: `{imp.text}` — {imp.importer} is loaded by the operator "
                f"(through the config schemas) and must not import {imp.target.split('.')[0]}"
            )
    return found


def test_imports_point_one_way():
    imports = collect_imports(REPO)
    assert len({imp.importer for imp in imports}) > 50, "the walk found too few modules: wrong root?"
    problems = violations(imports)
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("rel", "statement", "forbidden"),
    [
        ("kernels/gemm.py", "from ..runtime.errors import InvalidRequest", "tokenfleet.runtime"),
        ("runtime/router/app.py", "from tokenfleet.runtime import server", SERVER),
        ("runtime/server/app.py", "from ..router.prompt_blocks import hashes", ROUTER),
        ("runtime/model/llama.py", "import tokenfleet.runtime.engine.scheduler", "tokenfleet.runtime.engine"),
        ("runtime/engine/core.py", "def f():\n    from tokenfleet.sim import simulator", "tokenfleet.sim"),
        ("operator/builders.py", "from tokenfleet.kernels import moe", "the operator imports"),
        ("runtime/config.py", "import torch", "must not import torch"),
        ("tokenfleet/__init__.py", "from tokenfleet.runtime.engine.llm import LLM", "lazy table"),
        ("tokenfleet/__init__.py", "def f():\n    import torch", "must not import torch"),
    ],
)
def test_a_forbidden_import_is_reported_with_file_and_line(tmp_path, rel, statement, forbidden):
    """The walk resolves relative, `from pkg import module` and lazy imports, and names where they are."""
    _write(
        tmp_path,
        {
            "kernels/__init__.py": "",
            "runtime/__init__.py": "",
            "runtime/errors.py": "",
            "runtime/config.py": "from tokenfleet.runtime.errors import ConfigError\n",
            "runtime/engine/__init__.py": "",
            "runtime/engine/scheduler.py": "",
            "runtime/server/__init__.py": "",
            "runtime/router/__init__.py": "",
            "runtime/router/config.py": "",
            "runtime/router/prompt_blocks.py": "",
            "operator/__init__.py": "",
            "operator/api.py": "from tokenfleet.runtime.config import RuntimeConfig\n",
            "sim/__init__.py": "from tokenfleet.runtime.server import app\n",  # sim may import anything
            "tokenfleet/__init__.py": "import importlib\n",
        },
    )
    assert violations(collect_imports(tmp_path)) == []
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = path.read_text() if path.exists() else ""
    path.write_text(existing + "\n\n" + statement + "\n")
    line = existing.count("\n") + 3 + statement.count("\n")
    problems = violations(collect_imports(tmp_path))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rel}:{line}: `{statement.splitlines()[-1].strip()}`")
    assert forbidden in problems[0]


def test_the_offline_api_loads_on_first_use_and_never_with_the_operator():
    """`import tokenfleet` (what the operator does) loads no torch; `tokenfleet.LLM` and the other lazy names
    resolve to the engine's classes."""
    import subprocess
    import sys

    probe = (
        "import sys, tokenfleet, tokenfleet.operator.api\n"
        "assert 'torch' not in sys.modules, 'torch loaded by importing tokenfleet'\n"
        "from tokenfleet import LLM, SamplingParams, RequestOutput, CompletionOutput\n"
        "from tokenfleet.runtime.engine.llm import LLM as engine_llm\n"
        "assert LLM is engine_llm and 'torch' in sys.modules\n"
        "assert set(tokenfleet.__all__) <= set(dir(tokenfleet))\n"
        "assert all(getattr(tokenfleet, name) is not None for name in tokenfleet.__all__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
