"""The engine state a continuation rebuilds, checked against the uninterrupted run (fast, no model forward).

- The detokenizer resumed from the generated ids and the delivered characters releases exactly the rest
  of the text: with characters split across tokens (emoji) and a stop string whose prefix was held back
  at the cut.
- A seeded generator advanced past k sampling steps draws what the uninterrupted one draws at step k + 1,
  so a seeded request samples the same tokens after a resume (with top-p, penalties and min_tokens bans).
"""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from tokenfleet.runtime.engine.request import Request
from tokenfleet.runtime.engine.sampler import Sampler, advance_generator
from tokenfleet.runtime.engine.sampling_metadata import SamplingMetadata
from tokenfleet.runtime.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from tokenfleet.runtime.router.main import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def unbroken(tokenizer, prompt_ids, ids, params) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = [detok.update([t]) for t in ids]
    return [*deltas[:-1], deltas[-1] + detok.flush()] if not detok.finished else deltas


@pytest.mark.parametrize(
    "stop", [[], ["the fox"], ["🦊 and"]], ids=["no-stop", "stop-across-words", "stop-across-an-emoji"]
)
def test_the_detokenizer_resumes_where_the_client_is(tokenizer, stop):
    prompt_ids = tokenizer.encode("Tell me:", add_special_tokens=False)
    ids = tokenizer.encode(
        " Then the quick 🦊 and the fox jumped over 日本語 text.", add_special_tokens=False
    )
    params = SamplingParams(stop=stop, max_tokens=None)
    deltas = unbroken(tokenizer, prompt_ids, ids, params)
    full = "".join(deltas)
    for k in range(1, len(ids)):
        held = "".join(deltas[:k])  # what the client got for the first k tokens
        resumed = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        resumed.resume(ids[:k], len(held))
        rest = [resumed.update([t]) for t in ids[k:]] if not resumed.finished else []
        rest.append(resumed.flush())
        assert held + "".join(rest) == full, (k, held, rest)


def _request(rid: str, params: SamplingParams, outputs: list[int]) -> Request:
    return Request(rid, [1, 2, 3], params, output_token_ids=list(outputs))


def test_a_seeded_generator_advanced_past_k_steps_samples_the_same_tokens():
    vocab, steps, seed = 512, 12, 1234
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed, frequency_penalty=0.5, min_tokens=3)
    logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()

    def run(gen: torch.Generator, outputs: list[int], start: int) -> list[int]:
        out = list(outputs)
        for step in range(start, steps):
            meta = SamplingMetadata.build([_request("r", params, out)], {"r": gen}, "cpu")
            out.append(sampler(logits[step : step + 1], meta).token_ids[0])
        return out

    whole = run(torch.Generator().manual_seed(seed), [], 0)
    assert len(set(whole)) > 3  # really sampled
    for k in (1, 5, 11):
        gen = torch.Generator().manual_seed(seed)
        advance_generator(gen, k)
        assert run(gen, whole[:k], k) == whole, k
    # Without the advance the continuation would diverge: the check can fail.
    assert run(torch.Generator().manual_seed(seed), whole[:5], 5) != whole
