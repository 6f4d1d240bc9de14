"""ModelRunner: turns one SchedulerOutput into one forward pass and one sampling pass.

`execute` reads as the data flow: `prepare_inputs` (tensors from the scheduler's output) -> `forward`
(the model writes the step's KV and returns the logits of the rows to sample) -> `sample` (plain rows)
-> `verify` (rows with speculative proposals). The first two need nothing but the scheduler's output,
which is what a tensor-parallel worker receives each step.

It owns the device-side state: the model, the paged KV cache tensors (one K and one V tensor per layer,
`[num_blocks, block_size, num_kv_heads, head_dim]`), the per-request seeded generators and the speculative
draft, if any. Everything it reads about requests comes from the scheduler's output and the Request
objects; it never mutates them.

Speculative verification happens in the same forward pass as everything else: a request scheduled with
proposals feeds its last token and the k proposals (1 + k query rows over its paged context); the k + 1
rows' logits go to the rejection sampler, which returns the accepted proposals plus one corrected or
bonus token. Requests without proposals go through the plain sampler, unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tokenfleet.kernels.lora import LoRABatch, make_lora_batch_from_runs
from tokenfleet.runtime.config import CacheConfig, ModelConfig
from tokenfleet.runtime.engine.compiled_decode import (
    COMPILE_CACHE_DIR,
    CompiledDecode,
    decode_buckets,
    should_compile,
)
from tokenfleet.runtime.engine.kv_cache.kv_tensors import (
    allocate_kv_caches,
    release_kv_caches,
    restore_kv_caches,
)
from tokenfleet.runtime.engine.logits_buffer import LogitsBuffer
from tokenfleet.runtime.engine.logprobs import compute_logprobs, compute_prompt_logprobs
from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.engine.parallel.workers import TPWorkers
from tokenfleet.runtime.engine.persistent_block_table import PersistentBlockTable
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampler import Sampler, SamplingMetadata, advance_generator
from tokenfleet.runtime.engine.scheduler_output import PromptLogprobsChunk, SchedulerOutput
from tokenfleet.runtime.engine.sleep_weights import SleepingWeights, release_host_heap
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput, Proposer
from tokenfleet.runtime.engine.spec_decode.rejection_sampler import RejectionSampler
from tokenfleet.runtime.engine.spec_decode.verify_rows import build_verify_batch
from tokenfleet.runtime.engine.step_clock import StepClock
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.attention.base import AttentionMetadata
from tokenfleet.runtime.model.attention.metadata import build_step_metadata, to_device
from tokenfleet.runtime.model.loader import LoadedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(model_config: ModelConfig) -> torch.device:
    if model_config.device == "cuda" or (model_config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("model.device is 'cuda' but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def kv_cache_dtype(cache: CacheConfig, loaded: LoadedModel) -> torch.dtype:
    """`auto` stores K/V in the model's dtype; `fp8_e4m3` in e4m3 with per-tensor scales (a quarter of fp32's
    bytes: four times the blocks for the same budget)."""
    return torch.float8_e4m3fn if cache.kv_cache_dtype == "fp8_e4m3" else loaded.dtype


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    arch = loaded.model.arch  # this rank's shard
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_kv_blocks(
    cache: CacheConfig,
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks from an explicit count, else from the memory budget (device memory or the CPU GiB budget).

    `extra_bytes_per_block`: what a block costs besides the target's KV (a draft model's mirrored cache).
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(loaded, cache.block_size, dtype) + extra_bytes_per_block
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = cache.gpu_memory_utilization * total - used - 512 * 2**20  # headroom for activations
    else:
        budget = cache.cpu_kv_cache_gib * 2**30
    blocks = int(budget // per_block)
    if blocks < 2:
        raise ConfigError(f"KV cache budget too small: {budget / 2**20:.0f} MiB for {per_block} B blocks")
    return blocks


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step's model inputs, built from the SchedulerOutput alone."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn_meta: AttentionMetadata
    logit_rows: torch.Tensor  # int64 [N]: rows of the hidden states to compute logits for
    sample_ids: tuple[str, ...]  # one row each, first in logit_rows
    verify_ids: tuple[str, ...]  # k + 1 rows each, after the sample rows
    verify_drafts: tuple[tuple[int, ...], ...]
    # Prompt positions to score, one row each, last in logit_rows (empty unless a request asks for them).
    prompt_chunks: tuple[PromptLogprobsChunk, ...] = ()
    num_prompt_rows: int = 0
    lora: LoRABatch | None = None  # each token's adapter slot, when any entry uses an adapter


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs | None]]
    # Per request scoring its prompt in the step: its scored positions' logprobs, in position order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        device: torch.device,
        num_blocks: int,
        proposer: Proposer | None = None,
        workers: TPWorkers | None = None,
        compile: str = "off",
        max_num_seqs: int = 64,
        compile_batch_sizes: Sequence[int] | None = None,
    ):
        self.loaded = loaded
        self.workers = workers  # tensor parallel (rank 0): each step goes to the other ranks first
        self.model = loaded.model
        self.device = device
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        arch = loaded.model.arch  # the shard's: its KV heads only under tensor parallelism
        dtype = kv_cache_dtype(cache_config, loaded)
        compiled = should_compile(compile, device, loaded.model)
        # A compiled decode step pads its batch; padding rows write their K/V into one spare block past the
        # scheduler's blocks.
        shape = (num_blocks + int(compiled), self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = allocate_kv_caches(arch.num_layers, shape, dtype, device)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.proposer = proposer
        if proposer is not None:
            proposer.bind(self.kv_caches, num_blocks, self.block_size)
        self._generators: dict[str, torch.Generator] = {}
        # The sampling rows of the last step and their metadata: while a batch keeps its requests (most
        # decode steps) the parameter tensors are reused instead of rebuilt and copied to the device.
        self._sampling_rows: tuple[list[Request], SamplingMetadata | None] = ([], None)
        # CPU: big logits tensors written into one kept buffer instead of fresh pages every step.
        self.logits_buffer = LogitsBuffer(
            max_num_seqs, enabled=device.type == "cpu" and loaded.model.logits_into_buffer
        )
        # Last step's block table: a step rewrites only the rows whose request's blocks changed.
        self.block_table = PersistentBlockTable()
        # Model vs host time per step, on the host clock: only where the model runs on the host.
        self.clock = StepClock(enabled=device.type == "cpu")
        self.compiled: CompiledDecode | None = None
        if compiled:
            self.compiled = CompiledDecode(
                loaded.model,
                self.kv_caches,
                device,
                buckets=decode_buckets(max_num_seqs, compile_batch_sizes),
                max_blocks_per_seq=-(-loaded.max_model_len // self.block_size),
                scratch_slot=num_blocks * self.block_size,
            )
            seconds = self.compiled.warm_up()
            logger.info(
                "decode steps compiled for batch sizes %s in %.1f s (cache: %s)",
                list(self.compiled.buckets),
                seconds,
                COMPILE_CACHE_DIR,
            )
        logger.info(
            "KV cache: %d blocks x %d tokens of %s (%.0f MiB), attention backend %s on %s",
            num_blocks,
            self.block_size,
            dtype,
            kv_bytes_per_block(loaded, self.block_size, dtype) * num_blocks / 2**20,
            loaded.attention_backend,
            device,
        )

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            # A request resumed from another pod already drew one sample per output token there.
            advance_generator(gen, len(request.output_token_ids))
            self._generators[request.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator) once the request is finished or aborted."""
        self._generators.pop(request_id, None)
        self._sampling_rows = ([], None)  # the rows change with the next step anyway; drop its references

    # ---- sleep mode -----------------------------------------------------------------------------------------
    # Its state lives in attributes `sleep` sets (absent until the first sleep): `_sleep_kv`, `_sleep_weights`
    # (a SleepingWeights) and `_sleep_compiled` (the closed compiled step, rebuilt from its settings).

    def sleep(self, level: int) -> dict[str, int]:
        """Free the KV cache; level 1 moves the weights to host memory (nothing to move on the CPU, where
        they already are), level 2 discards them. Bytes freed per part. The engine is idle (no request
        holds a block) and steps only after `wake_up`."""
        freed = {"kv_cache": release_kv_caches(self.kv_caches), "weights": 0}
        self._sleep_kv = True
        if self.compiled is not None:
            # Its graphs read the KV and weight addresses they were captured with: rebuilt on wake.
            self._sleep_compiled = self.compiled
            self.compiled.close()
            self.compiled = None
        if level == 2:
            self._sleep_weights = SleepingWeights.discard(self.model)
            freed["weights"] = self._sleep_weights.nbytes
        elif self.device.type != "cpu":
            self._sleep_weights = SleepingWeights.offload(self.model)
            freed["weights"] = self._sleep_weights.nbytes
        self._generators.clear()
        self._sampling_rows = ([], None)
        self.logits_buffer.release()
        return freed

    @property
    def weights_asleep(self) -> bool:
        return getattr(self, "_sleep_weights", None) is not None

    @property
    def kv_asleep(self) -> bool:
        return getattr(self, "_sleep_kv", False)

    def wake_weights(self, reload) -> None:
        """Restore the weights: from host memory (level 1) or from `reload()`, the model loaded again from
        its source by the start-up loader (level 2)."""
        sleeping = getattr(self, "_sleep_weights", None)
        if sleeping is None:
            return
        fresh = reload() if sleeping.host is None else None
        sleeping.restore(fresh.model if fresh is not None else None)
        self._sleep_weights = None
        if fresh is not None:
            del fresh  # the reloaded copy: its memory goes back, not just to the allocators' free lists
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            release_host_heap()
        self._rebuild_compiled()

    def wake_kv_cache(self) -> None:
        """Re-allocate the KV cache (zeroed), and the compiled decode step once the weights are back too."""
        if self.kv_asleep:
            restore_kv_caches(self.kv_caches)
            self._sleep_kv = False
        self._rebuild_compiled()

    def _rebuild_compiled(self) -> None:
        old = getattr(self, "_sleep_compiled", None)
        if old is not None and not self.weights_asleep and not self.kv_asleep:
            self.compiled = CompiledDecode(
                self.model,
                self.kv_caches,
                self.device,
                buckets=old.buckets,
                max_blocks_per_seq=old.max_blocks_per_seq,
                scratch_slot=old.scratch_slot,
            )
            self._sleep_compiled = None
            self.compiled.warm_up()

    # ---- the step: prepare inputs -> forward -> logits -> sample -> verify ---------------------------------

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> ModelRunnerOutput:
        if self.workers is not None:
            self.workers.broadcast(output)
        inputs = self.prepare_inputs(output)
        self.clock.begin()
        try:
            logits = self.forward(inputs)
        except RuntimeError:  # a collective failed: name the worker that died, if one did
            if self.workers is not None:
                self.workers.check()
            raise
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs | None]] = {}
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if inputs.num_prompt_rows:
            num_rows = logits.shape[0] - inputs.num_prompt_rows
            prompt_logprobs = compute_prompt_logprobs(logits[num_rows:], inputs.prompt_chunks)
            logits = logits[:num_rows]
        num_sample = len(inputs.sample_ids)
        if num_sample:
            self.sample(logits[:num_sample], [requests[rid] for rid in inputs.sample_ids], sampled, logprobs)
        if inputs.verify_ids:
            verify_reqs = [requests[rid] for rid in inputs.verify_ids]
            self.verify(logits[num_sample:], verify_reqs, inputs.verify_drafts, sampled, logprobs)
        self.clock.end()  # the model's work ends with the sampler's (on a GPU both are device kernels)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def prepare_inputs(self, output: SchedulerOutput) -> StepInputs:
        """Token ids, positions and paged-attention metadata of one step, from the scheduler's output only
        (no Request objects: a tensor-parallel worker builds the same inputs from the same message).

        Per request only list appends; the tensors are built batch-wide and reach the device in one
        asynchronous copy (`to_device`), so preparing a step never waits for the device.
        """
        # The plain decodes first, whole columns at a time: row i is decode i, and each samples.
        decodes = output.decodes
        num_decodes = len(decodes)
        input_ids: list[int] = list(decodes.token_ids)
        rids: list[str] = list(decodes.request_ids)
        starts: list[int] = list(decodes.start_pos)
        query_lens: list[int] = [1] * num_decodes
        tables: list[tuple[int, ...]] = list(decodes.block_ids)
        sample_rows: list[int] = list(range(num_decodes))
        sample_ids: list[str] = list(decodes.request_ids)
        verify_rows: list[int] = []  # k + 1 rows per request with proposals
        verify_ids: list[str] = []
        verify_drafts: list[tuple[int, ...]] = []
        for rid, token_ids, start_pos, block_ids, sample, spec in output.others:
            input_ids += token_ids
            rids.append(rid)
            starts.append(start_pos)
            tables.append(block_ids)
            if spec:
                input_ids += spec
                query_lens.append(len(token_ids) + len(spec))
            else:
                query_lens.append(len(token_ids))
            if not sample:
                continue
            last = len(input_ids) - 1
            if spec:
                verify_rows.extend(range(last - len(spec), last + 1))
                verify_ids.append(rid)
                verify_drafts.append(spec)
            else:
                sample_rows.append(last)
                sample_ids.append(rid)
        prompt_rows = _prompt_rows(output) if output.prompt_logprobs else []
        block_tables = self.block_table.build(rids, tables)
        meta, positions = build_step_metadata(starts, query_lens, tables, self.block_size, block_tables)
        ids_t, positions, rows_t, slot_mapping, query_start_loc, seq_lens, block_tables = to_device(
            (
                torch.tensor(input_ids, dtype=torch.long),
                positions,
                torch.tensor(sample_rows + verify_rows + prompt_rows, dtype=torch.long),
                meta.slot_mapping,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
            ),
            self.device,
        )
        lora = None
        if output.lora_slots:
            runs = list(zip(output.lora_slots, query_lens, strict=True))  # (slot, its rows) per entry
            lora = make_lora_batch_from_runs(runs, self.device)
        return StepInputs(
            input_ids=ids_t,
            positions=positions,
            attn_meta=dataclasses.replace(
                meta,
                slot_mapping=slot_mapping,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=block_tables,
            ),
            logit_rows=rows_t,
            sample_ids=tuple(sample_ids),
            verify_ids=tuple(verify_ids),
            verify_drafts=tuple(verify_drafts),
            prompt_chunks=output.prompt_logprobs,
            num_prompt_rows=len(prompt_rows),
            lora=lora,
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the step's tokens (writing their KV); logits [rows, V] of the rows to sample from:
        first one row per plain sample, then k + 1 rows per request with k proposals."""
        if self.compiled is not None and inputs.lora is None and self.compiled.supports(inputs.attn_meta):
            # One row per sequence, so every row's logits come out; keep the ones asked for, in their order.
            logits = self.compiled.logits(inputs.input_ids, inputs.positions, inputs.attn_meta)
            if self.proposer is not None:
                self.proposer.observe(inputs.input_ids, inputs.positions, inputs.attn_meta)
            return logits.index_select(0, inputs.logit_rows)
        if inputs.lora is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_meta)
        else:
            lora_slots = self.model.lora  # the hooks read the step's token -> slot map while it runs
            lora_slots.batch = inputs.lora
            try:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_meta)
            finally:
                lora_slots.batch = None
        if self.proposer is not None:
            self.proposer.observe(inputs.input_ids, inputs.positions, inputs.attn_meta)
        if inputs.logit_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = inputs.logit_rows.numel()
        out = self.logits_buffer.take(rows, self.model.arch.vocab_size)
        return self.model.compute_logits(hidden.index_select(0, inputs.logit_rows), out=out)

    def sample(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs | None]],
    ) -> None:
        """One token per request (row i is reqs[i]'s last position); adds them (and logprobs) to the dicts."""
        rows, sampling_meta = self._sampling_rows
        if (
            sampling_meta is not None and rows == reqs
        ):  # the same Request objects in the same order (identity: eq=False)
            sampling_meta = sampling_meta.refresh(reqs, self.device)
        else:
            generators = {r.request_id: g for r in reqs if (g := self._generator(r)) is not None}
            sampling_meta = SamplingMetadata.build(reqs, generators, self.device)
            self._sampling_rows = (reqs, sampling_meta)
        result = self.sampler(logits, sampling_meta)
        for r, tok, lp in zip(reqs, result.token_ids, result.logprobs, strict=True):
            sampled[r.request_id] = [tok]
            logprobs[r.request_id] = [lp]

    def verify(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        drafts: Sequence[tuple[int, ...]],
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs | None]],
    ) -> None:
        """Rejection-sample the proposals of `reqs` (k + 1 logit rows each); adds their emitted tokens (and
        logprobs) to the dicts."""
        generators = {r.request_id: g for r in reqs if (g := self._generator(r)) is not None}
        batch = build_verify_batch(reqs, list(drafts), generators, self.device)
        emitted = self.rejection_sampler(logits, batch)
        want = [r.sampling_params.logprobs for r in reqs]
        lp_rows: list[int] = []
        lp_tokens: list[int] = []
        lp_want: list[int | None] = []
        for r, start, tokens, k in zip(reqs, batch.row_start, emitted, want, strict=True):
            sampled[r.request_id] = tokens
            logprobs[r.request_id] = [None] * len(tokens)
            if k is not None:
                lp_rows.extend(range(start, start + len(tokens)))
                lp_tokens.extend(tokens)
                lp_want.extend([k] * len(tokens))
        if lp_rows:
            # Emitted token j was decided by row j: its logprob is under that row's raw distribution.
            index = torch.tensor(lp_rows, device=self.device)
            token_t = torch.tensor(lp_tokens, dtype=torch.int64, device=self.device)
            lps = iter(compute_logprobs(logits.index_select(0, index), token_t, lp_want, max(lp_want)))
            for r, tokens, k in zip(reqs, emitted, want, strict=True):
                if k is not None:
                    logprobs[r.request_id] = [next(lps) for _ in tokens]

    @torch.inference_mode()
    def propose(self, batch: list[ProposalInput]) -> list[list[int]]:
        """The draft's proposals for the next step (model drafts write KV into the scheduler's look-ahead
        slots)."""
        if self.proposer is None or not batch:
            return [[] for _ in batch]
        if self.workers is None:
            return self.proposer.propose(batch)
        self.workers.broadcast_proposals(batch)  # tensor parallel: a self-draft runs on every rank
        try:
            return self.proposer.propose(batch)
        except RuntimeError:  # a collective failed: name the worker that died, if one did
            self.workers.check()
            raise


def _prompt_rows(output: SchedulerOutput) -> list[int]:
    """Rows of the step's tokens at the prompt positions to score, in the order of the chunks."""
    first_row: dict[str, tuple[int, int]] = {}  # request id -> (its first row, the position there)
    row = 0
    for entry in output.scheduled:
        first_row[entry.request_id] = (row, entry.start_pos)
        row += entry.num_tokens
    rows: list[int] = []
    for chunk in output.prompt_logprobs:
        base, start_pos = first_row[chunk.request_id]
        first = base + chunk.first_position - start_pos
        rows.extend(range(first, first + len(chunk.target_token_ids)))
    return rows
