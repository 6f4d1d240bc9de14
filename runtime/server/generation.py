"""The engine requests behind one HTTP request: submit, merge the n choices' deltas, abort on the way out.

An HTTP request with `n` choices (times several prompts for a batched completion) becomes that many engine
requests, ids `{base}-{index}`. They are all submitted before the response starts, so an admission error
(429, context length) is still a proper HTTP status; if one of them is refused the others are aborted.
`close()` — always called, in a `finally` — aborts whatever has not finished: that is how a client
disconnect (a cancelled handler, or a failed write on a stream) frees the request's KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenfleet.runtime.engine.outputs import RequestDelta, TokenLogprobs
from tokenfleet.runtime.engine.request import ResumeFrom
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.openai.translate import Prompt, choice_params
from tokenfleet.runtime.server.metrics import ServerMetrics


@dataclass(slots=True)
class ChoiceState:
    """What the server has seen of one choice so far (non-streaming responses are built from this)."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    last_delta_time: float | None = None
    # With prompt logprobs: the prompt's scored positions (on the first choice of each prompt only).
    prompt_logprobs: list[TokenLogprobs] | None = None


class Generation:
    def __init__(
        self,
        engine,
        metrics: ServerMetrics,
        base_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        resume: ResumeFrom | None = None,
        tenant: str | None = None,
        lora_name: str | None = None,
    ):
        self._engine = engine
        self._metrics = metrics
        self._base_id = base_id
        self._prompts = prompts
        self._params = params
        self._priority = priority
        self._cache_salt = cache_salt
        self._resume = resume  # continue a stream begun on another pod (one choice only)
        self._tenant = tenant  # whose fair share the engine counts it against (None: anonymous)
        self._lora_name = lora_name  # the LoRA adapter it runs under (None: the base model)
        self.choices: list[ChoiceState] = []
        self._streams: list[AsyncIterator[RequestDelta]] = []
        self._pumps: list[asyncio.Task] = []

    @property
    def prompts(self) -> list[Prompt]:
        return self._prompts

    def prompt_logprobs(self, prompt_index: int) -> list[TokenLogprobs] | None:
        """Prompt `prompt_index`'s scored positions (its first choice scored them for all its choices)."""
        for state in self.choices:
            if state.prompt_index == prompt_index and state.prompt_logprobs is not None:
                return state.prompt_logprobs
        return None

    def engine_id(self, index: int) -> str:
        return f"{self._base_id}-{index}"

    async def submit(self) -> None:
        """Submit every choice; on the first refusal abort the accepted ones and re-raise."""
        n = self._params.n
        try:
            for p, prompt in enumerate(self._prompts):
                for j in range(n):
                    index = p * n + j
                    extra = {"resume": self._resume} if self._resume is not None else {}
                    if self._tenant is not None:
                        extra["tenant"] = self._tenant
                    if self._lora_name is not None:
                        extra["lora_name"] = self._lora_name
                    stream = self._engine.add_request(
                        self.engine_id(index),
                        prompt.token_ids,
                        choice_params(self._params, j),
                        priority=self._priority,
                        cache_salt=self._cache_salt,
                        **extra,
                    )
                    self._streams.append(stream)
                    self.choices.append(
                        ChoiceState(index=index, prompt_index=p, num_prompt_tokens=len(prompt.token_ids))
                    )
        except BaseException:
            await self.close()
            raise

    async def deltas(self) -> AsyncIterator[tuple[ChoiceState, RequestDelta]]:
        """Every choice's deltas as they come, after updating its ChoiceState and the metrics."""
        async for index, out in self._merged():
            state = self.choices[index]
            self._account(state, out)
            yield state, out

    def _account(self, state: ChoiceState, out: RequestDelta) -> None:
        now = time.monotonic()
        if out.new_token_ids and state.last_delta_time is not None:
            self._metrics.observe_token_gap(now - state.last_delta_time, len(out.new_token_ids))
        if out.new_token_ids:
            state.last_delta_time = now
        state.text.append(out.new_text)
        if out.new_logprobs:
            state.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        state.num_prompt_tokens = out.num_prompt_tokens
        state.num_output_tokens = out.num_output_tokens
        # Cached tokens are a part of the prompt (a continuation also finds its generated tokens cached).
        state.num_cached_tokens = min(out.num_cached_tokens, out.num_prompt_tokens)
        if out.finished:
            state.finished = True
            state.finish_reason = out.finish_reason
            self._metrics.observe_finished(out)

    async def _merged(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        if len(self._streams) == 1:  # the common case: no tasks, no queue
            async for out in self._streams[0]:
                yield 0, out
            return
        # One pump task per engine stream feeds a shared queue; an exception travels as an item so the
        # consumer re-raises it in the handler's task.
        q: asyncio.Queue = asyncio.Queue()
        _end = object()

        async def pump(index: int, stream: AsyncIterator[RequestDelta]) -> None:
            try:
                async for out in stream:
                    q.put_nowait((index, out))
            except Exception as e:
                q.put_nowait((index, e))
            finally:
                q.put_nowait((index, _end))

        self._pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        remaining = len(self._pumps)
        while remaining:
            index, item = await q.get()
            if item is _end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        """Stop the pumps and abort every unfinished choice (idempotent; safe in a cancelled task)."""
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._pumps = []
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError, Exception):
                    await aclose()
        for state in self.choices:
            if not state.finished:
                # Awaited so that the KV blocks are free when the handler returns, not some time later.
                await self._engine.abort(self.engine_id(state.index))
                self._metrics.observe_aborted()
                state.finished = True
                state.finish_reason = state.finish_reason or "abort"
