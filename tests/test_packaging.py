"""pyproject.toml lists every package, and only packages that exist.

setuptools installs exactly the `packages` listed (no discovery: `operator/` must never become a top-level
`operator` package, the stdlib owns that name). A sub-package missing from the list works in the editable
checkout the tests run from and is absent from a wheel — an ImportError in production only. So: every folder
holding Python modules under the mapped folders is a package (has an __init__.py), every package is listed,
and every listed package has its folder.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
LISTED: list[str] = SETUPTOOLS["packages"]
# The folders that become sub-packages of tokenfleet; sim/ (tokenfleet.sim) when it is present.
FOLDERS = {
    "operator": "tokenfleet.operator",
    "runtime": "tokenfleet.runtime",
    "kernels": "tokenfleet.kernels",
}
if (REPO / "sim").is_dir():
    FOLDERS["sim"] = "tokenfleet.sim"


def _python_dirs(folder: str) -> list[Path]:
    """Folders under `folder` (itself included) that hold .py files, caches aside."""
    return sorted({p.parent for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts})


def _package_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    return ".".join([FOLDERS[rel.parts[0]], *rel.parts[1:]])


def _package_folder(name: str) -> Path:
    """Where setuptools looks for `name`: the longest package-dir prefix, then one folder per dot."""
    prefix = max((p for p in PACKAGE_DIR if name == p or name.startswith(p + ".")), key=len, default="")
    rest = name[len(prefix) :].lstrip(".").split(".") if name != prefix else []
    return REPO / (PACKAGE_DIR[prefix] if prefix else "") / Path(*rest)


def test_each_folder_maps_to_its_package():
    for folder, package in FOLDERS.items():
        assert PACKAGE_DIR.get(package) == folder, f"package-dir must map {package} to {folder}/"


def test_every_folder_with_modules_is_a_package():
    missing = [
        str(d.relative_to(REPO))
        for f in FOLDERS
        for d in _python_dirs(f)
        if not (d / "__init__.py").is_file()
    ]
    assert not missing, f"folders with modules but no __init__.py (a wheel would drop them): {missing}"


def test_every_package_is_listed():
    found = {_package_name(d) for f in FOLDERS for d in _python_dirs(f) if (d / "__init__.py").is_file()}
    unlisted = sorted(found - set(LISTED))
    assert not unlisted, f"packages missing from [tool.setuptools] packages in pyproject.toml: {unlisted}"


def test_every_listed_package_exists():
    absent = [
        f"{name} (looked in {_package_folder(name).relative_to(REPO)}/)"
        for name in LISTED
        if not (_package_folder(name) / "__init__.py").is_file()
    ]
    assert not absent, f"pyproject.toml lists packages that do not exist: {absent}"
    assert len(LISTED) == len(set(LISTED)), "pyproject.toml lists a package twice"
