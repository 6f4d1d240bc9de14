"""KVCacheManager: the requests' view of the block pool — block tables, prefix-cache lookups, caching.

When a block is cached (indexed by hash so others can share it): *lazily*, once its KV is written, i.e.
once `request.num_computed_tokens` covers it — the next time the request allocates, or when it is
freed. vLLM caches at allocation time instead (before the step that writes the KV runs); caching after
the fact costs nothing measurable (a block shared within its own step is rare) and removes two hazards:
a request preempted in the step that allocated its blocks would otherwise leave hashes on blocks whose KV
was never written, and rejected speculative tokens could be cached. It also means the router's
`BlockStored` events only name KV that exists.

Blocks that hold generated tokens are cached later still: when the request frees its table (it finished,
was aborted or preempted), all at once. Only a prompt that contains those tokens could hit them, and no
client can send one before it has the answer, i.e. before the request finished: the next turn of a
conversation, a resumed or preempted stream all come after the free. Deferring them loses no hit and
saves the decode hot path a hash, an index insert and an event per block (`block_size` steps of every
running sequence): the router learns a finished answer's blocks in one `BlockStored` run.

`Request.block_hashes` is extended incrementally (only the blocks that became full since the last time,
never rehashing) when the manager needs it: at a prefix lookup and when blocks get cached.

Prefix-cache statistics count tokens once per admission: `prefix_queries` += the request's tokens and
`prefix_hits` += the tokens served from the cache, when the request gets its first blocks.

Cache policy: a lookup first drops free blocks past their TTL; after the device hits it
continues in the host tier, if one is attached (`attach_host_tier`): host hits get device blocks and a
copy back, become ordinary cached blocks and are returned with the device hits. The tier's copies run
at the end of the manager call that caused them (`run_transfers`, batched per call): no forward pass
runs inside a manager call, so a victim's KV is still intact when it is copied out, and every caller
that allocates (the scheduler, the speculative decoder) is covered without a hook of its own. Pinned prefixes (pins.py) hold references on their blocks. `apply_policy` changes
TTL, eviction policy and pin cap live; `metrics()` snapshots the counters.

Sliding window (`sliding_window` W, given only when *every* attention layer of the model has one): a
query at position p reads keys p - W + 1 .. p only, so once a request's next query position q is
known (the first token a step computes), its blocks whose last token is before q - W + 1 are read by no
layer again. `allocate_slots` gives them back before it takes new blocks (`_release_behind`): cached
first when caching is on (their KV depends only on their tokens and positions, so they stay valid prefix
hits, free and evictable like any freed cached block), then one reference dropped. Their places in the
table keep the *null block*: block 0, reserved at construction, never written (all zeros) — the kernels
address blocks by position, and a key tile that starts inside a released block reads zeros it then masks.
The table's `fast_limit` also stops at the block boundary where its next block falls behind the window: a
decode releases in the call that takes its next block (still one call per block_size steps), the first
decode after a long prefill at once; a long generation holds at most ceil(W / block_size) + 1 blocks
(look-ahead slots for speculative tokens add theirs). Positions only move forward while a
table exists (speculative rejections cut only slots past the step's first query; a preemption frees
the whole table), so a released place is never needed again by its request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tokenfleet.runtime.config import CacheConfig
from tokenfleet.runtime.engine.kv_cache.block_hash import (
    ExtraItem,
    append_block_hashes,
    encode_extra,
    hash_extra,
    with_adapter,
    with_salt,
)
from tokenfleet.runtime.engine.kv_cache.block_pool import BlockPool, KVBlock
from tokenfleet.runtime.engine.kv_cache.block_table import RequestBlocks
from tokenfleet.runtime.engine.kv_cache.cache_metrics import KVCacheMetrics
from tokenfleet.runtime.engine.kv_cache.kv_events import KVEvent
from tokenfleet.runtime.engine.kv_cache.offload import HostKVTier, KVTransfer
from tokenfleet.runtime.engine.kv_cache.pins import PinnedPrefixes
from tokenfleet.runtime.engine.kv_cache.request_tokens import token_slice
from tokenfleet.runtime.engine.kv_cache.ttl import Clock
from tokenfleet.runtime.engine.request import Request

# Distinct cache salts whose encoded hash extra is memoised; beyond this the memo starts over (salts are
# client-chosen, so the memo must stay bounded).
_MAX_SALT_MEMO = 1024


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_extra: tuple[ExtraItem, ...] = (),
        eviction: str = "lru",
        enable_kv_events: bool = True,
        ttl_seconds: float | None = None,
        max_pinned_fraction: float = 0.25,
        clock: Clock = time.monotonic,
        sliding_window: int | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The model-wide part of every block hash; each request's `cache_salt` is appended to it.
        self.hash_extra = hash_extra
        self.pool = BlockPool(num_blocks, enable_caching, eviction, enable_kv_events, ttl_seconds, clock)
        self.sliding_window = sliding_window
        # Placeholder for released places (see the module docstring): one reference held for good.
        self.null_block: KVBlock | None = None
        if sliding_window is not None:
            if num_blocks < 2:
                raise ValueError("a sliding-window KV cache needs at least 2 blocks (one is the null block)")
            self.null_block = self.pool.get_new_blocks(1)[0]
        self.pins = PinnedPrefixes(self.pool, max_pinned_fraction)
        self.host: HostKVTier | None = None
        self._run_transfers: Callable[[list[KVTransfer]], None] | None = None
        # Request id -> its block table. Read-only outside the manager: the scheduler reads
        # `fast_limit` and `block_ids` on its hot path instead of calling `allocate_slots` / `get_block_ids`.
        self.tables: dict[str, RequestBlocks] = {}
        self._extra_bytes: dict[object, bytes] = {}  # by salt, or (salt, adapter key)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # The last lookup's (request id, device hits, host hits, misses) in blocks; counted on admission.
        self._lookup: tuple[str, int, int, int] | None = None
        self.num_device_hit_blocks = 0
        self.num_host_hit_blocks = 0
        self.num_miss_blocks = 0

    @classmethod
    def from_config(
        cls,
        cache: CacheConfig,
        num_blocks: int,
        model_name: str,
        clock: Clock = time.monotonic,
        sliding_window: int | None = None,
    ) -> KVCacheManager:
        return cls(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            hash_extra=hash_extra(model_name, cache.cache_salt),
            eviction=cache.eviction,
            ttl_seconds=cache.ttl_seconds,
            max_pinned_fraction=cache.max_pinned_fraction,
            clock=clock,
            sliding_window=sliding_window,
        )

    # ---- cache policy ---------------------------------------------------------------------------------------

    def apply_policy(self, cache: CacheConfig) -> None:
        """Apply the live cache-policy fields (TTL, eviction policy, pin cap); the host tier and the pins
        themselves are the engine's (they need tensors and prefill)."""
        self.pool.set_ttl(cache.ttl_seconds)
        self.pool.set_eviction_policy(cache.eviction)
        self.pins.set_max_fraction(cache.max_pinned_fraction)

    def attach_host_tier(
        self, host: HostKVTier | None, run_transfers: Callable[[list[KVTransfer]], None] | None = None
    ) -> None:
        """Offload pressure-evicted blocks to `host` and look prefixes up there (None: detach).

        `run_transfers` performs the tier's copies; without it they wait in `host.take_transfers()`.
        """
        self.host = host
        self._run_transfers = run_transfers
        self.pool.on_evict = None if host is None else (lambda block, h: host.offload(block.block_id, h))

    def run_host_transfers(self) -> None:
        """Run the host tier's recorded copies now: for a caller that took blocks from the pool itself (a KV
        connector filling them) and must copy the evicted victims out before it writes into them."""
        self._flush_transfers()

    def _flush_transfers(self) -> None:
        if self.host is not None and self._run_transfers is not None:
            transfers = self.host.take_transfers()
            if transfers:
                self._run_transfers(transfers)

    def metrics(self) -> KVCacheMetrics:
        host = self.host
        return KVCacheMetrics(
            device_hit_blocks=self.num_device_hit_blocks,
            host_hit_blocks=self.num_host_hit_blocks,
            miss_blocks=self.num_miss_blocks,
            evicted_ttl_blocks=self.pool.num_evicted_ttl,
            evicted_pressure_blocks=self.pool.num_evicted_pressure,
            pinned_blocks=self.pins.num_pinned_blocks,
            offloaded_blocks=0 if host is None else host.num_blocks_offloaded,
            loaded_blocks=0 if host is None else host.num_blocks_loaded,
            host_evicted_blocks=0 if host is None else host.num_evicted,
            host_used_blocks=0 if host is None else len(host),
            host_total_blocks=0 if host is None else host.num_slots,
        )

    # ---- figures ------------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks requests can use (the null block of a sliding-window cache is not one)."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` fits in the whole cache (with nothing else running)."""
        return -(-num_tokens // self.block_size) <= self.num_blocks

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        table = self.tables.get(request_id)
        return () if table is None else table.block_ids

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references now (released places excluded)."""
        table = self.tables.get(request_id)
        return 0 if table is None else table.num_held

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- lookup and allocation -----------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_tokens: int | None = None
    ) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet: (blocks, number of tokens).

        Stops at the first miss, and never covers the last token: it must be computed to get logits.
        The blocks are not referenced yet; pass them to `allocate_slots` in the same step. `max_tokens`
        caps the hit for a request that must compute the positions after it (one scoring its prompt);
        its blocks are hashed all the same, so others hit them once computed.
        """
        if not self.enable_caching:
            return [], 0
        assert request.request_id not in self.tables, "lookup for a request that holds blocks"
        self.pool.evict_expired()
        self._update_hashes(request)
        hashes = request.block_hashes
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(hashes))
        if max_tokens is not None:
            max_blocks = min(max_blocks, max_tokens // self.block_size)
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(hashes[i])
            if block is None:
                break
            hits.append(block)
        num_device = len(hits)
        if self.host is not None and num_device < max_blocks:
            hits.extend(self._load_from_host(request, hits, max_blocks))
        self._lookup = (request.request_id, num_device, len(hits) - num_device, max_blocks - len(hits))
        return hits, len(hits) * self.block_size

    def _load_from_host(self, request: Request, hits: list[KVBlock], stop: int) -> list[KVBlock]:
        """Blocks `len(hits)..stop` of the request found in the host tier, copied into device blocks."""
        host = self.host
        assert host is not None
        hashes = request.block_hashes
        start = len(hits)
        n = 0
        while start + n < stop and hashes[start + n] in host:
            n += 1
        if n == 0:
            return []
        pool = self.pool
        # Hold the device hits so that taking blocks for the loads cannot evict them.
        pool.touch(hits, count_hit=False)
        n = min(n, pool.num_free_blocks)
        blocks = pool.get_new_blocks(n) if n else []
        num_loaded = 0
        for block, block_hash in zip(blocks, hashes[start : start + n], strict=True):
            # A pressure eviction just now may have pushed one of ours out of the host tier: stop there.
            if not host.load(block_hash, block.block_id):
                break
            num_loaded += 1
        bs = self.block_size
        end = start + num_loaded
        pool.cache_blocks(
            blocks[:num_loaded],
            hashes[start:end],
            hashes[start - 1] if start else None,
            token_slice(request, start * bs, end * bs),
            bs,
        )
        # Loaded blocks become free cached blocks (the caller's allocate_slots takes them); unused go empty.
        pool.free_blocks(reversed(blocks))
        pool.free_blocks(reversed(hits))
        self._flush_transfers()
        return blocks[:num_loaded]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> tuple[KVBlock, ...] | None:
        """Make room for `num_new_tokens` after the computed ones (+ the cache hits); the new blocks.

        None, with nothing changed, when the free blocks do not suffice. Hits on free cached blocks take
        those out of the free pool, so they count against what is free.
        """
        rid = request.request_id
        table = self.tables.get(rid)
        bs = self.block_size
        if table is not None and not new_computed_blocks:
            # Hot path (a decode, or the next chunk of a prompt): often no new block is needed at all.
            num_computed = request.num_computed_tokens
            end = num_computed + num_new_tokens
            if end <= table.fast_limit:
                return ()  # nothing to allocate or cache (and no garbage for the GC)
            if self.sliding_window is not None:
                # Before taking a block: the ones the window left behind may be what makes room.
                self._release_behind(request, table, num_computed)
            blocks = table.blocks
            pool = self.pool
            num_required = -(-end // bs) - len(blocks)
            if num_required > 0 and not pool.has_free(num_required):
                return None
            if (
                table.num_cached < table.num_prompt_blocks
                and num_computed // bs > table.num_cached
                and self.enable_caching
            ):
                self._cache_computed(request, table, table.num_prompt_blocks)
            if num_required <= 0:
                return ()
            new_blocks = pool.get_new_blocks(num_required)
            if self.host is not None:
                self._flush_transfers()
            blocks += new_blocks
            if num_required == 1:
                table.block_ids += (new_blocks[0].block_id,)
            else:
                table.block_ids += tuple(b.block_id for b in new_blocks)
            table.settle(bs, self.enable_caching)
            return tuple(new_blocks)
        num_held = 0 if table is None else len(table.blocks)
        num_hits = len(new_computed_blocks)
        total = request.num_computed_tokens + num_hits * bs + num_new_tokens
        num_required = max(0, -(-total // bs) - num_held - num_hits)
        if num_required or num_hits:
            num_touched_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_required + num_touched_free > self.pool.num_free_blocks:
                return None
        if table is None:
            # Hits are cached already.
            table = self.tables[rid] = RequestBlocks(
                num_hits, len(request.prompt_token_ids) // bs, self.sliding_window
            )
            if self.enable_caching:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += num_hits * bs
                lookup = self._lookup
                if lookup is not None and lookup[0] == rid:
                    self.num_device_hit_blocks += lookup[1]
                    self.num_host_hit_blocks += lookup[2]
                    self.num_miss_blocks += lookup[3]
                    self._lookup = None
        elif self.enable_caching:
            self._cache_computed(request, table, table.num_prompt_blocks)
        if num_hits:
            self.pool.touch(new_computed_blocks)
            table.blocks.extend(new_computed_blocks)
        new_blocks = tuple(self.pool.get_new_blocks(num_required)) if num_required else ()
        if self.host is not None:
            self._flush_transfers()
        table.blocks.extend(new_blocks)
        table.block_ids = tuple(b.block_id for b in table.blocks)
        if self.sliding_window is not None:
            # The step's first query sits after the computed tokens and the hits (a long hit may already
            # lie partly behind the window: those blocks go back at once).
            self._release_behind(request, table, request.num_computed_tokens + num_hits * bs)
        table.settle(bs, self.enable_caching)
        return new_blocks

    def _release_behind(self, request: Request, table: RequestBlocks, first_query: int) -> None:
        """Give back the leading blocks no query at `first_query` or later can see (every token before
        first_query - W + 1); their places keep the null block. Cached first, when caching is on."""
        bs = self.block_size
        num_dead = min((first_query - self.sliding_window + 1) // bs, len(table.blocks))
        start = table.num_released
        if num_dead <= start:
            return
        if self.enable_caching and table.num_cached < num_dead:
            self._cache_computed(request, table, num_dead)
            # Never cache a null place later (a dead block not computed yet cannot be: it precedes the query).
            table.num_cached = max(table.num_cached, num_dead)
        dead = table.blocks[start:num_dead]
        null = self.null_block
        table.blocks[start:num_dead] = [null] * (num_dead - start)
        table.block_ids = (null.block_id,) * num_dead + table.block_ids[num_dead:]
        table.num_released = num_dead
        # Oldest last: a prompt's first blocks are the likeliest to be shared, so they are evicted last.
        self.pool.free_blocks(reversed(dead))
        table.settle(bs, self.enable_caching)

    # ---- release --------------------------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Give back all of a request's blocks, caching its computed full ones first.

        Freed in reverse order: the tail of a sequence is the least shareable part, so it is evicted first.
        """
        table = self.tables.pop(request.request_id, None)
        if table is None:
            return
        if self.enable_caching:
            self._cache_computed(request, table)
            if self.pins.pending_key(request.request_id) is not None:
                self._pin_prompt(request, table)
        held = table.blocks[table.num_released :] if table.num_released else table.blocks
        self.pool.free_blocks(reversed(held))

    def _pin_prompt(self, request: Request, table: RequestBlocks) -> None:
        """A pin's prefill is freed: pin the cached blocks of its prompt (full blocks only) once computed.

        Freed before its prompt was computed: preempted (it stays pending and comes back) or aborted.
        """
        if request.num_computed_tokens < request.num_prompt_tokens:
            if request.is_finished:
                self.pins.forget(request.request_id)
            return
        num_full = request.num_prompt_tokens // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[: min(num_full, table.num_cached)]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.pins.take(request.request_id, blocks)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> int:
        """Free the request's blocks that lie entirely at or past token `num_tokens`; how many.

        Used after speculative decoding rejects tokens: slots were allocated for all proposed tokens.
        """
        table = self.tables.get(request.request_id)
        if table is None:
            return 0
        keep = -(-num_tokens // self.block_size)
        if keep >= len(table.blocks):
            return 0
        assert keep > table.num_released, "freeing past a released place: positions moved backwards"
        tail = table.blocks[keep:]
        del table.blocks[keep:]
        table.block_ids = table.block_ids[:keep]
        table.num_cached = min(table.num_cached, keep)
        table.settle(self.block_size, self.enable_caching)
        self.pool.free_blocks(reversed(tail))
        return len(tail)

    # ---- hashing and caching --------------------------------------------------------------------------------

    def _extra_for(self, request: Request) -> bytes:
        lora = request.lora
        key = request.cache_salt if lora is None else (request.cache_salt, lora.cache_key)
        extra = self._extra_bytes.get(key)
        if extra is None:
            if len(self._extra_bytes) >= _MAX_SALT_MEMO:
                self._extra_bytes.clear()
            if lora is None:
                extra = encode_extra(with_salt(self.hash_extra, request.cache_salt))
            else:
                extra = encode_extra(with_adapter(self.hash_extra, request.cache_salt, lora.cache_key))
            self._extra_bytes[key] = extra
        return extra

    def _update_hashes(self, request: Request) -> None:
        """Hash the request's full blocks not hashed yet (incremental: earlier hashes never change)."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = (len(request.prompt_token_ids) + len(request.output_token_ids)) // bs
        start = len(hashes)
        if start >= num_full:
            return
        tokens = token_slice(request, start * bs, num_full * bs)
        append_block_hashes(hashes, hashes[-1] if hashes else None, tokens, bs, self._extra_for(request))

    def _cache_computed(self, request: Request, table: RequestBlocks, max_blocks: int | None = None) -> None:
        """Index the request's full blocks whose KV is written (covered by num_computed_tokens), the first
        `max_blocks` at most."""
        start = table.num_cached
        blocks = table.blocks
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        if max_blocks is not None and max_blocks < num_full:
            num_full = max_blocks
        if num_full <= start:
            return
        hashes = request.block_hashes
        num_prompt = len(request.prompt_token_ids)
        if start * bs >= num_prompt:  # generated tokens only (a decode filled a block): one slice
            tokens = request.output_token_ids[start * bs - num_prompt : num_full * bs - num_prompt]
        else:
            tokens = token_slice(request, start * bs, num_full * bs)
        if len(hashes) == start:  # the usual case: these blocks are the next ones to hash
            append_block_hashes(hashes, hashes[-1] if hashes else None, tokens, bs, self._extra_for(request))
        if len(hashes) < (num_prompt + len(request.output_token_ids)) // bs:
            self._update_hashes(request)  # every full block is hashed, as a lookup would
        self.pool.cache_blocks(
            blocks[start:num_full], hashes[start:num_full], hashes[start - 1] if start else None, tokens, bs
        )
        table.num_cached = num_full
        table.settle(bs, True)
