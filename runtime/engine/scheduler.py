"""Scheduler: continuous batching with one rule — `num_computed_tokens` catches up with `num_tokens`.

There are no prefill and decode phases. Each step hands out a token budget (`max_num_batched_tokens`):
1. RUNNING requests first, in admission order: each gets what it still lacks, capped by the budget (a
   decode lacks 1 token, plus its speculative proposals; a long prompt gets a chunk). When the KV cache
   cannot hold a request's tokens, the lowest-priority, newest running request is preempted (blocks
   freed, recomputed later) until the allocation succeeds or the request itself was the one preempted.
   Under `policy: priority` the budget follows priority too: a prompt chunk leaves one token for each more
   urgent running request after it (admitted later), and chunks of a lower priority than the waiting head's
   are scheduled after admissions, with the budget the admissions leave. A long prompt chunked over many
   steps then never makes a more urgent stream miss a step, nor a more urgent request wait for its chunks.
2. Then WAITING requests in (priority, arrival) order — preempted ones keep their place, ahead of later
   arrivals — while budget, `max_num_seqs` and free blocks allow: prefix-cache hits start
   `num_computed_tokens` ahead, the rest of the prompt gets a chunk. Strict FCFS: when the head cannot
   be admitted, nothing behind it is. No admissions in a step that had to preempt (blocks are tight).
   Under `policy: priority` the head instead preempts running requests of a strictly lower priority
   (lowest first, newest first) until it fits, as vLLM's priority scheduling does; ties never preempt.
   A request preempted in a step is not admitted again in that step (when it heads the queue, admissions
   stop there).
   Under `fair_share`, within a priority the waiting request of the least-served tenant goes first and may
   preempt a much more served tenant's running request of the same priority (see "Fair share" below);
   priorities stay strict.

The scheduler is the only one that allocates KV slots. A speculative draft that writes KV (a draft model,
self-speculation) needs slots for the positions it will propose after the step: a chunk that samples also
gets `num_lookahead_tokens` slots past its last token (vLLM's look-ahead slots), capped by the request's
length limit, so the draft can run between steps without allocating anything itself.

Cost per step: a fleet simulator runs this class for every simulated step of every replica, and a
server runs it between forward passes, so the common case is kept cheap. A running decode (one token, no
proposals, no look-ahead) whose block table already holds its slot and fills no block is scheduled with
two integer compares against its table's `fast_limit` (block_table.py), without a call into the KV cache
manager; only one decode in `block_size` steps reaches `allocate_slots`. Such decodes go into the output
column-wise (`DecodeBatch`: four list appends, no tuple per request), and `update` applies them from their
requests (remembered by `schedule`), without reading their entries back or looking anything up by id but
the sampled token; other entries find a request and its stop figures with one lookup, and a single sampled
token skips the speculative path. And `update` hands the decodes it applied on to the next step
(carried_decodes.py): while they still lead the running requests, that step schedules them as whole
columns, touching one at a time only those that reach the end of their blocks.

Fair share (`fair_share`, fair_share.py): each tenant (`Request.tenant`) has a virtual token counter, the
service it received, charged as each step is scheduled: the prompt tokens of its chunks (cache hits are not
service the pod computed; a prompt recomputed after a preemption is not charged twice: the preemption was
the engine's choice) and the token each chunk that samples generates (accepted speculative proposals when
`update` learns of them). Running requests are charged before admissions and each admitted one at once, so
every pick of the step sees the service given so far. A flood from one tenant then cannot hold another's
requests behind it in the waiting queue. And when the batch or the cache is full, a waiting request of a
tenant that received at least FAIR_PREEMPT_MARGIN less service than a running request's tenant (same
priority) preempts it — the most-served tenant's newest first — so a light tenant behind a flood waits one
step, not for a flood's request to finish. Only a tenant holding at least two more running requests than
the waiting one's is preempted: a swap then never reverses their order in running requests, so it is never
swapped back (service alone would: a prompt is charged in one lump the step it is admitted). With it off,
none of this runs: one heap, no charges.

A preempted request resumes by recomputing prompt + generated tokens (its `all_token_ids`), so the same
rule covers resumption. Synchronous, deterministic, no torch, no clock: one engine thread owns all of this
state, and a simulator can drive it on virtual time.
"""

from __future__ import annotations

import itertools
from collections import Counter

from tokenfleet.runtime.config import SchedulerConfig
from tokenfleet.runtime.engine.admission import AdmissionLimits
from tokenfleet.runtime.engine.carried_decodes import CarriedDecodes
from tokenfleet.runtime.engine.fair_share import RETURN_CREDIT, FairShare
from tokenfleet.runtime.engine.kv_cache.block_table import RequestBlocks
from tokenfleet.runtime.engine.kv_cache.kv_events import PrefillScheduled
from tokenfleet.runtime.engine.kv_cache.manager import KVCacheManager
from tokenfleet.runtime.engine.kv_cache.request_tokens import token_slice
from tokenfleet.runtime.engine.request import Request, RequestStatus
from tokenfleet.runtime.engine.scheduler_output import (
    DecodeBatch,
    PromptLogprobsChunk,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenfleet.runtime.engine.waiting_queue import FairWaitingQueue, WaitingQueue
from tokenfleet.runtime.errors import ConfigError, InvalidRequest

_RUNNING = RequestStatus.RUNNING
_new_tuple = tuple.__new__
_NO_STOP_IDS: frozenset[int] = frozenset()
_ONE_TOKEN = (0,)  # stands for a plain decode's token_ids where only their number matters


# Service by which a running request's tenant must be ahead of a waiting request's for fair share to
# preempt it: the credit a tenant back from idle gets (fair_share.py), so such a tenant is served at once,
# while two backlogged tenants swap a slot at most once per that much service (each swap recomputes what
# the prefix cache lost).
FAIR_PREEMPT_MARGIN = RETURN_CREDIT


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        max_loras: int | None = None,
    ):
        if max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {max_model_len}")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # Without chunking a whole sequence must fit one step, or a long one could never run.
            raise ConfigError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is off"
            )
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        # LoRA: the most distinct adapters the running requests may use (the device slots); None: no LoRA.
        self.max_loras = max_loras
        self.admission = AdmissionLimits(
            max_model_len, kv_cache_manager.block_size, kv_cache_manager.num_blocks
        )
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Fair share between tenants, or None (the default: then no step pays anything for it).
        self.fair: FairShare | None = FairShare() if config.fair_share else None
        self.waiting: WaitingQueue | FairWaitingQueue = (
            WaitingQueue() if self.fair is None else FairWaitingQueue(self.fair)
        )
        # Under fair share, per preempted request: prompt tokens already charged (a resumption recomputes
        # them; the tenant is charged only past this).
        self._prompt_charged: dict[str, int] = {}
        self._order: dict[str, int] = {}
        # Per request, fixed at admission, for the stop check that runs for every sampled token:
        # (length limit, EOS + stop token ids, min_tokens, output tokens up to the length limit, the
        # request itself: `update` finds everything it needs with one lookup per request). The plain-decode
        # run of `update` reads the same figures from `Request.stop_figures` instead.
        self._stop_info: dict[str, tuple[int, frozenset[int], int, int, Request]] = {}
        self._counter = itertools.count()
        self._aborted_ids: list[str] = []
        self._finished_ids: list[str] = []
        # The requests the last schedule() admitted for the first time, as routers are told of them: the
        # `scheduled` KV event, which the engine (and the simulated replica) publish before the step's
        # forward, so a router knows what a pod is computing while it does. Not in SchedulerOutput: that
        # goes to every tensor-parallel worker, which has no use for it.
        self.started: list[PrefillScheduled] = []
        self.num_preemptions_total = 0
        # Requests whose prompt is still being scored (prompt logprobs): only while one is here does a step
        # look for prompt positions to score.
        self._scoring: dict[str, Request] = {}
        # The last output with plain decodes, and the requests of its decodes in order:
        # `update` applies them from the requests alone, without reading the columns back or looking the
        # requests up by id (see `_update_plain`).
        self._plain_output: SchedulerOutput | None = None
        self._plain_requests: list[Request] = []
        self._plain_tables: list[RequestBlocks] = []
        # The decodes of the step being scheduled, their requests and their block tables: a request
        # preempted while the step is scheduled is taken out of all three.
        self._step_decodes = DecodeBatch()
        self._step_decoding: list[Request] = []
        self._step_tables: list[RequestBlocks] = []
        # The last step's plain decodes as `update` left them, for the next step to start from
        # (carried_decodes.py); None when something since may have changed what they are.
        self._carried: CarriedDecodes | None = None
        # Whether a running request was finished from outside (`finish`) since the last schedule(): only
        # then may `update` meet a decode whose request is no longer running.
        self._left_running = False

    # ---- queries -----------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def max_spec_tokens(self, request: Request, k: int) -> int:
        """How many of `k` proposals `request` may take in its next step (0: none).

        All accepted proposals plus the bonus token must stay within the length limit; with look-ahead
        slots, a draft may write KV only where this request holds slots.
        """
        self._carried = None  # proposals may follow: the carried decodes may not be plain any more
        limit = self._stop_info[request.request_id][0]
        k = min(k, limit - request.num_tokens - 1)
        if self.num_lookahead_tokens and k > 0:
            held = len(self.kv.get_block_ids(request.request_id)) * self.kv.block_size
            k = min(k, held - request.num_computed_tokens)
        return max(k, 0)

    # ---- admission and removal -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Take a request (raises InvalidRequest / ContextLengthExceeded / CapacityError; see admission.py)."""
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequest(f"duplicate request id {rid!r}", param="request_id")
        params = request.sampling_params
        limit = self.admission.check(request.num_prompt_tokens, params.max_tokens)
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        eos = _NO_STOP_IDS if params.ignore_eos else request.eos_token_ids
        # frozenset() of a frozenset is that same set: no copy per request (a set given is copied).
        stop_ids = eos | frozenset(params.stop_token_ids) if params.stop_token_ids else frozenset(eos)
        if not stop_ids:
            stop_ids = _NO_STOP_IDS  # one shared set: every stop check then reads the same object
        self._stop_info[rid] = (
            limit,
            stop_ids,
            params.min_tokens,
            limit - request.num_prompt_tokens,
            request,
        )
        request.stop_figures = (stop_ids, params.min_tokens, limit - request.num_prompt_tokens)
        order = self._order[rid] = next(self._counter)
        self.waiting.push(request, order)
        if self.fair is not None:
            self.fair.join(request.tenant or "")  # left in `_release`, whichever way it ends
        if (
            request.prompt_logprobs is not None
            and len(request.prompt_logprobs) < request.num_prompt_tokens - 1
        ):
            self._scoring[rid] = request

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request in any state (stop string found, abort); frees its blocks. None if unknown."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is _RUNNING:
            self.running.remove(request)
            self._left_running = True
        else:
            self.waiting.remove(request_id)
        request.status = status
        self._release(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Abort in any state; frees everything at once. False if the id is unknown (or already done)."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED) is not None

    # ---- the step ---------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        if self.started:
            self.started = []
        # Entries are added as soon as a request's allocation succeeds (its block table is final for the
        # step then); a request preempted later in the step is taken out again. Plain decodes go to
        # `decodes` (and their requests to `decoding`), in running order; the other entries to `entries`:
        # running order, then admission order, then the running chunks that made way for the admissions.
        decodes = self._step_decodes = DecodeBatch()
        decoding: list[Request] = []
        self._step_decoding = decoding
        tables: list[RequestBlocks] = []
        self._step_tables = tables
        entries: list[ScheduledRequest] = []
        preempted: list[str] = []
        running = self.running
        plain = not self.num_lookahead_tokens
        i = 0
        carried, self._carried = self._carried, None
        self._left_running = False
        if carried is not None:  # the last step's plain decodes (so `plain` holds)
            i = carried.schedule(running, self.kv.allocate_slots, decodes, decoding, tables)
            budget -= i
        urgent = self._urgent_priority()
        deferred: list[Request] = []  # running prompt chunks that go after the admissions
        while i < len(running) and budget > 0:
            if plain:
                n = self._schedule_decodes(i, budget, decodes, decoding, tables)
                i += n
                budget -= n
                if i == len(running) or budget == 0:
                    break
            if urgent is not None:
                request = running[i]
                if request.priority > urgent and request.num_tokens - request.num_computed_tokens > 1:
                    deferred.append(request)
                    i += 1
                    continue
            budget, i = self._schedule_running(i, budget, entries, preempted)

        if self.fair is not None and (decoding or entries):
            self._charge_running(decoding, decodes.start_pos, entries)  # before admissions: they see it
        if not preempted:
            budget = self._admit_waiting(budget, entries, preempted)
        if deferred:
            budget = self._schedule_deferred(deferred, budget, entries, preempted)

        output = SchedulerOutput(
            decodes=decodes,
            others=tuple(entries),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=tuple(preempted),
            aborted_ids=tuple(self._aborted_ids),
            finished_ids=tuple(self._finished_ids),
            prompt_logprobs=self._prompt_positions([*decodes.entries(), *entries]) if self._scoring else (),
        )
        self._aborted_ids.clear()
        self._finished_ids.clear()
        if decoding:  # (a request preempted after it was scheduled left `decodes` and `decoding` both)
            self._plain_output = output
            self._plain_requests = decoding
            self._plain_tables = tables
        else:
            self._plain_output = None
        return output

    def _schedule_decodes(
        self,
        i: int,
        budget: int,
        decodes: DecodeBatch,
        decoding: list[Request],
        decoding_tables: list[RequestBlocks],
    ) -> int:
        """Schedule `running[i:]` while they are plain decodes whose slot is free to take, into `decodes`
        (their requests appended to `decoding`, their block tables to `decoding_tables`); how many.

        A plain decode is one token, no proposals, no look-ahead slots (the caller checks those are off).
        When its blocks already hold the slot and no block fills (to be cached), `allocate_slots` would
        do nothing: the call is skipped. Nearly every running request takes this path nearly every
        step, so it is kept to the bare minimum. It stops at the first request that is not such a
        decode, or whose allocation fails (a failed allocation changes nothing: the general path retries
        it and preempts); the budget is the caller's, one token per entry.
        """
        tables = self.kv.tables
        allocate = self.kv.allocate_slots
        add_id = decodes.request_ids.append
        add_token = decodes.token_ids.append
        add_start = decodes.start_pos.append
        add_blocks = decodes.block_ids.append
        add_table = decoding_tables.append
        n = 0
        for request in itertools.islice(self.running, i, i + budget):
            output_ids = request.output_token_ids
            start = request.num_computed_tokens
            if start + 1 != len(request.prompt_token_ids) + len(output_ids) or request.spec_token_ids:
                break
            rid = request.request_id
            table = tables.get(rid)
            if table is None:  # holds no blocks (never expected while running): the general path copes
                break
            if start >= table.fast_limit and allocate(request, 1) is None:
                break
            add_id(rid)
            add_token(output_ids[-1] if output_ids else request.prompt_token_ids[-1])
            add_start(start)
            add_blocks(table.block_ids)
            add_table(table)
            n += 1
        if n:
            decoding += itertools.islice(self.running, i, i + n)
        return n

    def _schedule_running(
        self,
        i: int,
        budget: int,
        entries: list[ScheduledRequest],
        preempted: list[str],
        after_admissions: bool = False,
    ) -> tuple[int, int]:
        """Schedule `running[i]` in the general case (a chunk, proposals, look-ahead slots, a block to
        allocate or cache), preempting while the cache cannot hold it; (budget left, next index).
        `after_admissions`: a chunk deferred past the step's admissions: everything else is scheduled and
        charged to fair share by now (a victim's charge is refunded), and no budget is kept for anyone."""
        running = self.running
        request = running[i]
        prompt = request.prompt_token_ids
        output_ids = request.output_token_ids
        num_prompt = len(prompt)
        num_tokens = num_prompt + len(output_ids)
        start = request.num_computed_tokens
        num_missing = num_tokens - start
        num_new = num_missing if num_missing < budget else budget
        if num_new > 1 and self.config.policy == "priority" and not after_admissions:
            # The budget goes in admission order; a more urgent request admitted after this one would get
            # what this chunk leaves, possibly nothing, step after step while a long prompt is chunked.
            priority = request.priority
            num_urgent = sum(1 for r in itertools.islice(running, i + 1, None) if r.priority < priority)
            if num_urgent:
                num_new = min(num_new, budget - num_urgent)
                if num_new <= 0:
                    return budget, i + 1  # no room for any of it this step: the urgent ones go first
        lookahead = self.num_lookahead_tokens
        spec: tuple[int, ...] = ()
        num_slots = num_new
        if num_new == num_missing and (lookahead or request.spec_token_ids):  # samples, speculates
            limit = self._stop_info[request.request_id][0]
            if request.spec_token_ids:
                # Each accepted proposal adds a token: stay within max_tokens / the context length.
                num_spec = min(len(request.spec_token_ids), budget - num_new, limit - num_tokens - 1)
                if num_spec > 0:
                    spec = tuple(request.spec_token_ids[:num_spec])
                    num_slots += num_spec
            if lookahead:
                num_slots = min(num_slots + lookahead, limit - 1 - start)
        allocate = self.kv.allocate_slots
        while allocate(request, num_slots) is None:
            victim_index = max(range(len(running)), key=lambda j: self._preemption_key(running[j]))
            victim = running.pop(victim_index)
            vid = victim.request_id
            budget += self._take_back(victim, entries, charged=after_admissions)
            self._preempt(victim)
            preempted.append(vid)
            if victim_index < i:
                i -= 1
            if victim is request:
                return budget, i
        rid = request.request_id
        if num_new == 1:  # a decode: no slicing
            token_ids = (prompt[start],) if start < num_prompt else (output_ids[start - num_prompt],)
        else:
            token_ids = tuple(token_slice(request, start, start + num_new))
        entries.append(
            _new_tuple(
                ScheduledRequest,
                (rid, token_ids, start, self.kv.tables[rid].block_ids, start + num_new == num_tokens, spec),
            )
        )
        return budget - num_new - len(spec), i + 1

    def _urgent_priority(self) -> int | None:
        """Under `policy: priority`, the waiting head's priority: running prompt chunks of a lower priority
        go after this step's admissions. None under `fcfs`, or with nothing waiting."""
        if self.config.policy != "priority":
            return None
        head = self.waiting.peek()
        return None if head is None else head.priority

    def _schedule_deferred(
        self, deferred: list[Request], budget: int, entries: list[ScheduledRequest], preempted: list[str]
    ) -> int:
        """Schedule the running chunks that made way for the admissions, in running order, with the budget
        left; the budget then left."""
        for request in deferred:
            if budget <= 0:
                break
            if request.status is not _RUNNING:  # preempted in this step
                continue
            budget, _ = self._schedule_running(
                self.running.index(request), budget, entries, preempted, after_admissions=True
            )
            if self.fair is not None and entries and entries[-1][0] == request.request_id:
                entry = entries[-1]  # scheduled (not preempted to make room for itself): charge it
                start = entry.start_pos
                self._charge_entry(request, start, start + len(entry.token_ids), entry.sample, 1)
        return budget

    def _admit_waiting(self, budget: int, entries: list[ScheduledRequest], preempted: list[str]) -> int:
        """Admit waiting requests in order while budget, max_num_seqs and blocks allow; budget left. Under
        the `priority` policy a head that finds the batch or the cache full preempts running requests of a
        strictly lower priority first (`_preempt_for`)."""
        chunked = self.config.enable_chunked_prefill
        waiting = self.waiting
        # Either rule may make room: a more urgent priority, or (fair share) a much less served tenant.
        preempts = self.config.policy == "priority" or self.fair is not None
        # LoRA: a request whose adapter would exceed the slots waits, and those behind it go ahead (put
        # back in their places after the loop). The running adapters are gathered only when one is met.
        adapters: set | None = None
        passed_over: list[Request] = []
        # The head that has just preempted to make room keeps its turn: the victim's refund may have put
        # the victim's tenant back ahead of it, and the queue's order would hand the room straight back.
        made_room: Request | None = None
        while budget > 0:
            request = made_room or waiting.peek()
            kept_turn, made_room = made_room is not None, None
            if request is None:
                break
            if preempted and request.request_id in preempted:
                # It lost its slot in this very step, and its refund can leave its tenant less served than
                # the one that displaced it: admitted again, it would be charged again, preempted again by
                # the next head, without end. It waits for the next step, when the counters are settled.
                break
            lora = request.lora
            if lora is not None and self.max_loras is not None:
                if adapters is None:
                    adapters = {r.lora for r in self.running if r.lora is not None}
                if lora not in adapters and len(adapters) >= self.max_loras:
                    if kept_turn:
                        waiting.remove(request.request_id)
                    else:
                        waiting.pop()
                    passed_over.append(request)
                    continue
            if len(self.running) >= self.config.max_num_seqs:
                if not preempts or (refund := self._preempt_for(request, entries, preempted)) is None:
                    break
                budget += refund
                made_room = request
                continue
            rid = request.request_id
            # A request scoring its prompt computes every position it has not scored yet: a hit would
            # skip them (vLLM likewise skips the prefix cache for prompt logprobs). Only a resumed one,
            # preempted part-way, may hit what it scored before.
            scoring = self._scoring.get(rid)
            hits, num_hit_tokens = self.kv.get_computed_blocks(
                request, None if scoring is None else len(scoring.prompt_logprobs)
            )
            num_tokens = request.num_tokens
            num_new = num_tokens - num_hit_tokens
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            end = num_hit_tokens + num_new
            num_slots = num_new
            if end == num_tokens and self.num_lookahead_tokens:
                limit = self._stop_info[request.request_id][0]
                num_slots = min(num_new + self.num_lookahead_tokens, limit - 1 - num_hit_tokens)
            if self.kv.allocate_slots(request, num_slots, hits) is None:
                if not preempts or (refund := self._preempt_for(request, entries, preempted)) is None:
                    break
                budget += refund
                made_room = request
                continue
            if kept_turn:  # perhaps no longer the head
                waiting.remove(rid)
            else:
                waiting.pop()
            if request.status is RequestStatus.WAITING:  # first admission (not a resumption)
                request.num_cached_tokens = num_hit_tokens
                # Every request, also one without a full block: routers count announcements as work.
                self.started.append(PrefillScheduled(tuple(request.block_hashes)))
            request.num_computed_tokens = num_hit_tokens
            request.status = _RUNNING
            self.running.append(request)
            if adapters is not None and lora is not None:
                adapters.add(lora)
            if self.fair is not None:  # charged now: the next pick in this same step sees it
                self._charge_entry(request, num_hit_tokens, end, end == num_tokens, 1)
            entries.append(
                ScheduledRequest(
                    rid,
                    tuple(token_slice(request, num_hit_tokens, end)),
                    num_hit_tokens,
                    self.kv.get_block_ids(rid),
                    end == num_tokens,
                )
            )
            budget -= num_new
        for request in passed_over:
            waiting.push(request, self._order[request.request_id])
        return budget

    def _prompt_positions(self, entries: list[ScheduledRequest]) -> tuple[PromptLogprobsChunk, ...]:
        """The prompt positions the step's chunks score, for the requests still scoring their prompt.

        Position p scores prompt token p + 1, so positions 0 .. num_prompt - 2 are scored; those before
        `len(request.prompt_logprobs)` were scored before a preemption and are not scored again.
        """
        chunks = []
        for rid, token_ids, start, _, _, _ in entries:
            request = self._scoring.get(rid)
            if request is None:
                continue
            prompt = request.prompt_token_ids
            done = len(request.prompt_logprobs)
            # Hits are capped at what it scored (`_admit_waiting`): no position is ever skipped.
            assert start <= done, f"request {rid!r} would skip prompt positions {done}..{start - 1}"
            first = max(start, done)
            end = min(start + len(token_ids), len(prompt) - 1)
            if first < end:
                chunks.append(
                    PromptLogprobsChunk(
                        rid,
                        first,
                        tuple(prompt[first + 1 : end + 1]),
                        request.sampling_params.prompt_logprobs,
                    )
                )
            if end == len(prompt) - 1:  # its last positions are scored in this step
                del self._scoring[rid]
        return tuple(chunks)

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Apply a step's results; the requests that finished in it (their blocks are freed).

        `sampled[id]` holds, for each `sample=True` entry, the accepted speculative tokens followed by
        the one sampled after them (1 .. k+1 tokens for k proposals). KV slots of rejected proposals are
        rolled back. Tokens after a stop condition are dropped.
        """
        finished: list[Request] = []
        if output is self._plain_output:
            self._plain_output = None
            requests = self._plain_requests
            self._plain_requests = []
            tables, self._plain_tables = self._plain_tables, []
            self._carried = self._update_plain(requests, tables, output.decodes, sampled, finished)
            scheduled = output.others  # the rest, if any (chunks, admissions)
        else:
            scheduled = output.scheduled
        stop_info = self._stop_info
        for rid, token_ids, _, _, sample, spec_token_ids in scheduled:
            info = stop_info.get(rid)
            if info is None:
                continue  # aborted or finished since the step was scheduled
            request = info[4]
            if request.status is not _RUNNING:
                continue  # preempted since, or a new request under the same id
            if not sample:
                request.num_computed_tokens += len(token_ids)
                continue
            if not spec_token_ids:
                # A plain sample (no proposals to verify), the common case: one token, no rollback.
                try:
                    (token_id,) = sampled[rid]
                except (KeyError, ValueError):
                    pass  # missing or not one token: the general path below says what is wrong
                else:
                    output_ids = request.output_token_ids
                    output_ids.append(token_id)
                    request.num_computed_tokens += len(token_ids)
                    if request.spec_token_ids:
                        request.spec_token_ids = []  # not scheduled this step; the proposer sets fresh ones
                    _, stop_ids, min_tokens, max_output, _ = info
                    if token_id in stop_ids and len(output_ids) >= min_tokens:
                        request.status = self._stop_token_status(request, token_id)
                    elif len(output_ids) >= max_output:
                        request.status = RequestStatus.FINISHED_LENGTH
                    else:
                        continue
                    finished.append(request)
                    continue
            status = self._apply_sampled(request, token_ids, spec_token_ids, sampled.get(rid))
            if status is not None:
                request.status = status
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
            for request in finished:
                self._release(request)
        return finished

    def _update_plain(
        self,
        requests: list[Request],
        tables: list[RequestBlocks],
        decodes: DecodeBatch,
        sampled: dict[str, list[int]],
        finished: list[Request],
    ) -> CarriedDecodes | None:
        """`update` for the plain decodes of the last output, given their requests and block tables in order;
        the decodes still running, for the next step to start from (None if one was skipped).

        Each decode is (rid, one token, num_computed_tokens, blocks) of the request at the same place, so
        the request itself says everything the columns would: nearly every running request goes through
        here every step, without its decode being read back or its id looked up. The same effect as the
        general loop of `update` (which also clears proposals a request was not given: a plain decode had
        none when it was scheduled, and the proposer sets them only after `update`).
        """
        carry = True
        if self._left_running:  # some request left since the step was scheduled (a stop string, an abort)
            still = [r for r in requests if r.status is _RUNNING]
            if len(still) < len(requests):
                requests = still
                carry = False
        tokens: list[int] = []
        add_token = tokens.append
        num_finished = len(finished)
        for request in requests:
            rid = request.request_id
            try:
                (token_id,) = sampled[rid]
            except (KeyError, ValueError):
                # Missing or not one token: the general path raises, saying what is wrong.
                self._apply_sampled(request, _ONE_TOKEN, (), sampled.get(rid))
                raise AssertionError("unreachable") from None
            output_ids = request.output_token_ids
            output_ids.append(token_id)
            add_token(token_id)
            request.num_computed_tokens += 1
            stop_ids, min_tokens, max_output = request.stop_figures
            if token_id in stop_ids and len(output_ids) >= min_tokens:
                request.status = self._stop_token_status(request, token_id)
            elif len(output_ids) >= max_output:
                request.status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            finished.append(request)
        if not carry:
            return None
        carried = CarriedDecodes(requests, decodes.request_ids, tables, decodes.start_pos, tokens)
        if len(finished) > num_finished:
            return carried.kept([r.status is _RUNNING for r in requests])
        return carried

    def _apply_sampled(
        self,
        request: Request,
        token_ids: tuple[int, ...],
        spec_token_ids: tuple[int, ...],
        new_token_ids: list[int] | None,
    ) -> RequestStatus | None:
        """Append a sampling entry's tokens (accepted proposals + 1), roll back rejected proposals' slots;
        the finished status reached, if any."""
        rid = request.request_id
        num_spec = len(spec_token_ids)
        if not new_token_ids or len(new_token_ids) > num_spec + 1:
            raise ValueError(
                f"request {rid!r}: expected 1..{num_spec + 1} sampled tokens, got {new_token_ids!r}"
            )
        # Fed: token_ids + proposals; valid KV: token_ids + the accepted proposals.
        request.num_computed_tokens += len(token_ids) + len(new_token_ids) - 1
        limit, stop_ids, min_tokens, _, _ = self._stop_info[rid]
        output_ids = request.output_token_ids
        num_prompt = len(request.prompt_token_ids)
        status = None
        for token_id in new_token_ids:
            output_ids.append(token_id)
            if token_id in stop_ids and len(output_ids) >= min_tokens:
                status = self._stop_token_status(request, token_id)
                break
            if num_prompt + len(output_ids) >= limit:
                status = RequestStatus.FINISHED_LENGTH
                break
        num_tokens = num_prompt + len(output_ids)
        if request.num_computed_tokens >= num_tokens:  # tokens dropped after a stop
            request.num_computed_tokens = num_tokens - 1
        if request.spec_token_ids:
            request.spec_token_ids = []  # consumed; the proposer sets fresh ones for the next step
        if self.fair is not None and len(new_token_ids) > 1:  # one was charged when it was scheduled
            self.fair.charge_output(request.tenant or "", len(new_token_ids) - 1)
        if status is None and len(new_token_ids) <= num_spec:
            # Rejected proposals: give back the slots past what the next step (and its draft) uses.
            keep = min(num_tokens + self.num_lookahead_tokens, limit - 1)
            self.kv.free_blocks_beyond(request, max(keep, num_tokens))
        return status

    # ---- helpers -----------------------------------------------------------------------------------------

    def _stop_token_status(self, request: Request, token_id: int) -> RequestStatus:
        """`token_id` is an EOS or stop token (and min_tokens are out): EOS wins, as in vLLM."""
        if token_id not in request.eos_token_ids or request.sampling_params.ignore_eos:
            request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED

    def _preemption_key(self, request: Request) -> tuple[int, float, int]:
        """The largest key is preempted first: lowest priority (largest value), then the newest."""
        return (request.priority, request.arrival_time, self._order[request.request_id])

    def _preempt_for(
        self, request: Request, entries: list[ScheduledRequest], preempted: list[str]
    ) -> int | None:
        """Make room for `request` by preempting one running request: under `policy: priority` the one that
        yields first (lowest priority, newest) if its priority is strictly lower; else, under fair share,
        the newest of a much more served tenant of the same priority (`_fair_victim`). The tokens the victim
        had been given in this step (None: nothing yields).

        Strictly lower, so requests of one priority never preempt each other on priority, and a preempted
        request, back in the queue, can never preempt the one that displaced it: no ping-pong (fair share's
        margin does the same for tenants). Requests admitted earlier in this step came first in (priority,
        arrival) order, so they are never the priority victim.
        """
        running = self.running
        if not running:
            return None
        victim_index = None
        if self.config.policy == "priority":
            j = max(range(len(running)), key=lambda j: self._preemption_key(running[j]))
            if running[j].priority > request.priority:
                victim_index = j
        if victim_index is None and self.fair is not None:
            victim_index = self._fair_victim(request)
        if victim_index is None:
            return None
        victim = running.pop(victim_index)
        refund = self._take_back(victim, entries, charged=True)
        self._preempt(victim)
        preempted.append(victim.request_id)
        return refund

    def _take_back(self, victim: Request, entries: list[ScheduledRequest], charged: bool) -> int:
        """Take a preempted request's entry of this step out of `entries` or the step's decodes, if it has
        one; the tokens it had been given. `charged`: its service was charged to fair share already, so it
        is refunded."""
        vid = victim.request_id
        for j in range(len(entries) - 1, -1, -1):  # newest first: victims are the newest
            if entries[j][0] == vid:
                entry = entries.pop(j)
                if charged and self.fair is not None:
                    start = entry.start_pos
                    self._charge_entry(victim, start, start + len(entry.token_ids), entry.sample, -1)
                return entry.num_tokens
        decodes = self._step_decodes
        if vid not in decodes.request_ids:
            return 0
        j = decodes.request_ids.index(vid)
        start = decodes.pop(j)
        del self._step_decoding[j]
        del self._step_tables[j]
        if charged and self.fair is not None:
            self._charge_entry(victim, start, start + 1, True, -1)
        return 1

    def _fair_victim(self, request: Request) -> int | None:
        """Fair share's preemption: the newest running request of the same priority whose tenant has
        received at least FAIR_PREEMPT_MARGIN more service than `request`'s (the most-served tenant first)
        and holds at least two more running requests than `request`'s tenant, else None.

        Both are hysteresis, and the second is what guarantees it. Service is charged in lumps (a whole
        prompt chunk the step it is scheduled), so right after its admission the displacing tenant can be
        far more served than the displaced one, which would then take the slot back, and so on every step.
        A swap from a tenant holding n running requests to one holding m <= n - 2 leaves them n - 1 >= m + 1:
        it never turns the order of their running counts around, so the same rule cannot reverse it (each
        swap lowers the sum of the squares of the tenants' running counts: swaps end)."""
        fair = self.fair
        assert fair is not None
        tenant = request.tenant or ""
        floor = fair.counter(tenant) + FAIR_PREEMPT_MARGIN
        # Running requests per tenant, counted only once some request passes the service test: a flood's
        # own head, blocked every step behind its own tenant, never pays for it.
        slots: Counter[str] | None = None
        best, best_key = None, None
        for j, r in enumerate(self.running):
            if r.priority != request.priority:
                continue
            victim_tenant = r.tenant or ""
            served = fair.counter(victim_tenant)
            if served < floor:
                continue
            if slots is None:
                slots = Counter(x.tenant or "" for x in self.running)
            if slots[victim_tenant] < slots[tenant] + 2:
                continue
            key = (served, r.arrival_time, self._order[r.request_id])
            if best_key is None or key > best_key:
                best, best_key = j, key
        return best

    def _preempt(self, request: Request) -> None:
        if self.fair is not None:
            rid = request.request_id
            done = min(request.num_computed_tokens, request.num_prompt_tokens)
            if done > self._prompt_charged.get(rid, 0):
                self._prompt_charged[rid] = done
        self.kv.free(request)  # caches its computed full blocks: resuming may hit them
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        self.num_preemptions_total += 1
        self.waiting.push(request, self._order[request.request_id])

    def _release(self, request: Request) -> None:
        """Forget a request that reached a finished status; frees its blocks."""
        self.kv.free(request)
        rid = request.request_id
        del self._requests[rid]
        del self._order[rid]
        del self._stop_info[rid]
        self._scoring.pop(rid, None)
        if self.fair is not None:
            self.fair.leave(request.tenant or "")
            self._prompt_charged.pop(rid, None)
        if request.status is RequestStatus.FINISHED_ABORTED:
            self._aborted_ids.append(rid)
        else:
            self._finished_ids.append(rid)

    # ---- fair share: charging service (only with `fair_share` on) -------------------------------------------

    def _prompt_tokens_to_charge(self, request: Request, start: int, end: int) -> int:
        """Prompt tokens among positions start..end-1 that its tenant was not charged for before a
        preemption."""
        charged = self._prompt_charged.get(request.request_id, 0) if self._prompt_charged else 0
        n = min(end, len(request.prompt_token_ids)) - (start if start > charged else charged)
        return n if n > 0 else 0

    def _charge_entry(self, request: Request, start: int, end: int, sample: bool, sign: int) -> None:
        """Charge (sign 1) or refund (sign -1) one chunk: its prompt tokens and the token it samples."""
        fair = self.fair
        assert fair is not None
        tenant = request.tenant or ""
        if start < len(request.prompt_token_ids):
            fair.charge_prompt(tenant, sign * self._prompt_tokens_to_charge(request, start, end))
        if sample:
            fair.charge_output(tenant, sign)

    def _charge_running(
        self, decoding: list[Request], starts: list[int], entries: list[ScheduledRequest]
    ) -> None:
        """Charge what was scheduled for running requests, summed per tenant: the plain decodes (`decoding`,
        at positions `starts`) one sampled token each, and the other entries their chunks (this runs for
        every running request in every step)."""
        fair = self.fair
        assert fair is not None
        requests = self._requests
        prompt: dict[str, int] = {}
        output: dict[str, int] = {}
        for request, start in zip(decoding, starts, strict=True):
            tenant = request.tenant or ""
            if start < len(request.prompt_token_ids):  # the prompt's last token, recomputed
                n = self._prompt_tokens_to_charge(request, start, start + 1)
                prompt[tenant] = prompt.get(tenant, 0) + n
            output[tenant] = output.get(tenant, 0) + 1
        for rid, token_ids, start, _, sample, _ in entries:
            request = requests[rid]
            tenant = request.tenant or ""
            if start < len(request.prompt_token_ids):
                n = self._prompt_tokens_to_charge(request, start, start + len(token_ids))
                prompt[tenant] = prompt.get(tenant, 0) + n
            if sample:
                output[tenant] = output.get(tenant, 0) + 1
        for tenant, n in prompt.items():
            fair.charge_prompt(tenant, n)
        for tenant, n in output.items():
            fair.charge_output(tenant, n)
