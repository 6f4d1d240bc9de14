"""Self-speculative draft: the target's first L layers, its final norm and its LM head (early exit).

No second checkpoint and no second KV cache. The KV of layer l < L at position p depends only on the
tokens at positions <= p through layers 0..l, which the draft shares with the target. So:
- for every computed position, the target's layer-l KV *is* the draft's: drafting reads it as is;
- drafting writes layer-l KV (l < L) for the positions it proposes into the same slots. The next target
  step feeds those positions again (the last token + the proposals) and overwrites all its layers there,
  so a rejected proposal leaves nothing behind, and an accepted one ends with exactly the target's KV.
The engine allocates the slots of the drafted positions before drafting (they are the ones the
verification step needs anyway).

Cost per proposal: L/num_layers of a decode step plus one LM head; acceptance depends on how well the
early layers predict the final argmax (no early-exit training is assumed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenfleet.runtime.config import SpeculativeConfig
from tokenfleet.runtime.engine.spec_decode.greedy_draft import greedy_draft
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput, Proposer, register
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.model.llama import KVCache, LlamaForCausalLM
from tokenfleet.runtime.model.loader import LoadedModel


class SelfDraftProposer(Proposer):
    writes_kv = True

    def __init__(self, model: LlamaForCausalLM, num_layers: int, device: torch.device):
        total = len(model.model.layers)
        if not 1 <= num_layers < total:
            raise ConfigError(
                f"speculative.draft_layers must be in [1, {total - 1}] for a {total}-layer model, "
                f"got {num_layers}"
            )
        self.model = model
        self.num_layers = num_layers
        self.device = device
        self._kv_caches: list[KVCache] | None = None
        self._block_size = 0

    def bind(self, kv_caches: list[KVCache], num_blocks: int, block_size: int) -> None:
        self._kv_caches = kv_caches[: self.num_layers]
        self._block_size = block_size

    def propose(self, batch: Sequence[ProposalInput]) -> list[list[int]]:
        if self._kv_caches is None:
            raise RuntimeError("SelfDraftProposer used before bind()")
        return greedy_draft(
            self.model, self._kv_caches, batch, self._block_size, self.device, num_layers=self.num_layers
        )


@register("self")
def _build(config: SpeculativeConfig, target: LoadedModel, device: torch.device) -> Proposer:
    return SelfDraftProposer(target.model, config.draft_layers, device)
