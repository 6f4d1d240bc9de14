"""Verification of proposed tokens against the target model: exact in distribution, exact in greedy.

A request with k proposals d_1..d_k has k + 1 target rows: row i (0-based) is the target's sampling
distribution p_i (after penalties, temperature, top-k/p, min-p: `transform_logits`, the very law the
plain sampler draws from) for the token that follows d_i (row 0 follows the last known token).

Random rows (Leviathan et al. / Chen et al., 2023): for i = 1..k accept d_i with probability
min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); at the first rejection emit one token drawn from the residual
norm(max(0, p_{i-1} - q_{i-1})) and stop; when all k are accepted, emit a bonus token drawn from p_k.
Every emitted token is then distributed exactly as if drawn from p one at a time. Our proposers are
deterministic (q is a point mass at d_i), where this reads: accept with probability p(d_i); on rejection
draw from p with d_i removed. Dense draft distributions are supported for completeness (`draft_probs`).

Greedy rows: accept while d_i equals the argmax of p_{i-1}; emit the argmax at the first mismatch (or the
bonus argmax) — the tokens plain greedy decoding would have produced.

Randomness: each request draws its k uniforms and then one more for its final token (the inverse transform
of the plain sampler picks token j with probability r_j / sum r) from its own seeded generator when it has
one, else from a shared one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenfleet.runtime.engine.sampler import inverse_cdf, row_argmax, shared_generator, transform_logits
from tokenfleet.runtime.engine.sampling_metadata import SamplingMetadata


@dataclass(frozen=True, slots=True)
class VerifyBatch:
    """The rows of one step's verification: request r owns rows `row_start[r] .. row_start[r] + k_r`."""

    meta: SamplingMetadata  # one row per logits row (k_r + 1 per request)
    draft_token_ids: tuple[tuple[int, ...], ...]  # per request, k_r >= 1 proposals
    greedy: tuple[bool, ...]  # per request
    generators: tuple[torch.Generator | None, ...]  # per request: its seeded generator, or None (shared)
    draft_probs: torch.Tensor | None = None  # [sum k_r, V] fp32, rows in proposal order; None = point masses

    @property
    def row_start(self) -> list[int]:
        starts, row = [], 0
        for d in self.draft_token_ids:
            starts.append(row)
            row += len(d) + 1
        return starts


class RejectionSampler:
    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        return shared_generator(self._shared, device, self._seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: VerifyBatch) -> list[list[int]]:
        """The emitted tokens per request: the accepted proposals, then one corrected or bonus token."""
        device = logits.device
        transformed = transform_logits(logits.float(), batch.meta)
        starts = batch.row_start
        drafts = batch.draft_token_ids
        prop_rows = [s + i for s, d in zip(starts, drafts, strict=True) for i in range(len(d))]
        prop_tokens = [t for d in drafts for t in d]
        prop_rows_t = torch.tensor(prop_rows, dtype=torch.int64, device=device)
        prop_tokens_t = torch.tensor(prop_tokens, dtype=torch.int64, device=device)
        any_random = not all(batch.greedy)

        # Acceptance of every proposal, as if the earlier ones were accepted (only leading runs count).
        argmax = row_argmax(transformed)
        accept = argmax.index_select(0, prop_rows_t) == prop_tokens_t
        probs = None
        if any_random:
            probs = transformed.softmax(dim=-1)
            p_d = probs[prop_rows_t, prop_tokens_t]
            q_d = (
                batch.draft_probs.gather(1, prop_tokens_t.unsqueeze(1)).squeeze(1)
                if batch.draft_probs is not None
                else torch.ones_like(p_d)
            )
            u = self._uniforms(batch, device)
            # u < p/q  <=>  u * q < p (no division by a zero q: a proposal q never drew).
            random_accept = u * q_d < p_d
            is_greedy = torch.tensor(
                [g for g, d in zip(batch.greedy, drafts, strict=True) for _ in d],
                dtype=torch.bool,
                device=device,
            )
            accept = torch.where(is_greedy, accept, random_accept)
        accept_list = accept.tolist()

        num_accepted: list[int] = []
        offset = 0
        for d in drafts:
            n = 0
            while n < len(d) and accept_list[offset + n]:
                n += 1
            num_accepted.append(n)
            offset += len(d)

        final_rows = [s + n for s, n in zip(starts, num_accepted, strict=True)]
        final_tokens = argmax.index_select(
            0, torch.tensor(final_rows, dtype=torch.int64, device=device)
        ).tolist()
        if probs is not None:
            self._sample_random_finals(probs, batch, final_rows, num_accepted, final_tokens)
        return [[*d[:n], t] for d, n, t in zip(drafts, num_accepted, final_tokens, strict=True)]

    def _draws(
        self, batch: VerifyBatch, requests: Sequence[int], n: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """U[0,1) draws, n[j] of them for request requests[j], concatenated in that order.

        Seeded requests draw from their own generator (reproducible whatever the batch); the others share
        one draw from the shared generator (one call for the whole batch).
        """
        out = torch.empty(sum(n), device=device)
        offsets = [0]
        for count in n:
            offsets.append(offsets[-1] + count)
        shared_index: list[int] = []
        for j, r in enumerate(requests):
            gen = batch.generators[r]
            if gen is None:
                shared_index.extend(range(offsets[j], offsets[j + 1]))
            elif n[j]:
                out[offsets[j] : offsets[j + 1]] = torch.rand(n[j], generator=gen, device=device)
        if shared_index:
            index = torch.tensor(shared_index, dtype=torch.int64, device=device)
            out[index] = torch.rand(
                len(shared_index), generator=self._shared_generator(device), device=device
            )
        return out

    def _uniforms(self, batch: VerifyBatch, device: torch.device) -> torch.Tensor:
        """One U[0,1) per proposal (greedy requests draw nothing: their entries are 0 and never read)."""
        drafts = batch.draft_token_ids
        requests = [r for r, g in enumerate(batch.greedy) if not g]
        draws = self._draws(batch, requests, [len(drafts[r]) for r in requests], device)
        offsets = [0]
        for d in drafts:
            offsets.append(offsets[-1] + len(d))
        u = torch.zeros(offsets[-1], device=device)
        index = [i for r in requests for i in range(offsets[r], offsets[r + 1])]
        u[torch.tensor(index, dtype=torch.int64, device=device)] = draws
        return u

    def _sample_random_finals(
        self,
        probs: torch.Tensor,
        batch: VerifyBatch,
        final_rows: Sequence[int],
        num_accepted: Sequence[int],
        final_tokens: list[int],
    ) -> None:
        """Overwrite the final token of every random request with a draw from its residual or bonus row."""
        device = probs.device
        drafts = batch.draft_token_ids
        requests = [r for r, g in enumerate(batch.greedy) if not g]
        rows = torch.tensor([final_rows[r] for r in requests], dtype=torch.int64, device=device)
        dist = probs.index_select(0, rows)
        prop_offsets = [0]
        for d in drafts:
            prop_offsets.append(prop_offsets[-1] + len(d))
        rejected = [(j, r) for j, r in enumerate(requests) if num_accepted[r] < len(drafts[r])]
        if rejected:
            js = torch.tensor([j for j, _ in rejected], dtype=torch.int64, device=device)
            if batch.draft_probs is None:
                # Point mass at the rejected token: the residual is p without it.
                toks = torch.tensor([drafts[r][num_accepted[r]] for _, r in rejected], device=device)
                dist[js, toks] = 0.0
            else:
                q_rows = torch.tensor([prop_offsets[r] + num_accepted[r] for _, r in rejected], device=device)
                residual = (dist[js] - batch.draft_probs.index_select(0, q_rows)).clamp_(min=0.0)
                # All-zero residual only by rounding (rejection implies p > q somewhere): fall back to p.
                empty = residual.sum(dim=-1, keepdim=True) <= 0
                dist[js] = torch.where(empty, dist[js], residual)
        # One uniform per request: the inverse transform picks j with probability r_j / sum(r).
        u = self._draws(batch, requests, [1] * len(requests), device)
        for r, token in zip(requests, inverse_cdf(dist, u).tolist(), strict=True):
            final_tokens[r] = token
