"""Config reload: a Kubernetes-style ConfigMap swap applies live fields and refuses restart-only ones."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import yaml
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.config_watch import ConfigChange, ConfigWatcher, diff_config
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager


class ConfigMapMount:
    """The kubelet's layout: config.yaml -> ..data/config.yaml, ..data -> ..<version>/ (swapped atomically)."""

    def __init__(self, root: Path, config: dict):
        self.root = root
        self.version = 0
        self._write(config)
        (root / "config.yaml").symlink_to("..data/config.yaml")

    @property
    def path(self) -> Path:
        return self.root / "config.yaml"

    def _write(self, config: dict) -> None:
        self.version += 1
        version_dir = self.root / f"..2024_01_01_00_00_0{self.version}"
        version_dir.mkdir()
        (version_dir / "config.yaml").write_text(yaml.safe_dump(config))
        os.utime(version_dir / "config.yaml", ns=(10**18, 10**18))  # same mtime every time
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version_dir.name)
        os.replace(tmp, self.root / "..data")

    def swap(self, config: dict) -> None:
        self._write(config)


def cache(**fields) -> dict:
    return {"cache": {"num_blocks": 16, **fields}}


def test_diff_config_splits_live_and_restart_fields():
    old = RuntimeConfig.model_validate(cache())
    new = RuntimeConfig.model_validate(
        {"cache": {"num_blocks": 16, "ttl_seconds": 30, "block_size": 32}, "scheduler": {"max_waiting": 5}}
    )
    live, restart = diff_config(old, new)
    assert [c.path for c in live] == ["cache.ttl_seconds", "scheduler.max_waiting"]
    assert restart == (ConfigChange("cache.block_size", 16, 32),)
    assert diff_config(old, old) == ((), ())


async def test_symlink_swap_applies_live_fields_and_refuses_the_others(tmp_path: Path):
    mount = ConfigMapMount(tmp_path, cache(eviction="lru"))
    km = KVCacheManager(16, 16)
    seen: list[tuple[RuntimeConfig, RuntimeConfig]] = []

    def on_change(old: RuntimeConfig, new: RuntimeConfig) -> None:
        km.apply_policy(new.cache)
        seen.append((old, new))

    watcher = ConfigWatcher(mount.path, on_change)
    assert not await watcher.check_once()  # nothing changed yet

    mount.swap(cache(eviction="s3fifo", ttl_seconds=60, pinned_prefixes=[[1, 2, 3]], block_size=32))
    assert await watcher.check_once()
    assert km.pool.eviction == "s3fifo" and km.pool.ttl_seconds == 60
    ((old, new),) = seen
    assert old.cache.eviction == "lru" and new.cache.pinned_prefixes == ((1, 2, 3),)
    assert watcher.effective.cache.block_size == 16  # refused: the running value stays
    snap = watcher.snapshot()
    assert snap["restart_required"] and snap["pending_restart"] == [
        {"path": "cache.block_size", "running": 16, "file": 32}
    ]
    assert snap["effective"]["cache"]["eviction"] == "s3fifo"

    mount.swap(cache(eviction="s3fifo", ttl_seconds=60, pinned_prefixes=[[1, 2, 3]]))  # block size reverted
    assert not await watcher.check_once()  # no live change, but the pending restart is gone
    assert watcher.snapshot()["pending_restart"] == [] and len(seen) == 1


async def test_an_invalid_file_is_ignored_and_a_failing_apply_keeps_the_old_config(tmp_path: Path):
    mount = ConfigMapMount(tmp_path, cache())
    calls: list[RuntimeConfig] = []

    async def on_change(old: RuntimeConfig, new: RuntimeConfig) -> None:
        calls.append(new)
        if new.cache.ttl_seconds == 1:
            raise RuntimeError("engine refused")

    watcher = ConfigWatcher(mount.path, on_change)
    mount.swap({"cache": {"eviction": "random"}})
    assert not await watcher.check_once() and "eviction" in watcher.last_error
    mount.swap(cache(ttl_seconds=1))
    assert not await watcher.check_once() and watcher.effective.cache.ttl_seconds is None
    mount.swap(cache(ttl_seconds=2))
    assert await watcher.check_once() and watcher.effective.cache.ttl_seconds == 2
    assert watcher.last_error is None and len(calls) == 2


async def test_the_polling_task_picks_up_a_swap(tmp_path: Path):
    mount = ConfigMapMount(tmp_path, cache())
    applied = asyncio.Event()
    watcher = ConfigWatcher(mount.path, lambda old, new: applied.set(), interval_s=0.01)
    watcher.start()
    try:
        mount.swap(cache(max_pinned_fraction=0.5))
        await asyncio.wait_for(applied.wait(), timeout=5)
        assert watcher.effective.cache.max_pinned_fraction == 0.5
    finally:
        await watcher.stop()


def test_one_loader_validates_files_and_overrides(tmp_path):
    import pytest
    from tokenfleet.runtime.config_file import with_overrides
    from tokenfleet.runtime.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("server: {port: 9000}\n")
    config = RuntimeConfig.load(path)
    assert config.server.port == 9000
    assert with_overrides(config, {"model": None}) is config  # None: no override
    with pytest.raises(ConfigError, match="override"):
        with_overrides(config, {"server": {"port": 70000}})
    path.write_text("server: {port: nope}\n")
    with pytest.raises(ConfigError, match="invalid runtime config"):
        RuntimeConfig.load(path)
    with pytest.raises(ConfigError, match="invalid runtime config"):
        RuntimeConfig.load(tmp_path / "missing.yaml")


def test_router_live_fields_cover_subtrees_and_removed_map_keys():
    from tokenfleet.runtime.config_watch import with_changes
    from tokenfleet.runtime.router.config import LIVE_FIELDS, RouterConfig

    old = RouterConfig.model_validate(
        {"port": 1, "routing": {"rateLimits": {"tiers": {"gold": {"requestsPerMinute": 5}}}}}
    )
    new = RouterConfig.model_validate({"port": 2, "routing": {"strategy": "round-robin"}})
    live, restart = diff_config(old, new, LIVE_FIELDS)
    assert [c.path for c in restart] == ["port"]
    assert {c.path for c in live} == {
        "routing.strategy",
        "routing.rate_limits.tiers.gold.requests_per_minute",
        "routing.rate_limits.tiers.gold.tokens_per_minute",
    }
    applied = with_changes(old, live)
    assert applied.routing.rate_limits.tiers == {} and applied.routing.strategy == "round-robin"
    assert applied.port == 1  # restart-only: the running value stays
