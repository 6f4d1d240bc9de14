"""Longest cached prefix per endpoint, from events (exact) or from routing history (approximate)."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import block_hashes_for, hash_extra
from tokenfleet.runtime.router.prefix_index import ApproximatePrefixIndex, ExactPrefixIndex

EXTRA = hash_extra("m")
H = block_hashes_for(list(range(80)), 16, EXTRA)  # 5 chained blocks


def test_exact_longest_leading_match():
    idx = ExactPrefixIndex()
    idx.stored("a", H[:4])
    idx.stored("b", H[:2])
    idx.stored("c", H[1:])  # holds later blocks but not the first: unusable
    assert idx.match(H, ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}


def test_removal_cuts_the_chain_and_clear_forgets():
    idx = ExactPrefixIndex()
    idx.stored("a", H)
    idx.removed("a", [H[2]])
    assert idx.match(H, ["a"]) == {"a": 2}
    idx.clear("a")
    assert idx.match(H, ["a"]) == {"a": 0}
    assert idx.num_blocks("a") == 0


def test_replace_is_a_resync():
    idx = ExactPrefixIndex()
    idx.stored("a", H)
    idx.stored("b", H[:1])
    idx.replace("a", H[:3])
    assert idx.match(H, ["a", "b"]) == {"a": 3, "b": 1}
    assert idx.num_blocks("a") == 3


def test_different_salt_never_matches():
    other = block_hashes_for(list(range(80)), 16, hash_extra("m", "tenant-2"))
    idx = ExactPrefixIndex()
    idx.stored("a", H)
    assert idx.match(other, ["a"]) == {"a": 0}


def test_approximate_records_routes_and_evicts_least_recent():
    idx = ApproximatePrefixIndex(capacity_blocks=6)
    idx.record("a", H[:4])
    idx.record("b", H[:2])  # refreshes H0, H1: now the most recent
    assert idx.match(H, ["a", "b"]) == {"a": 4, "b": 2}
    other = block_hashes_for(list(range(100, 164)), 16, EXTRA)
    idx.record("c", other[:3])  # 7 entries > 6: the oldest (H2) goes, cutting a's chain
    assert len(idx) == 6
    assert idx.match(H, ["a", "b"]) == {"a": 2, "b": 2}
    idx.forget("a")
    assert idx.match(H, ["a", "b"]) == {"a": 0, "b": 2}
    idx.forget("c")  # entries held by nobody else go with it; b's shared ones stay
    assert len(idx) == 2 and idx.match(other, ["c"]) == {"c": 0}
    idx.forget("a")  # nothing left of a: a no-op
    assert idx.match(H, ["b"]) == {"b": 2}


def test_recent_routes_bridge_the_event_lag_then_expire():
    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    now = [0.0]
    recent = RecentRoutes(capacity_blocks=100, ttl_s=10.0, clock=lambda: now[0])
    recent.record("pod-a", [b"h0", b"h1", b"h2"])
    assert recent.match([b"h0", b"h1", b"x"], ["pod-a", "pod-b"]) == {"pod-a": 2, "pod-b": 0}
    now[0] = 15.0  # one rotation: still remembered (older generation)
    assert recent.match([b"h0", b"h1"], ["pod-a"]) == {"pod-a": 2}
    recent.record("pod-b", [b"h0"])
    now[0] = 26.0  # second rotation: pod-a's route (recorded at t=0) is gone, pod-b's (t=15) remains
    assert recent.match([b"h0", b"h1"], ["pod-a", "pod-b"]) == {"pod-a": 0, "pod-b": 1}
    now[0] = 60.0  # idle past 2 * ttl: everything expired at once
    assert recent.match([b"h0"], ["pod-b"]) == {"pod-b": 0}
    recent.record("pod-a", [b"h0"])
    recent.forget("pod-a")
    assert recent.match([b"h0"], ["pod-a"]) == {"pod-a": 0}


def test_an_eviction_reported_by_a_pod_ends_its_recent_routes():
    from tokenfleet.runtime.router.prefix_index import ExactPrefixIndex, RecentRoutes

    recent = RecentRoutes(capacity_blocks=100, ttl_s=30.0)
    exact = ExactPrefixIndex(on_removal=recent.forget)
    recent.record("pod-a", [b"r0"])
    recent.record("pod-b", [b"r0"])
    exact.stored("pod-a", [b"e0"])
    assert recent.match([b"r0"], ["pod-a"]) == {"pod-a": 1}  # a store says nothing about other prefixes
    exact.removed("pod-a", [b"e0"])
    assert recent.match([b"r0"], ["pod-a", "pod-b"]) == {"pod-a": 0, "pod-b": 1}


@pytest.mark.parametrize(
    ("num_blocks", "num_endpoints", "keep"),
    [(12, 6, 0.85), (300, 2, 0.995), (300, 40, 0.99)],  # short prompts, and long ones few or many hold
)
def test_match_counts_each_endpoints_leading_run_over_random_holdings(num_blocks, num_endpoints, keep):
    """Against the definition: endpoint e's count is the longest i such that it holds H[0..i-1]."""
    import random

    rng = random.Random(7)
    hashes = block_hashes_for(list(range(16 * num_blocks)), 16, EXTRA)
    endpoints = [f"e{i}" for i in range(num_endpoints)]
    for _ in range(200):
        idx = ExactPrefixIndex()
        held = {e: {h for h in hashes if rng.random() < keep} for e in endpoints}
        for e, blocks in held.items():
            idx.stored(e, blocks)
        expected = {}
        for e in endpoints:
            n = 0
            while n < len(hashes) and hashes[n] in held[e]:
                n += 1
            expected[e] = n
        asked = rng.sample(endpoints, rng.randint(1, len(endpoints)))
        assert idx.match(hashes, asked) == {e: expected[e] for e in asked}
        assert idx.match([], asked) == dict.fromkeys(asked, 0)


def _leading(hashes, held):
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


def test_match_stays_exact_across_many_endpoints_long_prompts_and_churn():
    """More endpoints than a machine word, prompts crossing the match's chunk boundaries, and endpoints that
    leave and come back (their slots reused): every answer agrees with the definition, and a departed
    endpoint's blocks never show up under the endpoint that inherits its slot."""
    import random

    rng = random.Random(11)
    hashes = block_hashes_for(list(range(16 * 700)), 16, EXTRA)
    endpoints = [f"e{i}" for i in range(80)]
    idx = ExactPrefixIndex()
    held: dict[str, set[bytes]] = {e: set() for e in endpoints}
    for step in range(120):
        e = rng.choice(endpoints)
        action = rng.random()
        if action < 0.5:  # a leading run, sometimes with a hole
            blocks = hashes[: rng.randint(0, len(hashes))]
            if blocks and rng.random() < 0.3:
                blocks = [h for h in blocks if h != rng.choice(blocks)]
            idx.stored(e, blocks)
            held[e].update(blocks)
        elif action < 0.8:
            gone = rng.sample(hashes, 30)
            idx.removed(e, gone)
            held[e].difference_update(gone)
        else:
            idx.clear(e)
            held[e] = set()
        asked = [*rng.sample(endpoints, rng.randint(1, len(endpoints))), "never-seen"]
        expected = {a: _leading(hashes, held.get(a, set())) for a in asked}
        assert idx.match(hashes, asked) == expected, step
        assert all(idx.num_blocks(a) == len(held[a]) for a in endpoints)
    for e in endpoints:
        idx.clear(e)
    assert len(idx) == 0  # nothing left behind once every endpoint is gone


def test_approximate_index_agrees_with_an_lru_of_routes():
    import random
    from collections import OrderedDict

    rng = random.Random(5)
    prompts = [block_hashes_for([p] * 16 * 90, 16, EXTRA)[: rng.randint(1, 90)] for p in range(6)]
    endpoints = [f"e{i}" for i in range(70)]
    idx = ApproximatePrefixIndex(capacity_blocks=300)
    lru: OrderedDict[bytes, set[str]] = OrderedDict()
    for _ in range(150):
        e = rng.choice(endpoints)
        if rng.random() < 0.85:
            blocks = rng.choice(prompts)
            idx.record(e, blocks)
            for h in blocks:
                lru.setdefault(h, set()).add(e)
                lru.move_to_end(h)
            while len(lru) > 300:
                lru.popitem(last=False)
        else:
            idx.forget(e)
            for h in [h for h, s in lru.items() if e in s]:
                lru[h].discard(e)
                if not lru[h]:
                    del lru[h]
        assert len(idx) == len(lru)
        target = rng.choice(prompts)
        expected = {a: _leading(target, {h for h, s in lru.items() if a in s}) for a in endpoints}
        assert idx.match(target, endpoints) == expected


def _chained_prompts(rng, n: int) -> list[list[bytes]]:
    """Prompts of chained hashes sharing prefixes at every depth: a few roots, each extended at random."""
    roots = [[rng.randrange(50) for _ in range(16 * rng.randrange(1, 4))] for _ in range(3)]
    prompts = []
    for _ in range(n):
        tokens = rng.choice(roots) + [rng.randrange(50) for _ in range(16 * rng.randrange(0, 6))]
        prompts.append(block_hashes_for(tokens, 16, EXTRA))
    return prompts


def test_recent_routes_match_the_longest_shared_run_of_any_route_there():
    """Against the definition: endpoint e's count is the longest leading run a prompt shares with one of the
    routes recorded for e and not yet expired or forgotten (chained hashes: sharing block i means sharing
    every block before it)."""
    import random

    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    rng = random.Random(11)
    endpoints = ["a", "b", "c"]
    for _ in range(40):
        now = [0.0]
        recent = RecentRoutes(capacity_blocks=10_000, ttl_s=10.0, clock=lambda now=now: now[0])
        routes: list[tuple[float, str, list[bytes]]] = []  # what the definition remembers
        forgotten_at: dict[str, float] = {}
        rotations = [0.0]
        for prompt in _chained_prompts(rng, 30):
            now[0] += rng.choice([0.1, 0.5, 3.0])
            if rng.random() < 0.05:
                e = rng.choice(endpoints)
                recent.forget(e)
                forgotten_at[e] = now[0]
            if rng.random() < 0.6:
                e = rng.choice(endpoints)
                recent.record(e, prompt)
                if now[0] - rotations[-1] >= 10.0:
                    rotations.append(now[0])
                routes.append((now[0], e, prompt))
            got = recent.match(prompt, endpoints)
            if now[0] - rotations[-1] >= 10.0:
                rotations.append(now[0])
            # Alive: recorded in the current generation or the one before it, and after any forget.
            alive_from = (
                rotations[-2] if len(rotations) > 1 and now[0] - rotations[-1] < 10.0 else rotations[-1]
            )
            if len(rotations) > 1 and rotations[-1] - rotations[-2] >= 20.0:
                alive_from = rotations[-1]
            expected = dict.fromkeys(endpoints, 0)
            for t, e, r in routes:
                if t < alive_from or t < forgotten_at.get(e, -1.0):
                    continue
                n = 0
                while n < min(len(r), len(prompt)) and r[n] == prompt[n]:
                    n += 1
                expected[e] = max(expected[e], n)
            assert got == expected


def test_recent_routes_hold_a_route_by_reference_or_a_pointer_per_block_of_its_own():
    """Recording a long prompt costs no index entry per block. A 15k-block route (a 240k-token prompt) under a
    new first block is held by reference: well under a kilobyte. One that branches off it after 10 blocks
    holds a pointer per block of its own part (8 bytes, where one index entry per block took ~150), the
    part it shares being held once, by the path it branches off."""
    import tracemalloc

    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    recent = RecentRoutes(capacity_blocks=1_000_000, ttl_s=30.0)
    long_prompt = [i.to_bytes(32, "little") for i in range(15_000)]
    branch = long_prompt[:10] + [(i + 10**6).to_bytes(32, "little") for i in range(15_000)]
    for name in ("a", "b", "c"):  # each endpoint's first record allocates its slot
        recent.record(name, [name.encode()])
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    recent.record("b", long_prompt)
    by_reference = tracemalloc.get_traced_memory()[0] - base
    recent.record("c", branch)
    own_part = tracemalloc.get_traced_memory()[0] - base - by_reference
    tracemalloc.stop()
    assert by_reference < 1024
    assert own_part < 8 * 15_000 + 1024
    assert recent.match(long_prompt, ["a", "b", "c"]) == {"a": 0, "b": 15_000, "c": 10}
    assert recent.match(branch, ["b", "c"]) == {"b": 10, "c": 15_010}
    assert recent.match([*long_prompt[:7_001], b"x"], ["b"]) == {"b": 7_001}  # a bisected difference
    assert recent.match([*branch[:9_001], b"x"], ["c"]) == {"c": 9_001}  # bisected in a copied part


def test_recent_routes_extend_a_conversation_in_place_and_branch_diverging_ones_at_their_shared_prefix():
    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    recent = RecentRoutes(capacity_blocks=100_000, ttl_s=30.0)
    turns = [block_hashes_for(list(range(16 * k)), 16, EXTRA) for k in range(1, 6)]
    for t in turns:  # each turn extends the last: one edge, holding the longest
        recent.record("a", t)
    recent.record("a", turns[1])  # a prefix of what is held: nothing new
    root = recent._current.root
    (edge,) = root.children.values()
    assert edge.blocks is turns[-1] and edge.node.depth == 5 and edge.node.children is None
    assert recent._current.blocks == 5
    assert recent.match(turns[-1], ["a"]) == {"a": 5}
    assert recent.match(turns[2], ["a"]) == {"a": 3}
    # Diverging prompts after a shared first block, from two pods: every one is kept, as one branch each
    # off the node where they part.
    branches = [block_hashes_for([0] * 16 + [k + 1] * 16, 16, EXTRA) for k in range(40)]
    for k, b in enumerate(branches):
        recent.record("b" if k % 2 else "c", b)
    shared = root.children[branches[0][0]].node
    assert shared.depth == 1 and len(shared.children) == 40
    assert recent.match(branches[0], ["b", "c"]) == {"b": 1, "c": 2}
    assert recent.match(branches[-1], ["b", "c"]) == {"b": 2, "c": 1}
    new = block_hashes_for([0] * 16 + [99] * 16, 16, EXTRA)
    assert recent.match(new, ["a", "b", "c"]) == {"a": 0, "b": 1, "c": 1}
    # A shorter prompt ending inside an edge splits it there; a forgotten pod's branches stop counting.
    recent.record("a", branches[3][:1])
    assert recent.match(branches[3], ["a", "b"]) == {"a": 1, "b": 2}
    recent.forget("b")
    assert recent.match(branches[3], ["a", "b", "c"]) == {"a": 1, "b": 0, "c": 1}
    recent.record("b", branches[5])
    assert recent.match(branches[3], ["b"]) == {"b": 1} and recent.match(branches[5], ["b"]) == {"b": 2}


def test_recent_routes_reuse_a_forgotten_endpoints_bit_once_cleared():
    """A pod that reports an eviction at every poll is forgotten as often: its retired bits are cleared from
    the trie in bulk (and the branches only they reached dropped), so bitsets stay as small as the live
    endpoints, and what each endpoint matches is what it recorded since it was last forgotten."""
    from tokenfleet.runtime.router import prefix_index
    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    recent = RecentRoutes(capacity_blocks=10_000_000, ttl_s=1e9)
    system = block_hashes_for([7] * 32, 16, EXTRA)
    for k in range(500):
        own = block_hashes_for([7] * 32 + [k + 1] * 16, 16, EXTRA)
        recent.record("steady", system)
        recent.record("churning", own)
        assert recent.match(own, ["steady", "churning"]) == {"steady": 2, "churning": 3}
        recent.forget("churning")
        assert recent.match(own, ["steady", "churning"]) == {"steady": 2, "churning": 0}
    generation = recent._current
    assert len(generation.slots.owners) <= prefix_index._COMPACT_AT + 2
    # The branches only cleared bits reached are gone: of 500 sessions' branches off the system prompt, at
    # most those forgotten since the last clearing are left.
    (edge,) = generation.root.children.values()
    assert edge.node.depth == 2 and len(edge.node.children) <= prefix_index._COMPACT_AT + 1


def test_recent_routes_rotate_early_at_capacity():
    from tokenfleet.runtime.router.prefix_index import RecentRoutes

    now = [0.0]
    recent = RecentRoutes(capacity_blocks=8, ttl_s=30.0, clock=lambda: now[0])
    one, two, three, four = (block_hashes_for([k] * 16 * 5, 16, EXTRA) for k in range(4))
    recent.record("a", one)
    recent.record("a", two)  # 10 blocks > 8: this generation becomes the older one
    assert recent.match(one, ["a"]) == {"a": 5} and recent.match(two, ["a"]) == {"a": 5}
    recent.record("a", three)
    recent.record("a", four)  # over again: the generation holding `one` and `two` is dropped
    assert recent.match(one, ["a"]) == {"a": 0} and recent.match(two, ["a"]) == {"a": 0}
    assert recent.match(three, ["a"]) == {"a": 5} and recent.match(four, ["a"]) == {"a": 5}
