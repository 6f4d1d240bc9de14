"""Logprobs of sampled tokens and their top-n alternatives, under the *raw* model distribution.

Raw means `log_softmax` of the logits as the model produced them: before penalties, min_tokens bans,
temperature and top-k/top-p/min-p truncation. This is what OpenAI and vLLM (by default) report, and it stays
meaningful for greedy requests (a processed distribution would be one-hot there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.engine.scheduler_output import PromptLogprobsChunk

# Prompt rows scored per log_softmax: bounds the fp32 temporaries of a long prefill chunk to
# rows x vocabulary (256 x 49k x 4 B = 48 MiB) whatever the chunk's length.
PROMPT_ROWS_PER_PASS = 256


def compute_logprobs(
    raw_logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_logprobs: Sequence[int | None],
    max_num_logprobs: int | None,
) -> list[TokenLogprobs | None]:
    """One entry per row: None where the row asked for no logprobs.

    raw_logits [N, V] fp32; token_ids [N] int64 (the sampled tokens); num_logprobs[i] is row i's number of
    alternatives (0 = only the sampled token's logprob). Alternatives are sorted by logprob, descending, and
    may include the sampled token (as OpenAI's top_logprobs do).
    """
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    if max_num_logprobs is None:
        return result
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    row_index = torch.tensor(rows, dtype=torch.int64, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits.index_select(0, row_index).float(), dim=-1)
    sampled = logprobs.gather(1, token_ids.index_select(0, row_index).unsqueeze(1)).squeeze(1)
    width = min(max_num_logprobs, logprobs.shape[-1])
    if width > 0:
        top_values, top_ids = logprobs.topk(width, dim=-1)  # sorted, descending
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    # One device-to-host transfer per tensor; the Python objects are built from plain lists.
    sampled_list = sampled.tolist()
    # 1 + tokens strictly more likely: the sampled token's rank, exact even when it is not among the top-k.
    rank_list = ((logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    token_list = token_ids.index_select(0, row_index).tolist()
    for j, row in enumerate(rows):
        k = min(num_logprobs[row] or 0, width)
        top = tuple(zip(top_ids_list[j][:k], top_values_list[j][:k], strict=True)) if k else ()
        result[row] = TokenLogprobs(
            token_id=token_list[j], logprob=sampled_list[j], top=top, rank=rank_list[j]
        )
    return result


def compute_prompt_logprobs(
    raw_logits: torch.Tensor, chunks: Sequence[PromptLogprobsChunk]
) -> dict[str, list[TokenLogprobs]]:
    """Logprobs of prompt tokens, per request: raw_logits [R, V] holds one row per scored position, the
    chunks' positions in order; row i scores the chunk's target token i (the prompt token after it)."""
    targets = [t for chunk in chunks for t in chunk.target_token_ids]
    want = [chunk.num_logprobs for chunk in chunks for _ in chunk.target_token_ids]
    target_t = torch.tensor(targets, dtype=torch.int64, device=raw_logits.device)
    scored: list[TokenLogprobs | None] = []
    for lo in range(0, len(targets), PROMPT_ROWS_PER_PASS):
        hi = min(lo + PROMPT_ROWS_PER_PASS, len(targets))
        part = want[lo:hi]
        scored += compute_logprobs(raw_logits[lo:hi], target_t[lo:hi], part, max(part))
    out: dict[str, list[TokenLogprobs]] = {}
    rows = iter(scored)
    for chunk in chunks:
        out.setdefault(chunk.request_id, []).extend(next(rows) for _ in chunk.target_token_ids)  # type: ignore[misc]
    return out
