"""RuntimeConfig: the one schema a runtime pod (and the router) is configured with.

Importable without torch: the operator builds it from the custom resources, writes it into a ConfigMap, and
the pod reads it with `tokenfleet serve --config PATH`. Field names are snake_case here; the CRDs use
camelCase and operator/builders.py maps between them.

`LIVE_FIELDS` names what a running pod may change on a config reload; everything else needs a restart
(the operator rolls pods by changing the config-hash annotation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from tokenfleet.runtime.config_file import load_config

DEFAULT_MODEL = "smollm2-135m-instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    model: str = Field(
        DEFAULT_MODEL, description="Built-in name, a .gguf file, or a HF checkpoint directory."
    )
    served_name: str | None = Field(None, description="Name clients use in `model`; defaults to `model`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on CPU (fastest correct there), bfloat16 on CUDA."
    )
    quantization: Literal["none", "fp8"] = "none"
    max_model_len: int | None = Field(None, gt=0, description="Defaults to the model's context length.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="auto = triton on CUDA, torch elsewhere."
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Decode steps through torch.compile (CUDA graphs on CUDA, inductor C++ on CPU), one graph "
        "per padded batch size, compiled at start-up. auto = on CUDA when the model supports it (otherwise "
        "eager, the reason logged); eager on CPU, where a compiled step measured no faster than eager and "
        "costs minutes of start-up. on = wherever the model supports it, a ConfigError at start-up where it "
        "does not (tensor parallelism, MoE layers, fp8 weights, attention_backend torch on CUDA).",
    )
    compile_batch_sizes: list[PositiveInt] | None = Field(
        None,
        description="Batch sizes compiled ahead when decode is compiled (each is a whole-model compile, and "
        "on CUDA a graph capture, at start-up). Default: the powers of two up to scheduler.max_num_seqs, "
        "and max_num_seqs itself. A decode step pads to the next compiled size; a larger one runs eagerly.",
    )
    context_overflow: Literal["reject", "truncate"] = Field(
        "reject",
        description="A prompt longer than the context allows: reject it (400), or truncate it (chat: keep the "
        "system message and the most recent whole turns; completions: drop tokens from the left).",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="auto = requests that do not set temperature / top_p / top_k / min_p / "
        "repetition_penalty use the checkpoint's defaults (generation_config.json, GGUF general.sampling.*); "
        "none = OpenAI's neutral values.",
    )
    default_max_tokens: int | None = Field(
        None,
        gt=0,
        description="Bounds the output of requests that set no max_tokens (with the checkpoint's "
        "max_new_tokens, the smaller wins; never more than the context left after the prompt). None = "
        "OpenAI's behaviour: up to the context length, unless the checkpoint's generation config (with "
        "generation_config auto) sets max_new_tokens; the built-in model's entry sets 512.",
    )

    weight_cache_dir: str | None = Field(
        None,
        description="A directory for converted weights (dequantised, cast, sharded), one entry per model, "
        "dtype, device type and shard: the next process loading the same model maps the entry instead of "
        "converting the checkpoint again. Written after the first load, checked (size, CRC-32) on every "
        "load. The operator points it at the model cache volume of hf:// models. None = off.",
    )

    @property
    def name(self) -> str:
        return self.served_name or self.model


class CacheConfig(_Strict):
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, description="Tokens per KV block.")
    enable_prefix_caching: bool = True
    num_blocks: int | None = Field(None, gt=0, description="Fixed KV block count; overrides the budgets.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="CUDA: fraction of device memory.")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="CPU: KV cache budget in GiB.")
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    cache_salt: str | None = Field(None, description="Mixed into every block hash (tenant isolation).")
    ttl_seconds: float | None = Field(
        None, gt=0, description="Unreferenced cached blocks older than this go first."
    )
    eviction: Literal["lru", "lfu", "s3fifo"] = "lru"
    pinned_prefixes: tuple[str | tuple[int, ...], ...] = Field(
        (),
        description="Prefixes kept cached: texts (tokenized without added special tokens, so write them as "
        "they start the rendered prompt) or lists of token ids. Only whole blocks are pinned.",
    )
    max_pinned_fraction: float = Field(0.25, ge=0, le=1)
    cpu_offload_gib: float = Field(0.0, ge=0, description="Host-memory tier for evicted KV blocks; 0 = off.")


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(64, gt=0, description="Most requests running in one step.")
    max_num_batched_tokens: int = Field(1024, gt=0, description="Token budget of one step (chunked prefill).")
    max_waiting: int = Field(256, ge=0, description="Bounded waiting queue; beyond it requests get 429.")
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: a waiting request waits for room in the batch whatever its priority. priority: "
        "a waiting request preempts running ones of a strictly lower priority (a larger number) when the "
        "batch or the KV cache is full (vLLM's --scheduling-policy).",
    )
    fair_share: bool = Field(
        False,
        description="Within a priority, admit the waiting request of the tenant that has received the least "
        "service (prompt tokens computed + 2 x generated tokens), first come first served within a tenant; "
        "priorities stay strict. The tenant: the x-tokenfleet-tenant header from a trusted caller, else the "
        "client's API key.",
    )


class SpeculativeConfig(_Strict):
    method: Literal["none", "ngram", "draft", "self"] = "none"
    num_speculative_tokens: int = Field(3, ge=1, le=16)
    draft_model: str | None = None
    draft_layers: int = Field(8, ge=1, description="`self`: layers of the target used as the draft.")
    ngram_min: int = Field(3, ge=1, description="Shortest n-gram matched; 1-2 propose noise on open chat.")
    ngram_max: int = Field(4, ge=1)


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Shards of one model (Megatron-style tensor parallelism), one worker process and one "
        "device each; heads, KV heads, vocabulary and experts must divide by it.",
    )


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = Field(None, description="One key per line (a mounted Secret).")
    internal_api_key_file: str | None = Field(
        None,
        description="The deployment's internal key (first line; a mounted Secret, re-read live): routers and "
        "the other role's pods call with it. When set, the internal endpoints (KV events, KV transfer, holds, "
        "config, tokenizer) require it and the tenant header is trusted only with it.",
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    drain_seconds: float = Field(30.0, ge=0, description="SIGTERM grace: in-flight requests may finish.")
    health_stall_seconds: float = Field(30.0, gt=0, description="/health fails when work waits this long.")
    stream_interval: int = Field(
        1,
        ge=1,
        description="A streamed request's tokens go out once at least this many are held (SGLang's "
        "--stream-interval): fewer, larger SSE events, so the server's per-event work (and the GIL it shares "
        "with the engine) costs less per token, at the price of burstier streams. The first token and the "
        "last always go out at once; the tokens, text and stop points are the same at every interval. Live: "
        "a running pod applies a change between steps.",
    )
    enable_sleep_mode: bool = Field(
        False,
        description="Expose vLLM's sleep-mode endpoints (POST /sleep?level=1|2, POST /wake_up, GET "
        "/is_sleeping; internal key): a sleeping pod frees its KV cache (level 1 keeps the weights in host "
        "memory, level 2 discards them and reloads them on wake), answers 503 `sleeping` and is not ready.",
    )


class LoRAModuleSpec(_Strict):
    """An adapter loaded at start-up (vLLM's `--lora-modules name=path`, or its JSON form)."""

    name: str = Field(min_length=1, description="The `model` clients send to use the adapter.")
    path: str = Field(
        min_length=1,
        description="Folder with adapter_config.json + adapter_model.safetensors, or hf://ORG/NAME[@REVISION] "
        "(downloaded when first needed, into lora.download_dir).",
    )
    base_model_name: str | None = Field(
        None, description="Listed as the adapter's `parent`; default the model."
    )


class LoRAConfig(_Strict):
    """LoRA adapters served on top of the base model (vLLM's flags and defaults)."""

    enable: bool = Field(False, description="Serve PEFT LoRA adapters (`--enable-lora`).")
    modules: tuple[LoRAModuleSpec, ...] = ()
    max_loras: int = Field(1, gt=0, le=64, description="Distinct adapters in one batch (device slots).")
    max_lora_rank: int = Field(16, gt=0, le=512, description="Largest adapter rank served (slot width).")
    max_cpu_loras: int | None = Field(
        None,
        gt=0,
        description="Adapters loaded at once (host memory); loading one more evicts the least recently used "
        "idle one (loaded again from its path when asked for). Default and minimum: max_loras.",
    )
    download_dir: str | None = Field(
        None,
        description="Where hf:// adapters are downloaded (a cache verified by digest, one entry per commit); "
        "default tokenfleet-adapters in the temp directory.",
    )

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora.modules names must be unique, got {names}")
        if self.modules and not self.enable:
            raise ValueError("lora.modules given but lora.enable is false (--enable-lora)")
        return self

    @property
    def host_limit(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class MetricsConfig(_Strict):
    naming: Literal["tokenfleet", "vllm"] = Field(
        "tokenfleet",
        description="Metric names on /metrics: `tokenfleet:*`, or vLLM's `vllm:*` names, types and labels "
        "for what vLLM also reports (endpoint pickers, KEDA/Prometheus rules and dashboards written for vLLM).",
    )


class RuntimeConfig(_Strict):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()
    server: ServerConfig = ServerConfig()
    metrics: MetricsConfig = MetricsConfig()
    lora: LoRAConfig = LoRAConfig()

    @classmethod
    def load(cls, path: str | Path) -> RuntimeConfig:
        return load_config(cls, path, "runtime config")

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=True)


# Fields a running pod applies on reload without a restart (dotted paths).
LIVE_FIELDS: frozenset[str] = frozenset(
    {
        "cache.ttl_seconds",
        "cache.eviction",
        "cache.pinned_prefixes",
        "cache.max_pinned_fraction",
        "cache.cpu_offload_gib",
        "scheduler.max_waiting",
        "lora.modules",
        "lora.max_cpu_loras",
        "server.api_keys",
        "server.api_key_file",
        "server.internal_api_key_file",
        "server.drain_seconds",
        "server.stream_interval",
    }
)
