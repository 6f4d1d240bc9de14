"""Sampler: a batch of logits -> one token per row (+ logprobs), vectorised over the batch.

Order of transforms (as in vLLM): grammar bitmask -> penalties -> min_tokens bans -> temperature -> top-k ->
top-p -> min-p -> draw. Greedy rows take the argmax of the transformed logits, which equals the argmax of the
penalised logits: their temperature is 1 and every truncation keeps the most likely token.

Random rows are drawn by inverse transform, one uniform u per row: the token is the first index whose
cumulative probability (vocabulary order) exceeds u times the row's total, which picks token i with
probability exactly p_i. One uniform per row is what keeps it cheap: the exponential race it replaced
(argmax(p / q) with q ~ Exp(1), a random number per vocabulary entry) cost 29.6 ms at 64 rows of a 49k
vocabulary on CPU against 6.2 ms for the cumulative sum and search. A generator then advances by the same
amount every step whatever the vocabulary, which `advance_generator` and the rejection sampler mirror. A
seeded request draws its u from its own generator, so its tokens depend only on its seed and its own
logits, not on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenfleet.runtime.engine.logprobs import compute_logprobs
from tokenfleet.runtime.engine.outputs import TokenLogprobs
from tokenfleet.runtime.engine.sampling_metadata import PenaltyMetadata, SamplingMetadata
from tokenfleet.runtime.engine.structured_output.state import apply_token_bitmask

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "TokenLogprobs",
    "advance_generator",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "transform_logits",
]

_ARGMAX_BLOCK = 512  # columns per block of the CPU argmax (row_argmax): fastest of 256..4096 at 1-64 rows


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


# top-p first looks at each row's 64 most likely tokens (a partial top-k: a trained model at a low
# temperature settles there). A row whose boundary lies deeper is binned on CPU (`top_p_keep_by_bins`) and
# sorted whole elsewhere. On CPU, 2 threads, 64 rows of a 49k vocabulary, the sort costs 2-3 ms a row and the
# bins 0.2 ms; the partial top-k rounds of 1,024 and 4,096 the bins replace cost as much as the bins and
# settled only rows whose nucleus was that small (temperature 1.0, top-p 0.95: 167 to 2,171 tokens; 1.5: 10k
# to 21k).
TOP_P_CANDIDATES = 64
# The bins are equal slices of the distance below a row's largest logit, over the row's own span of
# finite logits but at most TOP_P_SPAN (e^-24 of the top probability: the last bin then also holds whatever
# lies further down, whose mass is negligible unless p is within ~1e-6 of 1). 1,024 bins leave a few hundred
# tokens in the boundary bin of a 49k vocabulary, even on a flat row.
TOP_P_BINS = 1024
TOP_P_SPAN = 24.0
TOP_P_BIN_ROWS = 8


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Out of place; removed tokens get -inf. top_k 0 and top_p 1.0 mean off for that row.

    top-k keeps the k largest logits (and any tied with the k-th). top-p then keeps the smallest set of most
    likely tokens whose probability reaches p, renormalised over the top-k survivors (at least one token).
    """
    if top_k is not None:
        logits = _apply_top_k(logits, top_k)
    if top_p is not None:
        logits = _apply_top_p(logits, top_p)
    return logits


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # topk(max k) rather than a full sort: k is small in practice.
    vocab = logits.shape[-1]
    max_k = int(top_k.max().clamp(min=1, max=vocab).item())
    k = top_k.clamp(min=1, max=max_k)
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth = kth.masked_fill((top_k <= 0).unsqueeze(1), float("-inf"))  # k = 0: the row keeps everything
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_keep(probs_desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep mask over probabilities in descending order: a token stays while the tokens above it hold less
    than p."""
    mass_above = probs_desc.cumsum(dim=-1) - probs_desc
    return mass_above < top_p.unsqueeze(1)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    # The probabilities come from softmax, not from exp(logit - logsumexp): on CPU logsumexp is not
    # vectorised (64 rows of 49k: 34.5 ms against softmax's 5.7).
    probs = logits.softmax(dim=-1)
    pending = torch.nonzero(top_p < 1.0).flatten()  # rows whose boundary is not found yet
    if not pending.numel():
        return logits
    every_row = pending.numel() == logits.shape[0]  # (pending is in row order): no copy
    rows = logits if every_row else logits.index_select(0, pending)
    row_probs = probs if every_row else probs.index_select(0, pending)
    row_p = top_p.index_select(0, pending)
    out = logits  # copied before the first row is written
    if vocab > TOP_P_CANDIDATES:
        values, index = rows.topk(TOP_P_CANDIDATES, dim=-1)
        keep = _top_p_keep(row_probs.gather(1, index), row_p)
        # The candidates decide a row when its boundary falls inside them (their last one is dropped).
        decided = ~keep[:, -1]
        if every_row and bool(decided.all()):  # the usual step: every row decided at once
            kept = values.masked_fill(~keep, float("-inf"))
            return torch.full_like(logits, float("-inf")).scatter_(1, index, kept)
        done = pending[decided]
        if done.numel():
            out = logits.clone()
            kept = values[decided].masked_fill(~keep[decided], float("-inf"))
            blank = torch.full((done.numel(), vocab), float("-inf"), dtype=out.dtype, device=out.device)
            out[done] = blank.scatter_(1, index[decided], kept)
            undecided = ~decided
            pending, rows, row_probs, row_p = (
                pending[undecided],
                rows[undecided],
                row_probs[undecided],
                row_p[undecided],
            )
            if not pending.numel():
                return out
    # The rest: binned on CPU, whose scatter-add sums in a fixed order (a CUDA one uses atomics, and a
    # seeded row's tokens must not depend on the order in which its bin's mass was added up); the sort is
    # cheap on a GPU.
    by_bins = logits.device.type == "cpu"
    keep = top_p_keep_by_bins(rows, row_probs, row_p) if by_bins else top_p_keep_by_sort(row_probs, row_p)
    if out is logits:
        if pending.numel() == logits.shape[0]:
            return logits.masked_fill(~keep, float("-inf"))
        out = logits.clone()
    out[pending] = rows.masked_fill(~keep, float("-inf"))
    return out


def top_p_keep_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep mask of top-p, each row sorted whole."""
    probs_desc, index = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, index, _top_p_keep(probs_desc, top_p))


def top_p_keep_by_bins(logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep mask of top-p without sorting a row: bin the row by logit, sum each bin's probability, and sort
    only the bin where the cumulative mass reaches p.

    Tokens in bins above the boundary bin are all kept (the mass above any of them is below p), those below
    it all dropped. Within the boundary bin a token stays while the bins above plus the bin's larger tokens
    hold less than p, the rule of `_top_p_keep`. Tokens of equal probability there are ordered by token id,
    so a row keeps the same tokens whatever else is in the batch. The masses are summed in float64 across
    bins: closer to the exact boundary than one float32 running sum over a whole sorted row.
    """
    # A few rows at a time: the int64 bins of 64 rows of a 49k vocabulary are 25 MB, and temporaries that
    # size are fresh pages each step (35 ms for 64 rows at once, 12 ms in blocks of 8).
    keep = torch.empty(probs.shape, dtype=torch.bool, device=probs.device)
    for start in range(0, probs.shape[0], TOP_P_BIN_ROWS):
        rows = slice(start, start + TOP_P_BIN_ROWS)
        keep[rows] = _top_p_keep_binned(logits[rows], probs[rows], top_p[rows])
    return keep


def _top_p_keep_binned(logits: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    num_bins = TOP_P_BINS
    top = logits.amax(dim=-1, keepdim=True)
    lowest = logits.nan_to_num(neginf=float("inf")).amin(dim=-1, keepdim=True)  # lowest finite logit
    span = (top - lowest).clamp_(min=1e-6, max=TOP_P_SPAN)
    # -inf logits (removed by top-k or a grammar) land in the last bin, with no probability.
    distance = (top - logits).mul_(num_bins / span).clamp_(max=num_bins - 1)
    bins = distance.to(torch.int64)
    mass = torch.zeros(bins.shape[0], num_bins, dtype=probs.dtype, device=probs.device)
    mass = mass.scatter_add_(1, bins, probs).double()
    cumulative = mass.cumsum(dim=1)
    p = top_p.double().unsqueeze(1)
    boundary = (cumulative < p).sum(dim=1, keepdim=True).clamp_(max=num_bins - 1)
    mass_above_bin = cumulative.gather(1, boundary) - mass.gather(1, boundary)
    in_boundary = bins == boundary
    count = int(in_boundary.sum(dim=1).max())
    values, index = probs.masked_fill(~in_boundary, -1.0).topk(count, dim=-1)
    # Ties by token id: put the candidates in id order, then a stable sort by probability.
    by_id = index.sort(dim=-1).indices
    values, index = values.gather(1, by_id), index.gather(1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    index = index.gather(1, order)
    values64 = values.double()
    mass_above = mass_above_bin + values64.cumsum(dim=-1) - values64
    keep_candidate = (values >= 0) & (mass_above < p)  # (the -1 fill pads rows with fewer candidates)
    keep = bins < boundary
    return keep.scatter_(1, index, keep.gather(1, index) | keep_candidate)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Out of place: remove tokens whose probability is below min_p * (probability of the most likely one)."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def transform_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits each row is drawn from: softmax of this is the sampling distribution (for random rows).

    Pure (the input is left untouched, it is still needed for raw logprobs). Public so that speculative
    decoding can verify against exactly the distribution the sampler draws from.
    """
    out = logits
    if meta.grammar_bitmask is not None and meta.grammar_rows is not None:
        # First, so every later transform (and greedy argmax) only ever sees grammatical tokens.
        out = apply_token_bitmask(out, meta.grammar_bitmask, meta.grammar_rows)
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


def shared_generator(
    cache: dict[torch.device, torch.Generator], device: torch.device, seed: int | None
) -> torch.Generator:
    """The generator unseeded rows draw from, one per device (fixed `seed` for reproducible runs)."""
    gen = cache.get(device)
    if gen is None:
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        cache[device] = gen
    return gen


class Sampler:
    """Stateless apart from the shared generator used by unseeded rows (one per device)."""

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        return shared_generator(self._shared, device, self._seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {meta.num_rows} sampling rows")
        transformed = transform_logits(logits.float(), meta)
        if meta.all_greedy:
            token_ids = row_argmax(transformed)
        else:
            probs = transformed.softmax(dim=-1)
            sampled = inverse_cdf(probs, self._uniforms(probs, meta))
            token_ids = (
                sampled if meta.all_random else torch.where(meta.greedy, row_argmax(transformed), sampled)
            )
        logprobs = compute_logprobs(logits, token_ids, meta.num_logprobs, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _uniforms(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One U[0, 1) per row: from the row's own generator when seeded, else the shared one.

        Greedy rows draw nothing (their u is 0 and unused) so a request's seeded stream only advances on the
        steps where it really samples.
        """
        greedy = meta.greedy_rows
        shared_rows = [i for i, g in enumerate(meta.generators) if g is None and not greedy[i]]
        shared = self._shared_generator(probs.device)
        if len(shared_rows) == meta.num_rows:
            return torch.rand((meta.num_rows,), generator=shared, dtype=probs.dtype, device=probs.device)
        u = torch.zeros((meta.num_rows,), dtype=probs.dtype, device=probs.device)
        if shared_rows:
            index = torch.tensor(shared_rows, dtype=torch.int64, device=probs.device)
            u[index] = torch.rand(
                (len(shared_rows),), generator=shared, dtype=probs.dtype, device=probs.device
            )
        for row, gen in enumerate(meta.generators):
            if gen is not None and not greedy[row]:
                u[row] = draw_uniform(gen, probs.dtype, probs.device)
        return u


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first on a tie (NaN counts as largest), as `argmax(-1)`.

    On CPU both `argmax` and `max(-1).indices` carry the index through the reduction and run as scalar
    loops, while a plain maximum (`amax`) is vectorised: over 64 rows of a 49k vocabulary (one thread)
    `max(-1)` took 2.7 ms, `amax` 0.18 ms, and greedy selection a fifth of a tiny model's decode step. So
    the CPU takes each block of `_ARGMAX_BLOCK` columns' maximum, finds the first block holding the row's
    maximum, and looks for the index only inside that block: 0.35 ms. The first block with the maximum
    holds its first occurrence, and NaN propagates through `amax` as it wins in `max`, so the index is
    `argmax`'s exactly. Elsewhere (a GPU's reduction is parallel anyway) and for short rows, one call.
    """
    rows, n = x.shape
    block = _ARGMAX_BLOCK
    if x.device.type != "cpu" or n < 4 * block:
        return x.max(dim=-1).indices
    full = n - n % block
    peaks = x[:, :full].view(rows, full // block, block).amax(dim=-1)
    if full < n:  # the last, shorter block
        peaks = torch.cat((peaks, x[:, full:].amax(dim=-1, keepdim=True)), dim=1)
    start = peaks.max(dim=-1).indices.mul_(block)
    # Columns past the end (the last block is shorter) repeat the last column: after its first copy.
    cols = (start.unsqueeze(1) + torch.arange(block, device=x.device)).clamp_(max=n - 1)
    inner = x.gather(1, cols).max(dim=-1).indices
    return cols.gather(1, inner.unsqueeze(1)).squeeze(1)


def draw_uniform(gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A seeded request's one U[0, 1) of a sampled token, shape (1,): the same call every time, so that the
    stream is the same on every device, whatever its generator's per-call offset rules."""
    return torch.rand((1,), generator=gen, dtype=dtype, device=device)


def advance_generator(gen: torch.Generator, num_steps: int) -> None:
    """Move a seeded request's generator past `num_steps` sampling steps, exactly as `Sampler` consumed it:
    one `draw_uniform` (float32) per sampled token. Used when a request resumes on another pod with tokens it
    already drew."""
    for _ in range(num_steps):
        draw_uniform(gen, torch.float32, gen.device)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token drawn from `weights[i]` (non-negative, not necessarily normalised) with its uniform
    `u[i]` in [0, 1): the first index whose cumulative weight exceeds u times the row's total.

    A cumulative sum of non-negative floats never decreases, so the search is well defined, and it lands
    only where the sum rises, on a token of positive weight. The target is kept below the total: u * total
    can round up to it, and nothing exceeds the total.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
