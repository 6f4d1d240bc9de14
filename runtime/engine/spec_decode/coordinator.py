"""SpecDecoder: the engine's side of speculative decoding — who gets proposals, and the counters.

After each step's `Scheduler.update`, `propose(running)` sets `request.spec_token_ids` for every running
request whose next token is a decode (its prompt is fully computed: `num_computed_tokens == num_tokens - 1`).
How many proposals a request may take is the scheduler's call (`Scheduler.max_spec_tokens`: the length
limit, and for drafts that write KV the look-ahead slots the scheduler allocated with the step); this
class allocates nothing. Requests still in (chunked) prefill get none.

Counters follow vLLM's `spec_decode_*` metrics: drafts (requests verified with >= 1 proposal in a step),
draft tokens, accepted tokens, and accepted tokens per proposal position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenfleet.runtime.config import SpeculativeConfig
from tokenfleet.runtime.engine.model_runner import ModelRunner
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.scheduler import Scheduler
from tokenfleet.runtime.engine.scheduler_output import SchedulerOutput
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, scheduler: Scheduler):
        if runner.proposer is None:
            raise ValueError("SpecDecoder needs a model runner with a proposer")
        self.num_spec = config.num_speculative_tokens
        self.runner = runner
        self.scheduler = scheduler
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_spec

    def record(self, sched: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> None:
        """Count one step's verification results (before tokens after a stop are dropped)."""
        for entry in sched.others:  # plain decodes verify nothing
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

    def propose(self, running: Sequence[Request]) -> None:
        batch: list[ProposalInput] = []
        targets: list[Request] = []
        max_spec = self.scheduler.max_spec_tokens
        block_ids = self.scheduler.kv.get_block_ids
        for request in running:
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling: its next step samples no decode token to verify against
            k = max_spec(request, self.num_spec)
            if k < 1:
                continue
            batch.append(
                ProposalInput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    num_spec=k,
                    block_ids=block_ids(request.request_id),
                )
            )
            targets.append(request)
        if not batch:
            return
        for item, request, proposal in zip(batch, targets, self.runner.propose(batch), strict=True):
            request.spec_token_ids = proposal[: item.num_spec]
