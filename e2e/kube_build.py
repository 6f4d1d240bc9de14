"""Build (and cache) kube-apiserver from the Kubernetes Go module.

No package registry ships kube-apiserver, but the Go module proxy serves the Kubernetes source: a scratch
module that requires ``k8s.io/kubernetes vX.Y.Z`` and replaces every ``k8s.io/*`` staging module with its
``v0.Y.Z`` twin builds ``cmd/kube-apiserver``. The build takes ~10 minutes on 2 cores, so the binary is
cached outside the repo and guarded by a file lock: parallel test sessions wait for one build instead of
racing.

Usable as a script: ``python e2e/kube_build.py [vX.Y.Z]`` prints the binary path.
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


def build_kube_apiserver(version: str, dest_dir: Path) -> Path:
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
    pkg = "k8s.io/kubernetes/cmd/kube-apiserver"
    _log(f"resolving {pkg}@{version} ({len(staging)} staging modules pinned)")
    _run([go, "get", f"{pkg}@{version}"], src, env)
    out = dest_dir / "kube-apiserver.tmp"
    ldflags = f"-s -w -X k8s.io/component-base/version.gitVersion={version}"
    _log("compiling kube-apiserver (about 10 minutes on 2 cores)")
    _run([go, "build", "-trimpath", "-ldflags", ldflags, "-o", str(out), pkg], src, env)
    final = dest_dir / "kube-apiserver"
    out.rename(final)  # atomic: a half-written binary is never visible under the final name
    (dest_dir / "build.json").write_text(json.dumps({"version": version, "built": time.time()}))
    return final


def ensure_kube_apiserver(version: str | None = None) -> Path:
    """Path of a kube-apiserver binary: KUBEBUILDER_ASSETS, else the cache, else build it (locked)."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / "kube-apiserver").exists():
        return Path(assets) / "kube-apiserver"
    version = version or kube_version()
    dest = cache_root() / version
    dest.mkdir(parents=True, exist_ok=True)
    binary = dest / "kube-apiserver"
    if binary.exists():
        return binary
    with open(dest / ".build.lock", "w") as lock:
        _log(f"kube-apiserver {version} not cached in {dest}; waiting for the build lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():  # another process built it while we waited
            return binary
        started = time.monotonic()
        path = build_kube_apiserver(version, dest)
        _log(f"built {path} in {time.monotonic() - started:.0f}s")
        return path


if __name__ == "__main__":
    print(ensure_kube_apiserver(sys.argv[1] if len(sys.argv) > 1 else None))
