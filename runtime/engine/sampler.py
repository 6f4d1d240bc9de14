"""Sampler: a batch of logits -> one token per row (+ logprobs), vectorised over the batch.

Order of transforms (as in vLLM): penalties -> min_tokens bans -> temperature -> top-k -> top-p -> min-p ->
draw. Greedy rows take the argmax of the transformed logits, which equals the argmax of the penalised logits:
their temperature is 1 and every truncation keeps the most likely token.

Random rows use the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability
exactly p_i, and needs no cumulative sum or per-row multinomial call. A seeded request draws its q from its
own generator, so its tokens depend only on its seed and its own logits, not on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenfleet.runtime.engine.logprobs import compute_logprobs
from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.engine.sampling_metadata import PenaltyMetadata, SamplingMetadata

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "TokenLogprobs",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "transform_logits",
]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where the request asked for none


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> torch.Tensor:
    """Out of place. Repetition (HF: divide positive / multiply negative logits of every token seen in the
    prompt or the output) then frequency and presence (OpenAI: subtract freq * count + presence * [count > 0],
    counting output tokens only)."""
    num_rows, vocab = logits.shape
    output_counts = torch.zeros((num_rows, vocab), dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, pen.output_token_ids, pen.output_weights.to(logits.dtype))
    out = logits
    if pen.use_repetition:
        seen = output_counts.clone()
        seen.scatter_add_(1, pen.prompt_token_ids, pen.prompt_weights.to(logits.dtype))
        rp = pen.repetition.unsqueeze(1)
        penalised = torch.where(out > 0, out / rp, out * rp)
        out = torch.where(seen > 0, penalised, out)
    if pen.use_frequency_presence:
        out = (
            out
            - pen.frequency.unsqueeze(1) * output_counts
            - pen.presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
        )
    return out


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Out of place; removed tokens get -inf. top_k 0 and top_p 1.0 mean off for that row.

    top-k keeps the k largest logits (and any tied with the k-th). top-p then keeps the smallest set of most
    likely tokens whose probability reaches p (at least one token).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        return _apply_top_k_only(logits, top_k)
    # Ascending sort: the cumulative sum then adds the small probabilities first (less rounding error).
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # A token goes when the tokens at or below it carry at most 1 - p: the ones above it already reach p.
    remove = cumulative <= (1.0 - top_p).unsqueeze(1)
    remove[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # topk(max k) is far cheaper than a full-vocabulary sort when k is small, the usual case.
    vocab = logits.shape[-1]
    max_k = int(top_k.max().clamp(min=1, max=vocab).item())
    k = top_k.clamp(min=1, max=max_k)
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth = kth.masked_fill((top_k <= 0).unsqueeze(1), float("-inf"))  # k = 0: the row keeps everything
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Out of place: remove tokens whose probability is below min_p * (probability of the most likely one)."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def transform_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits each row is drawn from: softmax of this is the sampling distribution (for random rows).

    Pure (the input is left untouched, it is still needed for raw logprobs). Speculative decoding uses the
    same function so its rejection sampling targets exactly the distribution the sampler draws from.
    """
    out = logits
    if meta.penalties is not None:
        out = apply_penalties(out, meta.penalties)
    if meta.banned_rows is not None and meta.banned_token_ids is not None:
        # Stop ids outside the vocabulary can never be sampled anyway; indexing with them would fail.
        in_vocab = meta.banned_token_ids < out.shape[-1]
        out = out.index_put(
            (meta.banned_rows[in_vocab], meta.banned_token_ids[in_vocab]),
            torch.tensor(float("-inf"), dtype=out.dtype, device=out.device),
        )
    if meta.all_greedy:
        return out
    out = out / meta.temperature.unsqueeze(1)
    out = apply_top_k_top_p(out, meta.top_k, meta.top_p)
    return apply_min_p(out, meta.min_p)


class Sampler:
    """Stateless apart from the shared generator used by unseeded rows (one per device)."""

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {meta.num_rows} sampling rows")
        transformed = transform_logits(logits.float(), meta)
        if meta.all_greedy:
            token_ids = transformed.argmax(dim=-1)
        else:
            probs = transformed.softmax(dim=-1)
            q = self._exponentials(probs, meta)
            sampled = (probs / q).argmax(dim=-1)
            token_ids = (
                sampled if meta.all_random else torch.where(meta.greedy, transformed.argmax(-1), sampled)
            )
        logprobs = compute_logprobs(logits, token_ids, meta.num_logprobs, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _exponentials(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """q ~ Exp(1) per row and token: from the row's own generator when seeded, else the shared one.

        Greedy rows draw nothing (their q is 1 and unused) so a request's seeded stream only advances on the
        steps where it really samples.
        """
        q = torch.ones_like(probs)
        greedy = meta.greedy.tolist()
        shared_rows = [i for i, g in enumerate(meta.generators) if g is None and not greedy[i]]
        if shared_rows:
            gen = self._shared_generator(probs.device)
            if len(shared_rows) == meta.num_rows:
                q.exponential_(generator=gen)
            else:
                index = torch.tensor(shared_rows, dtype=torch.int64, device=probs.device)
                q[index] = torch.empty(
                    (len(shared_rows), probs.shape[1]), dtype=probs.dtype, device=probs.device
                ).exponential_(generator=gen)
        for row, gen in enumerate(meta.generators):
            if gen is not None and not greedy[row]:
                q[row].exponential_(generator=gen)
        # Exp(1) can return exactly 0; p / 0 would be inf (or nan for a removed token) and win the race.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)
