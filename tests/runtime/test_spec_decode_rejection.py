"""Rejection sampling keeps the target distribution exactly (statistically, over many seeded rows) and
reproduces greedy decoding exactly."""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.engine.spec_decode.rejection_sampler import RejectionSampler, VerifyBatch
from tokenfleet.runtime.engine.spec_decode.verify_rows import build_verify_batch, verification_rows

VOCAB = 8
# chi-square critical value for 7 degrees of freedom at p = 0.001: a correct sampler fails 1 in 1000
# seeds; the seeds below are fixed, so the test is deterministic.
CHI2_CRIT_7 = 24.32
CPU = torch.device("cpu")


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def make_requests(n: int, params: SamplingParams) -> list[Request]:
    return [Request(str(i), [1, 2, 3], params) for i in range(n)]


@pytest.fixture(scope="module")
def target_logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, VOCAB, generator=gen) * 1.5  # rows: after the last token, after d_1


def run_point_mass(target_logits, drafts_per_row, temperature=1.0, seed_base=None):
    num = len(drafts_per_row)
    params = SamplingParams(temperature=temperature, max_tokens=8)
    reqs = make_requests(num, params)
    gens = {}
    if seed_base is not None:
        gens = {r.request_id: torch.Generator().manual_seed(seed_base + i) for i, r in enumerate(reqs)}
    batch = build_verify_batch(reqs, [[d] for d in drafts_per_row], gens, CPU)
    logits = target_logits.repeat(num, 1)
    return RejectionSampler(seed=1)(logits, batch)


@pytest.mark.parametrize("draft", [0, 3])
def test_point_mass_proposals_keep_the_target_distribution(target_logits, draft):
    num = 4000
    p = torch.softmax(target_logits, dim=-1)
    emitted = run_point_mass(target_logits, [draft] * num)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).float()
    assert chi2(first, p[0]) < CHI2_CRIT_7
    # When d_1 was accepted, the bonus token follows the second row's distribution.
    bonus = [e[1] for e in emitted if len(e) == 2]
    assert abs(len(bonus) / num - p[0, draft].item()) < 0.03
    counts = torch.bincount(torch.tensor(bonus), minlength=VOCAB).float()
    assert chi2(counts, p[1]) < CHI2_CRIT_7


def test_dense_draft_distribution_keeps_the_target_distribution(target_logits):
    num = 4000
    gen = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(VOCAB, generator=gen), dim=-1)
    drafts = torch.multinomial(q, num, replacement=True, generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=8)
    reqs = make_requests(num, params)
    plain = build_verify_batch(reqs, [[d] for d in drafts], {}, CPU)
    batch = VerifyBatch(
        meta=plain.meta,
        draft_token_ids=plain.draft_token_ids,
        greedy=plain.greedy,
        generators=plain.generators,
        draft_probs=q.repeat(num, 1),
    )
    emitted = RejectionSampler(seed=2)(target_logits.repeat(num, 1), batch)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).float()
    assert chi2(first, torch.softmax(target_logits[0], dim=-1)) < CHI2_CRIT_7
    # Acceptance rate of the optimal scheme: sum_j min(p_j, q_j).
    rate = sum(len(e) == 2 for e in emitted) / num
    expected = torch.minimum(torch.softmax(target_logits[0], -1), q).sum().item()
    assert abs(rate - expected) < 0.03


def test_temperature_and_top_k_are_the_law_verified_against(target_logits):
    num = 4000
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=8)
    reqs = make_requests(num, params)
    batch = build_verify_batch(reqs, [[1]] * num, {}, CPU)
    emitted = RejectionSampler(seed=3)(target_logits.repeat(num, 1), batch)
    scaled = target_logits[0] / 0.7
    kth = scaled.topk(3).values[-1]
    p = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).float()
    assert first[p == 0].sum() == 0, "a token outside top-k was emitted"
    support = p > 0
    assert chi2(first[support], p[support]) < 13.82  # 2 degrees of freedom, p = 0.001


def test_greedy_accepts_the_argmax_prefix_and_emits_the_argmax():
    logits = torch.full((4, VOCAB), -5.0)
    for row, tok in enumerate([2, 4, 6, 1]):
        logits[row, tok] = 5.0
    reqs = make_requests(3, SamplingParams(temperature=0.0))
    drafts = [[2, 4, 6], [2, 5, 6], [3, 4, 6]]
    rows = torch.cat([logits, logits, logits])
    out = RejectionSampler()(rows, build_verify_batch(reqs, drafts, {}, CPU))
    assert out == [[2, 4, 6, 1], [2, 4], [2]]


def test_seeded_requests_are_reproducible_and_independent_of_the_batch(target_logits):
    solo = run_point_mass(target_logits, [3] * 4, seed_base=100)
    again = run_point_mass(target_logits, [3] * 4, seed_base=100)
    assert solo == again
    # The same seeded requests inside a larger unseeded batch draw the same numbers.
    num = 6
    params = SamplingParams(temperature=1.0, max_tokens=8)
    reqs = make_requests(num, params)
    gens = {str(i): torch.Generator().manual_seed(100 + i) for i in range(4)}
    batch = build_verify_batch(reqs, [[3]] * num, gens, CPU)
    mixed = RejectionSampler(seed=9)(target_logits.repeat(num, 1), batch)
    assert mixed[:4] == solo


def test_penalties_see_the_earlier_proposals_of_the_same_step():
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    req = Request("r", [1], params, output_token_ids=[5])
    rows = verification_rows(req, [6, 7])
    assert [r.output_token_ids for r in rows] == [[5], [5, 6], [5, 6, 7]]
    plain = Request("p", [1], SamplingParams(temperature=0.0))
    assert verification_rows(plain, [6, 7]) == [plain, plain, plain]
    # min_tokens lifts its EOS ban at the row where enough tokens are out.
    eos_req = Request("e", [1], SamplingParams(temperature=0.0, min_tokens=2), eos_token_ids=frozenset({0}))
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 10.0  # EOS is the argmax everywhere
    batch = build_verify_batch([eos_req], [[3, 4]], {}, CPU)
    # Row 0 (0 outputs) and row 1 (1 output) ban EOS, so d_1 = 3 is not the argmax there:
    # the argmax among the rest is token 1.
    assert RejectionSampler()(logits, batch) == [[1]]
    logits[0, 3] = 5.0
    logits[1, 4] = 5.0
    assert RejectionSampler()(logits, batch) == [[3, 4, 0]]
