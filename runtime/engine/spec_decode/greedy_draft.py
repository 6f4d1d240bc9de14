"""The drafting loop shared by model drafts: k single-token forwards, each proposing its argmax.

Step i feeds, for every request still drafting, its last known token (step 0: the request's last token,
at position `num_computed_tokens`; then its own previous proposal) and writes that token's draft KV at its
position. Requests with a smaller `num_spec` drop out of the batch early (k may differ per request).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenfleet.runtime.engine.sampler import row_argmax
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput
from tokenfleet.runtime.model.attention.metadata import SeqSpec, build_attention_metadata
from tokenfleet.runtime.model.llama import KVCache, LlamaForCausalLM


@torch.inference_mode()
def greedy_draft(
    model: LlamaForCausalLM,
    kv_caches: list[KVCache],
    batch: Sequence[ProposalInput],
    block_size: int,
    device: torch.device,
    num_layers: int | None = None,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """Up to `num_spec` argmax proposals per input. `num_layers` truncates the model (self-draft);
    `vocab_limit` keeps proposals inside the target's vocabulary when the draft's is padded larger."""
    proposals: list[list[int]] = [[] for _ in batch]
    last = [item.last_token_id for item in batch]
    active = [i for i, item in enumerate(batch) if item.num_spec > 0]
    step = 0
    while active:
        ids = torch.tensor([last[i] for i in active], dtype=torch.long, device=device)
        pos_list = [batch[i].num_computed_tokens + step for i in active]
        pos = torch.tensor(pos_list, dtype=torch.long, device=device)
        specs = [SeqSpec(p, 1, batch[i].block_ids) for i, p in zip(active, pos_list, strict=True)]
        meta = build_attention_metadata(specs, block_size, device)
        hidden = model(ids, pos, kv_caches, meta, num_layers=num_layers)
        logits = model.compute_logits(hidden)
        if vocab_limit is not None and logits.shape[-1] > vocab_limit:
            logits = logits[:, :vocab_limit]
        for i, token in zip(active, row_argmax(logits).tolist(), strict=True):
            proposals[i].append(token)
            last[i] = token
        step += 1
        active = [i for i in active if batch[i].num_spec > step]
    return proposals
