"""The routing decision, once: what the live router (`Fleet.pick`) and the simulator (`sim.router.SimRouter`)
both call, so a policy tuned in the simulator is the policy that ships.

Pure and clock-free itself: given the candidates' state (reported load, the router's in-flight count, KV
usage, whether the pod's event stream is followed), their prefix matches and the in-flight limit, the
strategy (`scoring.make_strategy(clock=)`, which carries the only clock) chooses an endpoint, or the
verdict says why none can take the request. The indexes the matches come from are the caller's, on the
caller's clock; `exact_matches` is how both callers merge them.

- A candidate's load is max(the pod's reported running + waiting, this router's in-flight count): the
  router's count is fresh but blind to other router replicas, the pod's figure is complete but one poll old.
  The caller brings the report up to date with its own requests started and ended since (`reported_load`).
- A candidate at `max_in_flight_per_endpoint` is skipped while another is below it; when all are at it the
  request waits in the router's queue (`priority.WaitQueue`), unless it was admitted already (a retry), which
  may exceed the limit rather than fail.
- A prefix match is the max of what the pod holds (its `stored` events), what it announced it is computing
  (`scheduled` events) and what this router sent there recently (before the pod could announce it).
- The tie-break key is the prompt's first block hashed under the router's own "approx" extra
  (`approx_extra`), so every router replica (and the simulator) names a prefix the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from tokenfleet.runtime.router.scoring import Candidate, Decision, RouteQuery, Strategy

# Why no endpoint was chosen.
NO_READY_ENDPOINT = "no_ready_endpoint"  # none available at all (loading, ejected, scaled to zero): 503
AT_CAPACITY = "at_capacity"  # available ones all at their in-flight limit: queue, then 429


class EndpointState(NamedTuple):
    """One available endpoint as the decision sees it."""

    endpoint_id: str
    reported_load: int  # the pod's last report (running + waiting) + this router's starts - ends since
    in_flight: int  # requests this router has there now
    kv_usage: float = 0.0
    reports_work: bool = False  # its KV-event stream is followed: it announces each request it starts


class CandidateState(Protocol):
    """What `decide` reads of an endpoint: `EndpointState`, or a caller's own record with these fields."""

    @property
    def endpoint_id(self) -> str: ...
    @property
    def reported_load(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def reports_work(self) -> bool: ...


class Verdict(NamedTuple):
    """The chosen endpoint's decision, or None and why (NO_READY_ENDPOINT or AT_CAPACITY)."""

    decision: Decision | None
    why_none: str = ""


class _Matcher(Protocol):
    def match(self, hashes: Sequence[bytes], endpoint_ids: Sequence[str]) -> dict[str, int]: ...


class _Raiser(Protocol):
    def raise_matches(self, hashes: Sequence[bytes], matches: dict[str, int]) -> None: ...


def approx_extra(model: str) -> tuple[str, str]:
    """The hash extra of the router's own block names for `model` (approximate index, tie-break key)."""
    return ("approx", model)


def load_of(state: CandidateState) -> int:
    a, b = state.reported_load, state.in_flight
    return a if a >= b else b


def within_limit(
    states: Sequence[CandidateState], limit: int, admitted: bool = False
) -> Sequence[CandidateState]:
    """The candidates below the in-flight limit; all of them when none is and the request was `admitted`
    already (a retry exceeds the limit rather than fail). Empty: the request must wait."""
    below = [s for s in states if s.in_flight < limit]
    if len(below) == len(states):
        return states
    return below or (states if admitted else below)


def exact_matches(
    endpoint_ids: Sequence[str],
    hashes: Sequence[bytes],
    held: _Matcher,
    scheduled: _Raiser,
    recent: _Raiser | None = None,
    recent_hashes: Sequence[bytes] | None = None,
) -> dict[str, int]:
    """Leading prompt blocks per endpoint: the max over held (exact index), scheduled (pods' announcements)
    and `recent` (this router's routes, keyed by `recent_hashes`: the same blocks, maybe named otherwise)."""
    matches = held.match(hashes, endpoint_ids)
    scheduled.raise_matches(hashes, matches)
    if recent is not None:
        recent.raise_matches(hashes if recent_hashes is None else recent_hashes, matches)
    return matches


def decide(
    strategy: Strategy,
    query: RouteQuery,
    states: Sequence[CandidateState],
    matches: dict[str, int],
    limit: int,
    admitted: bool = False,
) -> Verdict:
    """Choose among the available endpoints `states` (already filtered for health and exclusions)."""
    if not states:
        return Verdict(None, NO_READY_ENDPOINT)
    eligible = within_limit(states, limit, admitted)
    if not eligible:
        return Verdict(None, AT_CAPACITY)
    get = matches.get
    # This runs for every candidate of every pick: load_of inlined, and the tuples built by tuple.__new__
    # (a NamedTuple's own __new__ is a Python-level wrapper around it: a call more per candidate).
    new = tuple.__new__
    candidates = [
        new(
            Candidate,
            (
                s.endpoint_id,
                a if (a := s.reported_load) >= (b := s.in_flight) else b,
                s.kv_usage,
                get(s.endpoint_id, 0),
                s.reports_work,
            ),
        )
        for s in eligible
    ]
    return Verdict(strategy.choose(query, candidates))


def refusal_status(why_none: str) -> int:
    """The HTTP status of a request that waited its whole queue deadline: 503 when no endpoint was ready
    (the client should come back after Retry-After), 429 when they were merely all busy."""
    return 503 if why_none == NO_READY_ENDPOINT else 429
