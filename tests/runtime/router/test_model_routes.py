"""Model routes: weighted splits sticky per session, fallback chains, and their validation."""

from __future__ import annotations

import random

import pytest
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.router.config import RouterConfig
from tokenfleet.runtime.router.model_routes import route_targets, session_draw, split_draws


def config(routes, backends=(("v1", "llama"), ("v2", "llama-next"), ("small", "tiny"), ("big", "huge"))):
    return RouterConfig.model_validate(
        {
            "backends": [{"name": n, "model": m, "url": f"http://{n}:8000"} for n, m in backends],
            "routing": {"modelRoutes": routes},
        }
    )


def targets(cfg, model, draw=0.0):
    return [(t.model, t.backends, t.fallback) for t in route_targets(model, cfg.routing, cfg.backends, draw)]


def test_a_canary_split_holds_its_weights_over_2000_sessions_within_3_points():
    cfg = config(
        [{"model": "chat", "split": [{"backend": "v1", "weight": 95}, {"backend": "v2", "weight": 5}]}]
    )
    rng = random.Random(7)
    sessions = [f"session-{rng.getrandbits(64):x}" for _ in range(2000)]
    chosen = [targets(cfg, "chat", session_draw(s))[0][1] for s in sessions]
    share = chosen.count(("v2",)) / len(chosen)
    assert abs(share - 0.05) <= 0.03, share
    # Sticky: a session always lands on the same side.
    assert all(
        targets(cfg, "chat", session_draw(s))[0][1] == c for s, c in zip(sessions[:200], chosen, strict=False)
    )


def test_a_split_target_names_the_model_its_pods_serve_not_the_alias():
    cfg = config(
        [{"model": "chat", "split": [{"backend": "v1", "weight": 1}, {"backend": "v2", "weight": 1}]}]
    )
    assert targets(cfg, "chat", 0.2) == [("llama", ("v1",), False)]
    assert targets(cfg, "chat", 0.7) == [("llama-next", ("v2",), False)]


def test_zero_weights_take_nothing():
    cfg = config(
        [{"model": "chat", "split": [{"backend": "v1", "weight": 0}, {"backend": "v2", "weight": 2}]}]
    )
    assert {targets(cfg, "chat", d / 100)[0][1] for d in range(100)} == {("v2",)}


def test_fallbacks_follow_their_own_routes_depth_first():
    cfg = config(
        [
            {"model": "chat", "backends": ["v1"], "fallback": ["next", "tiny"]},
            {"model": "next", "backends": ["v2"], "fallback": ["huge"]},
        ]
    )
    assert targets(cfg, "chat") == [
        ("llama", ("v1",), False),
        ("llama-next", ("v2",), True),
        ("huge", ("big",), True),
        ("tiny", ("small",), True),
    ]


def test_a_model_without_a_route_is_served_by_its_backends():
    cfg = config([])
    assert targets(cfg, "tiny") == [("tiny", ("small",), False)]
    assert targets(cfg, "nope") == []


@pytest.mark.parametrize(
    ("routes", "words"),
    [
        (
            [
                {"model": "a", "backends": ["v1"], "fallback": ["b"]},
                {"model": "b", "backends": ["v2"], "fallback": ["a"]},
            ],
            "modelRoutes[b].fallback[0]: 'a' closes a cycle (a -> b -> a)",
        ),
        (
            [{"model": "a", "backends": ["v1"], "fallback": ["a"]}],
            "modelRoutes[a].fallback[0]: 'a' closes a cycle",
        ),
        (
            [
                {"model": "a", "backends": ["v1"], "fallback": ["b"]},
                {"model": "b", "backends": ["v2"], "fallback": ["c"]},
                {"model": "c", "backends": ["small"], "fallback": ["d"]},
                {"model": "d", "backends": ["big"], "fallback": ["tiny"]},
            ],
            "modelRoutes[d].fallback[0]: the chain a -> b -> c -> d -> tiny is longer than 3 hops",
        ),
        (
            [{"model": "a", "split": [{"backend": "v9", "weight": 1}]}],
            "modelRoutes[a].split: unknown backends ['v9']",
        ),
        (
            [{"model": "a", "backends": ["v1"], "fallback": ["ghost"]}],
            "modelRoutes[a].fallback[0]: no backend or route serves 'ghost'",
        ),
        (
            [{"model": "a", "split": [{"backend": "v1", "weight": 0}]}],
            "weights must sum to a positive number",
        ),
        ([{"model": "a", "backends": ["v1"], "split": [{"backend": "v2", "weight": 1}]}], "not both"),
        (
            [{"model": "a", "split": [{"backend": "v1", "weight": 1}, {"backend": "v1", "weight": 2}]}],
            "appears twice",
        ),
        ([{"model": "a", "split": [{"backend": "v1", "weight": -1}]}], "greater than or equal to 0"),
        (
            [{"model": "a", "backends": ["v1"]}, {"model": "a", "backends": ["v2"]}],
            "modelRoutes: a model appears twice",
        ),
    ],
)
def test_bad_routes_are_rejected_naming_the_field(routes, words):
    with pytest.raises((ConfigError, ValueError)) as e:
        config(routes)
    assert words in str(e.value)


def test_split_draws_reach_every_combination_of_sides_along_a_chain():
    cfg = config(
        [
            {
                "model": "chat",
                "split": [{"backend": "v1", "weight": 95}, {"backend": "v2", "weight": 5}],
                "fallback": ["spare"],
            },
            {"model": "spare", "split": [{"backend": "small", "weight": 1}, {"backend": "big", "weight": 1}]},
        ]
    )
    draws = split_draws(cfg.routing)
    reached = {tuple(t[1] for t in targets(cfg, "chat", d)) for d in draws}
    every = {tuple(t[1] for t in targets(cfg, "chat", i / 1000)) for i in range(1000)}
    assert reached == every and len(draws) == 3  # cuts at 0.5 and 0.95
    assert split_draws(config([{"model": "chat", "backends": ["v1"]}]).routing) == (0.5,)
