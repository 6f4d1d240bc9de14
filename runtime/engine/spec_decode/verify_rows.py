"""Per-position sampling parameters for verification rows.

Row i of a request with proposals d_1..d_k decides the token after d_i, so its sampling state is the
request's as if d_1..d_i had already been emitted: frequency / presence / repetition penalties count them,
and the min_tokens ban on EOS / stop tokens lifts once enough tokens are out. Rows of requests without
such state-dependent transforms simply repeat the request (no copies of its token lists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_metadata import SamplingMetadata
from tokenfleet.runtime.engine.spec_decode.rejection_sampler import VerifyBatch


def _depends_on_outputs(request: Request) -> bool:
    p = request.sampling_params
    return (
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or request.num_output_tokens < p.min_tokens
        or request.grammar is not None  # row i's allowed tokens follow d_1..d_i
    )


def verification_rows(request: Request, draft_token_ids: Sequence[int]) -> list[Request]:
    """k + 1 request views, one per verification row (row i: d_1..d_i appended to the outputs)."""
    if not _depends_on_outputs(request):
        return [request] * (len(draft_token_ids) + 1)
    rows = [request]
    for i in range(1, len(draft_token_ids) + 1):
        rows.append(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_ids=request.eos_token_ids,
                output_token_ids=request.output_token_ids + list(draft_token_ids[:i]),
                grammar=request.grammar,
            )
        )
    return rows


def build_verify_batch(
    requests: Sequence[Request],
    draft_token_ids: Sequence[Sequence[int]],
    generators: Mapping[str, torch.Generator],
    device: torch.device,
) -> VerifyBatch:
    """The VerifyBatch of requests (each with >= 1 proposal) whose rows are laid out request by request."""
    row_requests: list[Request] = []
    for request, drafts in zip(requests, draft_token_ids, strict=True):
        row_requests.extend(verification_rows(request, drafts))
    return VerifyBatch(
        meta=SamplingMetadata.build(row_requests, generators, device),
        draft_token_ids=tuple(tuple(d) for d in draft_token_ids),
        greedy=tuple(r.sampling_params.greedy for r in requests),
        generators=tuple(generators.get(r.request_id) for r in requests),
    )
