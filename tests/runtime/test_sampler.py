"""Sampler: greedy, seeded reproducibility across batches, truncation masks vs torch references, the sampled
distribution, penalties, min_tokens bans and raw logprobs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    inverse_cdf,
    row_argmax,
    top_p_keep_by_bins,
    top_p_keep_by_sort,
    transform_logits,
)
from tokenfleet.runtime.engine.sampling_params import SamplingParams

EOS = 2
_ids = itertools.count()


def make_request(prompt=(5, 6, 7), output=(), eos=frozenset({EOS}), **params) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_ids=eos,
        output_token_ids=list(output),
    )


def seeded_generators(requests) -> dict[str, torch.Generator]:
    gens = {}
    for r in requests:
        if r.sampling_params.seed is not None:
            gens[r.request_id] = torch.Generator().manual_seed(r.sampling_params.seed)
    return gens


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_also_in_a_mixed_batch():
    logits = random_logits(6, 1000, seed=1)
    reqs = [make_request(temperature=0.0) for _ in range(6)]
    out = Sampler()(logits, SamplingMetadata.build(reqs, {}, "cpu"))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6

    # Greedy rows next to random rows with truncation still take the plain argmax.
    mixed = [make_request(temperature=0.0, top_k=3, top_p=0.5) if i % 2 else make_request() for i in range(6)]
    out = Sampler(seed=0)(logits, SamplingMetadata.build(mixed, {}, "cpu"))
    assert out.token_ids[1::2] == logits.argmax(-1).tolist()[1::2]


def _run_steps(batch_builders, target_index, steps=6, vocab=500):
    """Sample `steps` steps; the target's logits are the same each run, the others' differ per run."""
    requests = batch_builders()
    gens = seeded_generators(requests)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = random_logits(len(requests), vocab, seed=1000 + step + 17 * len(requests))
        logits[target_index] = random_logits(1, vocab, seed=step, scale=1.0)[0]
        out = sampler(logits, SamplingMetadata.build(requests, gens, "cpu"))
        for r, tok in zip(requests, out.token_ids, strict=True):
            r.output_token_ids.append(tok)
        tokens.append(out.token_ids[target_index])
    return tokens


@pytest.mark.parametrize("vocab", [2047, 2048, 2049, 5000, 49152])
@pytest.mark.parametrize("kind", ["normal", "ties", "one_finite", "nan"])
def test_row_argmax_is_argmax_exactly(vocab, kind):
    # The CPU path searches blocks of columns; ties (first index wins), a row that is -inf but for one
    # token (a grammar mask), NaN (counts as largest), a short last block: all as torch.argmax.
    gen = torch.Generator().manual_seed(vocab)
    rows = 9
    if kind == "ties":  # maxima in several blocks, and several times within a block
        x = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    elif kind == "one_finite":
        x = torch.full((rows, vocab), float("-inf"))
        x[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=gen)] = -1.0
        x[0, vocab - 1] = 0.0  # in the last column, of the shorter last block
    else:
        x = torch.randn((rows, vocab), generator=gen)
        x[3, 1] = x[3].max()  # a tie between the first block and a later one
        if kind == "nan":
            x[torch.rand((rows, vocab), generator=gen) < 2 / vocab] = float("nan")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[2:3]), x[2:3].argmax(dim=-1))  # one row


def test_seeded_sampling_is_independent_of_the_batch():
    def target(seed=1234):
        return make_request(temperature=1.3, top_p=0.95, seed=seed, presence_penalty=0.5)

    alone = _run_steps(lambda: [target()], 0)
    in_batch = _run_steps(
        lambda: [
            make_request(temperature=0.7),
            make_request(temperature=0.9, seed=7, top_k=20),
            target(),
            make_request(temperature=0.0),
            make_request(min_p=0.1, repetition_penalty=1.2),
        ],
        2,
    )
    assert alone == in_batch
    # The seed matters: another seed on the same logits gives another sequence (flat logits, 6 draws).
    assert _run_steps(lambda: [target(seed=99)], 0) != alone


def _reference_top_k(row: torch.Tensor, k: int) -> set[int]:
    if k == 0:
        return set(range(row.numel()))
    return set(torch.topk(row, k).indices.tolist())


def _reference_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1).tolist()
    kept, total = set(), 0.0
    for tok in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if probs[tok] == 0.0:
            break
        kept.add(tok)
        total += probs[tok]
        if total >= p:
            break
    return kept


def _reference_min_p(row: torch.Tensor, min_p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1)
    return {i for i, pr in enumerate(probs.tolist()) if pr >= min_p * float(probs.max())}


def _kept(logits_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits_row)).flatten().tolist())


@pytest.mark.parametrize(("vocab", "scale"), [(7, 3.0), (1000, 3.0), (3000, 3.0), (3000, 0.3)])
def test_top_k_top_p_min_p_masks_match_references(vocab, scale):
    # vocab 3000: peaked rows settle top-p among the first rounds of top-k candidates, flat ones
    # (scale 0.3) need the full sort; both paths must agree with the reference.
    logits = random_logits(8, vocab, seed=vocab, scale=scale)
    ks = torch.tensor([0, 1, 3, 5, vocab, 2, 0, 4])
    ps = torch.tensor([0.5, 0.9, 1.0, 0.3, 0.75, 0.99, 0.2, 0.6])
    mps = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.01, 0.3, 1.0, 0.1])

    top_k_only = apply_top_k_top_p(logits, ks, None)
    top_p_only = apply_top_k_top_p(logits, None, ps)
    both = apply_top_k_top_p(logits, ks, ps)
    min_p_only = apply_min_p(logits, mps)
    for i in range(8):
        row = logits[i]
        assert _kept(top_k_only[i]) == _reference_top_k(row, int(ks[i]))
        assert _kept(top_p_only[i]) == _reference_top_p(row, float(ps[i]))
        assert _kept(min_p_only[i]) == _reference_min_p(row, float(mps[i]))
        # top-p applies to the top-k survivors, renormalised.
        after_k = row.masked_fill(
            ~torch.isin(torch.arange(vocab), torch.tensor(sorted(_kept(top_k_only[i])))), -math.inf
        )
        assert _kept(both[i]) == _reference_top_p(after_k, float(ps[i]))
        # Survivors keep their logit unchanged.
        assert torch.equal(both[i][torch.isfinite(both[i])], row[torch.isfinite(both[i])])


def test_top_p_boundaries_found_by_the_candidates_and_by_the_bins_match_the_reference():
    """In one batch, a peaked row is decided by the first top-k candidates and flatter ones by the bins (a
    few hundred tokens, thousands, nearly all): each row keeps what the reference keeps."""
    vocab = 6000
    base = random_logits(1, vocab, seed=21, scale=1.0)[0]
    logits = torch.stack([base * 8.0, base * 2.5, base * 1.5, base * 0.05])  # flatter and flatter
    out = apply_top_k_top_p(logits, None, torch.full((4,), 0.9))
    sizes = []
    for i in range(4):
        kept = _kept(out[i])
        assert kept == _reference_top_p(logits[i], 0.9)
        assert torch.equal(out[i][torch.isfinite(out[i])], logits[i][torch.isfinite(out[i])])
        sizes.append(len(kept))
    assert sizes[0] < TOP_P_CANDIDATES < sizes[1] < 1024 < sizes[2] < 4096 < sizes[3] < vocab, sizes


@pytest.mark.parametrize("p", [0.30001, 0.90001, 0.98999, 1.0 - 1e-9])  # (not where the uniform row ties p)
def test_top_p_bins_keep_what_the_reference_keeps_with_ties_and_removed_tokens(p):
    """Rows with many exactly tied logits (rounded to bfloat16, as a bf16 model's are; one row entirely
    uniform), and rows with tokens already removed (-inf): ties at the boundary go by token id, as in the
    reference, and a p within rounding of 1 keeps every token that has probability."""
    vocab = 3000
    raw = random_logits(4, vocab, seed=8, scale=2.0)
    rows = raw.to(torch.bfloat16).float()
    rows[1] = 0.5  # uniform: one bin holds the whole row
    rows[2, ::3] = float("-inf")
    rows[3] = rows[3] * 0.02
    probs = rows.softmax(dim=-1)
    keep = top_p_keep_by_bins(rows, probs, torch.full((4,), p))
    for i in range(4):
        assert set(torch.nonzero(keep[i] & (probs[i] > 0)).flatten().tolist()) == _reference_top_p(rows[i], p)


def test_top_p_bins_agree_with_the_sort_and_do_not_depend_on_the_batch():
    vocab = 5000
    rows = random_logits(6, vocab, seed=13, scale=1.5)
    rows[5] = rows[5].to(torch.bfloat16).float() * 0.1  # a boundary among tied tokens, a large boundary bin
    top_p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 0.9])
    probs = rows.softmax(dim=-1)
    together = top_p_keep_by_bins(rows, probs, top_p)
    for i in range(6):
        alone = top_p_keep_by_bins(rows[i : i + 1], probs[i : i + 1], top_p[i : i + 1])
        assert torch.equal(together[i], alone[0])
    sort = top_p_keep_by_sort(probs[:5], top_p[:5])  # (no ties there: the sort's order among them is its own)
    assert torch.equal(together[:5], sort)


def test_inverse_cdf_lands_only_on_tokens_of_positive_weight():
    weights = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for u, expected in ((0.0, [1, 5]), (0.5, [1, 5]), (0.7, [4, 5]), (float(below_one), [4, 5])):
        assert inverse_cdf(weights, torch.tensor([u, u])).tolist() == expected, u


def test_full_transform_applies_temperature_before_top_p():
    logits = random_logits(2, 50, seed=3)
    reqs = [make_request(temperature=0.5, top_p=0.8), make_request(temperature=2.0, top_p=0.8)]
    out = transform_logits(logits, SamplingMetadata.build(reqs, {}, "cpu"))
    for i, t in enumerate((0.5, 2.0)):
        assert _kept(out[i]) == _reference_top_p(logits[i] / t, 0.8)
        assert torch.allclose(out[i][torch.isfinite(out[i])], (logits[i] / t)[torch.isfinite(out[i])])
    assert len(_kept(out[0])) < len(_kept(out[1]))  # colder -> fewer tokens reach 80 %


def _expected_probs(logits_row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.sampling_params
    scaled = logits_row.double() / p.temperature
    kept = _reference_top_k(scaled, p.top_k)
    masked = scaled.masked_fill(
        ~torch.isin(torch.arange(scaled.numel()), torch.tensor(sorted(kept))), -math.inf
    )
    kept = _reference_top_p(masked, p.top_p) & _reference_min_p(masked, p.min_p)
    masked = scaled.masked_fill(
        ~torch.isin(torch.arange(scaled.numel()), torch.tensor(sorted(kept))), -math.inf
    )
    return torch.softmax(masked, -1)


def _chi_square(counts: torch.Tensor, expected: torch.Tensor, draws: int) -> float:
    support = expected > 0
    assert counts[~support].sum() == 0, "a removed token was sampled"
    e = expected[support] * draws
    return float((((counts[support].double() - e) ** 2) / e).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_distribution_matches_renormalised_probabilities(seeded):
    vocab = 12
    logits = torch.linspace(2.0, -2.0, vocab) + random_logits(1, vocab, seed=5, scale=0.3)[0]
    draws = 4000 if not seeded else 1500
    params = dict(temperature=0.8, top_k=9, top_p=0.95, min_p=0.02)
    reqs = [make_request(seed=i if seeded else None, **params) for i in range(draws)]
    meta = SamplingMetadata.build(reqs, seeded_generators(reqs), "cpu")
    out = Sampler(seed=123)(logits.expand(draws, vocab).contiguous(), meta)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab)
    expected = _expected_probs(logits, reqs[0])
    support = int((expected > 0).sum())
    assert 3 <= support < vocab  # truncation really removed tokens, and sampling is not degenerate
    # Chi-square critical value at p = 0.001 is below 27 for <= 8 degrees of freedom.
    assert _chi_square(counts, expected, draws) < 27.0


def _reference_penalties(logits, req: Request):
    p = req.sampling_params
    out = logits.clone()
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    for tok in seen:
        if out[tok] > 0:
            out[tok] = out[tok] / p.repetition_penalty
        else:
            out[tok] = out[tok] * p.repetition_penalty
    for tok in set(req.output_token_ids):
        out[tok] -= p.frequency_penalty * req.output_token_ids.count(tok) + p.presence_penalty
    return out


def test_penalties_match_the_reference_formulas():
    vocab = 40
    logits = random_logits(4, vocab, seed=9)
    reqs = [
        make_request(prompt=[1, 3, 3, 8], output=[8, 9, 9, 9, 20], temperature=0.0, repetition_penalty=1.5),
        make_request(
            prompt=[4, 5], output=[5, 6, 6], temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4
        ),
        make_request(prompt=[0, 1, 2], output=[], temperature=0.0),
        make_request(
            prompt=[10, 11, 12, 13, 14, 15],
            output=[11, 30, 30],
            temperature=0.0,
            repetition_penalty=0.8,
            frequency_penalty=-0.5,
            presence_penalty=1.0,
        ),
    ]
    out = transform_logits(logits, SamplingMetadata.build(reqs, {}, "cpu"))
    for i, r in enumerate(reqs):
        # allclose, not testing.assert_close: the latter lazily imports torch.distributed (seconds).
        assert torch.allclose(out[i], _reference_penalties(logits[i], r), rtol=1e-6, atol=1e-6)
    # Row 1: frequency/presence look at output tokens only; prompt-only token 4 is untouched.
    assert out[1][4] == logits[1][4]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    vocab = 30
    logits = torch.zeros((4, vocab))
    logits[:, EOS] = 10.0
    logits[:, 17] = 9.0  # a stop token id
    logits[:, 25] = 8.0
    reqs = [
        make_request(temperature=0.0, min_tokens=3, output=[4, 4], stop_token_ids=[17]),
        make_request(temperature=0.0, min_tokens=3, output=[4, 4, 4], stop_token_ids=[17]),
        make_request(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[17]),
        make_request(temperature=0.0, min_tokens=2, stop_token_ids=[17, 10_000]),  # out of vocab: ignored
    ]
    out = Sampler()(logits, SamplingMetadata.build(reqs, {}, "cpu"))
    # ignore_eos: EOS does not end the request, so it is not banned; the stop token still is.
    assert out.token_ids == [25, EOS, EOS, 25]


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    vocab = 64
    logits = random_logits(3, vocab, seed=11)
    reqs = [
        make_request(temperature=0.7, seed=1, logprobs=5, repetition_penalty=1.3, output=[1, 2, 3]),
        make_request(temperature=0.0, logprobs=0),
        make_request(temperature=1.0),
    ]
    out = Sampler()(logits, SamplingMetadata.build(reqs, seeded_generators(reqs), "cpu"))
    reference = torch.log_softmax(logits, -1)
    first, second, third = out.logprobs
    assert third is None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(float(reference[0, first.token_id]), abs=1e-6)
    assert len(first.top) == 5
    top_values = [lp for _, lp in first.top]
    assert top_values == sorted(top_values, reverse=True)
    expected = torch.topk(reference[0], 5)
    assert [t for t, _ in first.top] == expected.indices.tolist()
    assert top_values == pytest.approx(expected.values.tolist(), abs=1e-6)
    assert second.top == () and second.token_id == int(logits[1].argmax())
    assert second.logprob == pytest.approx(float(reference[1].max()), abs=1e-6)


def test_mismatched_rows_are_rejected():
    reqs = [make_request()]
    with pytest.raises(ValueError):
        Sampler()(torch.zeros((2, 10)), SamplingMetadata.build(reqs, {}, "cpu"))


# --- grammar bitmasks ------------------------------------------------------------------------------


def _bitmask(rows: int, vocab: int, allowed: dict[int, list[int]]) -> torch.Tensor:
    """[rows, ceil(V/32)] int32; rows in `allowed` permit only those tokens, the others everything."""
    bits = torch.ones((rows, (vocab + 31) // 32 * 32), dtype=torch.bool)
    for row, tokens in allowed.items():
        bits[row] = False
        bits[row, tokens] = True
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (bits.view(rows, -1, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_grammar_bitmask_restricts_only_its_rows():
    from dataclasses import replace

    vocab = 100
    reqs = [make_request(temperature=1.0, seed=i) for i in range(3)] + [make_request(temperature=0.0)]
    logits = random_logits(4, vocab, seed=0)
    allowed = {0: [3, 50, 99], 3: [7, 8]}
    base = SamplingMetadata.build(reqs, seeded_generators(reqs), "cpu")
    meta = replace(base, grammar_rows=(0, 3), grammar_bitmask=_bitmask(4, vocab, allowed))
    free = Sampler()(logits, SamplingMetadata.build(reqs, seeded_generators(reqs), "cpu")).token_ids
    for _ in range(20):
        out = Sampler()(logits, replace(meta, generators=(None,) * 4)).token_ids
        assert out[0] in allowed[0]
        assert out[3] == max(allowed[3], key=lambda t: logits[3, t].item())  # greedy: best allowed
    constrained = Sampler()(
        logits, replace(meta, generators=tuple(seeded_generators(reqs).get(r.request_id) for r in reqs))
    )
    assert constrained.token_ids[1:3] == free[1:3]  # unconstrained rows draw exactly as before


def test_rejection_sampler_never_accepts_a_draft_the_grammar_forbids():
    from dataclasses import replace

    from tokenfleet.runtime.engine.spec_decode.rejection_sampler import RejectionSampler, VerifyBatch

    vocab = 64
    req = make_request(temperature=0.0)
    logits = torch.full((3, vocab), -5.0)
    logits[:, 9] = 5.0  # the model is sure of token 9 everywhere...
    meta = SamplingMetadata.build([req] * 3, {}, "cpu")
    # ...but the grammar allows only 4 or 5 after the last known token.
    meta = replace(meta, grammar_rows=(0,), grammar_bitmask=_bitmask(3, vocab, {0: [4, 5]}))
    batch = VerifyBatch(meta=meta, draft_token_ids=((9, 9),), greedy=(True,), generators=(None,))
    (emitted,) = RejectionSampler()(logits, batch)
    assert emitted[0] in (4, 5) and len(emitted) == 1
