"""N-gram (prompt lookup) proposals: longest suffix match first, most recent occurrence, never the suffix."""

from __future__ import annotations

import numpy as np
import pytest
from tokenfleet.runtime.engine.spec_decode.ngram import NgramProposer, propose_ngram
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput
from tokenfleet.runtime.errors import ConfigError


def ngram(tokens: list[int], k: int = 3, lo: int = 1, hi: int = 4) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int64), lo, hi, k)


def test_continues_after_the_earlier_occurrence():
    assert ngram([5, 6, 7, 8, 9, 1, 5, 6]) == [7, 8, 9]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "2 3" occurred followed by 4; a later "3" alone is followed by 9.
    assert ngram([2, 3, 4, 4, 3, 9, 9, 2, 3], k=1) == [4]


def test_most_recent_occurrence_of_the_same_ngram_wins():
    assert ngram([1, 2, 10, 1, 2, 20, 1, 2], k=1) == [20]


def test_no_match_and_short_inputs_propose_nothing():
    assert ngram([1, 2, 3, 4]) == []
    assert ngram([7]) == []
    assert ngram([1, 2, 1], k=0) == []


def test_ngram_min_excludes_short_matches():
    assert ngram([1, 2, 3, 9, 3], k=2, lo=2) == []
    assert ngram([1, 2, 3, 9, 3], k=2, lo=1) == [9, 3]


def test_proposal_may_run_into_the_suffix_and_is_capped_at_the_end():
    # Period-1 sequence: the match ending just before the suffix proposes the last token only.
    assert ngram([4, 4, 4], k=5) == [4]


def test_proposer_reads_prompt_and_output_together_and_respects_num_spec():
    proposer = NgramProposer(1, 3)
    batch = [
        ProposalInput("a", [1, 2, 3, 4, 5], [9, 1, 2], 7, 2, ()),
        ProposalInput("b", [1, 2], [], 1, 3, ()),
    ]
    assert proposer.propose(batch) == [[3, 4], []]


def test_invalid_ngram_range_is_a_config_error():
    with pytest.raises(ConfigError):
        NgramProposer(3, 2)
