"""What tensor parallelism needs of the rest of the config, checked at start-up (a clear ConfigError).

Speculative drafts split two ways. The self-draft is the sharded target's own first layers: its forwards
are collectives, so every rank runs it (`SHARDED_DRAFTS`; parallel/worker.py). A separate draft model
(`draft`) is small by design and is not sharded: rank 0 alone loads it whole, keeps its KV cache and runs
it (it mirrors the target's inputs and drafts with no collective); n-gram speculation needs no model.
Model-shape limits are checked by `model/tensor_parallel.check_tensor_parallel` when the shard loads.
"""

from __future__ import annotations

from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.errors import ConfigError

SHARDED_DRAFTS = frozenset({"self"})


def check_tensor_parallel_config(config: RuntimeConfig, loaded: object | None) -> None:
    shard = getattr(getattr(loaded, "model", None), "arch", None)
    if shard is not None and shard.tp_size != config.parallel.tensor_parallel_size:
        raise ConfigError("a preloaded model cannot be used with tensor parallelism: pass the config only")
