"""stream_interval: fewer, larger deltas; the same tokens, text, logprobs and stop points as every step's."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.engine.output_processor import OutputProcessor
from tokenfleet.runtime.engine.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 314, 253], [1, 1070, 10428, 6128, 30]]


def _run(default_model, interval: int, params: SamplingParams) -> dict[str, list]:
    config = RuntimeConfig.model_validate(
        {
            "model": {"dtype": "float32", "attention_backend": "torch"},
            "cache": {"num_blocks": 64},
            "server": {"stream_interval": interval},
        }
    )
    core = EngineCore(config, loaded=default_model)
    deltas: dict[str, list] = {}
    try:
        for i, prompt in enumerate(PROMPTS):
            core.add_request(f"r{i}", prompt, params)
        while core.has_unfinished():
            for d in core.step():
                deltas.setdefault(d.request_id, []).append(d)
    finally:
        core.shutdown()
    return deltas


def _joined(deltas: list) -> tuple:
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in (d.new_logprobs or [])]
    return (
        [t for d in deltas for t in d.new_token_ids],
        "".join(d.new_text for d in deltas),
        [(lp.token_id, lp.logprob) for lp in logprobs],
        last.finish_reason,
        last.stop_reason,
        last.num_output_tokens,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=2),
        # A stop string found mid-way: the request ends at the same token whatever the interval.
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["."]),
    ],
    ids=["logprobs", "stop-string"],
)
def test_an_interval_merges_deltas_and_changes_nothing_else(default_model, params):
    every = _run(default_model, 1, params)
    merged = _run(default_model, 3, params)
    assert every.keys() == merged.keys() == {"r0", "r1", "r2"}
    for rid, deltas in every.items():
        assert _joined(merged[rid]) == _joined(deltas), rid
        assert all(len(d.new_token_ids) == 1 for d in deltas)  # one token per step, no speculation
        sizes = [len(d.new_token_ids) for d in merged[rid]]
        # The first token at once, then three at a time; the last delta carries what is left (maybe 0
        # tokens more: a stop string's flush, or nothing).
        assert sizes[0] == 1 and all(n == 3 for n in sizes[1:-1]) and sizes[-1] <= 3, sizes
        assert merged[rid][-1].finished and merged[rid][-1].metrics is not None
        assert not any(d.finished for d in merged[rid][:-1])
    if params.stop:
        assert any(deltas[-1].finish_reason == "stop" for deltas in every.values())


def test_an_abort_sends_what_was_held():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    from tokenfleet.runtime.engine.request import Request

    out = OutputProcessor(Tok(), lambda rid: None, lambda: 0.0, stream_interval=4)
    req = Request("r", [1, 2], SamplingParams(max_tokens=10, temperature=0.0))
    out.add(req)
    sent = []
    for token in (5, 6, 7):  # the first goes out at once, the next two are held
        before = len(req.output_token_ids)
        req.output_token_ids.append(token)
        sent += out.process({"r": before}, {}, set())[0]
    assert [d.new_token_ids for d in sent] == [[5]]
    final = out.abort("r")
    assert final.finished and final.finish_reason == "abort" and final.new_token_ids == [6, 7]
    assert sent[0].new_text + final.new_text == Tok().decode([5, 6, 7])


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval"):
        RuntimeConfig.model_validate({"server": {"stream_interval": 0}})
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(None, lambda rid: None, lambda: 0.0, stream_interval=0)


def test_a_live_change_of_interval_applies_from_the_next_step_and_lowering_it_sends_what_is_held(
    default_model,
):
    config = RuntimeConfig.model_validate(
        {
            "model": {"dtype": "float32", "attention_backend": "torch"},
            "cache": {"num_blocks": 64},
            "server": {"stream_interval": 8},
        }
    )
    core = EngineCore(config, loaded=default_model)
    try:
        core.add_request("r", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        sizes = []
        for step in range(12):
            if step == 4:  # 1 token sent, 3 held under interval 8
                core.set_stream_interval(2)
            sizes += [len(d.new_token_ids) for d in core.step()]
        assert not core.has_unfinished()
        # Held 3 + this step's 1 go out at once, then two at a time to the end.
        assert sizes == [1, 4, 2, 2, 2, 1], sizes
        with pytest.raises(ValueError, match="stream_interval"):
            core.set_stream_interval(0)
    finally:
        core.shutdown()
