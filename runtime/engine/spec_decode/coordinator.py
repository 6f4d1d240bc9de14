"""SpecDecoder: the engine's side of speculative decoding — who gets proposals, and the counters.

After each step's `Scheduler.update`, `propose(running)` sets `request.spec_token_ids` for every running
request whose next token is a decode (its prompt is fully computed: `num_computed_tokens == num_tokens - 1`),
capped so that accepting all of them cannot pass max_tokens or the context length. Requests still in
(chunked) prefill get none. For drafts that write KV, the slots of the next step (last token + k
proposals) are allocated first; a request whose slots do not fit right now gets no proposal this step
(the scheduler then decodes it plainly, preempting as usual if even that does not fit).

Counters follow vLLM's `spec_decode_*` metrics: drafts (requests verified with >= 1 proposal in a step),
draft tokens, accepted tokens, and accepted tokens per proposal position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenfleet.runtime.config import SpeculativeConfig
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.model_runner import ModelRunner
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.scheduler_output import SchedulerOutput
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, runner: ModelRunner, kv_manager: KVCacheManager, max_model_len: int
    ):
        if runner.proposer is None:
            raise ValueError("SpecDecoder needs a model runner with a proposer")
        self.num_spec = config.num_speculative_tokens
        self.runner = runner
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.writes_kv = runner.proposer.writes_kv
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_spec

    def record(self, sched: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> None:
        """Count one step's verification results (before tokens after a stop are dropped)."""
        for entry in sched.scheduled:
            spec = entry.spec_token_ids
            tokens = sampled.get(entry.request_id)
            if not spec or not tokens:
                continue
            accepted = len(tokens) - 1
            self.num_drafts += 1
            self.num_draft_tokens += len(spec)
            self.num_accepted_tokens += accepted
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1

    def _budget(self, request: Request) -> int:
        """Proposals this request may take: k, capped so that all accepted + the bonus stay in bounds."""
        max_tokens = request.sampling_params.max_tokens
        limit = self.max_model_len
        if max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + max_tokens)
        return min(self.num_spec, limit - request.num_tokens - 1)

    def propose(self, running: Sequence[Request]) -> None:
        batch: list[ProposalInput] = []
        targets: list[Request] = []
        for request in running:
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling: its next step samples no decode token to verify against
            k = self._budget(request)
            if k < 1:
                continue
            if self.writes_kv and self.kv.allocate_slots(request, k + 1) is None:
                continue
            batch.append(
                ProposalInput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    num_spec=k,
                    block_ids=self.kv.get_block_ids(request.request_id),
                )
            )
            targets.append(request)
        if not batch:
            return
        for request, proposal in zip(targets, self.runner.propose(batch), strict=True):
            request.spec_token_ids = proposal[: self._budget(request)]
