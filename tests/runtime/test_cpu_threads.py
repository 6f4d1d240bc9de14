"""A CPU engine's torch threads: OMP_NUM_THREADS, else the affinity mask capped by the cgroup CPU quota.

The cgroup trees are written under tmp_path as the kernel lays them out (v2 `cpu.max`, v1 `cpu.cfs_*`), with
`/proc/self/cgroup` lines as a container sees them with and without a cgroup namespace.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenfleet.runtime.engine import engine_core
from tokenfleet.runtime.engine.cpu_threads import affinity_cores, cgroup_cpu_quota, cpu_thread_budget


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_v2_takes_the_smallest_quota_on_the_path_to_the_root(tmp_path):
    root = _tree(
        tmp_path / "fs",
        {
            "kubepods/cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "250000 100000\n",  # the pod's limit: 2.5 cores
            "kubepods/pod1/ctr/cpu.max": "max 100000\n",
        },
    )
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(proc, root) == 2.5
    assert cpu_thread_budget({}, proc, root) == max(1, min(affinity_cores(), 2))


def test_v2_inside_a_cgroup_namespace_reads_the_mount_itself(tmp_path):
    root = _tree(tmp_path / "fs", {"cpu.max": "50000 100000\n"})  # docker run --cpus 0.5
    proc = _proc(tmp_path, "0::/\n")
    assert cgroup_cpu_quota(proc, root) == 0.5
    assert cpu_thread_budget({}, proc, root) == 1  # at least one thread


def test_v1_follows_the_cpu_controller_and_its_mount_root(tmp_path):
    root = _tree(
        tmp_path / "fs",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    lines = "12:memory:/docker/abc\n5:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_quota(_proc(tmp_path, lines), root) == 3.0
    # Docker mounts the container's own cgroup at the hierarchy's root: the path is not there, the root is.
    mounted = _tree(
        tmp_path / "ctr",
        {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_quota(_proc(tmp_path, lines), mounted) == 2.0


@pytest.mark.parametrize(
    ("proc_text", "files"),
    [
        ("0::/\n", {}),  # no cpu.max: the real root
        ("0::/a\n", {"a/cpu.max": "max 100000\n"}),
        ("0::/a\n", {"a/cpu.max": "garbage\n"}),
        ("0::/a\n", {"a/cpu.max": "100000 0\n"}),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "100000\n"}),  # no period
        ("", {}),
    ],
)
def test_no_quota_leaves_the_affinity_mask(tmp_path, proc_text, files):
    root = _tree(tmp_path / "fs", files)
    proc = _proc(tmp_path, proc_text)
    assert cgroup_cpu_quota(proc, root) is None
    assert cpu_thread_budget({}, proc, root) == affinity_cores()


def test_an_unreadable_proc_file_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "missing", tmp_path) is None


def test_omp_num_threads_is_the_deployers_choice_when_it_is_a_positive_integer(tmp_path):
    root = _tree(tmp_path / "fs", {"cpu.max": "100000 100000\n"})
    proc = _proc(tmp_path, "0::/\n")
    assert cpu_thread_budget({"OMP_NUM_THREADS": "3"}, proc, root) == 3  # above the quota: their call
    for unusable in ("", "0", "four", "-2"):
        assert cpu_thread_budget({"OMP_NUM_THREADS": unusable}, proc, root) == 1


def test_the_engine_lowers_torch_threads_to_the_budget(default_model, monkeypatch):
    from tokenfleet.runtime.config import RuntimeConfig

    config = RuntimeConfig.model_validate(
        {"model": {"dtype": "float32", "attention_backend": "torch"}, "cache": {"num_blocks": 16}}
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(engine_core, "cpu_thread_budget", lambda: 1)  # e.g. docker run --cpus 1
        engine_core.EngineCore(config, loaded=default_model).shutdown()
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(engine_core, "cpu_thread_budget", lambda: 8)  # more than torch took: left as is
        torch.set_num_threads(2)
        engine_core.EngineCore(config, loaded=default_model).shutdown()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
