"""N-gram (prompt lookup) proposer: continue the sequence the way it continued the last time it said this.

For the longest n in [ngram_max .. ngram_min] whose final n tokens occurred earlier in the sequence, propose
the tokens that followed the most recent earlier occurrence. Costs no model: it shines where the output
quotes the input (code editing, summaries with quotes, retrieval answers) and proposes nothing otherwise.

The search is vectorised with numpy: candidate end positions are the earlier occurrences of the last token,
then each extra token of the n-gram filters them; O(L * n) comparisons in C per request and step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tokenfleet.runtime.config import SpeculativeConfig
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput, Proposer, register
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.loader import LoadedModel


def propose_ngram(token_ids: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest matching suffix n-gram.

    `token_ids` is the whole sequence (int64). The suffix itself never counts as a match, and a match
    must be followed by at least one token.
    """
    num = len(token_ids)
    if num < 2 or k < 1:
        return []
    # Ends of earlier windows: positions e < num - 1 holding the last token (so e + 1 exists).
    ends = np.flatnonzero(token_ids[: num - 1] == token_ids[num - 1])
    if ends.size == 0:
        return []
    for n in range(min(ngram_max, num - 1), ngram_min - 1, -1):
        cand = ends[ends >= n - 1]
        for j in range(1, n):
            if cand.size == 0:
                break
            cand = cand[token_ids[cand - j] == token_ids[num - 1 - j]]
        if cand.size:
            start = int(cand[-1]) + 1
            return token_ids[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, ngram_min: int, ngram_max: int):
        if ngram_min > ngram_max:
            raise ConfigError(f"speculative.ngram_min ({ngram_min}) > ngram_max ({ngram_max})")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        out: list[list[int]] = []
        for item in batch:
            tokens = np.concatenate(
                (
                    np.asarray(item.prompt_token_ids, dtype=np.int64),
                    np.asarray(item.output_token_ids, dtype=np.int64),
                )
            )
            out.append(propose_ngram(tokens, self.ngram_min, self.ngram_max, item.num_spec))
        return out


@register("ngram")
def _build(config: SpeculativeConfig, target: LoadedModel, device: torch.device) -> Proposer:
    return NgramProposer(config.ngram_min, config.ngram_max)
