"""A request's block table as the KV cache manager keeps it (mutable, owned and changed by the manager only).

Besides the blocks, it carries `fast_limit`: the token count up to which `allocate_slots` would neither
take a block nor cache one, i.e. `min(held slots, the end of the first prompt block not yet offered to
the prefix cache)`. A step that keeps `num_computed_tokens + num_new_tokens <= fast_limit` needs no call
into the manager at all: the scheduler compares two integers and moves on. That is what a decode does on
15 of every 16 steps (block size 16), for every running request, so the check replaces a method call,
two divisions and a pool lookup per request per step. Blocks that hold generated tokens are offered to
the cache only when the request frees its table (manager.py says why), so past its prompt a decode
reaches the manager only to take its next block.

With a model whose every layer has a sliding window, the manager gives back the leading blocks no query
can see any more: `num_released` of them, whose places in `blocks` / `block_ids` then hold the manager's
null block (positions stay where the kernels look them up; the null block is never written). `fast_limit`
then also stops at the block boundary where the next block falls behind the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.runtime.engine.kv_cache.block_pool import KVBlock


class RequestBlocks:
    __slots__ = (
        "block_ids",
        "blocks",
        "fast_limit",
        "num_cached",
        "num_prompt_blocks",
        "num_released",
        "window",
    )

    def __init__(self, num_cached: int, num_prompt_blocks: int, window: int | None = None):
        self.blocks: list[KVBlock] = []
        # The same table as ids, as a tuple rebuilt only when it changes (every block_size tokens of a
        # decode): the scheduler hands it to the runner for every request every step without copying.
        self.block_ids: tuple[int, ...] = ()
        self.num_cached = num_cached  # leading blocks already offered to the prefix cache
        # Full blocks of prompt tokens only: offered to the cache as soon as their KV is written.
        self.num_prompt_blocks = num_prompt_blocks
        self.fast_limit = 0  # set by the manager after every change (`settle`)
        self.num_released = 0  # leading blocks given back (sliding window): the null block holds their place
        self.window = window  # the model's window on every layer, or None (nothing is ever released)

    @property
    def num_held(self) -> int:
        """Blocks this request holds a reference on (its table minus the released places)."""
        return len(self.blocks) - self.num_released

    def settle(self, block_size: int, caching: bool) -> None:
        """Recompute `fast_limit` after the blocks or `num_cached` changed."""
        held = len(self.blocks) * block_size
        if caching and self.num_cached < self.num_prompt_blocks:
            # Once num_computed_tokens reaches the end of block `num_cached`, that block is to be cached.
            next_full = (self.num_cached + 1) * block_size
            self.fast_limit = held if held < next_full else next_full
        else:
            self.fast_limit = held
        if self.window is not None:
            # Once num_computed_tokens reaches (num_released + 1) * block_size + window - 1, block
            # `num_released` is behind every query's window. Rounded up to a block boundary: a decode then
            # releases in the call that takes its next block (one call per block, and its peak is the same,
            # since the peak comes right after taking the block); a long prefill's table holds more than
            # that, so the first decode after it releases at once.
            release_at = (
                -(-((self.num_released + 1) * block_size + self.window - 1) // block_size) * block_size
            )
            if release_at < self.fast_limit:
                self.fast_limit = release_at
