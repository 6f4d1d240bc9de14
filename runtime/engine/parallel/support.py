"""What tensor parallelism supports today, checked at start-up (a clear ConfigError instead of wrong output).

A separate draft model for speculative decoding (`draft`) is refused with tensor_parallel_size > 1;
n-gram speculation needs no model, and the self-draft runs on every rank (parallel/worker.py). Model-shape limits are checked by
`model/tensor_parallel.check_tensor_parallel` when the shard loads.
"""

from __future__ import annotations

from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.errors import ConfigError

# A separate draft model (`draft`) would need sharding of its own, or a replica on rank 0 sized against
# the target's shard; it is refused. The self-draft is the sharded target's first layers: every rank runs it.
UNSUPPORTED_SPECULATIVE = frozenset({"draft"})
SHARDED_DRAFTS = frozenset({"self"})


def check_tensor_parallel_config(config: RuntimeConfig, loaded: object | None) -> None:
    size = config.parallel.tensor_parallel_size
    if config.speculative.method in UNSUPPORTED_SPECULATIVE:
        raise ConfigError(
            f"speculative.method {config.speculative.method!r} is not supported with tensor_parallel_size "
            f"{size} (use 'ngram', or tensor_parallel_size 1)"
        )
    shard = getattr(getattr(loaded, "model", None), "arch", None)
    if shard is not None and shard.tp_size != size:
        raise ConfigError("a preloaded model cannot be used with tensor parallelism: pass the config only")
