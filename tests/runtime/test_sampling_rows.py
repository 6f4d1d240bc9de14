"""The runner keeps a batch's sampling parameters across steps while its rows stay the same requests: what
follows the outputs (penalties, min_tokens bans) must still change every step, and seeded draws must not
depend on which other requests come and go."""

from __future__ import annotations

import pytest
import torch
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.llm import LLM
from tokenfleet.runtime.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(config=RuntimeConfig(), loaded=default_model, dtype="float32")


def test_seeded_output_is_the_same_alone_and_while_the_batch_changes_around_it(llm):
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["The weather today is"], seeded)[0].outputs[0].token_ids
    # The batch shrinks after 3 and 6 steps; between those its rows are the same requests.
    batch = llm.generate(
        ["The weather today is", "One two three", "A list of fruits:"],
        [
            seeded,
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
        ],
    )
    assert batch[0].outputs[0].token_ids == alone
    assert len(batch[1].outputs[0].token_ids) == 3 and len(batch[2].outputs[0].token_ids) == 6


def test_repetition_penalty_follows_the_outputs_step_by_step_as_hf(llm, hf_oracle):
    prompt = "one one one one one one one"
    ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=12, ignore_eos=True)
    ours = (
        llm.generate([ids, llm.tokenizer.encode("Two plus two is")], [params, params])[0].outputs[0].token_ids
    )
    with torch.inference_mode():
        ref = hf_oracle.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.5,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert ours == ref


def test_min_tokens_ban_lifts_once_reached(llm):
    prompt = "one one one one one one one one"
    free = (
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    # A token the greedy output first reaches at index k >= 2: banned before (where it is not the
    # argmax anyway, so the path is unchanged), allowed from k on, where it ends the request.
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[free[k]], min_tokens=k)
    held = llm.generate(
        [prompt, "Once upon a time"],
        [params, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)],
    )[0].outputs[0]
    assert held.token_ids == free[: k + 1] and held.finish_reason == "stop"
