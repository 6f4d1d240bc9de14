"""LLM: the offline API — `LLM(model=...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence

from tokenfleet.runtime.config import CacheConfig, ModelConfig, ParallelConfig, RuntimeConfig, SchedulerConfig
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.model.loader import LoadedModel

Prompt = str | list[int]


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
        sections: dict[str, dict[str, object]] = {"model": {}, "cache": {}, "scheduler": {}, "parallel": {}}
        if model is not None:
            sections["model"]["model"] = model
        for key, value in overrides.items():
            for name, cls in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
                ("parallel", ParallelConfig),
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

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text, or token ids); results are in the prompts' order.

        With `n > 1` a prompt yields n consecutive outputs (a given seed becomes seed + i for the i-th).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")

        order: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            for i in range(p.n):
                sub = copy.deepcopy(p)
                sub.n = 1
                if p.seed is not None:
                    sub.seed = p.seed + i
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sub)
                order.append(rid)
                prompt_ids[rid] = ids

        tokens: dict[str, list[int]] = {rid: [] for rid in order}
        texts: dict[str, list[str]] = {rid: [] for rid in order}
        logprobs: dict[str, list] = {rid: [] for rid in order}
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            step_outputs = self.engine.step()
            if on_step is not None:
                on_step(step_outputs)
            for out in step_outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
                if out.new_logprobs:
                    logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    final[out.request_id] = out
        return [
            CompletionOutput(
                request_id=rid,
                prompt_token_ids=prompt_ids[rid],
                token_ids=tokens[rid],
                text="".join(texts[rid]),
                finish_reason=final[rid].finish_reason,
                stop_reason=final[rid].stop_reason,
                num_cached_tokens=final[rid].num_cached_tokens,
                logprobs=logprobs[rid] or None,
            )
            for rid in order
        ]
