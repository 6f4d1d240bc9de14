"""ModelRunner: turns one SchedulerOutput into one forward pass and one sampling pass.

It owns the device-side state: the model, the paged KV cache tensors (one K and one V tensor per layer,
`[num_blocks, block_size, num_kv_heads, head_dim]`) and the per-request seeded generators. Everything it
reads about requests comes from the scheduler's output and the Request objects; it never mutates them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from tokenfleet.runtime.config import CacheConfig, ModelConfig
from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampler import Sampler, SamplingMetadata
from tokenfleet.runtime.engine.scheduler_output import SchedulerOutput
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata
from tokenfleet.runtime.model.loader import LoadedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(model_config: ModelConfig) -> torch.device:
    if model_config.device == "cuda" or (model_config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("model.device is 'cuda' but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    arch = loaded.arch
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_kv_blocks(cache: CacheConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> int:
    """Blocks from an explicit count, else from the memory budget (device memory or the CPU GiB budget)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(loaded, cache.block_size, dtype)
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
class ModelRunnerOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs | None]]


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig,
        device: torch.device,
        num_blocks: int,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        arch = loaded.arch
        dtype = loaded.dtype
        shape = (num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_layers)
        ]
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        logger.info(
            "KV cache: %d blocks x %d tokens (%.0f MiB), attention backend %s on %s",
            num_blocks,
            self.block_size,
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
            self._generators[request.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator) once the request is finished or aborted."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> ModelRunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        seq_specs: list[SeqSpec] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for sched in output.scheduled:
            tokens = list(sched.token_ids) + list(sched.spec_token_ids)
            input_ids.extend(tokens)
            positions.extend(range(sched.start_pos, sched.start_pos + len(tokens)))
            seq_specs.append(SeqSpec(sched.start_pos, len(tokens), sched.block_ids))
            if sched.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(requests[sched.request_id])
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        meta = build_attention_metadata(seq_specs, self.block_size, self.device)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        if not sample_reqs:
            return ModelRunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        generators = {r.request_id: g for r in sample_reqs if (g := self._generator(r)) is not None}
        sampling_meta = SamplingMetadata.build(sample_reqs, generators, self.device)
        result = self.sampler(logits, sampling_meta)
        sampled = {r.request_id: [tok] for r, tok in zip(sample_reqs, result.token_ids, strict=True)}
        logprobs = {r.request_id: [lp] for r, lp in zip(sample_reqs, result.logprobs, strict=True)}
        return ModelRunnerOutput(sampled, logprobs)
