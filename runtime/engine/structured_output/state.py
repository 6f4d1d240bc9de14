"""GrammarState: one request's position in its grammar, kept equal to a token list by rolling back.

The matcher is not advanced by a separate hook after each step: whoever needs a bitmask hands over the
token ids the row continues (`fill(bitmask, row, token_ids)`), and the state first makes its accepted
tokens equal to them — accepting what is new, rolling back what diverged. That one rule covers

- plain decoding: the committed outputs grow by one token per step;
- recompute preemption: output tokens are kept when the KV is freed, so the matcher is already in step
  when the request resumes (nothing to replay, nothing lost);
- speculative decoding: verification row i continues outputs + d_1..d_i, so filling rows 0..k accepts the
  drafts one by one; a draft the grammar refuses leaves the following rows unconstrained — they are never
  used, because the refused draft has probability 0 under the masked row before it and is rejected.
  Next step the committed outputs (accepted drafts + one new token) diverge from the drafts the matcher
  took, and the rejected tail is rolled back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar (and the transformers it imports, ~0.6 s) is imported where a grammar is first used, not with
# this module: the sampler imports it on every server's start-up path, and most servers never see a
# constrained request. A GrammarState exists only after the compiler imported it.


class GrammarState:
    __slots__ = ("_matcher", "accepted", "vocab_size")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        import xgrammar as xgr

        # max_rollback_tokens=-1: unlimited, so any number of rejected drafts can be taken back.
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.accepted: list[int] = []
        self.vocab_size = vocab_size

    def sync(self, token_ids: Sequence[int]) -> bool:
        """Make the accepted tokens equal `token_ids`; False when one of them is not grammatical (the state
        then stands after the longest grammatical prefix)."""
        accepted = self.accepted
        n = len(accepted)
        if len(token_ids) >= n and list(token_ids[:n]) == accepted:
            common = n
        else:
            common = 0
            for a, b in zip(accepted, token_ids, strict=False):
                if a != b:
                    break
                common += 1
            self._matcher.rollback(n - common)
            del accepted[common:]
        for tok in token_ids[common:]:
            if not self._matcher.accept_token(tok):
                return False
            accepted.append(tok)
        return True

    def fill(self, bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> bool:
        """Write the allowed next tokens after `token_ids` into `bitmask[row]`. When `token_ids` themselves
        break the grammar the row is left all-allowed and False returned: that is a verification row after a
        refused draft (never used: the refused draft is rejected first), or, for committed tokens, a row
        whose bans left nothing grammatical (min_tokens over a finished grammar), which then runs free
        rather than failing."""
        if self.sync(token_ids):
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return True
        return False

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def grammar_bitmask(
    rows: Sequence[tuple[GrammarState | None, Sequence[int]]], vocab_size: int
) -> torch.Tensor:
    """[len(rows), ceil(V / 32)] int32 on the CPU, bit b of word w allowing token 32 * w + b; rows without
    a grammar (None) allow everything."""
    bitmask = torch.full((len(rows), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for row, (state, token_ids) in enumerate(rows):
        if state is not None:
            state.fill(bitmask, row, token_ids)
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Out of place: logits[r, t] = -inf for each r in `rows` where bit t of bitmask[r] is clear.

    xgrammar's kernels: C++ on the CPU, Triton on CUDA (measured on the CPU: ~100x faster than unpacking
    the bits with torch ops)."""
    import xgrammar as xgr

    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=logits.shape[-1], indices=list(rows))
    return out
