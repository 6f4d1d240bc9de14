"""Workloads: seeded generators and JSONL trace replay, both yielding `SimRequest`s in arrival order.

Prompts are real token-id sequences (random ids from the seed), because the prefix cache and the router
hash real tokens: tenants share a system prompt (tenants drawn with Zipf popularity), multi-turn sessions
extend their own previous prompt + answer, long-document requests carry a big unique body.

Arrivals: `poisson` (exponential gaps), `gamma` (gaps with coefficient of variation `burstiness` > 1:
bursts and lulls at the same mean rate), `diurnal` (a Poisson process whose rate follows a sine of
`diurnal_period_s` between (1 - amplitude) and (1 + amplitude) x rate, by thinning).

Sessions are closed-loop: a session's next turn arrives `think_time_s` (exponential) after its previous
turn *finished* in the simulation (`Workload.follow_up`), so its prompt can reuse the KV of the answer.

LoRA adapters (`adapters`): each request of the mix — each session, whose turns stay on one adapter — names
adapter i of `count` with probability proportional to 1 / (i + 1)^zipf (or none, the base model, with
probability `base_fraction`), from a generator of its own, so turning adapters on changes no other draw.

Named tenants (`tenants`) replace the Zipf mix with streams of their own: each tenant sends at its own rate
(the same arrival process), with its own prompt and answer lengths and priority — what a question about
tenants needs (a flood from one beside another's steady traffic, batch beside interactive). Each stream
draws from seeds of its own (the workload's seed and the tenant's name), so a tenant's requests are the
same whoever else is in the list.
"""

from __future__ import annotations

import bisect
import heapq
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

VOCAB_LOW, VOCAB_HIGH = 100, 30000
CHUNK = 1024


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    arrival: float
    prompt: list[int]
    # What the "model" will produce: one token, repeated (exact length, reusable KV; see replica.py).
    output: list[int]
    priority: int = 0
    session: str | None = None
    tenant: str | None = None
    turn: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # filled once (router), shared with the replica
    # Where the prompt's leading blocks were hashed before (the router extends those hashes instead of
    # rehashing a shared system prompt or a conversation's history): a shared prefix's key and length ...
    prefix_key: str | None = None
    prefix_len: int = 0
    # ... or the previous turn of the same session (its prompt is a prefix of this one); dropped once used.
    parent: SimRequest | None = None
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)


class TenantStream(BaseModel):
    """One tenant's own traffic (`WorkloadSpec.tenants`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The tenant (the router's fair share counts per tenant).")
    rate: float = Field(gt=0, description="Mean arrivals per second.")
    system_prompt_tokens: int = Field(
        0, ge=0, description="A prefix every request of the tenant starts with."
    )
    user_tokens: int = Field(128, ge=1, description="Mean unique prompt tokens per request.")
    output_tokens: int = Field(128, ge=1, description="Mean output tokens.")
    priority: int = Field(1, description="Lower is served first.")
    start_s: float = Field(0.0, ge=0, description="It starts sending then (a tenant that arrives later).")


class AdapterMix(BaseModel):
    """Requests name LoRA adapters with Zipf popularity (`WorkloadSpec.adapters`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(ge=1, description="Distinct adapters (named adapter-0 .. adapter-{count-1}).")
    zipf: float = Field(
        1.0,
        ge=0,
        description="Popularity exponent: adapter i is named with weight 1/(i+1)^zipf (0: uniform).",
    )
    base_fraction: float = Field(0.0, ge=0, le=1, description="Share of requests for the base model.")


def adapter_name(index: int) -> str:
    return f"adapter-{index}"


# What the Zipf mix sets for every request, and a tenant stream sets for its own.
_MIX_FIELDS = frozenset(
    {
        "rate",
        "num_tenants",
        "zipf_s",
        "system_prompt_tokens",
        "user_tokens",
        "output_tokens",
        "session_fraction",
        "turns_mean",
        "think_time_s",
        "long_doc_fraction",
        "long_doc_tokens",
        "high_priority_fraction",
        "adapters",
    }
)


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival: Literal["poisson", "gamma", "diurnal"] = "poisson"
    rate: float = Field(10.0, gt=0, description="Mean arrivals per second (first turns and single requests).")
    duration_s: float = Field(60.0, gt=0, description="Arrivals stop after this many seconds.")
    burstiness: float = Field(2.0, ge=1.0, description="gamma: coefficient of variation of the gaps.")
    diurnal_period_s: float = Field(3600.0, gt=0)
    diurnal_amplitude: float = Field(0.5, ge=0, lt=1)
    num_tenants: int = Field(20, ge=1)
    zipf_s: float = Field(1.1, gt=0, description="Tenant popularity exponent.")
    system_prompt_tokens: int = Field(512, ge=0)
    user_tokens: int = Field(128, ge=1, description="Mean unique prompt tokens per request.")
    output_tokens: int = Field(128, ge=1, description="Mean output tokens.")
    length_sigma: float = Field(0.5, ge=0, description="Lognormal spread of user and output lengths.")
    session_fraction: float = Field(0.0, ge=0, le=1, description="Share of arrivals that open a session.")
    turns_mean: float = Field(3.0, ge=1)
    think_time_s: float = Field(5.0, ge=0)
    long_doc_fraction: float = Field(0.0, ge=0, le=1)
    long_doc_tokens: int = Field(4096, ge=1)
    high_priority_fraction: float = Field(0.0, ge=0, le=1, description="Priority 0; the rest get 1.")
    max_prompt_tokens: int = Field(7000, ge=2, description="Session prompts stop growing here (turns end).")
    tenants: tuple[TenantStream, ...] = Field(
        (),
        description="Named tenants, each at its own rate, lengths and priority, instead of the Zipf mix "
        "(no sessions or long documents; `arrival`, `duration_s`, `length_sigma`, `max_prompt_tokens` and "
        "`seed` still apply).",
    )
    adapters: AdapterMix | None = Field(
        None, description="Requests name LoRA adapters (a session keeps its first turn's adapter)."
    )
    seed: int = 0

    @model_validator(mode="after")
    def _check_tenants(self) -> WorkloadSpec:
        if self.tenants:
            mixed = sorted(_MIX_FIELDS & self.model_fields_set)
            if mixed:
                raise ValueError(f"{mixed[0]} is the Zipf mix's: with `tenants` each tenant sets its own")
            names = [t.name for t in self.tenants]
            if len(set(names)) != len(names):
                raise ValueError(f"tenant names repeat: {names}")
        return self


class Workload:
    """A seeded generator: `arrivals()` once, then `follow_up()` as session turns finish."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._rng = np.random.Generator(np.random.PCG64(spec.seed))
        self._content = np.random.Generator(np.random.PCG64(spec.seed + 1_000_003))
        ranks = np.arange(1, spec.num_tenants + 1, dtype=np.float64)
        weights = ranks ** (-spec.zipf_s)
        cdf = np.cumsum(weights / weights.sum())
        self._tenant_cdf = (cdf / cdf[-1]).tolist()  # numpy's choice(p=...) draw, without its overhead
        self._system = [self._tokens(spec.system_prompt_tokens) for _ in range(spec.num_tenants)]
        self._turns_left: dict[str, int] = {}
        self._count = 0
        self._adapter_cdf: list[float] = []
        if spec.adapters is not None:
            weights = np.arange(1, spec.adapters.count + 1, dtype=np.float64) ** (-spec.adapters.zipf)
            cdf = np.cumsum(weights / weights.sum())
            self._adapter_cdf = (cdf / cdf[-1]).tolist()
            # Its own stream: the other draws are the same with or without adapters.
            self._adapter_rng = np.random.Generator(np.random.PCG64([spec.seed, 0xADA]))

    # ---- randomness -----------------------------------------------------------------------------------

    def _tokens(self, n: int) -> list[int]:
        return self._content.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()

    def _output(self, n: int) -> list[int]:
        return [int(self._content.integers(VOCAB_LOW, VOCAB_HIGH))] * n

    def _length(self, mean: int) -> int:
        return self._lengths(mean, 1)[0]

    def _lengths(self, mean: int, n: int, content: np.random.Generator | None = None) -> list[int]:
        s = self.spec.length_sigma
        if s == 0:
            return [mean] * n
        # Lognormal with the given mean: mu = ln(mean) - s^2 / 2.
        draws = (content or self._content).lognormal(math.log(mean) - s * s / 2, s, n)
        return np.maximum(1, np.rint(draws)).astype(np.int64).tolist()

    def _gap_chunks(
        self, rate: float | None = None, rng: np.random.Generator | None = None
    ) -> Iterator[list[float]]:
        """Inter-arrival gaps at `rate` (default: the spec's), `CHUNK` at a time (one numpy call per chunk,
        not per request)."""
        spec = self.spec
        rate = rate or spec.rate
        rng = rng or self._rng
        if spec.arrival == "poisson":
            while True:
                yield rng.exponential(1.0 / rate, CHUNK).tolist()
        elif spec.arrival == "gamma":
            shape = 1.0 / spec.burstiness**2
            while True:
                yield rng.gamma(shape, 1.0 / (rate * shape), CHUNK).tolist()
        else:
            peak = rate * (1 + spec.diurnal_amplitude)
            t = 0.0
            while True:
                gaps = []
                for _ in range(CHUNK):
                    gap = 0.0
                    while True:
                        gap += float(rng.exponential(1.0 / peak))
                        phase = 2 * math.pi * (t + gap) / spec.diurnal_period_s
                        rate_now = rate * (1 + spec.diurnal_amplitude * math.sin(phase))
                        if rng.random() * peak <= rate_now:
                            break
                    t += gap
                    gaps.append(gap)
                yield gaps

    # ---- requests -------------------------------------------------------------------------------------

    def arrivals(self) -> Iterator[SimRequest]:
        """First turns and single requests in arrival order. Every random draw is made per chunk of
        `CHUNK` requests (a simulated hour is millions of requests: a numpy call per field per request
        would cost minutes)."""
        if self.spec.tenants:
            yield from self._tenant_arrivals()
            return
        spec, rng, content = self.spec, self._rng, self._content
        cdf = self._tenant_cdf
        p_turn = 1.0 / spec.turns_mean
        t = 0.0
        for gaps in self._gap_chunks():
            n = len(gaps)
            u_tenant, u_doc, u_session, u_priority = rng.random((4, n)).tolist()
            turns = rng.geometric(p_turn, n).tolist()
            user_len = self._lengths(spec.user_tokens, n)
            out_len = self._lengths(spec.output_tokens, n)
            out_token = content.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist()
            user = content.integers(VOCAB_LOW, VOCAB_HIGH, sum(user_len)).tolist()
            adapters = self._adapters(n)
            pos = 0
            for i in range(n):
                t += gaps[i]
                if t >= spec.duration_s:
                    return
                tenant = bisect.bisect_right(cdf, u_tenant[i])
                prompt = list(self._system[tenant])
                if u_doc[i] < spec.long_doc_fraction:
                    prompt += self._tokens(spec.long_doc_tokens)
                prompt += user[pos : pos + user_len[i]]
                pos += user_len[i]
                del prompt[spec.max_prompt_tokens :]
                self._count += 1
                session = None
                if u_session[i] < spec.session_fraction:
                    session = f"s{self._count}"
                    self._turns_left[session] = max(0, turns[i] - 1)
                yield SimRequest(
                    f"r{self._count}",
                    t,
                    prompt,
                    [out_token[i]] * out_len[i],
                    0 if u_priority[i] < spec.high_priority_fraction else 1,
                    session,
                    f"t{tenant}",
                    prefix_key=f"t{tenant}",
                    prefix_len=spec.system_prompt_tokens,
                    adapter=adapters[i],
                )

    def _adapters(self, n: int) -> list[str | None]:
        """The adapters of the next `n` requests (None: the base model)."""
        mix = self.spec.adapters
        if mix is None:
            return [None] * n
        cdf, base = self._adapter_cdf, mix.base_fraction
        out: list[str | None] = []
        for u in self._adapter_rng.random(n).tolist():
            if u < base:
                out.append(None)
            else:  # the rest of the unit interval, rescaled, picks by popularity
                index = bisect.bisect_right(cdf, (u - base) / (1.0 - base))
                out.append(adapter_name(min(index, len(cdf) - 1)))
        return out

    def _tenant_arrivals(self) -> Iterator[SimRequest]:
        """The named tenants' streams merged in arrival order (ties: the tenant listed first)."""
        streams = [self._stream(i, tenant) for i, tenant in enumerate(self.spec.tenants)]
        for t, _, tenant, prompt, output in heapq.merge(*streams):
            self._count += 1
            yield SimRequest(
                f"r{self._count}",
                t,
                prompt,
                output,
                tenant.priority,
                None,
                tenant.name,
                prefix_key=f"tenant:{tenant.name}" if tenant.system_prompt_tokens else None,
                prefix_len=tenant.system_prompt_tokens,
            )

    def _stream(self, index: int, tenant: TenantStream) -> Iterator[tuple]:
        """One tenant's arrivals: (time, index, tenant, prompt, output), from seeds of its own."""
        spec = self.spec
        name = zlib.crc32(tenant.name.encode())  # stable across runs, unlike hash()
        rng = np.random.Generator(np.random.PCG64([spec.seed, name, 1]))
        content = np.random.Generator(np.random.PCG64([spec.seed, name, 2]))
        system = content.integers(VOCAB_LOW, VOCAB_HIGH, size=tenant.system_prompt_tokens).tolist()
        t = tenant.start_s
        for gaps in self._gap_chunks(tenant.rate, rng):
            n = len(gaps)
            user_len = self._lengths(tenant.user_tokens, n, content)
            out_len = self._lengths(tenant.output_tokens, n, content)
            out_token = content.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist()
            user = content.integers(VOCAB_LOW, VOCAB_HIGH, sum(user_len)).tolist()
            pos = 0
            for i in range(n):
                t += gaps[i]
                if t >= spec.duration_s:
                    return
                prompt = system + user[pos : pos + user_len[i]]
                pos += user_len[i]
                del prompt[spec.max_prompt_tokens :]
                yield t, index, tenant, prompt, [out_token[i]] * out_len[i]

    def follow_up(self, previous: SimRequest, finished_at: float) -> SimRequest | None:
        """The session's next turn (its prompt extends the previous prompt + answer), or None."""
        session = previous.session
        if session is None or self._turns_left.get(session, 0) <= 0:
            self._turns_left.pop(session, None)
            return None
        self._turns_left[session] -= 1
        prompt = previous.prompt + previous.output + self._tokens(self._length(self.spec.user_tokens))
        if len(prompt) > self.spec.max_prompt_tokens:
            self._turns_left.pop(session, None)
            return None
        self._count += 1
        think = float(self._rng.exponential(self.spec.think_time_s)) if self.spec.think_time_s else 0.0
        return SimRequest(
            f"r{self._count}",
            finished_at + think,
            prompt,
            self._output(self._length(self.spec.output_tokens)),
            previous.priority,
            session,
            previous.tenant,
            previous.turn + 1,
            parent=previous,
            adapter=previous.adapter,
        )
