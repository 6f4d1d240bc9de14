"""SamplingMetadata: the per-step, per-row sampling parameters of a batch, as tensors.

Built once per step from the requests whose next token is sampled in this step (one row of logits per
request, in the same order), so the sampler itself never walks Python objects except to draw from the
per-request seeded generators. Optional transforms are `None` when no row uses them, which lets the
sampler skip their cost (a full-vocabulary sort for top-p, a bincount for penalties) in the common case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.structured_output.state import grammar_bitmask


@dataclass(frozen=True, slots=True)
class PenaltyMetadata:
    """Token occurrences needed by the repetition / frequency / presence penalties.

    Token ids are right-padded with 0 and paired with a 0/1 weight, so counts can be scattered into a
    `[N, V]` tensor without knowing the vocabulary size here (the logits carry it).
    """

    repetition: torch.Tensor  # [N] fp32, 1.0 = off (HF semantics: prompt + output tokens)
    frequency: torch.Tensor  # [N] fp32, 0.0 = off (OpenAI semantics: output tokens only)
    presence: torch.Tensor  # [N] fp32, 0.0 = off (OpenAI semantics: output tokens only)
    prompt_token_ids: torch.Tensor  # [N, max_prompt_len] int64, padded with 0
    prompt_weights: torch.Tensor  # [N, max_prompt_len] fp32, 1 for a real token, 0 for padding
    output_token_ids: torch.Tensor  # [N, max_output_len] int64, padded with 0
    output_weights: torch.Tensor  # [N, max_output_len] fp32
    use_repetition: bool
    use_frequency_presence: bool


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Per-row sampling parameters for one step. Row i describes logits row i."""

    num_rows: int
    temperature: torch.Tensor  # [N] fp32; greedy rows hold 1.0 so dividing by it is a no-op
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [N] int64, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [N] fp32, 1.0 = off; None when no row uses top-p
    min_p: torch.Tensor | None  # [N] fp32, 0.0 = off; None when no row uses min-p
    penalties: PenaltyMetadata | None  # None when no row uses a penalty
    # (row, token id) pairs to forbid this step: EOS / stop token ids of rows still under min_tokens.
    banned_rows: torch.Tensor | None  # [M] int64
    banned_token_ids: torch.Tensor | None  # [M] int64
    # One entry per row: the request's own seeded generator, or None (drawn from the sampler's shared one).
    generators: tuple[torch.Generator | None, ...]
    # Per-row number of top alternatives wanted (None = no logprobs for that row).
    num_logprobs: tuple[int | None, ...]
    max_num_logprobs: int | None  # None when no row asks for logprobs
    # Constrained rows (indices into the logits rows) and the batch's bitmask [N, ceil(V/32)] int32 of
    # allowed next tokens (bit t of word w: token 32w + t); None when no row is constrained.
    grammar_rows: tuple[int, ...] | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Row i is greedy, on the host (reading `greedy` back would wait for the device).
    greedy_rows: tuple[bool, ...] = ()
    # Some row has a part that changes from step to step (min_tokens bans, penalties, a grammar): `refresh`
    # recomputes those; without one, the same metadata serves every step of the same rows.
    per_step: bool = True

    @staticmethod
    def build(
        requests: Sequence[Request],
        generators: Mapping[str, torch.Generator],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Gather the parameters of `requests` (one per logits row, same order) into tensors on `device`.

        `generators` maps request id -> that request's seeded generator; requests without one are drawn
        from the sampler's shared generator. Greedy requests never draw.
        """
        params = [r.sampling_params for r in requests]
        greedy_list = [p.greedy for p in params]
        all_greedy = all(greedy_list)
        all_random = not any(greedy_list)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = floats([1.0 if p.greedy else p.temperature for p in params])
        greedy = torch.tensor(greedy_list, dtype=torch.bool, device=device)

        # Truncation only matters for rows that sample; greedy rows take the argmax whatever it says.
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k > 0 and not p.greedy for p in params):
                top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
            if any(p.top_p < 1.0 and not p.greedy for p in params):
                top_p = floats([p.top_p for p in params])
            if any(p.min_p > 0.0 and not p.greedy for p in params):
                min_p = floats([p.min_p for p in params])

        num_logprobs = tuple(p.logprobs for p in params)
        wanted = [k for k in num_logprobs if k is not None]
        static = SamplingMetadata(
            num_rows=len(requests),
            temperature=temperature,
            greedy=greedy,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            penalties=None,
            banned_rows=None,
            banned_token_ids=None,
            generators=tuple(generators.get(r.request_id) for r in requests),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(wanted) if wanted else None,
            greedy_rows=tuple(greedy_list),
            per_step=any(
                p.min_tokens > 0
                or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0
                for p in params
            )
            or any(r.grammar is not None for r in requests),
        )
        return static.refresh(requests, device)

    def refresh(self, requests: Sequence[Request], device: torch.device | str) -> SamplingMetadata:
        """This metadata for the next step of the same rows (`requests` as built, same order): the parts
        that follow the outputs (min_tokens bans, penalties, grammar masks) recomputed, the rest shared.

        A runner keeps one per batch composition, so a step of unchanged rows builds no tensor at all.
        """
        if not self.per_step:
            return self
        banned_rows, banned_ids = _min_tokens_bans(requests, device)
        grammar_rows, bitmask = _grammar(requests, device)
        return dataclasses.replace(
            self,
            penalties=_penalties(requests, device),
            banned_rows=banned_rows,
            banned_token_ids=banned_ids,
            grammar_rows=grammar_rows,
            grammar_bitmask=bitmask,
        )


def _grammar(
    requests: Sequence[Request], device: torch.device | str
) -> tuple[tuple[int, ...] | None, torch.Tensor | None]:
    """Each constrained row's allowed next tokens, after exactly that row's output tokens (a verification
    row's view includes the drafts before it, so the drafts are checked against the grammar too)."""
    rows = tuple(i for i, r in enumerate(requests) if r.grammar is not None)
    if not rows:
        return None, None
    vocab_size = requests[rows[0]].grammar.vocab_size
    bitmask = grammar_bitmask([(r.grammar, r.output_token_ids) for r in requests], vocab_size)
    return rows, bitmask.to(device)


def _min_tokens_bans(
    requests: Sequence[Request], device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row, token) pairs that may not be sampled because the row has fewer than min_tokens outputs.

    EOS is only banned when it would end the request (not with ignore_eos); stop token ids always end it.
    """
    rows: list[int] = []
    token_ids: list[int] = []
    for row, req in enumerate(requests):
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= req.eos_token_ids
        for tok in sorted(stops):
            rows.append(row)
            token_ids.append(tok)
    if not rows:
        return None, None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
    )


def _penalties(requests: Sequence[Request], device: torch.device | str) -> PenaltyMetadata | None:
    params = [r.sampling_params for r in requests]
    use_repetition = any(p.repetition_penalty != 1.0 for p in params)
    use_freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    if not (use_repetition or use_freq_pres):
        return None
    # Only rows that use a penalty contribute tokens: the others would be scattered for nothing.
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for r in requests:
        p = r.sampling_params
        uses_output = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        prompts.append(r.prompt_token_ids if p.repetition_penalty != 1.0 else [])
        outputs.append(r.output_token_ids if uses_output else [])
    prompt_ids, prompt_w = _padded(prompts, device)
    output_ids, output_w = _padded(outputs, device)
    return PenaltyMetadata(
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        prompt_token_ids=prompt_ids,
        prompt_weights=prompt_w,
        output_token_ids=output_ids,
        output_weights=output_w,
        use_repetition=use_repetition,
        use_frequency_presence=use_freq_pres,
    )


def _padded(rows: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into an int64 matrix (pad 0) and a matching 0/1 fp32 weight matrix."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    weights = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
            weights[i, : len(r)] = 1.0
    # Built on the CPU then moved once: one host-to-device copy per tensor instead of one per row.
    return ids.to(device), weights.to(device)
