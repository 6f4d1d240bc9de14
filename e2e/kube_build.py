"""Build (and cache) the Kubernetes control plane from the Kubernetes Go module.

No package registry ships kube-apiserver, kube-controller-manager or kube-scheduler, but the Go module
proxy serves the Kubernetes source: a scratch module that requires ``k8s.io/kubernetes vX.Y.Z`` and
replaces every ``k8s.io/*`` staging module with its ``v0.Y.Z`` twin builds the three commands. One
``go build`` of all three shares the compilation (~8 minutes for the apiserver, ~2 more for the other two on
2 cores), so the binaries are cached outside the repo and guarded by a file lock: parallel test sessions
wait for one build instead of racing.

Usable as a script: ``python e2e/kube_build.py [vX.Y.Z]`` prints the directory holding the binaries.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_KUBE_VERSION = "v1.37.2"
GO_PROXY = "https://proxy.golang.org"
_STAGING_RE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", re.MULTILINE)


def kube_version() -> str:
    return os.environ.get("TOKENFLEET_KUBE_VERSION", DEFAULT_KUBE_VERSION)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenfleet" / "envtest"


def find_go() -> str:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        raise FileNotFoundError("the Go toolchain is needed to build kube-apiserver (not found on PATH)")
    return go


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The k8s.io modules that k8s.io/kubernetes replaces with its in-tree staging copies."""
    return sorted(set(_STAGING_RE.findall(kubernetes_go_mod)))


def scratch_go_mod(version: str, staging: list[str], go_directive: str) -> str:
    """go.mod of the scratch module: require kubernetes, pin every staging module to v0.Y.Z."""
    staging_version = "v0." + version.lstrip("v").split(".", 1)[1]
    lines = ["module tokenfleet.dev/envtest", "", f"go {go_directive}", ""]
    lines.append(f"require k8s.io/kubernetes {version}")
    lines.append("")
    lines.append("replace (")
    lines.extend(f"\t{mod} => {mod} {staging_version}" for mod in staging)
    lines.append(")")
    return "\n".join(lines) + "\n"


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return resp.read().decode()


def _log(msg: str) -> None:
    print(f"[envtest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    _log("$ " + " ".join(cmd))
    # Output streams straight through so a 10-minute build visibly makes progress.
    subprocess.run(cmd, cwd=cwd, env=env, check=True)


CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")


def build_control_plane(version: str, dest_dir: Path) -> Path:
    go = find_go()
    src = dest_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    kube_mod = _fetch(f"{GO_PROXY}/k8s.io/kubernetes/@v/{version}.mod")
    go_line = re.search(r"^go (\S+)$", kube_mod, re.MULTILINE)
    staging = staging_modules(kube_mod)
    if not staging:
        raise RuntimeError(f"no staging modules found in k8s.io/kubernetes {version} go.mod")
    (src / "go.mod").write_text(scratch_go_mod(version, staging, go_line.group(1) if go_line else "1.24"))
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod -buildvcs=false", GOTOOLCHAIN="local")
    pkgs = [f"k8s.io/kubernetes/cmd/{name}" for name in CONTROL_PLANE]
    _log(f"resolving {', '.join(CONTROL_PLANE)} @{version} ({len(staging)} staging modules pinned)")
    _run([go, "get", *(f"{pkg}@{version}" for pkg in pkgs)], src, env)
    tmp = dest_dir / "bin.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    ldflags = f"-s -w -X k8s.io/component-base/version.gitVersion={version}"
    _log("compiling the control plane (about 10 minutes on 2 cores)")
    started = time.monotonic()
    _run([go, "build", "-trimpath", "-ldflags", ldflags, "-o", str(tmp) + "/", *pkgs], src, env)
    # The apiserver is renamed last: its presence is what marks the cache complete, and each rename is
    # atomic, so a half-written binary is never visible under its final name.
    for name in reversed(CONTROL_PLANE):
        (tmp / name).rename(dest_dir / name)
    tmp.rmdir()
    build = {"version": version, "built": time.time(), "seconds": round(time.monotonic() - started)}
    (dest_dir / "build.json").write_text(json.dumps(build))
    return dest_dir


def _complete(directory: Path) -> bool:
    return all((directory / name).exists() for name in CONTROL_PLANE)


def ensure_control_plane(version: str | None = None) -> Path:
    """Directory holding the three binaries: KUBEBUILDER_ASSETS, else the cache, else build them (locked).

    A KUBEBUILDER_ASSETS that lacks one of them is an error, not a silent fallback to the cache: the user
    pointed at those binaries on purpose.
    """
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        missing = [name for name in CONTROL_PLANE if not (Path(assets) / name).exists()]
        if missing:
            raise FileNotFoundError(f"KUBEBUILDER_ASSETS={assets} lacks {', '.join(missing)}")
        return Path(assets)
    version = version or kube_version()
    dest = cache_root() / version
    dest.mkdir(parents=True, exist_ok=True)
    if _complete(dest):
        return dest
    with open(dest / ".build.lock", "w") as lock:
        _log(f"control plane {version} not cached in {dest}; waiting for the build lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(dest):  # another process built it while we waited
            return dest
        started = time.monotonic()
        path = build_control_plane(version, dest)
        _log(f"built {', '.join(CONTROL_PLANE)} in {path} in {time.monotonic() - started:.0f}s")
        return path


def ensure_kube_apiserver(version: str | None = None) -> Path:
    return ensure_control_plane(version) / "kube-apiserver"


if __name__ == "__main__":
    print(ensure_control_plane(sys.argv[1] if len(sys.argv) > 1 else None))
