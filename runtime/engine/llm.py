"""LLM: the offline API, shaped like vLLM's — `LLM(model=...).generate(prompts, SamplingParams)` and
`.chat(messages)` return one `RequestOutput` per prompt with its n `CompletionOutput`s.

Prompts are text, token ids (a list of ints, or vLLM's `{"prompt_token_ids": [...]}`), or `{"prompt": text}`.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.runtime.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
)
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.engine.offline_outputs import (
    CompletionOutput,
    RequestOutput,
    prompt_logprobs,
    sample_logprobs,
)
from tokenfleet.runtime.engine.outputs import RequestDelta, TokenLogprobs
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.loader import LoadedModel

Prompt = str | list[int] | Mapping[str, Any]
Message = Mapping[str, Any]
ProgressBar = bool | Callable[..., Any]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT LoRA adapter to run a prompt under, as vLLM's offline API names it (`lora_int_id` is kept
    for scripts written for vLLM; the name identifies the adapter). Loaded on first use."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True, slots=True)
class _Submitted:
    """One prompt as submitted: its text (None for token ids), its ids and its n engine requests."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    engine_ids: list[str]


class LLM:
    """Runs many prompts through one continuous-batching engine and returns whole outputs in order.

    Keyword arguments are fields of ModelConfig, CacheConfig, SchedulerConfig or ParallelConfig (e.g.
    `block_size=16`, `num_blocks=64`, `max_num_batched_tokens=32`, `tensor_parallel_size=2`), or pass a full
    `config=`. With tensor parallelism, `shutdown()` stops the worker processes (they also stop with this
    process); a script that uses it needs the `if __name__ == "__main__":` guard, because the spawned
    workers import the main module.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: RuntimeConfig | None = None,
        loaded: LoadedModel | None = None,
        **overrides: object,
    ):
        config = config or RuntimeConfig()
        sections: dict[str, dict[str, object]] = {
            "model": {},
            "cache": {},
            "scheduler": {},
            "parallel": {},
            "lora": {},
        }
        if model is not None:
            sections["model"]["model"] = model
        for key, value in overrides.items():
            if key == "enable_lora":  # vLLM's name for lora.enable
                key = "enable"
            for name, cls in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
                ("parallel", ParallelConfig),
                ("lora", LoRAConfig),
            ):
                if key in cls.model_fields:
                    sections[name][key] = value
                    break
            else:
                raise TypeError(f"LLM() got an unknown option {key!r}")
        config = config.model_copy(
            update={
                name: getattr(config, name).model_copy(update=values)
                for name, values in sections.items()
                if values
            }
        )
        # Re-validate: model_copy(update=...) skips validation.
        self.config = RuntimeConfig.model_validate(config.model_dump())
        self.engine = EngineCore(self.config, loaded=loaded)
        self.engine.prefill_pins()
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given no SamplingParams: the checkpoint's generation config
        (`model.generation_config: auto`; `max_new_tokens` becomes max_tokens), else SamplingParams'
        defaults — as vLLM's LLM does. The server's `model.default_max_tokens` does not apply offline."""
        if self.config.model.generation_config == "none":
            return SamplingParams()
        defaults = getattr(self.engine.loaded, "generation_defaults", None)
        return SamplingParams(**(defaults.as_dict() if defaults is not None else {}))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: ProgressBar = True,
        on_step: Callable[[list[RequestDelta]], None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one RequestOutput per prompt, in the prompts' order.

        With `n > 1` a prompt's n completions are its `outputs` (a given seed becomes seed + i for the
        i-th). `use_tqdm`: a progress bar over the prompts (or a tqdm-like factory); `on_step` sees each
        engine step's deltas (for streaming to a terminal). `lora_request`: the adapter of every prompt,
        or one per prompt (None: the base model); needs `enable_lora=True`.
        """
        if isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        items = [self._prompt(p) for p in prompts]  # type: ignore[union-attr]
        return self._run(items, sampling_params, use_tqdm, on_step, lora_request)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: ProgressBar = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        on_step: Callable[[list[RequestDelta]], None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, rendered with the model's chat template
        (`tools` passed to it, as the server does); one RequestOutput per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        items = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation), add_generation_prompt=add_generation_prompt, **extra
            )
            # The template already holds the special tokens (BOS, role markers): add none.
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm, on_step, lora_request)

    def _load_lora(self, lora: LoRARequest) -> str:
        """The adapter's name, loading it from `lora_path` the first time it is named."""
        manager = self.engine.lora
        if manager is None:
            raise ValueError("lora_request needs LoRA on: LLM(..., enable_lora=True)")
        known = {name: path for name, path, _ in manager.known()}
        if lora.lora_name not in known:
            if not lora.lora_path:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} is not loaded and has no lora_path")
            manager.register(lora.lora_name, lora.lora_path)
        elif lora.lora_path and lora.lora_path != known[lora.lora_name]:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} is loaded from {known[lora.lora_name]}, not {lora.lora_path}"
            )
        return lora.lora_name

    def _prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt mapping needs `prompt` or `prompt_token_ids`")
        return None, list(prompt)

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: ProgressBar,
        on_step: Callable[[list[RequestDelta]], None] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(lora_request, Sequence):
            if len(lora_request) != len(items):
                raise ValueError("one lora_request per prompt, or a single one for all")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(items)
        lora_names = [None if lora is None else self._load_lora(lora) for lora in loras]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, Sequence):
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(items)
        if len(params_list) != len(items):
            raise ValueError("one SamplingParams per prompt, or a single one for all")

        submitted: list[_Submitted] = []
        for (text, ids), p, lora_name in zip(items, params_list, lora_names, strict=True):
            rid = str(next(self._ids))
            engine_ids = [rid] if p.n == 1 else [f"{rid}-{i}" for i in range(p.n)]
            for i, engine_id in enumerate(engine_ids):
                sub = copy.deepcopy(p)
                sub.n = 1
                if p.seed is not None:
                    sub.seed = p.seed + i
                if i:  # the n completions share the prompt: the first one scores it
                    sub.prompt_logprobs = None
                self.engine.add_request(engine_id, ids, sub, lora_name=lora_name)
            submitted.append(_Submitted(rid, text, ids, engine_ids))

        tokens: dict[str, list[int]] = {e: [] for s in submitted for e in s.engine_ids}
        texts: dict[str, list[str]] = {e: [] for e in tokens}
        logprobs: dict[str, list[TokenLogprobs]] = {e: [] for e in tokens}
        final: dict[str, RequestDelta] = {}
        scored: dict[str, list[TokenLogprobs]] = {}  # prompt logprobs, by engine id
        owner = {e: s for s in submitted for e in s.engine_ids}
        remaining = {s.request_id: len(s.engine_ids) for s in submitted}
        bar = _progress_bar(use_tqdm, len(submitted))
        try:
            while self.engine.has_unfinished():
                step_outputs = self.engine.step()
                if on_step is not None:
                    on_step(step_outputs)
                for out in step_outputs:
                    tokens[out.request_id].extend(out.new_token_ids)
                    texts[out.request_id].append(out.new_text)
                    if out.new_logprobs:
                        logprobs[out.request_id].extend(out.new_logprobs)
                    if out.prompt_logprobs is not None:
                        scored[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        final[out.request_id] = out
                        rid = owner[out.request_id].request_id
                        remaining[rid] -= 1
                        if bar is not None and remaining[rid] == 0:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()

        def completion(index: int, engine_id: str) -> CompletionOutput:
            lps, cumulative = None, None
            if logprobs[engine_id]:
                lps, cumulative = sample_logprobs(logprobs[engine_id], self._decode_one)
            return CompletionOutput(
                index=index,
                text="".join(texts[engine_id]),
                token_ids=tokens[engine_id],
                cumulative_logprob=cumulative,
                logprobs=lps,
                finish_reason=final[engine_id].finish_reason,
                stop_reason=final[engine_id].stop_reason,
            )

        return [
            RequestOutput(
                request_id=s.request_id,
                prompt=s.prompt,
                prompt_token_ids=s.token_ids,
                outputs=[completion(i, e) for i, e in enumerate(s.engine_ids)],
                finished=True,
                prompt_logprobs=(
                    prompt_logprobs(scored[s.engine_ids[0]], self._decode_one)
                    if s.engine_ids[0] in scored
                    else None
                ),
                num_cached_tokens=final[s.engine_ids[0]].num_cached_tokens,
            )
            for s in submitted
        ]

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _progress_bar(use_tqdm: ProgressBar, total: int):
    """A bar over the prompts (tqdm, which the runtime already installs with gguf), or None when off."""
    if use_tqdm is False:
        return None
    if callable(use_tqdm):
        factory = use_tqdm
    else:
        try:
            from tqdm.auto import tqdm as factory
        except ImportError:  # tqdm comes with gguf; without it, generate simply shows no bar
            return None
    return factory(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
