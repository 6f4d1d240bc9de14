"""How many torch threads a CPU engine may run: the cores this process is entitled to, not the machine's.

torch sizes its intra-op pool by the cores it sees, and a container sees every core of its host. Under a CPU
quota (`docker run --cpus 2`, a Kubernetes CPU limit, a LimitRange's default limit) a pool of one thread per
host core burns the period's quota in a few milliseconds and is then throttled until the next period, every
period; without a quota, pods sharing a node each start a thread per core and wait at every op's barrier
for threads that are off-core. The budget, in order:

1. `OMP_NUM_THREADS` when it is a positive integer: the deployer's choice (a ModelDeployment's pod gets its
   CPU request there);
2. else the process's affinity mask (cpuset), capped by the cgroup CPU quota (v2 `cpu.max`, v1
   `cpu.cfs_quota_us` / `cpu.cfs_period_us`; the smallest on the path from the process's cgroup to the root),
   rounded down, at least 1.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """`root` joined with `cgroup_path` and each of its parents, down to `root` itself (leaf first)."""
    parts = [p for p in cgroup_path.split("/") if p and p not in (".", "..")]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _quota_v2(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")  # "max 100000" or "<quota> <period>"
    fields = text.split() if text else []
    if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit() or int(fields[1]) == 0:
        return None
    return int(fields[0]) / int(fields[1])


def _quota_v1(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if not quota or not period or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None  # -1: no quota
    return int(quota) / int(period)


def cgroup_cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in cores (the smallest on its path to the root), or None."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    quotas: list[float] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2, the unified hierarchy
            quotas += [q for d in _ancestors(root, path) if (q := _quota_v2(d)) is not None]
        elif "cpu" in controllers.split(","):  # cgroup v1: mounted as cpu, cpu,cpuacct or cpuacct,cpu
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / mount).is_dir():
                    quotas += [q for d in _ancestors(root / mount, path) if (q := _quota_v1(d)) is not None]
                    break
    return min(quotas) if quotas else None


def affinity_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_thread_budget(
    env: Mapping[str, str] = os.environ,
    proc_cgroup: Path = PROC_CGROUP,
    root: Path = CGROUP_ROOT,
) -> int:
    """The torch threads this process's CPU engine may run (the module docstring's order)."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = affinity_cores()
    quota = cgroup_cpu_quota(proc_cgroup, root)
    return max(1, min(cores, math.floor(quota))) if quota is not None else cores
