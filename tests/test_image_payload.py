"""The image's payload works: the wheel built from exactly what the Dockerfile's build stage copies (its
COPY lines, read from the Dockerfile), installed with `--no-deps` into a venv that borrows the pinned
dependencies but cannot see the checkout, runs every console script of pyproject.toml.

Every other test imports the editable checkout, where a folder the Dockerfile forgets is still present;
only here does a missing folder (or a package missing from the wheel) show — as it would in the image.
Docker itself is not needed: e2e/image_payload.py stages and builds what the build stage would.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tokenfleet.runtime.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _load_builder():
    # The builder lives with the e2e harness (whose pods run the same payload); loaded by path so neither
    # the e2e folder nor the repository root goes on sys.path.
    spec = importlib.util.spec_from_file_location("image_payload", REPO / "e2e" / "image_payload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


image_payload = _load_builder()


def test_build_stage_copies_every_folder_pyproject_maps():
    copied = {
        src.rstrip("/") for copy in image_payload.build_stage_copies((REPO / "Dockerfile").read_text())
        for src in copy.sources
    }  # fmt: skip
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    missing = sorted(folders - copied)
    assert not missing, f"pyproject.toml maps {missing} but the Dockerfile's build stage never copies them"
    readme = PYPROJECT["project"]["readme"]
    assert {"pyproject.toml", readme, "requirements"} <= copied  # metadata: dependencies, long description


def test_staging_follows_dockers_copy_rules(tmp_path):
    context = tmp_path / "context"
    (context / "pkg" / "sub").mkdir(parents=True)
    (context / "pkg" / "sub" / "m.py").write_text("x = 1\n")
    (context / "a.txt").write_text("a")
    (context / "b.txt").write_text("b")
    (context / "ignored.txt").write_text("not copied")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM python:3.11-slim AS build\n"
        "WORKDIR /src\n"
        "# a comment\n"
        "COPY a.txt \\\n"
        "     b.txt ./\n"
        "COPY pkg/ /src/renamed/\n"
        "COPY a.txt single\n"
        "FROM python:3.11-slim\n"
        "COPY ignored.txt /src/\n"
        "COPY --from=build /src /src\n"
    )
    out = tmp_path / "staged"
    image_payload.stage_context(context, out, dockerfile)
    staged = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    # A directory's contents go into the destination (not the directory itself); a later stage's COPY
    # is no part of the build.
    assert staged == ["a.txt", "b.txt", "renamed/sub/m.py", "single"]
    assert (out / "single").read_text() == "a"

    dockerfile.write_text("FROM python:3.11-slim AS build\nWORKDIR /src\nCOPY missing/ missing/\n")
    with pytest.raises(image_payload.PayloadError, match="COPY missing/"):
        image_payload.stage_context(context, tmp_path / "again", dockerfile)
    dockerfile.write_text("FROM python:3.11-slim\nCOPY a.txt ./\n")
    with pytest.raises(image_payload.PayloadError, match="no stage"):
        image_payload.build_stage_copies(dockerfile.read_text())


@pytest.mark.slow
def test_wheel_from_the_build_stage_runs_every_console_script(tmp_path):
    context = tmp_path / "context"
    image_payload.stage_context(REPO, context)
    wheel = image_payload.build_wheel(context, tmp_path / "wheels")
    venv = image_payload.install_payload(wheel, tmp_path / "venv")
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    # The code that runs is the wheel's, with every listed package in it (not the checkout's).
    probe = run(
        python, "-c",
        "import importlib.metadata as m, tokenfleet; d = m.distribution('tokenfleet');"
        "print(tokenfleet.__file__); print(d.locate_file('')); print(*map(str, d.files or []), sep='\\n')",
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    module_file, location, *files = probe.stdout.splitlines()
    assert Path(module_file).is_relative_to(venv) and Path(location).is_relative_to(venv), probe.stdout
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in files, f"{package} is missing from the wheel"

    scripts = PYPROJECT["project"]["scripts"]
    assert scripts, "pyproject.toml declares no console script"
    for script in scripts:
        assert (venv / "bin" / script).is_file(), f"the wheel installs no `{script}` script"
        calls = [[script, "--help"]]
        if script == "tokenfleet":  # the dispatcher: each command imports its own component
            calls += [[script, command, "--help"] for command in COMMANDS]
        for argv in calls:
            out = run(*argv)
            assert out.returncode == 0, (
                f"`{' '.join(argv)}` in the payload venv failed:\n{out.stderr[-3000:]}"
            )
            assert "usage" in out.stdout.lower(), (argv, out.stdout[-500:])
