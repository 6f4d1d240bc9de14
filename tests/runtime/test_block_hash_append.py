"""`append_block_hashes` (the KV manager's hashing loop) gives byte-identical hashes to `hash_block`:
the router recomputes these from token ids, so a faster loop must never change a hash."""

from __future__ import annotations

import random

import pytest
from tokenfleet.runtime.engine.kv_cache.block_hash import (
    append_block_hashes,
    block_hashes_for,
    encode_extra,
    extend_block_hashes,
    hash_block,
)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_append_block_hashes_matches_hash_block(block_size):
    rng = random.Random(block_size)
    extra = ("model", "salt", 7, None)
    tokens = [rng.randrange(-(2**40), 2**40) for _ in range(block_size * 5 + block_size - 1)]
    expected, parent = [], None
    for i in range(5):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        expected.append(parent)
    out: list[bytes] = []
    append_block_hashes(out, None, tokens[: 5 * block_size], block_size, encode_extra(extra))
    assert out == expected
    assert block_hashes_for(tokens, block_size, extra) == expected  # the trailing partial block is not hashed
    # Continuing from a prefix of the chain hashes only the rest, chained on the last one.
    assert extend_block_hashes(expected[:2], tokens, block_size, extra) == expected
    more: list[bytes] = []
    append_block_hashes(
        more, expected[1], tokens[2 * block_size : 5 * block_size], block_size, encode_extra(extra)
    )
    assert more == expected[2:]
