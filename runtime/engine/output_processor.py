"""OutputProcessor: a step's new tokens -> RequestDelta deltas (text, logprobs, finish, timings).

It keeps, per live request, the Request and its incremental detokenizer. After the scheduler applied a
step (`Scheduler.update`), `process` turns what each request appended into one delta: it detokenizes,
detects stop strings (ending the request through `stop`, which the engine wires to the scheduler), and
stamps first-token / finish times from the injected clock.

`stream_interval` (SGLang's knob of the same name; `server.stream_interval`): a request's deltas go out
once at least that many tokens are held, and always with its first token and when it ends; the steps
between are merged into the next delta sent. Detokenizing and the stop checks still run every step, so
the tokens, the text and where a request stops are the same at every interval; only the number of deltas
changes. Each delta costs the server an SSE event, a socket write and the Python around them, under the
engine's GIL: at 64 streams of a cheap model that is most of what a served step costs beyond the offline
one. 1 (the default) sends every step's tokens as they come.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from tokenfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from tokenfleet.runtime.engine.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from tokenfleet.runtime.engine.request import Request

Clock = Callable[[], float]


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    prompt_logprobs_sent: bool = False
    delivered: bool = False  # a delta went out (the first one is never held)
    # Merged steps not yet sent (stream_interval > 1): token ids, text pieces, logprobs.
    held_ids: list[int] | None = None
    held_text: list[str] | None = None
    held_logprobs: list[TokenLogprobs] | None = None


class OutputProcessor:
    def __init__(self, tokenizer, stop: Callable[[str], None], clock: Clock, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._tokenizer = tokenizer
        self._stop = stop  # ends a request whose text hit a stop string (the scheduler frees its KV)
        self._clock = clock
        self.stream_interval = stream_interval
        self._tracked: dict[str, _Tracked] = {}
        self.generation_tokens_total = 0

    def __bool__(self) -> bool:
        return bool(self._tracked)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def get(self, request_id: str) -> Request:
        return self._tracked[request_id].request

    def add(self, request: Request) -> None:
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids, params)
        if request.output_token_ids:  # a continuation: its text up to here was delivered by another pod
            detokenizer.resume(request.output_token_ids, request.num_delivered_chars)
        self._tracked[request.request_id] = _Tracked(request, detokenizer, params.logprobs is not None)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Forget a request; its final (empty) delta, None if unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        return self._output(tracked, [], "", None, finished=True, reason="abort")

    def process(
        self,
        num_before: Mapping[str, int],
        logprobs: Mapping[str, list[TokenLogprobs | None]],
        finished: set[str],
    ) -> tuple[list[RequestDelta], Collection[str]]:
        """One delta per request in `num_before` (its output length before the step); the ids that ended.

        `finished` holds the ids the scheduler finished in the step; stop strings add to it.
        """
        now = self._clock()
        outputs: list[RequestDelta] = []
        interval = self.stream_interval
        for rid, before in num_before.items():
            tracked = self._tracked[rid]
            req = tracked.request
            # With speculation a request may get several tokens, and the scheduler drops those after a
            # stop (EOS, max_tokens): what it appended is what the request produced.
            new_ids = req.output_token_ids[before:]
            if req.first_token_time is None:
                req.first_token_time = now
            self.generation_tokens_total += len(new_ids)
            # A stop *token* ends the text before it (its text is not emitted); EOS is special anyway.
            text_ids = new_ids[:-1] if isinstance(req.stop_reason, int) and rid in finished else new_ids
            delta = tracked.detokenizer.update(text_ids)
            if tracked.detokenizer.stop_reason is not None and rid not in finished:
                self._stop(rid)
                req.stop_reason = tracked.detokenizer.stop_reason
                finished.add(rid)
            if rid in finished:
                delta += tracked.detokenizer.flush()
            lps = logprobs.get(rid, [])[: len(new_ids)] if tracked.want_logprobs else None
            new_lps = [lp for lp in lps if lp is not None] if lps else None
            if interval > 1 and tracked.delivered and rid not in finished:
                held = tracked.held_ids
                if held is None:  # hold these back: fewer, larger deltas (see the module docstring)
                    held = tracked.held_ids = []
                    tracked.held_text = []
                    tracked.held_logprobs = [] if tracked.want_logprobs else None
                held += new_ids
                tracked.held_text.append(delta)
                if new_lps:
                    tracked.held_logprobs.extend(new_lps)
                if len(held) < interval:
                    continue
                new_ids, delta, new_lps = [], "", None  # what is held now goes out, as one delta
            prompt_lps = None
            if req.prompt_logprobs is not None and not tracked.prompt_logprobs_sent:
                # The step that samples the first token ran the prompt's last chunk: it is all scored.
                prompt_lps = list(req.prompt_logprobs)
                tracked.prompt_logprobs_sent = True
            outputs.append(
                self._output(
                    tracked,
                    new_ids,
                    delta,
                    new_lps,
                    finished=rid in finished,
                    reason=req.status.finish_reason if rid in finished else None,
                    prompt_logprobs=prompt_lps,
                )
            )
        for rid in finished:
            self._tracked.pop(rid, None)
        return outputs, finished

    def _output(
        self,
        tracked: _Tracked,
        new_ids: list[int],
        text: str,
        logprobs: list[TokenLogprobs] | None,
        *,
        finished: bool,
        reason: str | None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestDelta:
        req = tracked.request
        tracked.delivered = True
        if tracked.held_ids is not None:  # steps held back (stream_interval) go first
            new_ids = tracked.held_ids + new_ids
            text = "".join(tracked.held_text) + text
            if tracked.held_logprobs:
                logprobs = tracked.held_logprobs + (logprobs or [])
            tracked.held_ids = tracked.held_text = tracked.held_logprobs = None
        metrics = None
        if finished:
            metrics = RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=self._clock(),
            )
        return RequestDelta(
            request_id=req.request_id,
            new_token_ids=new_ids,  # a list of its own already (a slice, a sum or a literal)
            new_text=text,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason if finished else None,
            metrics=metrics,
            prompt_logprobs=prompt_logprobs,
        )
